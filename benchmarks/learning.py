"""Does the main job teach the task, or only the format? Its recipe over several seeds.

For each seed, `grpo_nb.demo.main_job` (the exact recipe `grpo-nb demo` runs: a fresh embedded
default model, held-out greedy evaluation, GRPO steps, the same evaluation again) gives held-out
accuracy before and after under both scorings - strict (the answer inside <answer> tags, what
`correctness_reward` pays for) and lenient (the last number in the completion) - with 95% Wilson
intervals, and a paired exact McNemar test over the same problems. Writes
benchmarks/results/learning_cpu.json and learning_cpu.png.

    python benchmarks/learning.py                 # 3 seeds, about 10 minutes each on 2 CPU cores
    python benchmarks/learning.py --seeds 0 --max-steps 2 --eval-size 20   # a quick look
    python benchmarks/learning.py --set cpu_rollout_dtype=bfloat16 --set rollout_importance_sampling_correction=true \
        --out benchmarks/results/learning_bf16_rollout_cpu.json          # a variant of the recipe
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import warnings
from pathlib import Path

RATES = ("accuracy", "lenient_accuracy", "format_rate", "truncation_rate")


def run(seeds, max_steps, eval_size, settings=None) -> dict:
    import torch
    import transformers

    from grpo_nb.demo import DEMO_REWARDS, DEMO_SETTINGS, DEMO_TASK, main_job
    from grpo_nb.evaluation import paired_test
    from grpo_nb.reward_contract import reward_func_name

    results = {"benchmark": "learning", "device": f"CPU ({platform.processor() or platform.machine()}), "
                                                   f"{torch.get_num_threads()} threads",
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
               "date": time.strftime("%Y-%m-%d"), "task": DEMO_TASK, "settings": DEMO_SETTINGS,
               "rewards": [reward_func_name(f) for f in DEMO_REWARDS], "max_steps": max_steps,
               "settings_over_the_recipe": settings or {},
               "eval_size": eval_size, "seeds": []}
    for seed in seeds:
        with tempfile.TemporaryDirectory() as out:
            job = main_job(out, max_steps=max_steps, eval_size=eval_size, seed=seed, verbose=False, settings=settings)
        before, after = job["before"], job["after"]
        row = {"seed": seed, "minutes": round(job["seconds"] / 60, 2),
               "reward_per_step": [round(r["reward"], 4) for r in job["history"]],
               "p_strict": paired_test(before["correct"], after["correct"]),
               "p_lenient": paired_test(before["correct_lenient"], after["correct_lenient"])}
        for when, result in (("before", before), ("after", after)):
            row[when] = {**{k: result[k] for k in RATES}, "mean_length": result["mean_length"],
                         "intervals": result["intervals"], "n": result["n"],
                         "examples": result["completions"][:3]}
        results["seeds"].append(row)
        print(f"seed {seed}: strict {before['accuracy']:.0%} -> {after['accuracy']:.0%} (p={row['p_strict']:.2g}), "
              f"lenient {before['lenient_accuracy']:.0%} -> {after['lenient_accuracy']:.0%} "
              f"(p={row['p_lenient']:.2g}), format {before['format_rate']:.0%} -> {after['format_rate']:.0%}, "
              f"cut off {before['truncation_rate']:.0%} -> {after['truncation_rate']:.0%}, "
              f"{row['minutes']:.1f} min", flush=True)
    return results


def plot(results, path) -> None:
    from grpo_nb_widgets.figures import new_figure, save_png

    fig = new_figure((9, 3.6))
    for col, (key, title) in enumerate((("accuracy", "strict accuracy (answer in tags)"),
                                        ("lenient_accuracy", "lenient accuracy (last number)"))):
        ax = fig.add_subplot(1, 2, col + 1)
        for i, row in enumerate(results["seeds"]):
            for j, when in enumerate(("before", "after")):
                value = row[when][key]
                low, high = row[when]["intervals"][key]
                ax.errorbar(i + (j - 0.5) * 0.3, 100 * value, yerr=[[100 * (value - low)], [100 * (high - value)]],
                            fmt="o", color="C0" if when == "before" else "C2", capsize=3,
                            label=when if i == 0 else None)
        ax.set_xticks(range(len(results["seeds"])), [f"seed {r['seed']}" for r in results["seeds"]])
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of held-out problems")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--eval-size", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "learning_cpu.json"))
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a train() setting over the recipe's (VALUE read as JSON, else as text)")
    args = ap.parse_args()
    settings = {}
    for item in args.set:
        name, _, value = item.partition("=")
        try:
            settings[name] = json.loads(value)
        except json.JSONDecodeError:
            settings[name] = value
    warnings.filterwarnings("ignore")
    from grpo_nb.demo import DEMO_EVAL_SIZE, DEMO_STEPS

    results = run(args.seeds, args.max_steps or DEMO_STEPS, args.eval_size or DEMO_EVAL_SIZE, settings)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    plot(results, Path(args.out).with_suffix(".png"))
    print("| seed | strict before -> after (95% CI) | p | lenient before -> after | p | format | cut off |")
    for row in results["seeds"]:
        b, a = row["before"], row["after"]
        ci = lambda r, k: f"{r[k]:.0%} ({r['intervals'][k][0]:.0%}-{r['intervals'][k][1]:.0%})"  # noqa: E731
        print(f"| {row['seed']} | {ci(b, 'accuracy')} -> {ci(a, 'accuracy')} | {row['p_strict']:.2g} | "
              f"{ci(b, 'lenient_accuracy')} -> {ci(a, 'lenient_accuracy')} | {row['p_lenient']:.2g} | "
              f"{b['format_rate']:.0%} -> {a['format_rate']:.0%} | {b['truncation_rate']:.0%} -> "
              f"{a['truncation_rate']:.0%} |")


if __name__ == "__main__":
    main()
