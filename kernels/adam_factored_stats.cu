/*
 * Factored phase 1 of the Gefen step (adam.c gefen_adam_factored_stats):
 *
 *   row_stats[i]      = mean_j g_ij^2                    (float64)
 *   col_stats[j]      = sum over local rows of g_ij^2    (float64, j < cols)
 *   col_stats[cols]   = sum over local rows of the new v_row_i
 *
 * Three kernels, all with a fixed summation order (deterministic):
 *   factored_row_stats   one thread group per row (g^2 summed in float64)
 *   factored_col_partial thread j of chunk c sums column j over the rows of
 *                        chunk c, in row order, into scratch[c][j]
 *   factored_stats_finish col_stats[j] = sum of the chunks in chunk order; the
 *                        last CTA sums the new v_row over all rows
 * The number of row chunks is a fixed function of (rows, cols) (enough
 * threads to fill a large GPU), not of the device. g is read twice (rows,
 * then columns); the second read often hits L2.
 */
#include "gefen_cuda_common.cuh"

template <int DT>
__global__ void __launch_bounds__(GEFEN_CTA)
    factored_row_stats_kernel(const void *grad, double *row_stats, int64_t rows,
                              int64_t cols, int G) {
  const int per_cta = GEFEN_CTA / G, lane = threadIdx.x % G, slot = threadIdx.x / G;
  for (int64_t first = (int64_t)blockIdx.x * per_cta; first < rows;
       first += (int64_t)gridDim.x * per_cta) {
    const int64_t r = first + slot;
    float unused = 0.0f;
    double acc = 0.0;
    if (r < rows)
      for (int64_t j = lane; j < cols; j += G) acc = add_sq(acc, load_f32<DT>(grad, r * cols + j));
    group_reduce(&unused, &acc, G);
    if (r < rows && lane == 0) row_stats[r] = d_div(acc, (double)cols);
  }
}

template <int DT>
__global__ void __launch_bounds__(GEFEN_CTA)
    factored_col_partial_kernel(const void *grad, double *partial, int64_t rows,
                                int64_t cols, int64_t nchunk) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, c = blockIdx.y;
  if (j >= cols) return;
  const int64_t r0 = rows * c / nchunk, r1 = rows * (c + 1) / nchunk;
  double acc = 0.0;
  for (int64_t r = r0; r < r1; r++) acc = add_sq(acc, load_f32<DT>(grad, r * cols + j));
  partial[c * cols + j] = acc;
}

__global__ void __launch_bounds__(GEFEN_CTA)
    factored_stats_finish_kernel(const double *partial, int64_t nchunk, double *col_stats,
                                 int64_t cols, const float *v_row, const double *row_stats,
                                 int64_t rows, float beta2, float one_minus_beta2) {
  if (blockIdx.x == gridDim.x - 1) { /* the sum of the new v_row, one CTA */
    float unused = 0.0f;
    double acc = 0.0;
    for (int64_t r = threadIdx.x; r < rows; r += GEFEN_CTA)
      acc = d_add(acc, (double)factored_vrow(beta2, one_minus_beta2, v_row[r], row_stats[r]));
    group_reduce(&unused, &acc, GEFEN_CTA);
    if (threadIdx.x == 0) col_stats[cols] = acc;
    return;
  }
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  double acc = 0.0;
  for (int64_t c = 0; c < nchunk; c++) acc = d_add(acc, partial[c * cols + j]);
  col_stats[j] = acc;
}

/* ----------------------------------------------------------------- host */

extern "C" size_t gefen_cuda_adam_factored_stats_scratch_bytes(const gefen_adam_item *items,
                                                               int64_t n) {
  size_t most = 0;
  for (int64_t i = 0; items && i < n; i++) {
    const gefen_adam_item *it = &items[i];
    if (it->vmean || it->rows <= 0 || it->cols <= 0) continue;
    const size_t need =
        (size_t)gefen_col_chunks(it->rows, it->cols) * (size_t)it->cols * sizeof(double);
    if (need > most) most = need;
  }
  return most;
}

static gefen_status stats_item(const gefen_adam_item *it, int64_t i, double *partial,
                               cudaStream_t stream, gefen_error *err) {
  const int64_t rows = it->rows, cols = it->cols;
  if (rows == 0 || cols == 0) /* as adam.c: zeroed statistics, row_stats untouched */
    return gefen_cuda_check(cudaMemsetAsync(it->col_stats, 0, (size_t)(cols + 1) * sizeof(double),
                                            stream),
                            "Gefen factored statistics", i, err);
  const int G = gefen_group_size(cols);
  const int64_t nchunk = gefen_col_chunks(rows, cols);
  const unsigned col_ctas = (unsigned)((cols + GEFEN_CTA - 1) / GEFEN_CTA);
  const dim3 partial_grid(col_ctas, (unsigned)nchunk);
#define LAUNCH(DT)                                                                         \
  factored_row_stats_kernel<DT><<<gefen_grid(rows, GEFEN_CTA / G), GEFEN_CTA, 0, stream>>>( \
      it->grad, it->row_stats, rows, cols, G);                                             \
  factored_col_partial_kernel<DT><<<partial_grid, GEFEN_CTA, 0, stream>>>(it->grad, partial, \
                                                                          rows, cols, nchunk)
  GEFEN_DISPATCH_DTYPE(it->dtype, LAUNCH);
#undef LAUNCH
  gefen_status st = gefen_cuda_launched("Gefen factored statistics", i, err);
  if (st != GEFEN_OK) return st;
  const float beta2 = (float)it->beta2, one_minus_beta2 = (float)(1.0 - it->beta2);
  factored_stats_finish_kernel<<<col_ctas + 1, GEFEN_CTA, 0, stream>>>(
      partial, nchunk, it->col_stats, cols, it->v_row, it->row_stats, rows, beta2,
      one_minus_beta2);
  return gefen_cuda_launched("Gefen factored statistics", i, err);
}

extern "C" gefen_status gefen_cuda_adam_factored_stats(const gefen_adam_item *items, int64_t n,
                                                       void *scratch, size_t scratch_bytes,
                                                       void *stream, gefen_error *err) {
  gefen_status st = gefen_adam_validate(items, n, err);
  if (st != GEFEN_OK) return st;
  const cudaStream_t s = (cudaStream_t)stream;
  const size_t need = gefen_cuda_adam_factored_stats_scratch_bytes(items, n);
  for (int64_t i = 0; i < n; i++) /* the grid's x extent */
    if (!items[i].vmean && items[i].cols > 0 &&
        (items[i].cols + GEFEN_CTA - 1) / GEFEN_CTA > INT32_MAX)
      return gefen_cuda_fail(err, GEFEN_EVALUE, i, "too many columns for one launch");
  gefen_cuda_scratch sc;
  st = gefen_scratch_get(&sc, scratch, scratch_bytes, need, s, "Gefen factored statistics scratch",
                         err);
  if (st != GEFEN_OK) return st;
  /* one scratch serves every item: the launches are ordered on the stream */
  for (int64_t i = 0; i < n && st == GEFEN_OK; i++)
    if (!items[i].vmean) st = stats_item(&items[i], i, (double *)sc.ptr, s, err);
  return gefen_scratch_put(&sc, st, "Gefen factored statistics scratch", err);
}
