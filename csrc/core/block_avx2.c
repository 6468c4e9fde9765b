/* AVX2 versions of the block primitives (see block_ops.h), 8 lanes, for the
 * x86-64 CPUs without AVX-512 (AMD before Zen 4, Intel client CPUs). The fp32
 * operations and their order match block_scalar.c exactly, so every output
 * agrees with it bit for bit:
 *  - no fused multiply-add (the target leaves out "fma", so the compiler
 *    cannot contract even without -ffp-contract=off);
 *  - float16 through F16C, which rounds to nearest even like gefen_f32_to_f16;
 *    a NaN is first made the canonical quiet NaN of its sign, because F16C
 *    keeps payload bits that the portable conversion drops;
 *  - bfloat16 by the integer rounding of gefen_f32_to_bf16, NaN rule included;
 *  - sums of g^2 in the canonical lanes of block_ops.h: 16 elements at a time
 *    into four float64 vectors holding lanes 0-3, 4-7, 8-11 and 12-15;
 *  - tails (fewer than 8 elements) go through the portable primitive or the
 *    portable operations on the same lanes.
 *
 * The nearest-code search is the lookup table of quantizer.c: a byte gather
 * for the bucket's candidate k, float gathers for value[k] and value[k + 1],
 * the same |u - v| comparison, and for codebooks with repeated entries one
 * more gather of the code and value at 2 * k + (u > value[k]). A group of 8
 * holding a NaN (u outside [-1, 1]) is left to the portable code. */
#include "block_ops.h"
#include "kernel_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,f16c")))
#define INLINE TARGET static GEFEN_ALWAYS_INLINE

/* 8 elements of a float32/bfloat16/float16 buffer as fp32. */
INLINE __m256 load8(const void *p, gefen_dtype dt, int64_t i) {
  switch (dt) {
    case GEFEN_BF16: {
      const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case GEFEN_F16:
      return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    default:
      return _mm256_loadu_ps((const float *)p + i);
  }
}

/* fp32 -> bfloat16 bits, round to nearest even, NaN kept quiet (as gefen_f32_to_bf16). */
INLINE __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v), high = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  /* every 32-bit lane is <= 0xffff, so the unsigned-saturating pack is exact */
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* fp32 -> float16 bits as gefen_f32_to_f16: a NaN becomes sign | 0x7e00. */
INLINE __m128i to_f16(__m256 v) {
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256 canon = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)),
                                    _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
  return _mm256_cvtps_ph(_mm256_blendv_ps(v, canon, nan), _MM_FROUND_TO_NEAREST_INT);
}

INLINE void store8(void *p, gefen_dtype dt, int64_t i, __m256 v) {
  switch (dt) {
    case GEFEN_BF16:
      _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_bf16(v));
      break;
    case GEFEN_F16:
      _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_f16(v));
      break;
    default:
      _mm256_storeu_ps((float *)p + i, v);
      break;
  }
}

INLINE __m256 abs8(__m256 v) {
  return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
}

/* The largest lane: all lanes are >= +0 and not NaN, so any order will do. */
INLINE float max8(__m256 v) {
  float x[8];
  _mm256_storeu_ps(x, v);
  float mx = 0.0f;
  for (int l = 0; l < 8; l++) mx = x[l] > mx ? x[l] : mx;
  return mx;
}

/* Adds the 8 fp32 values of x to float64 lanes lo (4 lanes) and hi (the next 4). */
INLINE void add_lanes(__m256d *lo, __m256d *hi, __m256 x) {
  *lo = _mm256_add_pd(*lo, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
  *hi = _mm256_add_pd(*hi, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

/* Calls CALL(DT) with the dtype as a compile-time constant. float64 goes to the
 * portable primitive before this. */
#define DTYPE_SWITCH(dt, CALL)         \
  switch (dt) {                        \
    case GEFEN_BF16: CALL(GEFEN_BF16); \
    case GEFEN_F16: CALL(GEFEN_F16);   \
    default: CALL(GEFEN_F32);          \
  }

/* ------------------------------------------------------------- momentum */

/* m = beta1 * (C[code] * mag_old) + (1 - beta1) * g for 8 elements at j. */
INLINE __m256 adam8(const void *grad, gefen_dtype dt, int64_t base, const uint8_t *codes,
                    const float *cb, int64_t j, __m256 vmag, __m256 vb1, __m256 vomb1,
                    float *m, __m256 *g_out) {
  const __m256 g = load8(grad, dt, base + j);
  const __m256i ci = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + j)));
  const __m256 mo = _mm256_mul_ps(_mm256_i32gather_ps(cb, ci, 4), vmag);
  const __m256 v = _mm256_add_ps(_mm256_mul_ps(vb1, mo), _mm256_mul_ps(vomb1, g));
  _mm256_storeu_ps(m + j, v);
  *g_out = g;
  return abs8(v);
}

