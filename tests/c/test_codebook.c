/*
 * Tests of the codebook solver (ALGORITHM.md section 3) against a naive
 * O(N^2 K) reference written here with the same float64 arithmetic, compared
 * bit for bit. Exits nonzero when anything fails.
 *
 * GEFEN_SLOW=1 in the environment also checks N = 4096 histograms against the
 * naive reference (a few seconds each).
 */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gefen_core.h"

#define K GEFEN_CODEBOOK_SIZE
#define BINS GEFEN_HIST_BINS

static int g_failures = 0;
static int g_checks = 0;

#define CHECK(cond, ...)                                        \
  do {                                                          \
    g_checks++;                                                 \
    if (!(cond)) {                                              \
      g_failures++;                                             \
      printf("FAIL %s:%d: ", __FILE__, __LINE__);               \
      printf(__VA_ARGS__);                                      \
      printf("\n");                                             \
    }                                                           \
  } while (0)

/* ------------------------------------------------------------ random */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static int64_t rng_range(uint64_t *s, int64_t lo, int64_t hi) { /* inclusive */
  return lo + (int64_t)(rng_next(s) % (uint64_t)(hi - lo + 1));
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---------------------------------------------------- naive reference */

static double centre(int i) { return -1.0 + ((double)i + 0.5) / 2048.0; }

/* The specification's recurrence, literally: dp over all clusters c and all
 * feasible end points e, scanning s ascending with strict "<". */
static int ref_solve(const int64_t *hist, float *cb) {
  int n = 0;
  for (int i = 0; i < BINS; i++) n += hist[i] > 0;
  if (n == 0) return -1;
  if (n < K) {
    double c[K];
    int m = 0;
    for (int i = 0; i < BINS; i++)
      if (hist[i] > 0) c[m++] = centre(i);
    int k = 0;
    cb[k++] = -1.0f;
    for (int j = (n == K - 1) ? 1 : 0; j < n; j++) cb[k++] = (float)c[j];
    while (k < K - 1) cb[k++] = (float)c[n - 1];
    cb[k] = 1.0f;
    return 0;
  }
  size_t m = (size_t)n + 1;
  double *W = calloc(m, sizeof *W), *S1 = calloc(m, sizeof *S1), *S2 = calloc(m, sizeof *S2);
  double *dp = malloc((size_t)(K + 1) * m * sizeof *dp);
  int *arg = malloc((size_t)(K + 1) * m * sizeof *arg);
  if (!W || !S1 || !S2 || !dp || !arg) {
    printf("ref_solve: out of memory\n");
    exit(2);
  }
  double w_ = 0, s1_ = 0, s2_ = 0;
  int j = 0;
  for (int i = 0; i < BINS; i++) {
    if (hist[i] <= 0) continue;
    double x = centre(i), w = (double)hist[i];
    w_ += w;
    s1_ += w * x;
    s2_ += (w * x) * x;
    j++;
    W[j] = w_;
    S1[j] = s1_;
    S2[j] = s2_;
  }
#define DP(c, e) dp[(size_t)(c) * m + (size_t)(e)]
#define ARG(c, e) arg[(size_t)(c) * m + (size_t)(e)]
  for (int e = 1; e <= n - K + 1; e++) {
    double w = W[e] - W[0], s1 = S1[e] - S1[0], s2 = S2[e] - S2[0];
    DP(1, e) = (s2 + 2.0 * s1) + w;
    ARG(1, e) = 1;
  }
  for (int c = 2; c <= K; c++) {
    int elo = c == K ? n : c, ehi = n - K + c;
    for (int e = elo; e <= ehi; e++) {
      double best = INFINITY;
      int best_s = -1;
      for (int s = c; s <= e; s++) {
        double w = W[e] - W[s - 1], s1 = S1[e] - S1[s - 1], s2 = S2[e] - S2[s - 1];
        double cost = c == K ? (s2 - 2.0 * s1) + w : s2 - (s1 * s1) / w;
        double v = DP(c - 1, s - 1) + cost;
        if (v < best) {
          best = v;
          best_s = s;
        }
      }
      DP(c, e) = best;
      ARG(c, e) = best_s;
    }
  }
  int e = n;
  for (int c = K; c >= 1; c--) {
    int s = ARG(c, e);
    cb[c - 1] = (float)((S1[e] - S1[s - 1]) / (W[e] - W[s - 1]));
    e = s - 1;
  }
  cb[0] = -1.0f;
  cb[K - 1] = 1.0f;
#undef DP
#undef ARG
  free(W);
  free(S1);
  free(S2);
  free(dp);
  free(arg);
  return 0;
}

/* ------------------------------------------------------- comparison */

static int active(const int64_t *h) {
  int n = 0;
  for (int i = 0; i < BINS; i++) n += h[i] > 0;
  return n;
}

static int same_bits(const float *a, const float *b, int *where) {
  for (int i = 0; i < K; i++) {
    uint32_t x, y;
    memcpy(&x, &a[i], 4);
    memcpy(&y, &b[i], 4);
    if (x != y) {
      *where = i;
      return 0;
    }
  }
  return 1;
}

static int g_compared = 0;

static int g_rejected = 0;

/* Solves hist both ways and checks bitwise agreement and the contract. When
 * the reference's own float64 arithmetic yields an unsorted codebook (only
 * for counts near 2^40 and above), the solver must refuse with ERUNTIME. */
static void compare(const int64_t *hist, const char *what) {
  float got[K], want[K];
  gefen_error err, why;
  ref_solve(hist, want);
  int ref_ok = gefen_codebook_validate(want, &why) == GEFEN_OK;
  gefen_status st = gefen_codebook_solve(hist, got, &err);
  if (!ref_ok) {
    g_rejected++;
    CHECK(st == GEFEN_ERUNTIME && strstr(err.msg, "not sorted"),
          "%s (N=%d): reference is invalid (%s) but solve gave status %d: %s", what,
          active(hist), why.msg, (int)st, err.msg);
    return;
  }
  CHECK(st == GEFEN_OK, "%s (N=%d): status %d: %s", what, active(hist), (int)st, err.msg);
  if (st != GEFEN_OK) return;
  int at = -1;
  g_compared++;
  CHECK(same_bits(got, want, &at), "%s (N=%d): entry %d is %.9g, reference %.9g", what,
        active(hist), at, at >= 0 ? (double)got[at] : 0.0, at >= 0 ? (double)want[at] : 0.0);
  st = gefen_codebook_validate(got, &err);
  CHECK(st == GEFEN_OK, "%s: solved codebook fails validation: %s", what, err.msg);
}

/* ------------------------------------------------------- histograms */

/* n distinct random active bins with counts from count(). */
typedef int64_t (*count_fn)(uint64_t *rng, int j, int n);

static void random_bins(int64_t *h, int n, uint64_t *rng, count_fn count) {
  memset(h, 0, BINS * sizeof *h);
  int picked = 0, j = 0;
  /* Selection sampling keeps the bins sorted and distinct. */
  for (int i = 0; i < BINS && picked < n; i++) {
    if ((int64_t)(rng_next(rng) % (uint64_t)(BINS - i)) < n - picked) {
      h[i] = count(rng, j++, n);
      picked++;
    }
  }
}

static int64_t cnt_small(uint64_t *r, int j, int n) { (void)j, (void)n; return rng_range(r, 1, 20); }
static int64_t cnt_wide(uint64_t *r, int j, int n) { (void)j, (void)n; return rng_range(r, 1, 1000000); }
static int64_t cnt_one(uint64_t *r, int j, int n) { (void)r, (void)j, (void)n; return 1; }
static int64_t cnt_heavy(uint64_t *r, int j, int n) { /* log-uniform in [1, 2^40] */
  (void)j, (void)n;
  return (int64_t)ldexp(1.0, (int)rng_range(r, 0, 40)) + rng_range(r, 0, 3);
}
static int64_t cnt_two(uint64_t *r, int j, int n) { (void)j, (void)n; return rng_range(r, 1, 2) * 1000; }

/* The bins lo..lo+n-1 (a contiguous run) with counts from f. */
static void run_bins(int64_t *h, int lo, int n, uint64_t *rng, count_fn count) {
  memset(h, 0, BINS * sizeof *h);
  for (int j = 0; j < n; j++) h[lo + j] = count(rng, j, n);
}

/* n bins spaced stride apart, starting at lo, all with count c. */
static void spaced_bins(int64_t *h, int lo, int stride, int n, int64_t c) {
  memset(h, 0, BINS * sizeof *h);
  for (int j = 0; j < n; j++) h[lo + j * stride] = c;
}

/* Bell shape: counts peak * exp(-z^2 / 2) over n contiguous centred bins. */
static void bell_bins(int64_t *h, int n, double peak, double sigma_bins) {
  memset(h, 0, BINS * sizeof *h);
  int lo = BINS / 2 - n / 2;
  for (int j = 0; j < n; j++) {
    double z = (double)(lo + j - BINS / 2) / sigma_bins;
    h[lo + j] = 1 + (int64_t)(peak * exp(-0.5 * z * z));
  }
}

static void mirror(int64_t *h) { /* symmetric about 0: keep the lower half */
  for (int i = 0; i < BINS / 2; i++) h[BINS - 1 - i] = h[i];
}

/* ------------------------------------------------------------- tests */

static void test_random(void) {
  static const int sizes[] = {256, 257, 258, 300, 384, 600};
  count_fn fns[] = {cnt_small, cnt_wide, cnt_one, cnt_heavy, cnt_two};
  const char *names[] = {"random small", "random wide", "random ones", "random heavy",
                         "random two-valued"};
  uint64_t rng = 12345;
  int64_t h[BINS];
  char what[96];
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
    for (int f = 0; f < 5; f++)
      for (int rep = 0; rep < (sizes[si] <= 300 ? 4 : sizes[si] < 600 ? 2 : 1); rep++) {
        random_bins(h, sizes[si], &rng, fns[f]);
        snprintf(what, sizeof what, "%s #%d", names[f], rep);
        compare(h, what);
      }
  for (int f = 0; f < 5; f++) { /* a few larger ones: the naive DP is O(N^2 K) */
    if (f != 1 && f != 3) continue;
    random_bins(h, 1000, &rng, fns[f]);
    snprintf(what, sizeof what, "%s N=1000", names[f]);
    compare(h, what);
  }
}

/* Equal counts on evenly spaced bins: the exact optimum is tied between many
 * placements of the larger clusters, so rounding decides, and the float
 * minimiser is not monotone in e. */
static void test_ties(void) {
  int64_t h[BINS];
  char what[96];
  static const int ns[] = {256, 257, 258, 260, 272, 300, 383, 384, 385, 511, 512};
  static const int64_t cs[] = {1, 3, 1000, 1 << 20, (int64_t)1 << 40};
  for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
    for (size_t j = 0; j < sizeof cs / sizeof *cs; j++) {
      int stride = BINS / ns[i] >= 2 && (i + j) % 2 ? 2 : 1;
      spaced_bins(h, (BINS - stride * ns[i]) / 2, stride, ns[i], cs[j]);
      snprintf(what, sizeof what, "ties stride %d count %lld", stride, (long long)cs[j]);
      compare(h, what);
    }
  /* Repeating count patterns also tie between shifted placements. */
  static const int64_t pat[] = {1, 2, 1, 2, 5, 1, 1, 3};
  for (int n = 256; n <= 520; n += 88) {
    memset(h, 0, sizeof h);
    for (int j = 0; j < n; j++) h[100 + 3 * j] = pat[j % 8];
    compare(h, "periodic count pattern");
  }
  spaced_bins(h, 1, 1, 1000, 1);
  compare(h, "ties N=1000 contiguous");
}

/* Count-1 bins next to a few bins of 2^30..2^49 (like the spikes a gradient
 * histogram has at 0 and +-1): the prefix sums' rounding dwarfs the cost
 * differences of the light bins, so the float minimiser over split points is
 * decided by rounding noise and jumps around in e. A divide and conquer that
 * trusts monotonicity gets about a quarter of these wrong. */
static void test_noise_dominated(uint64_t *rng) {
  int64_t h[BINS];
  char what[96];
  for (int rep = 0; rep < 24; rep++) {
    int n = 300 + 50 * (rep % 3);
    random_bins(h, n, rng, cnt_one);
    int spikes = rep % 2 ? 5 : 1;
    for (int k = 0; k < spikes; k++)
      h[rng_range(rng, 0, BINS - 1)] = (int64_t)1 << (30 + rep % 20);
    snprintf(what, sizeof what, "ones + %d spikes of 2^%d #%d", spikes, 30 + rep % 20, rep);
    compare(h, what);
  }
  for (int rep = 0; rep < 12; rep++) {
    int n = 300 + 25 * (rep % 4);
    spaced_bins(h, 0, 1, n, 1);
    h[rng_range(rng, 0, n - 1)] = (int64_t)1 << (25 + 2 * rep);
    snprintf(what, sizeof what, "ones run + spike of 2^%d", 25 + 2 * rep);
    compare(h, what);
  }
}

static void test_structured(void) {
  int64_t h[BINS];
  uint64_t rng = 777;
  char what[96];
  for (int n = 256; n <= 600; n += 86) { /* symmetric histograms */
    random_bins(h, n / 2, &rng, cnt_small);
    mirror(h);
    compare(h, "symmetric random");
    memset(h, 0, sizeof h);
    for (int j = 0; j < n / 2; j++) h[BINS / 2 - 1 - 3 * j] = h[BINS / 2 + 3 * j] = 5;
    compare(h, "symmetric equal");
  }
  static const double sigmas[] = {20.0, 80.0, 400.0};
  for (int n = 256; n <= 560; n += 152)
    for (int k = 0; k < 3; k++) {
      bell_bins(h, n, 1e6, sigmas[k]);
      snprintf(what, sizeof what, "bell sigma %g", sigmas[k]);
      compare(h, what);
      bell_bins(h, n, 1e12, sigmas[k]);
      compare(h, "bell peak 1e12");
    }
  /* Spikes: a few huge bins among many count-1 bins, like gradients with a
   * dominant zero (u = 0 for all-zero blocks) and exact +-1 maxima. */
  for (int n = 256; n <= 600; n += 86) {
    random_bins(h, n, &rng, cnt_one);
    h[BINS / 2] = (int64_t)1 << 45;
    h[BINS - 1] = (int64_t)1 << 30;
    h[0] = (int64_t)1 << 30;
    compare(h, "spikes");
    run_bins(h, 1000, n, &rng, cnt_small);
    h[1000 + n / 3] = 1000000000;
    compare(h, "run with spike");
  }
  run_bins(h, 0, 256, &rng, cnt_wide);
  compare(h, "lowest 256 bins");
  test_noise_dominated(&rng);
  run_bins(h, BINS - 300, 300, &rng, cnt_wide);
  compare(h, "highest 300 bins");
  /* Totals near the 2^53 limit: prefix sums are far from exact. */
  random_bins(h, 400, &rng, cnt_one);
  for (int i = 0; i < BINS; i++)
    if (h[i]) h[i] = ((int64_t)1 << 43) + rng_range(&rng, 0, 1 << 20);
  compare(h, "huge counts");
  spaced_bins(h, 7, 9, 300, (int64_t)1 << 44);
  compare(h, "huge equal counts");
}

/* N == 256 has one bin per cluster. */
static void test_one_bin_per_cluster(void) {
  int64_t h[BINS];
  uint64_t rng = 5;
  random_bins(h, 256, &rng, cnt_wide);
  float cb[K];
  gefen_error err;
  CHECK(gefen_codebook_solve(h, cb, &err) == GEFEN_OK, "N=256: %s", err.msg);
  int k = 0, ok = 1;
  for (int i = 0; i < BINS; i++)
    if (h[i] > 0) {
      float want = k == 0 ? -1.0f : k == K - 1 ? 1.0f : (float)centre(i);
      ok &= cb[k] == want;
      k++;
    }
  CHECK(ok, "N=256: entries are not the bin centres");
}

static void test_padding(void) {
  int64_t h[BINS];
  float cb[K], want[K];
  gefen_error err;
  uint64_t rng = 99;
  static const int ns[] = {1, 2, 3, 100, 253, 254, 255};
  for (size_t t = 0; t < sizeof ns / sizeof *ns; t++) {
    int n = ns[t];
    random_bins(h, n, &rng, cnt_wide);
    CHECK(gefen_codebook_solve(h, cb, &err) == GEFEN_OK, "pad N=%d: %s", n, err.msg);
    ref_solve(h, want);
    int at = -1;
    CHECK(same_bits(cb, want, &at), "pad N=%d: entry %d", n, at);
    CHECK(gefen_codebook_validate(cb, &err) == GEFEN_OK, "pad N=%d: %s", n, err.msg);
  }
  /* Explicit shapes of the rule. */
  memset(h, 0, sizeof h);
  h[3000] = 17;
  gefen_codebook_solve(h, cb, &err);
  float c = (float)centre(3000);
  int ok = cb[0] == -1.0f && cb[K - 1] == 1.0f;
  for (int i = 1; i < K - 1; i++) ok &= cb[i] == c;
  CHECK(ok, "N=1: expected [-1, c x254, +1]");

  h[10] = 2; /* N = 2: [-1, c_1, c_2 x253, +1] */
  gefen_codebook_solve(h, cb, &err);
  ok = cb[0] == -1.0f && cb[1] == (float)centre(10) && cb[K - 1] == 1.0f;
  for (int i = 2; i < K - 1; i++) ok &= cb[i] == c;
  CHECK(ok, "N=2: expected [-1, c1, c2 x253, +1]");

  spaced_bins(h, 0, 1, 254, 1); /* N = 254: exactly [-1, c_1..c_254, +1] */
  gefen_codebook_solve(h, cb, &err);
  ok = cb[0] == -1.0f && cb[K - 1] == 1.0f;
  for (int i = 1; i < K - 1; i++) ok &= cb[i] == (float)centre(i - 1);
  CHECK(ok, "N=254: expected [-1, c1..c254, +1]");

  spaced_bins(h, 0, 1, 255, 1); /* N = 255: c_1 dropped */
  gefen_codebook_solve(h, cb, &err);
  ok = cb[0] == -1.0f && cb[K - 1] == 1.0f;
  for (int i = 1; i < K - 1; i++) ok &= cb[i] == (float)centre(i);
  CHECK(ok, "N=255: expected [-1, c2..c255, +1]");
}

static void test_errors(void) {
  int64_t h[BINS];
  float cb[K];
  gefen_error err;
  memset(h, 0, sizeof h);
  err.msg[0] = '\0';
  CHECK(gefen_codebook_solve(h, cb, &err) == GEFEN_EVALUE, "all-zero histogram accepted");
  CHECK(strstr(err.msg, "all zero") != NULL, "all-zero message: '%s'", err.msg);

  h[5] = 3;
  h[77] = -1;
  CHECK(gefen_codebook_solve(h, cb, &err) == GEFEN_EVALUE, "negative count accepted");
  CHECK(strstr(err.msg, "77") && strstr(err.msg, "-1"), "negative message: '%s'", err.msg);

  memset(h, 0, sizeof h);
  h[0] = h[1] = (int64_t)1 << 52;
  h[2] = 1;
  CHECK(gefen_codebook_solve(h, cb, &err) == GEFEN_EVALUE, "total above 2^53 accepted");
  h[0] = INT64_MAX;
  CHECK(gefen_codebook_solve(h, cb, &err) == GEFEN_EVALUE, "INT64_MAX count accepted");

  CHECK(gefen_codebook_solve(NULL, cb, &err) == GEFEN_EVALUE, "NULL histogram accepted");
  h[0] = 1;
  CHECK(gefen_codebook_solve(h, NULL, &err) == GEFEN_EVALUE, "NULL codebook accepted");
  CHECK(gefen_codebook_solve(h, cb, NULL) == GEFEN_OK, "err == NULL must be allowed");
  CHECK(gefen_codebook_solve(NULL, cb, NULL) == GEFEN_EVALUE, "err == NULL on failure");
  /* A successful call clears an earlier message. */
  strcpy(err.msg, "stale");
  CHECK(gefen_codebook_solve(h, cb, &err) == GEFEN_OK && err.msg[0] == '\0',
        "message not cleared on success: '%s'", err.msg);
}

static void test_validate(void) {
  float cb[K];
  gefen_error err;
  for (int i = 0; i < K; i++) cb[i] = -1.0f + 2.0f * (float)i / (K - 1);
  cb[K - 1] = 1.0f;
  CHECK(gefen_codebook_validate(cb, &err) == GEFEN_OK, "uniform rejected: %s", err.msg);

  float flat[K];
  for (int i = 0; i < K; i++) flat[i] = 0.25f;
  flat[0] = -1.0f;
  flat[K - 1] = 1.0f;
  CHECK(gefen_codebook_validate(flat, &err) == GEFEN_OK, "repeated entries rejected: %s",
        err.msg);
  flat[1] = -1.0f;
  flat[K - 2] = 1.0f;
  CHECK(gefen_codebook_validate(flat, &err) == GEFEN_OK, "repeated ends rejected: %s",
        err.msg);

  struct {
    int idx;
    float val;
    const char *needle;
  } bad[] = {
      {0, -0.99f, "codebook[0]"},      {0, -1.0000001f, "codebook[0]"},
      {K - 1, 0.999f, "codebook[255]"}, {K - 1, 1.0000001f, "codebook[255]"},
      {100, NAN, "codebook[100]"},     {17, INFINITY, "codebook[17]"},
      {0, -INFINITY, "codebook[0]"},   {50, 0.9f, "codebook[51]"},
      {200, -0.5f, "codebook[200]"},
  };
  for (size_t t = 0; t < sizeof bad / sizeof *bad; t++) {
    float c[K];
    memcpy(c, cb, sizeof c);
    c[bad[t].idx] = bad[t].val;
    err.msg[0] = '\0';
    gefen_status st = gefen_codebook_validate(c, &err);
    CHECK(st == GEFEN_EVALUE, "bad case %zu (index %d = %g) accepted", t, bad[t].idx,
          (double)bad[t].val);
    CHECK(strstr(err.msg, bad[t].needle) != NULL, "bad case %zu: message '%s' lacks '%s'", t,
          err.msg, bad[t].needle);
  }
  CHECK(gefen_codebook_validate(NULL, &err) == GEFEN_EVALUE, "NULL codebook accepted");
}

/* N = 4096 (every bin active): the case that needs the fast solver. */
static void test_timing(int slow) {
  int64_t h[BINS];
  uint64_t rng = 4242;
  float cb[K], want[K];
  gefen_error err;
  const char *names[] = {"random counts", "equal counts (ties)", "bell",
                         "gradient-like"};
  for (int k = 0; k < 4; k++) {
    if (k == 0) run_bins(h, 0, BINS, &rng, cnt_wide);
    if (k == 1) spaced_bins(h, 0, 1, BINS, 1);
    if (k == 2) bell_bins(h, BINS, 1e9, 300.0);
    if (k == 3) { /* Laplace-like body, zeros at the centre, block maxima at +-1 */
      for (int i = 0; i < BINS; i++) h[i] = 1 + (int64_t)(1e8 * exp(-fabs(centre(i)) / 0.05));
      h[BINS / 2 - 1] += 1000000000;
      h[BINS / 2] += 1000000000;
      h[0] += 10000000;
      h[BINS - 1] += 10000000;
    }
    double best = 1e9;
    for (int rep = 0; rep < 3; rep++) {
      double t0 = now_s();
      gefen_status st = gefen_codebook_solve(h, cb, &err);
      double dt = now_s() - t0;
      best = dt < best ? dt : best;
      CHECK(st == GEFEN_OK, "N=4096 %s: %s", names[k], err.msg);
    }
    CHECK(gefen_codebook_validate(cb, &err) == GEFEN_OK, "N=4096 %s: %s", names[k], err.msg);
    printf("timing: N=4096 %-20s %.1f ms (best of 3)\n", names[k], 1e3 * best);
    if (slow) {
      double t0 = now_s();
      ref_solve(h, want);
      int at = -1;
      g_compared++;
      CHECK(same_bits(cb, want, &at), "N=4096 %s: entry %d differs from reference", names[k],
            at);
      printf("        naive reference %.1f s\n", now_s() - t0);
    }
  }
}

int main(void) {
  const char *slow_env = getenv("GEFEN_SLOW");
  int slow = slow_env && slow_env[0] == '1';
  double t0 = now_s();
  test_errors();
  test_validate();
  test_padding();
  test_one_bin_per_cluster();
  test_random();
  test_ties();
  test_structured();
  test_timing(slow);
  printf("test_codebook: %d checks, %d bitwise comparisons with the naive DP, "
         "%d histograms whose reference codebook is unsorted (refused), %d failures "
         "(%.1f s)\n",
         g_checks, g_compared, g_rejected, g_failures, now_s() - t0);
  return g_failures ? 1 : 0;
}
