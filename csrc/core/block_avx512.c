/* AVX-512 versions of the block primitives (see block_ops.h), 16 lanes, with
 * masked tails. The fp32 operations and their order match block_scalar.c
 * exactly (no FMA: the build uses -ffp-contract=off and intrinsics are
 * explicit) and sums use the canonical lane order of block_ops.h, so every
 * output agrees bit for bit with the scalar path. The choice between the
 * versions (gefen_block_ops_for) is in block_scalar.c.
 *
 * The momentum and requantisation passes are block_avx512_kernels.h's
 * (threshold search in registers); without VBMI, codebook values come from
 * the 256 floats held in sixteen registers (vpermi2ps and three blends per
 * 16 values) rather than from a gather, which costs 25-40 cycles on the CPUs
 * we measured. */
#include "block_ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "block_avx512_common.h"

#define TARGET GEFEN_AVX512_TARGET
#define INLINE GEFEN_AVX512_INLINE

/* ------------------------------------------- momentum and requantisation */

/* A 256-entry float table (sixteen registers) at 16 indices 0..255: vpermi2ps
 * picks among each 32 entries by bits 0-4, blends by bits 5, 6 and 7. */
INLINE __m512 decode16(const float *table, __m512i idx) {
  __m512 t[8];
  for (int k = 0; k < 8; k++)
    t[k] = _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32 * k), idx,
                                  _mm512_loadu_ps(table + 32 * k + 16));
  const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
  for (int k = 0; k < 4; k++) t[k] = _mm512_mask_blend_ps(b5, t[2 * k], t[2 * k + 1]);
  for (int k = 0; k < 2; k++) t[k] = _mm512_mask_blend_ps(b6, t[2 * k], t[2 * k + 1]);
  return _mm512_mask_blend_ps(b7, t[0], t[1]);
}

INLINE void decode_codes64(const gefen_quant_search *s, const uint8_t *codes, __mmask64 km,
                           __m512 out[4]) {
  for (int v = 0; v < 4; v++) {
    const __m128i c = _mm_maskz_loadu_epi8((__mmask16)(km >> (16 * v)), codes + 16 * v);
    out[v] = decode16(s->value_of, _mm512_cvtepu8_epi32(c));
  }
}

/* The codes are the search's bits reversed (two nibble look-ups); the values
 * come straight from the bits through value_of_bits. */
INLINE void store_and_decode64(const gefen_quant_search *s, const __m512i bits[4],
                               uint8_t *codes, __mmask64 km, __m512 out[4]) {
  const __m512i rev4 = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15));
  for (int v = 0; v < 4; v++) {
    const __m512i lo = _mm512_and_si512(bits[v], _mm512_set1_epi32(15));
    const __m512i hi = _mm512_srli_epi32(bits[v], 4);
    const __m512i code = _mm512_or_si512(_mm512_slli_epi32(_mm512_shuffle_epi8(rev4, lo), 4),
                                         _mm512_shuffle_epi8(rev4, hi));
    _mm512_mask_cvtepi32_storeu_epi8(codes + 16 * v, (__mmask16)(km >> (16 * v)), code);
    if (out) out[v] = decode16(s->value_of_bits, bits[v]);
  }
}

INLINE void store_codes64(const gefen_quant_search *s, const __m512i bits[4], uint8_t *codes,
                          __mmask64 km) {
  store_and_decode64(s, bits, codes, km, NULL);
}

#include "block_avx512_kernels.h"

/* ------------------------------------------------------------ other passes */

/* The 8 bfloat16 values at `at` (or the first ones of k; the others 0) as
 * float. */
