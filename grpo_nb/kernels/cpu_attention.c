/* Attention for one new token per row on the CPU (a decode step), grouped KV heads; grpo_nb/kernels/cpu_attention.py
   compiles it with the system's C compiler and calls it through ctypes. Per (row, KV head): the scores of the G query
   heads that share the KV head, keys taken in blocks of 16 whose dot products are summed across lanes together;
   exp(score - max) vectorised; the value rows read once for up to 4 heads whose sums stay in registers. All
   arithmetic in fp32 (bf16 widened exactly), the output rounded once to the inputs' dtype. The first `shared`
   columns are the same in every row (a prompt prefix the engine prefilled once and repeated): every row reads them
   from row 0, so they come from memory once a step instead of once per row. Plain C with GCC / clang vector
   extensions: no torch headers, compiled in about a second. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "vector.h"

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

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
#define MAXG 64
#define MAXND 16

/* the probabilities p (H rows, `ps` apart) times the value rows, summed over the columns: H heads at once, their
   sums in registers */
static inline __attribute__((always_inline)) void values(const char* vb, const char* vb0, int64_t shared, const uint8_t* m, int64_t S, const int ND,
    int64_t vss, int bf16, const float* p, int64_t ps, const int H, vf (*acc)[MAXND]) {
  const int64_t size = bf16 ? 2 : 4;
  vf a[4][MAXND];
  for (int h = 0; h < H; h++) for (int c = 0; c < ND; c++) a[h][c] = (vf){0};
  for (int64_t s = 0; s < S; s++) {
    if (m && !m[s]) continue;
    const char* vr = (s < shared ? vb0 : vb) + s * vss * size;
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
    const char* q, const char* kb, const char* vb, const char* kb0, const char* vb0, int64_t shared, const uint8_t* m, char* out, int64_t G, int64_t S, const int ND,
    int64_t kss, int64_t vss, float scale, int bf16, float* scores, vf* scratch) {
  const int64_t size = bf16 ? 2 : 4, D = ND * W;
  /* per thread, on the heap (a thread's stack may be small): the scaled queries, the blocks' partial dot products,
     the heads' value sums */
  vf (*qf)[MAXND] = (vf (*)[MAXND])scratch;
  vf (*part)[W] = (vf (*)[W])(scratch + MAXG * MAXND);
  vf (*acc)[MAXND] = (vf (*)[MAXND])(scratch + MAXG * MAXND + MAXG * W);
  for (int64_t g = 0; g < G; g++) for (int c = 0; c < ND; c++) qf[g][c] = load_row(q + g * D * size, bf16, c) * scale;
  const vf ninf = (vf){0} - INFINITY;
  vf top[MAXG];
  for (int64_t g = 0; g < G; g++) top[g] = ninf;
  int64_t s0 = 0;
  for (; s0 + W <= S; s0 += W) {
    for (int i = 0; i < W; i++) {
      const char* kr = (s0 + i < shared ? kb0 : kb) + (s0 + i) * kss * size;
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
    const char* kr = (s < shared ? kb0 : kb) + s * kss * size;
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
  for (int64_t g0 = 0; g0 < G; g0 += 4) {  /* 4 heads at a time */
    const float* p = scores + g0 * S;
    switch (G - g0 < 4 ? G - g0 : 4) {
      case 4: values(vb, vb0, shared, m, S, ND, vss, bf16, p, S, 4, acc + g0); break;
      case 3: values(vb, vb0, shared, m, S, ND, vss, bf16, p, S, 3, acc + g0); break;
      case 2: values(vb, vb0, shared, m, S, ND, vss, bf16, p, S, 2, acc + g0); break;
      default: values(vb, vb0, shared, m, S, ND, vss, bf16, p, S, 1, acc + g0);
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

/* q [n, H, D] contiguous; k, v [n, KV, S, D] by strides in elements (the last one 1); mask [n, S] by its row stride
   (uint8, nonzero: attend) or NULL; out [n, H, D] contiguous. Returns 0; -1 out of memory; -2 shapes it does not
   take (D not a multiple of 16 or over 256, more than 64 query heads per KV head). */
int decode_attention(const void* q, const void* k, const void* v, const uint8_t* mask, void* out,
                     int64_t n, int64_t H, int64_t KV, int64_t S, int64_t D,
                     int64_t ksn, int64_t ksh, int64_t kss, int64_t vsn, int64_t vsh, int64_t vss, int64_t msn,
                     float scale, int bf16, int threads, int64_t shared) {
  const int64_t G = H / KV, size = bf16 ? 2 : 4;
  if (D % W || D / W > MAXND || G > MAXG) return -2;
  int failed = 0;
  #pragma omp parallel num_threads(threads)
  {
    float* scores = (float*)malloc((size_t)(G * S + W) * sizeof(float));
    void* block = NULL;
    if (posix_memalign(&block, 64, (size_t)(2 * MAXG * MAXND + MAXG * W) * sizeof(vf))) block = NULL;
    vf* scratch = (vf*)block;
    if (!scores || !scratch) failed = 1;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < n * KV; t++) {
      if (!scores || !scratch) continue;
      const int64_t b = t / KV, j = t % KV;
      const char* qp = (const char*)q + (b * H + j * G) * D * size;
      const char* kb = (const char*)k + (b * ksn + j * ksh) * size;
      const char* vb = (const char*)v + (b * vsn + j * vsh) * size;
      const char* kb0 = (const char*)k + j * ksh * size;
      const char* vb0 = (const char*)v + j * vsh * size;
      char* op = (char*)out + (b * H + j * G) * D * size;
      const uint8_t* m = mask ? mask + b * msn : NULL;
      if (D == 64) task(qp, kb, vb, kb0, vb0, shared, m, op, G, S, 4, kss, vss, scale, bf16, scores, scratch);
      else if (D == 128) task(qp, kb, vb, kb0, vb0, shared, m, op, G, S, 8, kss, vss, scale, bf16, scores, scratch);
      else task(qp, kb, vb, kb0, vb0, shared, m, op, G, S, (int)(D / W), kss, vss, scale, bf16, scores, scratch);
    }
    free(scores);
    free(block);
  }
  return failed ? -1 : 0;
}
