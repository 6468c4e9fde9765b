/* The AVX-512 momentum and requantisation primitives (see block_ops.h),
 * 64 elements at a time and without a memory gather: a template (no include
 * guard) included by block_avx512.c and by block_avx512vbmi_kernels.h (for
 * block_avx512vbmi.c and block_avx512bf16.c), which differ in how they turn
 * codes into codebook values, in their target and (CVT_BF16 below) in how
 * they round to bfloat16. The including file defines TARGET, INLINE and:
 *
 *   decode_codes64(s, codes, km, out)       C[code] of the codes at codes[0..64)
 *                                           (the lanes of km) as 4 x 16 floats;
 *   store_and_decode64(s, bits, codes, km, out)
 *                                           the codes of the search's result
 *                                           bits[4] (the count's bits reversed,
 *                                           search64) stored at codes[0..64)
 *                                           (the lanes of km), and their values;
 *   store_codes64(s, bits, codes, km)       the same codes stored, no values.
 *
 * Nearest code: the code of u is the number of quantiser thresholds below u
 * (gefen_quant_search, quantizer_internal.h), found by an 8-level binary
 * search whose thresholds come from registers through vpermps / vpermi2ps.
 * The count is exact for every codebook, so these paths need no exact lookup
 * table (that table read by gathers, ALGORITHM.md §10, measured 7-60% slower
 * even where gathers are fast: docs/performance.md). Short blocks divide
 * u = m / mx like the portable code; long blocks search m itself against the
 * thresholds scaled by mx, which gives the same count (gefen_quant_search
 * explains why) without a division per element.
 * Where the including file has byte look-ups (KEY_SEARCH), blocks of at
 * least KEY_MIN_LEN with a codebook whose thresholds are not too close search
 * 16-bit keys of m instead, 32 lanes per vector, and settle the one threshold
 * the keys cannot decide by an exact comparison: the same count. The whole
 * groups compare only the lanes whose key ties that threshold's key, in
 * scalar code after the search (key_ties), the last ones every lane
 * (key_codes_t).
 * Only on CPUs where that is faster (key_search: AMD; on Intel the 16-bit
 * permutes cost more than two float ones).
 *
 * Everything else (the fp32 operations, their order, the float64 lanes of the
 * sums, the dtype conversions of block_avx512_common.h) is that of the
 * portable primitives, so the results agree with them bit for bit; where a
 * file has byte look-ups, long blocks decode per-block value tables (the
 * products of a code's value that depend on the code alone, formed once per
 * block: VALUE_TABLES below) instead of the codebook.
 *
 * It defines the static functions adam_momentum, muon_momentum, requantize,
 * requantize_apply, dequantize_apply and adam_period1 of gefen_block_ops.
 *
 * The packed order (a file that defines PACKED_BF16 as 1 also defines
 * decode_codes64_packed and store_and_decode64_packed): for bfloat16 Adam
 * steps, the four vectors of a whole group of 64 hold its elements
 * {0, 2, .., 30}, {1, 3, .., 31}, {32, 34, .., 62} and {33, .., 63}, so that
 * a group's 128 bytes of gradient or parameter become floats by a shift and
 * a mask and go back by a shift and an or: no shuffle (port 5, which the
 * search saturates) where the element order needs vpmovzxwd and vpmovdw. The
 * momentum pass writes m in that order and the requantisation pass reads it
 * so (adam_momentum's packed, the sink's packed); the codes are stored in
 * element order, the float64 lanes of the sum of squares hold the same terms
 * in the same order (momentum_t), and every element gets the same operations:
 * the results are those of the element order, bit for bit. Tails (the last,
 * partial group of a block) keep the element order in both passes. */
#ifndef PACKED_BF16
#define PACKED_BF16 0
#endif

/* CVT_BF16 (a file whose target has AVX512-BF16 defines it as 1): the sinks
 * round float32 to bfloat16 by vcvtneps2bf16 / vcvtne2ps2bf16, which round to
 * nearest even and quieten NaN exactly as gefen_to_bf16_bits does, except that
 * they flush float32 subnormals to zero: a vector holding one (lanes masked
 * off included) takes gefen_to_bf16_bits instead. */
#ifndef CVT_BF16
#define CVT_BF16 0
#endif

#if CVT_BF16
/* Any lane with a zero exponent field (subnormal, or +-0, which either way
 * rounds the same). A test of the bits: vfpclassps would miss subnormals when
 * MXCSR.DAZ is set (measured on Zen 4), where arithmetic still makes them if
 * FTZ is not. */
INLINE int any_zero_exponent(__m512 v) {
  return _mm512_testn_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32(0x7f800000)) != 0;
}
#endif

/* gefen_store16, with the BF16 conversion where this file has it, and float16
 * converted without the NaN test: every caller runs gefen_f16_canonical_nans
 * over its block afterwards (store_nans_after). */