INLINE float adam_momentum_t(const void *grad, const gefen_dtype dt, int64_t base,
                             const uint8_t *codes, const float *cb, float mag_old, float beta1,
                             float one_minus_beta1, int64_t len, float *m, double *sq) {
  const __m256 vmag = _mm256_set1_ps(mag_old), vb1 = _mm256_set1_ps(beta1),
               vomb1 = _mm256_set1_ps(one_minus_beta1);
  __m256 vmx = _mm256_setzero_ps(), g0, g1;
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    /* max(a, vmx) keeps vmx when a is NaN: NaN never wins */
    vmx = _mm256_max_ps(adam8(grad, dt, base, codes, cb, j, vmag, vb1, vomb1, m, &g0), vmx);
    vmx = _mm256_max_ps(adam8(grad, dt, base, codes, cb, j + 8, vmag, vb1, vomb1, m, &g1), vmx);
    add_lanes(&acc[0], &acc[1], _mm256_mul_ps(g0, g0));
    add_lanes(&acc[2], &acc[3], _mm256_mul_ps(g1, g1));
  }
  if (len - j >= 8) { /* lanes 0-7 */
    vmx = _mm256_max_ps(adam8(grad, dt, base, codes, cb, j, vmag, vb1, vomb1, m, &g0), vmx);
    add_lanes(&acc[0], &acc[1], _mm256_mul_ps(g0, g0));
    j += 8;
  }
  double lanes[GEFEN_SUM_LANES];
  for (int a = 0; a < 4; a++) _mm256_storeu_pd(lanes + 4 * a, acc[a]);
  float mx = max8(vmx);
  for (; j < len; j++) { /* the portable operations, on lane j % 16 */
    const float g = gefen_load(grad, dt, base + j);
    const float mo = cb[codes[j]] * mag_old;
    const float v = beta1 * mo + one_minus_beta1 * g;
    m[j] = v;
    const float a = fabsf(v);
    mx = a > mx ? a : mx;
    const float x = g * g;
    lanes[j % GEFEN_SUM_LANES] += x;
  }
  if (sq) *sq += gefen_sum_lanes(lanes);
  return mx;
}

TARGET static float adam_momentum(const void *grad, gefen_dtype dt, int64_t base,
                                  const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                                  float beta1, float one_minus_beta1, int64_t len, float *m,
                                  double *sq, int packed) {
  (void)packed; /* m in element order */
  if (dt == GEFEN_F64)
    return gefen_block_ops_scalar.adam_momentum(grad, dt, base, codes, q, mag_old, beta1,
                                                one_minus_beta1, len, m, sq, 0);
  const float *cb = q->table.codebook;
#define CALL(DT) \
  return adam_momentum_t(grad, DT, base, codes, cb, mag_old, beta1, one_minus_beta1, len, m, sq)
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

INLINE float muon_momentum_t(const void *grad, const gefen_dtype dt, int64_t base,
                             const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                             float one_minus_beta, int64_t len, float *m) {
  const float *cb = q->table.codebook;
  const __m256 vmag = _mm256_set1_ps(mag_old), vomb = _mm256_set1_ps(one_minus_beta);
  __m256 vmx = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 g = load8(grad, dt, base + j);
    const __m256i ci = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + j)));
    const __m256 mo = _mm256_mul_ps(_mm256_i32gather_ps(cb, ci, 4), vmag);
    const __m256 v = _mm256_add_ps(mo, _mm256_mul_ps(vomb, _mm256_sub_ps(g, mo)));
    _mm256_storeu_ps(m + j, v);
    vmx = _mm256_max_ps(abs8(v), vmx);
  }
  float mx = max8(vmx);
  if (j < len) {
    const float t = gefen_block_ops_scalar.muon_momentum(grad, dt, base + j, codes + j, q,
                                                         mag_old, one_minus_beta, len - j,
                                                         m + j);
    mx = t > mx ? t : mx;
  }
  return mx;
}

