/* The fused Gefen step (ALGORITHM.md §4): block and factored forms.
 *
 * Work is split into chunks of whole blocks (block form) or whole rows
 * (factored form) across all items of a call, so one parallel region serves a
 * whole parameter group. Each block is two passes: the first forms the new
 * momentum into a per-thread scratch and finds its magnitude, the second
 * requantises it and writes codes and parameters.
 *
 * Factored items with momentum_in_stats move the momentum into phase 1, where
 * the gradient is read anyway: phase 1 takes a few rows' statistics, then
 * (the rows still in cache) their momentum, magnitudes and codes; phase 2
 * decodes C[code] * magnitude and applies it, without reading the gradient.
 * The kernels and their order of operations are the same, so are the bits. */
#include <float.h>
#include <stdlib.h>

#include "core_internal.h"
#include "block_ops.h"
#include "kernel_internal.h"
#include "quantizer_internal.h"

/* Per-item constants, computed once per call. */
typedef struct {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float inv_bc1;   /* 1 / (1 - beta1^step) */
  float rs_bc2;    /* 1 / sqrt(1 - beta2^step), block form */
  float eps, lr, decay; /* decay = 1 - lr * weight_decay */
  float *scol;     /* factored: sqrt(v_col_j / max(mu, FLT_MIN) / bc2) */
} adam_consts;

static gefen_status validate_item(const gefen_adam_item *it, int64_t i,
                                  gefen_error *err) {
  gefen_status st = gefen_check_layout(it->dtype, it->rows, it->cols, it->period, i, err);
  if (st != GEFEN_OK) return st;
  if (it->row_offset < 0 || it->global_rows < it->row_offset + it->rows)
    return gefen_fail_item(err, GEFEN_EVALUE, i, "rows [%lld, %lld) lie outside the %lld global rows",
                      (long long)it->row_offset,
                      (long long)(it->row_offset + it->rows), (long long)it->global_rows);
  if (it->step < 1)
    return gefen_fail_item(err, GEFEN_EVALUE, i, "step must be >= 1, got %lld", (long long)it->step);
  if (!(it->lr >= 0.0) || !isfinite(it->lr))
    return gefen_fail_item(err, GEFEN_EVALUE, i, "invalid lr %g", it->lr);
  if (!(it->beta1 >= 0.0 && it->beta1 < 1.0) || !(it->beta2 >= 0.0 && it->beta2 < 1.0))
    return gefen_fail_item(err, GEFEN_EVALUE, i, "betas (%g, %g) must lie in [0, 1)", it->beta1, it->beta2);
  if (!(it->eps > 0.0) || !isfinite(it->eps))
    return gefen_fail_item(err, GEFEN_EVALUE, i, "eps must be finite and > 0, got %g", it->eps);
  if (!(it->weight_decay >= 0.0) || !isfinite(it->weight_decay))
    return gefen_fail_item(err, GEFEN_EVALUE, i, "invalid weight_decay %g", it->weight_decay);
  const int factored = it->vmean == NULL;
  if (factored && (!it->v_row || !it->v_col || !it->col_stats || (it->rows > 0 && !it->row_stats)))
    return gefen_fail_item(err, GEFEN_EVALUE, i,
                           "the factored form needs v_row, v_col, col_stats and row_stats");
  if (!factored && (it->v_row || it->v_col))
    return gefen_fail_item(err, GEFEN_EVALUE, i,
                           "give either vmean (block) or v_row/v_col (factored), not both");
  if (it->rows > 0 && it->cols > 0 &&
      (!it->param || !it->grad || !it->codes || !it->magnitude))
    return gefen_fail_item(err, GEFEN_EVALUE, i, "a tensor pointer is NULL");
  return GEFEN_OK;
}

