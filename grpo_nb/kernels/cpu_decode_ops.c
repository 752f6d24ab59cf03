/* The small steps between a CPU decode step's products, each one call where the lean forward ran several torch
   ops: at a decode step's 1-16 rows a torch op costs more to dispatch than to compute, and a layer ran ~40 of them.
   The same fp32 arithmetic as the PyTorch each replaces (cpu_decode_ops.py holds it: `reference_*`), results
   rounded once to bf16 (to nearest even). Compiled with -ffp-contract=off: a product and a sum stay two roundings,
   as in torch's ops. One thread: each call's work is a few microseconds. */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "vector.h"

/* h [n, D] fp32 += delta [n, D] bf16 (row stride ld; skipped when NULL), then out [n, D] bf16 = h * rsqrt(mean(h^2)
   + eps) * w: the residual add before a norm and the norm's rows cast for a bf16 product */
int residual_norm(float* h, const uint16_t* delta, int64_t ld, const float* w, float eps, uint16_t* out, int64_t n,
                  int64_t D) {
  for (int64_t r = 0; r < n; r++) {
    float* x = h + r * D;
    if (delta)
      for (int64_t d = 0; d < D; d++) x[d] += bf16_to_f32(delta[r * ld + d]);
    vf acc = {0};
    int64_t d = 0;
    for (; d + W <= D; d += W) { vf v = load_f32(x + d); acc += v * v; }
    float sum = 0;
    for (int i = 0; i < W; i++) sum += acc[i];
    for (; d < D; d++) sum += x[d] * x[d];
    const float scale = 1.0f / sqrtf(sum / (float)D + eps);
    uint16_t* o = out + r * D;
    for (d = 0; d + W <= D; d += W) store_bf16(o + d, load_f32(x + d) * scale * load_f32(w + d));
    for (; d < D; d++) o[d] = f32_to_bf16(x[d] * scale * w[d]);
  }
  return 0;
}

/* one head's rotation: dst = bf16(x * cos + roll(x, hd / 2) * ssin) in fp32, ssin being sin with its first half
   negated (the lean forward's `_rotate`) */
static inline void rotate(const uint16_t* x, const float* c, const float* s, uint16_t* dst, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; d++) {
    const float a = bf16_to_f32(x[d]) * c[d];
    const float b = bf16_to_f32(x[d < half ? d + half : d - half]) * s[d];
    dst[d] = f32_to_bf16(a + b);
  }
}

/* qkv [n, (H + 2 KV) hd] bf16 (row stride ld), one new token per row: q's H heads rotated into q_out [n, H, hd], k's
   KV heads rotated into the cache's new column (k_out + r ks0 + j ks1), v's copied into v_out's (r vs0 + j vs1);
   cos / ssin [n, hd] fp32 (row stride lc) */
int rope_qkv(const uint16_t* qkv, int64_t ld, const float* cos, const float* ssin, int64_t lc, uint16_t* q_out,
             uint16_t* k_out, int64_t ks0, int64_t ks1, uint16_t* v_out, int64_t vs0, int64_t vs1, int64_t n,
             int64_t H, int64_t KV, int64_t hd) {
  if (hd % 2) return 1;
  for (int64_t r = 0; r < n; r++) {
    const uint16_t* row = qkv + r * ld;
    const float *c = cos + r * lc, *s = ssin + r * lc;
    for (int64_t j = 0; j < H; j++) rotate(row + j * hd, c, s, q_out + (r * H + j) * hd, hd);
    for (int64_t j = 0; j < KV; j++) rotate(row + (H + j) * hd, c, s, k_out + r * ks0 + j * ks1, hd);
    for (int64_t j = 0; j < KV; j++) memcpy(v_out + r * vs0 + j * vs1, row + (H + KV + j) * hd, hd * 2);
  }
  return 0;
}

/* gate_up [n, 2 I] bf16 (row stride ld; gate, then up): out [n, I] bf16 = silu(gate) * up in fp32, silu(g) being
   g / (1 + exp(-g)) as torch computes it */
int silu_mul(const uint16_t* gate_up, int64_t ld, int64_t I, uint16_t* out, int64_t n) {
  for (int64_t r = 0; r < n; r++) {
    const uint16_t *g = gate_up + r * ld, *u = g + I;
    uint16_t* o = out + r * I;
    int64_t d = 0;
    for (; d + W <= I; d += W) {
      vf x = load_bf16(g + d);
      store_bf16(o + d, x / (1.0f + vexp(-x)) * load_bf16(u + d));
    }
    for (; d < I; d++) {
      const float x = bf16_to_f32(g[d]);
      o[d] = f32_to_bf16(x / (1.0f + expf(-x)) * bf16_to_f32(u[d]));
    }
  }
  return 0;
}
