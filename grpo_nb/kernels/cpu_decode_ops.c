/* The small steps between a CPU decode step's products, each one call where the lean forward ran several torch
   ops: at a decode step's 1-16 rows a torch op costs more to dispatch than to compute, and a layer ran ~40 of them.
   The same fp32 arithmetic as the PyTorch each replaces (cpu_decode_ops.py holds it: `reference_*`). Every array
   but the residual stream h is bf16 (`bf16` set: the rollout's bf16 copies, results rounded once to nearest even)
   or fp32, as the products' outputs are. Compiled with -ffp-contract=off: a product and a sum stay two roundings,
   as in torch's ops. One thread: each call's work is a few microseconds. */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "vector.h"

/* h [n, D] fp32 += delta [n, D] (row stride ld; skipped when NULL), then out [n, D] = h * rsqrt(mean(h^2) + eps)
   * w: the residual add before a norm, and the norm's rows in the products' dtype */
int residual_norm(float* h, const void* delta, int64_t ld, const float* w, float eps, void* out, int64_t n,
                  int64_t D, int bf16) {
  for (int64_t r = 0; r < n; r++) {
    float* x = h + r * D;
    if (delta)
      for (int64_t d = 0; d < D; d++) x[d] += load1(delta, r * ld + d, bf16);
    vf acc = {0};
    int64_t d = 0;
    for (; d + W <= D; d += W) { vf v = load_f32(x + d); acc += v * v; }
    float sum = 0;
    for (int i = 0; i < W; i++) sum += acc[i];
    for (; d < D; d++) sum += x[d] * x[d];
    const float scale = 1.0f / sqrtf(sum / (float)D + eps);
    for (d = 0; d + W <= D; d += W) store16(out, r * D + d, load_f32(x + d) * scale * load_f32(w + d), bf16);
    for (; d < D; d++) store1(out, r * D + d, x[d] * scale * w[d], bf16);
  }
  return 0;
}

/* dst[d] = x[d] * c[d] + x[d +- hd / 2] * s[d] for d in [from, to), x's other half `shift` away */
static inline void rotate_part(const void* x, const float* c, const float* s, void* dst, int64_t from, int64_t to,
                               int64_t shift, int bf16) {
  int64_t d = from;
  for (; d + W <= to; d += W) {
    const vf a = load16(x, d, bf16) * load_f32(c + d), b = load16(x, d + shift, bf16) * load_f32(s + d);
    store16(dst, d, a + b, bf16);
  }
  for (; d < to; d++) {
    const float a = load1(x, d, bf16) * c[d], b = load1(x, d + shift, bf16) * s[d];
    store1(dst, d, a + b, bf16);
  }
}

/* one head's rotation, the lean forward's `_rotate`: x * cos + roll(x, hd / 2) * ssin in fp32, ssin being sin with
   its first half negated */
static inline void rotate(const void* x, const float* c, const float* s, void* dst, int64_t hd, int bf16) {
  rotate_part(x, c, s, dst, 0, hd / 2, hd / 2, bf16);
  rotate_part(x, c, s, dst, hd / 2, hd, -(hd / 2), bf16);
}

/* One new token per row: q [n, H hd], k, v [n, KV hd] (row strides lq, lk, lv: views of one fused product's rows,
   or three products); q's heads rotated into q_out [n, H, hd], k's into the cache's new column (k_out + r ks0 +
   j ks1), v's copied into v_out's (r vs0 + j vs1); cos / ssin [n, hd] fp32 (row stride lc) */
int rope_qkv(const void* q, int64_t lq, const void* k, int64_t lk, const void* v, int64_t lv, const float* cos,
             const float* ssin, int64_t lc, void* q_out, void* k_out, int64_t ks0, int64_t ks1, void* v_out,
             int64_t vs0, int64_t vs1, int64_t n, int64_t H, int64_t KV, int64_t hd, int bf16) {
  if (hd % 2) return 1;
  const int64_t size = bf16 ? 2 : 4;
  for (int64_t r = 0; r < n; r++) {
    const float *c = cos + r * lc, *s = ssin + r * lc;
    for (int64_t j = 0; j < H; j++)
      rotate((const char*)q + (r * lq + j * hd) * size, c, s, (char*)q_out + (r * H + j) * hd * size, hd, bf16);
    for (int64_t j = 0; j < KV; j++) {
      rotate((const char*)k + (r * lk + j * hd) * size, c, s, (char*)k_out + (r * ks0 + j * ks1) * size, hd, bf16);
      memcpy((char*)v_out + (r * vs0 + j * vs1) * size, (const char*)v + (r * lv + j * hd) * size, hd * size);
    }
  }
  return 0;
}

/* out [n, I] = silu(gate) * up in fp32, gate and up [n, I] (row strides lg, lu), silu(g) = g / (1 + exp(-g)) as
   torch computes it */
int silu_mul(const void* gate, int64_t lg, const void* up, int64_t lu, void* out, int64_t n, int64_t I, int bf16) {
  for (int64_t r = 0; r < n; r++) {
    int64_t d = 0;
    for (; d + W <= I; d += W) {
      const vf g = load16(gate, r * lg + d, bf16);
      store16(out, r * I + d, g / (1.0f + vexp(-g)) * load16(up, r * lu + d, bf16), bf16);
    }
    for (; d < I; d++) {
      const float g = load1(gate, r * lg + d, bf16);
      store1(out, r * I + d, g / (1.0f + expf(-g)) * load1(up, r * lu + d, bf16), bf16);
    }
  }
  return 0;
}
