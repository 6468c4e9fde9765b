/* The quantiser the C benchmarks share: the codebook learned (gefen_codebook_solve)
 * from a bell-shaped histogram of normalised values, `width` bins wide, like a
 * gradient's. Returns NULL after printing why when it cannot be made. */
#ifndef GEFEN_BENCH_CODEBOOK_H
#define GEFEN_BENCH_CODEBOOK_H

#include <math.h>
#include <stdio.h>

#include "gefen_core.h"

static inline gefen_quantizer *bench_quantizer(double width) {
  int64_t hist[GEFEN_HIST_BINS];
  for (int i = 0; i < GEFEN_HIST_BINS; i++)
    hist[i] = 1 + (int64_t)(1000 * exp(-((i - 2048) / width) * ((i - 2048) / width)));
  float cb[GEFEN_CODEBOOK_SIZE];
  gefen_error err;
  gefen_quantizer *q = NULL;
  if (gefen_codebook_solve(hist, cb, &err) != GEFEN_OK ||
      gefen_quantizer_create(cb, &q, &err) != GEFEN_OK) {
    fprintf(stderr, "setup failed: %s\n", err.msg);
    return NULL;
  }
  return q;
}

#endif
