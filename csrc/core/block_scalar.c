/* Portable versions of the block primitives (see block_ops.h): the reference
 * the SIMD versions are tested against, and the path for float64 parameters,
 * CPUs without AVX-512 and codebooks whose lookup table is not exact. */
#include "block_ops.h"
#include "kernel_internal.h"

static float adam_momentum(const void *grad, gefen_dtype dt, int64_t base,
                           const uint8_t *codes, const float *cb, float mag_old, float beta1,
                           float one_minus_beta1, int64_t len, float *m, double *sq) {
  float mx = 0.0f;
  double lanes[GEFEN_SUM_LANES] = {0};
  for (int64_t j = 0; j < len; j++) {
    const float g = gefen_load(grad, dt, base + j);
    const float mo = cb[codes[j]] * mag_old;
    const float v = beta1 * mo + one_minus_beta1 * g;
    m[j] = v;
    const float a = fabsf(v);
    mx = a > mx ? a : mx;
    const float x = g * g;
    lanes[j % GEFEN_SUM_LANES] += x;
  }
  *sq += gefen_sum_lanes(lanes);
  return mx;
}

static float muon_momentum(const void *grad, gefen_dtype dt, int64_t base,
                           const uint8_t *codes, const float *cb, float mag_old,
                           float one_minus_beta, int64_t len, float *m) {
  float mx = 0.0f;
  for (int64_t j = 0; j < len; j++) {
    const float g = gefen_load(grad, dt, base + j);
    const float mo = cb[codes[j]] * mag_old;
    const float v = mo + one_minus_beta * (g - mo);
    m[j] = v;
    const float a = fabsf(v);
    mx = a > mx ? a : mx;
  }
  return mx;
}

static void requantize(const gefen_quantizer *q, float *m, float mx, int64_t len,
                       uint8_t *codes) {
  const gefen_quant_table *t = &q->table;
  for (int64_t j = 0; j < len; j++) {
    const float u = mx > 0.0f ? m[j] / mx : 0.0f;
    const uint8_t c = gefen_quant_nearest(t, u);
    codes[j] = c;
    m[j] = t->codebook[c] * mx;
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
      p[i] = gefen_f32_to_bf16(gefen_bf16_to_f32(p[i]) * decay - lr * delta);
      break;
    }
    case GEFEN_F16: {
      uint16_t *p = (uint16_t *)param;
      p[i] = gefen_f32_to_f16(gefen_f16_to_f32(p[i]) * decay - lr * delta);
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

static void apply_block(void *param, gefen_dtype dt, int64_t base, const float *mq,
                        int64_t len, float s, float decay, float lr) {
  for (int64_t j = 0; j < len; j++) apply_one(param, dt, base + j, mq[j] * s, decay, lr);
}

static void apply_factored(void *param, gefen_dtype dt, int64_t base, const float *mq,
                           int64_t len, float srow, const float *scol, float inv_bc1,
                           float eps, float decay, float lr) {
  for (int64_t j = 0; j < len; j++) {
    const float s = inv_bc1 / (srow * scol[j] + eps);
    apply_one(param, dt, base + j, mq[j] * s, decay, lr);
  }
}

static void muon_output(void *out, gefen_dtype out_dt, const void *grad, gefen_dtype dt,
                        int64_t base, const float *mq, int64_t len, float beta,
                        float one_minus_beta, int nesterov) {
  for (int64_t j = 0; j < len; j++) {
    float o = mq[j];
    if (nesterov) o = beta * mq[j] + one_minus_beta * gefen_load(grad, dt, base + j);
    if (out_dt == GEFEN_F32)
      ((float *)out)[base + j] = o;
    else
      ((uint16_t *)out)[base + j] = gefen_f32_to_bf16(o);
  }
}

static double row_stats(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                        double *colsum) {
  double lanes[GEFEN_SUM_LANES] = {0};
  for (int64_t j = 0; j < len; j++) {
    const float g = gefen_load(grad, dt, base + j);
    const float x = g * g;
    lanes[j % GEFEN_SUM_LANES] += x;
    colsum[j] += x;
  }
  return gefen_sum_lanes(lanes);
}

const gefen_block_ops gefen_block_ops_scalar = {
    adam_momentum, muon_momentum, requantize, row_stats,
    apply_block,   apply_factored, muon_output,
};
