/* Period search (ALGORITHM.md §2) and the codebook histogram (§3).
 *
 * Both are phase-1 statistics: they read gradients and accumulate into flat
 * int64 buffers that a sharded caller all-reduces before the deterministic
 * phase 2. Both are exact (counts, and exact sums of block variances), so a
 * result depends neither on the thread count nor on how rows are sharded. */
#include <stdlib.h>

#include "core_internal.h"
#include "kernel_internal.h"
#include "gefen_xsum.h"

#define ROW_CHUNKS_MAX 256

int64_t gefen_period_candidates(int64_t cols, int64_t numel, int64_t *out,
                                int64_t cap) {
  if (numel <= 1 || cols <= 0) return 0;
  int64_t root = 1; /* the largest r with r * r <= cols */
  while (root + 1 <= cols / (root + 1)) root++;
  int64_t pos = 0;
  /* Divisors pair up as (d, cols / d) around the square root: the small ones
   * ascending, then their partners (ascending as the small one descends). */
  for (int64_t d = 1; d <= root; d++) {
    if (cols % d || d >= numel) continue;
    if (pos < cap) out[pos] = d;
    pos++;
  }
  for (int64_t s = root; s >= 1; s--) {
    if (cols % s || cols / s == s) continue;
    int64_t d = cols / s;
    if (d >= numel) continue;
    if (pos < cap) out[pos] = d;
    pos++;
  }
  return pos;
}

/* Population variance of x[0..n) in float64, two passes. */
static double block_variance(const float *x, int64_t n) {
  double sum = 0.0;
  for (int64_t k = 0; k < n; k++) sum += x[k];
  double mean = sum / (double)n;
  double acc = 0.0;
  for (int64_t k = 0; k < n; k++) {
    double d = (double)x[k] - mean;
    acc += d * d;
  }
  return acc / (double)n;
}

static int64_t row_chunks(int64_t rows) {
  return rows < ROW_CHUNKS_MAX ? rows : ROW_CHUNKS_MAX;
}

static gefen_status check_matrix(const gefen_matrix *g, gefen_error *err) {
  if (!g) return gefen_fail(err, GEFEN_EVALUE, "gradient view is NULL");
  if (g->rows < 0 || g->cols < 0)
    return gefen_fail(err, GEFEN_EVALUE, "negative gradient shape (%lld, %lld)",
                      (long long)g->rows, (long long)g->cols);
  if (gefen_dtype_size(g->dtype) == 0)
    return gefen_fail(err, GEFEN_ETYPE, "unknown gradient dtype %d", (int)g->dtype);
  if (g->rows > 0 && g->cols > 0 && !g->data)
    return gefen_fail(err, GEFEN_EVALUE, "gradient data is NULL");
  if (g->cols > 0 && g->rows > INT64_MAX / g->cols)
    return gefen_fail(err, GEFEN_EVALUE, "gradient shape overflows int64");
  return GEFEN_OK;
}

/* One thread's statistics: an exact sum per candidate, normalised before
 * its limbs could overflow. */
typedef struct {
  int64_t *stats; /* n_cands * GEFEN_PERIOD_STAT_WIDTH */
  int64_t adds;   /* additions since the last normalisation */
} period_acc;

static void acc_add(period_acc *a, int64_t k, double v) {
  int64_t *st = a->stats + k * GEFEN_PERIOD_STAT_WIDTH;
  if (!gefen_xsum_accepts(v)) {
    st[GEFEN_PERIOD_STAT_NONFINITE]++;
    return;
  }
  gefen_xsum_add(st, v);
  if (++a->adds == GEFEN_XSUM_SAFE_ADDS) {
    a->adds = 0;
    (void)gefen_xsum_normalize(st); /* a sum of finite doubles of one shard fits */
  }
}

