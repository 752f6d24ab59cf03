/* Vector helpers shared by grpo-nb's CPU kernels (cpu_attention.c, cpu_decode_ops.c): 16 fp32 lanes with GCC /
   clang vector extensions (AVX-512 where the CPU has it, pairs of narrower registers elsewhere), bf16 <-> fp32, and a
   vectorised exp. Plain C: no torch headers. */
#ifndef GRPO_NB_VECTOR_H
#define GRPO_NB_VECTOR_H
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));
#define W 16
static inline vf load_f32(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf load_bf16(const uint16_t* p) {
  vh h; memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v; memcpy(&v, &u, sizeof v); return v;
}
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if (isnan(f)) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* 16 lanes rounded to bf16 (to nearest even; NaN stays NaN) */
static inline void store_bf16(uint16_t* p, vf x) {
  vu u; memcpy(&u, &x, sizeof u);
  vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  r = (vu)(((vi)(x != x) & (vi)(r * 0 + 0x7fc0u)) | (~(vi)(x != x) & (vi)r));
  vh h = __builtin_convertvector(r, vh);
  memcpy(p, &h, sizeof h);
}
/* 16 values of a bf16 (flag set) or fp32 array, from / to fp32 lanes */
static inline vf load16(const void* p, int64_t i, int bf16) {
  return bf16 ? load_bf16((const uint16_t*)p + i) : load_f32((const float*)p + i);
}
static inline void store16(void* p, int64_t i, vf x, int bf16) {
  if (bf16) store_bf16((uint16_t*)p + i, x); else memcpy((float*)p + i, &x, sizeof x);
}
static inline float load1(const void* p, int64_t i, int bf16) {
  return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline void store1(void* p, int64_t i, float x, int bf16) {
  if (bf16) ((uint16_t*)p)[i] = f32_to_bf16(x); else ((float*)p)[i] = x;
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
#endif
