/* The AVX-512 helpers shared by the AVX-512 kernel files: 16-lane
 * loads and stores of float32/bfloat16/float16 buffers with the portable
 * rounding rules, masked tails, and the canonical float64 lanes of sums (see
 * block_ops.h). Only for x86-64 GCC/Clang builds; every function carries the
 * AVX-512 target attribute, so including this header enables nothing else. */
#ifndef GEFEN_BLOCK_AVX512_COMMON_H
#define GEFEN_BLOCK_AVX512_COMMON_H

#include <float.h>
#include <immintrin.h>

#include "block_ops.h"
#include "kernel_internal.h"

#define GEFEN_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define GEFEN_AVX512_INLINE GEFEN_AVX512_TARGET static GEFEN_ALWAYS_INLINE

GEFEN_AVX512_INLINE __mmask16 gefen_tail_mask16(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* 16 elements of a float32/bfloat16/float16 buffer as fp32 (masked-off lanes 0). */
GEFEN_AVX512_INLINE __m512 gefen_load16(const void *p, gefen_dtype dt, int64_t i, __mmask16 k) {
  switch (dt) {
    case GEFEN_BF16: {
      __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case GEFEN_F16:
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i));
    default:
      return _mm512_maskz_loadu_ps(k, (const float *)p + i);
  }
}

/* fp32 -> bfloat16 bits, round to nearest even, NaN kept quiet (as
 * gefen_f32_to_bf16). The NaN lanes are fixed only in a vector that has one
 * (a branch that almost never goes that way, cheaper than doing it always). */
GEFEN_AVX512_INLINE __m512i gefen_to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  if (!nan) return rounded;
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_mov_epi32(rounded, nan, quiet);
}

GEFEN_AVX512_INLINE void gefen_store16(void *p, gefen_dtype dt, int64_t i, __m512 v, __mmask16 k) {
  switch (dt) {
    case GEFEN_BF16:
      _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)p + i, k, gefen_to_bf16_bits(v));
      break;
    case GEFEN_F16: {
      /* a NaN becomes sign | 0x7e00 as in gefen_f32_to_f16 (the conversion
       * instruction would keep payload bits); only a vector with one is fixed */
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      if (nan) {
        const __m512 canon = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)),
            _mm512_set1_epi32(0x7fc00000)));
        v = _mm512_mask_mov_ps(v, nan, canon);
      }
      _mm256_mask_storeu_epi16((uint16_t *)p + i, k,
                               _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
    }
    default:
      _mm512_mask_storeu_ps((float *)p + i, k, v);
      break;
  }
}

/* float16 NaNs in p[i, i + n) made sign | 0x7e00, what gefen_store16 stores
 * for a NaN. vcvtps2ph turns a NaN into a NaN of the same sign (quiet, with
 * the payload's top bits) and nothing else into a NaN, so converting without
 * gefen_store16's test and then this gives its bits; a block is read 32
 * values at a time for any NaN and rewritten only when it has one. */
GEFEN_AVX512_INLINE void gefen_f16_canonical_nans(void *p, int64_t i, int64_t n) {
  uint16_t *h = (uint16_t *)p + i;
  const __m512i inf2 = _mm512_set1_epi16((short)0xF800); /* 2 * 0x7c00: NaN iff 2h above it */
  __m512i acc = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512i x = _mm512_loadu_si512(h + j);
    acc = _mm512_max_epu16(acc, _mm512_add_epi16(x, x));
  }
  if (j < n) {
    const __m512i x = _mm512_maskz_loadu_epi16((__mmask32)((1u << (n - j)) - 1u), h + j);
    acc = _mm512_max_epu16(acc, _mm512_add_epi16(x, x));
  }
  if (!_mm512_cmpgt_epu16_mask(acc, inf2)) return;
  for (j = 0; j < n; j += 32) {
    const __mmask32 k = n - j >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (n - j)) - 1u);
    const __m512i x = _mm512_maskz_loadu_epi16(k, h + j);
    const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_add_epi16(x, x), inf2);
    const __m512i canon =
        _mm512_or_si512(_mm512_and_si512(x, _mm512_set1_epi16((short)0x8000)), _mm512_set1_epi16(0x7e00));
    _mm512_mask_storeu_epi16(h + j, k & nan, canon);
  }
}

/* Prefetches the lines of elements [i, i + n) of a buffer of esz-byte
 * elements. The kernels work through blocks (rows) in address order and
 * fetch the next block (at + len) while working on this one: the hardware
 * prefetchers alone leave each pass waiting on memory. A prefetch past the
 * end of a buffer is harmless (no fault). */
