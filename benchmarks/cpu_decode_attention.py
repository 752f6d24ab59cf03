"""Attention for one new token per row (a CPU decode step) in hand-written C against torch's SDPA (issue 29's lead,
measured, not used).

    python benchmarks/cpu_decode_attention.py    # about a minute on 2 cores, alone (compiles a small C file first)

At 16 rows a decode step of the embedded default spends ~11.6 ms in `scaled_dot_product_attention` (30 layers, 9
query heads over 3 KV heads of 64, ~290 cached columns in bf16; benchmarks/profile_cpu.md), where reading the keys
and values once takes ~4.5 ms at this machine's copy bandwidth. The kernel below is the plainest faster
alternative: per (row, KV head), keys in blocks of 16 whose dot products with every query head of the group are
summed across lanes together, a vectorised exp, the value rows read once for up to 4 heads whose sums stay in
registers, all arithmetic in fp32 (bf16 widened exactly), rows spread over OpenMP threads. It is plain C with GCC /
clang vector extensions (no torch headers: compiled in about a second with `cc -O3 -march=native -fopenmp`) and
called through ctypes. Checked against the fp32 formula (`reference`), then timed against SDPA with the cache out of
and in the CPU's caches; results/cpu_decode_attention_cpu.json.
"""

from __future__ import annotations

import ctypes
import json
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));
#define W 16
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