gefen_status gefen_period_stats(const gefen_matrix *g, const int64_t *cands,
                                int64_t n_cands, int64_t *stats, int nthreads,
                                gefen_error *err) {
  gefen_clear(err);
  gefen_status st = check_matrix(g, err);
  if (st != GEFEN_OK) return st;
  if (n_cands < 0 || (n_cands > 0 && (!cands || !stats)))
    return gefen_fail(err, GEFEN_EVALUE, "period statistics need candidates and outputs");
  for (int64_t k = 0; k < n_cands; k++) {
    if (cands[k] < 1 || g->cols % cands[k])
      return gefen_fail(err, GEFEN_EVALUE, "candidate period %lld does not divide %lld",
                        (long long)cands[k], (long long)g->cols);
  }
  const int64_t rows = g->rows, cols = g->cols;
  if (rows == 0 || cols == 0 || n_cands == 0) return GEFEN_OK;

  const int nt = gefen_threads(nthreads);
  const int64_t nchunk = row_chunks(rows);
  const size_t width = (size_t)n_cands * GEFEN_PERIOD_STAT_WIDTH;
  float *sq = malloc((size_t)nt * (size_t)cols * sizeof(float));
  int64_t *part = calloc((size_t)nt * width, sizeof(int64_t));
  if (!sq || !part) {
    free(sq);
    free(part);
    return gefen_fail(err, GEFEN_ENOMEM, "period statistics: out of memory");
  }
  /* Exact sums: which thread adds which block does not change the result. */
#pragma omp parallel num_threads(nt) if (rows * cols > GEFEN_CHUNK_ELEMS)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num();
#else
    const int t = 0;
#endif
    float *x = sq + (size_t)t * (size_t)cols;
    period_acc acc = {part + (size_t)t * width, 0};
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < nchunk; c++) {
      const int64_t r0 = rows * c / nchunk, r1 = rows * (c + 1) / nchunk;
      for (int64_t r = r0; r < r1; r++) {
        for (int64_t j = 0; j < cols; j++) {
          float v = gefen_load(g->data, g->dtype, r * cols + j);
          x[j] = v * v;
        }
        for (int64_t k = 0; k < n_cands; k++) {
          const int64_t d = cands[k];
          if (d == 1) continue; /* a block of one has no variance */
          for (int64_t b = 0; b < cols; b += d) acc_add(&acc, k, block_variance(x + b, d));
        }
      }
    }
    for (int64_t k = 0; k < n_cands; k++)
      (void)gefen_xsum_normalize(acc.stats + k * GEFEN_PERIOD_STAT_WIDTH);
  }
  for (int t = 0; t < nt; t++)
    for (size_t i = 0; i < width; i++) stats[i] += part[(size_t)t * width + i];
  for (int64_t k = 0; k < n_cands; k++)
    stats[k * GEFEN_PERIOD_STAT_WIDTH + GEFEN_PERIOD_STAT_BLOCKS] += rows * (cols / cands[k]);
  free(sq);
  free(part);
  return GEFEN_OK;
}

double gefen_exact_sum_value(const int64_t *limbs) { return gefen_xsum_value(limbs); }

gefen_status gefen_exact_sum_add(int64_t *limbs, const double *x, int64_t n,
                                 gefen_error *err) {
  gefen_clear(err);
  if (n < 0 || (n > 0 && (!limbs || !x)))
    return gefen_fail(err, GEFEN_EVALUE, "exact sum needs values and limbs");
  for (int64_t i = 0; i < n; i++)
    if (!gefen_xsum_accepts(x[i]))
      return gefen_fail(err, GEFEN_EVALUE, "exact sum: value %lld (%g) is negative or not finite",
                        (long long)i, x[i]);
  for (int64_t i = 0; i < n; i++) {
    gefen_xsum_add(limbs, x[i]);
    if ((i + 1) % GEFEN_XSUM_SAFE_ADDS == 0) (void)gefen_xsum_normalize(limbs);
  }
  (void)gefen_xsum_normalize(limbs);
  return GEFEN_OK;
}

/* The largest divisor of cols that is <= 2048, when it is >= 8; else 1. */
static int64_t fallback_divisor(int64_t cols) {
  for (int64_t d = cols < 2048 ? cols : 2048; d >= 8; d--)
    if (cols % d == 0) return d;
  return 1;
}

