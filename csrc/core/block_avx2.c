/* AVX2 versions of the block primitives (see block_ops.h), 8 lanes, for the
 * x86-64 CPUs without AVX-512 (AMD before Zen 4, Intel client CPUs). The fp32
 * operations and their order match block_scalar.c exactly, so every output
 * agrees with it bit for bit:
 *  - no fused multiply-add but the exact ones written out (float16 squares,
 *    add_squares); every build passes -ffp-contract=off, as for the AVX-512
 *    tables, so the compiler contracts nothing;
 *  - float16 through F16C, which rounds to nearest even like gefen_f32_to_f16
 *    and makes a NaN a NaN of the same sign, but keeps payload bits that the
 *    portable conversion drops: each function that stores float16 makes the
 *    NaNs of its block the canonical quiet NaN of their sign afterwards
 *    (f16_canonical_nans; a block seldom has one);
 *  - bfloat16 by the integer rounding of gefen_f32_to_bf16, NaN rule included;
 *    the block form's bfloat16 steps keep m in a packed order of their own
 *    (load16_bf16_packed) so that their loads and stores need no shuffles;
 *  - sums of g^2 in the canonical lanes of block_ops.h: 16 elements at a time
 *    into four float64 vectors holding lanes 0-3, 4-7, 8-11 and 12-15;
 *  - tails (fewer than 8 elements) go through the portable primitive or the
 *    portable operations on the same lanes.
 *
 * The nearest-code search is the lookup table of quantizer.c, read by scalar
 * loads instead of gathers (a gather of 8 lanes costs about 10 cycles on Zen 3
 * and more where microcode guards it against Gather Data Sampling): the
 * bucket's candidate k by one byte load per lane, then the 16-byte row of k
 * (value[k], value[k + 1], k and the threshold between them) by one load per
 * lane, the 8 rows transposed into vectors. Where the codebook allows it
 * (gefen_quantizer.coarse_div, every learned codebook measured so far) the row
 * comes in one load per lane from a table of rows by coarse bucket (8 to 64
 * KiB, 32 to 4 lookup buckets a row), without the byte load of k: the fp32
 * block step about 16% faster in cache on Zen 3. With distinct entries the
 * code is k + (u > threshold[k + 1]), the count of gefen_quant_search; with
 * repeated entries the |u - v| comparison of the table, then gathers of the code and
 * value at 2 * k + (u > value[k]), and a group of 8 holding a NaN (u outside
 * [-1, 1]) is left to the portable code. The block goes through in chunks of
 * two passes (division and buckets, then look-ups), so that the look-ups do
 * not wait on the division's latency. */
#include "block_ops.h"
#include "kernel_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,f16c,fma")))
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

/* fp32 -> bfloat16 as gefen_f32_to_bf16 (round to nearest even, NaN kept quiet),
 * the result in the high 16 bits of each 32-bit lane (the low 16 are not cleared). */
INLINE __m256i bf16_high(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

/* fp32 -> bfloat16 bits, in order. */
INLINE __m128i to_bf16(__m256 v) {
  const __m256i r = _mm256_srli_epi32(bf16_high(v), 16);
  /* every 32-bit lane is <= 0xffff, so the unsigned-saturating pack is exact */
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* The packed order of bfloat16 Adam steps (adam_momentum's and the Adam sinks'
 * packed): m holds each whole group of 16 elements of a block as its even
 * elements 0, 2, ..., 14, then its odd ones 1, 3, ..., 15. The group's 32
 * bytes of bfloat16 then load as one vector whose low halves (shifted up) are
 * the even elements and whose high halves (masked) the odd ones, and store
 * back the same way: no shuffles (two per 8 values each way in element
 * order). The codes stay in element order. */
INLINE void load16_bf16_packed(const void *p, int64_t i, __m256 *even, __m256 *odd) {
  const __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)p + i));
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}

INLINE void store16_bf16_packed(void *p, int64_t i, __m256 even, __m256 odd) {
  const __m256i lo = _mm256_srli_epi32(bf16_high(even), 16);
  const __m256i hi = _mm256_and_si256(bf16_high(odd), _mm256_set1_epi32((int)0xffff0000u));
  _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)p + i), _mm256_or_si256(lo, hi));
}

/* After float16 stores by store8 to p[i, i + n) (dt a constant): the NaNs
 * there made sign | 0x7e00, as gefen_f32_to_f16 makes them (F16C turns a NaN
 * into a NaN of the same sign with payload bits, and nothing else into a NaN).
 * The block is read 16 values at a time for any NaN and rewritten only when it
 * has one: cheaper than the canonical NaN formed for every vector (float16
 * block step in cache -2.8% without it, Zen 4). */
INLINE void f16_canonical_nans(void *p, const gefen_dtype dt, int64_t i, int64_t n) {
  if (dt != GEFEN_F16) return;
  uint16_t *h = (uint16_t *)p + i;
  __m256i acc = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) { /* 2h above 0xf800 (2 * 0x7c00): a NaN */
    const __m256i x = _mm256_loadu_si256((const __m256i *)(void *)(h + j));
    acc = _mm256_max_epu16(acc, _mm256_add_epi16(x, x));
  }
  const __m256i nan_min = _mm256_set1_epi16((short)0xf801);
  int any = _mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_max_epu16(acc, nan_min), acc)) != 0;
  for (; j < n; j++) any |= (h[j] & 0x7fffu) > 0x7c00u;
  if (!any) return;
  for (j = 0; j < n; j++)
    if ((h[j] & 0x7fffu) > 0x7c00u) h[j] = (uint16_t)((h[j] & 0x8000u) | 0x7e00u);
}

INLINE void store8(void *p, gefen_dtype dt, int64_t i, __m256 v) {
  switch (dt) {
    case GEFEN_BF16:
      _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_bf16(v));
      break;
    case GEFEN_F16:
      /* NaNs as F16C leaves them (f16_canonical_nans) */
      _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
      break;
    default:
      _mm256_storeu_ps((float *)p + i, v);
      break;
  }
}

INLINE __m256 abs8(__m256 v) {
  return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
}

