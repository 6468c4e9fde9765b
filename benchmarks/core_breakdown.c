/* Where the time of a Gefen step goes on this CPU: each block primitive of the C core
 * timed alone (ns per element), in cache (a few blocks) and out of cache (64M elements),
 * for the AVX-512, AVX2 and portable versions (the SIMD ones where this CPU has them).
 *   bash benchmarks/core_breakdown.sh */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "block_ops.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void run(const char *label, const gefen_block_ops *ops, int64_t n, int64_t P) {
  float *g = malloc((size_t)n * 4), *p = malloc((size_t)n * 4), *m = malloc((size_t)P * 4),
        *scol = malloc((size_t)P * 4);
  uint8_t *codes = malloc((size_t)n);
  double *colsum = calloc((size_t)P, 8);
  srand(1);
  for (int64_t i = 0; i < n; i++) {
    g[i] = (float)(rand() % 2001 - 1000) / 1000.0f;
    p[i] = 1.0f;
    codes[i] = (uint8_t)(rand() & 255);
  }
  for (int64_t j = 0; j < P; j++) scol[j] = 0.5f;
  int64_t hist[GEFEN_HIST_BINS];
  for (int i = 0; i < GEFEN_HIST_BINS; i++)
    hist[i] = 1 + (int64_t)(1000 * exp(-((i - 2048) / 400.0) * ((i - 2048) / 400.0)));
  float cb[GEFEN_CODEBOOK_SIZE];
  gefen_error err;
  gefen_quantizer *q = NULL;
  if (gefen_codebook_solve(hist, cb, &err) != GEFEN_OK ||
      gefen_quantizer_create(cb, &q, &err) != GEFEN_OK) {
    fprintf(stderr, "setup failed: %s\n", err.msg);
    exit(1);
  }
  const int64_t nblk = n / P;
  const int reps = (int)(n < (1 << 22) ? (1 << 26) / n : 3);
  double t_m = 0, t_q = 0, t_a = 0, t_f = 0, t_r = 0, sq;
  for (int r = 0; r < reps; r++) {
    for (int64_t b = 0; b < nblk; b++) {
      const int64_t base = b * P;
      double t0 = now();
      float mx = ops->adam_momentum(g, GEFEN_F32, base, codes + base, cb, 0.5f, 0.9f, 0.1f, P,
                                    m, &sq);
      double t1 = now();
      ops->requantize(q, m, mx, P, codes + base);
      double t2 = now();
      ops->apply_block(p, GEFEN_F32, base, m, P, 0.1f, 0.999f, 1e-6f);
      double t3 = now();
      ops->apply_factored(p, GEFEN_F32, base, m, P, 0.3f, scol, 1.0f, 1e-8f, 0.999f, 1e-6f);
      double t4 = now();
      ops->row_stats(g, GEFEN_F32, base, P, colsum);
      double t5 = now();
      t_m += t1 - t0;
      t_q += t2 - t1;
      t_a += t3 - t2;
      t_f += t4 - t3;
      t_r += t5 - t4;
    }
  }
  const double e = 1e9 / ((double)reps * (double)nblk * (double)P);
  printf("%-9s %-10s n=%-9lld momentum %.3f  requantize %.3f  apply(block) %.3f  "
         "apply(factored) %.3f  row_stats %.3f  ns/element\n",
         label, n <= (1 << 16) ? "in-cache" : "in-memory", (long long)n, t_m * e, t_q * e,
         t_a * e, t_f * e, t_r * e);
  gefen_quantizer_destroy(q);
  free(g);
  free(p);
  free(m);
  free(scol);
  free(codes);
  free(colsum);
}

int main(void) {
  const int64_t P = 2048;
  const gefen_block_ops *avx512 = gefen_block_ops_avx512(), *avx2 = gefen_block_ops_avx2();
  for (int pass = 0; pass < 2; pass++) {
    const int64_t n = pass == 0 ? 8 * P : (int64_t)1 << 26;
    if (avx512) run("avx512", avx512, n, P);
    if (avx2) run("avx2", avx2, n, P);
    run("portable", &gefen_block_ops_scalar, n, P);
  }
  return 0;
}
