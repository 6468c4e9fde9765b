/* C tests of the period search (ALGORITHM.md §2) and its exact sums.
 *
 * - candidates, the choice on a structured gradient, the fallbacks;
 * - exact sums: correctly rounded (ties to even, subnormals, overflow),
 *   independent of the order of the terms;
 * - sharding invariance: the statistics of every split of a matrix into row
 *   shards add up to those of the whole matrix bit for bit, for any thread
 *   count, so every world size picks the same period. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gefen_core.h"
#include "gefen_xsum.h"

#include "check.h"

static double unit(void) { return (double)(test_rng() >> 11) * 0x1p-53; }

#define W GEFEN_PERIOD_STAT_WIDTH

/* ------------------------------------------------------------ candidates */

static void test_candidates(void) {
  int64_t out[64];
  int64_t n = gefen_period_candidates(12, 48, out, 64);
  const int64_t want12[] = {1, 2, 3, 4, 6, 12};
  CHECK(n == 6 && memcmp(out, want12, sizeof want12) == 0, "candidates of 12");
  n = gefen_period_candidates(12, 12, out, 64); /* d = numel excluded */
  CHECK(n == 5 && out[4] == 6, "candidates of a 1 x 12 parameter");
  n = gefen_period_candidates(36, 72, out, 64);
  const int64_t want36[] = {1, 2, 3, 4, 6, 9, 12, 18, 36};
  CHECK(n == 9 && memcmp(out, want36, sizeof want36) == 0, "candidates of 36 (square)");
  CHECK(gefen_period_candidates(7, 1, out, 64) == 0, "numel 1 has no candidates");
  CHECK(gefen_period_candidates(1000000007LL, 2000000014LL, out, 64) == 2, "a large prime");
}

/* --------------------------------------------------------------- choice */

static void test_choice(void) {
  /* S = 48, every block of 16 has its own scale: err(d) = 0 for d | 16, and
   * blocks of 3, 6, 12 straddle 16-boundaries, so the largest drop of the
   * error, s(16) = -err(12), is at 16 (the worked case of tests/test_reference.py) */
  enum { R = 8, S = 48 };
  static float g[R * S];
  for (int r = 0; r < R; r++)
    for (int b = 0; b < S / 16; b++) {
      const float scale = 0.5f + 2.5f * (float)unit();
      for (int j = 0; j < 16; j++) g[r * S + b * 16 + j] = scale;
    }
  gefen_matrix mat = {g, GEFEN_F32, R, S};
  int64_t out[64];
  const int64_t n = gefen_period_candidates(S, R * S, out, 64);
  static int64_t stats[64 * W];
  gefen_error err;
  CHECK(gefen_period_stats(&mat, out, n, stats, 2, &err) == GEFEN_OK, "%s", err.msg);
  int64_t period = 0;
  CHECK(gefen_period_choose(S, R * S, 2, out, n, stats, &period, &err) == GEFEN_OK, "%s", err.msg);
  CHECK(period == 16, "structured gradient: period %lld, expected 16", (long long)period);
  for (int64_t k = 0; k < n; k++)
    CHECK(stats[k * W + GEFEN_PERIOD_STAT_BLOCKS] == R * (S / out[k]), "block count of %lld",
          (long long)out[k]);
  /* a constant gradient has no structure: the 2-D fallback is the whole row */
  for (int i = 0; i < R * S; i++) g[i] = 0.5f;
  memset(stats, 0, sizeof stats);
  gefen_period_stats(&mat, out, n, stats, 1, &err);
  gefen_period_choose(S, R * S, 2, out, n, stats, &period, &err);
  CHECK(period == S, "no structure, 2-D: period %lld, expected %d", (long long)period, S);
  gefen_period_choose(S, R * S, 3, out, n, stats, &period, &err);
  CHECK(period == 48, "no structure, 3-D: largest divisor <= 2048 is 48, got %lld",
        (long long)period);
  const int64_t big = 3 * 4096; /* 3-D, S = 12288: the largest divisor <= 2048 is 2048 */
  int64_t cands_big[1] = {1}, one_block[W] = {0};
  one_block[GEFEN_PERIOD_STAT_BLOCKS] = 1;
  gefen_period_choose(big, 2 * big, 3, cands_big, 1, one_block, &period, &err);
  CHECK(period == 2048, "fallback divisor of 12288: %lld", (long long)period);
  gefen_period_choose(1, 5, 1, NULL, 0, NULL, &period, &err);
  CHECK(period == 1, "1-D parameters use period 1");
  CHECK(gefen_period_stats(&mat, (int64_t[]){5}, 1, stats, 1, &err) == GEFEN_EVALUE &&
            strstr(err.msg, "does not divide"),
        "a candidate that does not divide S is refused: %s", err.msg);
  int64_t corrupt[W] = {0};
  corrupt[3] = -1;
  CHECK(gefen_period_choose(S, R * S, 2, cands_big, 1, corrupt, &period, &err) == GEFEN_EVALUE &&
            strstr(err.msg, "negative"),
        "negative statistics are refused: %s", err.msg);
  /* a NaN gradient makes the variances of its blocks non-finite: counted */
  g[5] = NAN;
  memset(stats, 0, sizeof stats);
  gefen_period_stats(&mat, out, n, stats, 1, &err);
  CHECK(stats[(n - 1) * W + GEFEN_PERIOD_STAT_NONFINITE] == 1, "one non-finite block of %lld",
        (long long)out[n - 1]);
  CHECK(stats[0 * W + GEFEN_PERIOD_STAT_NONFINITE] == 0, "blocks of one have no variance");
}