TARGET static float muon_momentum(const void *grad, gefen_dtype dt, int64_t base,
                                  const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                                  float one_minus_beta, int64_t len, float *m) {
  if (dt == GEFEN_F64)
    return gefen_block_ops_scalar.muon_momentum(grad, dt, base, codes, q, mag_old,
                                                one_minus_beta, len, m);
#define CALL(DT) return muon_momentum_t(grad, DT, base, codes, q, mag_old, one_minus_beta, len, m)
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

/* --------------------------------------------------------- requantisation */

/* 32-bit gather of byte table entries (the byte tables are followed by other
 * fields of their struct, so reading 4 bytes at the last index is safe). */
INLINE __m256i gather_u8(const uint8_t *table, __m256i idx) {
  return _mm256_and_si256(_mm256_i32gather_epi32((const int *)(const void *)table, idx, 1),
                          _mm256_set1_epi32(0xff));
}

/* The low bytes of 8 int32 lanes, in order, to dst[0..8). */
INLINE void store_codes8(uint8_t *dst, __m256i c) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, -1);
  const __m256i b = _mm256_shuffle_epi8(c, pick);
  _mm_storel_epi64((__m128i *)dst,
                   _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

INLINE void requantize_t(const gefen_quantizer *q, float *m, float mx, int64_t len,
                         uint8_t *codes, const int unique) {
  const gefen_quant_table *t = &q->table;
  const __m256 vmx = _mm256_set1_ps(mx), one = _mm256_set1_ps(1.0f),
               neg_one = _mm256_set1_ps(-1.0f),
               scale = _mm256_set1_ps((float)(GEFEN_LUT_BUCKETS / 2));
  const __m256i last_bucket = _mm256_set1_epi32(GEFEN_LUT_BUCKETS - 1);
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 u = _mm256_div_ps(_mm256_loadu_ps(m + j), vmx);
    const __m256 in = _mm256_and_ps(_mm256_cmp_ps(u, neg_one, _CMP_GE_OQ),
                                    _mm256_cmp_ps(u, one, _CMP_LE_OQ));
    if (_mm256_movemask_ps(in) != 0xff) { /* a NaN: rare, the portable way */
      gefen_block_ops_scalar.requantize(q, m + j, mx, 8, codes + j);
      continue;
    }
    /* u + 1 >= 0, so the truncated bucket is >= 0; only the top needs a clamp */
    const __m256i b = _mm256_min_epi32(
        _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_add_ps(u, one), scale)), last_bucket);
    __m256i k = gather_u8(t->bucket, b);
    const __m256 v0 = _mm256_i32gather_ps(t->value, k, 4);
    const __m256 v1 = _mm256_i32gather_ps(t->value + 1, k, 4);
    const __m256 d0 = abs8(_mm256_sub_ps(u, v0)), d1 = abs8(_mm256_sub_ps(u, v1));
    const __m256 up = _mm256_cmp_ps(d0, d1, _CMP_NLE_UQ); /* !(d0 <= d1) */
    k = _mm256_sub_epi32(k, _mm256_castps_si256(up));   /* all-ones lanes: k + 1 */
    __m256 val = _mm256_blendv_ps(v0, v1, up);          /* value[k] */
    __m256i code = k;
    if (!unique) { /* repeated entries: first code at or below value[k], last above */
      const __m256i above = _mm256_castps_si256(_mm256_cmp_ps(u, val, _CMP_GT_OQ));
      const __m256i sel = _mm256_sub_epi32(_mm256_add_epi32(k, k), above);
      code = gather_u8(q->sel_code, sel);
      val = _mm256_i32gather_ps(q->sel_value, sel, 4);
    }
    /* with distinct entries value[k] is codebook[k] and k the code */
    _mm256_storeu_ps(m + j, _mm256_mul_ps(val, vmx));
    store_codes8(codes + j, code);
  }
  if (j < len) gefen_block_ops_scalar.requantize(q, m + j, mx, len - j, codes + j);
}

TARGET static void requantize(const gefen_quantizer *q, float *m, float mx, int64_t len,
                              uint8_t *codes) {
  if (!(mx > 0.0f) || !q->table.exact_lut) { /* u = 0 everywhere, or no table */
    gefen_block_ops_scalar.requantize(q, m, mx, len, codes);
    return;
  }
  if (q->table.n_distinct == GEFEN_CODEBOOK_SIZE)
    requantize_t(q, m, mx, len, codes, 1);
  else
    requantize_t(q, m, mx, len, codes, 0);
}