/* Prefetches the line of element i of a buffer of esz-byte elements (into L2).
 * The passes work through blocks in address order and fetch the block after
 * this one (i = j + len) while working on it, as the AVX-512 kernels do
 * (gefen_prefetch): the hardware prefetchers alone leave each pass waiting on
 * memory. A prefetch past the end of a buffer is harmless (no fault). */
INLINE void prefetch_at(const void *p, size_t esz, int64_t i) {
  _mm_prefetch((const char *)p + (size_t)i * esz, _MM_HINT_T1);
}

INLINE size_t esz_of(gefen_dtype dt) { return dt == GEFEN_F32 ? 4 : 2; }

/* The Adam sinks' constants as vectors (gefen_sink). */
typedef struct {
  __m256 s, inv_bc1, eps, decay, lr;
} adam_vectors;

INLINE adam_vectors adam_vectors_of(float s, float inv_bc1, float eps, float decay, float lr) {
  return (adam_vectors){_mm256_set1_ps(s), _mm256_set1_ps(inv_bc1), _mm256_set1_ps(eps),
                        _mm256_set1_ps(decay), _mm256_set1_ps(lr)};
}

/* The factored step sizes inv_bc1 / (srow * scol[j] + eps) of 8 elements (c->s is srow). */
INLINE __m256 factored_s8(const adam_vectors *c, const float *scol) {
  return _mm256_div_ps(c->inv_bc1, _mm256_add_ps(_mm256_mul_ps(c->s, _mm256_loadu_ps(scol)), c->eps));
}

/* lr * (mq * s): what the Adam update subtracts (for a block sink, a function
 * of the code alone: the read-once decoding's value table). */
INLINE __m256 lr_delta8(__m256 mq, __m256 s, const adam_vectors *c) {
  return _mm256_mul_ps(c->lr, _mm256_mul_ps(mq, s));
}

/* p * decay - lrd, lrd = lr_delta8(...). */
INLINE __m256 adam_update_of8(__m256 p, __m256 lrd, const adam_vectors *c) {
  return _mm256_sub_ps(_mm256_mul_ps(p, c->decay), lrd);
}

/* p * decay - lr * (mq * s): the Adam update of 8 parameters. */
INLINE __m256 adam_update8(__m256 p, __m256 mq, __m256 s, const adam_vectors *c) {
  return adam_update_of8(p, lr_delta8(mq, s, c), c);
}

/* p = p * decay - lr * (mq * s) for the 8 parameters at i. */
INLINE void update8(void *param, gefen_dtype dt, int64_t i, __m256 mq, __m256 s,
                    const adam_vectors *c) {
  store8(param, dt, i, adam_update8(load8(param, dt, i), mq, s, c));
}

/* An Adam sink's update of the 8 elements at j of its block from their mq. */
INLINE void sink8(const gefen_sink *sk, const gefen_sink_kind kind, const gefen_dtype dt,
                  const adam_vectors *c, int64_t j, __m256 mq) {
  const __m256 s = kind == GEFEN_SINK_ADAM_FACTORED ? factored_s8(c, sk->scol + j) : c->s;
  update8(sk->out, dt, sk->base + j, mq, s, c);
}