gefen_status gefen_adam_validate(const gefen_adam_item *items, int64_t n,
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

/* ----------------------------------------------------- factored phase 1 */

/* momentum_in_stats: row r's momentum (§4 step 4), block magnitudes (5) and
 * codes (6), exactly as factored_chunk forms them without the flag; the
 * dequantised values are not formed (phase 2 decodes them). */
static void momentum_row(const gefen_adam_item *it, const gefen_quantizer *q,
                         const gefen_block_ops *ops, int64_t r, float *m) {
  const int64_t P = it->period, cols = it->cols;
  const float beta1 = (float)it->beta1, one_minus_beta1 = (float)(1.0 - it->beta1);
  const gefen_sink codes_only = {.kind = GEFEN_SINK_CODES};
  for (int64_t c0 = 0; c0 < cols; c0 += P) {
    const int64_t base = r * cols + c0, b = base / P;
    uint8_t *codes = it->codes + base;
    const float mx = ops->adam_momentum(it->grad, it->dtype, base, codes, q, it->magnitude[b],
                                        beta1, one_minus_beta1, P, m, NULL, 0);
    it->magnitude[b] = mx;
    if (it->stochastic_round)
      gefen_requantize_stochastic(q, m, mx, P, codes, it->seed, (it->row_offset + r) * cols + c0);
    else
      ops->requantize_apply(q, m, mx, P, codes, &codes_only);
  }
}

/* Rows whose statistics are taken at once (row_stats adds them to the column
 * sums row after row, so the grouping does not change a bit); with
 * momentum_in_stats their momentum follows while they are in cache. */
#define STATS_ROWS 8

static void factored_stats_rows(const gefen_adam_item *it, const gefen_quantizer *q,
                                const gefen_block_ops *ops, int64_t r0, int64_t r1,
                                double *colsum, double *vrow_sum, float *m) {
  const int64_t cols = it->cols;
  const float b2 = (float)it->beta2, omb2 = (float)(1.0 - it->beta2);
  const int with_momentum = it->momentum_in_stats != 0;
  double vsum = 0.0, sums[STATS_ROWS];
  for (int64_t r = r0; r < r1; r += STATS_ROWS) {
    const int64_t n = r1 - r < STATS_ROWS ? r1 - r : STATS_ROWS;
    ops->row_stats(it->grad, it->dtype, r * cols, cols, n, colsum, sums);
    for (int64_t i = 0; i < n; i++) {
      const double mean = sums[i] / (double)cols;
      it->row_stats[r + i] = mean;
      const float vr = b2 * it->v_row[r + i] + omb2 * (float)mean;
      vsum += vr;
    }
    if (with_momentum)
      for (int64_t i = 0; i < n; i++) momentum_row(it, q, ops, r + i, m);
  }
  *vrow_sum += vsum;
}

/* Row chunks of the factored items: a fixed split that depends only on the
 * shapes, so the sums (taken per chunk, then added in chunk order) do not
 * depend on the number of threads. */
static int64_t stats_chunks(const gefen_adam_item *it) {
  if (it->vmean || it->rows == 0 || it->cols == 0) return 0;
  int64_t c = it->rows * it->cols / GEFEN_CHUNK_ELEMS;
  if (c > 64) c = 64;
  if (c > it->rows) c = it->rows;
  return c > 1 ? c : 1;
}

static int momentum_in_stats(const gefen_adam_item *it) {
  return !it->vmean && it->momentum_in_stats;
}

/* The chunks' partial column sums live in one buffer of at most this many
 * doubles (2 MiB) at a time, or one item's when that is more: the chunks run
 * in batches of whole items whose partials fit, each batch reduced before the
 * next reuses the buffer. (All partials at once came to 50 MB for a 12-layer
 * model of width 768: allocated, faulted in and unmapped on every step, it
 * made the pass 6x slower than reading the gradient.) */
#define STATS_PART_DOUBLES ((int64_t)1 << 18)

/* The doubles of an item's chunk partials (none when its one chunk sums into
 * col_stats itself). */
static int64_t stats_partials(const gefen_adam_item *it) {
  const int64_t c = stats_chunks(it);
  return c > 1 ? c * (it->cols + 1) : 0;
}

/* Whether an item with `part` doubles of partials starts a new batch after
 * `used` doubles of the current one. */
static int stats_new_batch(int64_t used, int64_t part) {
  return used > 0 && used + part > STATS_PART_DOUBLES;
}

/* Phase 1's scratch, allocated before anything is written (stats_prepare)
 * so that a step can hold both phases' scratch before its first mutation. */
typedef struct {
  int64_t nwork, max_period, nbatch;
  gefen_work *work;   /* one entry per chunk, item after item */
  double **dest;      /* its sums: into `part`, or its item's col_stats when it is the only chunk */
  int64_t *batch_end; /* the chunks of batch b are [batch_end[b - 1], batch_end[b]) */
  double *part;
  float *mbuf;        /* momentum_in_stats: one momentum block per thread */
} stats_scratch;

static void stats_free(stats_scratch *s) {
  free(s->work);
  free(s->dest);
  free(s->batch_end);
  free(s->part);
  free(s->mbuf);
  memset(s, 0, sizeof *s);
}

/* Checks the quantiser of flagged items and allocates the scratch; writes
 * nothing of the items. */
static gefen_status stats_prepare(const gefen_adam_item *items, int64_t n,
                                  const gefen_quantizer *q, int nt, stats_scratch *s,
                                  gefen_error *err) {
  memset(s, 0, sizeof *s);
  for (int64_t i = 0; i < n; i++) {
    if (!momentum_in_stats(&items[i]) || stats_chunks(&items[i]) == 0) continue;
    if (!q)
      return gefen_fail_item(err, GEFEN_EVALUE, i,
                             "momentum_in_stats needs the quantizer in phase 1 "
                             "(gefen_adam_step)");
    if (items[i].period > s->max_period) s->max_period = items[i].period;
  }
  /* the batches: whole items, in order, while their partials fit */
  int64_t max_part = 0, batch_part = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t part = stats_partials(&items[i]);
    if (stats_new_batch(batch_part, part)) batch_part = 0;
    batch_part += part;
    if (batch_part > max_part) max_part = batch_part;
    s->nwork += stats_chunks(&items[i]);
  }
  if (s->nwork == 0) return GEFEN_OK;
  s->work = malloc((size_t)s->nwork * sizeof *s->work);
  s->dest = malloc((size_t)s->nwork * sizeof *s->dest);
  s->batch_end = malloc((size_t)(n > 0 ? n : 1) * sizeof *s->batch_end);
  s->part = malloc((size_t)(max_part > 0 ? max_part : 1) * sizeof(double));
  if (s->max_period > 0) s->mbuf = malloc((size_t)nt * (size_t)s->max_period * sizeof(float));
  if (!s->work || !s->dest || !s->batch_end || !s->part || (s->max_period > 0 && !s->mbuf)) {
    stats_free(s);
    return gefen_fail(err, GEFEN_ENOMEM, "factored statistics: out of memory");
  }
  int64_t w = 0, off = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t c = stats_chunks(&items[i]), cols = items[i].cols;
    const int64_t part = stats_partials(&items[i]);
    if (stats_new_batch(off, part)) {
      s->batch_end[s->nbatch++] = w;
      off = 0;
    }
    for (int64_t k = 0; k < c; k++, w++) {
      s->work[w].item = i;
      s->work[w].begin = items[i].rows * k / c;
      s->work[w].end = items[i].rows * (k + 1) / c;
      s->dest[w] = c > 1 ? s->part + off + k * (cols + 1) : items[i].col_stats;
    }
    off += part;
  }
  s->batch_end[s->nbatch++] = w;
  return GEFEN_OK;
}

