"""Plain vs offloaded gradient checkpointing on a GPU: step time, peak memory, copy overlap.

A random-weight model with Qwen2.5-1.5B's shapes (from grpo_nb.architectures, nothing is
downloaded), bf16, LoRA r=16 on all linear layers. One step is the decoder stack's forward
(`grpo_nb.logprobs.decoder_hidden_states`) with a plain sum as the loss, and its backward:
the lm_head / log-prob part is the same for both modes, so it is left out. For each
sequence length the same model runs with plain (non-reentrant) checkpointing, then with
offloaded checkpointing; LoRA gradients of the two are compared.

"Overlap" compares the offloaded step's extra time with the time the same device-to-host and
host-to-device copies take when run alone: 1.0 means they were hidden entirely behind compute.

    python benchmarks/offload.py [--batch 8] [--seq 1024 4096] [--steps 3] [--out PATH]

Writes benchmarks/results/offload_<device>.json. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

MODEL = "Qwen/Qwen2.5-1.5B-Instruct"  # shapes from grpo_nb.architectures; nothing is downloaded


def build_model(lora_rank: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_nb.architectures import known_config

    torch.manual_seed(0)
    with torch.device("cuda"):  # initialise the random weights on the GPU: much faster than on the CPU
        model = AutoModelForCausalLM.from_config(known_config(MODEL), dtype=torch.bfloat16)
    model.config.use_cache = False
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    return model


def measure(model, ids, mask, steps: int) -> dict:
    import torch

    from grpo_nb.logprobs import decoder_hidden_states

    def step():
        model.zero_grad(set_to_none=True)
        loss = decoder_hidden_states(model, ids, mask).sum(dtype=torch.float32)
        loss.backward()
        return loss

    step()  # warm-up: kernels, allocator and pinned host blocks
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return {"step_seconds": statistics.median(times), "step_seconds_all": times,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_above_model_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
            "loss": float(loss), "_grads": grads}


def serial_copy_seconds(layers: int, shape, dtype, repeats: int = 3) -> float:
    """Time of the D2H + H2D copies of every layer input, alone on one stream (nothing to overlap)."""
    import torch

    src = torch.empty(shape, dtype=dtype, device="cuda")
    host = [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(layers)]
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for h in host:
            h.copy_(src, non_blocking=True)
        for h in host:
            src.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("benchmarks/offload.py measures CUDA streams and pinned-memory copies: it needs a CUDA GPU, and none is "
              "available here. Nothing was measured.")
        return 0

    import peft
    import transformers

    from grpo_nb.offload import disable_offloaded_checkpointing, enable_offloaded_checkpointing

    device = torch.cuda.get_device_name()
    model = build_model(args.lora_rank)
    from grpo_nb.architectures import KNOWN_ARCHITECTURES

    shapes = KNOWN_ARCHITECTURES[MODEL]
    vocab, layers, hidden = shapes["vocab_size"], shapes["num_hidden_layers"], shapes["hidden_size"]
    results = {
        "benchmark": "offload", "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
        "config": {"model": "Qwen2.5-1.5B shapes, random weights", **shapes, "dtype": "bfloat16",
                   "attn_implementation": model.config._attn_implementation, "lora_rank": args.lora_rank,
                   "lora_targets": "all-linear", "batch": args.batch, "steps": args.steps,
                   "loss": "decoder_hidden_states(...).sum()"},
        "runs": [],
    }
    for seq in args.seq:
        g = torch.Generator().manual_seed(seq)
        ids = torch.randint(0, vocab, (args.batch, seq), generator=g).cuda()
        mask = torch.ones_like(ids)
        row = {"seq": seq, "layer_input_mib": args.batch * seq * hidden * 2 / 2**20}
        for mode in ("plain", "offload"):
            offloader = enable_offloaded_checkpointing(model) if mode == "offload" else None
            try:
                row[mode] = measure(model, ids, mask, args.steps)
            except torch.cuda.OutOfMemoryError as err:
                row[mode] = {"error": f"out of memory: {str(err).splitlines()[0]}"}
            finally:
                if offloader is not None:
                    row.setdefault(mode, {})["offloader"] = offloader.stats()
                    disable_offloaded_checkpointing(model)
                torch.cuda.empty_cache()
            print(seq, mode, {k: v for k, v in row[mode].items() if not k.startswith("_")}, flush=True)
        plain, off = row["plain"], row["offload"]
        if "_grads" in plain and "_grads" in off:
            diffs = [(plain["_grads"][n] - off["_grads"][n]).abs().max().item() for n in plain["_grads"]]
            row["lora_grad_max_abs_diff"] = max(diffs)
            scale = max(plain["_grads"][n].abs().max().item() for n in plain["_grads"])
            row["lora_grad_max_rel_diff"] = max(diffs) / scale if scale else 0.0  # of the largest gradient entry
            row["lora_grads_bitwise_equal"] = all(torch.equal(plain["_grads"][n], off["_grads"][n])
                                                  for n in plain["_grads"])
            row["peak_saved_gib"] = plain["peak_allocated_gib"] - off["peak_allocated_gib"]
            row["time_ratio_offload_over_plain"] = off["step_seconds"] / plain["step_seconds"]
            copies = serial_copy_seconds(layers, (args.batch, seq, hidden), torch.bfloat16)
            extra = off["step_seconds"] - plain["step_seconds"]
            row["serial_copy_seconds"] = copies
            row["offload_extra_seconds"] = extra
            row["overlap"] = max(0.0, 1.0 - extra / copies) if copies > 0 else None
        for mode in ("plain", "offload"):
            row[mode].pop("_grads", None)
        results["runs"].append(row)

    slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    out = Path(args.out or Path(__file__).parent / "results" / f"offload_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["runs"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