/* ------------------------------------------------------------ exact sums */

static double xsum_of(const double *x, int64_t n) {
  int64_t limbs[GEFEN_XSUM_LIMBS] = {0};
  gefen_error err;
  if (gefen_exact_sum_add(limbs, x, n, &err) != GEFEN_OK) return -1.0;
  return gefen_exact_sum_value(limbs);
}

static void test_exact_sums(void) {
  /* exact where float64 is not: 1 + 2^-60 * 2^10 == 1 + 2^-50 */
  double x[1100];
  x[0] = 1.0;
  for (int i = 1; i <= 1024; i++) x[i] = 0x1p-60;
  CHECK(xsum_of(x, 1025) == 1.0 + 0x1p-50, "many tiny terms add up exactly");
  /* ties to even: 2^53 + 1 rounds to 2^53, 2^53 + 3 to 2^53 + 4 */
  double t1[2] = {0x1p53, 1.0}, t2[2] = {0x1p53, 3.0}, t3[3] = {0x1p53, 1.0, 0x1p-1000};
  CHECK(xsum_of(t1, 2) == 0x1p53, "tie rounds to even (down)");
  CHECK(xsum_of(t2, 2) == 0x1p53 + 4.0, "tie rounds to even (up)");
  CHECK(xsum_of(t3, 3) == 0x1p53 + 2.0, "above the tie (sticky bit far below) rounds up");
  /* subnormals and the largest doubles */
  double s[3] = {DBL_TRUE_MIN, DBL_TRUE_MIN, 3 * DBL_TRUE_MIN};
  CHECK(xsum_of(s, 3) == 5 * DBL_TRUE_MIN, "subnormals add exactly");
  double big[2] = {DBL_MAX, DBL_MAX};
  CHECK(xsum_of(big, 2) == HUGE_VAL, "overflow gives +inf");
  CHECK(xsum_of(big, 1) == DBL_MAX, "the largest double is representable");
  double zero[2] = {0.0, -0.0};
  CHECK(xsum_of(zero, 2) == 0.0, "zeros");
  double bad[2] = {1.0, -1.0};
  int64_t limbs[GEFEN_XSUM_LIMBS] = {0};
  gefen_error err;
  CHECK(gefen_exact_sum_add(limbs, bad, 2, &err) == GEFEN_EVALUE && limbs[0] == 0 &&
            strstr(err.msg, "negative or not finite"),
        "negative values are refused before anything is added: %s", err.msg);
  /* order independence over a wide range of magnitudes, and agreement with a
   * long-double sum where that one is exact enough to compare */
  enum { N = 1000 };
  double v[N], w[N];
  for (int trial = 0; trial < 20; trial++) {
    for (int i = 0; i < N; i++) v[i] = ldexp(unit(), (int)(test_rng() % 200) - 100);
    memcpy(w, v, sizeof v);
    for (int i = N - 1; i > 0; i--) { /* shuffle */
      const int j = (int)(test_rng() % (uint64_t)(i + 1));
      const double tmp = w[i];
      w[i] = w[j];
      w[j] = tmp;
    }
    const double a = xsum_of(v, N), b = xsum_of(w, N);
    CHECK(a == b, "order independence (trial %d): %.17g vs %.17g", trial, a, b);
    double naive = 0.0;
    for (int i = 0; i < N; i++) naive += v[i];
    CHECK(fabs(a - naive) <= 1e-12 * a, "close to the float64 sum: %.17g vs %.17g", a, naive);
  }
  /* limb-wise addition of two accumulators is the sum of their values */
  int64_t l1[GEFEN_XSUM_LIMBS] = {0}, l2[GEFEN_XSUM_LIMBS] = {0}, l12[GEFEN_XSUM_LIMBS] = {0};
  gefen_exact_sum_add(l1, v, N / 2, &err);
  gefen_exact_sum_add(l2, v + N / 2, N - N / 2, &err);
  for (int k = 0; k < GEFEN_XSUM_LIMBS; k++) l12[k] = l1[k] + l2[k];
  CHECK(gefen_exact_sum_value(l12) == xsum_of(v, N), "accumulators add limb by limb");
}

