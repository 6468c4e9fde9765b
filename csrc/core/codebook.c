/*
 * codebook.c -- the optimizer's 256-entry codebook (ALGORITHM.md section 3).
 *
 * The codebook is the optimal weighted 1-D k-means (K = 256) of the
 * histogram's active bin centres, with the first cluster pinned at -1 and the
 * last at +1. The reference is a naive O(N^2 K) dynamic programme in float64;
 * this file must reproduce its result bit for bit, including its tie rule
 * (strict "<" scanning the split point ascending, so the smallest wins).
 *
 * Speed comes from divide and conquer over the end point e of each middle
 * layer: in exact arithmetic the plain variance cost satisfies the quadrangle
 * inequality, so the optimal split point moves monotonically with e. Floating
 * point rounding can break that monotonicity wherever two split points are
 * (nearly) tied, so a plain divide and conquer would sometimes pick a
 * different split point than the naive scan. We therefore carry, instead of
 * a single optimal split, the hull of all split points whose value is within
 * a rigorous rounding bound of the minimum; those hulls are provably
 * monotone (see layer_solve), so searching between them always contains
 * every split point the naive scan could pick, and inside that window we
 * evaluate exactly the naive expressions in the naive order.
 */
#include <float.h>
#include <stdlib.h>

#include "core_internal.h"

#define K GEFEN_CODEBOOK_SIZE

/* Prefix sums over the active bins (1-based; index 0 holds the zeros) and the
 * scratch of the dynamic programme. */
typedef struct {
  int n;             /* active bins */
  double e1, e2;     /* error bounds of every float prefix S1[j], S2[j] */
  double m1, m2;     /* bounds of sum w |x| and sum w x^2 over all bins */
  double *W, *S1, *S2;
  double *prev, *cur; /* dp rows of the previous and current layer, by e */
  double *f;         /* the candidate values of one window, by s */
  uint16_t *arg;     /* arg[c * (n + 1) + e]: first split point of dp[c][e] */
  double slack;      /* a candidate within slack of the minimum may be tied */
} dp_work;

/* ------------------------------------------------------------ segment costs */

/* The prefix differences of segment s..e are formed exactly as the reference
 * forms them, so every cost below is the reference's float64 value. */
static inline double cost_first(const dp_work *d, int e) { /* pinned at -1 */
  double w = d->W[e] - d->W[0];
  double s1 = d->S1[e] - d->S1[0];
  double s2 = d->S2[e] - d->S2[0];
  return (s2 + 2.0 * s1) + w;
}

static inline double cost_last(const dp_work *d, int s, int e) { /* pinned at +1 */
  double w = d->W[e] - d->W[s - 1];
  double s1 = d->S1[e] - d->S1[s - 1];
  double s2 = d->S2[e] - d->S2[s - 1];
  return (s2 - 2.0 * s1) + w;
}

/* ------------------------------------------------------------ histogram */

static double bin_centre(int i) { return -1.0 + ((double)i + 0.5) / 2048.0; }

/* Counts the active bins and rejects what the solver cannot represent. */
static gefen_status scan_hist(const int64_t *hist, int *n_active, gefen_error *err) {
  /* Beyond 2^53 the float64 weight sums stop being exact integers, which the
   * rounding bound of the fast solver relies on (and W[e] - W[s-1] could
   * even round to zero); no real gradient histogram comes near it. */
  const int64_t limit = (int64_t)1 << 53;
  int64_t total = 0;
  int n = 0;
  for (int i = 0; i < GEFEN_HIST_BINS; i++) {
    int64_t c = hist[i];
    if (c < 0)
      return gefen_fail(err, GEFEN_EVALUE,
                        "codebook histogram: bin %d has negative count %lld", i,
                        (long long)c);
    if (c > limit - total)
      return gefen_fail(err, GEFEN_EVALUE,
                        "codebook histogram: total count exceeds 2^53 at bin %d", i);
    total += c;
    n += c > 0;
  }
  if (n == 0)
    return gefen_fail(err, GEFEN_EVALUE,
                      "codebook histogram is all zero: no values to learn a codebook from");
  *n_active = n;
  return GEFEN_OK;
}

