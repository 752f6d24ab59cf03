"""The main job: GRPO on the embedded default model and offline arithmetic problems, on the CPU.

`grpo-nb demo` (or `python -m grpo_nb demo`) measures held-out accuracy, trains for a few
minutes with a live progress line, measures again, and writes a reward-curve PNG.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .data import arithmetic_dataset
from .display import plot_reward_curves
from .evaluation import evaluate
from .models import setup_reasoning_model
from .rewards import correctness_reward, soft_format_reward, xml_count_reward
from .trainer import train

# Partial-credit format reward first: it gives even a 135M model's first groups reward
# variance; correctness only pays once the format is there.
DEMO_REWARDS = [xml_count_reward, soft_format_reward, correctness_reward]

DEMO_SETTINGS = dict(
    num_generations=8,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,  # 2 prompts x 8 completions per step
    max_completion_length=48,
    # LoRA on a 135M model with a handful of steps: a large step on purpose. Measured here (seed 0,
    # the native engine's samples): 5e-4 and 2.5e-4 both took the held-out format rate from 54% to 96%,
    # but greedy held-out accuracy fell to 50% at 5e-4 and only to 71% at 2.5e-4.
    learning_rate=2.5e-4,
    lr_scheduler_type="constant",
    save_steps=0,
)


def run_demo(output_dir="grpo_nb_demo", *, max_steps: int = 10, eval_size: int = 24, seed: int = 0) -> dict:
    """Train the embedded default for `max_steps` and return a before/after summary."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print("Loading the embedded default model (SmolLM2-135M-Instruct; first run converts it, ~30 s)...", flush=True)
    model, tokenizer = setup_reasoning_model(seed=seed)
    train_set = arithmetic_dataset(512, seed=seed)
    heldout = arithmetic_dataset(eval_size, seed=seed + 10_000)

    print(f"Evaluating {eval_size} held-out problems before training...", flush=True)
    before = evaluate(model, tokenizer, heldout, max_completion_length=DEMO_SETTINGS["max_completion_length"])
    print(f"Training {max_steps} GRPO steps (2 prompts x 8 completions each) on the CPU...", flush=True)
    history = train(model, tokenizer, train_set, DEMO_REWARDS, max_steps=max_steps, output_dir=str(out / "adapter"),
                    seed=seed, **DEMO_SETTINGS)
    after = evaluate(model, tokenizer, heldout, max_completion_length=DEMO_SETTINGS["max_completion_length"])

    plot_reward_curves(history, out / "reward_curve.png", window=3)
    k = max(1, min(3, len(history) // 3))
    mean = lambda rs: sum(r["reward"] for r in rs) / len(rs)  # noqa: E731
    summary = {
        "steps": len(history),
        "reward_first_steps": mean(history[:k]),
        "reward_last_steps": mean(history[-k:]),
        "heldout_accuracy_before": before["accuracy"],
        "heldout_accuracy_after": after["accuracy"],
        "heldout_format_before": before["format_rate"],
        "heldout_format_after": after["format_rate"],
        "eval_size": eval_size,
        "minutes": (time.time() - t0) / 60,
        "reward_curve": str(out / "reward_curve.png"),
        "adapter": str(out / "adapter"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "history.json").write_text(json.dumps(history, default=float))
    print(
        f"\nBefore/after ({summary['minutes']:.1f} min)\n"
        f"  mean reward, first {k} vs last {k} steps: {summary['reward_first_steps']:.3f} -> "
        f"{summary['reward_last_steps']:.3f}\n"
        f"  held-out format rate ({eval_size} problems): {before['format_rate']:.0%} -> {after['format_rate']:.0%}\n"
        f"  held-out accuracy: {before['accuracy']:.0%} -> {after['accuracy']:.0%}\n"
        f"  reward curve: {summary['reward_curve']}\n  adapter: {summary['adapter']}",
        flush=True,
    )
    return summary