/* Phase 1 on prepared scratch: cannot fail. */
static void stats_run(const gefen_block_ops *ops, const gefen_adam_item *items, int64_t n,
                      const gefen_quantizer *q, int nt, const stats_scratch *s) {
  for (int64_t i = 0; i < n; i++)
    if (!items[i].vmean) memset(items[i].col_stats, 0, (size_t)(items[i].cols + 1) * sizeof(double));
  if (s->nwork == 0) return;
  float *const mbuf = s->mbuf;
  for (int64_t b = 0, k0 = 0; b < s->nbatch; k0 = s->batch_end[b++]) {
    const int64_t k1 = s->batch_end[b];
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (k1 - k0 > 1 && nt > 1)
    for (int64_t k = k0; k < k1; k++) {
#ifdef _OPENMP
      float *m = mbuf ? mbuf + (size_t)omp_get_thread_num() * (size_t)s->max_period : NULL;
#else
      float *m = mbuf;
#endif
      const gefen_adam_item *it = &items[s->work[k].item];
      if (s->dest[k] != it->col_stats) /* a partial: the buffer is reused batch after batch */
        memset(s->dest[k], 0, (size_t)(it->cols + 1) * sizeof(double));
      factored_stats_rows(it, q, ops, s->work[k].begin, s->work[k].end, s->dest[k],
                          s->dest[k] + it->cols, m);
    }
    /* each item's partials added in chunk order, as one batch of everything would */
    for (int64_t k = k0; k < k1; k++) {
      const gefen_adam_item *it = &items[s->work[k].item];
      if (s->dest[k] == it->col_stats) continue;
      for (int64_t j = 0; j <= it->cols; j++) it->col_stats[j] += s->dest[k][j];
    }
  }
}