/* Fewer active bins than entries: every centre gets its own entry. */
static void pad_codebook(const int64_t *hist, int n, float *codebook) {
  int k = 0;
  int skip = n == K - 1; /* [-1, c_1..c_N, +1] is one too long: drop c_1 */
  codebook[k++] = -1.0f;
  for (int i = 0; i < GEFEN_HIST_BINS; i++) {
    if (hist[i] <= 0) continue;
    if (skip) {
      skip = 0;
      continue;
    }
    codebook[k++] = (float)bin_centre(i);
  }
  float last = codebook[k - 1];
  while (k < K - 1) codebook[k++] = last;
  codebook[K - 1] = 1.0f;
}

/* ------------------------------------------------------- prefix sums */

/* Builds W, S1, S2 in the reference's order and, alongside, rigorous bounds
 * on how far the float S1, S2 are from the exact sums of w x and w x^2 (W is
 * exact: integer sums below 2^53). Each float operation errs by at most
 * u |result| (u = 2^-53; 1.01 u covers dividing by 1 - u), so the bounds add
 * those up as the sums go. They are a-posteriori, so a histogram whose mass
 * sits near x = 0 gets a bound far below the a-priori n u W. */
static void build_prefix(const int64_t *hist, dp_work *d) {
  const double ur = 1.01 * (DBL_EPSILON / 2.0);
  double W = 0.0, S1 = 0.0, S2 = 0.0;
  double e1 = 0.0, e2 = 0.0, m1 = 0.0, m2 = 0.0;
  int j = 0;
  d->W[0] = d->S1[0] = d->S2[0] = 0.0;
  for (int i = 0; i < GEFEN_HIST_BINS; i++) {
    if (hist[i] <= 0) continue;
    double x = bin_centre(i);
    double w = (double)hist[i];
    double t1 = w * x;
    double t2 = t1 * x;
    W += w;
    S1 += t1;
    S2 += t2;
    e1 += ur * fabs(t1) + ur * fabs(S1);
    e2 += ur * t2 + fabs(x) * ur * fabs(t1) + ur * S2;
    m1 += fabs(t1);
    m2 += t2;
    j++;
    d->W[j] = W;
    d->S1[j] = S1;
    d->S2[j] = S2;
  }
  d->e1 = e1;
  d->e2 = e2;
  d->m1 = 1.01 * m1; /* >= sum w |x|, the 1% dwarfs every rounding */
  d->m2 = 1.01 * m2; /* >= sum w x^2 */
}

/* A bound delta on |F - G| for every candidate (s, e) of a middle layer:
 *   F = fl(D[s-1] + cost(s, e))       what the reference computes (cost = s2 - (s1*s1)/w
 *                                     of the prefix differences, as window_values forms it),
 *   G = D[s-1] + V(s, e)              V the exact variance of the exact bins,
 * with D the previous layer's float values taken as they are. For a segment
 * the exact sums obey |S1| <= m1, S1^2 / w <= S2 <= m2, |S1| <= w, w >= 1:
 *   s1, s2 (prefix differences) err by at most ed1, ed2,
 *   (s1*s1)/w errs by 2 ed1 + ed1^2 (propagated) + 2.03 u q (two roundings),
 *   s2 - q and D + cost round once each.
 * The result is doubled to absorb the rounding of this computation. */
static double rounding_bound(const dp_work *d, double dmax) {
  const double ur = 1.01 * (DBL_EPSILON / 2.0);
  double ed1 = 2.0 * d->e1 + ur * (d->m1 + 2.0 * d->e1);
  double ed2 = 2.0 * d->e2 + ur * (d->m2 + 2.0 * d->e2);
  double prop = 2.0 * ed1 + ed1 * ed1;
  double q = d->m2 + prop; /* >= |(s1*s1)/w| before its rounding */
  double cost = ed2 + prop + 2.03 * ur * q + ur * (d->m2 + ed2 + q);
  double add = ur * (dmax + d->m2 + ed2 + q);
  return 2.0 * (cost + add);
}

/* ------------------------------------------------------ dynamic programme */

