/* GefenMuon's quantised momentum (ALGORITHM.md §7): the same codes, block
 * magnitudes and quantiser as Gefen, with Muon's momentum rule. The
 * Newton-Schulz iteration runs outside the core (torch.matmul). */
#include <stdlib.h>

#include "core_internal.h"
#include "block_ops.h"
#include "kernel_internal.h"
#include "quantizer_internal.h"

static gefen_status validate_item(const gefen_muon_item *it, int64_t i,
                                  gefen_error *err) {
  gefen_status st = gefen_check_layout(it->dtype, it->rows, it->cols, it->period, i, err);
  if (st != GEFEN_OK) return st;
  if (it->out_dtype != GEFEN_F32 && it->out_dtype != GEFEN_BF16)
    return gefen_fail_item(err, GEFEN_ETYPE, i, "output must be float32 or bfloat16");
  if (!(it->beta >= 0.0 && it->beta < 1.0))
    return gefen_fail_item(err, GEFEN_EVALUE, i, "momentum %g must lie in [0, 1)", it->beta);
  if (it->rows > 0 && it->cols > 0 && (!it->grad || !it->codes || !it->magnitude || !it->out))
    return gefen_fail_item(err, GEFEN_EVALUE, i, "a tensor pointer is NULL");
  return GEFEN_OK;
}

gefen_status gefen_muon_validate(const gefen_muon_item *items, int64_t n,
                                 gefen_error *err) {
  gefen_clear(err);
  if (n < 0 || (n > 0 && !items))
    return gefen_fail(err, GEFEN_EVALUE, "invalid item list");
  for (int64_t i = 0; i < n; i++) {
    gefen_status st = validate_item(&items[i], i, err);
    if (st != GEFEN_OK) return st;
  }
  return GEFEN_OK;
}

static void muon_block(const gefen_muon_item *it, const gefen_quantizer *q,
                       const gefen_block_ops *ops, int64_t b, float *m) {
  const int64_t P = it->period, base = b * P;
  const float omb = (float)(1.0 - it->beta);
  const float mx = ops->muon_momentum(it->grad, it->dtype, base, it->codes + base, q,
                                      it->magnitude[b], omb, P, m);
  it->magnitude[b] = mx;
  const gefen_sink sink = {.kind = GEFEN_SINK_MUON,
                           .out = it->out,
                           .out_dtype = it->out_dtype,
                           .grad = it->grad,
                           .dtype = it->dtype,
                           .base = base,
                           .beta = (float)it->beta,
                           .one_minus_beta = omb,
                           .nesterov = it->nesterov};
  ops->requantize_apply(q, m, mx, P, it->codes + base, &sink);
}

static void muon_units(const void *items, int64_t i, int64_t *units,
                       int64_t *unit_len) {
  const gefen_muon_item *it = (const gefen_muon_item *)items + i;
  *units = it->rows * (it->cols / it->period);
  *unit_len = it->period;
}

gefen_status gefen_muon_momentum(const gefen_muon_item *items, int64_t n,
                                 const gefen_quantizer *q, int nthreads,
                                 gefen_error *err) {
  gefen_status st = gefen_muon_validate(items, n, err);
  if (st != GEFEN_OK) return st;
  if (!q) return gefen_fail(err, GEFEN_EVALUE, "quantizer is NULL");
  const gefen_block_ops *ops = gefen_block_ops_for(q);
  const int nt = gefen_threads(nthreads);
  int64_t max_period = 1;
  for (int64_t i = 0; i < n; i++)
    if (items[i].period > max_period) max_period = items[i].period;
  gefen_work_list wl;
  st = gefen_work_plan(&wl, items, n, muon_units, err);
  if (st != GEFEN_OK) return st;
  float *mbuf = malloc((size_t)nt * (size_t)max_period * sizeof(float));
  if (!mbuf) {
    gefen_work_free(&wl);
    return gefen_fail(err, GEFEN_ENOMEM, "GefenMuon momentum: out of memory");
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (wl.count > 1 && nt > 1)
  for (int64_t w = 0; w < wl.count; w++) {
#ifdef _OPENMP
    float *m = mbuf + (size_t)omp_get_thread_num() * (size_t)max_period;
#else
    float *m = mbuf;
#endif
    const gefen_work *wk = &wl.items[w];
    const gefen_muon_item *it = &items[wk->item];
    for (int64_t b = wk->begin; b < wk->end; b++) muon_block(it, q, ops, b, m);
  }
  free(mbuf);
  gefen_work_free(&wl);
  return GEFEN_OK;
}
