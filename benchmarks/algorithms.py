"""GRPO, Dr. GRPO, RLOO and GSPO side by side: the same model, data, seeds, steps and budget.

Each variant trains the embedded SmolLM2-135M-Instruct on the offline arithmetic problems
with the demo's settings (2 prompts x 8 completions of up to 48 tokens per step, LoRA r=16,
lr 2.5e-4) plus `num_iterations=2` (two optimizer steps per generation batch, so that
GSPO's sequence-level ratio differs from the token-level one), in its own fresh process.
Held-out accuracy and format rate (greedy, the same 24 problems) are measured before
training and after steps 5 and 10; the run is split there with a checkpoint and resumed,
which equals an unbroken run bit for bit on the CPU.

What each variant changes (everything else equal):

- grpo:    loss_type="grpo", rewards scaled by each group's std (the original GRPO)
- dr_grpo: loss_type="dr_grpo", scale_rewards="none" (no length or std normalisation)
- rloo:    loss_type="grpo", advantage_estimator="rloo", scale_rewards="none" (leave-one-out baseline)
- gspo:    loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4 (paper)

    python benchmarks/algorithms.py            # about 35 minutes on 2 CPU cores
    python benchmarks/algorithms.py --steps 4  # a quick look

Results: benchmarks/results/algorithms_cpu.json and algorithms_cpu.png (reward curves and
held-out accuracy per variant). Ten steps of a 135M model is a small sample: the figure
shows what each variant changes on this budget, not which is best in general.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "grpo": {"loss_type": "grpo", "scale_rewards": "group"},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none"},
    "rloo": {"loss_type": "grpo", "advantage_estimator": "rloo", "scale_rewards": "none"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
}

WORKER = r"""
import json, sys, tempfile
from grpo_nb import arithmetic_dataset, evaluate, setup_reasoning_model, train
from grpo_nb.demo import DEMO_REWARDS, DEMO_SETTINGS

spec = json.loads(sys.argv[1])
model, tokenizer = setup_reasoning_model(seed=spec["seed"])
heldout = arithmetic_dataset(spec["eval_size"], seed=spec["seed"] + 10_000)
length = DEMO_SETTINGS["max_completion_length"]

def held_out():
    r = evaluate(model, tokenizer, heldout, max_completion_length=length)
    return {"accuracy": r["accuracy"], "format_rate": r["format_rate"]}

result = {"evals": {}}
if spec["variant"] is None:
    result["evals"][0] = held_out()
else:
    settings = {**DEMO_SETTINGS, "num_iterations": 2, "seed": spec["seed"], "save_steps": spec["eval_at"][0],
                "verbose": False, "live": False, **spec["overrides"]}
    data = arithmetic_dataset(512, seed=spec["seed"])
    with tempfile.TemporaryDirectory() as out:
        resume = None
        for stop in spec["eval_at"]:
            history = train(model, tokenizer, data, DEMO_REWARDS, max_steps=stop, output_dir=out,
                            resume_from_checkpoint=resume, **settings)
            result["evals"][stop] = held_out()
            resume = True
    result["history"] = [{k: r[k] for k in ("step", "reward", "reward_std", "loss", "kl", "clip_ratio",
                                            "completion_length_mean", "frac_reward_zero_std", "step_time")}
                         for r in history]
print(json.dumps(result))
"""


def run(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(spec)], capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{spec['variant']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results["variants"].items():
        steps = [h["step"] for h in r["history"]]
        rewards = [h["reward"] for h in r["history"]]
        smooth = [sum(rewards[max(0, i - 2) : i + 1]) / len(rewards[max(0, i - 2) : i + 1]) for i in range(len(rewards))]
        line, = left.plot(steps, smooth, label=name)
        left.plot(steps, rewards, color=line.get_color(), alpha=0.25)
        evals = {0: results["before"], **{int(k): v for k, v in r["evals"].items()}}
        right.plot(sorted(evals), [evals[k]["accuracy"] for k in sorted(evals)], marker="o", label=name,
                   color=line.get_color())
    left.set(title="training reward (mean of 16 completions; line: 3-step mean)", xlabel="step", ylabel="reward")
    right.set(title=f"held-out accuracy ({results['config']['eval_size']} problems, greedy)", xlabel="step",
              ylabel="accuracy", ylim=(0, 1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    if args.steps < 2 or args.steps % 2:
        ap.error("--steps must be even and >= 2: held-out accuracy is measured halfway and at the end")
    eval_at = [args.steps // 2, args.steps]
    base = {"seed": args.seed, "eval_size": args.eval_size, "eval_at": eval_at}
    t0 = time.time()
    results = {"before": run({**base, "variant": None, "overrides": {}})["evals"]["0"], "variants": {}}
    for name in args.variants:
        print(f"{name} ...", flush=True)
        results["variants"][name] = {**run({**base, "variant": name, "overrides": VARIANTS[name]}),
                                     "overrides": VARIANTS[name]}

    import torch
    import transformers

    import grpo_nb
    from grpo_nb.demo import DEMO_SETTINGS

    results["config"] = {"model": "embedded SmolLM2-135M-Instruct, LoRA r=16", "steps": args.steps,
                         "eval_at": eval_at, "eval_size": args.eval_size, "seed": args.seed,
                         "common": {**DEMO_SETTINGS, "num_iterations": 2}}
    results["device"] = f"CPU ({os.cpu_count()} cores)"
    results["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "grpo_nb": grpo_nb.__version__, "python": platform.python_version()}
    results["minutes"] = (time.time() - t0) / 60
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "algorithms_cpu.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "algorithms_cpu.png")

    b = results["before"]
    print("| variant | reward, first 3 steps | reward, last 3 steps | held-out accuracy | held-out format |")
    print("|---|---|---|---|---|")
    for name, r in results["variants"].items():
        h = r["history"]
        first, last = (sum(x["reward"] for x in h[:3]) / 3, sum(x["reward"] for x in h[-3:]) / 3)
        mid, end = r["evals"][str(eval_at[0])], r["evals"][str(eval_at[1])]
        print(f"| {name} | {first:.2f} | {last:.2f} | {b['accuracy']:.0%} -> {mid['accuracy']:.0%} -> "
              f"{end['accuracy']:.0%} | {b['format_rate']:.0%} -> {mid['format_rate']:.0%} -> "
              f"{end['format_rate']:.0%} |")
    print(f"wrote {out / 'algorithms_cpu.json'} and algorithms_cpu.png ({results['minutes']:.0f} min)")


if __name__ == "__main__":
    main()