/* f[s] = dp[c-1][s-1] + cost(s..e) for s in a..b. Kept free of branches so
 * that compilers can vectorise it (GCC does at -O3); vector lanes round
 * exactly as the scalar code does, so the values stay the reference's. */
static void window_values(dp_work *d, int e, int a, int b) {
  const double *restrict prev = d->prev;
  const double *restrict W = d->W;
  const double *restrict S1 = d->S1;
  const double *restrict S2 = d->S2;
  double *restrict f = d->f;
  double we = W[e], s1e = S1[e], s2e = S2[e];
  for (int s = a; s <= b; s++) {
    double w = we - W[s - 1];
    double s1 = s1e - S1[s - 1];
    double s2 = s2e - S2[s - 1];
    f[s] = prev[s - 1] + (s2 - (s1 * s1) / w);
  }
}

/* Fills dp[c][e] for e in elo..ehi of a middle layer c, knowing that every
 * split point the naive scan could choose for these e lies in slo..shi.
 *
 * Why the window is safe: let A_e be the split points whose exact value G is
 * within 2 delta of min G (delta = rounding_bound). The reference's choice
 * (any float minimiser) lies in A_e, and every s of A_e has
 * F(s) <= min F + 4 delta = min F + slack. Because V satisfies the
 * quadrangle inequality, min A_e and max A_e are both non-decreasing in e
 * (for e1 < e2: a split point that is more than 2 delta from optimal at e1
 * and left of an optimum cannot become near-optimal at e2, and one that is
 * near-optimal at e1 and right of an optimum at e2 stays near-optimal at
 * e2). So the hull of {s : F(s) <= min F + slack} at mid, which contains
 * A_mid, bounds the windows of every e left and right of mid. */
static void layer_solve(dp_work *d, int c, int elo, int ehi, int slo, int shi) {
  while (elo <= ehi) {
    int mid = elo + (ehi - elo) / 2;
    int a = slo > c ? slo : c;
    int b = shi < mid ? shi : mid;
    if (a > b) { /* unreachable when the bound holds; scan everything */
      a = c;
      b = mid;
    }
    window_values(d, mid, a, b);
    double best = d->f[a];
    int best_s = a;
    for (int s = a + 1; s <= b; s++) {
      if (d->f[s] < best) {
        best = d->f[s];
        best_s = s;
      }
    }
    d->cur[mid] = best;
    d->arg[(size_t)c * (size_t)(d->n + 1) + (size_t)mid] = (uint16_t)best_s;

    double thr = best + d->slack;
    int lo = a, hi = b;
    while (!(d->f[lo] <= thr)) lo++;
    while (!(d->f[hi] <= thr)) hi--;

    /* Recurse into the smaller half, loop over the other: depth stays log n. */
    if (mid - elo < ehi - mid) {
      layer_solve(d, c, elo, mid - 1, slo, hi);
      elo = mid + 1;
      slo = lo;
    } else {
      layer_solve(d, c, mid + 1, ehi, lo, shi);
      ehi = mid - 1;
      shi = hi;
    }
  }
}

static double max_abs(const double *v, int lo, int hi) {
  double m = 0.0;
  for (int i = lo; i <= hi; i++) m = fabs(v[i]) > m ? fabs(v[i]) : m;
  return m;
}

/* Runs layers 1..K and returns the first split point of the last cluster. */
static int run_dp(dp_work *d) {
  int n = d->n;
  /* Layer c needs dp[c][e] only for e in c..n-K+c: the remaining K-c
   * clusters each need at least one bin. */
  for (int e = 1; e <= n - K + 1; e++) d->cur[e] = cost_first(d, e);

  for (int c = 2; c < K; c++) {
    double *t = d->prev;
    d->prev = d->cur;
    d->cur = t;
    double dmax = max_abs(d->prev, c - 1, n - K + c - 1);
    d->slack = 4.0 * rounding_bound(d, dmax);
    layer_solve(d, c, c, n - K + c, c, n - K + c);
  }

  /* The last cluster ends at n, so its layer is a single plain scan. */
  double best = d->cur[K - 1] + cost_last(d, K, n);
  int best_s = K;
  for (int s = K + 1; s <= n; s++) {
    double v = d->cur[s - 1] + cost_last(d, s, n);
    if (v < best) {
      best = v;
      best_s = s;
    }
  }
  return best_s;
}