/* The sink of the elements from j of its block on (for the portable tails). */
INLINE gefen_sink sink_from(const gefen_sink *sk, int64_t j) {
  gefen_sink tail = *sk;
  tail.base += j;
  if (tail.scol) tail.scol += j;
  return tail;
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

/* The 8 values of g as float64: lanes 0-3 in a, 4-7 in b. */
INLINE void widen_pd(__m256 g, __m256d *a, __m256d *b) {
  *a = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
  *b = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
}

/* Adds g^2 of the 8 values g (of dtype dt) to the float64 lanes lo and hi, as
 * add_lanes(lo, hi, g * g). For float16 g by multiply-adds of g widened to
 * float64: its square (at most 22 bits, 2^-48 to 2^32) is exact in float32,
 * so RN(acc + (double)RN32(g * g)) = RN(acc + g * g), with no float32
 * product (gefen_fma_squares16 in block_avx512_common.h, the same for
 * AVX-512). bfloat16 and fp32 squares can round or overflow in float32 and
 * keep the product. */
INLINE void add_squares(__m256d *lo, __m256d *hi, __m256 g, const gefen_dtype dt) {
  if (dt != GEFEN_F16) {
    add_lanes(lo, hi, _mm256_mul_ps(g, g));
    return;
  }
  __m256d a, b;
  widen_pd(g, &a, &b);
  *lo = _mm256_fmadd_pd(a, a, *lo);
  *hi = _mm256_fmadd_pd(b, b, *hi);
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

/* C[codes[0]], C[codes[stride]], ..., C[codes[7 * stride]]: scalar loads, not a
 * gather (a gather of 8 costs about 10 cycles on Zen 3, and more where
 * microcode guards it). Stride 2: the even or odd codes of a packed group. */
INLINE __m256 decode8(const float *cb, const uint8_t *codes, const int stride) {
  return _mm256_setr_ps(cb[codes[0]], cb[codes[stride]], cb[codes[2 * stride]],
                        cb[codes[3 * stride]], cb[codes[4 * stride]], cb[codes[5 * stride]],
                        cb[codes[6 * stride]], cb[codes[7 * stride]]);
}

/* Value tables: within a block, beta1 * (C[code] * mag_old) (Gefen) and
 * C[code] * mag_old (GefenMuon) depend on the code alone. A block of at least
 * VALUE_MIN_LEN elements forms them once for the 256 codes, by the same
 * operations, and decodes them instead of C[code] (tabled below): the same
 * bits, two or one multiplications fewer per 8 elements (docs/performance.md,
 * "Value tables per block"). */
#define VALUE_MIN_LEN 1024

/* The part of the momentum that depends on the code's value c alone: mo = c *
 * mag_old (GefenMuon), beta1 * mo (Gefen). */
INLINE __m256 momentum_code8(__m256 c, __m256 vmag, __m256 vb1, const int muon) {
  const __m256 mo = _mm256_mul_ps(c, vmag);
  return muon ? mo : _mm256_mul_ps(vb1, mo);
}

INLINE void momentum_table(const float *cb, float mag_old, float beta1, const int muon, float *t) {
  const __m256 vmag = _mm256_set1_ps(mag_old), vb1 = _mm256_set1_ps(beta1);
  for (int i = 0; i < GEFEN_CODEBOOK_SIZE; i += 8)
    _mm256_storeu_ps(t + i, momentum_code8(_mm256_loadu_ps(cb + i), vmag, vb1, muon));
}

/* m = beta1 * (C[code] * mag_old) + (1 - beta1) * g of 8 elements from their
 * gradients g and decoded codes c (tabled: c is already beta1 * (C[code] *
 * mag_old)), stored at m; returns |m|. */
INLINE __m256 adam8(__m256 g, __m256 c, __m256 vmag, __m256 vb1, __m256 vomb1, float *m,
                    const int tabled) {
  const __m256 cv = tabled ? c : momentum_code8(c, vmag, vb1, 0);
  const __m256 v = _mm256_add_ps(cv, _mm256_mul_ps(vomb1, g));
  _mm256_storeu_ps(m, v);
  return abs8(v);
}

/* The same for the 8 elements at j of a block in element order, loading their
 * gradients (to *g_out) and codes (decoded through cb). */
INLINE __m256 adam8_at(const void *grad, gefen_dtype dt, int64_t base, const uint8_t *codes,
                       const float *cb, int64_t j, __m256 vmag, __m256 vb1, __m256 vomb1,
                       float *m, __m256 *g_out, const int tabled) {
  const __m256 g = load8(grad, dt, base + j);
  *g_out = g;
  return adam8(g, decode8(cb, codes + j, 1), vmag, vb1, vomb1, m + j, tabled);
}

/* The Adam momentum pass; with packed (bfloat16 only) its whole groups of 16 in
 * the packed order (see load16_bf16_packed). The sums of g^2 go to the
 * canonical lanes either way: in the packed order acc[0] and acc[1] hold the
 * even lanes (0, 2, 4, 6 and 8, ..., 14), acc[2] and acc[3] the odd ones. */
INLINE float adam_momentum_run(const void *grad, const gefen_dtype dt, int64_t base,
                               const uint8_t *codes, const float *cb, const float *tb,
                               const int tabled, float mag_old, float beta1,
                               float one_minus_beta1, int64_t len, float *m, double *sq,
                               const int packed) {
  const __m256 vmag = _mm256_set1_ps(mag_old), vb1 = _mm256_set1_ps(beta1),
               vomb1 = _mm256_set1_ps(one_minus_beta1);
  __m256 vmx = _mm256_setzero_ps(), g0, g1;
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    prefetch_at(grad, esz_of(dt), base + j + len); /* the next block */
    if (dt == GEFEN_F32) prefetch_at(grad, 4, base + j + len + 8);
    if (j % 64 == 0) prefetch_at(codes, 1, j + len);
    if (packed) {
      load16_bf16_packed(grad, base + j, &g0, &g1);
      /* max(a, vmx) keeps vmx when a is NaN: NaN never wins */
      vmx = _mm256_max_ps(
          adam8(g0, decode8(tb, codes + j, 2), vmag, vb1, vomb1, m + j, tabled), vmx);
      vmx = _mm256_max_ps(
          adam8(g1, decode8(tb, codes + j + 1, 2), vmag, vb1, vomb1, m + j + 8, tabled), vmx);
    } else {
      vmx = _mm256_max_ps(
          adam8_at(grad, dt, base, codes, tb, j, vmag, vb1, vomb1, m, &g0, tabled), vmx);
      vmx = _mm256_max_ps(
          adam8_at(grad, dt, base, codes, tb, j + 8, vmag, vb1, vomb1, m, &g1, tabled), vmx);
    }
    add_squares(&acc[0], &acc[1], g0, dt);
    add_squares(&acc[2], &acc[3], g1, dt);
  }
  if (!packed && len - j >= 8) { /* lanes 0-7 */
    vmx = _mm256_max_ps(
        adam8_at(grad, dt, base, codes, tb, j, vmag, vb1, vomb1, m, &g0, tabled), vmx);
    add_squares(&acc[0], &acc[1], g0, dt);
    j += 8;
  }
  double lanes[GEFEN_SUM_LANES];
  if (packed) {
    double even[8], odd[8];
    _mm256_storeu_pd(even, acc[0]);
    _mm256_storeu_pd(even + 4, acc[1]);
    _mm256_storeu_pd(odd, acc[2]);
    _mm256_storeu_pd(odd + 4, acc[3]);
    for (int l = 0; l < 8; l++) {
      lanes[2 * l] = even[l];
      lanes[2 * l + 1] = odd[l];
    }
  } else {
    for (int a = 0; a < 4; a++) _mm256_storeu_pd(lanes + 4 * a, acc[a]);
  }
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

INLINE float adam_momentum_t(const void *grad, const gefen_dtype dt, int64_t base,
                             const uint8_t *codes, const float *cb, float mag_old, float beta1,
                             float one_minus_beta1, int64_t len, float *m, double *sq,
                             const int packed) {
  if (len >= VALUE_MIN_LEN) {
    _Alignas(32) float tb[GEFEN_CODEBOOK_SIZE];
    momentum_table(cb, mag_old, beta1, 0, tb);
    return adam_momentum_run(grad, dt, base, codes, cb, tb, 1, mag_old, beta1, one_minus_beta1,
                             len, m, sq, packed);
  }
  return adam_momentum_run(grad, dt, base, codes, cb, cb, 0, mag_old, beta1, one_minus_beta1, len,
                           m, sq, packed);
}

/* Whether a bfloat16 Adam step with this quantiser keeps m in the packed order
 * when asked to (packed): for block sinks only (the factored sink would need
 * its column factors split into even and odd, four shuffles per 16, which
 * cost what the packed loads and stores save: the factored update of the
 * 16.8M set +1.6 to +2.0% packed, the block update -2.8 to -3.6%, Zen 3); with
 * the searches of distinct entries, whose groups requantize_chunk never leaves
 * to the portable code (which reads m in element order); not without an exact
 * table (the portable requantisation). */
static int packs(const gefen_quantizer *q, gefen_dtype dt, int packed);

TARGET static float adam_momentum(const void *grad, gefen_dtype dt, int64_t base,
                                  const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                                  float beta1, float one_minus_beta1, int64_t len, float *m,
                                  double *sq, int packed) {
  if (dt == GEFEN_F64)
    return gefen_block_ops_scalar.adam_momentum(grad, dt, base, codes, q, mag_old, beta1,
                                                one_minus_beta1, len, m, sq, 0);
  const float *cb = q->table.codebook;
  if (packs(q, dt, packed))
    return adam_momentum_t(grad, GEFEN_BF16, base, codes, cb, mag_old, beta1, one_minus_beta1,
                           len, m, sq, 1);
#define CALL(DT)                                                                            \
  return adam_momentum_t(grad, DT, base, codes, cb, mag_old, beta1, one_minus_beta1, len, m, \
                         sq, 0)
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

INLINE float muon_momentum_run(const void *grad, const gefen_dtype dt, int64_t base,
                               const uint8_t *codes, const gefen_quantizer *q, const float *tb,
                               const int tabled, float mag_old, float one_minus_beta,
                               int64_t len, float *m) {
  const __m256 vmag = _mm256_set1_ps(mag_old), vomb = _mm256_set1_ps(one_minus_beta);
  __m256 vmx = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    if (j % 16 == 0) prefetch_at(grad, esz_of(dt), base + j + len); /* the next block */
    if (j % 64 == 0) prefetch_at(codes, 1, j + len);
    const __m256 g = load8(grad, dt, base + j);
    const __m256 c = decode8(tb, codes + j, 1);
    const __m256 mo = tabled ? c : momentum_code8(c, vmag, _mm256_setzero_ps(), 1);
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

INLINE float muon_momentum_t(const void *grad, const gefen_dtype dt, int64_t base,
                             const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                             float one_minus_beta, int64_t len, float *m) {
  const float *cb = q->table.codebook;
  if (len >= VALUE_MIN_LEN) {
    _Alignas(32) float tb[GEFEN_CODEBOOK_SIZE];
    momentum_table(cb, mag_old, 0.0f, 1, tb);
    return muon_momentum_run(grad, dt, base, codes, q, tb, 1, mag_old, one_minus_beta, len, m);
  }
  return muon_momentum_run(grad, dt, base, codes, q, cb, 0, mag_old, one_minus_beta, len, m);
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

/* The 8 int32 lanes of c, each saturated to 0..255, in order, to dst[0..8). */
INLINE void store_codes8(uint8_t *dst, __m256i c) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64((__m128i *)dst, _mm_packus_epi16(w, w));
}

/* How requantize_chunk finds a value's row: the search of a codebook with
 * repeated entries (the lookup bucket's k, then the distance comparison), or
 * of one with distinct entries through the lookup bucket's k or through the
 * coarse bucket's row directly (gefen_quantizer.crow, when coarse_div > 0). */
enum { SEARCH_REPEATED, SEARCH_DISTINCT, SEARCH_COARSE };

/* The rows (gefen_quantizer.row) of the buckets idx[0..8) as vectors: the
 * candidates value[k] and value[k + 1], k itself and, when thr is not NULL,
 * threshold[k + 1]. With k = bucket[idx[l]], a lane's bucket entry then its
 * 16-byte row; with coarse buckets the row at byte offset idx[l] of crow in
 * one load (see the top of this file). The 8 rows transposed. */
INLINE void lookup8(const gefen_quantizer *q, const int32_t *idx, const int coarse, __m256 *v0,
                    __m256 *v1, __m256i *k, __m256 *thr) {
  const uint8_t *bucket = q->table.bucket;
  const char *crow = (const char *)q->crow;
#define ROW(l) \
  _mm_load_ps(coarse ? (const float *)(const void *)(crow + idx[l]) : q->row[bucket[idx[l]]])
  const __m256 a0 = _mm256_insertf128_ps(_mm256_castps128_ps256(ROW(0)), ROW(4), 1);
  const __m256 a1 = _mm256_insertf128_ps(_mm256_castps128_ps256(ROW(1)), ROW(5), 1);
  const __m256 a2 = _mm256_insertf128_ps(_mm256_castps128_ps256(ROW(2)), ROW(6), 1);
  const __m256 a3 = _mm256_insertf128_ps(_mm256_castps128_ps256(ROW(3)), ROW(7), 1);
#undef ROW
  const __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);
  const __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
  *v0 = _mm256_shuffle_ps(t0, t2, 0x44);
  *v1 = _mm256_shuffle_ps(t0, t2, 0xee);
  *k = _mm256_castps_si256(_mm256_shuffle_ps(t1, t3, 0x44));
  if (thr) *thr = _mm256_shuffle_ps(t1, t3, 0xee);
}

/* The nearest codes of the 8 values u at m whose buckets are at idx, and
 * codebook[code] in *val (NaN only with distinct entries). */
INLINE __m256i nearest8(const gefen_quantizer *q, const float *m, const int32_t *idx,
                        const int search, __m256 *val_out) {
  const __m256 u = _mm256_loadu_ps(m);
  __m256 v0, v1;
  __m256i k;
  if (search != SEARCH_REPEATED) {
    /* code k + 1 exactly when u > threshold[k + 1]; NaN (not excluded here)
     * goes up too, from row 254 or 255 to code 255 or 256 (255 as a byte) and
     * value[255] */
    __m256 thr;
    lookup8(q, idx, search == SEARCH_COARSE, &v0, &v1, &k, &thr);
    const __m256 up = _mm256_cmp_ps(u, thr, _CMP_NLE_UQ); /* !(u <= thr) */
    *val_out = _mm256_blendv_ps(v0, v1, up);
    return _mm256_sub_epi32(k, _mm256_castps_si256(up)); /* all-ones lanes: k + 1 */
  }
  lookup8(q, idx, 0, &v0, &v1, &k, NULL);
  const __m256 d0 = abs8(_mm256_sub_ps(u, v0)), d1 = abs8(_mm256_sub_ps(u, v1));
  const __m256 up = _mm256_cmp_ps(d0, d1, _CMP_NLE_UQ); /* !(d0 <= d1) */
  k = _mm256_sub_epi32(k, _mm256_castps_si256(up));   /* all-ones lanes: k + 1 */
  const __m256 val = _mm256_blendv_ps(v0, v1, up);    /* value[k] */
  /* repeated entries: first code at or below value[k], last above */
  const __m256i above = _mm256_castps_si256(_mm256_cmp_ps(u, val, _CMP_GT_OQ));
  const __m256i sel = _mm256_sub_epi32(_mm256_add_epi32(k, k), above);
  *val_out = _mm256_i32gather_ps(q->sel_value, sel, 4);
  return gather_u8(q->sel_code, sel);
}

/* Where requantize_chunk sends the 8 values mq of the block's elements at j
 * (m + j is where they are in the chunk): back into m (GEFEN_SINK_M) or to an
 * Adam sink. */
INLINE void emit8(float *m, __m256 mq, const gefen_sink *sk, const gefen_sink_kind kind,
                  const gefen_dtype dt, const adam_vectors *c, int64_t j) {
  if (kind == GEFEN_SINK_M)
    _mm256_storeu_ps(m, mq);
  else
    sink8(sk, kind, dt, c, j, mq);
}

/* One group of 8 of requantize_chunk's second pass on its own: the portable
 * code when it holds a NaN (m is still m then), else as nearest8. */
INLINE void group_slow(const gefen_quantizer *q, float *m, float mx, uint8_t *codes,
                       const int search, const int32_t *idx, uint32_t nan, const gefen_sink *sk,
                       const gefen_sink_kind kind, const gefen_dtype dt, const adam_vectors *c,
                       int64_t j) {
  if (nan) {
    gefen_block_ops_scalar.requantize(q, m, mx, 8, codes);
    if (kind != GEFEN_SINK_M) sink8(sk, kind, dt, c, j, _mm256_loadu_ps(m));
    return;
  }
  __m256 val;
  const __m256i code = nearest8(q, m, idx, search, &val);
  emit8(m, _mm256_mul_ps(val, _mm256_set1_ps(mx)), sk, kind, dt, c, j);
  store_codes8(codes, code);
}

/* The int32 lanes of a then b, each saturated to 0..255, in order, to dst[0..16). */
INLINE void store_codes16(uint8_t *dst, __m256i a, __m256i b) {
  /* words a0-3 b0-3 | a4-7 b4-7, then bytes: dwords a0-3 b0-3 (same) | a4-7 b4-7 (same) */
  const __m256i w = _mm256_packus_epi32(a, b), c = _mm256_packus_epi16(w, w);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5);
  _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c, order)));
}

