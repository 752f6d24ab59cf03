"""The seeds' configurations at full size, grpo-nb and TRL side by side, without a GPU.

Each configuration runs one whole GRPO step of each system - the rollout's KV cache at full
length, the policy update with its optimizer step - on PyTorch's meta device, every allocation
counted (`grpo_nb.simulate.simulate_step`: grpo-nb's own functions for grpo-nb, TRL's
GRPOTrainer methods for TRL). These are simulated allocation peaks on the meta device, not GPU
runs: what `torch.cuda.max_memory_allocated` would report, without the CUDA context, the caching
allocator's fragmentation or library workspaces. The fit searches add the allowance of
`grpo_nb.memory.usable_gpu_bytes` for those (0.6 GiB, then 10% of the rest).

    python benchmarks/simulated_memory.py            # about 10 minutes on 2 CPU cores
    python benchmarks/simulated_memory.py --quick    # the fixed configurations only

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
]
# Longest completion per card: 8 generations of a 256-token prompt, micro-batches of 1.
FITS = [("Qwen2.5-1.5B QLoRA", QWEN, dict(load_in_4bit=True)), ("Llama-3.1-8B QLoRA", LLAMA, dict(load_in_4bit=True))]
CARDS = {"T4 (15 GB)": 15.0, "A100 / H100 (80 GB)": 80.0}
SYSTEM_SETTINGS = {"grpo_nb": dict(gradient_checkpointing="offload"), "trl": dict(gradient_checkpointing=True)}


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
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "simulated_memory.json"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from grpo_nb.memory import usable_gpu_bytes
    from grpo_nb.simulate import longest_completion, simulate_step

    results = {"benchmark": "simulated_memory",
               "what": "simulated allocation peak on the meta device, not a GPU run (grpo_nb.simulate)",
               "device": "meta device standing for a CUDA GPU; run on " + (platform.processor() or "x86_64"),
               "versions": versions(), "date": time.strftime("%Y-%m-%d"), "configs": [], "fits": []}
    started = time.perf_counter()
    for name, model, settings in CONFIGS:
        row = {"name": name, "model": model, "settings": settings}
        for system, extra in SYSTEM_SETTINGS.items():
            step = simulate_step(model, system=system, **settings, **extra)
            row[system] = summary(step)
            print(f"{name:<56} {system:<8} peak {step.peak / GB:6.2f} GB  (update "
                  f"{step.phases['policy update']['peak'] / GB:6.2f}, rollout {step.phases['rollout']['peak'] / GB:6.2f})"
                  f"  {step.seconds:5.1f} s", flush=True)
        ours, theirs = row["grpo_nb"], row["trl"]
        weights = ours["categories"]["base_weights"]
        row["ratio_peak"] = round(ours["peak_bytes"] / theirs["peak_bytes"], 3)
        row["ratio_update_above_weights"] = round(
            (ours["phases"]["policy update"]["peak"] - weights) / (theirs["phases"]["policy update"]["peak"] - weights), 3)
        results["configs"].append(row)
    if not args.quick:
        for name, model, settings in FITS:
            for card, gib in CARDS.items():
                row = {"name": name, "card": card, "gib": gib, "usable_bytes": usable_gpu_bytes(gib)}
                for system, extra in SYSTEM_SETTINGS.items():
                    length, step = longest_completion(gib, model, system=system, max_prompt_length=256,
                                                      num_generations=8, per_device_train_batch_size=1,
                                                      rollout=True, **settings, **extra)
                    row[system] = {"max_completion_length": length, "peak_bytes": step.peak if step else None}
                    print(f"longest completion, {name}, {card}, {system}: {length} tokens", flush=True)
                row["ratio"] = round(row["grpo_nb"]["max_completion_length"] / max(1, row["trl"]["max_completion_length"]), 2)
                results["fits"].append(row)
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
        lines.append(f"| longest completion, {row['name']}, 8 generations, {row['card']} | "
                     f"{row['trl']['max_completion_length']:,} | {row['grpo_nb']['max_completion_length']:,} | "
                     f"{row['ratio']:.2f}x | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
