/* The per-block primitives of the element kernels, in a portable C version
 * (block_scalar.c), an AVX2 version (block_avx2.c) and an AVX-512 version
 * (block_avx512.c) chosen at run time. All compute the same operations in the
 * same order, so they give the same results bit for bit.
 *
 * A block is `len` consecutive elements starting at element `base` of a
 * parameter's local shard. `m` is a per-thread scratch of `len` floats. */
#ifndef GEFEN_BLOCK_OPS_H
#define GEFEN_BLOCK_OPS_H

#include "core_internal.h"
#include "quantizer_internal.h"

/* Sums of g^2 inside a block or row are taken in one canonical order on every
 * path: element j goes to float64 lane j % 16, then the lanes are added in
 * order. So the portable and SIMD kernels agree bit for bit. */
#define GEFEN_SUM_LANES 16

static inline double gefen_sum_lanes(const double *lanes) {
  double total = 0.0;
  for (int l = 0; l < GEFEN_SUM_LANES; l++) total += lanes[l];
  return total;
}

/* Branch-free twins of the dtype conversions of core_internal.h, equal to them
 * bit for bit (tests/c/test_kernels.c checks), written as selects so that the
 * compiler can vectorise loops over them; the originals branch (and loop, for
 * float16 subnormals). */
static inline uint16_t gefen_f32_to_bf16_sel(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint32_t quiet = (u >> 16) | 0x0040u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* NaN may wrap: unused */
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline float gefen_f16_to_f32_sel(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu, exp = em >> 10;
  /* zero and subnormals: em * 2^-24, exact in fp32 (a normal number) */
  const float sub = (float)(int32_t)em * 0x1p-24f;
  uint32_t sub_bits;
  memcpy(&sub_bits, &sub, sizeof sub_bits);
  const uint32_t normal = (em << 13) + ((uint32_t)(127 - 15) << 23);
  /* inf, or NaN made quiet */
  const uint32_t special = (em << 13) | 0x7f800000u | ((uint32_t)((em & 0x3ffu) != 0) << 22);
  /* all-ones masks rather than ?: chains, which GCC leaves as branches */
  const uint32_t is_sub = 0u - (uint32_t)(exp == 0), is_special = 0u - (uint32_t)(exp == 31);
  const uint32_t u = sign | (sub_bits & is_sub) | (special & is_special) |
                     (normal & ~(is_sub | is_special));
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t gefen_f32_to_f16_sel(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  float fa;
  memcpy(&fa, &a, sizeof fa);
  /* below 2^-14 (float16 subnormals): fp32's ulp at 0.5 is 2^-24, the float16
   * subnormal step, so fa + 0.5 is rounded to nearest even by the FPU itself */
  const float shifted = fa + 0.5f;
  uint32_t sub;
  memcpy(&sub, &shifted, sizeof sub);
  sub -= 0x3f000000u;
  /* normal: rebias the exponent 127 -> 15 and round the 13 dropped bits */
  const uint32_t normal = (a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13;
  /* NaN (0x7e00) or overflow to inf (0x7c00) */
  const uint32_t big = 0x7c00u | ((uint32_t)(a > 0x7f800000u) << 9);
  const uint32_t is_big = 0u - (uint32_t)(a >= 0x477ff000u);
  const uint32_t is_sub = 0u - (uint32_t)(a < 0x38800000u); /* never with is_big */
  const uint32_t r = (big & is_big) | (sub & is_sub) | (normal & ~(is_big | is_sub));
  return (uint16_t)(sign | r);
}

/* Where the requantisation pass sends each dequantised value mq = C[code] * mx
 * of a block, so that one pass over the block both requantises and uses it. */
typedef enum {
  GEFEN_SINK_M,             /* back into m (requantize) */
  GEFEN_SINK_ADAM_BLOCK,    /* p = p * decay - lr * (mq * s) */
  GEFEN_SINK_ADAM_FACTORED, /* the same with s_j = inv_bc1 / (s * scol[j] + eps) */
  GEFEN_SINK_MUON,          /* out = beta * mq + (1 - beta) * g (nesterov) or mq */
  GEFEN_SINK_CODES          /* nowhere: only the codes are wanted (m may be overwritten) */
} gefen_sink_kind;

typedef struct {
  gefen_sink_kind kind;
  void *out;             /* Adam: the parameter; Muon: the Newton-Schulz input */
  gefen_dtype out_dtype;
  const void *grad;      /* Muon: the gradient (read with nesterov) */
  gefen_dtype dtype;     /* Muon: the gradient's dtype */
  int64_t base;          /* index of the block's first element in out and grad */
  float s;               /* block: the step size; factored: the row factor */
  const float *scol;     /* factored: the column factors of the block's elements */
  float inv_bc1, eps, decay, lr;
  float beta, one_minus_beta;
  int nesterov;
  int packed;            /* Adam sinks: m is as adam_momentum(..., packed) of the
                          * same primitives wrote it with the same packed, the
                          * sink's kind (its own order, see there); 0: in order */
  int m_has_no_nan;      /* Adam sinks: the caller has shown that m holds no NaN
                          * (gefen_m_has_no_nan); a requantisation may then skip
                          * what only a NaN needs. 0 (the default): it may hold one */
} gefen_sink;

/* Whether adam_momentum's m holds no NaN, from what the caller has anyway:
 * m = beta1 * (C[code] * mag_old) + (1 - beta1) * g takes a NaN only from a NaN
 * g or a non-finite mag_old (C * mag_old is then NaN or an infinity that may
 * meet the other one), and a NaN or infinite g makes the sum of the squares
 * that holds it non-finite (the block's, or its row's in the factored form).
 * Finite operands whose m overflows give +-inf, not NaN. (With a non-finite
 * mag_old no block reaches the key search anyway: its max|m| is then +inf or
 * 0; the clause keeps the reasoning local.) */
static inline int gefen_m_has_no_nan(double squares, float mag_old) {
  return isfinite(squares) && isfinite(mag_old);
}

/* The block form's step for blocks of one element (period 1: the 1-D
 * parameters) over a run of elements: the item's buffers and constants. */
typedef struct {
  const void *grad;
  void *param;
  gefen_dtype dtype; /* of grad and param: float32, bfloat16 or float16 */
  uint8_t *codes;
  float *magnitude, *vmean; /* one per element */
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float inv_bc1, rs_bc2, eps, decay, lr;
} gefen_period1;

typedef struct {
  /* Gefen (C: the codebook of q): m = beta1 * (C[code] * mag_old) + (1 - beta1) * g; adds sum g^2
   * to *sq unless sq is NULL; returns max|m| (NaN never wins; 0 for an
   * all-NaN block). With packed set (to the kind of the Adam sink that will
   * read m: GEFEN_SINK_ADAM_BLOCK or GEFEN_SINK_ADAM_FACTORED), a version may
   * write m in an order of its own within each whole group of 64 elements
   * (the VBMI version does for bfloat16: even elements, then odd ones, so
   * that its loads and stores need no shuffle; the AVX2 version the same
   * within groups of 16, for block sinks only), for requantize_apply with an
   * Adam sink of that kind whose packed is the same and nothing else; the
   * sum, the maximum and the values are the same. */
  float (*adam_momentum)(const void *grad, gefen_dtype dt, int64_t base,
                         const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                         float beta1, float one_minus_beta1, int64_t len, float *m,
                         double *sq, int packed);
  /* GefenMuon: mo = C[code] * mag_old; m = mo + (1 - beta) * (g - mo). */
  float (*muon_momentum)(const void *grad, gefen_dtype dt, int64_t base,
                         const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                         float one_minus_beta, int64_t len, float *m);
  /* Nearest-code requantisation of m with magnitude mx (u = m / mx, or 0 when
   * mx == 0): writes codes and overwrites m with C[code] * mx. */
  void (*requantize)(const gefen_quantizer *q, float *m, float mx, int64_t len,
                     uint8_t *codes);
  /* The same, sending each C[code] * mx to the sink instead (m may be
   * overwritten). */
  void (*requantize_apply)(const gefen_quantizer *q, float *m, float mx, int64_t len,
                           uint8_t *codes, const gefen_sink *sink);
  /* Factored statistics of `rows` consecutive rows of len elements from
   * base: adds each row's g_j^2 to colsum[j] (float64), row after row, and
   * writes each row's sum of g^2 to sums[r]. (Several rows at once, so that
   * colsum is read and written once per few rows; the order of the
   * additions is the same.) */
  void (*row_stats)(const void *grad, gefen_dtype dt, int64_t base, int64_t len, int64_t rows,
                    double *colsum, double *sums);
  /* p = p * decay - lr * (mq * s) with one step size s for the block. */
  void (*apply_block)(void *param, gefen_dtype dt, int64_t base, const float *mq,
                      int64_t len, float s, float decay, float lr);
  /* The same with s_j = inv_bc1 / (srow * scol[j] + eps) per element. */
  void (*apply_factored)(void *param, gefen_dtype dt, int64_t base, const float *mq,
                         int64_t len, float srow, const float *scol, float inv_bc1,
                         float eps, float decay, float lr);
  /* Newton-Schulz input: beta * mq + (1 - beta) * g (nesterov) or mq. */
  void (*muon_output)(void *out, gefen_dtype out_dt, const void *grad, gefen_dtype dt,
                      int64_t base, const float *mq, int64_t len, float beta,
                      float one_minus_beta, int nesterov);
  /* Sends mq = C[code] * mag of the codes codes[0..len) to the sink (an Adam
   * sink): the same values, bit for bit, as the requantisation that wrote the
   * codes with magnitude mag sends (C[code] * mx). m is a scratch of len
   * floats (may be overwritten). */
  void (*dequantize_apply)(const gefen_quantizer *q, const uint8_t *codes, float mag,
                           int64_t len, float *m, const gefen_sink *sink);
  /* The block form's whole step (nearest rounding) of the elements [base,
   * base + n) of an item of period 1, each element its own block: for each,
   * the same operations as adam_momentum (len 1, with the square),
   * the block's second moment and step size (adam.c's block_chunk) and
   * requantize_apply (len 1) to an Adam block sink, but 64 elements at a time
   * instead of one call each. NULL: adam.c calls those per element. */
  void (*adam_period1)(const gefen_quantizer *q, const gefen_period1 *a, int64_t base,
                       int64_t n);
} gefen_block_ops;

/* The portable primitives (every dtype, every codebook). */
extern const gefen_block_ops gefen_block_ops_scalar;

/* The fastest primitives for this CPU and quantiser (NULL: any quantiser):
 * AVX-512 with VBMI, AVX-512, AVX2, then portable; the AVX2 version needs an
 * exact lookup table, the AVX-512 versions do not. */
const gefen_block_ops *gefen_block_ops_for(const gefen_quantizer *q);

/* The AVX-512 + VBMI + BF16 primitives (those of VBMI, bfloat16 rounded by
 * the BF16 conversion), or NULL when this CPU (or build) has none. */
const gefen_block_ops *gefen_block_ops_avx512bf16(void);

/* The AVX-512 + VBMI primitives, or NULL when this CPU (or build) has none. */
const gefen_block_ops *gefen_block_ops_avx512vbmi(void);

/* The AVX-512 primitives, or NULL when this CPU (or build) has none. */
const gefen_block_ops *gefen_block_ops_avx512(void);

/* The AVX2 (+F16C) primitives, or NULL when this CPU (or build) has none. */
const gefen_block_ops *gefen_block_ops_avx2(void);

/* Sends the dequantised values mq[0..len) of a block to the sink through the
 * primitives of ops (GEFEN_SINK_M: nothing to do). */
void gefen_sink_apply(const gefen_block_ops *ops, const float *mq, int64_t len,
                      const gefen_sink *sink);

/* dequantize_apply as a portable decoding into m followed by gefen_sink_apply. */
void gefen_dequantize_apply_with(const gefen_block_ops *ops, const gefen_quantizer *q,
                                 const uint8_t *codes, float mag, int64_t len, float *m,
                                 const gefen_sink *sink);

/* requantize_apply as ops->requantize followed by gefen_sink_apply. */
void gefen_requantize_apply_with(const gefen_block_ops *ops, const gefen_quantizer *q,
                                 float *m, float mx, int64_t len, uint8_t *codes,
                                 const gefen_sink *sink);

/* Stochastic requantisation (ALGORITHM.md §6): like requantize, with the
 * element's global flat index global_base + j. Portable only. */
void gefen_requantize_stochastic(const gefen_quantizer *q, float *m, float mx,
                                 int64_t len, uint8_t *codes, uint64_t seed,
                                 int64_t global_base);

/* The phases of gefen_adam_step one at a time, with the given primitives
 * instead of gefen_block_ops_for(q) (the tests run every version; ops must
 * suit q as gefen_block_ops_for would choose it). Unlike the public calls
 * they take factored items with momentum_in_stats: phase 1 (q needed then)
 * MUTATES their codes and magnitude, and the update must follow it exactly
 * once, with the same quantiser; should it fail in between (GEFEN_ENOMEM),
 * the state is left half-stepped. That is why the public API takes the flag
 * only in gefen_adam_step, which allocates both phases' scratch first. */
gefen_status gefen_adam_factored_stats_with(const gefen_block_ops *ops,
                                            const gefen_adam_item *items, int64_t n,
                                            const gefen_quantizer *q, int nthreads,
                                            gefen_error *err);
gefen_status gefen_adam_update_with(const gefen_block_ops *ops, const gefen_adam_item *items,
                                    int64_t n, const gefen_quantizer *q, int nthreads,
                                    gefen_error *err);
gefen_status gefen_adam_step_with(const gefen_block_ops *ops, const gefen_adam_item *items,
                                  int64_t n, const gefen_quantizer *q, int nthreads,
                                  gefen_error *err);

#endif /* GEFEN_BLOCK_OPS_H */