/* The codes of a packed group (a: its even elements, b: its odd ones), each
 * saturated to 0..255, in element order to dst[0..16). */
INLINE void store_codes16_packed(uint8_t *dst, __m256i a, __m256i b) {
  /* a0 b0 a1 b1 | a4 b4 a5 b5 and a2 b2 a3 b3 | a6 b6 a7 b7, then as store_codes16
   * but taking both lanes' first 8 bytes in turn */
  const __m256i lo = _mm256_unpacklo_epi32(a, b), hi = _mm256_unpackhi_epi32(a, b);
  const __m256i w = _mm256_packus_epi32(lo, hi), c = _mm256_packus_epi16(w, w);
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 0, 1, 4, 5);
  _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c, order)));
}

/* A block sink's update of a packed group at j of its block (bfloat16
 * parameters) from the group's mq, even elements and odd ones. */
INLINE void sink16_packed(const gefen_sink *sk, const adam_vectors *c, int64_t j,
                          __m256 mq_even, __m256 mq_odd) {
  __m256 p_even, p_odd;
  load16_bf16_packed(sk->out, sk->base + j, &p_even, &p_odd);
  store16_bf16_packed(sk->out, sk->base + j, adam_update8(p_even, mq_even, c->s, c),
                      adam_update8(p_odd, mq_odd, c->s, c));
}

