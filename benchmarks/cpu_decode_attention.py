"""A CPU decode step's attention: grpo-nb's C kernel (grpo_nb/kernels/cpu_attention.py) against torch's SDPA.

    python benchmarks/cpu_decode_attention.py    # about 20 s on 2 cores, alone (compiles the kernel once first)

At 16 rows a decode step of the embedded default spent ~11.6 ms in `scaled_dot_product_attention` (30 layers, 9 query
heads over 3 KV heads of 64, ~290 cached columns in bf16; benchmarks/profile_cpu.md), where reading the keys and
values once takes ~4.5 ms at this machine's copy bandwidth. Timed here on those shapes, 30 layers' worth, taking
turns: SDPA, the kernel, and the kernel told how many first columns every row shares (`shared`: a prompt prefix the
engine prefilled once - the offline prompts share 191 of ~228 columns - read from one row), with the cache coming
from memory (every layer its own) and from the CPU's caches (one layer's again). Results:
results/cpu_decode_attention_cpu.json.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_few_rows import median_time  # noqa: E402
from grpo_nb.kernels import cpu_attention  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, SHARED = 30, 9, 3, 64, 191  # the embedded default; the offline prompts' prefix


def main():
    started = time.perf_counter()
    assert cpu_attention.available(), cpu_attention.why_not
    build_s = time.perf_counter() - started
    src, dst = torch.randn(64 * 2**20), torch.empty(64 * 2**20)
    copy = 2 * src.numel() * 4 / median_time(lambda: dst.copy_(src))
    results = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "build_and_check_s": build_s, "copy_gb_s": copy / 1e9, "rows": []}
    print(f"built and checked in {build_s:.1f} s (0 when cached); copy {copy / 1e9:.1f} GB/s")
    D = HEAD_DIM
    for rows in (4, 16):
        for S in (64, 290, 1000):
            shared = SHARED if S > SHARED else 0
            for dtype in (torch.bfloat16, torch.float32):
                for cached in (False, True):  # every layer its own cache (memory), or one layer's again
                    count = 1 if cached else LAYERS
                    q = [torch.randn(rows, HEADS, 1, D).to(dtype) for _ in range(count)]
                    k = [torch.randn(rows, KV_HEADS, S + 40, D).to(dtype)[:, :, :S] for _ in range(count)]
                    v = [torch.randn(rows, KV_HEADS, S + 40, D).to(dtype)[:, :, :S] for _ in range(count)]
                    for t in k + v:
                        t[:, :, :shared] = t[:1, :, :shared].clone()  # as the engine repeats a prefilled prefix
                    mask = torch.ones(rows, 1, 1, S, dtype=torch.bool)
                    mask[: rows // 4, ..., shared:shared + 10] = False  # padding after the prefix
                    layer = [i % count for i in range(LAYERS)]
                    ways = {"sdpa": lambda: [F.scaled_dot_product_attention(
                                q[i], k[i], v[i], attn_mask=mask, scale=D**-0.5, enable_gqa=True) for i in layer],
                            "kernel": lambda: [cpu_attention.attention(q[i], k[i], v[i], mask, D**-0.5)
                                               for i in layer],
                            "kernel, shared": lambda: [cpu_attention.attention(q[i], k[i], v[i], mask, D**-0.5,
                                                                               shared) for i in layer]}
                    times = {name: [] for name in ways}
                    for _ in range(3):  # taking turns: a busy moment falls on all of them
                        for name, f in ways.items():
                            f()
                            times[name].append(median_time(f, repeats=5))
                    nbytes = 2 * LAYERS * rows * KV_HEADS * S * D * (2 if dtype == torch.bfloat16 else 4)
                    row = {"rows": rows, "columns": S, "shared": shared, "dtype": str(dtype), "in_cache": cached,
                           "cache_mb": nbytes / 1e6, **{f"{n}_ms": min(t) * 1e3 for n, t in times.items()}}
                    results["rows"].append(row)
                    print(f"{rows:>2} rows x {S:>4} columns ({shared} shared) {str(dtype)[6:]:>8} "
                          f"{'in cache' if cached else 'memory':>8}: " + ", ".join(
                              f"{n} {row[n + '_ms']:6.2f} ms" for n in ways) +
                          f" (keys and values {nbytes / 1e6:.0f} MB: {nbytes / copy * 1e3:.1f} ms at copy speed)")
    out = ROOT / "benchmarks" / "results" / "cpu_decode_attention_cpu.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