gefen_status gefen_adam_factored_stats_with(const gefen_block_ops *ops,
                                            const gefen_adam_item *items, int64_t n,
                                            const gefen_quantizer *q, int nthreads,
                                            gefen_error *err) {
  gefen_status st = gefen_adam_validate(items, n, err);
  if (st != GEFEN_OK) return st;
  const int nt = gefen_threads(nthreads);
  stats_scratch s;
  st = stats_prepare(items, n, q, nt, &s, err);
  if (st != GEFEN_OK) return st;
  stats_run(ops, items, n, q, nt, &s);
  stats_free(&s);
  return GEFEN_OK;
}

/* The public two-phase calls: not for items with momentum_in_stats. */
static gefen_status refuse_flag(const gefen_adam_item *items, int64_t n, const char *call,
                                gefen_error *err) {
  gefen_status st = gefen_adam_validate(items, n, err);
  if (st != GEFEN_OK) return st;
  for (int64_t i = 0; i < n; i++)
    if (momentum_in_stats(&items[i]))
      return gefen_fail_item(err, GEFEN_EVALUE, i,
                             "%s does not take momentum_in_stats (phase 1 would write codes "
                             "and magnitudes): use gefen_adam_step", call);
  return GEFEN_OK;
}

gefen_status gefen_adam_factored_stats(const gefen_adam_item *items, int64_t n,
                                       int nthreads, gefen_error *err) {
  gefen_status st = refuse_flag(items, n, "gefen_adam_factored_stats", err);
  if (st != GEFEN_OK) return st;
  return gefen_adam_factored_stats_with(gefen_block_ops_for(NULL), items, n, NULL, nthreads,
                                        err);
}

/* ------------------------------------------------------------- the update */

static void make_consts(const gefen_adam_item *it, adam_consts *k) {
  const double bc1 = 1.0 - pow(it->beta1, (double)it->step);
  const double bc2 = 1.0 - pow(it->beta2, (double)it->step);
  k->beta1 = (float)it->beta1;
  k->one_minus_beta1 = (float)(1.0 - it->beta1);
  k->beta2 = (float)it->beta2;
  k->one_minus_beta2 = (float)(1.0 - it->beta2);
  k->inv_bc1 = (float)(1.0 / bc1);
  k->rs_bc2 = (float)(1.0 / sqrt(bc2));
  k->eps = (float)it->eps;
  k->lr = (float)it->lr;
  k->decay = (float)(1.0 - it->lr * it->weight_decay);
  k->scol = NULL;
}

/* v_col and the per-column factor of the step size, shared by every row. */
static void factored_columns(const gefen_adam_item *it, const adam_consts *k,
                             float *scol) {
  const int64_t cols = it->cols;
  const double bc2 = 1.0 - pow(it->beta2, (double)it->step);
  const float bc2f = (float)bc2;
  float mu = (float)(it->col_stats[cols] / (double)it->global_rows);
  const float denom = mu > FLT_MIN ? mu : FLT_MIN;
  for (int64_t j = 0; j < cols; j++) {
    float cm = (float)(it->col_stats[j] / (double)it->global_rows);
    float vc = k->beta2 * it->v_col[j] + k->one_minus_beta2 * cm;
    it->v_col[j] = vc;
    scol[j] = sqrtf(vc / denom / bc2f);
  }
}