static void backtrack(const dp_work *d, int last_s, float *codebook) {
  int e = d->n;
  int s = last_s;
  for (int c = K; c >= 1; c--) {
    if (c < K) s = c == 1 ? 1 : d->arg[(size_t)c * (size_t)(d->n + 1) + (size_t)e];
    double w = d->W[e] - d->W[s - 1];
    double s1 = d->S1[e] - d->S1[s - 1];
    codebook[c - 1] = (float)(s1 / w);
    e = s - 1;
  }
  codebook[0] = -1.0f;
  codebook[K - 1] = 1.0f;
}

static gefen_status solve_dp(const int64_t *hist, int n, float *codebook,
                             gefen_error *err) {
  size_t m = (size_t)n + 1;
  dp_work d = {0};
  d.n = n;
  double *buf = malloc(6 * m * sizeof *buf);
  d.arg = malloc((size_t)K * m * sizeof *d.arg);
  if (!buf || !d.arg) {
    free(buf);
    free(d.arg);
    return gefen_fail(err, GEFEN_ENOMEM, "codebook solver: out of memory (%d bins)", n);
  }
  d.W = buf;
  d.S1 = buf + m;
  d.S2 = buf + 2 * m;
  d.prev = buf + 3 * m;
  d.cur = buf + 4 * m;
  d.f = buf + 5 * m;

  build_prefix(hist, &d);
  int last_s = run_dp(&d);
  backtrack(&d, last_s, codebook);

  free(buf);
  free(d.arg);
  return GEFEN_OK;
}

/* ------------------------------------------------------------ public API */

gefen_status gefen_codebook_solve(const int64_t *hist, float *codebook,
                                  gefen_error *err) {
  gefen_clear(err);
  if (!hist || !codebook)
    return gefen_fail(err, GEFEN_EVALUE, "codebook solve: NULL %s",
                      hist ? "codebook" : "histogram");
  int n = 0;
  gefen_status st = scan_hist(hist, &n, err);
  if (st != GEFEN_OK) return st;

  if (n < K) {
    pad_codebook(hist, n, codebook);
    return GEFEN_OK;
  }
  st = solve_dp(hist, n, codebook, err);
  if (st != GEFEN_OK) return st;
  /* Exact segment means of sorted bins are at least one bin apart, but the
   * specified arithmetic takes them from float64 prefix differences: when a
   * few bins hold ~2^40 counts or more, a light segment's mean can err by
   * more than a bin and the reference itself yields an unsorted codebook.
   * Such a codebook cannot quantise, so it is an error, not a result. */
  gefen_error why;
  if (gefen_codebook_validate(codebook, &why) != GEFEN_OK)
    return gefen_fail(err, GEFEN_ERUNTIME,
                      "codebook solve: float64 rounding of the histogram sums "
                      "(total weight too uneven) gave an invalid codebook: %s",
                      why.msg);
  return GEFEN_OK;
}

gefen_status gefen_codebook_validate(const float *codebook, gefen_error *err) {
  gefen_clear(err);
  if (!codebook) return gefen_fail(err, GEFEN_EVALUE, "codebook: NULL pointer");
  for (int i = 0; i < K; i++) {
    float v = codebook[i];
    if (!isfinite(v))
      return gefen_fail(err, GEFEN_EVALUE, "codebook[%d] = %g is not finite", i,
                        (double)v);
    if (i > 0 && v < codebook[i - 1])
      return gefen_fail(err, GEFEN_EVALUE,
                        "codebook is not sorted: codebook[%d] = %.9g < codebook[%d] = %.9g",
                        i, (double)v, i - 1, (double)codebook[i - 1]);
  }
  if (codebook[0] != -1.0f)
    return gefen_fail(err, GEFEN_EVALUE, "codebook[0] = %.9g, must be exactly -1",
                      (double)codebook[0]);
  if (codebook[K - 1] != 1.0f)
    return gefen_fail(err, GEFEN_EVALUE, "codebook[%d] = %.9g, must be exactly +1",
                      K - 1, (double)codebook[K - 1]);
  return GEFEN_OK;
}