/* Elements per chunk of the requantisation's two passes (a multiple of 8 and at
 * most 32 groups, one bit each in a mask). */
#define CHUNK 256

/* Requantises m[0..n), n <= CHUNK a multiple of 8, in two passes, so that the
 * table look-ups of one group do not wait on the division of the same group
 * (one pass per group left the loop bound by that chain's latency):
 *  1. u = m / mx into m and the bucket of each u into idx (the lookup
 *     bucket, or the coarse row's byte offset in crow); with repeated
 *     entries a group holding a NaN (u outside [-1, 1]) keeps its m and gets
 *     its bit in the mask (with distinct entries NaN takes the search);
 *  2. per group, the rows of the buckets, the nearest code and C[code] * mx,
 *     or the portable code for the masked groups. */
INLINE void requantize_chunk(const gefen_quantizer *q, float *m, float mx, int64_t n,
                             uint8_t *codes, const int search, const gefen_sink *sk,
                             const gefen_sink_kind kind, const gefen_dtype dt,
                             const adam_vectors *c, int64_t off, int64_t len, const int packed) {
  const int buckets = search == SEARCH_COARSE ? GEFEN_LUT_BUCKETS / q->coarse_div
                                              : GEFEN_LUT_BUCKETS;
  const __m256 vmx = _mm256_set1_ps(mx), one = _mm256_set1_ps(1.0f),
               neg_one = _mm256_set1_ps(-1.0f), scale = _mm256_set1_ps((float)(buckets / 2));
  const __m256i last_bucket = _mm256_set1_epi32(buckets - 1);
  int32_t idx[CHUNK];
  uint32_t nan_groups = 0;
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 u = _mm256_div_ps(_mm256_loadu_ps(m + j), vmx);
    if (search == SEARCH_REPEATED) {
      const __m256 in = _mm256_and_ps(_mm256_cmp_ps(u, neg_one, _CMP_GE_OQ),
                                      _mm256_cmp_ps(u, one, _CMP_LE_OQ));
      if (_mm256_movemask_ps(in) != 0xff) { /* a NaN: rare, the portable way */
        nan_groups |= 1u << (j / 8);
        continue;
      }
    }
    /* u + 1 >= 0 but for NaN (|m| <= mx), so the truncated bucket is >= 0 and
     * only the top needs a clamp; NaN truncates to 0x80000000, which the
     * unsigned clamp takes to the top bucket, in bounds */
    const __m256i b = _mm256_min_epu32(
        _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_add_ps(u, one), scale)), last_bucket);
    /* coarse rows: the row's byte offset (16 bytes a row), so that the look-up
     * needs no shift per lane (fp32 block step in cache -4%, Zen 3) */
    _mm256_storeu_si256((__m256i *)(void *)(idx + j),
                        search == SEARCH_COARSE ? _mm256_slli_epi32(b, 4) : b);
    _mm256_storeu_ps(m + j, u);
  }
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    if (kind != GEFEN_SINK_M) prefetch_at(sk->out, esz_of(dt), sk->base + off + j + len);
    if ((nan_groups >> (j / 8)) & 3u) {
      group_slow(q, m + j, mx, codes + j, search, idx + j, (nan_groups >> (j / 8)) & 1u, sk,
                 kind, dt, c, off + j);
      group_slow(q, m + j + 8, mx, codes + j + 8, search, idx + j + 8,
                 (nan_groups >> (j / 8 + 1)) & 1u, sk, kind, dt, c, off + j + 8);
      continue;
    }
    __m256 val0, val1;
    const __m256i code0 = nearest8(q, m + j, idx + j, search, &val0);
    const __m256i code1 = nearest8(q, m + j + 8, idx + j + 8, search, &val1);
    if (packed) { /* m + j: the group's even elements, then its odd ones */
      sink16_packed(sk, c, off + j, _mm256_mul_ps(val0, vmx), _mm256_mul_ps(val1, vmx));
      store_codes16_packed(codes + j, code0, code1);
      continue;
    }
    emit8(m + j, _mm256_mul_ps(val0, vmx), sk, kind, dt, c, off + j);
    emit8(m + j + 8, _mm256_mul_ps(val1, vmx), sk, kind, dt, c, off + j + 8);
    store_codes16(codes + j, code0, code1);
  }
  if (j < n)
    group_slow(q, m + j, mx, codes + j, search, idx + j, (nan_groups >> (j / 8)) & 1u, sk, kind,
               dt, c, off + j);
}