/* The requantisation of a block and the parameter update that follows it,
 * in one pass (ops->requantize_apply) unless rounding stochastically. */
static void finish_block(const gefen_adam_item *it, const gefen_quantizer *q,
                         const gefen_block_ops *ops, float *m, float mx, int64_t base,
                         int64_t global_base, const gefen_sink *sink) {
  uint8_t *codes = it->codes + base;
  const int64_t P = it->period;
  if (it->stochastic_round) {
    gefen_requantize_stochastic(q, m, mx, P, codes, it->seed, global_base);
    gefen_sink_apply(ops, m, P, sink);
  } else {
    ops->requantize_apply(q, m, mx, P, codes, sink);
  }
}

/* The sink of an item's update. m stays between adam_momentum and
 * requantize_apply in the primitives' own order for this kind of sink (packed:
 * the kind) unless the block is rounded stochastically
 * (gefen_requantize_stochastic reads it in element order). */
static gefen_sink adam_sink(const gefen_adam_item *it, const adam_consts *k,
                            gefen_sink_kind kind) {
  return (gefen_sink){.kind = kind,
                      .out = it->param,
                      .out_dtype = it->dtype,
                      .inv_bc1 = k->inv_bc1,
                      .eps = k->eps,
                      .decay = k->decay,
                      .lr = k->lr,
                      .packed = it->stochastic_round ? 0 : (int)kind};
}

static void block_chunk(const gefen_adam_item *it, const adam_consts *k,
                        const gefen_quantizer *q, const gefen_block_ops *ops, int64_t b0,
                        int64_t b1, float *m) {
  const int64_t P = it->period, nb = it->cols / P;
  if (P == 1 && ops->adam_period1 && !it->stochastic_round && it->dtype != GEFEN_F64) {
    /* blocks of one element: a call per element would cost far more than its
     * arithmetic (block b is element b) */
    const gefen_period1 a = {.grad = it->grad, .param = it->param, .dtype = it->dtype,
                             .codes = it->codes, .magnitude = it->magnitude,
                             .vmean = it->vmean, .beta1 = k->beta1,
                             .one_minus_beta1 = k->one_minus_beta1, .beta2 = k->beta2,
                             .one_minus_beta2 = k->one_minus_beta2, .inv_bc1 = k->inv_bc1,
                             .rs_bc2 = k->rs_bc2, .eps = k->eps, .decay = k->decay, .lr = k->lr};
    ops->adam_period1(q, &a, b0, b1 - b0);
    return;
  }
  gefen_sink sink = adam_sink(it, k, GEFEN_SINK_ADAM_BLOCK);
  for (int64_t b = b0; b < b1; b++) {
    const int64_t base = b * P;
    double sq = 0.0;
    const float mag_old = it->magnitude[b];
    const float mx = ops->adam_momentum(it->grad, it->dtype, base, it->codes + base, q, mag_old,
                                        k->beta1, k->one_minus_beta1, P, m, &sq, sink.packed);
    it->magnitude[b] = mx;
    const float vm = k->beta2 * it->vmean[b] + k->one_minus_beta2 * (float)(sq / (double)P);
    it->vmean[b] = vm;
    sink.s = k->inv_bc1 / (sqrtf(vm) * k->rs_bc2 + k->eps);
    sink.base = base;
    sink.m_has_no_nan = gefen_m_has_no_nan(sq, mag_old);
    const int64_t global_base = (it->row_offset + b / nb) * it->cols + (b % nb) * P;
    finish_block(it, q, ops, m, mx, base, global_base, &sink);
  }
}