INLINE void store16(void *p, gefen_dtype dt, int64_t i, __m512 v, __mmask16 k) {
#if CVT_BF16
  if (dt == GEFEN_BF16 && !any_zero_exponent(v)) {
    _mm256_mask_storeu_epi16((uint16_t *)p + i, k, (__m256i)_mm512_cvtneps_pbh(v));
    return;
  }
#endif
  if (dt == GEFEN_F16) {
    _mm256_mask_storeu_epi16((uint16_t *)p + i, k,
                             _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return;
  }
  gefen_store16(p, dt, i, v, k);
}

/* After a block's stores by store16 to p[i, i + n): its float16 NaNs as
 * gefen_store16 stores them. */
INLINE void store_nans_after(void *p, gefen_dtype dt, int64_t i, int64_t n) {
  if (dt == GEFEN_F16) gefen_f16_canonical_nans(p, i, n);
}

/* Blocks at least this long search m with scaled thresholds (requantize_t). */
#define SCALED_MIN_LEN 128

INLINE __mmask64 tail_mask64(int64_t left) {
  return left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
}

INLINE __mmask16 part_mask(__mmask64 k, int v) { return (__mmask16)(k >> (16 * v)); }

/* The two Adam formulas, written once for the per-block primitives and for
 * adam_period1 (same operations, same order as the portable code):
 *   m     = beta1 * mo + (1 - beta1) * g        (mo = C[code] * mag_old)
 *   param = param * decay - lr * delta           (delta = mq * step size)
 * adam_param_of takes lr * delta already formed. */
INLINE __m512 adam_param_of(__m512 p, float decay, __m512 lrd) {
  return _mm512_sub_ps(_mm512_mul_ps(p, _mm512_set1_ps(decay)), lrd);
}

INLINE __m512 adam_param16(__m512 p, float decay, float lr, __m512 delta) {
  return adam_param_of(p, decay, _mm512_mul_ps(_mm512_set1_ps(lr), delta));
}

/* The momentum in two parts: the part of a code's value c = C[code] that
 * depends on the code alone within a block (mo = c * mag for GefenMuon, beta1
 * * mo for Gefen), and m from it and g: the operations of Adam's m above and
 * of GefenMuon's m = mo + (1 - beta) * (g - mo), in their order. */
INLINE __m512 momentum_code_value(__m512 c, __m512 vmag, __m512 vb1, const int muon) {
  const __m512 mo = _mm512_mul_ps(c, vmag);
  return muon ? mo : _mm512_mul_ps(vb1, mo);
}

INLINE __m512 momentum_of(__m512 cv, __m512 vomb, __m512 g, const int muon) {
  return muon ? _mm512_add_ps(cv, _mm512_mul_ps(vomb, _mm512_sub_ps(g, cv)))
              : _mm512_add_ps(cv, _mm512_mul_ps(vomb, g));
}

#ifndef KEY_SEARCH
#define KEY_SEARCH 0
#endif

/* Value tables (files with byte look-ups, KEY_SEARCH, have them): within a
 * block, what the momentum pass and the sinks form from a code's value before
 * an element's own operands enter (momentum_code_value; sink_code_value: lr *
 * ((C[code] * mx) * s) for a block Adam sink) depends on the code alone. A
 * block of at least VALUE_MIN_LEN elements forms it once for each of the 256
 * codes, by the same operations on the same operands, as four byte planes
 * (split_planes), and decodes that instead of C[code]: the same bits, with up
 * to 12 fewer multiplications per 64 elements. */
#define VALUE_TABLES KEY_SEARCH
#define VALUE_MIN_LEN 1024

/* A 256-entry table of floats as byte planes (byte b of entry i at [b][i]). */
typedef const uint8_t (*planes_ptr)[GEFEN_CODEBOOK_SIZE];

#if VALUE_TABLES
/* t[0..256) as four byte planes, 64 at a time: two byte permutes of each
 * pair of vectors give planes 0 and 1, and 2 and 3, of their 32 entries
 * (16 bytes per vector and plane), then one 128-bit lane shuffle per plane
 * joins the two pairs' halves (8 shuffles per 64 entries, where a byte
 * permute of each vector and a 4 x 4 transpose of 128-bit lanes took 12). */
INLINE void split_planes(const float *t, uint8_t (*plane)[GEFEN_CODEBOOK_SIZE]) {
  /* output byte 16 l + k: byte b = 2 h + (l >> 1) of entry k of vector l & 1
   * of the pair (64 + ... for the second vector), h = 0 or 1 */
  static const _Alignas(64) uint8_t by_plane[2][64] = {
     {0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84,
      88, 92, 96, 100, 104, 108, 112, 116, 120, 124, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37,
      41, 45, 49, 53, 57, 61, 65, 69, 73, 77, 81, 85, 89, 93, 97, 101, 105, 109, 113, 117,
      121, 125},
     {2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 66, 70, 74, 78, 82, 86,
      90, 94, 98, 102, 106, 110, 114, 118, 122, 126, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39,
      43, 47, 51, 55, 59, 63, 67, 71, 75, 79, 83, 87, 91, 95, 99, 103, 107, 111, 115, 119,
      123, 127}};
  const __m512i idx01 = _mm512_load_si512(by_plane[0]), idx23 = _mm512_load_si512(by_plane[1]);
  for (int g = 0; g < GEFEN_CODEBOOK_SIZE / 64; g++) {
    const __m512i x0 = _mm512_loadu_si512(t + 64 * g);
    const __m512i x1 = _mm512_loadu_si512(t + 64 * g + 16);
    const __m512i x2 = _mm512_loadu_si512(t + 64 * g + 32);
    const __m512i x3 = _mm512_loadu_si512(t + 64 * g + 48);
    const __m512i a01 = _mm512_permutex2var_epi8(x0, idx01, x1);
    const __m512i a23 = _mm512_permutex2var_epi8(x0, idx23, x1);
    const __m512i b01 = _mm512_permutex2var_epi8(x2, idx01, x3);
    const __m512i b23 = _mm512_permutex2var_epi8(x2, idx23, x3);
    _mm512_storeu_si512(plane[0] + 64 * g, _mm512_shuffle_i64x2(a01, b01, 0x44));
    _mm512_storeu_si512(plane[1] + 64 * g, _mm512_shuffle_i64x2(a01, b01, 0xEE));
    _mm512_storeu_si512(plane[2] + 64 * g, _mm512_shuffle_i64x2(a23, b23, 0x44));
    _mm512_storeu_si512(plane[3] + 64 * g, _mm512_shuffle_i64x2(a23, b23, 0xEE));
  }
}

/* A block's momentum_code_value of every code, as byte planes. */
INLINE void momentum_values(const gefen_quant_search *s, __m512 vmag, __m512 vb1, const int muon,
                            uint8_t (*plane)[GEFEN_CODEBOOK_SIZE]) {
  _Alignas(64) float t[GEFEN_CODEBOOK_SIZE];
  for (int g = 0; g < GEFEN_CODEBOOK_SIZE / 16; g++)
    _mm512_store_ps(t + 16 * g,
                    momentum_code_value(_mm512_loadu_ps(s->value_of + 16 * g), vmag, vb1, muon));
  split_planes(t, plane);
}
#endif

/* The 64 codes at codes[0..64) (the lanes of km) decoded: the entries of the
 * block's value table plane (tabled), or the codebook's values. */
INLINE void decode_either64(const gefen_quant_search *s, planes_ptr plane, const int tabled,
                            const uint8_t *codes, __mmask64 km, __m512 out[4]) {
#if VALUE_TABLES
  if (tabled) {
    decode_codes64_with(plane, codes, km, out);
    return;
  }
#else
  (void)plane;
  (void)tabled;
#endif
  decode_codes64(s, codes, km, out);
}

/* The state of a momentum pass: the running max|m| and float64 lanes of g^2. */
typedef struct {
  __m512 vmx;
  __m512d lo, hi;
} momentum_acc;

/* max(|x|, vmx) with NaN never winning, in one operation: vrangeps with imm 0x0B
 * takes the operand of larger magnitude and clears its sign. An operand that is
 * a quiet NaN gives the other one (IEEE maxNum; the kernel tests' NaN gradients
 * check it on the CPU that runs them), and every x here is an arithmetic result,
 * so a NaN is quiet; vmx starts at 0 and never holds one. Was _mm512_max_ps of
 * _mm512_abs_ps(x) and vmx: one operation more per 16 values (docs/performance.md,
 * "The keys without their clamp"). */
#define MAX_ABS 0x0B

#if PACKED_BF16
/* 64 bfloat16 values at p + i as floats in the packed order, and back (rounded
 * as gefen_store16 rounds). */
INLINE void load64_bf16_packed(const void *p, int64_t i, __m512 out[4]) {
  const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
  for (int h = 0; h < 2; h++) {
    const __m512i x = _mm512_loadu_si512((const uint16_t *)p + i + 32 * h);
    out[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    out[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, odd));
  }
}

INLINE void store64_bf16_packed(void *p, int64_t i, const __m512 v[4]) {
  for (int h = 0; h < 2; h++) {
#if CVT_BF16
    if (!any_zero_exponent(v[2 * h]) && !any_zero_exponent(v[2 * h + 1])) {
      /* 16 even then 16 odd values, interleaved by one word permute */
      static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                         21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                         11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
      const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(v[2 * h + 1], v[2 * h]);
      _mm512_storeu_si512((uint16_t *)p + i + 32 * h,
                          _mm512_permutexvar_epi16(_mm512_loadu_si512(order), w));
      continue;
    }
#endif
    const __m512i even = gefen_to_bf16_bits(v[2 * h]), odd = gefen_to_bf16_bits(v[2 * h + 1]);
    _mm512_storeu_si512((uint16_t *)p + i + 32 * h, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
  }
}

/* A whole group of the Adam momentum pass in the packed order (bfloat16): the
 * operations of momentum64, with the squares in even and odd accumulators. */
INLINE void momentum64_packed(planes_ptr plane, const int tabled, const void *grad, int64_t base,
                              const uint8_t *codes, __m512 vmag, __m512 vb1, __m512 vomb,
                              int64_t len, float *m, int64_t j, momentum_acc *acc, __m512d *even,
                              __m512d *odd, const int want_sq) {
  gefen_prefetch(codes, 1, j + len, 64); /* the next block, as momentum64 */
  gefen_prefetch(grad, 2, base + j + len, 64);
  __m512 c[4], g[4];
  decode_codes64_packed(plane, codes + j, c);
  load64_bf16_packed(grad, base + j, g);
  for (int v = 0; v < 4; v++) {
    const __m512 cv = tabled ? c[v] : momentum_code_value(c[v], vmag, vb1, 0);
    const __m512 x = momentum_of(cv, vomb, g[v], 0);
    _mm512_storeu_ps(m + j + 16 * v, x);
    acc->vmx = _mm512_range_ps(acc->vmx, x, MAX_ABS); /* NaN never wins */
  }
  /* the squares: one float64 accumulator takes both halves of a vector, low then high
   * (gefen_add_lanes16 with lo = hi), so that in the packed order the even (odd)
   * accumulator's lane a holds what the element order's lane 2a (2a + 1) would, term
   * after term */
  if (want_sq) /* by multiply-adds, checked in momentum_run */
    for (int v = 0; v < 4; v++) gefen_fma_squares16(v % 2 ? odd : even, v % 2 ? odd : even, g[v]);
}
#endif

/* 64 elements (or the first ones of km) of the momentum pass at j. Called
 * with km all ones (a constant) for whole groups, so that the compiler drops
 * the masks there. */
INLINE void momentum64(const gefen_quant_search *s, planes_ptr plane, const int tabled,
                       const void *grad, const gefen_dtype dt, int64_t base, const uint8_t *codes,
                       __m512 vmag, __m512 vb1, __m512 vomb, int64_t len, float *m, int64_t j,
                       __mmask64 km, momentum_acc *acc, const int muon, const int want_sq) {
  gefen_prefetch(codes, 1, j + len, 64); /* the next block (gefen_prefetch) */
  gefen_prefetch(grad, gefen_esz(dt), base + j + len, 64);
  __m512 c[4];
  decode_either64(s, plane, tabled, codes + j, km, c);
  for (int v = 0; v < 4; v++) {
    const __mmask16 k = part_mask(km, v);
    const int64_t i = j + 16 * v;
    const __m512 g = gefen_load16(grad, dt, base + i, k);
    const __m512 cv = tabled ? c[v] : momentum_code_value(c[v], vmag, vb1, muon);
    const __m512 x = momentum_of(cv, vomb, g, muon);
    _mm512_mask_storeu_ps(m + i, k, x);
    acc->vmx = _mm512_mask_range_ps(acc->vmx, k, acc->vmx, x, MAX_ABS); /* NaN never wins */
    if (want_sq && dt != GEFEN_F32) /* bfloat16: checked in momentum_run */
      gefen_fma_squares16(&acc->lo, &acc->hi, g); /* masked lanes add 0 */
    else if (want_sq)
      gefen_add_lanes16(&acc->lo, &acc->hi, _mm512_mul_ps(g, g)); /* masked lanes add 0 */
  }
}

/* The canonical sum of a bfloat16 block's float32 squares, for the blocks
 * whose multiply-adds cannot be shown exact (block_avx512_common.h). */
TARGET __attribute__((noinline, cold)) static double bf16_squares_f32(const void *grad,
                                                                      int64_t base, int64_t len) {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (int64_t j = 0; j < len; j += 16) {
    const __m512 g = gefen_load16(grad, GEFEN_BF16, base + j, gefen_tail_mask16(len - j));
    gefen_add_lanes16(&lo, &hi, _mm512_mul_ps(g, g)); /* masked lanes add 0 */
  }
  return gefen_sum_lanes16(lo, hi);
}

/* Gefen (muon = 0): m = beta1 * (C[code] * mag_old) + (1 - beta1) * g, with
 * the sum of g^2 when want_sq; GefenMuon (muon = 1): mo = C[code] * mag_old,
 * m = mo + (1 - beta) * (g - mo) (beta1 unused). Returns max|m|. */
INLINE float momentum_run(const gefen_quant_search *s, planes_ptr plane, const int tabled,
                          const void *grad, const gefen_dtype dt, int64_t base,
                          const uint8_t *codes, __m512 vmag, __m512 vb1, __m512 vomb,
                          int64_t len, float *m, double *sq, const int muon, const int want_sq,
                          const int packed) {
  momentum_acc acc = {_mm512_setzero_ps(), _mm512_setzero_pd(), _mm512_setzero_pd()};
  int64_t j = 0;
#if PACKED_BF16
  if (packed) { /* Adam, bfloat16: the whole groups in the packed order */
    __m512d even = _mm512_setzero_pd(), odd = _mm512_setzero_pd();
    for (; j + 64 <= len; j += 64)
      momentum64_packed(plane, tabled, grad, base, codes, vmag, vb1, vomb, len, m, j, &acc,
                        &even, &odd, want_sq);
    if (want_sq) { /* element order's lanes: 0-7 = even0 odd0 .. even3 odd3, 8-15 the rest */
      acc.lo = _mm512_permutex2var_pd(even, _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), odd);
      acc.hi = _mm512_permutex2var_pd(even, _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15), odd);
    }
  }
#else
  (void)packed;
#endif
  for (; j + 64 <= len; j += 64)
    momentum64(s, plane, tabled, grad, dt, base, codes, vmag, vb1, vomb, len, m, j, ~(__mmask64)0,
               &acc, muon, want_sq);
  if (j < len)
    momentum64(s, plane, tabled, grad, dt, base, codes, vmag, vb1, vomb, len, m, j,
               tail_mask64(len - j), &acc, muon, want_sq);
  if (want_sq) {
    double t = gefen_sum_lanes16(acc.lo, acc.hi);
    if (dt == GEFEN_BF16) /* multiply-adds (block_avx512_common.h): a zero sum took only zeros */
      t = t != 0.0 && !gefen_bf16_sq_starts_ok16(grad, base, len)
              ? bf16_squares_f32(grad, base, len)
              : gefen_bf16_sq_settle(grad, base, len, t);
    *sq += t;
  }
  return _mm512_reduce_max_ps(acc.vmx);
}

