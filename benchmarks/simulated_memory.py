"""The seeds' configurations at full size, grpo-nb and TRL side by side, without a GPU.

Each configuration runs one whole GRPO step of each system - the rollout's KV cache at full
length, the policy update with its optimizer step - on PyTorch's meta device, every allocation
counted (`grpo_nb.simulate.simulate_step`: grpo-nb's own functions for grpo-nb, TRL's
GRPOTrainer methods for TRL). These are simulated allocation peaks on the meta device, not GPU
runs: what `torch.cuda.max_memory_allocated` would report, without the CUDA context, the caching
allocator's fragmentation or library workspaces. The fit searches add the allowance of
`grpo_nb.planning.usable_gpu_bytes` for those (0.6 GiB, then 10% of the rest).

    python benchmarks/simulated_memory.py            # about an hour on 2 CPU cores
    python benchmarks/simulated_memory.py --quick    # the fixed configurations only
    python benchmarks/simulated_memory.py --only Llama-3.1-8B   # rerun those rows, keep the rest

Writes benchmarks/results/simulated_memory.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

GB = 1e9
QWEN, LLAMA = "Qwen/Qwen2.5-1.5B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"

# (name, model, settings): the seeds' shapes. grpo-nb runs with its GPU defaults (offloaded
# checkpointing, the Triton log-prob kernels), TRL with its own (gradient checkpointing, its fused LM head).
CONFIGS = [
    ("Qwen2.5-1.5B LoRA, 8 x (256 + 1024), micro-batch 8", QWEN,
     dict(max_prompt_length=256, max_completion_length=1024, num_generations=8, per_device_train_batch_size=8)),
    ("Qwen2.5-1.5B QLoRA, 8 x (256 + 1024), micro-batch 8", QWEN,
     dict(max_prompt_length=256, max_completion_length=1024, num_generations=8, per_device_train_batch_size=8,
          load_in_4bit=True)),
    ("Llama-3.1-8B LoRA, 8 x (256 + 20480), micro-batch 1", LLAMA,
     dict(max_prompt_length=256, max_completion_length=20480, num_generations=8, per_device_train_batch_size=1)),
    ("Llama-3.1-8B QLoRA, 8 x (256 + 20480), micro-batch 1", LLAMA,
     dict(max_prompt_length=256, max_completion_length=20480, num_generations=8, per_device_train_batch_size=1,
          load_in_4bit=True)),
    # The same step with grpo-nb decoding one completion at a time (the KV cache holds one row; the
    # rollout takes longer). TRL generates its whole generation batch at once: its row is the one above.
    ("Llama-3.1-8B QLoRA, 8 x (256 + 20480), micro-batch 1, grpo-nb rollout_max_rows=1", LLAMA,
     dict(max_prompt_length=256, max_completion_length=20480, num_generations=8, per_device_train_batch_size=1,
          load_in_4bit=True), dict(rollout_max_rows=1)),
]
# Longest completion per card: 8 generations of a 256-token prompt, micro-batches of 1, and for
# grpo-nb completions decoded one at a time (rollout_max_rows=1: the KV cache holds one row; TRL's
# generation batch holds whole groups). Capped by the model's context window. The planner
# (`estimate_vram`, within 1.5% of the simulation at the configurations above) proposes the length;
# simulations then walk from it, 1,024 tokens at a time, to the longest whose simulated peak fits
# (`grpo_nb.planning.simulated_longest_completion`; Llama-3.1-8B at 130K tokens: several minutes a try).
FITS = [("Qwen2.5-1.5B QLoRA", QWEN, dict(load_in_4bit=True), True),
        ("Llama-3.1-8B QLoRA", LLAMA, dict(load_in_4bit=True), True)]
# card -> (GiB, the card whose kernels run, the dtype it trains in): a T4 (sm75) has no FlashAttention and no bf16
CARDS = {"T4 (15 GB)": (15.0, "T4", "fp16"), "A100 / H100 (80 GB)": (80.0, "A100-80GB", "bf16")}
SYSTEM_SETTINGS = {"grpo_nb": dict(gradient_checkpointing="offload"), "trl": dict(gradient_checkpointing=True)}
FIT_SETTINGS = {"grpo_nb": dict(rollout_max_rows=1), "trl": {}}


def summary(step) -> dict:
    return {"peak_bytes": step.peak, "categories": step.categories, "phases": step.phases,
            "host_peak_bytes": step.host_peak, "largest_at_peak": step.largest_at_peak[:10],
            "settings": step.settings, "seconds": round(step.seconds, 1), "notes": step.notes,
            "questions_asked": len(step.questions)}


def versions() -> dict:
    import bitsandbytes
    import peft
    import torch
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "trl": trl.__version__, "bitsandbytes": bitsandbytes.__version__, "python": platform.python_version()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the longest-completion searches")
    ap.add_argument("--fits", action="store_true", help="only the longest-completion searches (with --only: keep the rest)")
    ap.add_argument("--only", default="", help="run the rows whose name contains this, keep the others from --out")
    ap.add_argument("--card", default="", help="with --fits: only the cards whose name contains this, keep the others")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "simulated_memory.json"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from grpo_nb.planning import usable_gpu_bytes
    from grpo_nb.planning import simulated_longest_completion as longest_completion
    from grpo_nb.simulate import simulate_step

    results = {"benchmark": "simulated_memory",
               "what": "simulated allocation peak on the meta device, not a GPU run (grpo_nb.simulate)",
               "device": "meta device standing for a CUDA GPU; run on " + (platform.processor() or "x86_64"),
               "versions": versions(), "date": time.strftime("%Y-%m-%d"), "configs": [], "fits": []}
    kept = json.loads(Path(args.out).read_text()) if (args.only or args.fits) and Path(args.out).exists() else {}
    kept_configs = {row["name"]: row for row in kept.get("configs", [])}
    kept_fits = {(row["name"], row["card"]): row for row in kept.get("fits", [])}
    started = time.perf_counter()
    done = {}  # steps already run, by settings (TRL's rollout_max_rows row is the row above it)
    for row in kept_configs.values():
        for system, extra in SYSTEM_SETTINGS.items():
            extra = {**extra, **row.get("grpo_nb_settings", {})} if system == "grpo_nb" else extra
            done[(system, row["model"], json.dumps({**row["settings"], **extra}, sort_keys=True))] = row[system]
    for name, model, settings, *grpo_extra in CONFIGS:
        if args.only not in name or args.fits:
            if name in kept_configs:
                results["configs"].append(kept_configs[name])
            continue
        row = {"name": name, "model": model, "settings": settings, "grpo_nb_settings": grpo_extra[0] if grpo_extra else {}}
        for system, extra in SYSTEM_SETTINGS.items():
            extra = {**extra, **row["grpo_nb_settings"]} if system == "grpo_nb" else extra
            key = (system, model, json.dumps({**settings, **extra}, sort_keys=True))
            if key not in done:
                done[key] = summary(simulate_step(model, system=system, **settings, **extra))
            row[system] = done[key]
            print(f"{name:<56} {system:<8} peak {row[system]['peak_bytes'] / GB:6.2f} GB  (update "
                  f"{row[system]['phases']['policy update']['peak'] / GB:6.2f}, rollout "
                  f"{row[system]['phases']['rollout']['peak'] / GB:6.2f})  {row[system]['seconds']:5.1f} s", flush=True)
        ours, theirs = row["grpo_nb"], row["trl"]
        weights = ours["categories"]["base_weights"]
        row["ratio_peak"] = round(ours["peak_bytes"] / theirs["peak_bytes"], 3)
        row["ratio_update_above_weights"] = round(
            (ours["phases"]["policy update"]["peak"] - weights) / (theirs["phases"]["policy update"]["peak"] - weights), 3)
        results["configs"].append(row)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")  # as it goes: hours in all
    if not args.quick:
        from grpo_nb.planning import estimated_longest_completion as planned_longest

        for name, model, settings, check in FITS:
            for card, (gib, gpu, dtype) in CARDS.items():
                if args.only not in name or args.card not in card:
                    if (name, card) in kept_fits:
                        results["fits"].append(kept_fits[(name, card)])
                    continue
                row = {"name": name, "card": card, "gib": gib, "gpu": gpu, "dtype": dtype,
                       "usable_bytes": usable_gpu_bytes(gib)}
                for system, extra in SYSTEM_SETTINGS.items():
                    kw = dict(max_prompt_length=256, num_generations=8, per_device_train_batch_size=1, dtype=dtype,
                              **settings, **extra, **FIT_SETTINGS[system])
                    if check:  # the planner's length, then simulations walk to the longest that fits
                        length, step = longest_completion(gib, model, system=system, step=1024, gpu=gpu, **kw)
                        row[system] = {"max_completion_length": length, "settings": kw, "checked_by_simulation": True,
                                       "planner_length": planned_longest(gib, model, system=system, step=1024, **kw)}
                        if step is not None:
                            row[system].update(simulated_peak_bytes=step.peak, categories=step.categories,
                                               seconds=round(step.seconds, 1))
                    else:
                        length = planned_longest(gib, model, system=system, step=1024, **kw)
                        row[system] = {"max_completion_length": length, "settings": kw, "checked_by_simulation": False}
                    peak = row[system].get("simulated_peak_bytes")
                    print(f"longest completion, {name}, {card}, {system}: {length} tokens, "
                          + (f"{peak / GB:.2f} GB simulated" if peak else "the planner's"), flush=True)
                row["ratio"] = round(row["grpo_nb"]["max_completion_length"] / max(1, row["trl"]["max_completion_length"]), 2)
                results["fits"].append(row)
                Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    results["seconds"] = round(time.perf_counter() - started)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(table(results))


def table(results) -> str:
    lines = ["| configuration | TRL peak | grpo-nb peak | ratio | update above weights: TRL / grpo-nb | ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in results["configs"]:
        ours, theirs = row["grpo_nb"], row["trl"]
        w = ours["categories"]["base_weights"]
        lines.append(f"| {row['name']} | {theirs['peak_bytes'] / GB:.2f} GB | {ours['peak_bytes'] / GB:.2f} GB | "
                     f"{row['ratio_peak']:.2f}x | {(theirs['phases']['policy update']['peak'] - w) / GB:.2f} / "
                     f"{(ours['phases']['policy update']['peak'] - w) / GB:.2f} GB | {row['ratio_update_above_weights']:.2f}x |")
    for row in results["fits"]:
        checked = "simulated" if row["grpo_nb"]["checked_by_simulation"] else "planner"
        lines.append(f"| longest completion, {row['name']}, 8 generations, {row['card']} ({checked}) | "
                     f"{row['trl']['max_completion_length']:,} | {row['grpo_nb']['max_completion_length']:,} | "
                     f"{row['ratio']:.2f}x | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