static inline vf load_f32(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf load_bf16(const uint16_t* p) {
  vh h; memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v; memcpy(&v, &u, sizeof v); return v;
}
static inline vf load_row(const char* p, int bf16, int c) {
  return bf16 ? load_bf16((const uint16_t*)p + c * W) : load_f32((const float*)p + c * W);
}
static inline float hsum(vf v) {
  vf h = SHUF(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7); v += h;
  h = SHUF(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11); v += h;
  h = SHUF(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13); v += h;
  return v[0] + v[1];
}
/* r[i] = the sum of p[i]'s lanes, for 16 vectors at once */
static inline vf sums16(const vf* p) {
  vf t[8], u[4], v[2];
  for (int k = 0; k < 8; k++)
    t[k] = SHUF(p[2*k], p[2*k+1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + SHUF(p[2*k], p[2*k+1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; k++)
    u[k] = SHUF(t[2*k], t[2*k+1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + SHUF(t[2*k], t[2*k+1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; k++)
    v[k] = SHUF(u[2*k], u[2*k+1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
         + SHUF(u[2*k], u[2*k+1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUF(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
       + SHUF(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if (isnan(f)) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline vf vexp(vf x) {
  const vf zero = {0};
  vi under = x < zero - 87.3365447504f;
  vf c = (vf)(~under & (vi)x);
  vi over = c > zero + 88.3762626647949f;
  c = (vf)((~over & (vi)c) | (over & (vi)(zero + 88.3762626647949f)));
  vf t = c * 1.44269504088896341f + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  n = n + __builtin_convertvector((vi)(n > t), vf);
  vf r = c - n * 0.693359375f + n * 2.12194440e-4f;
  vf y = 1.9875691500e-4f * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return (vf)(~under & (vi)(y * (vf)bits));
}

#define MAXG 64
#define MAXND 16

/* the probabilities p (H rows, `ps` apart) times the value rows, summed over the columns: H heads at once, their
   sums in registers */
static inline __attribute__((always_inline)) void values(const char* vb, const uint8_t* m, int64_t S, const int ND,
    int64_t vss, int bf16, const float* p, int64_t ps, const int H, vf (*acc)[MAXND]) {
  const int64_t size = bf16 ? 2 : 4;
  vf a[4][MAXND];
  for (int h = 0; h < H; h++) for (int c = 0; c < ND; c++) a[h][c] = (vf){0};
  for (int64_t s = 0; s < S; s++) {
    if (m && !m[s]) continue;
    const char* vr = vb + s * vss * size;
    float w[4];
    for (int h = 0; h < H; h++) w[h] = p[h * ps + s];
    for (int c = 0; c < ND; c++) {
      vf x = load_row(vr, bf16, c);
      for (int h = 0; h < H; h++) a[h][c] += w[h] * x;
    }
  }
  for (int h = 0; h < H; h++) for (int c = 0; c < ND; c++) acc[h][c] = a[h][c];
}

static inline __attribute__((always_inline)) void task(
    const char* q, const char* kb, const char* vb, const uint8_t* m, char* out, int64_t G, int64_t S, const int ND,
    int64_t kss, int64_t vss, float scale, int bf16, float* scores) {
  const int64_t size = bf16 ? 2 : 4, D = ND * W;
  vf qf[MAXG][MAXND] __attribute__((aligned(64)));
  for (int64_t g = 0; g < G; g++) for (int c = 0; c < ND; c++) qf[g][c] = load_row(q + g * D * size, bf16, c) * scale;
  const vf ninf = (vf){0} - INFINITY;
  vf top[MAXG];
  for (int64_t g = 0; g < G; g++) top[g] = ninf;
  int64_t s0 = 0;
  vf part[MAXG][W];
  for (; s0 + W <= S; s0 += W) {
    for (int i = 0; i < W; i++) {
      const char* kr = kb + (s0 + i) * kss * size;
      vf kv[MAXND];
      for (int c = 0; c < ND; c++) kv[c] = load_row(kr, bf16, c);
      for (int64_t g = 0; g < G; g++) {
        vf a = qf[g][0] * kv[0];
        for (int c = 1; c < ND; c++) a += qf[g][c] * kv[c];
        part[g][i] = a;
      }
    }
    vi keep = {0};
    if (m) { for (int i = 0; i < W; i++) keep[i] = m[s0 + i] ? -1 : 0; }
    for (int64_t g = 0; g < G; g++) {
      vf x = sums16(part[g]);
      if (m) x = (vf)((keep & (vi)x) | (~keep & (vi)ninf));
      memcpy(scores + g * S + s0, &x, sizeof x);
      top[g] = (vf)(((vi)(x > top[g]) & (vi)x) | ((vi)(x <= top[g]) & (vi)top[g]));
    }
  }
  float topg[MAXG];
  for (int64_t g = 0; g < G; g++) {
    float t = -INFINITY;
    for (int i = 0; i < W; i++) if (top[g][i] > t) t = top[g][i];
    topg[g] = t;
  }
  for (int64_t s = s0; s < S; s++) {  /* the last S % 16 keys one by one */
    const char* kr = kb + s * kss * size;
    for (int64_t g = 0; g < G; g++) {
      float x = -INFINITY;
      if (!m || m[s]) {
        vf a = qf[g][0] * load_row(kr, bf16, 0);
        for (int c = 1; c < ND; c++) a += qf[g][c] * load_row(kr, bf16, c);
        x = hsum(a);
      }
      scores[g * S + s] = x;
      if (x > topg[g]) topg[g] = x;
    }
  }
  float total[MAXG];
  for (int64_t g = 0; g < G; g++) {
    float* p = scores + g * S;
    vf sum = {0};
    int64_t s = 0;
    for (; s + W <= S; s += W) { vf e = vexp(load_f32(p + s) - topg[g]); memcpy(p + s, &e, sizeof e); sum += e; }
    total[g] = hsum(sum);
    for (; s < S; s++) { p[s] = (m && !m[s]) ? 0.f : expf(p[s] - topg[g]); total[g] += p[s]; }
  }
  vf acc[MAXG][MAXND];
  for (int64_t g0 = 0; g0 < G; g0 += 4) {  /* 4 heads at a time */
    const float* p = scores + g0 * S;
    switch (G - g0 < 4 ? G - g0 : 4) {
      case 4: values(vb, m, S, ND, vss, bf16, p, S, 4, acc + g0); break;
      case 3: values(vb, m, S, ND, vss, bf16, p, S, 3, acc + g0); break;
      case 2: values(vb, m, S, ND, vss, bf16, p, S, 2, acc + g0); break;
      default: values(vb, m, S, ND, vss, bf16, p, S, 1, acc + g0);
    }
  }
  for (int64_t g = 0; g < G; g++) {
    const float inv = 1.f / total[g];
    for (int c = 0; c < ND; c++) {
      vf x = acc[g][c] * inv;
      for (int i = 0; i < W; i++) {
        if (bf16) ((uint16_t*)out)[g * D + c * W + i] = f32_to_bf16(x[i]);
        else ((float*)out)[g * D + c * W + i] = x[i];
      }
    }
  }
}

int decode_attention(const void* q, const void* k, const void* v, const uint8_t* mask, void* out,
                     int64_t n, int64_t H, int64_t KV, int64_t S, int64_t D,
                     int64_t ksn, int64_t ksh, int64_t kss, int64_t vsn, int64_t vsh, int64_t vss, int64_t msn,
                     float scale, int bf16, int threads) {
  const int64_t G = H / KV, size = bf16 ? 2 : 4;
  if (D % W || D / W > MAXND || G > MAXG) return -2;
  int failed = 0;
  #pragma omp parallel num_threads(threads)
  {
    float* scores = (float*)malloc((size_t)(G * S + W) * sizeof(float));
    if (!scores) failed = 1;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < n * KV; t++) {
      if (!scores) continue;
      const int64_t b = t / KV, j = t % KV;
      const char* qp = (const char*)q + (b * H + j * G) * D * size;
      const char* kb = (const char*)k + (b * ksn + j * ksh) * size;
      const char* vb = (const char*)v + (b * vsn + j * vsh) * size;
      char* op = (char*)out + (b * H + j * G) * D * size;
      const uint8_t* m = mask ? mask + b * msn : NULL;
      if (D == 64) task(qp, kb, vb, m, op, G, S, 4, kss, vss, scale, bf16, scores);
      else if (D == 128) task(qp, kb, vb, m, op, G, S, 8, kss, vss, scale, bf16, scores);
      else task(qp, kb, vb, m, op, G, S, (int)(D / W), kss, vss, scale, bf16, scores);
    }
    free(scores);
  }
  return failed ? -1 : 0;
}
"""


def build(folder: str):
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    source, library = Path(folder) / "attention.c", Path(folder) / "attention.so"
    source.write_text(SOURCE)
    subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", str(source), "-o",
                    str(library), "-lm"], check=True)
    fn = ctypes.CDLL(str(library)).decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 5 + [i64] * 12 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def reference(q, k, v, mask, scale):
    """The kernel's arithmetic in PyTorch: q [n, H, 1, D], k / v [n, KV, S, D], mask [n, 1, 1, S] (True: attend)."""
    n, H, _, D = q.shape
    KV = k.shape[1]
    scores = (q.float().view(n, KV, H // KV, D) @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.view(n, 1, 1, -1), float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    return ((p @ v.float()) / p.sum(-1, keepdim=True)).view(n, H, 1, D).to(q.dtype)


def call(fn, q, k, v, mask, scale):
    n, H, _, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    m = None if mask is None else mask.reshape(n, S)
    failed = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if m is None else m.data_ptr(), out.data_ptr(),
                n, H, KV, S, D, *k.stride()[:3], *v.stride()[:3], 0 if m is None else m.stride(0), float(scale),
                int(q.dtype == torch.bfloat16), torch.get_num_threads())
    assert failed == 0, failed
    return out


def median_time(fn, repeats=9) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main():
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        fn = build(folder)
        compile_s = time.perf_counter() - started
        g = torch.Generator().manual_seed(0)
        worst = {}
        for dtype in (torch.float32, torch.bfloat16):  # grouped heads, strided caches, masks, odd lengths, D 64 / 128
            for n, H, KV, S, D in ((3, 6, 2, 37, 64), (2, 4, 4, 5, 128), (4, 9, 3, 290, 64), (2, 14, 2, 300, 64)):
                q = torch.randn(n, H, 1, D, generator=g).to(dtype)
                k, v = (torch.randn(n, KV, S + 3, D, generator=g).to(dtype)[:, :, :S] for _ in range(2))
                mask = torch.rand(n, 1, 1, S, generator=g) < 0.7
                mask[..., -1] = True
                for m in (None, mask):
                    want = reference(q, k, v, m, D**-0.5).float()
                    err = float((call(fn, q, k, v, m, D**-0.5).float() - want).abs().max())
                    worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
        assert worst["torch.float32"] < 1e-5 and worst["torch.bfloat16"] < 8e-3, worst  # bf16: one output rounding
        src, dst = torch.randn(64 * 2**20), torch.empty(64 * 2**20)
        copy = 2 * src.numel() * 4 / median_time(lambda: dst.copy_(src))
        results = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                   "torch": torch.__version__, "compile_s": compile_s, "copy_gb_s": copy / 1e9,
                   "largest_difference_from_reference": worst, "rows": []}
        print(f"compiled in {compile_s:.1f} s; copy {copy / 1e9:.1f} GB/s; largest difference {worst}")
        layers, H, KV, D = 30, 9, 3, 64  # the embedded default's attention
        for rows in (4, 16):
            for S in (64, 290, 1000):
                for dtype in (torch.bfloat16, torch.float32):
                    for cached in (False, True):  # every layer its own cache (memory), or one layer's again
                        count = 1 if cached else layers
                        q = [torch.randn(rows, H, 1, D).to(dtype) for _ in range(count)]
                        k = [torch.randn(rows, KV, S + 40, D).to(dtype)[:, :, :S] for _ in range(count)]
                        v = [torch.randn(rows, KV, S + 40, D).to(dtype)[:, :, :S] for _ in range(count)]
                        mask = torch.ones(rows, 1, 1, S, dtype=torch.bool)
                        mask[: rows // 4, ..., :10] = False  # left padding
                        ways = {"sdpa": lambda: [F.scaled_dot_product_attention(
                                    q[i % count], k[i % count], v[i % count], attn_mask=mask, scale=D**-0.5,
                                    enable_gqa=True) for i in range(layers)],
                                "kernel": lambda: [call(fn, q[i % count], k[i % count], v[i % count], mask, D**-0.5)
                                                   for i in range(layers)]}
                        times = {name: [] for name in ways}
                        for _ in range(3):  # taking turns
                            for name, f in ways.items():
                                f()
                                times[name].append(median_time(f, repeats=5))
                        nbytes = 2 * layers * rows * KV * S * D * (2 if dtype == torch.bfloat16 else 4)
                        row = {"rows": rows, "columns": S, "dtype": str(dtype), "in_cache": cached,
                               "cache_mb": nbytes / 1e6, **{f"{n}_ms": min(t) * 1e3 for n, t in times.items()}}
                        results["rows"].append(row)
                        print(f"{rows:>2} rows x {S:>4} columns {str(dtype)[6:]:>8} {'in cache' if cached else 'memory':>8}"
                              f": sdpa {row['sdpa_ms']:6.2f} ms, kernel {row['kernel_ms']:6.2f} ms "
                              f"(keys and values {nbytes / 1e6:.0f} MB: {nbytes / copy * 1e3:.1f} ms at copy speed)")
    out = Path(__file__).parent / "results" / "cpu_decode_attention_cpu.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