/* Requantises m[0..len) and sends each mq to the sink (kind GEFEN_SINK_M: into
 * m; or an Adam sink, whose parameters have dtype dt); with packed, m's whole
 * groups of 16 are in the packed order (bfloat16 block sinks, distinct
 * entries; see packs). */
INLINE void requantize_t(const gefen_quantizer *q, float *m, float mx, int64_t len,
                         uint8_t *codes, const int search, const gefen_sink *sk,
                         const gefen_sink_kind kind, const gefen_dtype dt, const int packed) {
  const adam_vectors c =
      kind == GEFEN_SINK_M ? adam_vectors_of(0.0f, 0.0f, 0.0f, 0.0f, 0.0f)
                           : adam_vectors_of(sk->s, sk->inv_bc1, sk->eps, sk->decay, sk->lr);
  const int64_t whole = len / 8 * 8;
  for (int64_t j = 0; j < whole; j += CHUNK) {
    const int64_t n = whole - j < CHUNK ? whole - j : CHUNK;
    requantize_chunk(q, m + j, mx, n, codes + j, search, sk, kind, dt, &c, j, len, packed);
  }
  if (whole < len) {
    gefen_block_ops_scalar.requantize(q, m + whole, mx, len - whole, codes + whole);
    if (kind != GEFEN_SINK_M) {
      const gefen_sink tail = sink_from(sk, whole);
      gefen_sink_apply(&gefen_block_ops_scalar, m + whole, len - whole, &tail);
    }
  }
  if (kind != GEFEN_SINK_M) f16_canonical_nans(sk->out, dt, sk->base, len);
}

/* The search for this quantiser's codebook (requantize_chunk). */
static int search_of(const gefen_quantizer *q) {
  if (q->table.n_distinct != GEFEN_CODEBOOK_SIZE) return SEARCH_REPEATED;
  return q->coarse_div > 0 ? SEARCH_COARSE : SEARCH_DISTINCT;
}

static int packs(const gefen_quantizer *q, gefen_dtype dt, int packed) {
  return packed == GEFEN_SINK_ADAM_BLOCK && dt == GEFEN_BF16 && q->table.exact_lut &&
         search_of(q) != SEARCH_REPEATED;
}

/* Calls CALL(S, A, B) with the search S as a compile-time constant, as
 * DTYPE_SWITCH does with the dtype. */
#define SEARCH_SWITCH(search, CALL, A, B)                     \
  switch (search) {                                           \
    case SEARCH_COARSE: CALL(SEARCH_COARSE, A, B); break;     \
    case SEARCH_DISTINCT: CALL(SEARCH_DISTINCT, A, B); break; \
    default: CALL(SEARCH_REPEATED, A, B);                     \
  }

TARGET static void requantize(const gefen_quantizer *q, float *m, float mx, int64_t len,
                              uint8_t *codes) {
  if (!(mx > 0.0f) || !q->table.exact_lut) { /* u = 0 everywhere, or no table */
    gefen_block_ops_scalar.requantize(q, m, mx, len, codes);
    return;
  }
#define BY_SEARCH(S, K, DT) requantize_t(q, m, mx, len, codes, S, NULL, K, DT, 0)
  SEARCH_SWITCH(search_of(q), BY_SEARCH, GEFEN_SINK_M, GEFEN_F32)
#undef BY_SEARCH
}

/* ------------------------------------------------------- factored stats */

/* x = g^2 of the 8 elements at (row r, column j) into the row's lanes lo and hi
 * and into the column sums c_lo and c_hi held in registers (add_squares for
 * each pair; the compiler forms x, or the widened float16 g, once). */
INLINE void row8(const void *grad, gefen_dtype dt, int64_t at, __m256d *lo, __m256d *hi,
                 __m256d *c_lo, __m256d *c_hi) {
  const __m256 g = load8(grad, dt, at);
  add_squares(lo, hi, g, dt);
  add_squares(c_lo, c_hi, g, dt);
}

/* Rows taken at once: their column sums are loaded and stored once per 16
 * columns, each row's x added to them in row order (the portable order, so
 * the grouping changes no bit). Two rows hold 8 lane vectors and 4 column-sum
 * vectors, what 16 ymm registers leave room for. */
#define ROWS_AT_ONCE 2

