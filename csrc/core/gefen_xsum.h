/*
 * gefen_xsum.h -- exact sums of non-negative doubles, shared by the C core
 * and the CUDA kernels (header-only, C11 and CUDA C++).
 *
 * Why: the period search (ALGORITHM.md §2) compares square roots of sums of
 * block variances. A float64 sum depends on the order of its terms, so a
 * sharded run (rows split over ranks, partials all-reduced) could pick a
 * different period than one process on a near-tie. Summing exactly makes the
 * result independent of order, threads, shards and devices by construction.
 *
 * How: every finite double x >= 0 is an integer multiple of 2^-1074, and
 * x < 2^1024, so it is a 2098-bit fixed-point number. An accumulator holds
 * that number as GEFEN_XSUM_LIMBS int64 limbs; limb k carries the digit of
 * weight 2^(32k - 1074). Adding x adds its (at most 53 significant) bits as
 * three pieces below 2^33 to three consecutive limbs; limbs are never
 * negative, so an int64 limb takes 2^30 additions before it could overflow.
 * Accumulators add limb by limb (an integer all-reduce with SUM is exact),
 * and gefen_xsum_normalize() propagates carries so that every limb is a
 * 32-bit digit again. gefen_xsum_value() rounds the exact sum once to the
 * nearest double (ties to even), which is what Python's math.fsum returns.
 */
#ifndef GEFEN_XSUM_H
#define GEFEN_XSUM_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gefen_core.h"

#ifdef __CUDACC__
#define GEFEN_XSUM_FN static inline __host__ __device__
#else
#define GEFEN_XSUM_FN static inline
#endif

/* Additions an accumulator takes between two normalisations. */
#define GEFEN_XSUM_SAFE_ADDS (1 << 29)

/* Where x (finite, >= 0) lands: limb index and the three pieces for limbs
 * index, index + 1, index + 2. Returns 0 for x == 0 (nothing to add). */
GEFEN_XSUM_FN int gefen_xsum_split(double x, int *limb, int64_t piece[3]) {
  uint64_t bits;
  memcpy(&bits, &x, sizeof bits);
  const uint64_t biased = (bits >> 52) & 0x7ffu;
  uint64_t mant = bits & ((1ull << 52) - 1u);
  int64_t pos = 0; /* bit position of the mantissa's bit 0 above 2^-1074 */
  if (biased) {
    mant |= 1ull << 52;
    pos = (int64_t)biased - 1;
  }
  if (!mant) return 0;
  const int shift = (int)(pos & 31);
  const uint64_t low = (mant & 0xffffffffu) << shift; /* < 2^63 */
  const uint64_t high = (mant >> 32) << shift;        /* < 2^52 */
  *limb = (int)(pos >> 5);
  piece[0] = (int64_t)(low & 0xffffffffu);
  piece[1] = (int64_t)((low >> 32) + (high & 0xffffffffu));
  piece[2] = (int64_t)(high >> 32);
  return 1;
}

/* Whether x can be summed: finite and not negative (NaN and -0.0 aside:
 * -0.0 adds nothing and is accepted). */
GEFEN_XSUM_FN int gefen_xsum_accepts(double x) {
  return x >= 0.0 && x <= 1.7976931348623157e308;
}

/* Adds x (gefen_xsum_accepts(x) must hold) to limbs[GEFEN_XSUM_LIMBS]. */
GEFEN_XSUM_FN void gefen_xsum_add(int64_t *limbs, double x) {
  int k;
  int64_t piece[3];
  if (!gefen_xsum_split(x, &k, piece)) return;
  limbs[k] += piece[0];
  limbs[k + 1] += piece[1];
  limbs[k + 2] += piece[2];
}

/* Propagates carries so that every limb but the last is in [0, 2^32).
 * Returns 0 when the value fits the accumulator, -1 when it exceeds it
 * (then the value is infinite). Limbs must be non-negative. */
GEFEN_XSUM_FN int gefen_xsum_normalize(int64_t *limbs) {
  int64_t carry = 0;
  for (int k = 0; k < GEFEN_XSUM_LIMBS; k++) {
    const int64_t v = limbs[k] + carry;
    limbs[k] = v & 0xffffffff;
    carry = v >> 32;
  }
  return carry ? -1 : 0;
}

/* Bit i (0 = weight 2^-1074) of a normalised accumulator. */
GEFEN_XSUM_FN int gefen_xsum_bit(const int64_t *limbs, int64_t i) {
  return (int)((limbs[i >> 5] >> (i & 31)) & 1);
}

/* The exact sum held by limbs, rounded once to the nearest double (ties to
 * even); +inf when it exceeds the largest double. Normalises a copy. */
GEFEN_XSUM_FN double gefen_xsum_value(const int64_t *in) {
  int64_t limbs[GEFEN_XSUM_LIMBS];
  for (int k = 0; k < GEFEN_XSUM_LIMBS; k++) limbs[k] = in[k];
  if (gefen_xsum_normalize(limbs) != 0) return HUGE_VAL;
  int top = GEFEN_XSUM_LIMBS - 1;
  while (top >= 0 && limbs[top] == 0) top--;
  if (top < 0) return 0.0;
  int64_t h = (int64_t)top * 32 + 31; /* the highest set bit */
  while (!gefen_xsum_bit(limbs, h)) h--;
  /* the 53 bits from h down (fewer when h < 52), the round bit below them
   * and whether anything below that is set */
  const int64_t low = h >= 52 ? h - 52 : 0;
  uint64_t m = 0;
  for (int64_t i = h; i >= low; i--) m = (m << 1) | (uint64_t)gefen_xsum_bit(limbs, i);
  if (low > 0) {
    const int round = gefen_xsum_bit(limbs, low - 1);
    int sticky = 0;
    if (low >= 2) {
      const int64_t i0 = low - 2; /* bits 0 .. i0 */
      const int64_t L = i0 >> 5;
      sticky = (limbs[L] & (int64_t)((2ull << (i0 & 31)) - 1u)) != 0;
      for (int64_t k = 0; k < L && !sticky; k++) sticky = limbs[k] != 0;
    }
    if (round && (sticky || (m & 1u))) m++; /* m may become 2^53: still exact */
  }
  /* m * 2^(low - 1074) is representable (its lowest bit weighs at least
   * 2^-1074), so ldexp is exact; beyond the largest double it gives +inf */
  return ldexp((double)m, (int)(low - 1074));
}

#endif /* GEFEN_XSUM_H */