INLINE __m256 bf16x8(const void *grad, int64_t at, __mmask8 k) {
  const __m128i h = _mm_maskz_loadu_epi16(k, (const uint16_t *)grad + at);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* g^2 of the 8 bfloat16 gradient values at `at` (or the first ones of k; the
 * others 0) as float64: widened to float, squared, widened again, as
 * gefen_add_lanes16 does for each half of a vector. Taken as two halves of 8
 * instead of one vector of 16 (no vextractf64x4 for the high half; the
 * conversions from 16 bits in 256-bit halves), the bfloat16 and float16
 * statistics passes took 5-7% and 8-9% less time at 16.8M with one and two
 * threads on the Zen 4 VM (10-14% in cache; the two forms side by side in one
 * process), where the conversions and the float64 additions share pipes;
 * float32 rows were 2-4% slower that way and keep one vector
 * (docs/performance.md, "The factored form's extra cost, taken apart").
 * float16 rows take the halves without the square (rows16: by multiply-adds,
 * gefen_fma_squares16); this is bfloat16's where its multiply-adds cannot be
 * shown exact (block_avx512_common.h): its squares can overflow or underflow
 * in float32. */
INLINE __m512d square8_pd(const void *grad, int64_t at, __mmask8 k) {
  const __m256 g = bf16x8(grad, at, k);
  return _mm512_cvtps_pd(_mm256_mul_ps(g, g));
}

/* 16 columns at j of n rows (n <= ROWS_AT_ONCE, a constant): each row's
 * x = g^2 into its lanes and, row after row, into colsum[j..j+16), which is
 * loaded and stored once. Eight rows (18 of the 32 vector registers) load and
 * store colsum half as often as four, and on Intel CPUs the rows are read
 * without software prefetches (a plain sequential read the hardware prefetchers
 * follow; the prefetches cost more than they gave): the pass went from about
 * 3.9 to 3.5 ms (fp32) and 3.2 to 2.6 ms (bf16) at 16.8M on 2 Ice Lake cores
 * (docs/performance.md). With pf (float32 rows on AMD CPUs) each row's line
 * 32 KiB ahead is fetched into L2, as the AVX2 table's paired rows do: on the
 * Zen 4 VM (2026-12-05, this loop twice in a throwaway A/B, two threads, the
 * 16.8M / 67.1M sets) the pass took -3 to -12% in seven runs of eight (+3.6% in
 * one); 16-bit rows there were +10% as often as -14%, and keep the plain read. */
#define ROWS_AT_ONCE 8
#define ROW_PREFETCH_BYTES 32768
INLINE void rows16(const void *grad, gefen_dtype dt, int64_t base, int64_t len, const int n,
                   const int pf, const int halves, int64_t j, __mmask16 k, double *colsum,
                   __m512d *lo, __m512d *hi) {
  const __mmask8 k_lo = (__mmask8)(k & 0xff), k_hi = (__mmask8)(k >> 8);
  __m512d c_lo = _mm512_maskz_loadu_pd(k_lo, colsum + j);
  __m512d c_hi = _mm512_maskz_loadu_pd(k_hi, colsum + j + 8);
  if (halves == 2) {
    /* bfloat16 by multiply-adds (block_avx512_common.h; rows_bf16 has
     * checked the rows' first terms): the column sums after the first row
     * must be at least 2^-72, else these 16 columns take the float32 squares
     * below, before anything is added */
    const __m512d big = _mm512_set1_pd(0x1p-72);
#pragma GCC unroll 8
    for (int r = 0; r < n; r++) {
      const int64_t at = base + r * len + j;
      const __m512d a = _mm512_cvtps_pd(bf16x8(grad, at, k_lo));
      const __m512d b = _mm512_cvtps_pd(bf16x8(grad, at + 8, k_hi));
      if (r == 0) {
        const __m512d f_lo = _mm512_fmadd_pd(a, a, c_lo);
        const __m512d f_hi = _mm512_fmadd_pd(b, b, c_hi);
        if ((_mm512_mask_cmp_pd_mask(k_lo, f_lo, big, _CMP_GE_OQ) != k_lo) |
            (_mm512_mask_cmp_pd_mask(k_hi, f_hi, big, _CMP_GE_OQ) != k_hi))
          goto f32_squares;
        c_lo = f_lo;
        c_hi = f_hi;
      } else {
        c_lo = _mm512_fmadd_pd(a, a, c_lo);
        c_hi = _mm512_fmadd_pd(b, b, c_hi);
      }
      lo[r] = _mm512_fmadd_pd(a, a, lo[r]); /* masked lanes add 0 */
      hi[r] = _mm512_fmadd_pd(b, b, hi[r]);
    }
    _mm512_mask_storeu_pd(colsum + j, k_lo, c_lo);
    _mm512_mask_storeu_pd(colsum + j + 8, k_hi, c_hi);
    return;
  }
f32_squares:
  /* unrolled: without it GCC 12 kept the prefetching (float32, AMD) variant's
   * rows in a loop, their sums on the stack (a load and a store per 8 lanes),
   * and that pass took 6% longer in cache on the Zen 4 VM (docs/performance.md) */
#pragma GCC unroll 8
  for (int r = 0; r < n; r++) {
    const int64_t at = base + r * len + j;
    if (pf) /* float32: a line per row and 16 columns */
      _mm_prefetch((const char *)grad + (size_t)(at * 4 + ROW_PREFETCH_BYTES), _MM_HINT_T1);
    __m512d x_lo, x_hi;
    if (halves && dt == GEFEN_F16) {
      /* float16: each half widened to float64 and its squares added by
       * multiply-adds (exact squares: gefen_fma_squares16); the pass took
       * 19-23% less time at 16.8M with one and two threads on the Zen 4 VM
       * (docs/performance.md, "Fixed keys, and float16 squares by
       * multiply-adds"). Written out: the same load and widening through a
       * helper shared with square8_pd made GCC 12 compile both 16-bit row
       * loops 12-49% slower on the Zen 4 VM (2026-12-05). */
      const __m512d a = _mm512_cvtps_pd(
          _mm256_maskz_cvtph_ps((__mmask8)0xff, _mm_maskz_loadu_epi16(k_lo, (const uint16_t *)grad + at)));
      const __m512d b = _mm512_cvtps_pd(
          _mm256_maskz_cvtph_ps((__mmask8)0xff, _mm_maskz_loadu_epi16(k_hi, (const uint16_t *)grad + at + 8)));
      lo[r] = _mm512_fmadd_pd(a, a, lo[r]); /* masked lanes add 0 */
      hi[r] = _mm512_fmadd_pd(b, b, hi[r]);
      c_lo = _mm512_fmadd_pd(a, a, c_lo);
      c_hi = _mm512_fmadd_pd(b, b, c_hi);
      continue;
    }
    if (halves) { /* bfloat16 rows (square8_pd) */
      x_lo = square8_pd(grad, at, k_lo);
      x_hi = square8_pd(grad, at + 8, k_hi);
    } else {
      const __m512 g = gefen_load16(grad, dt, at, k);
      const __m512 x = _mm512_mul_ps(g, g);
      x_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
      x_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    }
    lo[r] = _mm512_add_pd(lo[r], x_lo); /* masked lanes add 0 */
    hi[r] = _mm512_add_pd(hi[r], x_hi);
    c_lo = _mm512_add_pd(c_lo, x_lo);
    c_hi = _mm512_add_pd(c_hi, x_hi);
  }
  _mm512_mask_storeu_pd(colsum + j, k_lo, c_lo);
  _mm512_mask_storeu_pd(colsum + j + 8, k_hi, c_hi);
}

INLINE void rows_t(const void *grad, gefen_dtype dt, int64_t base, int64_t len, const int n,
                   const int pf, const int halves, double *colsum, double *sums) {
  __m512d lo[ROWS_AT_ONCE], hi[ROWS_AT_ONCE];
  for (int r = 0; r < n; r++) lo[r] = hi[r] = _mm512_setzero_pd();
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) /* a constant mask: plain loads and stores */
    rows16(grad, dt, base, len, n, pf, halves, j, (__mmask16)0xFFFF, colsum, lo, hi);
  if (j < len)
    rows16(grad, dt, base, len, n, 0, halves, j, gefen_tail_mask16(len - j), colsum, lo, hi);
  for (int r = 0; r < n; r++) sums[r] = gefen_sum_lanes16(lo[r], hi[r]);
}

