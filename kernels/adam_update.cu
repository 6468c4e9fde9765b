/*
 * The fused Gefen step (ALGORITHM.md §4), mirroring adam.c's update phase.
 *
 *   adam_factored_prepare   factored items: v_col <- beta2 v_col + (1-beta2) col_mean,
 *                           scol_j = sqrt(v_col_j / max(mu, FLT_MIN) / bc2) into scratch,
 *                           v_row <- beta2 v_row + (1-beta2) row_mean   (adam.c
 *                           factored_columns and the first line of factored_chunk)
 *   adam_update             one thread group per quantisation block: momentum,
 *                           block magnitude, (block form) vmean, requantisation,
 *                           parameter update (adam.c block_chunk / factored_chunk)
 *
 * A block is processed in two passes by the same G threads. Pass 1 forms the
 * momentum m_j from g and the OLD codes, and reduces max|m| (and, block form,
 * sum g^2). Pass 2 recomputes m_j with the very same operations (so the same
 * bits) instead of keeping it in registers or shared memory, requantises it,
 * and writes codes and parameter. Element j is read and written by the same
 * thread in both passes, so the old code it reads in pass 2 is still intact;
 * its second read of g usually hits L1/L2.
 */
#include "gefen_cuda_common.cuh"

typedef struct {
  void *param;
  const void *grad;
  uint8_t *codes;
  float *magnitude;
  float *vmean;       /* block form */
  const float *v_row; /* factored: the NEW v_row (written by the prepare kernel) */
  const float *scol;  /* factored: per-column step factors */
  int64_t cols, period, nblocks;
  int64_t global_base; /* row_offset * cols: global flat index of local element 0 */
  int group;
  int stochastic;
  uint64_t seed;
  adam_consts k;
} adam_args;

template <int DT, bool FACTORED>
__global__ void __launch_bounds__(GEFEN_CTA)
    adam_update_kernel(adam_args a, const gefen_quant_table *__restrict__ t) {
  const int G = a.group, per_cta = GEFEN_CTA / G;
  const int lane = threadIdx.x % G, slot = threadIdx.x / G;
  const int64_t P = a.period, blocks_per_row = a.cols / P;
  for (int64_t first = (int64_t)blockIdx.x * per_cta; first < a.nblocks;
       first += (int64_t)gridDim.x * per_cta) {
    const int64_t b = first + slot, base = b * P;
    const bool active = b < a.nblocks;
    float mag_old = 0.0f, vmean_old = 0.0f;
    if (active) {
      mag_old = a.magnitude[b];
      if (!FACTORED) vmean_old = a.vmean[b];
    }

    /* pass 1: the new momentum's magnitude and, block form, sum g^2 */
    float mx = 0.0f;
    double sum_sq = 0.0;
    if (active) {
      for (int64_t j = lane; j < P; j += G) {
        const float g = load_f32<DT>(a.grad, base + j);
        const float m = adam_momentum(ro(&t->codebook[a.codes[base + j]]), mag_old, g,
                                      a.k.beta1, a.k.one_minus_beta1);
        mx = max_abs(mx, m);
        if (!FACTORED) sum_sq = add_sq(sum_sq, g);
      }
    }
    group_reduce(&mx, &sum_sq, G);
    if (!active) continue;

    float s = 0.0f, srow = 0.0f;
    int64_t col0 = 0;
    if (FACTORED) {
      srow = f_sqrt(a.v_row[b / blocks_per_row]);
      col0 = (b % blocks_per_row) * P;
    } else {
      const float vm = block_vmean(a.k, vmean_old, sum_sq, P);
      if (lane == 0) a.vmean[b] = vm;
      s = block_step(a.k, vm);
    }
    if (lane == 0) a.magnitude[b] = mx;

    /* pass 2: the same momentum, requantised; then the parameter */
    for (int64_t j = lane; j < P; j += G) {
      const float g = load_f32<DT>(a.grad, base + j);
      const float m = adam_momentum(ro(&t->codebook[a.codes[base + j]]), mag_old, g,
                                    a.k.beta1, a.k.one_minus_beta1);
      const uint8_t c =
          quantize(t, quant_input(m, mx), a.stochastic, a.seed, a.global_base + base + j);
      a.codes[base + j] = c;
      const float mq = f_mul(ro(&t->codebook[c]), mx);
      const float sj = FACTORED ? factored_step(a.k, srow, a.scol[col0 + j]) : s;
      apply_update<DT>(a.param, base + j, f_mul(mq, sj), a.k.decay, a.k.lr);
    }
  }
}

typedef struct {
  float *v_col;
  float *v_row;
  const double *col_stats; /* reduced: column sums, then the sum of the new v_row */
  const double *row_stats; /* local row means of g^2 */
  float *scol;
  int64_t n_cols; /* columns to update: cols, or 0 when there are no global rows */
  int64_t n_rows; /* rows to update: rows, or 0 when cols == 0 (as adam.c) */
  int64_t cols, global_rows;
  adam_consts k;
} prepare_args;

