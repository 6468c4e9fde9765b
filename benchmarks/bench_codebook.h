/* The codebook and quantiser the C benchmarks share: the codebook learned
 * (gefen_codebook_solve) from a bell-shaped histogram of normalised values, `width`
 * bins wide, like a gradient's. Both return failure after printing why. */
#ifndef GEFEN_BENCH_CODEBOOK_H
#define GEFEN_BENCH_CODEBOOK_H

#include <math.h>
#include <stdio.h>

#include "gefen_core.h"

/* The codebook into cb; 0, or -1 when it cannot be learned. */
static inline int bench_codebook(double width, float cb[GEFEN_CODEBOOK_SIZE]) {
  int64_t hist[GEFEN_HIST_BINS];
  for (int i = 0; i < GEFEN_HIST_BINS; i++)
    hist[i] = 1 + (int64_t)(1000 * exp(-((i - 2048) / width) * ((i - 2048) / width)));
  gefen_error err;
  if (gefen_codebook_solve(hist, cb, &err) != GEFEN_OK) {
    fprintf(stderr, "setup failed: %s\n", err.msg);
    return -1;
  }
  return 0;
}

/* A quantiser of that codebook, or NULL. */
static inline gefen_quantizer *bench_quantizer(double width) {
  float cb[GEFEN_CODEBOOK_SIZE];
  gefen_error err;
  gefen_quantizer *q = NULL;
  if (bench_codebook(width, cb) != 0) return NULL;
  if (gefen_quantizer_create(cb, &q, &err) != GEFEN_OK) {
    fprintf(stderr, "setup failed: %s\n", err.msg);
    return NULL;
  }
  return q;
}

#endif
