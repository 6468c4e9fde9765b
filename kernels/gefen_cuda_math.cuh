/*
 * Per-element math of the CUDA kernels, shared by host and device.
 *
 * These are line-by-line mirrors of the CPU core: block_scalar.c (momentum,
 * requantisation, parameter update), quantizer.c / quantizer_internal.h (the
 * lookup-table quantiser, its binary-search reference, stochastic rounding),
 * core_internal.h (dtype conversions) and adam.c (constants, factored
 * columns). They are __host__ __device__ so that kernels/test/host_check.cu
 * can run them on the CPU against the core.
 *
 * Exactness: every fp32 / fp64 operation goes through f_add, f_mul, ... On
 * the device these are the _rn intrinsics, which nvcc never contracts into an
 * FMA and which are correctly rounded (division and square root included)
 * whatever -fmad / -prec-div / -use_fast_math say. On the host they are plain
 * operators; build host code with -ffp-contract=off (as the core is).
 */
#ifndef GEFEN_CUDA_MATH_CUH
#define GEFEN_CUDA_MATH_CUH

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gefen_core.h"

#define GEFEN_HD __host__ __device__ __forceinline__

/* ------------------------------------------------ correctly rounded ops */

GEFEN_HD float f_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GEFEN_HD float f_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
GEFEN_HD float f_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GEFEN_HD float f_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
GEFEN_HD float f_sqrt(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return sqrtf(a);
#endif
}
GEFEN_HD double d_add(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
GEFEN_HD double d_sub(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
GEFEN_HD double d_mul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
GEFEN_HD double d_div(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

/* A read through the read-only data cache on the device (the quantiser
 * table and other inputs no thread writes during the kernel). */
template <typename T>
GEFEN_HD T ro(const T *p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

GEFEN_HD float u32_as_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}
GEFEN_HD uint32_t f32_as_u32(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

/* ------------------------------------- dtype conversion (core_internal.h) */

GEFEN_HD float bf16_to_f32(uint16_t h) { return u32_as_f32((uint32_t)h << 16); }

/* Round to nearest even; NaN stays a quiet NaN. */
GEFEN_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_as_u32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

GEFEN_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: normalise */
      int e = -1;
      do {
        man <<= 1;
        e++;
      } while ((man & 0x400u) == 0);
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return u32_as_f32(u);
}

/* Round to nearest even, overflow to inf, NaN to a quiet NaN. */
GEFEN_HD uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_as_u32(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
  if (a < 0x38800000u) {                                  /* subnormal or zero */
    if (a < 0x33000000u) return sign;                     /* below half the smallest subnormal */
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e; /* 14 .. 24 */
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = a - 0x38000000u; /* rebias exponent 127 -> 15 */
  r += 0x0fffu + ((r >> 13) & 1u);
  return (uint16_t)(sign | (r >> 13));
}

/* Element i of a gradient (or parameter) of dtype DT as fp32 (gefen_load). */
template <int DT>
GEFEN_HD float load_f32(const void *p, int64_t i) {
  if constexpr (DT == GEFEN_BF16)
    return bf16_to_f32(ro((const uint16_t *)p + i));
  else if constexpr (DT == GEFEN_F16)
    return f16_to_f32(ro((const uint16_t *)p + i));
  else if constexpr (DT == GEFEN_F64)
    return (float)ro((const double *)p + i);
  else
    return ro((const float *)p + i);
}

/* p <- p * decay - lr * delta, rounded once to the parameter's dtype
 * (block_scalar.c apply_one; float64 parameters keep float64 precision). */
template <int DT>
GEFEN_HD void apply_update(void *param, int64_t i, float delta, float decay, float lr) {
  if constexpr (DT == GEFEN_F32) {
    float *p = (float *)param;
    p[i] = f_sub(f_mul(p[i], decay), f_mul(lr, delta));
  } else if constexpr (DT == GEFEN_BF16) {
    uint16_t *p = (uint16_t *)param;
    p[i] = f32_to_bf16(f_sub(f_mul(bf16_to_f32(p[i]), decay), f_mul(lr, delta)));
  } else if constexpr (DT == GEFEN_F16) {
    uint16_t *p = (uint16_t *)param;
    p[i] = f32_to_f16(f_sub(f_mul(f16_to_f32(p[i]), decay), f_mul(lr, delta)));
  } else if constexpr (DT == GEFEN_F64) {
    double *p = (double *)param;
    p[i] = d_sub(d_mul(p[i], (double)decay), d_mul((double)lr, (double)delta));
  }
}

/* GefenMuon's Newton-Schulz input element (float32 or bfloat16 output). */
GEFEN_HD void store_out(void *out, int out_dtype, int64_t i, float v) {
  if (out_dtype == GEFEN_F32)
    ((float *)out)[i] = v;
  else
    ((uint16_t *)out)[i] = f32_to_bf16(v);
}

/* ---------------------------------------------- quantiser (quantizer.c) */

/* The reference rule by binary search; exact for every float, NaN included. */
GEFEN_HD uint8_t q_reference(const float *c, float u) {
  int lo = 0, hi = GEFEN_CODEBOOK_SIZE; /* first index with c[r] >= u in [lo, hi] */
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (ro(c + mid) >= u)
      hi = mid;
    else
      lo = mid + 1;
  }
  const int r = lo > GEFEN_CODEBOOK_SIZE - 1 ? GEFEN_CODEBOOK_SIZE - 1 : lo;
  const int l = r > 0 ? r - 1 : 0;
  return (uint8_t)(fabsf(f_sub(u, ro(c + l))) <= fabsf(f_sub(u, ro(c + r))) ? l : r);
}

/* Nearest code through the lookup table (quantizer_internal.h). */
GEFEN_HD uint8_t q_nearest(const gefen_quant_table *t, float u) {
  if (!(u >= -1.0f && u <= 1.0f) || !ro(&t->exact_lut)) return q_reference(t->codebook, u);
  int b = (int)f_mul(f_add(u, 1.0f), (float)(GEFEN_LUT_BUCKETS / 2));
  if (b > GEFEN_LUT_BUCKETS - 1) b = GEFEN_LUT_BUCKETS - 1;
  int k = ro(&t->bucket[b]);
  const float v0 = ro(&t->value[k]), v1 = ro(&t->value[k + 1]);
  if (!(fabsf(f_sub(u, v0)) <= fabsf(f_sub(u, v1)))) k++;
  return u <= ro(&t->value[k]) ? ro(&t->first[k]) : ro(&t->last[k]);
}

/* The uniform variate of ALGORITHM.md §6 (gefen_sr_uniform). */
GEFEN_HD float sr_uniform(uint64_t seed, int64_t global_index) {
  uint64_t z = seed + UINT64_C(0x9E3779B97F4A7C15) * ((uint64_t)global_index + 1u);
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  z ^= z >> 31;
  return f_mul((float)(uint32_t)(z >> 40), 1.0f / 16777216.0f);
}

/* Stochastic rounding between the two neighbours (gefen_quant_stochastic). */
GEFEN_HD uint8_t q_stochastic(const gefen_quant_table *t, float u, uint64_t seed,
                              int64_t global_index) {
  const float *c = t->codebook;
  int lo = 0, hi = GEFEN_CODEBOOK_SIZE;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (ro(c + mid) >= u)
      hi = mid;
    else
      lo = mid + 1;
  }
  const int r = lo > GEFEN_CODEBOOK_SIZE - 1 ? GEFEN_CODEBOOK_SIZE - 1 : lo;
  const int l = r > 0 ? r - 1 : 0;
  const float cl = ro(c + l);
  const float span = f_sub(ro(c + r), cl);
  const float p_up = span > 0.0f ? f_div(f_sub(u, cl), span) : 0.0f;
  return (uint8_t)(sr_uniform(seed, global_index) < p_up ? r : l);
}

/* --------------------------------------- block primitives (block_scalar.c) */

/* Gefen momentum: beta1 * (C[code] * mag_old) + (1 - beta1) * g. */
GEFEN_HD float adam_momentum(float code_value, float mag_old, float g, float beta1,
                             float one_minus_beta1) {
  const float mo = f_mul(code_value, mag_old);
  return f_add(f_mul(beta1, mo), f_mul(one_minus_beta1, g));
}

/* GefenMuon momentum: mo + (1 - beta) * (g - mo). */
GEFEN_HD float muon_momentum(float code_value, float mag_old, float g, float one_minus_beta) {
  const float mo = f_mul(code_value, mag_old);
  return f_add(mo, f_mul(one_minus_beta, f_sub(g, mo)));
}

/* Running max of |v|; NaN never wins (and the max is order-independent). */
GEFEN_HD float max_abs(float mx, float v) {
  const float a = fabsf(v);
  return a > mx ? a : mx;
}

/* The value the quantiser sees: m / mx, or 0 for a zero block. */
GEFEN_HD float quant_input(float m, float mx) { return mx > 0.0f ? f_div(m, mx) : 0.0f; }

/* The code of u, nearest or stochastic with the element's global index. */
GEFEN_HD uint8_t quantize(const gefen_quant_table *t, float u, int stochastic, uint64_t seed,
                          int64_t global_index) {
  return stochastic ? q_stochastic(t, u, seed, global_index) : q_nearest(t, u);
}

/* ------------------------------------------------------ adam.c constants */

/* Per-item constants of the Gefen step, computed on the host exactly as
 * adam.c's make_consts / factored_columns do (float64, then one rounding). */
typedef struct {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float inv_bc1; /* 1 / (1 - beta1^step) */
  float rs_bc2;  /* 1 / sqrt(1 - beta2^step), block form */
  float bc2;     /* (float)(1 - beta2^step), factored columns */
  float eps, lr, decay; /* decay = 1 - lr * weight_decay */
} adam_consts;

static inline adam_consts adam_make_consts(const gefen_adam_item *it) {
  adam_consts k;
  const double bc1 = 1.0 - pow(it->beta1, (double)it->step);
  const double bc2 = 1.0 - pow(it->beta2, (double)it->step);
  k.beta1 = (float)it->beta1;
  k.one_minus_beta1 = (float)(1.0 - it->beta1);
  k.beta2 = (float)it->beta2;
  k.one_minus_beta2 = (float)(1.0 - it->beta2);
  k.inv_bc1 = (float)(1.0 / bc1);
  k.rs_bc2 = (float)(1.0 / sqrt(bc2));
  k.bc2 = (float)bc2;
  k.eps = (float)it->eps;
  k.lr = (float)it->lr;
  k.decay = (float)(1.0 - it->lr * it->weight_decay);
  return k;
}

/* Block form: vmean <- beta2 * vmean + (1 - beta2) * mean(g^2). */
GEFEN_HD float block_vmean(const adam_consts &k, float vmean_old, double sum_sq, int64_t len) {
  return f_add(f_mul(k.beta2, vmean_old),
               f_mul(k.one_minus_beta2, (float)d_div(sum_sq, (double)len)));
}

/* Block form step size: inv_bc1 / (sqrt(vmean) * rs_bc2 + eps). */
GEFEN_HD float block_step(const adam_consts &k, float vmean) {
  return f_div(k.inv_bc1, f_add(f_mul(f_sqrt(vmean), k.rs_bc2), k.eps));
}

/* Factored: v_row <- beta2 * v_row + (1 - beta2) * (float)row_mean. */
GEFEN_HD float factored_vrow(float beta2, float one_minus_beta2, float v_row_old,
                             double row_mean) {
  return f_add(f_mul(beta2, v_row_old), f_mul(one_minus_beta2, (float)row_mean));
}

/* Factored: the new v_col_j and its step factor sqrt(v_col_j / max(mu,
 * FLT_MIN) / bc2) (adam.c factored_columns). */
GEFEN_HD float factored_vcol(const adam_consts &k, float v_col_old, double col_sum,
                             int64_t global_rows) {
  const float cm = (float)d_div(col_sum, (double)global_rows);
  return f_add(f_mul(k.beta2, v_col_old), f_mul(k.one_minus_beta2, cm));
}
GEFEN_HD float factored_denom(double vrow_sum, int64_t global_rows) {
  const float mu = (float)d_div(vrow_sum, (double)global_rows);
  return mu > FLT_MIN ? mu : FLT_MIN;
}
GEFEN_HD float factored_scol(const adam_consts &k, float v_col, float denom) {
  return f_sqrt(f_div(f_div(v_col, denom), k.bc2));
}

/* Factored step size: inv_bc1 / (sqrt(v_row) * scol_j + eps). */
GEFEN_HD float factored_step(const adam_consts &k, float srow, float scol) {
  return f_div(k.inv_bc1, f_add(f_mul(srow, scol), k.eps));
}

/* Newton-Schulz input: beta * mq + (1 - beta) * g (nesterov) or mq. */
GEFEN_HD float muon_output(float mq, float g, float beta, float one_minus_beta, int nesterov) {
  return nesterov ? f_add(f_mul(beta, mq), f_mul(one_minus_beta, g)) : mq;
}

/* (float)x * x added to a float64 sum, as every g^2 statistic of the core. */
GEFEN_HD double add_sq(double acc, float g) { return d_add(acc, (double)f_mul(g, g)); }

#endif /* GEFEN_CUDA_MATH_CUH */