INLINE float momentum_t(const gefen_quant_search *s, const void *grad, const gefen_dtype dt,
                        int64_t base, const uint8_t *codes, float mag_old, float beta1,
                        float one_minus_beta, int64_t len, float *m, double *sq,
                        const int muon, const int want_sq, const int packed) {
  const __m512 vmag = _mm512_set1_ps(mag_old), vb1 = _mm512_set1_ps(beta1),
               vomb = _mm512_set1_ps(one_minus_beta);
#if VALUE_TABLES
  if (len >= VALUE_MIN_LEN) {
    _Alignas(64) uint8_t plane[4][GEFEN_CODEBOOK_SIZE];
    momentum_values(s, vmag, vb1, muon, plane);
    return momentum_run(s, (planes_ptr)plane, 1, grad, dt, base, codes, vmag, vb1, vomb, len, m,
                        sq, muon, want_sq, packed);
  }
#endif
  return momentum_run(s, s->plane, 0, grad, dt, base, codes, vmag, vb1, vomb, len, m, sq, muon,
                      want_sq, packed);
}

TARGET static float adam_momentum(const void *grad, gefen_dtype dt, int64_t base,
                                  const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                                  float beta1, float one_minus_beta1, int64_t len, float *m,
                                  double *sq, int packed) {
  if (dt == GEFEN_F64)
    return gefen_block_ops_scalar.adam_momentum(grad, dt, base, codes, q, mag_old, beta1,
                                                one_minus_beta1, len, m, sq, 0);
  const gefen_quant_search *s = &q->search;
#define CALL(DT, SQ) \
  return momentum_t(s, grad, DT, base, codes, mag_old, beta1, one_minus_beta1, len, m, sq, 0, SQ, 0)
#define CALL_PACKED(SQ)                                                                       \
  return momentum_t(s, grad, GEFEN_BF16, base, codes, mag_old, beta1, one_minus_beta1, len, m, \
                    sq, 0, SQ, 1)
  if (PACKED_BF16 && packed && dt == GEFEN_BF16) {
    if (sq) CALL_PACKED(1);
    CALL_PACKED(0);
  }
  if (sq) {
    switch (dt) {
      case GEFEN_BF16: CALL(GEFEN_BF16, 1);
      case GEFEN_F16: CALL(GEFEN_F16, 1);
      default: CALL(GEFEN_F32, 1);
    }
  }
  switch (dt) {
    case GEFEN_BF16: CALL(GEFEN_BF16, 0);
    case GEFEN_F16: CALL(GEFEN_F16, 0);
    default: CALL(GEFEN_F32, 0);
  }
#undef CALL_PACKED
#undef CALL
}

TARGET static float muon_momentum(const void *grad, gefen_dtype dt, int64_t base,
                                  const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                                  float one_minus_beta, int64_t len, float *m) {
  if (dt == GEFEN_F64)
    return gefen_block_ops_scalar.muon_momentum(grad, dt, base, codes, q, mag_old,
                                                one_minus_beta, len, m);
  const gefen_quant_search *s = &q->search;
#define CALL(DT) \
  return momentum_t(s, grad, DT, base, codes, mag_old, 0.0f, one_minus_beta, len, m, NULL, 1, 0, 0)
  switch (dt) {
    case GEFEN_BF16: CALL(GEFEN_BF16);
    case GEFEN_F16: CALL(GEFEN_F16);
    default: CALL(GEFEN_F32);
  }
#undef CALL
}

/* --------------------------------------------------------- requantisation */

/* "u is above t": !(u <= t), so that NaN is above every threshold. */
#define ABOVE(u, t) _mm512_cmp_ps_mask((u), (t), _CMP_NLE_UQ)
#define SET_BIT(j, k, bit) _mm512_mask_or_epi32((j), (k), (j), _mm512_set1_epi32(bit))

/* The binary search of gefen_quant_search for 4 x 16 values (u against its
 * order[], or m against the thresholds scaled by scale_order): j[v] gets the
 * count's bits in reverse order, and level L reads the run of order at
 * GEFEN_LEVEL_AT(L). The four vectors go level by level so that their
 * dependency chains overlap. */
INLINE void search64(const float *order, const __m512 u[4], __m512i j[4]) {
  __mmask16 k6[4], k7[4];
  const __m512 t1 = _mm512_set1_ps(order[GEFEN_LEVEL_AT(1)]);
  for (int v = 0; v < 4; v++) j[v] = _mm512_maskz_mov_epi32(ABOVE(u[v], t1), _mm512_set1_epi32(1));
  for (int level = 2; level <= 5; level++) {
    const __m512 t = _mm512_loadu_ps(order + GEFEN_LEVEL_AT(level));
    for (int v = 0; v < 4; v++)
      j[v] = SET_BIT(j[v], ABOVE(u[v], _mm512_permutexvar_ps(j[v], t)), 1 << (level - 1));
  }
  const float *t6 = order + GEFEN_LEVEL_AT(6), *t7 = order + GEFEN_LEVEL_AT(7);
  const __m512 t6a = _mm512_loadu_ps(t6), t6b = _mm512_loadu_ps(t6 + 16);
  for (int v = 0; v < 4; v++) {
    k6[v] = ABOVE(u[v], _mm512_permutex2var_ps(t6a, j[v], t6b));
    j[v] = SET_BIT(j[v], k6[v], 32);
  }
  const __m512 t7a = _mm512_loadu_ps(t7), t7b = _mm512_loadu_ps(t7 + 16),
               t7c = _mm512_loadu_ps(t7 + 32), t7d = _mm512_loadu_ps(t7 + 48);
  for (int v = 0; v < 4; v++) {
    const __m512 lo = _mm512_permutex2var_ps(t7a, j[v], t7b);
    const __m512 hi = _mm512_permutex2var_ps(t7c, j[v], t7d);
    k7[v] = ABOVE(u[v], _mm512_mask_blend_ps(k6[v], lo, hi));
    j[v] = SET_BIT(j[v], k7[v], 64);
  }
  const float *t8 = order + GEFEN_LEVEL_AT(8);
  for (int v = 0; v < 4; v++) {
    /* entry (bit 6, bit 5, bits 0-4) of the reversed index: bits 5 and 6 are
     * the outcomes of levels 6 and 7 */
    const __m512 c0 = _mm512_permutex2var_ps(_mm512_loadu_ps(t8), j[v], _mm512_loadu_ps(t8 + 16));
    const __m512 c1 =
        _mm512_permutex2var_ps(_mm512_loadu_ps(t8 + 32), j[v], _mm512_loadu_ps(t8 + 48));
    const __m512 c2 =
        _mm512_permutex2var_ps(_mm512_loadu_ps(t8 + 64), j[v], _mm512_loadu_ps(t8 + 80));
    const __m512 c3 =
        _mm512_permutex2var_ps(_mm512_loadu_ps(t8 + 96), j[v], _mm512_loadu_ps(t8 + 112));
    const __m512 lo = _mm512_mask_blend_ps(k6[v], c0, c1), hi = _mm512_mask_blend_ps(k6[v], c2, c3);
    j[v] = SET_BIT(j[v], ABOVE(u[v], _mm512_mask_blend_ps(k7[v], lo, hi)), 128);
  }
}

/* The largest float below each lane (nextafter towards -inf); x is never NaN
 * or -inf here. */
INLINE __m512 float_below(__m512 x) {
  const __m512i b = _mm512_castps_si512(x), zero = _mm512_setzero_si512();
  const __mmask16 pos = _mm512_cmpgt_epi32_mask(b, zero); /* > +0, as integers */
  const __mmask16 zeros = _mm512_testn_epi32_mask(b, _mm512_set1_epi32(0x7fffffff));
  __m512i r = _mm512_add_epi32(b, _mm512_set1_epi32(1)); /* negative: away from zero */
  r = _mm512_mask_sub_epi32(r, pos, b, _mm512_set1_epi32(1));
  r = _mm512_mask_mov_epi32(r, zeros, _mm512_set1_epi32((int)0x80000001u)); /* -2^-149 */
  return _mm512_castsi512_ps(r);
}

/* The thresholds of s in m-space for the magnitude mx (finite, > 0), in
 * search order (GEFEN_SEARCH_ENTRIES of them): u > t exactly when
 * m > RD(b * mx), or m > float_below(RU(b * mx)) when a tie at b rounds up
 * (gefen_quant_search). From single_min_mx on, b * mx is rounded by one fused
 * multiply-add of t * mx and the exact h * mx (b = t + h, gefen_quant_search)
 * instead of a float64 product and two conversions: the same floats, in
 * 75-107 instead of 194 cycles a block on the Zen 4 VM with the ties as below
 * (requantise alone 1-3.5% less in cache; with the other per-block changes,
 * whole steps 0.6-3.7% less; docs/performance.md, "Per-block costs"). */
