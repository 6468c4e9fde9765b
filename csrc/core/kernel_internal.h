/* Work splitting shared by the element kernels. */
#ifndef GEFEN_KERNEL_INTERNAL_H
#define GEFEN_KERNEL_INTERNAL_H

#include "core_internal.h"

#if defined(__GNUC__)
#define GEFEN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define GEFEN_ALWAYS_INLINE inline
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

/* Bit `bit` of ECX from CPUID leaf `leaf` (sub-leaf 0), for the features that
 * some compilers' __builtin_cpu_supports does not know: GFNI (older GCC) and
 * F16C (Clang 16 refuses the name at compile time). */
static inline int gefen_cpuid_ecx_bit(unsigned leaf, unsigned bit) {
  unsigned a, b, c, d;
  return __get_cpuid_count(leaf, 0, &a, &b, &c, &d) && (c >> bit & 1u);
}
#endif

/* About this many elements per chunk: large enough to amortise scheduling,
 * small enough to balance threads over a group of parameters. */
#define GEFEN_CHUNK_ELEMS 32768

/* Units [begin, end) of item `item`: blocks or rows, as the kernel defines. */
typedef struct {
  int64_t item, begin, end;
} gefen_work;

typedef struct {
  gefen_work *items;
  int64_t count;
} gefen_work_list;

/* Reports how many units item i has and how many elements each holds. */
typedef void (*gefen_units_fn)(const void *items, int64_t i, int64_t *units,
                               int64_t *unit_len);

/* Splits every item's units into chunks of about GEFEN_CHUNK_ELEMS elements
 * (at least one unit each). Allocates wl->items; free with gefen_work_free. */
gefen_status gefen_work_plan(gefen_work_list *wl, const void *items, int64_t n,
                             gefen_units_fn units_of, gefen_error *err);
void gefen_work_free(gefen_work_list *wl);

#endif /* GEFEN_KERNEL_INTERNAL_H */