/* Rows go two at a time only from this many bytes on, and then fetch each
 * row's lines PAIRED_PREFETCH_BYTES ahead (into L2). Two streams of rows left
 * the hardware prefetchers behind: paired without software prefetches, rows
 * in DRAM were slower than one after the other when short (Zen 3, one thread:
 * 2 and 4 KiB rows of bf16 +14% and +19%), faster when long (8 KiB -3% to
 * -13%, 16 KiB -11% to -29%). With the prefetches (Zen 3, the 16.8M and
 * 67.1M sets, statistics phase alone, two threads, ABBA), against pairs
 * without them: 8 KiB rows of fp32 -18 to -19%, 16-bit rows of 8 KiB -7 to
 * -10%, 16 KiB rows of fp32 -9 to -14%; against single rows: 4 KiB rows of 16-bit
 * -4 to -14%, 4 and 6 KiB rows of fp32 -24% (one run of a 4 KiB set in L3
 * +8%); 2 and 3 KiB rows of bf16 -1 to -2% (not taken). Single rows with the
 * same prefetches were 4-7% slower (4 KiB rows of bf16). */
#define PAIRED_ROW_BYTES 4096
#define PAIRED_PREFETCH_BYTES 32768

/* The statistics of n rows (n <= ROWS_AT_ONCE, a constant) from base, each
 * len long: sums[r] and colsum[0..len) += every row's x, row after row. */
INLINE void rows_t(const void *grad, const gefen_dtype dt, int64_t base, int64_t len,
                   const int n, double *colsum, double *sums) {
  __m256d acc[ROWS_AT_ONCE][4];
  for (int r = 0; r < n; r++)
    for (int a = 0; a < 4; a++) acc[r][a] = _mm256_setzero_pd();
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    __m256d c[4];
    for (int a = 0; a < 4; a++) c[a] = _mm256_loadu_pd(colsum + j + 4 * a);
    for (int r = 0; r < n; r++) {
      if (n == ROWS_AT_ONCE && (dt == GEFEN_F32 || j % 32 == 0)) /* each line once */
        prefetch_at(grad, esz_of(dt),
                    base + r * len + j + PAIRED_PREFETCH_BYTES / (int64_t)esz_of(dt));
      row8(grad, dt, base + r * len + j, &acc[r][0], &acc[r][1], &c[0], &c[1]);
      row8(grad, dt, base + r * len + j + 8, &acc[r][2], &acc[r][3], &c[2], &c[3]);
    }
    for (int a = 0; a < 4; a++) _mm256_storeu_pd(colsum + j + 4 * a, c[a]);
  }
  if (len - j >= 8) { /* lanes 0-7 */
    __m256d c[2] = {_mm256_loadu_pd(colsum + j), _mm256_loadu_pd(colsum + j + 4)};
    for (int r = 0; r < n; r++)
      row8(grad, dt, base + r * len + j, &acc[r][0], &acc[r][1], &c[0], &c[1]);
    _mm256_storeu_pd(colsum + j, c[0]);
    _mm256_storeu_pd(colsum + j + 4, c[1]);
    j += 8;
  }
  for (int r = 0; r < n; r++) {
    double lanes[GEFEN_SUM_LANES];
    for (int a = 0; a < 4; a++) _mm256_storeu_pd(lanes + 4 * a, acc[r][a]);
    for (int64_t t = j; t < len; t++) { /* the portable operations, on lane t % 16 */
      const float g = gefen_load(grad, dt, base + r * len + t);
      const float x = g * g;
      lanes[t % GEFEN_SUM_LANES] += x;
      colsum[t] += x;
    }
    sums[r] = gefen_sum_lanes(lanes);
  }
}

TARGET static void rows_of(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                           const int n, double *colsum, double *sums) {
#define CALL(DT)                                                                  \
  if (n == ROWS_AT_ONCE) rows_t(grad, DT, base, len, ROWS_AT_ONCE, colsum, sums); \
  else rows_t(grad, DT, base, len, 1, colsum, sums);                              \
  return
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

TARGET static void row_stats(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                             int64_t rows, double *colsum, double *sums) {
  if (dt == GEFEN_F64) {
    gefen_block_ops_scalar.row_stats(grad, dt, base, len, rows, colsum, sums);
    return;
  }
  int64_t r = 0;
  if ((int64_t)esz_of(dt) * len >= PAIRED_ROW_BYTES)
    for (; r + ROWS_AT_ONCE <= rows; r += ROWS_AT_ONCE)
      rows_of(grad, dt, base + r * len, len, ROWS_AT_ONCE, colsum, sums + r);
  for (; r < rows; r++) rows_of(grad, dt, base + r * len, len, 1, colsum, sums + r);
}

/* ------------------------------------------------------------ parameters */

INLINE void apply_block_t(void *param, const gefen_dtype dt, int64_t base, const float *mq,
                          int64_t len, float s, float decay, float lr) {
  const adam_vectors c = adam_vectors_of(s, 0.0f, 0.0f, decay, lr);
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    if (j % 16 == 0 || dt == GEFEN_F32) prefetch_at(param, esz_of(dt), base + j + len);
    update8(param, dt, base + j, _mm256_loadu_ps(mq + j), c.s, &c);
  }
  if (j < len)
    gefen_block_ops_scalar.apply_block(param, dt, base + j, mq + j, len - j, s, decay, lr);
  f16_canonical_nans(param, dt, base, len);
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
  const adam_vectors c = adam_vectors_of(srow, inv_bc1, eps, decay, lr);
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    if (j % 16 == 0 || dt == GEFEN_F32) prefetch_at(param, esz_of(dt), base + j + len);
    update8(param, dt, base + j, _mm256_loadu_ps(mq + j), factored_s8(&c, scol + j), &c);
  }
  if (j < len)
    gefen_block_ops_scalar.apply_factored(param, dt, base + j, mq + j, len - j, srow, scol + j,
                                          inv_bc1, eps, decay, lr);
  f16_canonical_nans(param, dt, base, len);
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
  f16_canonical_nans(out, out_dt, base, len); /* out_dt is never float16 (muon_output) */
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

/* The requantisation with an Adam sink in one pass over the block: each
 * group's mq goes to the parameters as it is formed. Other sinks, and the
 * blocks requantize leaves to the portable code, as requantize followed by
 * gefen_sink_apply. */