INLINE void scale_order(const gefen_quant_search *s, float mx, float *o) {
  const int single = mx >= s->single_min_mx;
  const __m512d vmxd = _mm512_set1_pd((double)mx);
  const __m512 vmx = _mm512_set1_ps(mx);
  for (int g = 0; g < GEFEN_SEARCH_ENTRIES / 16; g++) {
    const __mmask16 tie = s->tie_up[g];
    __m512 t;
    if (single && !s->single_off[g]) {
      /* h * mx (exact, normal) and, for a tie that rounds up, the float below it:
       * RD(t * mx + that) is the largest float below b * mx, float_below(RU(b *
       * mx)), as the step down (at most h * ulp(mx), the grid of the exact
       * product b * mx) is more than 0 and at most the gap below b * mx (a
       * normal float at least 2^24 h * mx / 2 in magnitude) */
      const __m512 h = _mm512_mul_ps(_mm512_loadu_ps(s->half_up + 16 * g), vmx);
      const __m512 c = _mm512_castsi512_ps(_mm512_mask_sub_epi32(
          _mm512_castps_si512(h), tie, _mm512_castps_si512(h), _mm512_set1_epi32(1)));
      t = _mm512_fmadd_round_ps(_mm512_loadu_ps(s->order + 16 * g), vmx, c,
                                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    } else {
      const __m512d lo = _mm512_mul_pd(_mm512_loadu_pd(s->bound + 16 * g), vmxd); /* exact */
      const __m512d hi = _mm512_mul_pd(_mm512_loadu_pd(s->bound + 16 * g + 8), vmxd);
      t = _mm512_insertf32x8(
          _mm512_castps256_ps512(_mm512_cvt_roundpd_ps(lo, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)),
          _mm512_cvt_roundpd_ps(hi, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), 1);
      if (tie) {
        const __m512 up = _mm512_insertf32x8(
            _mm512_castps256_ps512(_mm512_cvt_roundpd_ps(lo, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC)),
            _mm512_cvt_roundpd_ps(hi, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC), 1);
        t = _mm512_mask_mov_ps(t, tie, float_below(up));
      }
    }
    _mm512_storeu_ps(o + 16 * g, t);
  }
}

#if KEY_SEARCH
/* The search over 16-bit keys (a file with byte look-ups defines KEY_SEARCH
 * as 1): 32 lanes per vector instead of 16, then one exact comparison.
 *
 * key(x) = (int16) RN(min(x * r, S)) with r = S / mx (S = key_top, 32767 or
 * a little less: gefen_quant_search) is a non-decreasing function of x
 * (NaN: S), so for the scaled thresholds T of a block and their keys K =
 * key(T), K < key(m) implies m > T, and K > key(m) implies m <= T. With the
 * keys strictly increasing, the count c of keys below key(m) is the exact
 * count or one less, and the exact count is c + (m above T[c + 1]), which
 * only a lane whose key equals K[c + 1] can need: one comparison with that
 * threshold (key_ties, as m / mx against the unscaled one; key_codes_t looks
 * up T for every lane). The keys of a block are strictly increasing when the
 * thresholds are at least 2^-12 apart (key_ok: their keys are then about 4
 * or more apart, the rounding errors of T and of the key about 0.01; of the
 * thresholds, all in [-1, 1], at most one is close enough to 1 for T to take
 * the key S) and mx >= 2^-96 (T is then exact to far below a key unit).
 * Where every threshold t has t * S far enough from a half-integer
 * (key_fixed), K is RN(t * S) for every such mx: the quantiser's own keys,
 * and a block whose length is a multiple of 128 forms neither T nor K.
 * m and NaN have keys within -S..S; NaN's, S, is at least every
 * threshold's key, so c is 255, or 254 and a tie with the top threshold,
 * whose comparison (true for NaN: "not at most") makes it 255: NaN's code.
 * (The scale was 16384 / mx until the ties were settled apart: the finer
 * keys tie half as often.) */
typedef struct {
  /* the keys of the scaled thresholds in search order (gefen_quant_search's
   * order: level L's run at GEFEN_LEVEL_AT(L)), then 32 zeros, so that every
   * level's table can be read as 32 lanes: the quantiser's fixed keys
   * (key_fixed) or own[] */
  const int16_t *key;
  int16_t own[GEFEN_CODEBOOK_SIZE + 32];
  /* byte b of the scaled threshold at plane[b][j], j in search order: j is the
   * count's bits reversed for the threshold above that count */
  uint8_t plane[4][GEFEN_CODEBOOK_SIZE];
  /* the thresholds themselves (unscaled, in search order) and the block's
   * magnitude, for the ties (key_ties) */
  const float *order;
  float mx, r, top;
  /* the quantiser, where its look-up takes the first GEFEN_BUCKET_LEVELS levels
   * (key_levels_by_bucket; fixed keys only), else NULL */
  const gefen_quant_search *bucket;
} key_tables;

/* Blocks at least this long search with 16-bit keys (the tables cost about
 * 200 operations a block; in cache on Zen 4 the fused pass gained 9-21% at
 * 512-element blocks and nothing clear at 256). A block whose length is a
 * multiple of 128 and whose quantiser has fixed keys forms no tables: it
 * searches keys from 128 on (kernel_ab, in cache on Zen 4: blocks of 128,
 * 256 and 384 took 22-33% less than with the float search; docs/performance.md,
 * "Fixed keys, and float16 squares by multiply-adds"). */
#define KEY_MIN_LEN 512

/* The keys of 16 values x (above). clamp 0 where x holds no NaN (the sink's
 * m_has_no_nan): with mx finite, as every block of the key search has, x * r is
 * within about -S..S for every finite x (|x| <= mx), so the clamp changes no
 * key; only NaN needs it (without it, the integer indefinite: key -32768 and
 * code 0 instead of 255). One operation fewer per 16 (docs/performance.md,
 * "The keys without their clamp"). */
INLINE __m512i key16(__m512 x, __m512 vr, __m512 vtop, const int clamp) {
  const __m512 y = _mm512_mul_ps(x, vr);
  return _mm512_cvtps_epi32(clamp ? _mm512_min_ps(y, vtop) : y);
}

/* The key tables of a block with magnitude mx: the quantiser's fixed keys,
 * or the keys of its scaled thresholds t (scale_order); the byte planes of t
 * only with planes (key_codes_t reads them, for the groups of a block after
 * its last whole 128: a block whose length is a multiple of 128 has none,
 * and skips the 48 shuffles of the split). t is read only when the keys are
 * not fixed or with planes. */
INLINE void key_setup(const gefen_quant_search *s, const float *t, float mx, key_tables *kt,
                      const int planes) {
  kt->top = s->key_top;
  kt->r = s->key_top / mx;
  kt->mx = mx;
  kt->order = s->order;
  kt->key = s->key;
  kt->bucket = s->key_fixed && s->key_bucket ? s : NULL;
  if (!s->key_fixed) {
    const __m512 vr = _mm512_set1_ps(kt->r), vtop = _mm512_set1_ps(kt->top);
    for (int g = 0; g < GEFEN_CODEBOOK_SIZE / 16; g++)
      _mm256_storeu_si256((__m256i *)(kt->own + 16 * g),
                          _mm512_cvtsepi32_epi16(key16(_mm512_loadu_ps(t + 16 * g), vr, vtop, 1)));
    _mm512_storeu_si512(kt->own + GEFEN_CODEBOOK_SIZE, _mm512_setzero_si512());
    kt->key = kt->own;
  }
  if (planes) split_planes(t, kt->plane); /* the thresholds in their own order */
}

/* Groups of 64 per search step at most: 2 x KEY_GROUPS chains of 32 keys
 * overlap. A level (permute, compare into a mask, masked add) is a chain of
 * about 11 cycles on Zen 4, so a step of few chains waits on latency; with
 * 8 chains instead of 4 the 16-bit block steps there took 4-10% less with
 * two threads, fp32 the same (docs/performance.md, "The key search's
 * chains"); 16 would not fit in the 32 vector registers. */
#ifndef KEY_GROUPS
#define KEY_GROUPS 4
#endif
_Static_assert(KEY_GROUPS >= 2 && KEY_GROUPS <= 4,
               "KEY_GROUPS: 2 to 4 groups (the passes of two groups share its arrays)");

/* The first GEFEN_BUCKET_LEVELS levels of key_search by the quantiser's
 * look-up (s->key_bucket; n even): the count of the levels' keys below the
 * bucket of each key q's high byte, then key_bucket comparisons with the next
 * of them, each adding one where q is above it; j gets the count's bits
 * reversed and ub the key above it, as the levels would leave them. Per 32
 * keys about 3.5 operations for the look-up (7 byte permutes and blends per
 * 64), 3 per comparison and 1 each for ub and j: about 11.5 with one
 * comparison against the six levels' 23 (docs/performance.md, "The first
 * levels by one look-up"). */
INLINE void key_levels_by_bucket(const gefen_quant_search *s, const int n, const __m512i *q,
                                 __m512i *j, __m512i *ub) {
  /* the high bytes of q[v] (byte 2 w + 1: bytes 0..31) and q[v + 1] (bytes 32..63) */
  static const _Alignas(64) uint8_t high[64] = {
      1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
      45, 47, 49, 51, 53, 55, 57, 59, 61, 63, 65, 67, 69, 71, 73, 75, 77, 79, 81, 83, 85, 87,
      89, 91, 93, 95, 97, 99, 101, 103, 105, 107, 109, 111, 113, 115, 117, 119, 121, 123, 125, 127};
  /* the counts of bytes 0..31 (32..63) to the low bytes of words 0..31 */
  static const _Alignas(64) uint8_t low[2][64] = {
      {0,  0, 1,  0, 2,  0, 3,  0, 4,  0, 5,  0, 6,  0, 7,  0, 8,  0, 9,  0, 10, 0,
       11, 0, 12, 0, 13, 0, 14, 0, 15, 0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0,
       22, 0, 23, 0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31, 0},
      {32, 0, 33, 0, 34, 0, 35, 0, 36, 0, 37, 0, 38, 0, 39, 0, 40, 0, 41, 0, 42, 0,
       43, 0, 44, 0, 45, 0, 46, 0, 47, 0, 48, 0, 49, 0, 50, 0, 51, 0, 52, 0, 53, 0,
       54, 0, 55, 0, 56, 0, 57, 0, 58, 0, 59, 0, 60, 0, 61, 0, 62, 0, 63, 0}};
  const __mmask64 even = 0x5555555555555555ull;
  __m512i c[2 * KEY_GROUPS];
  for (int v = 0; v < n; v += 2) {
    const __m512i h = _mm512_permutex2var_epi8(q[v], _mm512_load_si512(high), q[v + 1]);
    const __m512i below =
        _mm512_permutex2var_epi8(_mm512_loadu_si512(s->bucket_count), h,
                                 _mm512_loadu_si512(s->bucket_count + 64));
    const __m512i above =
        _mm512_permutex2var_epi8(_mm512_loadu_si512(s->bucket_count + 128), h,
                                 _mm512_loadu_si512(s->bucket_count + 192));
    const __m512i b = _mm512_mask_blend_epi8(_mm512_movepi8_mask(h), below, above);
    c[v] = _mm512_maskz_permutexvar_epi8(even, _mm512_load_si512(low[0]), b);
    c[v + 1] = _mm512_maskz_permutexvar_epi8(even, _mm512_load_si512(low[1]), b);
  }
  /* the 64-entry tables (entries from 2^GEFEN_BUCKET_LEVELS on are never read) */
  const __m512i next0 = _mm512_loadu_si512(s->bucket_key),
                next1 = _mm512_loadu_si512(s->bucket_key + 32);
  for (int f = 0; f < s->key_bucket; f++)
    for (int v = 0; v < n; v++) {
      const __m512i probe = _mm512_permutex2var_epi16(next0, c[v], next1);
      const __mmask32 k = _mm512_cmpgt_epi16_mask(q[v], probe);
      c[v] = _mm512_mask_add_epi16(c[v], k, c[v], _mm512_set1_epi16(1));
    }
  const __m512i above0 = _mm512_loadu_si512(s->bucket_above),
                above1 = _mm512_loadu_si512(s->bucket_above + 32);
  const __m512i rev0 = _mm512_loadu_si512(s->bucket_rev),
                rev1 = _mm512_loadu_si512(s->bucket_rev + 32);
  for (int v = 0; v < n; v++) {
    ub[v] = _mm512_permutex2var_epi16(above0, c[v], above1);
    j[v] = _mm512_permutex2var_epi16(rev0, c[v], rev1);
  }
}

/* The counts of keys below each of n x 32 keys q[] (bits reversed, as
 * search64), level by level over the n vectors so that their chains overlap;
 * tie[v]: the lanes whose key equals the key above their count, the one case
 * the keys cannot decide (key_codes_t, key_ties). That key is the last one on
 * the lane's path that was not below it (in a binary search, the successor of
 * the final interval is its last left turn), so each level keeps it by a
 * blend, from -32768, which no key is (m's and the thresholds' keys are
 * within -S..S, S <= 32767). bucket (a constant at each call): the first
 * GEFEN_BUCKET_LEVELS levels by kt->bucket's look-up (key_levels_by_bucket). */
INLINE void key_search(const key_tables *kt, const int n, const __m512i *q, __m512i *j,
                       __mmask32 *tie, const int bucket) {
  const int16_t *w = kt->key;
  __mmask32 k7[2 * KEY_GROUPS];
  __m512i ub[2 * KEY_GROUPS];
  int first = 2; /* the first level of the binary search's loops */
  if (bucket) {
    key_levels_by_bucket(kt->bucket, n, q, j, ub);
    first = GEFEN_BUCKET_LEVELS + 1;
  } else {
    const __m512i t1 = _mm512_set1_epi16(w[GEFEN_LEVEL_AT(1)]);
    for (int v = 0; v < n; v++) {
      const __mmask32 k = _mm512_cmpgt_epi16_mask(q[v], t1);
      j[v] = _mm512_maskz_mov_epi16(k, _mm512_set1_epi16(1));
      ub[v] = _mm512_mask_mov_epi16(t1, k, _mm512_set1_epi16(-32768));
    }
  }
  for (int level = first; level <= 6; level++) {
    const __m512i t = _mm512_loadu_si512(w + GEFEN_LEVEL_AT(level));
    for (int v = 0; v < n; v++) {
      const __m512i probe = _mm512_permutexvar_epi16(j[v], t);
      const __mmask32 k = _mm512_cmpgt_epi16_mask(q[v], probe);
      j[v] = _mm512_mask_add_epi16(j[v], k, j[v], _mm512_set1_epi16((short)(1 << (level - 1))));
      ub[v] = _mm512_mask_mov_epi16(probe, k, ub[v]);
    }
  }
  for (int v = 0; v < n; v++) {
    const __m512i probe = _mm512_permutex2var_epi16(_mm512_loadu_si512(w + GEFEN_LEVEL_AT(7)), j[v],
                                                    _mm512_loadu_si512(w + GEFEN_LEVEL_AT(7) + 32));
    k7[v] = _mm512_cmpgt_epi16_mask(q[v], probe);
    j[v] = _mm512_mask_add_epi16(j[v], k7[v], j[v], _mm512_set1_epi16(64));
    ub[v] = _mm512_mask_mov_epi16(probe, k7[v], ub[v]);
  }
  for (int v = 0; v < n; v++) {
    const __m512i lo =
        _mm512_permutex2var_epi16(_mm512_loadu_si512(w), j[v], _mm512_loadu_si512(w + 32));
    const __m512i hi =
        _mm512_permutex2var_epi16(_mm512_loadu_si512(w + 64), j[v], _mm512_loadu_si512(w + 96));
    const __m512i probe = _mm512_mask_blend_epi16(k7[v], lo, hi);
    const __mmask32 k = _mm512_cmpgt_epi16_mask(q[v], probe);
    j[v] = _mm512_mask_add_epi16(j[v], k, j[v], _mm512_set1_epi16(128));
    tie[v] = _mm512_cmpeq_epi16_mask(q[v], _mm512_mask_mov_epi16(probe, k, ub[v]));
  }
}

/* Ties settled after the search (requantize_keys, the whole groups of a
 * block): the search of a chunk's groups stores their counts as codes and
 * records their tied lanes (key_counts64); key_ties then adds one to the code
 * of each tied lane whose m is above the threshold above its count, in
 * scalar code, before any of the chunk's codes is decoded. About 0.6% of
 * lanes tie (measured with fresh gradients; with the same gradient every
 * step, as the benchmarks give, fewer: m stays near its code); the look-up of
 * that threshold in every lane by byte planes (key_codes_t, still used for
 * the last groups of a block) costs more (docs/performance.md, "Ties settled
 * in scalar code"). */

/* G whole groups of m at m[0..64 G) searched: their counts stored as codes
 * (element order) at codes[0..64 G), and each group's tied lanes in tie[h]:
 * bit 32 s + w for word w of its vector q[2 h + s] (key_ties). m in the
 * packed order where packed (the codes are not). no_nan: m holds no NaN
 * (key16 without its clamp). */
INLINE void key_counts64(const key_tables *kt, const int G, const float *m, uint8_t *codes,
                         const int packed, uint64_t *tie, const int no_nan) {
  const __m512 vr = _mm512_set1_ps(kt->r), vtop = _mm512_set1_ps(kt->top);
  __m512i q[2 * KEY_GROUPS], j[2 * KEY_GROUPS];
  __mmask32 t[2 * KEY_GROUPS];
  /* the packs interleave 4-lane groups exactly as codes_t_of does */
  for (int v = 0; v < 2 * G; v++)
    q[v] = _mm512_packs_epi32(key16(_mm512_loadu_ps(m + 32 * v), vr, vtop, !no_nan),
                              key16(_mm512_loadu_ps(m + 32 * v + 16), vr, vtop, !no_nan));
  if (kt->bucket)
    key_search(kt, 2 * G, q, j, t, 1);
  else
    key_search(kt, 2 * G, q, j, t, 0);
  for (int h = 0; h < G; h++) {
    const __m512i c_t = reverse_bits(_mm512_packus_epi16(j[2 * h], j[2 * h + 1]));
    if (PACKED_BF16 && packed)
      store_packed_t(c_t, codes + 64 * h);
    else
      store_t(c_t, codes + 64 * h, ~(__mmask64)0);
    tie[h] = (uint64_t)t[2 * h] | (uint64_t)t[2 * h + 1] << 32;
  }
}

/* The tied lanes of n groups (key_counts64) settled: u = m[i] / mx above the
 * threshold above the count (the reference rule itself; thresholds in search
 * order: at the count's bits reversed) adds one to the code. Bit 32 s + w of
 * a group's tie word is its element at vector 2 s + (w >> 2 & 1), lane 4 (w
 * >> 3) + (w & 3), of m (the packs' order); the code's element is that one,
 * or in the packed order vector v, lane i is element 32 (v / 2) + 2 i + v %
 * 2. "Above" is "not at most", so that a NaN tied with the top threshold
 * takes code 255. (A division per tied lane, about 0.6% of them, instead of
 * the block's scaled thresholds: with fixed keys a block whose length is a
 * multiple of 128 forms neither those nor their keys.) */
INLINE void key_ties(const key_tables *kt, const uint64_t *tie, int64_t n, const float *m,
                     uint8_t *codes, const int packed) {
  const float *t = kt->order, mx = kt->mx;
  for (int64_t g = 0; g < n; g++)
    for (uint64_t k = tie[g]; k; k &= k - 1) {
      const int b = __builtin_ctzll(k);
      const int v = 2 * (b >> 5) + (b >> 2 & 1), lane = 4 * (b >> 3 & 3) + (b & 3);
      const int64_t mi = 64 * g + 16 * v + lane;
      const int64_t ci = packed ? 64 * g + 32 * (v >> 1) + 2 * lane + (v & 1) : mi;
      const uint8_t c = codes[ci];
      codes[ci] = (uint8_t)(c + !(m[mi] / mx <= t[gefen_bit_reverse8(c)]));
    }
}

/* The codes of g groups (1 or 2) of 4 x 16 values m (element order) in the
 * transposed order of decode64. */
INLINE void key_codes_t(const key_tables *kt, const int g, const __m512 *m,
                        __m512i *codes_t) {
  const __m512 vr = _mm512_set1_ps(kt->r), vtop = _mm512_set1_ps(kt->top);
  __m512i q[2 * KEY_GROUPS], j[2 * KEY_GROUPS];
  /* the packs interleave 4-lane groups exactly as codes_t_of does */
  for (int v = 0; v < 2 * g; v++)
    q[v] = _mm512_packs_epi32(key16(m[2 * v], vr, vtop, 1), key16(m[2 * v + 1], vr, vtop, 1));
  __mmask32 tie[2 * KEY_GROUPS];
  key_search(kt, 2 * g, q, j, tie, 0); /* (tie unused: every lane is compared below) */
  for (int h = 0; h < g; h++) {
    /* the count's code and the threshold above it, both by its reversed bits */
    const __m512i bits_t = _mm512_packus_epi16(j[2 * h], j[2 * h + 1]);
    const __m512i c_t = reverse_bits(bits_t);
    __m512 t[4];
    lookup_planes64((const uint8_t(*)[GEFEN_CODEBOOK_SIZE])kt->plane, bits_t, t);
    /* the comparisons as 0/1 in the transposed order, by the packs of codes_t_of */
    __m512i up[4];
    for (int v = 0; v < 4; v++)
      up[v] = _mm512_maskz_mov_epi32(ABOVE(m[4 * h + v], t[v]), _mm512_set1_epi32(1));
    const __m512i up_t = _mm512_packus_epi16(_mm512_packus_epi32(up[0], up[1]),
                                             _mm512_packus_epi32(up[2], up[3]));
    codes_t[h] = _mm512_adds_epu8(c_t, up_t);
  }
}
#endif

/* What a sink forms from a code's value c = C[code] before any operand of the
 * element enters (a function of the code alone within a block: value tables,
 * above): mq = c * mx, times s and lr for a block Adam sink (its lr * delta),
 * times beta for a Nesterov GefenMuon output. */
INLINE __m512 sink_code_value(const gefen_sink *sk, const gefen_sink_kind kind, __m512 vmx,
                              __m512 c) {
  const __m512 mq = _mm512_mul_ps(c, vmx);
  if (kind == GEFEN_SINK_ADAM_BLOCK)
    return _mm512_mul_ps(_mm512_set1_ps(sk->lr), _mm512_mul_ps(mq, _mm512_set1_ps(sk->s)));
  if (kind == GEFEN_SINK_MUON && sk->nesterov) return _mm512_mul_ps(_mm512_set1_ps(sk->beta), mq);
  return mq;
}

/* One vector of the sink's code values cv (sink_code_value) at element i of the
 * block to the sink (kind, dt and out_dt are constants after inlining). */
INLINE void sink16(const gefen_sink *sk, const gefen_sink_kind kind, const gefen_dtype dt,
                   const gefen_dtype out_dt, float *m, int64_t i, __m512 cv, __mmask16 k) {
  const int64_t at = sk->base + i;
  switch (kind) {
    case GEFEN_SINK_M:
      _mm512_mask_storeu_ps(m + i, k, cv);
      break;
    case GEFEN_SINK_ADAM_BLOCK: {
      const __m512 p = gefen_load16(sk->out, out_dt, at, k);
      store16(sk->out, out_dt, at, adam_param_of(p, sk->decay, cv), k);
      break;
    }
    case GEFEN_SINK_ADAM_FACTORED: {
      /* the divider is free here (no u = m / mx) */
      const __m512 s = _mm512_div_ps(
          _mm512_set1_ps(sk->inv_bc1),
          _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(sk->s), _mm512_maskz_loadu_ps(k, sk->scol + i)),
                        _mm512_set1_ps(sk->eps)));
      const __m512 p = gefen_load16(sk->out, out_dt, at, k);
      store16(sk->out, out_dt, at, adam_param16(p, sk->decay, sk->lr, _mm512_mul_ps(cv, s)), k);
      break;
    }
    case GEFEN_SINK_MUON: {
      __m512 o = cv;
      if (sk->nesterov)
        o = _mm512_add_ps(cv, _mm512_mul_ps(_mm512_set1_ps(sk->one_minus_beta),
                                            gefen_load16(sk->grad, dt, at, k)));
      store16(sk->out, out_dt, at, o, k);
      break;
    }
    case GEFEN_SINK_CODES: /* no values are formed (requantize64) */
      break;
  }
}

