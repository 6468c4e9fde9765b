/*
 * Phase 1 of the period search (ALGORITHM.md §2), mirroring period.c's
 * gefen_period_stats: for each candidate d, the sum over the local blocks of
 * length d of the population variance of x = g^2 (x squared in fp32, the
 * variance two-pass in float64), and the number of blocks.
 *
 *   period_variance   one thread group per variance block (two group sums:
 *                     the mean, then sum (x - mean)^2); each CTA adds its
 *                     groups' variances in slot order into scratch[cta]
 *   period_finish     one thread adds the CTA partials in CTA order to
 *                     sums[k], and the block count to counts[k]
 * The CTA count is a fixed function of the shape and d, so the result does
 * not depend on the device. Within a block the float64 sums run in the group
 * order of gefen_cuda_common.cuh, not left to right as on the CPU: results
 * agree with the core to float64 rounding (the period choice is a difference
 * of square roots of these sums; tests compare with a relative 1e-12).
 * Runs once per parameter (first step), one pass over g per candidate.
 */
#include "gefen_cuda_common.cuh"

template <int DT>
__global__ void __launch_bounds__(GEFEN_CTA)
    period_variance_kernel(const void *grad, int64_t d, int64_t nblocks, int G,
                           double *partial) {
  __shared__ double slot_sum[GEFEN_CTA];
  const int per_cta = GEFEN_CTA / G, lane = threadIdx.x % G, slot = threadIdx.x / G;
  double mine = 0.0; /* this group's sum of variances */
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
    double acc = 0.0;
    if (active) {
      for (int64_t j = lane; j < d; j += G) {
        const float g = load_f32<DT>(grad, base + j);
        const double dv = d_sub((double)f_mul(g, g), mean);
        acc = d_add(acc, d_mul(dv, dv));
      }
    }
    group_reduce(&unused, &acc, G);
    if (active) mine = d_add(mine, d_div(acc, (double)d));
  }
  if (lane == 0) slot_sum[slot] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int k = 0; k < per_cta; k++) s = d_add(s, slot_sum[k]);
    partial[blockIdx.x] = s;
  }
}

__global__ void period_finish_kernel(const double *partial, int nparts, double *sum,
                                     double *count, double blocks) {
  double s = 0.0;
  for (int i = 0; i < nparts; i++) s = d_add(s, partial[i]);
  *sum = d_add(*sum, s);
  *count = d_add(*count, blocks);
}

extern "C" size_t gefen_cuda_period_stats_scratch_bytes(const gefen_matrix *g,
                                                        int64_t n_cands) {
  if (!g || g->rows <= 0 || g->cols <= 0 || n_cands <= 0) return 0;
  return GEFEN_PERIOD_MAX_CTAS * sizeof(double);
}

extern "C" gefen_status gefen_cuda_period_stats(const gefen_matrix *g, const int64_t *cands,
                                                int64_t n_cands, double *device_sums,
                                                double *device_counts, void *scratch,
                                                size_t scratch_bytes, void *stream,
                                                gefen_error *err) {
  gefen_cuda_clear(err);
  gefen_status st = gefen_cuda_check_matrix(g, err);
  if (st != GEFEN_OK) return st;
  if (n_cands < 0 || (n_cands > 0 && (!cands || !device_sums || !device_counts)))
    return gefen_cuda_fail(err, GEFEN_EVALUE, -1,
                           "period statistics need candidates and outputs");
  for (int64_t k = 0; k < n_cands; k++)
    if (cands[k] < 1 || g->cols % cands[k])
      return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "candidate period %lld does not divide %lld",
                             (long long)cands[k], (long long)g->cols);
  const int64_t rows = g->rows, cols = g->cols;
  if (rows == 0 || cols == 0 || n_cands == 0) return GEFEN_OK;

  const cudaStream_t s = (cudaStream_t)stream;
  gefen_cuda_scratch sc;
  st = gefen_scratch_get(&sc, scratch, scratch_bytes,
                         gefen_cuda_period_stats_scratch_bytes(g, n_cands), s,
                         "period statistics scratch", err);
  if (st != GEFEN_OK) return st;
  double *partial = (double *)sc.ptr;
  /* one scratch serves every candidate: the launches are ordered on the stream */
  for (int64_t k = 0; k < n_cands && st == GEFEN_OK; k++) {
    const int64_t d = cands[k], nblocks = rows * (cols / d);
    unsigned nparts = 0;
    if (d > 1) { /* a block of one has no variance */
      const int G = gefen_group_size(d);
      nparts = gefen_period_ctas(nblocks, G);
#define LAUNCH(DT) \
  period_variance_kernel<DT><<<nparts, GEFEN_CTA, 0, s>>>(g->data, d, nblocks, G, partial)
      GEFEN_DISPATCH_DTYPE(g->dtype, LAUNCH);
#undef LAUNCH
      st = gefen_cuda_launched("period statistics", -1, err);
      if (st != GEFEN_OK) break;
    }
    period_finish_kernel<<<1, 1, 0, s>>>(partial, (int)nparts, device_sums + k,
                                         device_counts + k, (double)rows * (double)(cols / d));
    st = gefen_cuda_launched("period statistics", -1, err);
  }
  return gefen_scratch_put(&sc, st, "period statistics scratch", err);
}
