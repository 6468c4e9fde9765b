/* AVX-512 + VBMI + BF16 versions of the momentum and requantisation
 * primitives (block_avx512vbmi_kernels.h): those of block_avx512vbmi.c, with
 * float32 values rounded to bfloat16 by vcvtne2ps2bf16 / vcvtneps2bf16 (one
 * instruction for 32 / 16 values instead of eight integer operations per 16)
 * wherever the Adam and Muon sinks write bfloat16 (block_avx512_kernels.h,
 * CVT_BF16). The instruction rounds to nearest even and quietens NaN exactly
 * as gefen_f32_to_bf16 does (checked for all 2^32 inputs on an AMD Zen 4); it
 * flushes float32 subnormal inputs to zero, which gefen_f32_to_bf16 rounds, so
 * a vector holding one goes the integer way. */
#include "block_ops.h"

/* AVX512-BF16 intrinsics: GCC 10 and Clang 9 onwards; older compilers build
 * the stub below and the VBMI table is chosen instead. */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 9) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
/* Scheduled for Zen (GCC's znver3 model, its newest in GCC 11-12): on a Zen 4 VM
 * the fp32 / float16 block updates of the 16.8M set took 6.0 / 4.4% less with two
 * threads (in cache 5-9% / 1-5%), bfloat16 and the factored form unchanged
 * (docs/performance.md, "Scheduled for Zen"). Only the instruction order and
 * selection change, never the results. Intel CPUs with AVX512-BF16 (Sapphire
 * Rapids) run this table too: not measured there. */
#if !defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11
#pragma GCC target("tune=znver3")
#endif
#include "block_avx512_common.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512bf16,gfni")))
#define INLINE TARGET static GEFEN_ALWAYS_INLINE
#define CVT_BF16 1

#include "block_avx512vbmi_kernels.h"

/* The VBMI table's CPU (gefen_block_ops_avx512vbmi initialises the CPU model)
 * with BF16. */
const gefen_block_ops *gefen_block_ops_avx512bf16(void) {
  return gefen_block_ops_avx512vbmi() && __builtin_cpu_supports("avx512bf16") ? &ops_vbmi : NULL;
}

#else /* not x86-64 with GCC >= 10 or Clang >= 9 */

const gefen_block_ops *gefen_block_ops_avx512bf16(void) { return NULL; }

#endif
