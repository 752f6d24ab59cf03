"""A CPU decode step against this machine's floor (issue 29): where the time goes, and what merging the LoRA
adapters into rollout-only weights buys.

    python benchmarks/cpu_decode.py      # a few minutes on 2 cores; run it with nothing else on the machine

The embedded default (SmolLM2-135M, fp32, LoRA r=16 on every linear layer, as `setup_reasoning_model` sets it
up on the CPU) decodes 32 tokens for 1 / 4 / 16 rows of the offline dataset's prompts, every row forced to the
full length, three ways, interleaved, median of 3 after a warm-up:

* "branch": the LoRA branch computed beside each base matmul (peft's arithmetic; `grpo_nb.lora.MERGE_ON_CPU=False`),
  through the model's modules;
* "merged, modules": each adapted layer multiplies by a merged copy `W + s * B @ A` made once per rollout, through
  the model's modules (transformers' and peft's; `lean_forward.LEAN_ON_CPU=False`);
* "merged": the same copies through `grpo_nb.rollout.lean_forward` (the default): the decoder's arithmetic as
  straight tensor calls, no module calls per layer;
* "merged bf16": the same, the copies (and the output head's) in bf16, rows cast to them
  (`cpu_rollout_dtype="bfloat16"`);
* "merged bf16, torch products": the same with torch's few-row products only, never grpo-nb's AMX kernel
  (`grpo_nb.kernels.cpu_linear`, offered where the CPU has AMX);
* "merged, SDPA" / "merged bf16, SDPA": "merged" and the previous row with a decode step's attention by torch's
  `scaled_dot_product_attention` instead of grpo-nb's C kernel (`grpo_nb.kernels.cpu_attention`);
* "adapter off": the base model alone (`disable_adapter()`), through lean_forward;
* "plain model": a merged fp32 copy of the whole model as transformers builds it (`merge_and_unload()` of a deep
  copy: no peft layers, no tiled MLP or lean norms, HF's RMSNorm) through its modules: HF's own forward.

A few-row product runs as F.linear or W @ x.T, whichever timed faster in this process (`lora.ProductChoice`); the
choices are in the results.

The floor of a decode step is the larger of the weights read once at the copy bandwidth measured here and the
step's FLOPs at the GEMM rate measured here (`step_time.measure_cpu`, at the start); the copy bandwidth is measured
again before each pass over the arms (the shared host's drifts within a run), and "during the arms" is the floor at
their median. A profile of one 4-row rollout
(torch.profiler, self time per ATen op, and what no op accounts for) says where the rest goes.
Results: results/cpu_decode_cpu.json.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from grpo_nb import arithmetic_dataset, lora, setup_reasoning_model  # noqa: E402
from grpo_nb.kernels import cpu_attention, cpu_linear  # noqa: E402
from grpo_nb.rollout import RolloutEngine, lean_forward  # noqa: E402
from step_time import best, measure_cpu  # noqa: E402

TOKENS, REPEATS = 32, 3
MODES = ("branch", "merged, modules", "merged", "merged, SDPA", "merged bf16", "merged bf16, torch products",
         "merged bf16, SDPA", "adapter off", "plain model")


def decode_ms(model, tok, ids, mask, mode: str, plain=None) -> float:
    """One rollout's decode time per step, in ms."""
    lora.MERGE_ON_CPU = mode != "branch"
    lean_forward.LEAN_ON_CPU = mode not in ("merged, modules", "plain model")
    cpu_attention.ENABLED = not mode.endswith("SDPA")
    cpu_linear.ENABLED = not mode.endswith(("SDPA", "torch products"))
    engine = RolloutEngine(max_completion_length=TOKENS, min_new_tokens=TOKENS,
                           cpu_dtype="bfloat16" if mode.startswith("merged bf16") else None)
    try:
        if mode == "plain model":
            engine(plain, tok, ids, mask, 1)
        elif mode == "adapter off":
            with model.disable_adapter():
                engine(model, tok, ids, mask, 1)
        else:
            engine(model, tok, ids, mask, 1)
    finally:
        lora.MERGE_ON_CPU = lean_forward.LEAN_ON_CPU = cpu_attention.ENABLED = cpu_linear.ENABLED = True
    stats = engine.last_stats
    return stats["decode_s"] / stats["decode_steps"] * 1e3


def copy_bytes_per_s(src=torch.empty(64 * 2**20).normal_(), dst=torch.empty(64 * 2**20)) -> float:
    """The copy bandwidth now (bytes read + written per second): `measure_cpu`'s copy, measured again between the
    arms, since the shared host's bandwidth drifts within a run."""
    return 2 * src.numel() * 4 / best(lambda: dst.copy_(src))


