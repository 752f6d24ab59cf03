"""Rollout throughput: grpo-nb's RolloutEngine vs HF `generate`, same model, prompts and settings, one run.

Both sample `generations` completions per prompt from the same live LoRA model at temperature
1.0, and every completion is forced to exactly `--tokens` tokens (min_new_tokens = max new
tokens), so both produce the same number of tokens and tokens/s compare like for like. The
systems run interleaved, `--repeats` times each after a warm-up call on one prompt, and the
median counts.

CPU (default): the embedded SmolLM2-135M-Instruct, 8 generations x 64 tokens, 2 prompts of 512
tokens (real text from the offline dataset's prompts). Target: the engine >= 1.5x `generate`.

GPU (`--gpu`): a random-weight model with Qwen2.5-1.5B's shapes (grpo_nb.architectures; nothing
is downloaded), bf16, LoRA r=16 on all linear layers as setup_reasoning_model prepares them, 16 prompts of 256 random tokens, 8
generations x 1024 tokens. Target: >= 3x `generate`. For the engine it also reports the share of
the GPU's memory-bandwidth limit reached in decode: per decode step the weights are read once and
the KV cache of every row up to its current length, so bytes/step divided by the measured time
per step, over the card's peak bandwidth (table below; unknown cards report null).

    python benchmarks/rollout.py            # CPU, a few minutes
    python benchmarks/rollout.py --gpu      # one CUDA GPU

Writes benchmarks/results/rollout_<cpu|device>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Peak DRAM bandwidth in bytes/s, from the vendors' data sheets, by a substring of the device name.
PEAK_BANDWIDTH = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
                  ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 864e9), ("L4", 300e9),
                  ("A10G", 600e9), ("T4", 320e9), ("V100", 900e9), ("RTX 4090", 1008e9), ("RTX 3090", 936e9)]


def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH if key in name), None)


def cpu_setup(args):
    import torch

    from grpo_nb import arithmetic_dataset, setup_reasoning_model
    from grpo_nb.models import DEFAULT_MODEL

    model, tok = setup_reasoning_model()
    # Real text: the dataset's chat prompts back to back, each prompt a different 512-token window.
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
             for r in arithmetic_dataset(64, seed=0)]
    stream = tok("".join(texts), add_special_tokens=False)["input_ids"]
    ids = torch.tensor([stream[i * args.prompt_len : (i + 1) * args.prompt_len] for i in range(args.prompts)])
    return model, tok, ids, {"model": DEFAULT_MODEL, "dtype": str(next(model.parameters()).dtype),
                             "lora": "setup_reasoning_model() default"}


def gpu_setup(args):
    import torch

    from step_time_gpu import MODEL, build  # the model as setup_reasoning_model prepares it (grpo-nb's LoRA layers)

    model = build("lora", "cuda").eval()
    # Rollouts on token ids need only the tokenizer's pad and EOS ids (Qwen2.5's).
    tok = SimpleNamespace(eos_token_id=151645, pad_token_id=151643)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150000, (args.prompts, args.prompt_len), generator=g).cuda()
    return model, tok, ids, {"model": f"{MODEL} shapes, random weights", "dtype": str(next(model.parameters()).dtype),
                             "attn_implementation": "sdpa",
                             "lora": "r=16, all-linear, prepared as setup_reasoning_model does"}


def systems(args, cuda):
    from grpo_nb.rollout.engine import RolloutEngine
    from grpo_nb.rollout import HFGenerateRollout

    T = args.tokens
    out = {"hf_generate": HFGenerateRollout(max_completion_length=T, generation_kwargs={"min_new_tokens": T}),
           "engine": RolloutEngine(max_completion_length=T, min_new_tokens=T, seed=0)}
    if "decode" in inspect.signature(RolloutEngine).parameters and cuda:
        out["engine_dynamic_cache"] = RolloutEngine(max_completion_length=T, min_new_tokens=T, seed=0,
                                                    decode="dynamic")
    out["engine_no_prefix_sharing"] = RolloutEngine(max_completion_length=T, min_new_tokens=T, seed=0,
                                                    share_prompt_prefix=False)
    return out


def decode_bandwidth(model, stats, prompt_len, tokens):
    """Bytes a decode step must read (weights once + every row's KV cache so far) per second."""
    import torch

    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * torch.tensor([], dtype=model.dtype).element_size()
    mean_ctx = prompt_len + tokens / 2
    bytes_per_step = weight_bytes + stats["rows"] * mean_ctx * kv_per_token
    seconds_per_step = stats["decode_s"] / max(stats["decode_steps"], 1)
    return bytes_per_step / seconds_per_step, bytes_per_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="Qwen2.5-1.5B-shaped random model on a CUDA GPU")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import peft
    import torch
    import transformers

    if args.gpu and not torch.cuda.is_available():
        print("--gpu needs a CUDA GPU and none is available here. Nothing was measured.")
        return 0
    defaults = dict(prompts=16, prompt_len=256, tokens=1024, repeats=2) if args.gpu else \
        dict(prompts=2, prompt_len=512, tokens=64, repeats=3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    model, tok, ids, model_info = (gpu_setup if args.gpu else cpu_setup)(args)
    device = torch.cuda.get_device_name() if args.gpu else f"CPU ({platform.processor() or platform.machine()}, " \
                                                            f"{torch.get_num_threads()} threads)"
    rollouts = systems(args, args.gpu)
    G, T = args.generations, args.tokens
    n_tokens = args.prompts * G * T
    times = {name: [] for name in rollouts}
    stats = {}

    def call(name, prompt_ids=ids):
        torch.manual_seed(0)
        if args.gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = rollouts[name](model, tok, prompt_ids, torch.ones_like(prompt_ids), G)
        if args.gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        produced = int(out.completion_mask.sum())
        if produced != len(prompt_ids) * G * T:  # forced lengths: both must do exactly the same work
            raise RuntimeError(f"{name} produced {produced} tokens, expected {n_tokens}")
        return seconds

    for name in rollouts:  # warm-up on one prompt: allocator, kernels, code paths
        call(name, ids[:1])
        print(f"warm-up {name} done", flush=True)
    for r in range(args.repeats):
        for name in rollouts:
            times[name].append(call(name))
            if hasattr(rollouts[name], "last_stats"):
                stats[name] = dict(rollouts[name].last_stats)
            print(f"repeat {r} {name}: {times[name][-1]:.2f} s", flush=True)

    base = statistics.median(times["hf_generate"])
    rows = []
    for name in rollouts:
        med = statistics.median(times[name])
        row = {"system": name, "seconds": times[name], "median_seconds": med, "tokens_per_second": n_tokens / med,
               "speedup_vs_hf_generate": base / med}
        if name in stats:
            row["engine_stats"] = stats[name]
            if args.gpu:
                achieved, per_step = decode_bandwidth(model, stats[name], args.prompt_len, T)
                peak = peak_bandwidth(device)
                row.update(decode_bytes_per_step=per_step, decode_bandwidth_bytes_per_s=achieved,
                           decode_bandwidth_fraction=achieved / peak if peak else None)
        rows.append(row)

    results = {
        "benchmark": "rollout", "device": device, "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "config": {**model_info, "prompts": args.prompts, "prompt_len": args.prompt_len, "generations": G,
                   "completion_tokens": T, "forced_length": True, "temperature": 1.0, "repeats": args.repeats,
                   "tokens_per_call": n_tokens},
        "results": rows,
    }
    slug = "cpu" if not args.gpu else re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"rollout_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    print(f"wrote {out}")
    return 0


def markdown(results: dict) -> str:
    c = results["config"]
    lines = [f"Rollout, {results['device']}: {c['model']}, {c['prompts']} prompts x {c['prompt_len']} tokens, "
             f"{c['generations']} generations x {c['completion_tokens']} tokens",
             "", "| system | median s | tokens/s | vs HF generate | decode bandwidth |", "|---|---|---|---|---|"]
    for r in results["results"]:
        bw = r.get("decode_bandwidth_fraction")
        lines.append(f"| {r['system']} | {r['median_seconds']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup_vs_hf_generate']:.2f}x | {'' if bw is None else f'{bw:.0%} of peak'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
