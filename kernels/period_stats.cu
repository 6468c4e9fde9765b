/*
 * Phase 1 of the period search (ALGORITHM.md §2), mirroring period.c's
 * gefen_period_stats: for each candidate d, the exact sum over the local
 * blocks of length d of the population variance of x = g^2 (x squared in
 * fp32, the variance two-pass in float64), the number of blocks whose
 * variance is not finite, and the number of blocks -- GEFEN_PERIOD_STAT_WIDTH
 * int64s per candidate (gefen_core.h, gefen_xsum.h).
 *
 *   period_variance   one thread group per variance block (two group sums:
 *                     the mean, then sum (x - mean)^2); lane 0 of the group
 *                     adds the variance to the CTA's exact accumulator in
 *                     shared memory (integer atomics), which thread 0
 *                     normalises and the CTA adds to the output (integer
 *                     atomics again)
 *   period_count      adds the block count
 * Integer sums do not depend on order, so the result is a fixed function of
 * the block variances: independent of the grid, the device and the
 * scheduling. Within a block the float64 sums run in the group order of
 * gefen_cuda_common.cuh, not left to right as on the CPU: a block variance
 * agrees with the core's to float64 rounding (tests compare the rounded sums
 * with a relative 1e-12). Runs once per parameter (first step), one pass over
 * g per candidate.
 */
#include "gefen_cuda_common.cuh"
#include "gefen_xsum.h"

typedef unsigned long long ull;

template <int DT>
__global__ void __launch_bounds__(GEFEN_CTA)
    period_variance_kernel(const void *grad, int64_t d, int64_t nblocks, int G,
                           int64_t *stats) {
  __shared__ int64_t acc[GEFEN_PERIOD_STAT_WIDTH];
  for (int i = threadIdx.x; i < GEFEN_PERIOD_STAT_WIDTH; i += blockDim.x) acc[i] = 0;
  __syncthreads();
  const int per_cta = GEFEN_CTA / G, lane = threadIdx.x % G, slot = threadIdx.x / G;
  for (int64_t first = (int64_t)blockIdx.x * per_cta; first < nblocks;
       first += (int64_t)gridDim.x * per_cta) {
    const int64_t b = first + slot, base = b * d;
    const bool active = b < nblocks;
    float unused = 0.0f;
    double sum = 0.0;
    if (active)
      for (int64_t j = lane; j < d; j += G) sum = add_sq(sum, load_f32<DT>(grad, base + j));
    group_reduce(&unused, &sum, G);
    const double mean = d_div(sum, (double)d);
    double ssd = 0.0;
    if (active) {
      for (int64_t j = lane; j < d; j += G) {
        const float g = load_f32<DT>(grad, base + j);
        const double dv = d_sub((double)f_mul(g, g), mean);
        ssd = d_add(ssd, d_mul(dv, dv));
      }
    }
    group_reduce(&unused, &ssd, G);
    if (active && lane == 0) {
      const double var = d_div(ssd, (double)d);
      int k;
      int64_t piece[3];
      if (!gefen_xsum_accepts(var)) {
        atomicAdd((ull *)&acc[GEFEN_PERIOD_STAT_NONFINITE], 1ull);
      } else if (gefen_xsum_split(var, &k, piece)) {
        for (int i = 0; i < 3; i++) atomicAdd((ull *)&acc[k + i], (ull)piece[i]);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) (void)gefen_xsum_normalize(acc);
  __syncthreads();
  for (int i = threadIdx.x; i < GEFEN_PERIOD_STAT_BLOCKS; i += blockDim.x)
    if (acc[i]) atomicAdd((ull *)&stats[i], (ull)acc[i]);
}

__global__ void period_count_kernel(int64_t *stats, int64_t blocks) {
  stats[GEFEN_PERIOD_STAT_BLOCKS] += blocks;
}

extern "C" size_t gefen_cuda_period_stats_scratch_bytes(const gefen_matrix *g,
                                                        int64_t n_cands) {
  (void)g;
  (void)n_cands;
  return 0; /* the exact accumulators live in shared memory and the output */
}

extern "C" gefen_status gefen_cuda_period_stats(const gefen_matrix *g, const int64_t *cands,
                                                int64_t n_cands, int64_t *device_stats,
                                                void *scratch, size_t scratch_bytes,
                                                void *stream, gefen_error *err) {
  (void)scratch;
  (void)scratch_bytes;
  gefen_cuda_clear(err);
  gefen_status st = gefen_cuda_check_matrix(g, err);
  if (st != GEFEN_OK) return st;
  if (n_cands < 0 || (n_cands > 0 && (!cands || !device_stats)))
    return gefen_cuda_fail(err, GEFEN_EVALUE, -1,
                           "period statistics need candidates and outputs");
  for (int64_t k = 0; k < n_cands; k++)
    if (cands[k] < 1 || g->cols % cands[k])
      return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "candidate period %lld does not divide %lld",
                             (long long)cands[k], (long long)g->cols);
  const int64_t rows = g->rows, cols = g->cols;
  if (rows == 0 || cols == 0 || n_cands == 0) return GEFEN_OK;

  const cudaStream_t s = (cudaStream_t)stream;
  for (int64_t k = 0; k < n_cands; k++) {
    const int64_t d = cands[k], nblocks = rows * (cols / d);
    int64_t *out = device_stats + k * GEFEN_PERIOD_STAT_WIDTH;
    if (d > 1) { /* a block of one has no variance */
      const int G = gefen_group_size(d);
      const unsigned nparts = gefen_period_ctas(nblocks, G);
#define LAUNCH(DT) \
  period_variance_kernel<DT><<<nparts, GEFEN_CTA, 0, s>>>(g->data, d, nblocks, G, out)
      GEFEN_DISPATCH_DTYPE(g->dtype, LAUNCH);
#undef LAUNCH
      st = gefen_cuda_launched("period statistics", -1, err);
      if (st != GEFEN_OK) return st;
    }
    period_count_kernel<<<1, 1, 0, s>>>(out, nblocks);
    st = gefen_cuda_launched("period statistics", -1, err);
    if (st != GEFEN_OK) return st;
  }
  return GEFEN_OK;
}