/* ------------------------------------------------------ sharding invariance */

/* Statistics of rows [r0, r1) of g (R x S), added into out. */
static void shard_stats(const float *g, int64_t r0, int64_t r1, int64_t S, const int64_t *cands,
                        int64_t n, int nthreads, int64_t *out) {
  gefen_matrix m = {g + r0 * S, GEFEN_F32, r1 - r0, S};
  gefen_error err;
  CHECK(gefen_period_stats(&m, cands, n, out, nthreads, &err) == GEFEN_OK, "%s", err.msg);
}

static void normalise_all(int64_t *stats, int64_t n) {
  for (int64_t k = 0; k < n; k++) (void)gefen_xsum_normalize(stats + k * W);
}

static void test_sharding_invariance(void) {
  enum { R = 9, S = 60 };
  static float g[R * S];
  for (int i = 0; i < R * S; i++)
    g[i] = (float)ldexp(unit() - 0.5, (int)(test_rng() % 40) - 20); /* wide dynamic range */
  int64_t cands[64];
  const int64_t n = gefen_period_candidates(S, R * S, cands, 64);
  static int64_t whole[64 * W], sharded[64 * W];
  memset(whole, 0, sizeof whole);
  shard_stats(g, 0, R, S, cands, n, 1, whole);
  normalise_all(whole, n);
  int64_t p_whole = 0, p = 0;
  gefen_error err;
  gefen_period_choose(S, R * S, 2, cands, n, whole, &p_whole, &err);
  int splits = 0;
  /* every split into two and three shards (empty shards included), thread
   * counts 1..3 */
  for (int a = 0; a <= R; a++)
    for (int b = a; b <= R; b++) {
      memset(sharded, 0, sizeof sharded);
      shard_stats(g, 0, a, S, cands, n, 1 + (a % 3), sharded);
      shard_stats(g, a, b, S, cands, n, 1 + (b % 3), sharded);
      shard_stats(g, b, R, S, cands, n, 2, sharded);
      normalise_all(sharded, n);
      CHECK(memcmp(whole, sharded, (size_t)n * W * sizeof(int64_t)) == 0,
            "shards [0,%d) [%d,%d) [%d,%d) differ from the whole matrix", a, a, b, b, R);
      gefen_period_choose(S, R * S, 2, cands, n, sharded, &p, &err);
      CHECK(p == p_whole, "period %lld of shards vs %lld", (long long)p, (long long)p_whole);
      splits++;
    }
  /* one shard per row, reduced in reverse order */
  memset(sharded, 0, sizeof sharded);
  for (int r = R - 1; r >= 0; r--) shard_stats(g, r, r + 1, S, cands, n, 1, sharded);
  normalise_all(sharded, n);
  CHECK(memcmp(whole, sharded, (size_t)n * W * sizeof(int64_t)) == 0, "row-by-row shards");
  printf("test_period: %d shardings agree (period %lld)\n", splits, (long long)p_whole);
}

int main(void) {
  printf("test_period: candidates\n");
  test_candidates();
  printf("test_period: choice\n");
  test_choice();
  printf("test_period: exact sums\n");
  test_exact_sums();
  printf("test_period: sharding invariance\n");
  test_sharding_invariance();
  if (failures) {
    fprintf(stderr, "test_period: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_period: all passed\n");
  return 0;
}
