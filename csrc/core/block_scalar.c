/* Portable versions of the block primitives (see block_ops.h): the reference
 * the SIMD versions are tested against, and the path for float64 parameters,
 * CPUs without AVX2 (ARM included) and codebooks whose lookup table is not
 * exact.
 *
 * Written so that a compiler can vectorise them for any target: each primitive
 * is instantiated per dtype (a switch outside the loop, the dtype a constant
 * inside), conversions are the branch-free twins of block_ops.h, and the sums
 * and maxima are kept in GEFEN_SUM_LANES independent lanes over full groups of
 * 16 elements, which is exactly the canonical order of block_ops.h. The
 * maximum of |m| may be taken per lane and then across lanes: its inputs are
 * never -0 and NaN never wins, so every order gives the same bits. */
#include "block_ops.h"
#include "kernel_internal.h"

#define L GEFEN_SUM_LANES

/* Element i of a typed buffer as fp32 (dt a constant after inlining). */
static GEFEN_ALWAYS_INLINE float load_dt(const void *p, gefen_dtype dt, int64_t i) {
  switch (dt) {
    case GEFEN_F32: return ((const float *)p)[i];
    case GEFEN_BF16: return gefen_bf16_to_f32(((const uint16_t *)p)[i]);
    case GEFEN_F16: return gefen_f16_to_f32_sel(((const uint16_t *)p)[i]);
    case GEFEN_F64: return (float)((const double *)p)[i];
  }
  return 0.0f;
}

/* Calls NAME##_t(..., DT, ...) with the dtype as a compile-time constant. The
 * dtypes were validated by the caller; anything else is treated as float64. */
#define DTYPE_SWITCH(dt, CALL)        \
  switch (dt) {                       \
    case GEFEN_F32: CALL(GEFEN_F32);  \
    case GEFEN_BF16: CALL(GEFEN_BF16); \
    case GEFEN_F16: CALL(GEFEN_F16);  \
    default: CALL(GEFEN_F64);         \
  }

static GEFEN_ALWAYS_INLINE float max_lanes(const float *mxl) {
  float mx = 0.0f;
  for (int l = 0; l < L; l++) mx = mxl[l] > mx ? mxl[l] : mx;
  return mx;
}

/* ------------------------------------------------------------- momentum */

static GEFEN_ALWAYS_INLINE void adam_one(const void *grad, gefen_dtype dt, int64_t base,
                                         float c, float mag_old, float beta1,
                                         float one_minus_beta1, float *m, int64_t j,
                                         float *mxl, double *lane) {
  const float g = load_dt(grad, dt, base + j);
  const float mo = c * mag_old;
  const float v = beta1 * mo + one_minus_beta1 * g;
  m[j] = v;
  const float a = fabsf(v);
  *mxl = a > *mxl ? a : *mxl; /* NaN never wins */
  const float x = g * g;
  *lane += x;
}

static GEFEN_ALWAYS_INLINE float adam_momentum_t(const void *grad, const gefen_dtype dt,
                                                 int64_t base, const uint8_t *codes,
                                                 const float *cb, float mag_old, float beta1,
                                                 float one_minus_beta1, int64_t len, float *m,
                                                 double *sq) {
  float mxl[L] = {0};
  double lanes[L] = {0};
  int64_t j = 0;
  for (; j + L <= len; j += L) {
    /* the codebook look-ups first, so that the arithmetic below has no
     * indexed load and vectorises without gather instructions */
    float c[L];
    for (int l = 0; l < L; l++) c[l] = cb[codes[j + l]];
    for (int l = 0; l < L; l++)
      adam_one(grad, dt, base, c[l], mag_old, beta1, one_minus_beta1, m, j + l, &mxl[l],
               &lanes[l]);
  }
  for (int l = 0; j < len; j++, l++)
    adam_one(grad, dt, base, cb[codes[j]], mag_old, beta1, one_minus_beta1, m, j, &mxl[l],
             &lanes[l]);
  if (sq) *sq += gefen_sum_lanes(lanes);
  return max_lanes(mxl);
}