TARGET static void requantize_apply(const gefen_quantizer *q, float *m, float mx, int64_t len,
                                    uint8_t *codes, const gefen_sink *sink) {
  const int factored = sink->kind == GEFEN_SINK_ADAM_FACTORED;
  if (!(factored || sink->kind == GEFEN_SINK_ADAM_BLOCK) || sink->out_dtype == GEFEN_F64 ||
      !(mx > 0.0f) || !q->table.exact_lut) {
    gefen_requantize_apply_with(&ops_avx2, q, m, mx, len, codes, sink);
    return;
  }
  const int search = search_of(q);
  /* every argument that selects code a constant in its own instance */
  if (!factored && packs(q, sink->out_dtype, sink->packed)) { /* m as adam_momentum packed it */
#define PACKED(S) requantize_t(q, m, mx, len, codes, S, sink, GEFEN_SINK_ADAM_BLOCK, GEFEN_BF16, 1)
    if (search == SEARCH_COARSE) PACKED(SEARCH_COARSE);
    else PACKED(SEARCH_DISTINCT);
#undef PACKED
    return;
  }
#define BY_SEARCH(S, K, DT) requantize_t(q, m, mx, len, codes, S, sink, K, DT, 0)
#define CALL(DT)                                                        \
  if (factored) {                                                       \
    SEARCH_SWITCH(search, BY_SEARCH, GEFEN_SINK_ADAM_FACTORED, DT)      \
  } else {                                                              \
    SEARCH_SWITCH(search, BY_SEARCH, GEFEN_SINK_ADAM_BLOCK, DT)         \
  }                                                                     \
  return
  DTYPE_SWITCH(sink->out_dtype, CALL)
#undef CALL
#undef BY_SEARCH
}

/* mq = C[code] * mag of the codes, 8 at a time, to an Adam sink of kind K and
 * parameters of dtype DT (as the portable decoding followed by the apply). */
INLINE void dequantize_apply_run(const gefen_quantizer *q, const uint8_t *codes, const float *tb,
                                 const int tabled, float mag, int64_t len, float *m,
                                 const gefen_sink *sk, const gefen_sink_kind kind,
                                 const gefen_dtype dt, const adam_vectors *c) {
  const __m256 vmag = _mm256_set1_ps(mag);
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    if (j % 16 == 0) prefetch_at(sk->out, esz_of(dt), sk->base + j + len); /* the next block */
    if (j % 64 == 0) prefetch_at(codes, 1, j + len);
    const __m256 d = decode8(tb, codes + j, 1);
    if (tabled && kind == GEFEN_SINK_ADAM_BLOCK) /* d = lr_delta8 of the code */
      store8(sk->out, dt, sk->base + j, adam_update_of8(load8(sk->out, dt, sk->base + j), d, c));
    else
      sink8(sk, kind, dt, c, j, tabled ? d : _mm256_mul_ps(d, vmag));
  }
  if (j < len) {
    const gefen_sink tail = sink_from(sk, j);
    gefen_dequantize_apply_with(&gefen_block_ops_scalar, q, codes + j, mag, len - j, m + j, &tail);
  }
  f16_canonical_nans(sk->out, dt, sk->base, len);
}

/* The values tabled for a long block (value tables, above): mq = C[code] * mag,
 * and for a block sink lr * (mq * s) (adam_update8's order). */
INLINE void dequantize_apply_t(const gefen_quantizer *q, const uint8_t *codes, float mag,
                               int64_t len, float *m, const gefen_sink *sk,
                               const gefen_sink_kind kind, const gefen_dtype dt) {
  const float *cb = q->table.codebook;
  const adam_vectors c = adam_vectors_of(sk->s, sk->inv_bc1, sk->eps, sk->decay, sk->lr);
  if (len >= VALUE_MIN_LEN) {
    _Alignas(32) float tb[GEFEN_CODEBOOK_SIZE];
    const __m256 vmag = _mm256_set1_ps(mag);
    for (int i = 0; i < GEFEN_CODEBOOK_SIZE; i += 8) {
      const __m256 mq = _mm256_mul_ps(_mm256_loadu_ps(cb + i), vmag);
      _mm256_storeu_ps(tb + i, kind == GEFEN_SINK_ADAM_BLOCK ? lr_delta8(mq, c.s, &c) : mq);
    }
    dequantize_apply_run(q, codes, tb, 1, mag, len, m, sk, kind, dt, &c);
    return;
  }
  dequantize_apply_run(q, codes, cb, 0, mag, len, m, sk, kind, dt, &c);
}

/* The decoding with an Adam sink in one pass (the form whose codes the
 * statistics pass wrote, momentum_in_stats); other sinks through m. */
TARGET static void dequantize_apply(const gefen_quantizer *q, const uint8_t *codes, float mag,
                                    int64_t len, float *m, const gefen_sink *sink) {
  const int factored = sink->kind == GEFEN_SINK_ADAM_FACTORED;
  if (!(factored || sink->kind == GEFEN_SINK_ADAM_BLOCK) || sink->out_dtype == GEFEN_F64) {
    gefen_dequantize_apply_with(&ops_avx2, q, codes, mag, len, m, sink);
    return;
  }
#define CALL(DT)                                                                          \
  if (factored)                                                                           \
    dequantize_apply_t(q, codes, mag, len, m, sink, GEFEN_SINK_ADAM_FACTORED, DT);        \
  else                                                                                    \
    dequantize_apply_t(q, codes, mag, len, m, sink, GEFEN_SINK_ADAM_BLOCK, DT);           \
  return
  DTYPE_SWITCH(sink->out_dtype, CALL)
#undef CALL
}

static const gefen_block_ops ops_avx2 = {
    adam_momentum, muon_momentum,  requantize,     requantize_apply,
    row_stats,     apply_block,    apply_factored, muon_output,
    dequantize_apply,
    NULL, /* adam_period1: the per-block primitives */
};

static int cpu_has_avx2(void) {
  __builtin_cpu_init();
  /* every CPU with AVX2 has FMA and F16C too; FMA is used only for the
   * exact float16 squares (add_squares) */
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         gefen_cpuid_ecx_bit(1, 29); /* F16C */
}

const gefen_block_ops *gefen_block_ops_avx2(void) {
  return cpu_has_avx2() ? &ops_avx2 : NULL;
}

#else /* not x86-64 with GCC/Clang */

const gefen_block_ops *gefen_block_ops_avx2(void) { return NULL; }

#endif
