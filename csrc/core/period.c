/* Period search (ALGORITHM.md §2) and the codebook histogram (§3).
 *
 * Both are phase-1 statistics: they read gradients and accumulate into flat
 * buffers that a sharded caller all-reduces before the deterministic phase 2.
 * Partial sums are taken over a fixed split of the rows (independent of the
 * thread count) and added in order, so a result does not depend on threads. */
#include <stdlib.h>

#include "core_internal.h"
#include "kernel_internal.h"

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

gefen_status gefen_period_stats(const gefen_matrix *g, const int64_t *cands,
                                int64_t n_cands, double *sums, double *counts,
                                int nthreads, gefen_error *err) {
  gefen_clear(err);
  gefen_status st = check_matrix(g, err);
  if (st != GEFEN_OK) return st;
  if (n_cands < 0 || (n_cands > 0 && (!cands || !sums || !counts)))
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
  float *sq = malloc((size_t)nt * (size_t)cols * sizeof(float));
  double *part = calloc((size_t)nchunk * (size_t)n_cands, sizeof(double));
  if (!sq || !part) {
    free(sq);
    free(part);
    return gefen_fail(err, GEFEN_ENOMEM, "period statistics: out of memory");
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (rows * cols > GEFEN_CHUNK_ELEMS)
  for (int64_t c = 0; c < nchunk; c++) {
#ifdef _OPENMP
    float *x = sq + (size_t)omp_get_thread_num() * (size_t)cols;
#else
    float *x = sq;
#endif
    const int64_t r0 = rows * c / nchunk, r1 = rows * (c + 1) / nchunk;
    double *out = part + c * n_cands;
    for (int64_t r = r0; r < r1; r++) {
      for (int64_t j = 0; j < cols; j++) {
        float v = gefen_load(g->data, g->dtype, r * cols + j);
        x[j] = v * v;
      }
      for (int64_t k = 0; k < n_cands; k++) {
        const int64_t d = cands[k];
        if (d == 1) continue; /* a block of one has no variance */
        double acc = 0.0;
        for (int64_t b = 0; b < cols; b += d) acc += block_variance(x + b, d);
        out[k] += acc;
      }
    }
  }
  for (int64_t c = 0; c < nchunk; c++)
    for (int64_t k = 0; k < n_cands; k++) sums[k] += part[c * n_cands + k];
  for (int64_t k = 0; k < n_cands; k++)
    counts[k] += (double)rows * (double)(cols / cands[k]);
  free(sq);
  free(part);
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
                                 const double *sums, const double *counts,
                                 int64_t *period, gefen_error *err) {
  gefen_clear(err);
  if (!period) return gefen_fail(err, GEFEN_EVALUE, "period output is NULL");
  if (numel <= 1 || cols <= 1) {
    *period = 1;
    return GEFEN_OK;
  }
  if (n_cands < 1 || !cands || !sums || !counts)
    return gefen_fail(err, GEFEN_EVALUE, "period choice needs at least one candidate");
  int64_t best = 0;
  double best_score = 1e-12, prev_err = 0.0;
  for (int64_t k = 0; k < n_cands; k++) {
    double e = counts[k] > 0 ? sqrt(sums[k] / counts[k]) : 0.0;
    if (cands[k] == 1) e = 0.0;
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