static float adam_momentum(const void *grad, gefen_dtype dt, int64_t base,
                           const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                           float beta1, float one_minus_beta1, int64_t len, float *m,
                           double *sq, int packed) {
  (void)packed; /* m in element order */
  const float *cb = q->table.codebook;
#define CALL(DT) \
  return adam_momentum_t(grad, DT, base, codes, cb, mag_old, beta1, one_minus_beta1, len, m, sq)
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

static GEFEN_ALWAYS_INLINE float muon_momentum_t(const void *grad, const gefen_dtype dt,
                                                 int64_t base, const uint8_t *codes,
                                                 const float *cb, float mag_old,
                                                 float one_minus_beta, int64_t len, float *m) {
  float mxl[L] = {0};
  int64_t j = 0;
  for (; j + L <= len; j += L) {
    float c[L]; /* the look-ups apart, as in adam_momentum_t */
    for (int l = 0; l < L; l++) c[l] = cb[codes[j + l]];
    for (int l = 0; l < L; l++) {
      const float g = load_dt(grad, dt, base + j + l);
      const float mo = c[l] * mag_old;
      const float v = mo + one_minus_beta * (g - mo);
      m[j + l] = v;
      const float a = fabsf(v);
      mxl[l] = a > mxl[l] ? a : mxl[l];
    }
  }
  for (; j < len; j++) {
    const float g = load_dt(grad, dt, base + j);
    const float mo = cb[codes[j]] * mag_old;
    const float v = mo + one_minus_beta * (g - mo);
    m[j] = v;
    const float a = fabsf(v);
    mxl[0] = a > mxl[0] ? a : mxl[0];
  }
  return max_lanes(mxl);
}

static float muon_momentum(const void *grad, gefen_dtype dt, int64_t base,
                           const uint8_t *codes, const gefen_quantizer *q, float mag_old,
                           float one_minus_beta, int64_t len, float *m) {
  const float *cb = q->table.codebook;
#define CALL(DT) return muon_momentum_t(grad, DT, base, codes, cb, mag_old, one_minus_beta, len, m)
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

/* --------------------------------------------------------- requantisation */

/* One element of an exact table, u = m[j] / mx: the branch-free search for
 * u in [-1, 1], the reference rule otherwise (NaN). */
static GEFEN_ALWAYS_INLINE void requantize_one(const gefen_quantizer *q, float *m, float mx,
                                               int64_t j, uint8_t *codes) {
  const float u = m[j] / mx;
  if (u >= -1.0f && u <= 1.0f) {
    const int i = gefen_quant_select(q, u);
    codes[j] = q->sel_code[i];
    m[j] = q->sel_value[i] * mx;
  } else {
    const uint8_t c = gefen_quantize_reference(q->table.codebook, u);
    codes[j] = c;
    m[j] = q->table.codebook[c] * mx;
  }
}

static void requantize(const gefen_quantizer *q, float *m, float mx, int64_t len,
                       uint8_t *codes) {
  const gefen_quant_table *t = &q->table;
  if (!(mx > 0.0f) || !t->exact_lut) { /* u = 0 everywhere, or no exact table */
    for (int64_t j = 0; j < len; j++) {
      const float u = mx > 0.0f ? m[j] / mx : 0.0f;
      const uint8_t c = gefen_quant_nearest(t, u);
      codes[j] = c;
      m[j] = t->codebook[c] * mx;
    }
    return;
  }
  /* gefen_quant_select on up to 64 elements at a time, split into stages so
   * that the arithmetic (the division above all) vectorises and only the
   * table look-ups stay scalar. u = m / max|m| is in [-1, 1] unless m holds a
   * NaN, so the one branch per group is predictable. (Groups of 64, not 16:
   * loops of 16 are unrolled before the vectoriser sees them.) */
  enum { GROUP = 64 };
  float u[GROUP], v0[GROUP], v1[GROUP];
  int32_t k[GROUP], sel[GROUP];
  for (int64_t j = 0; j < len; j += GROUP) {
    const int n = len - j < GROUP ? (int)(len - j) : GROUP;
    float *mj = m + j;
    uint8_t *cj = codes + j;
    int out = 0;
    for (int l = 0; l < n; l++) {
      u[l] = mj[l] / mx;
      out |= !((u[l] >= -1.0f) & (u[l] <= 1.0f));
    }
    if (out) {
      for (int l = 0; l < n; l++) requantize_one(q, mj, mx, l, cj);
      continue;
    }
    for (int l = 0; l < n; l++) {
      const int32_t b = (int32_t)((u[l] + 1.0f) * (float)(GEFEN_LUT_BUCKETS / 2));
      k[l] = b < GEFEN_LUT_BUCKETS - 1 ? b : GEFEN_LUT_BUCKETS - 1;
    }
    for (int l = 0; l < n; l++) {
      k[l] = t->bucket[k[l]];
      v0[l] = t->value[k[l]];
      v1[l] = t->value[k[l] + 1];
    }
    for (int l = 0; l < n; l++) {
      const int32_t up = !(fabsf(u[l] - v0[l]) <= fabsf(u[l] - v1[l]));
      const float vk = up ? v1[l] : v0[l];
      sel[l] = 2 * (k[l] + up) + (u[l] > vk);
    }
    for (int l = 0; l < n; l++) {
      cj[l] = q->sel_code[sel[l]];
      mj[l] = q->sel_value[sel[l]] * mx;
    }
  }
}

void gefen_requantize_stochastic(const gefen_quantizer *q, float *m, float mx,
                                 int64_t len, uint8_t *codes, uint64_t seed,
                                 int64_t global_base) {
  const gefen_quant_table *t = &q->table;
  for (int64_t j = 0; j < len; j++) {
    const float u = mx > 0.0f ? m[j] / mx : 0.0f;
    const uint8_t c = gefen_quant_stochastic(t, u, seed, global_base + j);
    codes[j] = c;
    m[j] = t->codebook[c] * mx;
  }
}

/* ------------------------------------------------------------ parameters */

/* p <- p * decay - lr * delta, rounded once to the parameter's dtype. */
static GEFEN_ALWAYS_INLINE void apply_one(void *param, gefen_dtype dt, int64_t i, float delta,
                                          float decay, float lr) {
  switch (dt) {
    case GEFEN_F32: {
      float *p = (float *)param;
      p[i] = p[i] * decay - lr * delta;
      break;
    }
    case GEFEN_BF16: {
      uint16_t *p = (uint16_t *)param;
      p[i] = gefen_f32_to_bf16_sel(gefen_bf16_to_f32(p[i]) * decay - lr * delta);
      break;
    }
    case GEFEN_F16: {
      uint16_t *p = (uint16_t *)param;
      p[i] = gefen_f32_to_f16_sel(gefen_f16_to_f32_sel(p[i]) * decay - lr * delta);
      break;
    }
    case GEFEN_F64: {
      /* float64 parameters keep float64 precision: only the update is fp32 */
      double *p = (double *)param;
      p[i] = p[i] * (double)decay - (double)lr * (double)delta;
      break;
    }
  }
}

static GEFEN_ALWAYS_INLINE void apply_block_t(void *param, const gefen_dtype dt, int64_t base,
                                              const float *mq, int64_t len, float s,
                                              float decay, float lr) {
  for (int64_t j = 0; j < len; j++) apply_one(param, dt, base + j, mq[j] * s, decay, lr);
}

static void apply_block(void *param, gefen_dtype dt, int64_t base, const float *mq,
                        int64_t len, float s, float decay, float lr) {
#define CALL(DT)                                               \
  apply_block_t(param, DT, base, mq, len, s, decay, lr); \
  return
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

static GEFEN_ALWAYS_INLINE void apply_factored_t(void *param, const gefen_dtype dt,
                                                 int64_t base, const float *mq, int64_t len,
                                                 float srow, const float *scol, float inv_bc1,
                                                 float eps, float decay, float lr) {
  for (int64_t j = 0; j < len; j++) {
    const float s = inv_bc1 / (srow * scol[j] + eps);
    apply_one(param, dt, base + j, mq[j] * s, decay, lr);
  }
}

static void apply_factored(void *param, gefen_dtype dt, int64_t base, const float *mq,
                           int64_t len, float srow, const float *scol, float inv_bc1,
                           float eps, float decay, float lr) {
#define CALL(DT)                                                                     \
  apply_factored_t(param, DT, base, mq, len, srow, scol, inv_bc1, eps, decay, lr); \
  return
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

/* ------------------------------------------------------------------ Muon */

static GEFEN_ALWAYS_INLINE void muon_output_t(void *out, const gefen_dtype out_dt,
                                              const void *grad, const gefen_dtype dt,
                                              int64_t base, const float *mq, int64_t len,
                                              float beta, float one_minus_beta) {
  for (int64_t j = 0; j < len; j++) {
    const float o = beta * mq[j] + one_minus_beta * load_dt(grad, dt, base + j);
    if (out_dt == GEFEN_F32)
      ((float *)out)[base + j] = o;
    else
      ((uint16_t *)out)[base + j] = gefen_f32_to_bf16_sel(o);
  }
}

static void muon_output(void *out, gefen_dtype out_dt, const void *grad, gefen_dtype dt,
                        int64_t base, const float *mq, int64_t len, float beta,
                        float one_minus_beta, int nesterov) {
  if (!nesterov) { /* the momentum itself */
    if (out_dt == GEFEN_F32) {
      memcpy((float *)out + base, mq, sizeof(float) * (size_t)len);
    } else {
      uint16_t *o = (uint16_t *)out + base;
      for (int64_t j = 0; j < len; j++) o[j] = gefen_f32_to_bf16_sel(mq[j]);
    }
    return;
  }
  if (out_dt == GEFEN_F32) {
#define CALL(DT)                                                                    \
  muon_output_t(out, GEFEN_F32, grad, DT, base, mq, len, beta, one_minus_beta); \
  return
    DTYPE_SWITCH(dt, CALL)
#undef CALL
  } else {
#define CALL(DT)                                                                     \
  muon_output_t(out, GEFEN_BF16, grad, DT, base, mq, len, beta, one_minus_beta); \
  return
    DTYPE_SWITCH(dt, CALL)
#undef CALL
  }
}

/* ------------------------------------------------------- factored stats */

static GEFEN_ALWAYS_INLINE double row_stats_t(const void *grad, const gefen_dtype dt,
                                              int64_t base, int64_t len, double *colsum) {
  double lanes[L] = {0};
  int64_t j = 0;
  for (; j + L <= len; j += L)
    for (int l = 0; l < L; l++) {
      const float g = load_dt(grad, dt, base + j + l);
      const float x = g * g;
      lanes[l] += x;
      colsum[j + l] += x;
    }
  for (int l = 0; j < len; j++, l++) {
    const float g = load_dt(grad, dt, base + j);
    const float x = g * g;
    lanes[l] += x;
    colsum[j] += x;
  }
  return gefen_sum_lanes(lanes);
}

static double row_stats_one(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                            double *colsum) {
#define CALL(DT) return row_stats_t(grad, DT, base, len, colsum)
  DTYPE_SWITCH(dt, CALL)
#undef CALL
}

static void row_stats(const void *grad, gefen_dtype dt, int64_t base, int64_t len, int64_t rows,
                      double *colsum, double *sums) {
  for (int64_t r = 0; r < rows; r++) sums[r] = row_stats_one(grad, dt, base + r * len, len, colsum);
}

/* ------------------------------------------------------------------ sinks */

void gefen_sink_apply(const gefen_block_ops *ops, const float *mq, int64_t len,
                      const gefen_sink *sk) {
  switch (sk->kind) {
    case GEFEN_SINK_M:
    case GEFEN_SINK_CODES:
      break;
    case GEFEN_SINK_ADAM_BLOCK:
      ops->apply_block(sk->out, sk->out_dtype, sk->base, mq, len, sk->s, sk->decay, sk->lr);
      break;
    case GEFEN_SINK_ADAM_FACTORED:
      ops->apply_factored(sk->out, sk->out_dtype, sk->base, mq, len, sk->s, sk->scol,
                          sk->inv_bc1, sk->eps, sk->decay, sk->lr);
      break;
    case GEFEN_SINK_MUON:
      ops->muon_output(sk->out, sk->out_dtype, sk->grad, sk->dtype, sk->base, mq, len, sk->beta,
                       sk->one_minus_beta, sk->nesterov);
      break;
  }
}

void gefen_requantize_apply_with(const gefen_block_ops *ops, const gefen_quantizer *q,
                                 float *m, float mx, int64_t len, uint8_t *codes,
                                 const gefen_sink *sink) {
  ops->requantize(q, m, mx, len, codes);
  gefen_sink_apply(ops, m, len, sink);
}

static void requantize_apply(const gefen_quantizer *q, float *m, float mx, int64_t len,
                             uint8_t *codes, const gefen_sink *sink) {
  gefen_requantize_apply_with(&gefen_block_ops_scalar, q, m, mx, len, codes, sink);
}

/* C[code] * mag: the product every requantisation forms for its dequantised
 * value (codebook[code] * mx; sel_value holds codebook[code] bit for bit). */
void gefen_dequantize_apply_with(const gefen_block_ops *ops, const gefen_quantizer *q,
                                 const uint8_t *codes, float mag, int64_t len, float *m,
                                 const gefen_sink *sink) {
  const float *cb = q->table.codebook;
  for (int64_t j = 0; j < len; j++) m[j] = cb[codes[j]] * mag;
  gefen_sink_apply(ops, m, len, sink);
}

static void dequantize_apply(const gefen_quantizer *q, const uint8_t *codes, float mag,
                             int64_t len, float *m, const gefen_sink *sink) {
  gefen_dequantize_apply_with(&gefen_block_ops_scalar, q, codes, mag, len, m, sink);
}

const gefen_block_ops gefen_block_ops_scalar = {
    adam_momentum, muon_momentum,  requantize,     requantize_apply,
    row_stats,     apply_block,    apply_factored, muon_output,
    dequantize_apply,
    NULL, /* adam_period1: the per-block primitives (the reference) */
};

/* ------------------------------------------------------------- dispatch */

const char *gefen_core_simd_path(void) {
  const gefen_block_ops *ops = gefen_block_ops_for(NULL);
  if (ops == gefen_block_ops_avx512bf16()) return "avx512bf16";
  if (ops == gefen_block_ops_avx512vbmi()) return "avx512vbmi";
  if (ops == gefen_block_ops_avx512()) return "avx512";
  if (ops == gefen_block_ops_avx2()) return "avx2";
  return "portable";
}

int gefen_core_key_search(void) { return gefen_cpu_prefers_key_search(); }

const gefen_block_ops *gefen_block_ops_for(const gefen_quantizer *q) {
  /* the threshold search of the AVX-512 versions is exact for every codebook */
  const gefen_block_ops *ops = gefen_block_ops_avx512bf16();
  if (!ops) ops = gefen_block_ops_avx512vbmi();
  if (!ops) ops = gefen_block_ops_avx512();
  if (ops) return ops;
  /* the AVX2 requantisation needs the exact lookup table */
  if (q && !q->table.exact_lut) return &gefen_block_ops_scalar;
  ops = gefen_block_ops_avx2();
  return ops ? ops : &gefen_block_ops_scalar;
}