__global__ void __launch_bounds__(GEFEN_CTA) adam_factored_prepare_kernel(prepare_args a) {
  const int64_t total = a.n_cols + a.n_rows;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    if (i < a.n_cols) {
      const float denom = factored_denom(a.col_stats[a.cols], a.global_rows);
      const float vc = factored_vcol(a.k, a.v_col[i], a.col_stats[i], a.global_rows);
      a.v_col[i] = vc;
      a.scol[i] = factored_scol(a.k, vc, denom);
    } else {
      const int64_t r = i - a.n_cols;
      a.v_row[r] =
          factored_vrow(a.k.beta2, a.k.one_minus_beta2, a.v_row[r], a.row_stats[r]);
    }
  }
}

/* ----------------------------------------------------------------- host */

static size_t scol_floats(const gefen_adam_item *items, int64_t n) {
  int64_t most = 0;
  for (int64_t i = 0; i < n; i++)
    if (!items[i].vmean && items[i].cols > most) most = items[i].cols;
  return (size_t)most;
}

extern "C" size_t gefen_cuda_adam_update_scratch_bytes(const gefen_adam_item *items,
                                                       int64_t n) {
  if (!items || n <= 0) return 0;
  return scol_floats(items, n) * sizeof(float);
}

static gefen_status launch_item(const gefen_adam_item *it, int64_t i,
                                const gefen_quant_table *table, float *scol,
                                cudaStream_t stream, gefen_error *err) {
  const int factored = it->vmean == NULL;
  const adam_consts k = adam_make_consts(it);
  if (factored) {
    prepare_args p;
    p.v_col = it->v_col;
    p.v_row = it->v_row;
    p.col_stats = it->col_stats;
    p.row_stats = it->row_stats;
    p.scol = scol;
    /* v_col is replicated: every rank updates it, even with no local rows */
    p.n_cols = it->global_rows > 0 ? it->cols : 0;
    p.n_rows = it->cols > 0 ? it->rows : 0;
    p.cols = it->cols;
    p.global_rows = it->global_rows;
    p.k = k;
    if (p.n_cols + p.n_rows > 0) {
      adam_factored_prepare_kernel<<<gefen_grid(p.n_cols + p.n_rows, GEFEN_CTA), GEFEN_CTA, 0,
                                     stream>>>(p);
      gefen_status st = gefen_cuda_launched("Gefen factored columns", i, err);
      if (st != GEFEN_OK) return st;
    }
  }
  if (it->rows == 0 || it->cols == 0) return GEFEN_OK;

  adam_args a;
  a.param = it->param;
  a.grad = it->grad;
  a.codes = it->codes;
  a.magnitude = it->magnitude;
  a.vmean = it->vmean;
  a.v_row = it->v_row;
  a.scol = scol;
  a.cols = it->cols;
  a.period = it->period;
  a.nblocks = it->rows * (it->cols / it->period);
  a.global_base = it->row_offset * it->cols;
  a.group = gefen_group_size(it->period);
  a.stochastic = it->stochastic_round;
  a.seed = it->seed;
  a.k = k;
  const unsigned grid = gefen_grid(a.nblocks, GEFEN_CTA / a.group);
#define LAUNCH(DT)                                                                        \
  if (factored)                                                                           \
    adam_update_kernel<DT, true><<<grid, GEFEN_CTA, 0, stream>>>(a, table);               \
  else                                                                                    \
    adam_update_kernel<DT, false><<<grid, GEFEN_CTA, 0, stream>>>(a, table)
  GEFEN_DISPATCH_DTYPE(it->dtype, LAUNCH);
#undef LAUNCH
  return gefen_cuda_launched("Gefen update", i, err);
}

extern "C" gefen_status gefen_cuda_adam_update(const gefen_adam_item *items, int64_t n,
                                               const gefen_quant_table *device_table,
                                               void *scratch, size_t scratch_bytes,
                                               void *stream, gefen_error *err) {
  gefen_status st = gefen_adam_validate(items, n, err);
  if (st != GEFEN_OK) return st;
  if (!device_table) return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "quantizer table is NULL");
  const cudaStream_t s = (cudaStream_t)stream;
  gefen_cuda_scratch sc;
  st = gefen_scratch_get(&sc, scratch, scratch_bytes, gefen_cuda_adam_update_scratch_bytes(items, n),
                         s, "Gefen update scratch", err);
  if (st != GEFEN_OK) return st;
  /* one scratch serves every item: the launches are ordered on the stream */
  for (int64_t i = 0; i < n && st == GEFEN_OK; i++)
    st = launch_item(&items[i], i, device_table, (float *)sc.ptr, s, err);
  return gefen_scratch_put(&sc, st, "Gefen update scratch", err);
}
