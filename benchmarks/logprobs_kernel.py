"""Per-token log-probs on a GPU: full logits vs the chunked PyTorch reference vs the Triton kernels.

For each path, forward + backward of `(logp * upstream).sum()` with gradients for the hidden
states and the lm_head weight (and, with --frozen-head, for the hidden states only, as with
LoRA): the rise of the CUDA allocator's peak over the inputs, and the median time over
several runs (CUDA events, after warm-up). Also the forward alone under no_grad (the reference
model's log-probs). Default shape: 16K rows through Qwen2.5-1.5B's head, bf16.

    python benchmarks/logprobs_kernel.py [--rows 16384] [--vocab 151936] [--hidden 1536] [--frozen-head]

Writes benchmarks/results/logprobs_kernel_<device>.json and prints a markdown table.
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

PATHS = ("full_logits", "chunked_torch", "triton")


def logprobs_fn(path):
    from grpo_nb.logprobs import selective_logprobs
    import torch

    if path == "full_logits":
        return lambda h, w, t: torch.log_softmax((h @ w.t()).float(), -1).gather(1, t[:, None]).squeeze(1)
    backend = "torch" if path == "chunked_torch" else "triton"
    return lambda h, w, t: selective_logprobs(h, w, t, backend=backend)


def time_ms(fn, warmup, repeats):
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_path(path, h, w, t, upstream, *, w_grad, warmup, repeats, keep):
    import torch

    fn = logprobs_fn(path)
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_(w_grad)

    def step():
        h.grad = w.grad = None
        (fn(h, w, t) * upstream).sum().backward()

    def forward_only():
        with torch.no_grad():
            fn(h, w, t)

    try:
        step()  # compile the kernels, create cuBLAS workspaces
        # Peak of one step (gradients allocated inside it), above the inputs.
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        out = {"peak_extra_mib": round(peak / 2**20, 1),
               "fwd_bwd_ms": round(time_ms(step, warmup, repeats), 2),
               "fwd_no_grad_ms": round(time_ms(forward_only, warmup, repeats), 2)}
        if keep:  # outputs to compare the paths with
            step()
            with torch.no_grad():
                out["_logp"] = fn(h, w, t).float()
            out["_grads"] = (h.grad.float(), None if w.grad is None else w.grad.float())
        return out
    except torch.cuda.OutOfMemoryError:
        return {"oom": True}
    finally:
        h.grad = w.grad = None
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--frozen-head", action="store_true", help="no gradient for the lm_head weight")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/logprobs_kernel.py needs a CUDA GPU (torch.cuda.is_available() is False). "
                 "The kernels' correctness tests run on the CPU: pytest tests/test_logprobs_triton.py")
    try:
        import triton
    except ImportError:
        sys.exit("benchmarks/logprobs_kernel.py needs triton: pip install triton")
    paths = [p for p in args.paths.split(",") if p]
    if unknown := set(paths) - set(PATHS):
        sys.exit(f"unknown --paths {sorted(unknown)}; choose from {PATHS}")

    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(args.rows, args.hidden, device="cuda", generator=g).to(dtype)
    w = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g) * 0.02).to(dtype)
    t = torch.randint(0, args.vocab, (args.rows,), device="cuda", generator=g)
    upstream = torch.randn(args.rows, device="cuda", generator=g)

    device = torch.cuda.get_device_name()
    result = {
        "benchmark": "logprobs_kernel", "device": device, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "config": {"rows": args.rows, "vocab": args.vocab, "hidden": args.hidden, "dtype": args.dtype,
                   "grads": "hidden" if args.frozen_head else "hidden+weight",
                   "warmup": args.warmup, "repeats": args.repeats,
                   "full_logits_fp32_mib": round(args.rows * args.vocab * 4 / 2**20, 1)},
        "paths": {},
    }
    for path in paths:
        print(f"running {path} ...", flush=True)
        result["paths"][path] = bench_path(path, h, w, t, upstream, w_grad=not args.frozen_head,
                                           warmup=args.warmup, repeats=args.repeats,
                                           keep=path in ("chunked_torch", "triton"))

    # Agreement of the Triton kernels with the chunked reference (same dtype, same inputs).
    res = result["paths"]
    if all(p in res and not res[p].get("oom") for p in ("chunked_torch", "triton")):
        ref, ours = res["chunked_torch"], res["triton"]
        agree = {"logp_max_abs_diff": float((ours["_logp"] - ref["_logp"]).abs().max())}
        for name, a, b in zip(("grad_hidden", "grad_weight"), ours["_grads"], ref["_grads"]):
            if a is not None:
                agree[f"{name}_rel_err"] = float((a - b).norm() / b.norm())
        result["triton_vs_chunked"] = agree
    for r in res.values():
        r.pop("_logp", None)
        r.pop("_grads", None)

    full = res.get("full_logits", {})
    print(f"\n{args.rows} rows x {args.vocab} vocab x {args.hidden} hidden, {args.dtype}, "
          f"grads: {result['config']['grads']}, {device}\n")
    print("| path | peak above inputs (MiB) | fwd+bwd (ms) | fwd no_grad (ms) | memory vs full logits |")
    print("|---|---:|---:|---:|---:|")
    for path, r in res.items():
        if r.get("oom"):
            print(f"| {path} | OOM | | | |")
            continue
        ratio = (f"{r['peak_extra_mib'] / full['peak_extra_mib']:.3f}x"
                 if full.get("peak_extra_mib") else "n/a")
        print(f"| {path} | {r['peak_extra_mib']:.1f} | {r['fwd_bwd_ms']:.1f} | {r['fwd_no_grad_ms']:.1f} | {ratio} |")
    if "triton_vs_chunked" in result:
        print(f"\ntriton vs chunked torch: {result['triton_vs_chunked']}")

    slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    out = Path(args.out or Path(__file__).parent / "results" / f"logprobs_kernel_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