/* Where a row's bfloat16 squares by multiply-adds took one that overflows
 * float32 (block_avx512_common.h), its sum and its columns' sums are +inf, as in the
 * canonical order (NaNs stay). */
TARGET __attribute__((noinline, cold)) static void bf16_rows_settle(const void *grad, int64_t base,
                                                                    int64_t len, int64_t rows,
                                                                    double *colsum, double *sums) {
  for (int64_t r = 0; r < rows; r++) {
    if (sums[r] < GEFEN_BF16_SQ_BIG) continue;
    for (int64_t j = 0; j < len; j++)
      if (gefen_bf16_sq_overflow(grad, base + r * len + j)) {
        if (sums[r] == sums[r]) sums[r] = (double)INFINITY;
        if (colsum[j] == colsum[j]) colsum[j] = (double)INFINITY;
      }
  }
}

/* bfloat16 rows by multiply-adds where every row's first 16 terms allow it
 * (block_avx512_common.h), else by float32 squares. */
INLINE void rows_bf16(const void *grad, int64_t base, int64_t len, const int n, double *colsum,
                      double *sums) {
  int fma = 1;
  for (int r = 0; r < n; r++)
    fma &= gefen_bf16_sq_starts_ok16(grad, base + r * len, len);
  if (!fma) {
    rows_t(grad, GEFEN_BF16, base, len, n, 0, 1, colsum, sums);
    return;
  }
  rows_t(grad, GEFEN_BF16, base, len, n, 0, 2, colsum, sums);
  int big = 0;
  for (int r = 0; r < n; r++) big |= !(sums[r] < GEFEN_BF16_SQ_BIG);
  if (big) bf16_rows_settle(grad, base, len, n, colsum, sums);
}

