/* AVX-512 + VBMI (+ GFNI) versions of the momentum and requantisation
 * primitives (block_avx512vbmi_kernels.h): codebook values by byte permutes, no
 * gather; the search's reversed bits put back in order by one GFNI affine. */
#include "block_ops.h"
#include "quantizer_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "block_avx512_common.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,gfni")))
#define INLINE TARGET static GEFEN_ALWAYS_INLINE
#define CVT_BF16 0

#include "block_avx512vbmi_kernels.h"

static int cpu_has_avx512vbmi(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vbmi") &&
         gefen_cpuid_ecx_bit(7, 8); /* GFNI: every CPU with VBMI has it but Cannon Lake
                                       (and a VM that hides it) */
}

const gefen_block_ops *gefen_block_ops_avx512vbmi(void) {
  return cpu_has_avx512vbmi() ? &ops_vbmi : NULL;
}

/* Measured (docs/performance.md): with the key search the fused block pass
 * in cache was 14-15% faster on an AMD Zen 4, and 2-6% slower on an Intel
 * Sapphire Rapids, whose whole 16.8M step (two threads) it slowed by 5-14%. */
int gefen_cpu_prefers_key_search(void) {
  return cpu_has_avx512vbmi() && __builtin_cpu_is("amd");
}

#else /* not x86-64 with GCC/Clang */

const gefen_block_ops *gefen_block_ops_avx512vbmi(void) { return NULL; }
int gefen_cpu_prefers_key_search(void) { return 0; }

#endif
