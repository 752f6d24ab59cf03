"""A hand-written few-row fp32 product against MKL's, on this CPU (issue 29's lead, measured, not used).

    python benchmarks/cpu_few_rows.py        # about 2 minutes on 2 cores, alone (compiles a small C++ kernel first)

A decode step multiplies 1-16 rows by every weight of the model. MKL's fp32 GEMM streams the weights at 10-16
GB/s there, against ~25 GB/s this machine copies (benchmarks/profile_cpu.md). The kernel below is the plainest
alternative: each block of 4 weight rows is read once, its dot products with every input row accumulated in
registers (GCC's 16-float vectors: AVX-512 where the CPU has it), the blocks spread over the threads by
`at::parallel_for`. It is compiled here with `-march=native` through `torch.utils.cpp_extension` (needs ninja
and a C++ compiler). Measured on the embedded default's layer shapes (30 layers x 7 projections, 425 MB of fp32
weights, streamed from memory as in a decode step): `F.linear`, `W @ x.T` (the two `lora.skinny_linear` chooses
between) and the kernel, taking turns; results/cpu_few_rows_cpu.json.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
typedef float v16 __attribute__((vector_size(64)));
static inline v16 loadu(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }
static inline float hsum(v16 v) { float s = 0; for (int i = 0; i < 16; i++) s += v[i]; return s; }

// out[r0 .. r0 + NR, j0 .. j0 + 4] from 4 weight rows read once
template <int NR>
static void block(const float* W, const float* X, float* O, int64_t K, int64_t N, int64_t j0, int64_t r0) {
  const int64_t K16 = K / 16 * 16;
  v16 acc[4][NR] = {};
  const float* w0 = W + j0 * K;
  for (int64_t k = 0; k < K16; k += 16) {
    v16 wv[4], xv[NR];
    for (int j = 0; j < 4; ++j) wv[j] = loadu(w0 + j * K + k);
    for (int r = 0; r < NR; ++r) xv[r] = loadu(X + (r0 + r) * K + k);
    for (int j = 0; j < 4; ++j) for (int r = 0; r < NR; ++r) acc[j][r] += wv[j] * xv[r];
  }
  for (int j = 0; j < 4; ++j) for (int r = 0; r < NR; ++r) {
    float s = hsum(acc[j][r]);
    for (int64_t k = K16; k < K; ++k) s += w0[j * K + k] * X[(r0 + r) * K + k];
    O[(r0 + r) * N + j0 + j] = s;
  }
}

// x [R, K] @ w[N, K].T -> [R, N], both contiguous fp32
torch::Tensor few_rows(torch::Tensor x, torch::Tensor w) {
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({R, N}, x.options());
  const float* X = x.data_ptr<float>(); const float* W = w.data_ptr<float>(); float* O = out.data_ptr<float>();
  at::parallel_for(0, N / 4, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t r0 = 0;
      for (; r0 + 4 <= R; r0 += 4) block<4>(W, X, O, K, N, b * 4, r0);
      switch (R - r0) {
        case 1: block<1>(W, X, O, K, N, b * 4, r0); break;
        case 2: block<2>(W, X, O, K, N, b * 4, r0); break;
        case 3: block<3>(W, X, O, K, N, b * 4, r0); break;
      }
    }
  });
  for (int64_t j = N / 4 * 4; j < N; ++j)
    for (int64_t r = 0; r < R; ++r) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += W[j * K + k] * X[r * K + k];
      O[r * N + j] = s;
    }
  return out;
}
"""

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o gate up down


def median_time(fn, repeats=9) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main():
    from torch.utils.cpp_extension import load_inline

    started = time.perf_counter()
    kernel = load_inline("grpo_nb_few_rows_bench", cpp_sources=[SOURCE], functions=["few_rows"],
                         extra_cflags=["-O3", "-march=native"])
    compile_s = time.perf_counter() - started
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(30) for n, k in SHAPES]
    nbytes = sum(w.numel() * 4 for w in weights)
    results = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "compile_s": compile_s, "weights_mb": nbytes / 1e6, "rows": []}
    src, dst = torch.randn(64 * 2**20), torch.empty(64 * 2**20)
    copy = 2 * src.numel() * 4 / median_time(lambda: dst.copy_(src))
    results["copy_gb_s"] = copy / 1e9
    print(f"compiled in {compile_s:.0f} s; {nbytes / 1e6:.0f} MB of weights; copy {copy / 1e9:.1f} GB/s "
          f"(floor {nbytes / copy * 1e3:.1f} ms)")
    for rows in (1, 2, 4, 8, 12, 16):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        worst = max(float((kernel.few_rows(xs[w.shape[1]], w) - F.linear(xs[w.shape[1]], w)).abs().max()
                          / F.linear(xs[w.shape[1]], w).abs().max()) for w in weights[:7])
        ways = {"F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
                "W @ x.T": lambda: [(w @ xs[w.shape[1]].t()).t().contiguous() for w in weights],
                "kernel": lambda: [kernel.few_rows(xs[w.shape[1]], w) for w in weights]}
        times = {name: [] for name in ways}
        for _ in range(3):  # taking turns: a busy moment falls on all of them
            for name, fn in ways.items():
                fn()
                times[name].append(median_time(fn, repeats=3))
        row = {"rows": rows, "max_relative_difference": worst, **{f"{n}_ms": min(t) * 1e3 for n, t in times.items()}}
        results["rows"].append(row)
        print(f"{rows:>2} rows: " + ", ".join(f"{n} {row[n + '_ms']:.1f} ms ({nbytes / row[n + '_ms'] / 1e6:.1f} GB/s)"
                                              for n in ways) + f"; largest difference {worst:.1e} of the output")
    out = Path(__file__).parent / "results" / "cpu_few_rows_cpu.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