static void factored_chunk(const gefen_adam_item *it, const adam_consts *k,
                           const gefen_quantizer *q, const gefen_block_ops *ops, int64_t r0,
                           int64_t r1, float *m) {
  const int64_t P = it->period, cols = it->cols;
  gefen_sink sink = adam_sink(it, k, GEFEN_SINK_ADAM_FACTORED);
  const int decode = it->momentum_in_stats != 0;
  for (int64_t r = r0; r < r1; r++) {
    const float vr = k->beta2 * it->v_row[r] + k->one_minus_beta2 * (float)it->row_stats[r];
    it->v_row[r] = vr;
    sink.s = sqrtf(vr);
    if (decode) { /* phase 1 wrote the new codes and magnitudes */
      for (int64_t c0 = 0; c0 < cols; c0 += P) {
        const int64_t base = r * cols + c0;
        sink.base = base;
        sink.scol = k->scol + c0;
        ops->dequantize_apply(q, it->codes + base, it->magnitude[base / P], P, m, &sink);
      }
      continue;
    }
    for (int64_t c0 = 0; c0 < cols; c0 += P) {
      const int64_t base = r * cols + c0, b = base / P;
      /* the block's sum of squares is not needed: sq = NULL (its row's holds its
       * squares: gefen_m_has_no_nan) */
      const float mag_old = it->magnitude[b];
      const float mx = ops->adam_momentum(it->grad, it->dtype, base, it->codes + base, q,
                                          mag_old, k->beta1, k->one_minus_beta1, P, m, NULL,
                                          sink.packed);
      it->magnitude[b] = mx;
      sink.base = base;
      sink.scol = k->scol + c0;
      sink.m_has_no_nan = gefen_m_has_no_nan(it->row_stats[r], mag_old);
      finish_block(it, q, ops, m, mx, base, (it->row_offset + r) * cols + c0, &sink);
    }
  }
}

static void adam_units(const void *items, int64_t i, int64_t *units,
                       int64_t *unit_len) {
  const gefen_adam_item *it = (const gefen_adam_item *)items + i;
  if (it->vmean) { /* block form: blocks of one period */
    *units = it->rows * (it->cols / it->period);
    *unit_len = it->period;
  } else { /* factored form: whole rows (v_row is per row) */
    *units = it->rows;
    *unit_len = it->cols;
  }
}

/* The update's scratch: per-item constants, the factored column factors,
 * one momentum block per thread, and the chunk list. */
typedef struct {
  int64_t max_period;
  gefen_work_list wl;
  adam_consts *consts;
  float *scol, *mbuf;
} update_scratch;

static void update_free(update_scratch *u) {
  free(u->consts);
  free(u->scol);
  free(u->mbuf);
  gefen_work_free(&u->wl);
  memset(u, 0, sizeof *u);
}

/* Allocates the scratch; writes nothing of the items. */
static gefen_status update_prepare(const gefen_adam_item *items, int64_t n, int nt,
                                   update_scratch *u, gefen_error *err) {
  memset(u, 0, sizeof *u);
  int64_t scol_total = 0;
  u->max_period = 1;
  for (int64_t i = 0; i < n; i++) {
    if (!items[i].vmean) scol_total += items[i].cols;
    /* the momentum blocks of items with elements (an empty item's period
     * may be anything up to its column count) */
    if (items[i].rows > 0 && items[i].cols > 0 && items[i].period > u->max_period)
      u->max_period = items[i].period;
  }
  gefen_status st = gefen_work_plan(&u->wl, items, n, adam_units, err);
  if (st != GEFEN_OK) return st;
  u->consts = malloc((size_t)(n > 0 ? n : 1) * sizeof *u->consts);
  u->scol = malloc((size_t)(scol_total > 0 ? scol_total : 1) * sizeof(float));
  u->mbuf = malloc((size_t)nt * (size_t)u->max_period * sizeof(float));
  if (!u->consts || !u->scol || !u->mbuf) {
    update_free(u);
    return gefen_fail(err, GEFEN_ENOMEM, "Gefen step: out of memory");
  }
  return GEFEN_OK;
}