/* ------------------------------------------------------- factored stats */

INLINE void colsum_add(double *colsum, __m256d x) {
  _mm256_storeu_pd(colsum, _mm256_add_pd(_mm256_loadu_pd(colsum), x));
}

/* x = g^2 of 8 elements at j into two lane vectors and colsum[j..j+8). */
INLINE void row8(const void *grad, gefen_dtype dt, int64_t base, int64_t j, double *colsum,
                 __m256d *lo, __m256d *hi) {
  const __m256 g = load8(grad, dt, base + j);
  const __m256 x = _mm256_mul_ps(g, g);
  const __m256d x_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d x_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  *lo = _mm256_add_pd(*lo, x_lo);
  *hi = _mm256_add_pd(*hi, x_hi);
  colsum_add(colsum + j, x_lo);
  colsum_add(colsum + j + 4, x_hi);
}

INLINE double row_stats_t(const void *grad, const gefen_dtype dt, int64_t base, int64_t len,
                          double *colsum) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    row8(grad, dt, base, j, colsum, &acc[0], &acc[1]);
    row8(grad, dt, base, j + 8, colsum, &acc[2], &acc[3]);
  }
  if (len - j >= 8) { /* lanes 0-7 */
    row8(grad, dt, base, j, colsum, &acc[0], &acc[1]);
    j += 8;
  }
  double lanes[GEFEN_SUM_LANES];
  for (int a = 0; a < 4; a++) _mm256_storeu_pd(lanes + 4 * a, acc[a]);
  for (; j < len; j++) { /* the portable operations, on lane j % 16 */
    const float g = gefen_load(grad, dt, base + j);
    const float x = g * g;
    lanes[j % GEFEN_SUM_LANES] += x;
    colsum[j] += x;
  }
  return gefen_sum_lanes(lanes);
}

TARGET static double row_stats_one(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                                   double *colsum) {
#define CALL(DT) return row_stats_t(grad, DT, base, len, colsum)
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

TARGET static void row_stats(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                             int64_t rows, double *colsum, double *sums) {
  if (dt == GEFEN_F64) {
    gefen_block_ops_scalar.row_stats(grad, dt, base, len, rows, colsum, sums);
    return;
  }
  for (int64_t r = 0; r < rows; r++) sums[r] = row_stats_one(grad, dt, base + r * len, len, colsum);
}

/* ------------------------------------------------------------ parameters */

INLINE void apply_block_t(void *param, const gefen_dtype dt, int64_t base, const float *mq,
                          int64_t len, float s, float decay, float lr) {
  const __m256 vs = _mm256_set1_ps(s), vdecay = _mm256_set1_ps(decay), vlr = _mm256_set1_ps(lr);
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 p = load8(param, dt, base + j);
    const __m256 delta = _mm256_mul_ps(_mm256_loadu_ps(mq + j), vs);
    store8(param, dt, base + j, _mm256_sub_ps(_mm256_mul_ps(p, vdecay), _mm256_mul_ps(vlr, delta)));
  }
  if (j < len)
    gefen_block_ops_scalar.apply_block(param, dt, base + j, mq + j, len - j, s, decay, lr);
}

TARGET static void apply_block(void *param, gefen_dtype dt, int64_t base, const float *mq,
                               int64_t len, float s, float decay, float lr) {
  if (dt == GEFEN_F64) {
    gefen_block_ops_scalar.apply_block(param, dt, base, mq, len, s, decay, lr);
    return;
  }
#define CALL(DT)                                         \
  apply_block_t(param, DT, base, mq, len, s, decay, lr); \
  return
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

INLINE void apply_factored_t(void *param, const gefen_dtype dt, int64_t base, const float *mq,
                             int64_t len, float srow, const float *scol, float inv_bc1,
                             float eps, float decay, float lr) {
  const __m256 vsrow = _mm256_set1_ps(srow), vinv = _mm256_set1_ps(inv_bc1),
               veps = _mm256_set1_ps(eps), vdecay = _mm256_set1_ps(decay),
               vlr = _mm256_set1_ps(lr);
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 s = _mm256_div_ps(
        vinv, _mm256_add_ps(_mm256_mul_ps(vsrow, _mm256_loadu_ps(scol + j)), veps));
    const __m256 p = load8(param, dt, base + j);
    const __m256 delta = _mm256_mul_ps(_mm256_loadu_ps(mq + j), s);
    store8(param, dt, base + j, _mm256_sub_ps(_mm256_mul_ps(p, vdecay), _mm256_mul_ps(vlr, delta)));
  }
  if (j < len)
    gefen_block_ops_scalar.apply_factored(param, dt, base + j, mq + j, len - j, srow, scol + j,
                                          inv_bc1, eps, decay, lr);
}

