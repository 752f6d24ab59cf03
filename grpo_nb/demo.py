"""The main job: GRPO on the embedded default model and offline arithmetic problems, on the CPU.

`grpo-nb demo` (or `python -m grpo_nb demo`) measures held-out accuracy, trains for a few
minutes with a live progress line, measures again, and writes a reward-curve PNG.
`benchmarks/learning.py` runs the same recipe (`main_job`) over several seeds.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from pathlib import Path

from .arguments import SEED_LIMIT, need_int, refuse
from .atomic_files import expand, folder_problem, open_to_read, regular_file, write_file
from .data import arithmetic_dataset, heldout_split
from .display import plot_reward_curves
from .evaluation import evaluate, paired_test
from .models import setup_reasoning_model
from .rewards import correctness_reward, soft_format_reward, xml_count_reward
from .trainer import train

# Partial-credit format reward first: it gives even a 135M model's first groups reward
# variance; correctness only pays once the format is there.
DEMO_REWARDS = [xml_count_reward, soft_format_reward, correctness_reward]

# The task: generated one-step word problems (grpo_nb.data.arithmetic_dataset's knobs) with one worked
# example in the prompt. With two examples the 135M model already copies the answer tags 60% of the time
# and 10 steps move strict accuracy within noise (52% -> 57%, p = 0.13); with one it starts at 24% format
# and 39% strict, so what GRPO teaches shows: the answer where the reward (and a grader) looks for it.
DEMO_TASK = dict(difficulty="easy", few_shot=1)

DEMO_SETTINGS = dict(
    num_generations=8,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,  # 2 prompts x 8 completions per step
    # Measured here (seed 0, 100 held-out problems, greedy, 10 steps, two-shot prompts): 48 tokens at
    # lr 2.5e-4 taught the format (52% -> 99%) but cost arithmetic (strict 47% -> 42%, lenient 53% -> 43%,
    # p = 0.04); 64 tokens at lr 1e-4 did not (strict 52% -> 57%, lenient 53% -> 57%). One-shot prompts,
    # 64 tokens: lr 1e-4 strict 39% -> 59% (p = 9e-5), lenient 57% -> 61%; lr 2e-4 strict 39% -> 57%,
    # lenient 57% -> 57%. benchmarks/learning.py runs this recipe over seeds.
    max_completion_length=64,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    save_steps=0,
)
DEMO_STEPS = 10
# `grpo-nb demo --long`: the time the faster code saved, spent on steps (6.3-6.9 minutes a seed alone on 2 cores with
# the bf16 rollout copies "auto" picks on a CPU with native bf16, 10.7 in fp32; the old main job took 13).
# benchmarks/learning.py --max-steps 40, seeds 0 / 1 / 2: strict 39 -> 69%, 36 -> 61%, 31 -> 65%; lenient 57 -> 69%
# (p = 0.06), 47 -> 61% (p = 0.02), 45 -> 65% (p = 9e-5). At 10 steps: lenient 57 -> 59, 47 -> 55, 45 -> 52%.
DEMO_LONG_STEPS = 40
CUT_WARNING = r"\d+% of this step's completions hit max_completion_length"  # trainer.warn_once's
DEMO_EVAL_SIZE = 100
MAX_EVAL_SIZE = 10_000


def main_job(output_dir="grpo_nb_demo", *, max_steps: int = DEMO_STEPS, eval_size: int = DEMO_EVAL_SIZE,
             seed: int = 0, verbose: bool = True, settings: dict | None = None) -> dict:
    """The recipe: held-out evaluation, `max_steps` GRPO steps, the same evaluation again. `settings`: train()
    arguments over the recipe's (benchmarks/learning.py's --set: a variant measured on the same recipe).

    Returns {"before", "after": evaluate() results on the same held-out problems, "history",
    "seconds", "output_dir"}; the trained adapter is in output_dir/adapter.
    """
    out = check_demo_arguments(output_dir, max_steps, eval_size, seed)  # before minutes of loading and training
    started = time.time()
    model, tokenizer = setup_reasoning_model(seed=seed)
    train_set = arithmetic_dataset(512, seed=seed, **DEMO_TASK)
    heldout = heldout_split(train_set, arithmetic_dataset(2 * eval_size + 20, seed=seed + 10_000, **DEMO_TASK),
                            eval_size)
    length = DEMO_SETTINGS["max_completion_length"]
    if verbose:
        print(f"Evaluating {eval_size} held-out problems before training...", flush=True)
    before = evaluate(model, tokenizer, heldout, max_completion_length=length)
    if verbose:
        print(f"Training {max_steps} GRPO steps (2 prompts x 8 completions each) on the CPU... (sampled at temperature "
              f"1, many of the untrained model's completions run past {length} tokens at first: expected here, the "
              f"rewards pay only for answers that finish)", flush=True)
    with warnings.catch_warnings():
        # train()'s warning that most of a step's completions hit the cap is this recipe's known state, said above
        # and counted in the summary (sampled_truncation): 30-75% of the samples a step, while greedy answers end in
        # time (10% -> 3% cut). 96 tokens (seed 0 / 1 / 2: strict 39 -> 57%, 36 -> 56%, 31 -> 42%; lenient 57 -> 57%,
        # 46 -> 57%, 46 -> 47%) learned no more than 64 (39 -> 59%, 36 -> 57%, 31 -> 44%; 57 -> 60%, 47 -> 58%,
        # 45 -> 47%), and still cut 63% of seed 2's samples at a step.
        warnings.filterwarnings("ignore", message=CUT_WARNING, category=UserWarning)
        history = train(model, tokenizer, train_set, DEMO_REWARDS, max_steps=max_steps,
                        output_dir=str(out / "adapter"), seed=seed, verbose=verbose, live=False,
                        **{**DEMO_SETTINGS, **(settings or {})})
    after = evaluate(model, tokenizer, heldout, max_completion_length=length)
    return {"before": before, "after": after, "history": history, "seconds": time.time() - started,
            "output_dir": str(out)}


def check_demo_arguments(output_dir, max_steps, eval_size, seed) -> Path:
    """The demo's arguments, checked before any work (the CLI's too); returns the folder to write, made."""
    for name, value, low in (("max_steps", max_steps, 1), ("eval_size", eval_size, 1)):
        need_int("demo", name, value, low)
    need_int("demo", "seed", seed, 0, below=SEED_LIMIT)
    if eval_size > MAX_EVAL_SIZE:  # the held-out set is generated whole, then each problem decoded greedily
        refuse("demo", "eval_size", eval_size, f"at most {MAX_EVAL_SIZE:,} held-out problems (each is decoded twice, "
               f"before and after training; the generator's easy problems hold few more distinct ones)")
    if isinstance(output_dir, bool) or not isinstance(output_dir, (str, os.PathLike)) or not str(output_dir).strip():
        refuse("demo", "output_dir", output_dir, "a folder name, e.g. 'grpo_nb_demo'")
    try:
        out = expand(output_dir)
    except RuntimeError as err:  # '~name/...' for a user this machine does not have
        refuse("demo", "output_dir", str(output_dir), f"a folder, and '~' there names no home folder ({err})")
    check_demo_folder(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # an existing folder may still be read-only (not after the evaluation)
            pass
    except OSError as err:
        raise ValueError(f"demo output_dir={str(out)!r} is invalid: the folder cannot be made or written there "
                         f"({err.strerror}): pass a folder you can write, e.g. --output-dir grpo_nb_demo.") from None
    return out


# What the demo writes in its folder. Its summary.json (which names the demo's adapter and curve) tells a
# folder it wrote; one holding only adapter/ is a demo that stopped in training (train() checks that folder).
DEMO_FILES = ("adapter", "reward_curve.png", "summary.json", "history.json")


def check_demo_folder(out: Path) -> None:
    """`out` is new, empty or a demo's own: the demo replaces its files there (a user's history.json,
    summary.json or reward_curve.png included), so any other folder is refused before any work."""
    if (problem := folder_problem(out)) is not None:
        raise ValueError(f"demo output_dir={str(out)!r} is invalid: {problem}. Pass a new folder, e.g. "
                         f"--output-dir grpo_nb_demo.")
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.is_dir() else []
    if not names or names == ["adapter"] or _demo_summary(out / "summary.json"):
        return
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    raise ValueError(f"demo output_dir={str(out)!r} holds other files ({shown}), and the demo writes "
                     f"{', '.join(DEMO_FILES)} there, replacing any of those names: pass a new folder, e.g. "
                     f"--output-dir grpo_nb_demo (or output_dir= to run_demo / main_job).")


def _demo_summary(path: Path) -> bool:
    """`path` is a summary.json run_demo wrote (it names the demo's adapter and reward curve, and its p-value)."""
    if not regular_file(path):
        return False
    try:
        with open_to_read(path) as f:
            summary = json.loads(f.read(2**20))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(summary, dict) and all(key in summary for key in ("adapter", "reward_curve", "paired_p_strict"))


def summary_lines(before: dict, after: dict, max_completion_length: int, history=()) -> list[str]:
    """Before -> after in words a newcomer reads at a glance, and a warning when answers were cut off; with the
    run's `history`, how many of the sampled completions the cap cut during training."""
    def rate(result, key):
        low, high = result["intervals"][key]
        return f"{result[key]:.0%} ({low:.0%}-{high:.0%})"

    n = after["n"]
    p_strict = paired_test(before["correct"], after["correct"])
    lines = [
        f"Held-out accuracy on {n} problems the model never trained on, greedy, with 95% intervals: "
        f"{rate(before, 'accuracy')} -> {rate(after, 'accuracy')} with the answer in <answer> tags "
        f"(strict, p = {p_strict:.2g} that training changed nothing), "
        f"{rate(before, 'lenient_accuracy')} -> {rate(after, 'lenient_accuracy')} counting the last number "
        f"anywhere (lenient).",
        f"Answer format followed: {before['format_rate']:.0%} -> {after['format_rate']:.0%}; completions cut off "
        f"at {max_completion_length} tokens: {before['truncation_rate']:.0%} -> {after['truncation_rate']:.0%}.",
    ]
    cut = [r["truncated_fraction"] for r in history if isinstance(r.get("truncated_fraction"), float)]
    if cut:
        lines.append(f"Sampled completions (temperature 1) cut at {max_completion_length} tokens during training: "
                     f"{cut[0]:.0%} at step 1, {max(cut):.0%} at most, {cut[-1]:.0%} at the last step.")
    if max(before["truncation_rate"], after["truncation_rate"]) > 0.5:
        lines.append(f"Warning: most completions hit the {max_completion_length}-token cap, so their answers were "
                     f"cut off: raise max_completion_length.")
    return lines


def run_demo(output_dir="grpo_nb_demo", *, max_steps: int = DEMO_STEPS, eval_size: int = DEMO_EVAL_SIZE,
             seed: int = 0) -> dict:
    """Train the embedded default for `max_steps` and print and return a before/after summary."""
    print("Loading the embedded default model (SmolLM2-135M-Instruct; first run converts it, ~30 s)...", flush=True)
    job = main_job(output_dir, max_steps=max_steps, eval_size=eval_size, seed=seed)
    before, after, history, out = job["before"], job["after"], job["history"], Path(job["output_dir"])
    plot_reward_curves(history, out / "reward_curve.png", window=3)
    k = max(1, min(3, len(history) // 3))
    mean = lambda rs: sum(r["reward"] for r in rs) / len(rs)  # noqa: E731
    summary = {
        "steps": len(history),
        "reward_first_steps": mean(history[:k]),
        "reward_last_steps": mean(history[-k:]),
        **{f"heldout_{key}_{when}": result[key] for when, result in (("before", before), ("after", after))
           for key in ("accuracy", "lenient_accuracy", "format_rate", "truncation_rate", "mean_length")},
        "heldout_intervals_before": before["intervals"],
        "heldout_intervals_after": after["intervals"],
        "paired_p_strict": paired_test(before["correct"], after["correct"]),
        "paired_p_lenient": paired_test(before["correct_lenient"], after["correct_lenient"]),
        "eval_size": eval_size,
        "minutes": job["seconds"] / 60,
        "reward_curve": str(out / "reward_curve.png"),
        "adapter": str(out / "adapter"),
    }
    write_file(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=2)))
    write_file(out / "history.json", lambda tmp: tmp.write_text(json.dumps(history, default=float)))
    print(
        f"\nBefore/after ({summary['minutes']:.1f} min)\n"
        f"  mean reward, first {k} vs last {k} steps: {summary['reward_first_steps']:.3f} -> "
        f"{summary['reward_last_steps']:.3f}\n  "
        + "\n  ".join(summary_lines(before, after, DEMO_SETTINGS["max_completion_length"], history))
        + f"\n  reward curve: {summary['reward_curve']}\n  adapter: {summary['adapter']}",
        flush=True,
    )
    return summary
