/* What the core's C tests share: a CHECK macro that counts failures, a
 * deterministic random number generator with uniform and normal floats, and
 * the SIMD versions of the block primitives this CPU has. */
#ifndef GEFEN_TEST_CHECK_H
#define GEFEN_TEST_CHECK_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "block_ops.h"

static int failures = 0;
#define CHECK(cond, ...)                                     \
  do {                                                       \
    if (!(cond)) {                                           \
      failures++;                                            \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);   \
      fprintf(stderr, __VA_ARGS__);                          \
      fprintf(stderr, "\n");                                 \
      if (failures > 20) exit(1);                            \
    }                                                        \
  } while (0)

/* xorshift64*: deterministic test data. */
static uint64_t test_rng_state = 0x243F6A8885A308D3ull;
static inline uint64_t test_rng(void) {
  test_rng_state ^= test_rng_state >> 12;
  test_rng_state ^= test_rng_state << 25;
  test_rng_state ^= test_rng_state >> 27;
  return test_rng_state * 0x2545F4914F6CDD1Dull;
}

static inline float test_uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)((test_rng() >> 40) * (1.0 / 16777216.0));
}
static inline float test_normal(void) {
  float u = test_uniform(1e-7f, 1.0f), v = test_uniform(0.0f, 1.0f);
  return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

/* The SIMD versions of the block primitives this CPU has, with their names
 * (most capable first): at most TEST_SIMD_MAX of them. */
#define TEST_SIMD_MAX 4
static inline int test_simd_tables(const gefen_block_ops **ops, const char **names) {
  int n = 0;
  if (gefen_block_ops_avx512bf16()) {
    ops[n] = gefen_block_ops_avx512bf16();
    names[n++] = "avx512bf16";
  }
  if (gefen_block_ops_avx512vbmi()) {
    ops[n] = gefen_block_ops_avx512vbmi();
    names[n++] = "avx512vbmi";
  }
  if (gefen_block_ops_avx512()) {
    ops[n] = gefen_block_ops_avx512();
    names[n++] = "avx512";
  }
  if (gefen_block_ops_avx2()) {
    ops[n] = gefen_block_ops_avx2();
    names[n++] = "avx2";
  }
  return n;
}

#endif /* GEFEN_TEST_CHECK_H */