#if PACKED_BF16
/* A whole group's code values cv (sink_code_value; packed order) to an Adam
 * sink of a bfloat16 parameter: sink16's operations, the column factors of a
 * factored sink taken in the packed order by two permutes per 32. */
INLINE void sink64_packed(const gefen_sink *sk, const gefen_sink_kind kind, int64_t j,
                          const __m512 cv[4]) {
  __m512 p[4], s[4] = {0};
  load64_bf16_packed(sk->out, sk->base + j, p);
  for (int h = 0; h < 2; h++) {
    if (kind == GEFEN_SINK_ADAM_FACTORED) {
      const __m512 a = _mm512_loadu_ps(sk->scol + j + 32 * h),
                   b = _mm512_loadu_ps(sk->scol + j + 32 * h + 16);
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      const __m512 scol[2] = {_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b)};
      for (int e = 0; e < 2; e++)
        s[2 * h + e] = _mm512_div_ps(
            _mm512_set1_ps(sk->inv_bc1),
            _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(sk->s), scol[e]), _mm512_set1_ps(sk->eps)));
    }
  }
  __m512 out[4];
  for (int v = 0; v < 4; v++)
    out[v] = kind == GEFEN_SINK_ADAM_BLOCK
                 ? adam_param_of(p[v], sk->decay, cv[v])
                 : adam_param16(p[v], sk->decay, sk->lr, _mm512_mul_ps(cv[v], s[v]));
  store64_bf16_packed(sk->out, sk->base + j, out);
}
#endif

