/* AVX-512 versions of the block primitives (see block_ops.h), 16 lanes, with
 * masked tails. The fp32 operations and their order match block_scalar.c
 * exactly (no FMA: the build uses -ffp-contract=off and intrinsics are
 * explicit) and sums use the canonical lane order of block_ops.h, so every
 * output agrees bit for bit with the scalar path. The choice between the
 * versions (gefen_block_ops_for) is in block_scalar.c.
 *
 * The nearest-code search is the lookup table of quantizer.c: one byte
 * gather for the bucket's candidate k, two float gathers for value[k] and
 * value[k + 1], and the same |u - v| comparison as the reference rule; for
 * codebooks with repeated entries, the code and value at 2 * k + (u > value[k])
 * of the quantiser's selection tables. */
#include "block_ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "block_avx512_common.h"

#define TARGET GEFEN_AVX512_TARGET

TARGET static float adam_momentum(const void *grad, gefen_dtype dt, int64_t base,
                                  const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                                  float beta1, float one_minus_beta1, int64_t len, float *m,
                                  double *sq) {
  if (dt == GEFEN_F64)
    return gefen_block_ops_scalar.adam_momentum(grad, dt, base, codes, q, mag_old, beta1,
                                                one_minus_beta1, len, m, sq);
  const float *cb = q->table.codebook;
  const __m512 vmag = _mm512_set1_ps(mag_old), vb1 = _mm512_set1_ps(beta1),
               vomb1 = _mm512_set1_ps(one_minus_beta1);
  __m512 vmx = _mm512_setzero_ps();
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 k = gefen_tail_mask16(len - j);
    const __m512 g = gefen_load16(grad, dt, base + j, k);
    const __m512i ci = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes + j));
    const __m512 mo = _mm512_mul_ps(_mm512_i32gather_ps(ci, cb, 4), vmag);
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(vb1, mo), _mm512_mul_ps(vomb1, g));
    _mm512_mask_storeu_ps(m + j, k, v);
    vmx = _mm512_mask_max_ps(vmx, k, _mm512_abs_ps(v), vmx); /* NaN never wins */
    gefen_add_lanes16(&lo, &hi, _mm512_mul_ps(g, g)); /* masked lanes add 0 */
  }
  if (sq) *sq += gefen_sum_lanes16(lo, hi);
  return _mm512_reduce_max_ps(vmx);
}

TARGET static float muon_momentum(const void *grad, gefen_dtype dt, int64_t base,
                                  const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                                  float one_minus_beta, int64_t len, float *m) {
  if (dt == GEFEN_F64)
    return gefen_block_ops_scalar.muon_momentum(grad, dt, base, codes, q, mag_old,
                                                one_minus_beta, len, m);
  const float *cb = q->table.codebook;
  const __m512 vmag = _mm512_set1_ps(mag_old), vomb = _mm512_set1_ps(one_minus_beta);
  __m512 vmx = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 k = gefen_tail_mask16(len - j);
    const __m512 g = gefen_load16(grad, dt, base + j, k);
    const __m512i ci = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes + j));
    const __m512 mo = _mm512_mul_ps(_mm512_i32gather_ps(ci, cb, 4), vmag);
    const __m512 v = _mm512_add_ps(mo, _mm512_mul_ps(vomb, _mm512_sub_ps(g, mo)));
    _mm512_mask_storeu_ps(m + j, k, v);
    vmx = _mm512_mask_max_ps(vmx, k, _mm512_abs_ps(v), vmx);
  }
  return _mm512_reduce_max_ps(vmx);
}

/* Byte table entries at 32-bit indices (the tables are followed by other
 * fields of gefen_quant_table, so reading 4 bytes at the last index is safe). */
TARGET static inline __m512i gather_u8(__m512i idx, const uint8_t *table) {
  return _mm512_and_si512(_mm512_i32gather_epi32(idx, table, 1), _mm512_set1_epi32(0xff));
}

