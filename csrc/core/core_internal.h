/* Internal helpers shared by the core's translation units. Not installed. */
#ifndef GEFEN_CORE_INTERNAL_H
#define GEFEN_CORE_INTERNAL_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "gefen_core.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Writes a formatted message into err (when err is not NULL) and returns
 * status, so a check reads: if (bad) return gefen_fail(err, GEFEN_EVALUE, ...). */
gefen_status gefen_fail(gefen_error *err, gefen_status status, const char *fmt,
                        ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* The same, naming the offending item of a list call in err->item. */
gefen_status gefen_fail_item(gefen_error *err, gefen_status status, int64_t item,
                             const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* Clears err to the empty message and no item. */
static inline void gefen_clear(gefen_error *err) {
  if (err) {
    err->msg[0] = '\0';
    err->item = -1;
  }
}

/* The checks every element kernel makes on an item's layout: a known dtype,
 * a non-negative shape whose size fits int64, a period that divides cols. */
gefen_status gefen_check_layout(gefen_dtype dtype, int64_t rows, int64_t cols, int64_t period,
                                int64_t item, gefen_error *err);

/* The number of threads to use for a call: nthreads > 0 as given, else the
 * OpenMP default (1 without OpenMP). */
int gefen_threads(int nthreads);

/* ------------------------------------------------ scalar dtype conversion */

static inline float gefen_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Round to nearest even; NaN stays a quiet NaN. */
static inline uint16_t gefen_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float gefen_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: normalise */
      int e = -1;
      do {
        man <<= 1;
        e++;
      } while ((man & 0x400u) == 0);
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Round to nearest even, overflow to inf, NaN to a quiet NaN. */
static inline uint16_t gefen_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
  if (a < 0x38800000u) {                                  /* subnormal or zero */
    if (a < 0x33000000u) return sign;                     /* below half the smallest subnormal */
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14 .. 24 */
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = a - 0x38000000u; /* rebias exponent 127 -> 15 */
  r += 0x0fffu + ((r >> 13) & 1u);
  return (uint16_t)(sign | (r >> 13));
}

/* Element i of a typed buffer as float / stored from float. */
static inline float gefen_load(const void *p, gefen_dtype dt, int64_t i) {
  switch (dt) {
    case GEFEN_F32: return ((const float *)p)[i];
    case GEFEN_BF16: return gefen_bf16_to_f32(((const uint16_t *)p)[i]);
    case GEFEN_F16: return gefen_f16_to_f32(((const uint16_t *)p)[i]);
    case GEFEN_F64: return (float)((const double *)p)[i];
  }
  return 0.0f;
}

#endif /* GEFEN_CORE_INTERNAL_H */
