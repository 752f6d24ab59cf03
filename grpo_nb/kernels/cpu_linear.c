/* A few rows times a bf16 weight on the CPU with AMX: y = x W^T + b, a decode step's products (1-64 rows) on a
   CPU with AMX bf16 tiles (Intel Sapphire Rapids and later); grpo_nb/kernels/cpu_linear.py compiles it with the
   system's C compiler and calls it through ctypes. The weight is read once, in the layout nn.Linear holds it ([N, K]
   rows, no repacked copy): 16 of its rows and 32 columns are the A tile, x's rows transposed into pairs of columns
   the B tile (made once per call, a few KB), so one TDPBF16PS gives 16 outputs for each of up to 16 rows; two
   blocks of 16 weight rows share each B tile, and the next two blocks' rows are prefetched while these multiply.
   Sums in fp32 (the tiles' arithmetic), the bias added to them, each output rounded once to bf16 (to nearest
   even, as torch rounds). Built without AMX (another CPU, an older compiler) both functions answer "not here". */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands a process AMX's tile registers only once asked (arch_prctl, since 5.16; inherited across fork) */
int linear_ready(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) ? 2 : 0; }

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

static inline __m512 bias16(const uint16_t* b) {
  if (!b) return _mm512_setzero_ps();
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)b));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* x [M, K] (row stride ldx), w [N, K] (ldw), bias [N] or NULL, y [M, N] (ldy), all bf16; N % 16 == 0, K % 32 == 0.
   Answers 0, or 1 for shapes it does not take, 3 where memory ran out. */
int linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, const uint16_t* bias, uint16_t* y,
                int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  if (M <= 0 || N <= 0 || K <= 0 || N % 16 || K % 32) return 1;
  const int64_t K2 = K / 2, chunks = (M + 15) / 16, R = M < 16 ? M : 16;  /* R: rows in each chunk's tiles */
  /* the B tiles: per chunk of 16 rows, per pair of columns (k, k+1), the chunk's R rows' pairs side by side
     (a last chunk's missing rows zeros), gathered here in one thread (~1 us at 16 rows of 576), kept per thread */
  static __thread uint32_t* kept = NULL;  /* the calling thread's (OpenMP's threads read it through xt) */
  static __thread int64_t held = 0;
  const int64_t need = ((chunks * K2 * R * 4 + 63) / 64) * 64;
  if (need > held) {
    free(kept);
    kept = aligned_alloc(64, need);
    held = kept ? need : 0;
    if (!kept) return 3;
  }
  uint32_t* const xt = kept;
  const __m512i row = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32((int)(ldx * 2)));  /* byte offsets of 16 rows */
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t rows = M - c * 16 < 16 ? M - c * 16 : 16;
    const __mmask16 valid = (__mmask16)((1u << rows) - 1);
    const char* base = (const char*)(x + c * 16 * ldx);
    for (int64_t k2 = 0; k2 < K2; k2++) {
      __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, row, base + 4 * k2, 1);
      _mm512_mask_storeu_epi32(xt + (c * K2 + k2) * R, (__mmask16)((1u << R) - 1), pairs);
    }
  }
  const int64_t blocks = N / 16, pairs = (blocks + 1) / 2;
#pragma omp parallel num_threads(threads)
  {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 2; t++) {
      config.rows[t] = 16; config.colsb[t] = R * 4;      /* tiles 0, 1: sums, 16 weight rows x R rows */
      config.rows[2 + t] = 16; config.colsb[2 + t] = 64; /* tiles 2, 3: 16 weight rows x 32 columns */
    }
    config.rows[4] = 16; config.colsb[4] = R * 4;        /* tile 4: 16 column pairs x R rows */
    _tile_loadconfig(&config);
    float sums[2][16 * 16];
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32((int)R));
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
      const int64_t n0 = p * 32;
      const int two = n0 + 16 < N;
      const uint16_t* w0 = w + n0 * ldw;
      const uint16_t* w1 = w0 + 16 * ldw;
      /* the next pair's rows, prefetched in address order over this pair's K / 32 steps (when rows are
         contiguous they are one run of memory, which DRAM and the hardware prefetchers read fastest) */
      const char* next = (const char*)(w0 + 32 * ldw);
      const int64_t ahead = (N - n0 - 32 < 32 ? N - n0 - 32 : 32) * ldw * 2, step = (ahead / (K / 32) + 63) & ~63;
      const __m512 b0 = bias16(bias ? bias + n0 : NULL), b1 = two ? bias16(bias ? bias + n0 + 16 : NULL) : b0;
      for (int64_t c = 0; c < chunks; c++) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < K; k += 32) {
          if (c == 0)
            for (int64_t b = (k / 32) * step; b < (k / 32 + 1) * step && b < ahead; b += 64)
              _mm_prefetch(next + b, _MM_HINT_T1);
          _tile_loadd(4, xt + (c * K2 + k / 2) * R, R * 4);
          _tile_loadd(2, w0 + k, ldw * 2);
          _tile_dpbf16ps(0, 2, 4);
          if (two) {
            _tile_loadd(3, w1 + k, ldw * 2);
            _tile_dpbf16ps(1, 3, 4);
          }
        }
        _tile_stored(0, sums[0], R * 4);
        if (two) _tile_stored(1, sums[1], R * 4);
        const int64_t rows = M - c * 16 < R ? M - c * 16 : R;
        for (int64_t r = 0; r < rows; r++) {  /* sums[t][i * R + r]: weight row n0 + 16t + i, x row 16c + r */
          uint16_t* out = y + (c * 16 + r) * ldy + n0;
          __m512 a = _mm512_add_ps(_mm512_i32gather_ps(column, sums[0] + r, 4), b0);
          if (two) {
            __m512 b = _mm512_add_ps(_mm512_i32gather_ps(column, sums[1] + r, 4), b1);
            _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(b, a));
          } else {
            _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(a));
          }
        }
      }
    }
    _tile_release();
  }
  return 0;
}

#else
int linear_ready(void) { return 1; }
int linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, const uint16_t* bias, uint16_t* y,
                int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  return 1;
}
#endif
