/*
 * The codebook histogram (ALGORITHM.md §3), mirroring period.c's
 * gefen_histogram: per block of `period` elements a = max|g| (NaN never wins),
 * u = g / a (0 when a == 0), bin = floor((u + 1) * 2048) clamped to 4095;
 * values outside [-1, 1] (NaN, inf) are not counted.
 *
 * One thread group per block finds a (group max, order-independent); each
 * CTA counts into a shared uint32 histogram and adds its non-zero bins to the
 * int64 histogram with 64-bit integer atomics. Integer addition is exact and
 * associative, so the result is independent of scheduling.
 */
#include "gefen_cuda_common.cuh"

#define HIST_MAX_CTAS 1024
#define HIST_MAX_PER_CTA (INT64_C(1) << 30) /* elements a uint32 shared bin can count */

template <int DT>
__global__ void __launch_bounds__(GEFEN_CTA)
    histogram_kernel(const void *grad, int64_t period, int64_t nblocks, int G, int64_t *hist) {
  __shared__ unsigned int h[GEFEN_HIST_BINS];
  for (int i = threadIdx.x; i < GEFEN_HIST_BINS; i += GEFEN_CTA) h[i] = 0u;
  __syncthreads();
  const int per_cta = GEFEN_CTA / G, lane = threadIdx.x % G, slot = threadIdx.x / G;
  for (int64_t first = (int64_t)blockIdx.x * per_cta; first < nblocks;
       first += (int64_t)gridDim.x * per_cta) {
    const int64_t b = first + slot, base = b * period;
    const bool active = b < nblocks;
    float a = 0.0f;
    double unused = 0.0;
    if (active)
      for (int64_t j = lane; j < period; j += G) a = max_abs(a, load_f32<DT>(grad, base + j));
    group_reduce(&a, &unused, G);
    if (!active) continue;
    for (int64_t j = lane; j < period; j += G) {
      const float u = quant_input(load_f32<DT>(grad, base + j), a);
      if (!(u >= -1.0f && u <= 1.0f)) continue; /* non-finite: not counted */
      int bin = (int)floorf(f_mul(f_add(u, 1.0f), 2048.0f));
      if (bin > GEFEN_HIST_BINS - 1) bin = GEFEN_HIST_BINS - 1;
      atomicAdd(&h[bin], 1u);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < GEFEN_HIST_BINS; i += GEFEN_CTA)
    if (h[i]) atomicAdd((unsigned long long *)&hist[i], (unsigned long long)h[i]);
}

extern "C" gefen_status gefen_cuda_histogram(const gefen_matrix *g, int64_t period,
                                             int64_t *device_hist, void *stream,
                                             gefen_error *err) {
  gefen_cuda_clear(err);
  gefen_status st = gefen_cuda_check_matrix(g, err);
  if (st != GEFEN_OK) return st;
  if (!device_hist) return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "histogram output is NULL");
  if (period < 1 || (g->cols > 0 && g->cols % period))
    return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "period %lld does not divide %lld",
                           (long long)period, (long long)g->cols);
  const int64_t numel = g->rows * g->cols;
  if (numel == 0) return GEFEN_OK;
  const int64_t nblocks = numel / period;
  const int G = gefen_group_size(period);
  const int64_t per_cta = GEFEN_CTA / G;
  int64_t ctas = (nblocks + per_cta - 1) / per_cta;
  if (ctas > HIST_MAX_CTAS) ctas = HIST_MAX_CTAS;
  /* enough CTAs that no shared uint32 bin can overflow (blocks are spread evenly) */
  const int64_t floor_ctas = numel / HIST_MAX_PER_CTA + 1;
  if (ctas < floor_ctas) ctas = floor_ctas;
  if (ctas > GEFEN_MAX_GRID)
    return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "histogram input too large");
  const cudaStream_t s = (cudaStream_t)stream;
#define LAUNCH(DT) \
  histogram_kernel<DT><<<(unsigned)ctas, GEFEN_CTA, 0, s>>>(g->data, period, nblocks, G, device_hist)
  GEFEN_DISPATCH_DTYPE(g->dtype, LAUNCH);
#undef LAUNCH
  return gefen_cuda_launched("histogram", -1, err);
}
