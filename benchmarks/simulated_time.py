"""How long the seeds' steps take on the GPUs people use, grpo-nb and TRL 1.16 side by side, without a GPU.

Each configuration's step (the one `simulated_memory.py` counts) is recorded kernel by kernel on the meta device
and priced on each card by `grpo_nb.simulate.pricing` (a roofline per kernel from `grpo_nb.gpus`' cited rates,
launch costs, grpo-nb's decode step replayed from a CUDA graph, TRL's HF generate launching every kernel). These
are prices from a model, not GPU runs; benchmarks/step_time.py checks the same model against real CPU timings
and benchmarks/step_time_published.py against published GPU figures.

    python benchmarks/simulated_time.py            # about 30 minutes on 2 CPU cores
    python benchmarks/simulated_time.py --quick    # Qwen2.5-1.5B only (minutes)
    python benchmarks/simulated_time.py --within-hour   # Llama-3.1-8B QLoRA on a T4: the longest completion whose
                                                        # step fits and is priced under an hour (about an hour)
    python benchmarks/simulated_time.py --points 20480:2,24576:2  # that question at these lengths and widths
    python benchmarks/simulated_time.py --episodes      # Qwen2.5-1.5B QLoRA on a T4: episodes of 3 turns with tool
                                                        # results vs one turn of the same budget (about an hour;
                                                        # --only "3 turns, 64-token results": that row alone)

Writes benchmarks/results/simulated_time.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN, LLAMA = "Qwen/Qwen2.5-1.5B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"
# cards and the dtype each trains in (no bf16 hardware on a T4); the 8B model is priced on the T4 only
CARDS = {"T4": "fp16", "L4": "bf16", "A100-80GB": "bf16", "H100": "bf16"}
T4_ONLY = {"T4": "fp16"}
BIG = {"A100-80GB": "bf16", "H100": "bf16"}  # the 8B model at 20K tokens: 28-39 GB, for 80 GB cards
CONFIGS = [
    ("Qwen2.5-1.5B QLoRA, 8 x (256 + 1024), micro-batch 8", QWEN,
     dict(max_prompt_length=256, max_completion_length=1024, num_generations=8, per_device_train_batch_size=8,
          load_in_4bit=True), {}, CARDS),
    ("Qwen2.5-1.5B LoRA, 8 x (256 + 1024), micro-batch 8", QWEN,
     dict(max_prompt_length=256, max_completion_length=1024, num_generations=8, per_device_train_batch_size=8), {},
     CARDS),
    ("Llama-3.1-8B QLoRA, 8 x (256 + 4096), micro-batch 1", LLAMA,
     dict(max_prompt_length=256, max_completion_length=4096, num_generations=8, per_device_train_batch_size=1,
          load_in_4bit=True), {}, T4_ONLY),
    ("Llama-3.1-8B QLoRA, 8 x (256 + 4096), micro-batch 1, grpo-nb rollout_max_rows=1", LLAMA,
     dict(max_prompt_length=256, max_completion_length=4096, num_generations=8, per_device_train_batch_size=1,
          load_in_4bit=True), dict(rollout_max_rows=1), T4_ONLY),
    # the memory table's 8B rows (simulated_memory.py), priced on the 80 GB cards they fit
    ("Llama-3.1-8B LoRA, 8 x (256 + 20480), micro-batch 1", LLAMA,
     dict(max_prompt_length=256, max_completion_length=20480, num_generations=8, per_device_train_batch_size=1), {},
     BIG),
    ("Llama-3.1-8B QLoRA, 8 x (256 + 20480), micro-batch 1", LLAMA,
     dict(max_prompt_length=256, max_completion_length=20480, num_generations=8, per_device_train_batch_size=1,
          load_in_4bit=True), {}, BIG),
    ("Llama-3.1-8B QLoRA, 8 x (256 + 20480), micro-batch 1, grpo-nb rollout_max_rows=1", LLAMA,
     dict(max_prompt_length=256, max_completion_length=20480, num_generations=8, per_device_train_batch_size=1,
          load_in_4bit=True), dict(rollout_max_rows=1), BIG),
]
SYSTEM_SETTINGS = {"grpo_nb": dict(gradient_checkpointing="offload"), "trl": dict(gradient_checkpointing=True)}


def main():
    from grpo_nb.gpus import card as gpu_card
    from grpo_nb.simulate import simulate_step

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--within-hour", action="store_true")
    parser.add_argument("--episodes", action="store_true")
    parser.add_argument("--only", default="", help="run the configurations whose name contains this, keep the rest")
    parser.add_argument("--points", default="", help="LENGTH:ROWS,...: --within-hour's question priced at these "
                                                     "completion lengths and rollout widths only (minutes each)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.points:
        return within_hour_points([tuple(int(v) for v in p.split(":")) for p in args.points.split(",")])
    if args.within_hour:
        return within_hour()
    if args.episodes:
        return episodes(args.only)
    out = ROOT / "benchmarks" / "results" / ("simulated_time_quick.json" if args.quick else "simulated_time.json")
    rows = []
    if args.only and out.exists():
        rows = [r for r in json.loads(out.read_text()) if args.only not in r["config"]]
    for name, model, settings, ours_only, cards in CONFIGS:
        if (args.quick and model != QWEN) or args.only not in name:
            continue
        # one simulation per dtype and attention kernels (FlashAttention from compute capability 8.0; a T4 has none)
        groups = {}
        for card, dtype in cards.items():
            groups.setdefault((dtype, gpu_card(card).capability >= (8, 0)), []).append(card)
        for (dtype, _), group in groups.items():
            for system in ("grpo_nb", "trl"):
                if ours_only and system == "trl":
                    continue
                started = time.perf_counter()
                step = simulate_step(model, system=system, dtype=dtype, gpu=group[0], **settings,
                                     **SYSTEM_SETTINGS[system], **(ours_only if system == "grpo_nb" else {}))
                if system == "grpo_nb":
                    floor_bytes = rollout_floor_bytes(model, step, settings)
                for card in group:
                    t = step.time(card)
                    floor = floor_bytes / gpu_card(card).peak["memory"]
                    rows.append({"config": name, "system": system, "card": card, "dtype": dtype,
                                 "rollout_floor_s": floor, "rollout_over_floor": t.rollout / floor,
                                 "step_s": t.total, "rollout_s": t.rollout, "update_s": t.update,
                                 "optimizer_s": t.optimizer, "tokens_per_s": t.tokens_per_second,
                                 "stages_s": {k: v.seconds for k, v in t.stages.items()},
                                 "kernels": {k: v.kernels for k, v in t.stages.items()},
                                 "peak_gb": step.peak / 1e9, "notes": t.notes})
                    print(f"{name} | {system} | {card} {dtype}: step {t.total:.1f} s (rollout {t.rollout:.1f} s, "
                          f"{t.rollout / floor:.1f}x its bandwidth floor {floor:.1f} s, "
                          f"{t.tokens_per_second:,.0f} tokens/s; update {t.update:.1f} s), peak {step.peak / 1e9:.2f} GB "
                          f"[{time.perf_counter() - started:.0f} s]", flush=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print("\n| configuration | card | grpo-nb s/step (rollout + update) | TRL 1.16 s/step (rollout + update) | ratio | "
          "rollout / floor, grpo-nb (TRL) |")
    print("|---|---|---:|---:|---:|---:|")
    by = {(r["config"], r["system"], r["card"]): r for r in rows}
    for (config, system, card), r in by.items():
        if system != "grpo_nb":
            continue
        trl = by.get((config, "trl", card))
        theirs = f"{trl['step_s']:.1f} ({trl['rollout_s']:.1f} + {trl['update_s']:.1f})" if trl else "-"
        ratio = f"{r['step_s'] / trl['step_s']:.2f}x" if trl else "-"
        floors = f"{r['rollout_over_floor']:.1f}x" + (f" ({trl['rollout_over_floor']:.1f}x)" if trl else "") \
            if "rollout_over_floor" in r else "-"
        print(f"| {config} | {card} | {r['step_s']:.1f} ({r['rollout_s']:.1f} + {r['update_s']:.1f}) | {theirs} | {ratio} "
              f"| {floors} |")
    print(f"wrote {out}")


def rollout_floor_bytes(model, step, settings) -> float:
    """What a rollout of `settings` must read at the least (issue 27's floor): every decode step reads the weights
    once - as stored (a QLoRA base 4-bit packed with its scales: the simulated step's base weights), the adapters
    in 16 bits (grpo-nb keeps them in fp32: half its trainable bytes) - and the KV cache so far (16-bit keys and
    values of every row, the prompt and the tokens before it), all rows decoded at once. Over the card's
    datasheet bandwidth, a time no implementation can beat; the prefill (compute-bound) is left out."""
    from grpo_nb.memory.accounting import kv_cache_bytes
    from grpo_nb.memory.estimate import resolve_config

    rows = settings["num_generations"] * settings.get("prompts_per_step", 1)
    prompt, completion = settings["max_prompt_length"], settings["max_completion_length"]
    weights = step.categories["base_weights"] + step.categories["trainable"] // 2
    per_token = kv_cache_bytes(resolve_config(model), rows, 1, 2)
    steps = completion - 1  # the prefill samples the first token
    return steps * weights + per_token * sum(prompt + t for t in range(1, completion))


# The T4 question of issue 27: Llama-3.1-8B QLoRA, 8 generations of a 256-token prompt, micro-batch 1. The planner
# (plan_for_gpu, simulate=True) takes the longest of these lengths that fits the card *and* whose step is priced under
# an hour, choosing the rollout width (all 8 completions at once, 4, 2 or 1) that is fastest among those that fit.
# Longer lengths are left out to save hours of simulation: a decode step costs at least ~22 ms on a T4 (the 4-bit
# weights read once), so one row at a time passes an hour near 8 x 20K tokens, and two rows' KV cache (262 KB per
# token) beside the weights leaves no room for the update much beyond 24K.
WITHIN_HOUR_LENGTHS = (28672, 24576, 20480, 16384, 12288, 8192, 4096)


def within_hour():
    from grpo_nb import plan_for_gpu

    started = time.perf_counter()
    plan = plan_for_gpu("T4", LLAMA, simulate=True, max_step_seconds=3600, max_prompt_length=256,
                        max_completion_length=WITHIN_HOUR_LENGTHS, num_generations=(8,), load_in_4bit=(True,),
                        gradient_checkpointing="offload", per_device_train_batch_size=1)
    print(plan)
    t = plan.time if plan.fits else None
    result = {"question": "Llama-3.1-8B QLoRA on a T4 (fp16, no FlashAttention): the longest completion of 8 whose "
                          "step fits and is priced under 3600 s", "lengths_tried": WITHIN_HOUR_LENGTHS,
              "fits": plan.fits, "settings": plan.settings, "notes": plan.notes,
              "peak_gb": plan.simulated.peak / 1e9 if plan.fits else None,
              "step_s": t.total if t else None, "rollout_s": t.rollout if t else None,
              "update_s": t.update if t else None, "tokens_per_s": t.tokens_per_second if t else None,
              "alternatives": [{"settings": a, "peak_gb": peak / 1e9, "step_s": None if at is None else at.total}
                               for a, peak, at in plan.alternatives],
              "seconds": round(time.perf_counter() - started)}
    out = ROOT / "benchmarks" / "results" / "simulated_time_within_hour.json"
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")


def within_hour_points(points):
    """--within-hour's configuration (Llama-3.1-8B QLoRA, 8 generations of a 256-token prompt, micro-batch 1, a T4
    in fp16) simulated and priced at the given (completion length, rows decoded at once) only: whether each fits
    the planner's T4 budget and how long its step is priced at. Adds them to
    results/simulated_time_within_hour_points.json (a point priced again replaces its old row)."""
    from grpo_nb.planning import GPU_MEMORY_GIB, usable_gpu_bytes
    from grpo_nb.simulate import simulate_step

    out = ROOT / "benchmarks" / "results" / "simulated_time_within_hour_points.json"
    rows = json.loads(out.read_text()) if out.exists() else []
    budget = usable_gpu_bytes(GPU_MEMORY_GIB["T4"])  # what plan_for_gpu("T4") fits a step in
    for length, width in points:
        started = time.perf_counter()
        step = simulate_step(LLAMA, system="grpo_nb", dtype="fp16", gpu="T4", max_prompt_length=256,
                             max_completion_length=length, num_generations=8, per_device_train_batch_size=1,
                             load_in_4bit=True, gradient_checkpointing="offload", rollout_max_rows=width,
                             record_kernels=True)
        t = step.time("T4")
        row = {"max_completion_length": length, "rollout_max_rows": width, "peak_gb": step.peak / 1e9,
               "fits_t4_budget": step.peak <= budget, "t4_budget_gb": budget / 1e9, "step_s": t.total,
               "rollout_s": t.rollout, "update_s": t.update, "under_an_hour": t.total <= 3600,
               "seconds": round(time.perf_counter() - started), "date": time.strftime("%Y-%m-%d")}
        print(row, flush=True)
        rows = [r for r in rows if (r["max_completion_length"], r["rollout_max_rows"]) != (length, width)] + [row]
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out}")


# Issue 28: an agent's step. The same budget of 8 x 1,024 tokens, one turn, or 3 turns with 64-token tool results
# between them (each later turn prefills its result over the episode's growing KV cache, then decodes on it; the
# single turn decodes on a static cache replayed from a CUDA graph); and the 3 turns decoded 2 rows at a time
# (run_episodes then cannot keep the rows on one cache: every turn is a rollout of its own, the conversation so far
# prefilled again).
EPISODES = [("one turn", {}), ("3 turns, 64-token results", dict(tool_turns=3, tool_result_tokens=64)),
            ("3 turns, 64-token results, rollout_max_rows=2",
             dict(tool_turns=3, tool_result_tokens=64, rollout_max_rows=2))]


def episodes(only: str = ""):
    from grpo_nb.simulate import simulate_step

    out = ROOT / "benchmarks" / "results" / "simulated_time_episodes.json"
    config = "Qwen2.5-1.5B QLoRA, T4 fp16, 8 x (256 + 1024), {}"
    kept = {r["config"]: r for r in json.loads(out.read_text())} if only and out.exists() else {}
    rows = []
    for name, extra in EPISODES:
        if only and only != name:  # (--only NAME: the others' rows as they were)
            if config.format(name) in kept:
                rows.append(kept[config.format(name)])
            continue
        started = time.perf_counter()
        step = simulate_step(QWEN, max_prompt_length=256, max_completion_length=1024, num_generations=8,
                             per_device_train_batch_size=8, load_in_4bit=True, gradient_checkpointing="offload",
                             gpu="T4", **extra)
        t = step.time("T4")
        rows.append({"config": config.format(name), "step_s": t.total,
                     "rollout_s": t.rollout, "prefill_s": t.seconds("prefill"), "decode_s": t.seconds("decode"),
                     "update_s": t.update, "sampled_tokens": t.generated_tokens, "tokens_per_s": t.tokens_per_second,
                     "peak_gb": step.peak / 1e9, "rollout_peak_gb": step.phases["rollout"]["peak"] / 1e9,
                     "notes": t.notes, "seconds": round(time.perf_counter() - started)})
        print(f"{name}: step {t.total:.1f} s (rollout {t.rollout:.1f} s = prefill {t.seconds('prefill'):.2f} + decode "
              f"{t.seconds('decode'):.1f}; {t.tokens_per_second:,.0f} sampled tokens/s; update {t.update:.1f} s), peak "
              f"{step.peak / 1e9:.2f} GB [{time.perf_counter() - started:.0f} s]", flush=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