/* 64 elements (or the first ones of km) of the requantisation pass at j
 * (km all ones, a constant, for whole groups: see momentum64). */
/* mode: how the search gets u = m / mx (see requantize_t). */
enum { BY_ZERO, BY_DIVISION, BY_SCALED_LEVELS, BY_KEYS };

#if !KEY_SEARCH
typedef void key_tables;
#endif

/* The decoded values c of a group at j to the sink: C[code], whose code
 * values the sink forms here, or (tabled) those code values already, from a
 * block's value table. A whole group of a bfloat16 Adam sink goes in the
 * packed order when packed. */
INLINE void sink_values64(const gefen_sink *sk, const gefen_sink_kind kind, const gefen_dtype dt,
                          const gefen_dtype out_dt, float *m, __m512 vmx, int64_t j,
                          __mmask64 km, const int packed, const int tabled, __m512 c[4]) {
  if (!tabled)
    for (int v = 0; v < 4; v++) c[v] = sink_code_value(sk, kind, vmx, c[v]);
#if PACKED_BF16
  if (packed) {
    sink64_packed(sk, kind, j, c);
    return;
  }
#else
  (void)packed;
#endif
  for (int v = 0; v < 4; v++) {
    const __mmask16 k = part_mask(km, v);
    if (k) sink16(sk, kind, dt, out_dt, m, j + 16 * v, c[v], k);
  }
}

#if VALUE_TABLES
/* A block's sink_code_value of every code, as byte planes. */
INLINE void sink_values(const gefen_quant_search *s, const gefen_sink *sk,
                        const gefen_sink_kind kind, __m512 vmx,
                        uint8_t (*plane)[GEFEN_CODEBOOK_SIZE]) {
  _Alignas(64) float t[GEFEN_CODEBOOK_SIZE];
  for (int g = 0; g < GEFEN_CODEBOOK_SIZE / 16; g++)
    _mm512_store_ps(t + 16 * g, sink_code_value(sk, kind, vmx, _mm512_loadu_ps(s->value_of + 16 * g)));
  split_planes(t, plane);
}
#endif

#if KEY_SEARCH
/* 64 codes (transposed order) at j stored, and their values to the sink: the
 * entries of vt, the block's value table (tabled) or the codebook's planes. */
INLINE void emit64(planes_ptr vt, const int tabled, __m512i codes_t, float *m, __m512 vmx,
                   uint8_t *codes, const gefen_sink *sk, const gefen_sink_kind kind,
                   const gefen_dtype dt, const gefen_dtype out_dt, int64_t j, __mmask64 km,
                   const int packed) {
  __m512 c[4];
  if (kind == GEFEN_SINK_CODES) {
    store_t(codes_t, codes + j, km);
    return;
  }
  if (PACKED_BF16 && packed) {
    store_and_decode64_packed_t(vt, codes_t, codes + j, c);
  } else {
    store_t(codes_t, codes + j, km);
    lookup_planes64(vt, codes_t, c);
  }
  sink_values64(sk, kind, dt, out_dt, m, vmx, j, km, packed, tabled, c);
}

/* Elements per chunk of the key passes (requantize_keys): a chunk's search,
 * its ties, then its decoding; its m and codes stay in L1. In cache on Zen 4
 * 512 and 1024 measured alike, 256 and 2048 slower. */
#define KEY_CHUNK 1024
_Static_assert(KEY_CHUNK % (64 * KEY_GROUPS) == 0, "KEY_CHUNK: whole search steps");

/* The whole groups of [j, end) (end - j a multiple of 128, at most KEY_CHUNK)
 * by the key search, KEY_GROUPS groups per step (then 2) so that their chains
 * overlap: the counts and ties (key_counts64), the ties settled (key_ties),
 * then each group's codes decoded (vt: the block's value table where tabled,
 * else the codebook's planes) to the sink. m in the packed order where
 * packed. */