def floor_ms(weight_bytes, params, rows, speeds) -> float:
    """A decode step's floor: the weights read once at the copy bandwidth, or its FLOPs at the GEMM rate. (With the
    weights in bf16 - half the bytes - the compute side stays at fp32's GEMM rate, so it may overstate what bf16
    products need.)"""
    return max(weight_bytes / speeds["copy_bytes_per_s"], 2 * params * rows / speeds["gemm_flops"]) * 1e3


def profile(model, tok, ids, mask) -> list:
    """Self time per ATen op over one merged 4-row rollout, and the rest (Python, modules, the framework)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    engine = RolloutEngine(max_completion_length=TOKENS, min_new_tokens=TOKENS)
    started = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        engine(model, tok, ids, mask, 1)
    wall = time.perf_counter() - started
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    top = [{"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6} for e in ops[:10]]
    inside = sum(e.self_cpu_time_total for e in ops) / 1e6
    return [{"op": "the whole rollout (profiled)", "calls": 0, "self_s": wall},
            {"op": "outside ATen ops (Python, modules, framework)", "calls": 0, "self_s": max(0.0, wall - inside)}] + top


def main():
    load_before = os.getloadavg()[0]
    speeds = measure_cpu()
    model, tok = setup_reasoning_model()
    base = model.get_base_model()
    plain = copy.deepcopy(model).merge_and_unload()
    for module in plain.modules():  # grpo-nb's instance-level forwards (tiled MLP, lean norms): the classes' own
        module.__dict__.pop("forward", None)
    plain.eval()
    # read once per decode step: every linear layer's weight and the LM head (tied to the embeddings here)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for name, m in base.named_modules()
                       if isinstance(m, torch.nn.Linear) and "lora_" not in name)
    params = weight_bytes // 4
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
               for r in arithmetic_dataset(16, seed=0)]
    rows_out = []
    for rows in (1, 4, 16):
        enc = tok(prompts[:rows], return_tensors="pt", padding=True, padding_side="left")
        for mode in MODES:  # warm-up
            decode_ms(model, tok, enc.input_ids, enc.attention_mask, mode, plain)
        times = {mode: [] for mode in MODES}
        copies = []  # the copy bandwidth before each pass over the arms
        for _ in range(REPEATS):
            copies.append(copy_bytes_per_s())
            for mode in MODES:
                times[mode].append(decode_ms(model, tok, enc.input_ids, enc.attention_mask, mode, plain))
        floor = floor_ms(weight_bytes, params, rows, speeds)
        during = floor_ms(weight_bytes, params, rows, {**speeds, "copy_bytes_per_s": statistics.median(copies)})
        row = {"rows": rows, "floor_ms": floor,
               "bf16_weights_floor_ms": floor_ms(weight_bytes // 2, params, rows, speeds), "floor_during_ms": during,
               "copy_bytes_per_s_during": copies,
               **{f"{m}_ms": statistics.median(t) for m, t in times.items()}, "all_ms": times}
        rows_out.append(row)
        print(f"{rows:>2} rows: floor {floor:.1f} ms (during the arms {during:.1f}) | " + " | ".join(
            f"{m} {row[m + '_ms']:.1f} ms ({row[m + '_ms'] / floor:.1f}x)" for m in MODES), flush=True)
    enc = tok(prompts[:4], return_tensors="pt", padding=True, padding_side="left")
    prof = profile(model, tok, enc.input_ids, enc.attention_mask)
    result = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "speeds": speeds, "weight_bytes": weight_bytes, "tokens": TOKENS,
              "load_average_before_after": [load_before, os.getloadavg()[0]], "rows": rows_out,
              "products_chosen": {f"{rows} rows x {list(shape)} {str(dtype).removeprefix('torch.')}": name
                                  for (rows, shape, dtype), name in sorted({**lora._PRODUCTS.chosen,
                                                                            **lora._BF16_PRODUCTS.chosen}.items(),
                                                                           key=str)},
              "profile_merged_4_rows": prof}
    out = ROOT / "benchmarks" / "results" / "cpu_decode_cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n| rows | floor (bf16 weights; during the arms) | " + " | ".join(MODES) + " |\n|---:|---:|"
          + "---:|" * len(MODES))
    for r in rows_out:
        floors = f"{r['floor_ms']:.1f} ms ({r['bf16_weights_floor_ms']:.1f}; {r['floor_during_ms']:.1f})"
        print(f"| {r['rows']} | {floors} | " + " | ".join(
            f"{r[m + '_ms']:.1f} ms ({r[m + '_ms'] / r['floor_ms']:.1f}x)" for m in MODES) + " |")
    print("\nprofile, one merged 4-row rollout:")
    for p in prof:
        print(f"  {p['op']:<50} {p['self_s']:8.3f} s  {p['calls']:>7} calls")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