/* The update on prepared scratch: cannot fail. */
static void update_run(const gefen_block_ops *ops, const gefen_adam_item *items, int64_t n,
                       const gefen_quantizer *q, int nt, const update_scratch *u) {
  adam_consts *const consts = u->consts;
  int64_t off = 0;
  for (int64_t i = 0; i < n; i++) {
    make_consts(&items[i], &consts[i]);
    if (!items[i].vmean) {
      consts[i].scol = u->scol + off;
      /* v_col is replicated: every rank updates it, even with no local rows */
      if (items[i].global_rows > 0) factored_columns(&items[i], &consts[i], u->scol + off);
      off += items[i].cols;
    }
  }
  const gefen_work_list *wl = &u->wl;
  float *const mbuf = u->mbuf;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (wl->count > 1 && nt > 1)
  for (int64_t w = 0; w < wl->count; w++) {
#ifdef _OPENMP
    float *m = mbuf + (size_t)omp_get_thread_num() * (size_t)u->max_period;
#else
    float *m = mbuf;
#endif
    const gefen_work *wk = &wl->items[w];
    const gefen_adam_item *it = &items[wk->item];
    if (it->vmean)
      block_chunk(it, &consts[wk->item], q, ops, wk->begin, wk->end, m);
    else
      factored_chunk(it, &consts[wk->item], q, ops, wk->begin, wk->end, m);
  }
}

/* The checks of a call that updates (the items, a quantiser) and its thread count. */
static gefen_status begin_update(const gefen_adam_item *items, int64_t n,
                                 const gefen_quantizer *q, int nthreads, int *nt,
                                 gefen_error *err) {
  gefen_status st = gefen_adam_validate(items, n, err);
  if (st != GEFEN_OK) return st;
  if (!q) return gefen_fail(err, GEFEN_EVALUE, "quantizer is NULL");
  *nt = gefen_threads(nthreads);
  return GEFEN_OK;
}

gefen_status gefen_adam_update_with(const gefen_block_ops *ops, const gefen_adam_item *items,
                                    int64_t n, const gefen_quantizer *q, int nthreads,
                                    gefen_error *err) {
  int nt = 1;
  gefen_status st = begin_update(items, n, q, nthreads, &nt, err);
  if (st != GEFEN_OK) return st;
  update_scratch u;
  st = update_prepare(items, n, nt, &u, err);
  if (st != GEFEN_OK) return st;
  update_run(ops, items, n, q, nt, &u);
  update_free(&u);
  return GEFEN_OK;
}

gefen_status gefen_adam_update(const gefen_adam_item *items, int64_t n,
                               const gefen_quantizer *q, int nthreads,
                               gefen_error *err) {
  gefen_status st = refuse_flag(items, n, "gefen_adam_update", err);
  if (st != GEFEN_OK) return st;
  return gefen_adam_update_with(gefen_block_ops_for(q), items, n, q, nthreads, err);
}

/* ------------------------------------------------------- the whole step */

gefen_status gefen_adam_step_with(const gefen_block_ops *ops, const gefen_adam_item *items,
                                  int64_t n, const gefen_quantizer *q, int nthreads,
                                  gefen_error *err) {
  int nt = 1;
  gefen_status st = begin_update(items, n, q, nthreads, &nt, err);
  if (st != GEFEN_OK) return st;
  /* every allocation of both phases before the first write */
  stats_scratch s;
  update_scratch u;
  st = stats_prepare(items, n, q, nt, &s, err);
  if (st != GEFEN_OK) return st;
  st = update_prepare(items, n, nt, &u, err);
  if (st != GEFEN_OK) {
    stats_free(&s);
    return st;
  }
  stats_run(ops, items, n, q, nt, &s);
  stats_free(&s);
  update_run(ops, items, n, q, nt, &u);
  update_free(&u);
  return GEFEN_OK;
}

gefen_status gefen_adam_step(const gefen_adam_item *items, int64_t n, const gefen_quantizer *q,
                             int nthreads, gefen_error *err) {
  return gefen_adam_step_with(gefen_block_ops_for(q), items, n, q, nthreads, err);
}
