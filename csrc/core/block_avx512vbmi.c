/* AVX-512 + VBMI versions of the momentum and requantisation primitives
 * (block_avx512vbmi_kernels.h): codebook values by byte permutes, no gather. */
#include "block_ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "block_avx512_common.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")))
#define INLINE TARGET static GEFEN_ALWAYS_INLINE
#define CVT_BF16 0

#include "block_avx512vbmi_kernels.h"

static int cpu_has_avx512vbmi(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vbmi");
}

const gefen_block_ops *gefen_block_ops_avx512vbmi(void) {
  return cpu_has_avx512vbmi() ? &ops_vbmi : NULL;
}

#else /* not x86-64 with GCC/Clang */

const gefen_block_ops *gefen_block_ops_avx512vbmi(void) { return NULL; }

#endif