gefen_status gefen_period_choose(int64_t cols, int64_t numel, int ndim,
                                 const int64_t *cands, int64_t n_cands,
                                 const int64_t *stats, int64_t *period, gefen_error *err) {
  gefen_clear(err);
  if (!period) return gefen_fail(err, GEFEN_EVALUE, "period output is NULL");
  if (numel <= 1 || cols <= 1) {
    *period = 1;
    return GEFEN_OK;
  }
  if (n_cands < 1 || !cands || !stats)
    return gefen_fail(err, GEFEN_EVALUE, "period choice needs at least one candidate");
  int64_t best = 0;
  double best_score = 1e-12, prev_err = 0.0;
  for (int64_t k = 0; k < n_cands; k++) {
    const int64_t *st = stats + k * GEFEN_PERIOD_STAT_WIDTH;
    const int64_t blocks = st[GEFEN_PERIOD_STAT_BLOCKS];
    for (int i = 0; i < GEFEN_PERIOD_STAT_WIDTH; i++)
      if (st[i] < 0)
        return gefen_fail(err, GEFEN_EVALUE, "period statistics of candidate %lld are negative "
                          "(corrupt or overflowed)", (long long)cands[k]);
    double e = 0.0;
    if (cands[k] != 1 && blocks > 0) {
      const double sum = st[GEFEN_PERIOD_STAT_NONFINITE] ? NAN : gefen_xsum_value(st);
      e = sqrt(sum / (double)blocks);
    }
    if (k > 0) {
      double s = e - prev_err;
      if (s < best_score) {
        best_score = s;
        best = k;
      }
    }
    prev_err = e;
  }
  int64_t pick = cands[best];
  if (pick >= 8) {
    *period = pick;
  } else if (cols >= 8 && ndim == 2) {
    *period = cols;
  } else {
    *period = fallback_divisor(cols);
  }
  return GEFEN_OK;
}

gefen_status gefen_histogram(const gefen_matrix *g, int64_t period,
                             int64_t *hist, int nthreads, gefen_error *err) {
  gefen_clear(err);
  gefen_status st = check_matrix(g, err);
  if (st != GEFEN_OK) return st;
  if (!hist) return gefen_fail(err, GEFEN_EVALUE, "histogram output is NULL");
  if (period < 1 || (g->cols > 0 && g->cols % period))
    return gefen_fail(err, GEFEN_EVALUE, "period %lld does not divide %lld",
                      (long long)period, (long long)g->cols);
  const int64_t rows = g->rows, cols = g->cols;
  if (rows == 0 || cols == 0) return GEFEN_OK;
  const int nt = gefen_threads(nthreads);
  const int64_t nchunk = row_chunks(rows);
  int64_t *part = calloc((size_t)nchunk * GEFEN_HIST_BINS, sizeof(int64_t));
  if (!part) return gefen_fail(err, GEFEN_ENOMEM, "histogram: out of memory");
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (rows * cols > GEFEN_CHUNK_ELEMS)
  for (int64_t c = 0; c < nchunk; c++) {
    int64_t *h = part + c * GEFEN_HIST_BINS;
    const int64_t r0 = rows * c / nchunk, r1 = rows * (c + 1) / nchunk;
    for (int64_t base = r0 * cols; base < r1 * cols; base += period) {
      float a = 0.0f;
      for (int64_t k = 0; k < period; k++) {
        float v = fabsf(gefen_load(g->data, g->dtype, base + k));
        a = v > a ? v : a; /* NaN never wins */
      }
      for (int64_t k = 0; k < period; k++) {
        float v = gefen_load(g->data, g->dtype, base + k);
        float u = a > 0.0f ? v / a : 0.0f;
        if (!(u >= -1.0f && u <= 1.0f)) continue; /* non-finite: not counted */
        float x = floorf((u + 1.0f) * 2048.0f);
        int64_t bin = (int64_t)x;
        if (bin > GEFEN_HIST_BINS - 1) bin = GEFEN_HIST_BINS - 1;
        h[bin]++;
      }
    }
  }
  for (int64_t c = 0; c < nchunk; c++)
    for (int64_t i = 0; i < GEFEN_HIST_BINS; i++) hist[i] += part[c * GEFEN_HIST_BINS + i];
  free(part);
  return GEFEN_OK;
}