TARGET static void apply_factored(void *param, gefen_dtype dt, int64_t base, const float *mq,
                                  int64_t len, float srow, const float *scol, float inv_bc1,
                                  float eps, float decay, float lr) {
  if (dt == GEFEN_F64) {
    gefen_block_ops_scalar.apply_factored(param, dt, base, mq, len, srow, scol, inv_bc1, eps,
                                          decay, lr);
    return;
  }
#define CALL(DT)                                                                   \
  apply_factored_t(param, DT, base, mq, len, srow, scol, inv_bc1, eps, decay, lr); \
  return
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

/* ------------------------------------------------------------------ Muon */

INLINE void muon_output_t(void *out, const gefen_dtype out_dt, const void *grad,
                          const gefen_dtype dt, int64_t base, const float *mq, int64_t len,
                          float beta, float one_minus_beta, int nesterov) {
  const __m256 vbeta = _mm256_set1_ps(beta), vomb = _mm256_set1_ps(one_minus_beta);
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    __m256 o = _mm256_loadu_ps(mq + j);
    if (nesterov)
      o = _mm256_add_ps(_mm256_mul_ps(vbeta, o), _mm256_mul_ps(vomb, load8(grad, dt, base + j)));
    store8(out, out_dt, base + j, o);
  }
  if (j < len)
    gefen_block_ops_scalar.muon_output(out, out_dt, grad, dt, base + j, mq + j, len - j, beta,
                                       one_minus_beta, nesterov);
}

TARGET static void muon_output(void *out, gefen_dtype out_dt, const void *grad, gefen_dtype dt,
                               int64_t base, const float *mq, int64_t len, float beta,
                               float one_minus_beta, int nesterov) {
  if (nesterov && dt == GEFEN_F64) {
    gefen_block_ops_scalar.muon_output(out, out_dt, grad, dt, base, mq, len, beta,
                                       one_minus_beta, nesterov);
    return;
  }
  /* out is float32 or bfloat16 (as the portable version assumes) */
  if (out_dt == GEFEN_F32) {
#define CALL(DT)                                                                     \
  muon_output_t(out, GEFEN_F32, grad, DT, base, mq, len, beta, one_minus_beta, nesterov); \
  return
    DTYPE_SWITCH(dt, CALL)
#undef CALL
  } else {
#define CALL(DT)                                                                      \
  muon_output_t(out, GEFEN_BF16, grad, DT, base, mq, len, beta, one_minus_beta, nesterov); \
  return
    DTYPE_SWITCH(dt, CALL)
#undef CALL
  }
}

static const gefen_block_ops ops_avx2;

static void requantize_apply(const gefen_quantizer *q, float *m, float mx, int64_t len,
                             uint8_t *codes, const gefen_sink *sink) {
  gefen_requantize_apply_with(&ops_avx2, q, m, mx, len, codes, sink);
}

/* the portable decoding (the compiler vectorises its multiply), then the AVX2 apply */
static void dequantize_apply(const gefen_quantizer *q, const uint8_t *codes, float mag,
                             int64_t len, float *m, const gefen_sink *sink) {
  gefen_dequantize_apply_with(&ops_avx2, q, codes, mag, len, m, sink);
}

static const gefen_block_ops ops_avx2 = {
    adam_momentum, muon_momentum,  requantize,     requantize_apply,
    row_stats,     apply_block,    apply_factored, muon_output,
    dequantize_apply,
    NULL, /* adam_period1: the per-block primitives */
};

static int cpu_has_avx2(void) {
  __builtin_cpu_init();
  /* every CPU with AVX2 has FMA and F16C too; FMA is required only so that
   * this path means the same CPUs everywhere (it is never used) */
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         gefen_cpuid_ecx_bit(1, 29); /* F16C */
}

const gefen_block_ops *gefen_block_ops_avx2(void) {
  return cpu_has_avx2() ? &ops_avx2 : NULL;
}

#else /* not x86-64 with GCC/Clang */

const gefen_block_ops *gefen_block_ops_avx2(void) { return NULL; }

#endif
