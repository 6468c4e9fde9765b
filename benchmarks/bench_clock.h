/* What the C benchmarks share: a monotonic clock in seconds and the median of a
 * sample. The including file defines _POSIX_C_SOURCE (199309L or later, or
 * _DEFAULT_SOURCE) before its first system header, for clock_gettime. */
#ifndef GEFEN_BENCH_CLOCK_H
#define GEFEN_BENCH_CLOCK_H

#include <stdlib.h>
#include <time.h>

static inline double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median of v[0..n) (sorts v). */
static inline double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#endif