INLINE void requantize_keys(planes_ptr vt, const int tabled, const key_tables *kt, float *m,
                            __m512 vmx, int64_t len, uint8_t *codes, const gefen_sink *sk,
                            const gefen_sink_kind kind, const gefen_dtype dt,
                            const gefen_dtype out_dt, int64_t j, int64_t end, const int packed,
                            const int no_nan) {
  uint64_t tie[KEY_CHUNK / 64];
  int64_t i = j;
  for (; i + 64 * KEY_GROUPS <= end; i += 64 * KEY_GROUPS)
    key_counts64(kt, KEY_GROUPS, m + i, codes + i, packed, tie + (i - j) / 64, no_nan);
  for (; i < end; i += 128)
    key_counts64(kt, 2, m + i, codes + i, packed, tie + (i - j) / 64, no_nan);
  key_ties(kt, tie, (end - j) / 64, m + j, codes + j, packed);
  if (kind == GEFEN_SINK_CODES) return;
  for (i = j; i < end; i += 64) {
    if (kind != GEFEN_SINK_M)
      gefen_prefetch(sk->out, gefen_esz(out_dt), sk->base + i + len, 64);
    __m512 c[4];
    if (PACKED_BF16 && packed)
      decode_codes64_packed(vt, codes + i, c);
    else
      decode_codes64_with(vt, codes + i, ~(__mmask64)0, c);
    sink_values64(sk, kind, dt, out_dt, m, vmx, i, ~(__mmask64)0, packed, tabled, c);
  }
}
#endif

INLINE void requantize64(const gefen_quant_search *s, const float *order,
                         const key_tables *kt, planes_ptr vt, const int tabled, float *m,
                         __m512 vmx, const int mode,
                         int64_t len, uint8_t *codes,
                         const gefen_sink *sk, const gefen_sink_kind kind, const gefen_dtype dt,
                         const gefen_dtype out_dt, int64_t j, __mmask64 km, const int packed) {
  if (kind != GEFEN_SINK_M && kind != GEFEN_SINK_CODES)
    gefen_prefetch(sk->out, gefen_esz(out_dt), sk->base + j + len, 64);
  __m512 u[4];
  __m512i bits[4];
  for (int v = 0; v < 4; v++) {
    const __m512 x = _mm512_maskz_loadu_ps(part_mask(km, v), m + j + 16 * v);
    u[v] = mode == BY_SCALED_LEVELS || mode == BY_KEYS ? x
           : mode == BY_DIVISION                         ? _mm512_div_ps(x, vmx)
                                                         : _mm512_setzero_ps();
  }
  __m512 c[4];
#if KEY_SEARCH
  if (mode == BY_KEYS) {
    __m512i codes_t;
    key_codes_t(kt, 1, u, &codes_t);
    emit64(vt, tabled, codes_t, m, vmx, codes, sk, kind, dt, out_dt, j, km, packed);
    return;
  }
#else
  (void)kt;
  (void)vt;
  (void)tabled;
#endif
  search64(order, u, bits);
  if (kind == GEFEN_SINK_CODES) { /* the codes alone: no decoding */
    store_codes64(s, bits, codes + j, km);
    return;
  }
#if VALUE_TABLES
  if (tabled) {
    emit64(vt, 1, codes_t_of(bits), m, vmx, codes, sk, kind, dt, out_dt, j, km, packed);
    return;
  }
#endif
#if PACKED_BF16
  if (packed) /* a whole group of a bfloat16 Adam sink: m and u in the packed order */
    store_and_decode64_packed(s, bits, codes + j, c);
  else
#endif
    store_and_decode64(s, bits, codes + j, km, c);
  sink_values64(sk, kind, dt, out_dt, m, vmx, j, km, packed, 0, c);
}

INLINE void requantize_t(const gefen_quantizer *q, float *m, float mx, int64_t len,
                         uint8_t *codes, const gefen_sink *sink, const gefen_sink_kind kind,
                         const gefen_dtype dt, const gefen_dtype out_dt, const int packed) {
  const gefen_quant_search *s = &q->search;
  /* a copy, so that the stores below (which may alias anything) do not make
   * the compiler read the sink's fields again for every vector */
  const gefen_sink sink_copy = *sink, *sk = &sink_copy;
  const __m512 vmx = _mm512_set1_ps(mx);
  /* u = 0 everywhere (NaN included) when mx is 0; for a long block with a
   * finite mx, the thresholds scaled by mx instead of a division per element
   * (about 10 cycles per 16 lanes, the scaling about 100 per block) */
  _Alignas(64) float scaled[GEFEN_SEARCH_ENTRIES];
  const float *order = s->order;
#if KEY_SEARCH
  _Alignas(64) key_tables keys;
  const key_tables *kt = &keys;
  /* blocks of the scaled searches from VALUE_MIN_LEN on decode a value table */
  _Alignas(64) uint8_t values[4][GEFEN_CODEBOOK_SIZE];
  int tabled = 0;
#else
  const key_tables *kt = NULL;
#endif
  planes_ptr vt = s->plane;
  int mode = BY_DIVISION;
  if (!(mx > 0.0f)) {
    mode = BY_ZERO;
  } else if (len >= SCALED_MIN_LEN && mx <= FLT_MAX && !(_mm_getcsr() & 0x8040u)) {
    /* not with MXCSR's FTZ or DAZ set: scaled thresholds can be subnormal, which
     * FTZ flushes when they are formed and DAZ reads as 0 in the compares, where
     * the portable code divides first (test_kernels.c, under_daz) */
    mode = BY_SCALED_LEVELS;
#if KEY_SEARCH
    if (len >= (s->key_fixed && len % 128 == 0 ? 128 : KEY_MIN_LEN) && s->key_search &&
        mx >= 0x1p-96f) {
      /* the scaled thresholds only for keys of their own or for the groups
       * after the last whole 128 (key_codes_t) */
      mode = BY_KEYS;
      const int partial = len % 128 != 0;
      if (partial || !s->key_fixed) scale_order(s, mx, scaled);
      key_setup(s, scaled, mx, &keys, partial);
    } else
#endif
    {
      scale_order(s, mx, scaled);
      order = scaled;
    }
#if KEY_SEARCH
    if (len >= VALUE_MIN_LEN && kind != GEFEN_SINK_CODES) {
      sink_values(s, sk, kind, vmx, values);
      vt = (planes_ptr)values;
      tabled = 1;
    }
#endif
  }
#if KEY_SEARCH
/* the keys without their clamp only for the Adam sinks, whose callers know
 * (gefen_m_has_no_nan): the other kinds keep one version of the passes */
#define KEY_PASSES_WITH(TABLED, NO_NAN)                                                    \
  for (const int64_t whole = len / 128 * 128; j < whole; j += KEY_CHUNK)                  \
    requantize_keys(vt, TABLED, kt, m, vmx, len, codes, sk, kind, dt, out_dt, j,            \
                    j + KEY_CHUNK < whole ? j + KEY_CHUNK : whole, packed, NO_NAN)
#define KEY_PASSES(MODE, TABLED)                                                           \
  if (MODE == BY_KEYS) {                                                                   \
    if ((kind == GEFEN_SINK_ADAM_BLOCK || kind == GEFEN_SINK_ADAM_FACTORED) &&            \
        sk->m_has_no_nan)                                                                  \
      KEY_PASSES_WITH(TABLED, 1);                                                          \
    else                                                                                   \
      KEY_PASSES_WITH(TABLED, 0);                                                          \
    j = len / 128 * 128;                                                                   \
  }
#else
#define KEY_PASSES(MODE, TABLED) (void)0
#endif
#define PASS(MODE, TABLED)                                                                  \
  do {                                                                                      \
    int64_t j = 0;                                                                          \
    KEY_PASSES(MODE, TABLED);                                                               \
    for (; j + 64 <= len; j += 64)                                                          \
      requantize64(s, order, kt, vt, TABLED, m, vmx, MODE, len, codes, sk, kind, dt, out_dt, \
                   j, ~(__mmask64)0, packed);                                               \
    if (j < len) /* the tail in element order, as momentum_t leaves it */                    \
      requantize64(s, order, kt, vt, TABLED, m, vmx, MODE, len, codes, sk, kind, dt, out_dt, \
                   j, tail_mask64(len - j), 0);                                             \
  } while (0)
#if KEY_SEARCH
  if (mode == BY_KEYS && tabled)
    PASS(BY_KEYS, 1);
  else if (mode == BY_KEYS)
    PASS(BY_KEYS, 0);
  else if (mode == BY_SCALED_LEVELS && tabled)
    PASS(BY_SCALED_LEVELS, 1);
  else
#endif
  if (mode == BY_SCALED_LEVELS)
    PASS(BY_SCALED_LEVELS, 0);
  else if (mode == BY_DIVISION)
    PASS(BY_DIVISION, 0);
  else
    PASS(BY_ZERO, 0);
#undef PASS
#undef KEY_PASSES
#undef KEY_PASSES_WITH
  if (kind == GEFEN_SINK_ADAM_BLOCK || kind == GEFEN_SINK_ADAM_FACTORED || kind == GEFEN_SINK_MUON)
    store_nans_after(sk->out, out_dt, sk->base, len);
}