TARGET void gefen_avx512_row_stats(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                                   int64_t rows, double *colsum, double *sums) {
  if (dt == GEFEN_F64) {
    gefen_block_ops_scalar.row_stats(grad, dt, base, len, rows, colsum, sums);
    return;
  }
  const int pf = dt == GEFEN_F32 && __builtin_cpu_is("amd"); /* see rows16 */
  const int halves = dt != GEFEN_F32;                         /* see square8_pd */
  int64_t r = 0;
  if (dt == GEFEN_BF16) {
    for (; r + ROWS_AT_ONCE <= rows; r += ROWS_AT_ONCE)
      rows_bf16(grad, base + r * len, len, ROWS_AT_ONCE, colsum, sums + r);
    for (; r < rows; r++) rows_bf16(grad, base + r * len, len, 1, colsum, sums + r);
    return;
  }
  for (; r + ROWS_AT_ONCE <= rows; r += ROWS_AT_ONCE) {
    if (pf) rows_t(grad, dt, base + r * len, len, ROWS_AT_ONCE, 1, 0, colsum, sums + r);
    else if (halves) rows_t(grad, dt, base + r * len, len, ROWS_AT_ONCE, 0, 1, colsum, sums + r);
    else rows_t(grad, dt, base + r * len, len, ROWS_AT_ONCE, 0, 0, colsum, sums + r);
  }
  for (; r < rows; r++) {
    if (halves) rows_t(grad, dt, base + r * len, len, 1, 0, 1, colsum, sums + r);
    else rows_t(grad, dt, base + r * len, len, 1, 0, 0, colsum, sums + r);
  }
}

TARGET void gefen_avx512_apply_block(void *param, gefen_dtype dt, int64_t base, const float *mq,
                               int64_t len, float s, float decay, float lr) {
  if (dt == GEFEN_F64) {
    gefen_block_ops_scalar.apply_block(param, dt, base, mq, len, s, decay, lr);
    return;
  }
  const __m512 vs = _mm512_set1_ps(s), vdecay = _mm512_set1_ps(decay), vlr = _mm512_set1_ps(lr);
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 k = gefen_tail_mask16(len - j);
    const __m512 p = gefen_load16(param, dt, base + j, k);
    const __m512 delta = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, mq + j), vs);
    gefen_store16(param, dt, base + j,
            _mm512_sub_ps(_mm512_mul_ps(p, vdecay), _mm512_mul_ps(vlr, delta)), k);
  }
}

TARGET void gefen_avx512_apply_factored(void *param, gefen_dtype dt, int64_t base,
                                        const float *mq, int64_t len, float srow,
                                        const float *scol, float inv_bc1, float eps, float decay,
                                        float lr) {
  if (dt == GEFEN_F64) {
    gefen_block_ops_scalar.apply_factored(param, dt, base, mq, len, srow, scol, inv_bc1, eps,
                                          decay, lr);
    return;
  }
  const __m512 vsrow = _mm512_set1_ps(srow), vinv = _mm512_set1_ps(inv_bc1),
               veps = _mm512_set1_ps(eps), vdecay = _mm512_set1_ps(decay),
               vlr = _mm512_set1_ps(lr);
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 k = gefen_tail_mask16(len - j);
    const __m512 s = _mm512_div_ps(
        vinv, _mm512_add_ps(_mm512_mul_ps(vsrow, _mm512_maskz_loadu_ps(k, scol + j)), veps));
    const __m512 p = gefen_load16(param, dt, base + j, k);
    const __m512 delta = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, mq + j), s);
    gefen_store16(param, dt, base + j,
                  _mm512_sub_ps(_mm512_mul_ps(p, vdecay), _mm512_mul_ps(vlr, delta)), k);
  }
}

TARGET void gefen_avx512_muon_output(void *out, gefen_dtype out_dt, const void *grad, gefen_dtype dt,
                               int64_t base, const float *mq, int64_t len, float beta,
                               float one_minus_beta, int nesterov) {
  if (dt == GEFEN_F64) {
    gefen_block_ops_scalar.muon_output(out, out_dt, grad, dt, base, mq, len, beta,
                                       one_minus_beta, nesterov);
    return;
  }
  const __m512 vbeta = _mm512_set1_ps(beta), vomb = _mm512_set1_ps(one_minus_beta);
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 k = gefen_tail_mask16(len - j);
    __m512 o = _mm512_maskz_loadu_ps(k, mq + j);
    if (nesterov)
      o = _mm512_add_ps(_mm512_mul_ps(vbeta, o),
                        _mm512_mul_ps(vomb, gefen_load16(grad, dt, base + j, k)));
    gefen_store16(out, out_dt, base + j, o, k);
  }
}

static const gefen_block_ops ops_avx512 = {
    adam_momentum,          muon_momentum,           requantize,
    requantize_apply,       gefen_avx512_row_stats,  gefen_avx512_apply_block,
    gefen_avx512_apply_factored, gefen_avx512_muon_output, dequantize_apply,
    adam_period1,
};

static int cpu_has_avx512(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

const gefen_block_ops *gefen_block_ops_avx512(void) {
  return cpu_has_avx512() ? &ops_avx512 : NULL;
}

#else /* not x86-64 with GCC/Clang */

const gefen_block_ops *gefen_block_ops_avx512(void) { return NULL; }

#endif