TARGET static void requantize(const gefen_quantizer *q, float *m, float mx, int64_t len,
                              uint8_t *codes) {
  const gefen_quant_table *t = &q->table;
  if (!(mx > 0.0f)) { /* u = 0 everywhere */
    gefen_block_ops_scalar.requantize(q, m, mx, len, codes);
    return;
  }
  const __m512 vmx = _mm512_set1_ps(mx), one = _mm512_set1_ps(1.0f),
               scale = _mm512_set1_ps((float)(GEFEN_LUT_BUCKETS / 2)),
               top = _mm512_set1_ps(t->codebook[GEFEN_CODEBOOK_SIZE - 1]);
  const __m512i zero = _mm512_setzero_si512(),
                last_bucket = _mm512_set1_epi32(GEFEN_LUT_BUCKETS - 1),
                ione = _mm512_set1_epi32(1), code_nan = _mm512_set1_epi32(GEFEN_CODEBOOK_SIZE - 1);
  /* de-interleave 2 x 8 (value[k], value[k+1]) pairs into 16 lows and 16 highs */
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const int unique = t->n_distinct == GEFEN_CODEBOOK_SIZE;
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 k = gefen_tail_mask16(len - j);
    const __m512 u = _mm512_div_ps(_mm512_maskz_loadu_ps(k, m + j), vmx);
    const __mmask16 nan = _mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q);
    __m512i b = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(u, one), scale));
    b = _mm512_min_epi32(_mm512_max_epi32(b, zero), last_bucket);
    __m512i kk = gather_u8(b, t->bucket);
    const __m512i p_lo = _mm512_i32gather_epi64(_mm512_castsi512_si256(kk), q->pair, 8);
    const __m512i p_hi = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(kk, 1), q->pair, 8);
    const __m512 v0 = _mm512_castsi512_ps(_mm512_permutex2var_epi32(p_lo, even, p_hi));
    const __m512 v1 = _mm512_castsi512_ps(_mm512_permutex2var_epi32(p_lo, odd, p_hi));
    const __m512 d0 = _mm512_abs_ps(_mm512_sub_ps(u, v0));
    const __m512 d1 = _mm512_abs_ps(_mm512_sub_ps(u, v1));
    const __mmask16 up = _mm512_cmp_ps_mask(d0, d1, _CMP_NLE_UQ); /* !(d0 <= d1) */
    kk = _mm512_mask_add_epi32(kk, up, kk, ione);
    __m512 val = _mm512_mask_blend_ps(up, v0, v1);
    __m512i code = kk;
    if (!unique) { /* repeated entries: first code at or below value[k], last above */
      const __mmask16 above = _mm512_cmp_ps_mask(u, val, _CMP_GT_OQ);
      const __m512i k2 = _mm512_add_epi32(kk, kk);
      const __m512i sel = _mm512_mask_add_epi32(k2, above, k2, ione);
      code = gather_u8(sel, q->sel_code);
      /* codebook[code], which differs from value[k] in sign when a run of
       * equal entries mixes -0 and +0 */
      val = _mm512_i32gather_ps(sel, q->sel_value, 4);
    }
    code = _mm512_mask_mov_epi32(code, nan, code_nan);
    val = _mm512_mask_mov_ps(val, nan, top);
    _mm512_mask_storeu_ps(m + j, k, _mm512_mul_ps(val, vmx));
    _mm512_mask_cvtepi32_storeu_epi8(codes + j, k, code);
  }
}

/* 16 elements of a row at j: x = g^2 into the lanes and colsum[j..j+16). */
GEFEN_AVX512_INLINE void row16(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                               int64_t j, __mmask16 k, double *colsum, __m512d *lo,
                               __m512d *hi) {
  gefen_prefetch(grad, gefen_esz(dt), base + j + len, 16); /* the next row */
  const __m512 g = gefen_load16(grad, dt, base + j, k);
  const __m512 x = _mm512_mul_ps(g, g);
  const __mmask8 k_lo = (__mmask8)(k & 0xff), k_hi = (__mmask8)(k >> 8);
  const __m512d x_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d x_hi =
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  *lo = _mm512_add_pd(*lo, x_lo);
  *hi = _mm512_add_pd(*hi, x_hi);
  _mm512_mask_storeu_pd(colsum + j, k_lo,
                        _mm512_add_pd(_mm512_maskz_loadu_pd(k_lo, colsum + j), x_lo));
  _mm512_mask_storeu_pd(colsum + j + 8, k_hi,
                        _mm512_add_pd(_mm512_maskz_loadu_pd(k_hi, colsum + j + 8), x_hi));
}

TARGET double gefen_avx512_row_stats(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                                     double *colsum) {
  if (dt == GEFEN_F64) return gefen_block_ops_scalar.row_stats(grad, dt, base, len, colsum);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) /* a constant mask: plain loads and stores */
    row16(grad, dt, base, len, j, (__mmask16)0xFFFF, colsum, &lo, &hi);
  if (j < len) row16(grad, dt, base, len, j, gefen_tail_mask16(len - j), colsum, &lo, &hi);
  return gefen_sum_lanes16(lo, hi);
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

static const gefen_block_ops ops_avx512;

static void requantize_apply(const gefen_quantizer *q, float *m, float mx, int64_t len,
                             uint8_t *codes, const gefen_sink *sink) {
  gefen_requantize_apply_with(&ops_avx512, q, m, mx, len, codes, sink);
}

static const gefen_block_ops ops_avx512 = {
    adam_momentum,          muon_momentum,           requantize,
    requantize_apply,       gefen_avx512_row_stats,  gefen_avx512_apply_block,
    gefen_avx512_apply_factored, gefen_avx512_muon_output,
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