TARGET static void requantize_apply(const gefen_quantizer *q, float *m, float mx, int64_t len,
                                    uint8_t *codes, const gefen_sink *sk) {
  const gefen_sink_kind kind = sk->kind;
  const gefen_dtype out_dt = sk->out_dtype, dt = sk->dtype;
  if ((kind != GEFEN_SINK_M && kind != GEFEN_SINK_CODES && out_dt == GEFEN_F64) ||
      (kind == GEFEN_SINK_MUON && sk->nesterov && dt == GEFEN_F64)) {
    /* float64 parameters and gradients: the portable arithmetic */
    const gefen_sink to_m = {.kind = GEFEN_SINK_M};
    requantize_t(q, m, mx, len, codes, &to_m, GEFEN_SINK_M, GEFEN_F32, GEFEN_F32, 0);
    gefen_sink_apply(gefen_block_ops_avx512(), m, len, sk);
    return;
  }
#define CALL(KIND, DT, ODT)                                    \
  requantize_t(q, m, mx, len, codes, sk, KIND, DT, ODT, 0); \
  return
#define BY_OUT(KIND, DT)                                                       \
  switch (out_dt) {                                                           \
    case GEFEN_BF16:                                                          \
      if (PACKED_BF16 && sk->packed) {                                        \
        requantize_t(q, m, mx, len, codes, sk, KIND, DT, GEFEN_BF16, 1);      \
        return;                                                               \
      }                                                                       \
      CALL(KIND, DT, GEFEN_BF16);                                             \
    case GEFEN_F16: CALL(KIND, DT, GEFEN_F16);                                \
    default: CALL(KIND, DT, GEFEN_F32);                                       \
  }
  switch (kind) {
    case GEFEN_SINK_M: CALL(GEFEN_SINK_M, GEFEN_F32, GEFEN_F32);
    case GEFEN_SINK_CODES: CALL(GEFEN_SINK_CODES, GEFEN_F32, GEFEN_F32);
    case GEFEN_SINK_ADAM_BLOCK: BY_OUT(GEFEN_SINK_ADAM_BLOCK, GEFEN_F32)
    case GEFEN_SINK_ADAM_FACTORED: BY_OUT(GEFEN_SINK_ADAM_FACTORED, GEFEN_F32)
    case GEFEN_SINK_MUON:
      if (out_dt == GEFEN_BF16) {
        switch (dt) {
          case GEFEN_BF16: CALL(GEFEN_SINK_MUON, GEFEN_BF16, GEFEN_BF16);
          case GEFEN_F16: CALL(GEFEN_SINK_MUON, GEFEN_F16, GEFEN_BF16);
          default: CALL(GEFEN_SINK_MUON, GEFEN_F32, GEFEN_BF16);
        }
      }
      switch (dt) {
        case GEFEN_BF16: CALL(GEFEN_SINK_MUON, GEFEN_BF16, GEFEN_F32);
        case GEFEN_F16: CALL(GEFEN_SINK_MUON, GEFEN_F16, GEFEN_F32);
        default: CALL(GEFEN_SINK_MUON, GEFEN_F32, GEFEN_F32);
      }
  }
#undef BY_OUT
#undef CALL
}

TARGET static void requantize(const gefen_quantizer *q, float *m, float mx, int64_t len,
                              uint8_t *codes) {
  const gefen_sink to_m = {.kind = GEFEN_SINK_M};
  requantize_t(q, m, mx, len, codes, &to_m, GEFEN_SINK_M, GEFEN_F32, GEFEN_F32, 0);
}


/* dequantize_apply: 64 codes at j (or the first ones of km) decoded, times
 * mag, to the sink (an Adam sink; kind and out_dt are constants after
 * inlining). mq = C[code] * mag is the product requantize64 forms. */
INLINE void dequantize64(const gefen_quant_search *s, planes_ptr plane, const int tabled,
                         const uint8_t *codes, __m512 vmag, int64_t len, const gefen_sink *sk,
                         const gefen_sink_kind kind, const gefen_dtype out_dt, int64_t j,
                         __mmask64 km) {
  gefen_prefetch(codes, 1, j + len, 64); /* the next block */
  gefen_prefetch(sk->out, gefen_esz(out_dt), sk->base + j + len, 64);
  __m512 c[4];
  decode_either64(s, plane, tabled, codes + j, km, c);
  for (int v = 0; v < 4; v++) {
    const __mmask16 k = part_mask(km, v);
    if (k)
      sink16(sk, kind, GEFEN_F32, out_dt, NULL, j + 16 * v,
             tabled ? c[v] : sink_code_value(sk, kind, vmag, c[v]), k);
  }
}

INLINE void dequantize_run(const gefen_quant_search *s, planes_ptr plane, const int tabled,
                           const uint8_t *codes, __m512 vmag, int64_t len, const gefen_sink *sk,
                           const gefen_sink_kind kind, const gefen_dtype out_dt) {
  int64_t j = 0;
  for (; j + 64 <= len; j += 64)
    dequantize64(s, plane, tabled, codes, vmag, len, sk, kind, out_dt, j, ~(__mmask64)0);
  if (j < len)
    dequantize64(s, plane, tabled, codes, vmag, len, sk, kind, out_dt, j, tail_mask64(len - j));
  store_nans_after(sk->out, out_dt, sk->base, len);
}

INLINE void dequantize_t(const gefen_quantizer *q, const uint8_t *codes, float mag, int64_t len,
                         const gefen_sink *sink, const gefen_sink_kind kind,
                         const gefen_dtype out_dt) {
  const gefen_quant_search *s = &q->search;
  const gefen_sink sink_copy = *sink, *sk = &sink_copy; /* as in requantize_t */
  const __m512 vmag = _mm512_set1_ps(mag);
#if VALUE_TABLES
  if (len >= VALUE_MIN_LEN) {
    _Alignas(64) uint8_t plane[4][GEFEN_CODEBOOK_SIZE];
    sink_values(s, sk, kind, vmag, plane);
    dequantize_run(s, (planes_ptr)plane, 1, codes, vmag, len, sk, kind, out_dt);
    return;
  }
#endif
  dequantize_run(s, s->plane, 0, codes, vmag, len, sk, kind, out_dt);
}

TARGET static void dequantize_apply(const gefen_quantizer *q, const uint8_t *codes, float mag,
                                    int64_t len, float *m, const gefen_sink *sk) {
  const gefen_sink_kind kind = sk->kind;
  const gefen_dtype out_dt = sk->out_dtype;
  if ((kind != GEFEN_SINK_ADAM_BLOCK && kind != GEFEN_SINK_ADAM_FACTORED) ||
      out_dt == GEFEN_F64) { /* the portable decoding (float64 parameters: their arithmetic) */
    gefen_dequantize_apply_with(gefen_block_ops_avx512(), q, codes, mag, len, m, sk);
    return;
  }
#define CALL(KIND, ODT)                                 \
  dequantize_t(q, codes, mag, len, sk, KIND, ODT); \
  return
#define BY_OUT(KIND)                         \
  switch (out_dt) {                         \
    case GEFEN_BF16: CALL(KIND, GEFEN_BF16); \
    case GEFEN_F16: CALL(KIND, GEFEN_F16);   \
    default: CALL(KIND, GEFEN_F32);          \
  }
  if (kind == GEFEN_SINK_ADAM_BLOCK) BY_OUT(GEFEN_SINK_ADAM_BLOCK)
  BY_OUT(GEFEN_SINK_ADAM_FACTORED)
#undef BY_OUT
#undef CALL
}


/* ------------------------------------------------ blocks of one element */

/* adam_period1: 64 elements at j (or the first ones of km), each its own
 * block. Per lane, the operations of the per-block path with len 1:
 * momentum64 (m, and max|m| over one element: |m|, or 0 when m is NaN, as
 * vmaxps returns its second operand then), the second moment and step size of
 * block_chunk (the block's sum of squares is g * g: one float64 lane holding
 * a float, divided by P = 1 and rounded back), and requantize64 in its modes
 * for short blocks: u = m / mx (BY_DIVISION) where mx > 0, u = 0 (BY_ZERO)
 * elsewhere, unscaled thresholds, mq = C[code] * mx to the block sink. The
 * momentum and the parameter update are the same helpers (momentum_code_value
 * and momentum_of, adam_param16) as those of momentum64 and sink16. */
INLINE void period1_64(const gefen_quant_search *s, const gefen_period1 *a, const gefen_dtype dt,
                       int64_t j, __mmask64 km) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 c[4], u[4], mx[4], step[4];
  __m512i bits[4];
  decode_codes64(s, a->codes + j, km, c);
  for (int v = 0; v < 4; v++) {
    const __mmask16 k = part_mask(km, v);
    const int64_t i = j + 16 * v;
    const __m512 g = gefen_load16(a->grad, dt, i, k);
    const __m512 cv = momentum_code_value(c[v], _mm512_maskz_loadu_ps(k, a->magnitude + i),
                                          _mm512_set1_ps(a->beta1), 0);
    const __m512 x = momentum_of(cv, _mm512_set1_ps(a->one_minus_beta1), g, 0);
    mx[v] = _mm512_max_ps(_mm512_abs_ps(x), zero); /* NaN never wins */
    _mm512_mask_storeu_ps(a->magnitude + i, k, mx[v]);
    const __m512 vm =
        _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(a->beta2), _mm512_maskz_loadu_ps(k, a->vmean + i)),
                      _mm512_mul_ps(_mm512_set1_ps(a->one_minus_beta2), _mm512_mul_ps(g, g)));
    _mm512_mask_storeu_ps(a->vmean + i, k, vm);
    step[v] = _mm512_div_ps(_mm512_set1_ps(a->inv_bc1),
                            _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vm), _mm512_set1_ps(a->rs_bc2)),
                                          _mm512_set1_ps(a->eps)));
    u[v] = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(mx[v], zero, _CMP_GT_OQ), x, mx[v]);
  }
  search64(s->order, u, bits);
  store_and_decode64(s, bits, a->codes + j, km, c);
  for (int v = 0; v < 4; v++) {
    const __mmask16 k = part_mask(km, v);
    const int64_t i = j + 16 * v;
    const __m512 delta = _mm512_mul_ps(_mm512_mul_ps(c[v], mx[v]), step[v]);
    const __m512 p = gefen_load16(a->param, dt, i, k);
    store16(a->param, dt, i, adam_param16(p, a->decay, a->lr, delta), k);
  }
}

INLINE void period1_t(const gefen_quantizer *q, const gefen_period1 *a, const gefen_dtype dt,
                      int64_t base, int64_t n) {
  const gefen_quant_search *s = &q->search;
  int64_t j = base;
  for (; j + 64 <= base + n; j += 64) period1_64(s, a, dt, j, ~(__mmask64)0);
  if (j < base + n) period1_64(s, a, dt, j, tail_mask64(base + n - j));
  store_nans_after(a->param, dt, base, n);
}

TARGET static void adam_period1(const gefen_quantizer *q, const gefen_period1 *a, int64_t base,
                                int64_t n) {
  switch (a->dtype) {
    case GEFEN_BF16: period1_t(q, a, GEFEN_BF16, base, n); return;
    case GEFEN_F16: period1_t(q, a, GEFEN_F16, base, n); return;
    default: period1_t(q, a, GEFEN_F32, base, n); return; /* float32 (adam.c: never float64) */
  }
}
