/* The per-block primitives of the element kernels, in a portable C version
 * (block_scalar.c) and an AVX-512 version (block_avx512.c) chosen at run time.
 * Both compute the same operations in the same order, so they give the same
 * results bit for bit.
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

typedef struct {
  /* Gefen: m = beta1 * (C[code] * mag_old) + (1 - beta1) * g; adds sum g^2
   * to *sq; returns max|m| (NaN never wins; 0 for an all-NaN block). */
  float (*adam_momentum)(const void *grad, gefen_dtype dt, int64_t base,
                         const uint8_t *codes, const float *codebook, float mag_old,
                         float beta1, float one_minus_beta1, int64_t len, float *m,
                         double *sq);
  /* GefenMuon: mo = C[code] * mag_old; m = mo + (1 - beta) * (g - mo). */
  float (*muon_momentum)(const void *grad, gefen_dtype dt, int64_t base,
                         const uint8_t *codes, const float *codebook, float mag_old,
                         float one_minus_beta, int64_t len, float *m);
  /* Nearest-code requantisation of m with magnitude mx (u = m / mx, or 0 when
   * mx == 0): writes codes and overwrites m with C[code] * mx. */
  void (*requantize)(const gefen_quantizer *q, float *m, float mx, int64_t len,
                     uint8_t *codes);
  /* Factored statistics of one row: adds g_j^2 to colsum[j] (float64) and
   * returns the row's sum of g^2. */
  double (*row_stats)(const void *grad, gefen_dtype dt, int64_t base, int64_t len,
                      double *colsum);
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
} gefen_block_ops;

/* The portable primitives (every dtype, every codebook). */
extern const gefen_block_ops gefen_block_ops_scalar;

/* The fastest primitives for this CPU and quantiser (NULL: any quantiser). */
const gefen_block_ops *gefen_block_ops_for(const gefen_quantizer *q);

/* The AVX-512 primitives, or NULL when this CPU (or build) has none. */
const gefen_block_ops *gefen_block_ops_avx512(void);

/* Stochastic requantisation (ALGORITHM.md §6): like requantize, with the
 * element's global flat index global_base + j. Portable only. */
void gefen_requantize_stochastic(const gefen_quantizer *q, float *m, float mx,
                                 int64_t len, uint8_t *codes, uint64_t seed,
                                 int64_t global_base);

#endif /* GEFEN_BLOCK_OPS_H */