GEFEN_AVX512_INLINE void gefen_prefetch(const void *p, size_t esz, int64_t i, int64_t n) {
  const char *c = (const char *)p + (size_t)i * esz;
  for (size_t off = 0; off < (size_t)n * esz; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

/* Bytes per element of a float32/bfloat16/float16 buffer. */
GEFEN_AVX512_INLINE size_t gefen_esz(gefen_dtype dt) { return dt == GEFEN_F32 ? 4 : 2; }

/* Adds the 16 fp32 values of x to the float64 lanes lo (0-7) and hi (8-15); lo
 * and hi may be one accumulator, which then takes the low half first. */
GEFEN_AVX512_INLINE void gefen_add_lanes16(__m512d *lo, __m512d *hi, __m512 x) {
  *lo = _mm512_add_pd(*lo, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
  *hi = _mm512_add_pd(
      *hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
}

/* gefen_add_lanes16(lo, hi, x * x) for x converted from float16: its square
 * is exact in float32 and float64 alike (at most 22 significant bits, from
 * 2^-48 to 2^32), so RN(acc + (double)RN32(x * x)) = RN(acc + x * x), one
 * fused multiply-add of the float64 x per lane (on Zen 4 the multiply-add
 * pipes, where the additions take the add pipes), and no float32 product. */
GEFEN_AVX512_INLINE void gefen_fma_squares16(__m512d *lo, __m512d *hi, __m512 x) {
  const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d b =
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  *lo = _mm512_fmadd_pd(a, a, *lo);
  *hi = _mm512_fmadd_pd(b, b, *hi);
}

/* bfloat16 sums of squares by float64 multiply-adds (the block momentum and the
 * factored statistics): the canonical order adds RN32(g * g) widened to
 * float64; a multiply-add of the widened g adds the exact g * g instead. The
 * two are the same term for every bfloat16 g with 2^-63 <= |g| < 2^64 (a
 * square of at most 16 significant bits in float32's normal range), for
 * zeros, infinities and NaNs. The others:
 *  - finite |g| >= 2^64: RN32(g * g) is +inf, the exact square finite (below
 *    2^256, so no float64 sum overflows). A sum that took one is +inf in the
 *    canonical order (NaN if it took a NaN too, the same NaN both ways) and at
 *    least 2^128 by multiply-adds: gefen_bf16_sq_overflow finds the terms where
 *    a sum is not below 2^128, and the sum is made +inf.
 *  - 0 < |g| < 2^-63: both squares are at most 2^-126, so added to a float64
 *    accumulator of at least 2^-72 (half an ulp at least 2^-125) both leave it
 *    unchanged. A lane is therefore exact once its first term is at least
 *    2^-72 exactly: |g| >= 2^-36, bits 0x2d80 (gefen_bf16_sq_starts_ok16), or its
 *    accumulator is already that large; where neither can be shown, the kernels
 *    take the float32 squares of the canonical order. */
#define GEFEN_BF16_SQ_START 0x2d80u    /* bits of |g| = 2^-36 */
#define GEFEN_BF16_SQ_OVERFLOW 0x5f80u /* bits of |g| = 2^64 */
#define GEFEN_BF16_SQ_BIG 0x1p128      /* no sum below this took such a g */

/* Whether the bfloat16 value at i is finite with |g| >= 2^64 (its float32
 * square is +inf). */
GEFEN_AVX512_INLINE int gefen_bf16_sq_overflow(const void *grad, int64_t i) {
  const unsigned a = ((const uint16_t *)grad)[i] & 0x7fffu;
  return a >= GEFEN_BF16_SQ_OVERFLOW && a < 0x7f80u;
}

/* A sum of n bfloat16 squares at base by multiply-adds, made what the
 * canonical order gives where it took a square that overflows float32. */
GEFEN_AVX512_INLINE double gefen_bf16_sq_settle(const void *grad, int64_t base, int64_t n,
                                                 double sum) {
  if (sum < GEFEN_BF16_SQ_BIG || sum != sum) return sum;
  for (int64_t i = 0; i < n; i++)
    if (gefen_bf16_sq_overflow(grad, base + i)) return (double)INFINITY;
  return sum;
}

/* Whether the first min(n, 16) bfloat16 values at base all have |g| >= 2^-36
 * (NaNs and infinities too): the first terms of a sum's 16 lanes, which
 * make its multiply-adds exact (above). */
GEFEN_AVX512_INLINE int gefen_bf16_sq_starts_ok16(const void *grad, int64_t base, int64_t n) {
  const __mmask16 k = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
  const __m256i a = _mm256_and_si256(_mm256_maskz_loadu_epi16(k, (const uint16_t *)grad + base),
                                     _mm256_set1_epi16(0x7fff));
  return _mm256_mask_cmpge_epu16_mask(k, a, _mm256_set1_epi16((short)GEFEN_BF16_SQ_START)) == k;
}

/* The canonical in-order sum of the 16 lanes (see block_ops.h). */
GEFEN_AVX512_INLINE double gefen_sum_lanes16(__m512d lo, __m512d hi) {
  double lanes[GEFEN_SUM_LANES];
  _mm512_storeu_pd(lanes, lo);
  _mm512_storeu_pd(lanes + 8, hi);
  return gefen_sum_lanes(lanes);
}

/* The AVX-512 primitives of block_avx512.c that the VBMI table reuses. */
void gefen_avx512_row_stats(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                            int64_t rows, double *colsum, double *sums);
void gefen_avx512_apply_block(void *param, gefen_dtype dt, int64_t base, const float *mq,
                              int64_t len, float s, float decay, float lr);
void gefen_avx512_apply_factored(void *param, gefen_dtype dt, int64_t base, const float *mq,
                                 int64_t len, float srow, const float *scol, float inv_bc1,
                                 float eps, float decay, float lr);
void gefen_avx512_muon_output(void *out, gefen_dtype out_dt, const void *grad, gefen_dtype dt,
                              int64_t base, const float *mq, int64_t len, float beta,
                              float one_minus_beta, int nesterov);

#endif /* GEFEN_BLOCK_AVX512_COMMON_H */
