/* What the core's C tests share: a CHECK macro that counts failures and a
 * deterministic random number generator. */
#ifndef GEFEN_TEST_CHECK_H
#define GEFEN_TEST_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

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

#endif /* GEFEN_TEST_CHECK_H */
