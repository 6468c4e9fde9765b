/* What one 512-bit instruction costs on this CPU: throughput of eight independent
 * instructions (cycles per instruction), and the latency of a permute and of one level
 * of the 16-bit key search (permute, compare into a mask, masked add), in cycles of
 * this CPU's clock measured as search_ports does (vpermps zmm, eight at a time: one
 * per cycle on the CPUs measured, Sapphire Rapids and Zen 4). Inputs are normal
 * floats (a subnormal one made vdivps about three quarters slower on Zen 4). The
 * numbers behind docs/performance.md, "The key search's chains" and (the float64
 * additions and conversions of the factored statistics) "The factored form's extra
 * cost, taken apart" and "Fixed keys, and float16 squares by multiply-adds" (their
 * 256-bit forms). Written in assembly
 * so that the counts do not depend on the compiler.
 *
 *   gcc -O2 benchmarks/zmm_costs.c -o zmm_costs && ./zmm_costs [iterations]
 *
 * Prints a line and exits 0 on a CPU without AVX-512 BW and VBMI, or on a compiler or
 * machine other than GCC/Clang on x86-64. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>

#include "bench_clock.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

/* Eight copies of one instruction on independent registers (inputs zmm1-zmm9, outputs
 * zmm10-zmm17, masks k1-k7), n times; seconds per instruction. */
#define EIGHT(I) I(2, 10, 1) I(3, 11, 2) I(4, 12, 3) I(5, 13, 4) I(6, 14, 5) I(7, 15, 6) I(8, 16, 7) I(9, 17, 1)
/* The same for two instructions interleaved, eight of each: a pair's cycles per
 * instruction near the slower one's alone means they issue side by side, near the sum
 * of the two that they share a pipe. */
#define EIGHT2(I, J) I(2, 10, 1) J(2, 10, 1) I(3, 11, 2) J(3, 11, 2) I(4, 12, 3) J(4, 12, 3) \
  I(5, 13, 4) J(5, 13, 4) I(6, 14, 5) J(6, 14, 5) I(7, 15, 6) J(7, 15, 6) I(8, 16, 7) J(8, 16, 7) \
  I(9, 17, 1) J(9, 17, 1)
#define STR(x) #x
#define RUN(NAME, BODY)                                                                   \
  __attribute__((noinline, target("avx512f,avx512bw,avx512vbmi"))) static double NAME(    \
      long n) {                                                                           \
    const double t0 = now();                                                              \
    __asm__ volatile(                                                                     \
        "vpternlogd $0xff, %%zmm1, %%zmm1, %%zmm1\n\t"                                    \
        "vpsrld $2, %%zmm1, %%zmm1\n\t" /* 0x3fffffff: 2 - 2^-23, a normal float */ \
        "vmovdqa64 %%zmm1, %%zmm2\n\tvmovdqa64 %%zmm1, %%zmm3\n\t"                        \
        "vmovdqa64 %%zmm1, %%zmm4\n\tvmovdqa64 %%zmm1, %%zmm5\n\t"                        \
        "vmovdqa64 %%zmm1, %%zmm6\n\tvmovdqa64 %%zmm1, %%zmm7\n\t"                        \
        "vmovdqa64 %%zmm1, %%zmm8\n\tvmovdqa64 %%zmm1, %%zmm9\n\t"                        \
        "1:\n\t" BODY "dec %0\n\tjnz 1b"                                                  \
        : "+r"(n)                                                                         \
        :                                                                                 \
        : "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
          "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "k1", "k2", "k3", \
          "k4", "k5", "k6", "k7", "cc");                                                        \
    return now() - t0;                                                                    \
  }

#define I_PERMPS(a, d, k) "vpermps %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_PERMW(a, d, k) "vpermw %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_PERMB(a, d, k) "vpermb %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_PERMT2W(a, d, k) "vmovdqa64 %%zmm1, %%zmm" STR(d) "\n\tvpermt2w %%zmm" STR(a) ", %%zmm2, %%zmm" STR(d) "\n\t"
#define I_PERMT2B(a, d, k) "vmovdqa64 %%zmm1, %%zmm" STR(d) "\n\tvpermt2b %%zmm" STR(a) ", %%zmm2, %%zmm" STR(d) "\n\t"
#define I_CMPW(a, d, k) "vpcmpgtw %%zmm1, %%zmm" STR(a) ", %%k" STR(k) "\n\t"
#define I_MADDW(a, d, k) "vpaddw %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "%{%%k" STR(k) "%}\n\t"
#define I_MULPS(a, d, k) "vmulps %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_ADDPS(a, d, k) "vaddps %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_DIVPS(a, d, k) "vdivps %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_SQRTPS(a, d, k) "vsqrtps %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_CVTPS2PH(a, d, k) "vcvtps2ph $4, %%zmm" STR(a) ", %%ymm" STR(d) "\n\t"
#define I_CVTPH2PS(a, d, k) "vcvtph2ps %%ymm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_CVTPS2PD(a, d, k) "vcvtps2pd %%ymm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_PSLLD(a, d, k) "vpslld $13, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_PANDD(a, d, k) "vpandd %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_TERNLOG(a, d, k) "vmovdqa64 %%zmm1, %%zmm" STR(d) "\n\tvpternlogd $0xf8, %%zmm2, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_BLENDW(a, d, k) "vpblendmw %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "%{%%k" STR(k) "%}\n\t"
#define I_ANDPS(a, d, k) "vandps %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
/* the factored statistics' operations (float64 sums of squares): an addition, the
 * same as a fused multiply-add by 1.0 (accumulating: eight chains), the high half's
 * extraction */
#define I_ADDPD(a, d, k) "vaddpd %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_FMAPD(a, d, k) "vfmadd231pd %%zmm1, %%zmm" STR(a) ", %%zmm" STR(d) "\n\t"
#define I_EXTR(a, d, k) "vextractf64x4 $1, %%zmm" STR(a) ", %%ymm" STR(d) "\n\t"
/* the same conversions in 256 bits, and the insertion that would put two halves back */
#define I_CVTPH2PS_Y(a, d, k) "vcvtph2ps %%xmm" STR(a) ", %%ymm" STR(d) "\n\t"
#define I_CVTPS2PH_Y(a, d, k) "vcvtps2ph $4, %%ymm" STR(a) ", %%xmm" STR(d) "\n\t"
#define I_CVTPS2PD_Y(a, d, k) "vcvtps2pd %%xmm" STR(a) ", %%ymm" STR(d) "\n\t"
#define I_ADDPD_Y(a, d, k) "vaddpd %%ymm1, %%ymm" STR(a) ", %%ymm" STR(d) "\n\t"
#define I_INS(a, d, k) "vinsertf64x4 $1, %%ymm" STR(a) ", %%zmm1, %%zmm" STR(d) "\n\t"
/* a level of the key search, its three instructions on the eight chains' registers */
#define I_LEVEL(a, d, k) I_PERMW(a, d, k) "vpcmpgtw %%zmm1, %%zmm" STR(d) ", %%k" STR(k) "\n\t" \
  "vpaddw %%zmm1, %%zmm" STR(a) ", %%zmm" STR(a) "%{%%k" STR(k) "%}\n\t"

/* Each throughput measured: its function, body, name in the table and instructions
 * per iteration (8 alone, 16 for pairs). */
#define THROUGHPUTS(X) \
  X(t_permps, EIGHT(I_PERMPS), "vpermps", 8) \
  X(t_permw, EIGHT(I_PERMW), "vpermw", 8) \
  X(t_permb, EIGHT(I_PERMB), "vpermb", 8) \
  X(t_permt2w, EIGHT(I_PERMT2W), "vpermt2w (+ a copy)", 8) \
  X(t_permt2b, EIGHT(I_PERMT2B), "vpermt2b (+ a copy)", 8) \
  X(t_cmpw, EIGHT(I_CMPW), "vpcmpgtw into a mask", 8) \
  X(t_maddw, EIGHT(I_MADDW), "vpaddw masked", 8) \
  X(t_mulps, EIGHT(I_MULPS), "vmulps", 8) \
  X(t_addps, EIGHT(I_ADDPS), "vaddps", 8) \
  X(t_divps, EIGHT(I_DIVPS), "vdivps", 8) \
  X(t_sqrtps, EIGHT(I_SQRTPS), "vsqrtps", 8) \
  X(t_cvtps2ph, EIGHT(I_CVTPS2PH), "vcvtps2ph", 8) \
  X(t_cvtph2ps, EIGHT(I_CVTPH2PS), "vcvtph2ps", 8) \
  X(t_cvtps2pd, EIGHT(I_CVTPS2PD), "vcvtps2pd", 8) \
  X(t_permw_mulps, EIGHT2(I_PERMW, I_MULPS), "pairs: vpermw + vmulps", 16) \
  X(t_permw_addps, EIGHT2(I_PERMW, I_ADDPS), "pairs: vpermw + vaddps", 16) \
  X(t_mulps_addps, EIGHT2(I_MULPS, I_ADDPS), "pairs: vmulps + vaddps", 16) \
  X(t_permw_cvtps2pd, EIGHT2(I_PERMW, I_CVTPS2PD), "pairs: vpermw + vcvtps2pd", 16) \
  X(t_addps_cvtps2pd, EIGHT2(I_ADDPS, I_CVTPS2PD), "pairs: vaddps + vcvtps2pd", 16) \
  X(t_pslld, EIGHT(I_PSLLD), "vpslld", 8) \
  X(t_pandd, EIGHT(I_PANDD), "vpandd", 8) \
  X(t_ternlog, EIGHT(I_TERNLOG), "vpternlogd (+ a copy)", 8) \
  X(t_andps, EIGHT(I_ANDPS), "vandps", 8) \
  X(t_mulps_andps, EIGHT2(I_MULPS, I_ANDPS), "pairs: vmulps + vandps", 16) \
  X(t_addps_andps, EIGHT2(I_ADDPS, I_ANDPS), "pairs: vaddps + vandps", 16) \
  X(t_permw_andps, EIGHT2(I_PERMW, I_ANDPS), "pairs: vpermw + vandps", 16) \
  X(t_mulps_pandd, EIGHT2(I_MULPS, I_PANDD), "pairs: vmulps + vpandd", 16) \
  X(t_addps_pandd, EIGHT2(I_ADDPS, I_PANDD), "pairs: vaddps + vpandd", 16) \
  X(t_blendw, EIGHT(I_BLENDW), "vpblendmw", 8) \
  X(t_permw_blendw, EIGHT2(I_PERMW, I_BLENDW), "pairs: vpermw + vpblendmw", 16) \
  X(t_mulps_blendw, EIGHT2(I_MULPS, I_BLENDW), "pairs: vmulps + vpblendmw", 16) \
  X(t_addps_blendw, EIGHT2(I_ADDPS, I_BLENDW), "pairs: vaddps + vpblendmw", 16) \
  X(t_permw_cvtph2ps, EIGHT2(I_PERMW, I_CVTPH2PS), "pairs: vpermw + vcvtph2ps", 16) \
  X(t_permw_cvtps2ph, EIGHT2(I_PERMW, I_CVTPS2PH), "pairs: vpermw + vcvtps2ph", 16) \
  X(t_permw_pslld, EIGHT2(I_PERMW, I_PSLLD), "pairs: vpermw + vpslld", 16) \
  X(t_permw_pandd, EIGHT2(I_PERMW, I_PANDD), "pairs: vpermw + vpandd", 16) \
  X(t_mulps_pslld, EIGHT2(I_MULPS, I_PSLLD), "pairs: vmulps + vpslld", 16) \
  X(t_addps_pslld, EIGHT2(I_ADDPS, I_PSLLD), "pairs: vaddps + vpslld", 16) \
  X(t_addpd, EIGHT(I_ADDPD), "vaddpd", 8) \
  X(t_fmapd, EIGHT(I_FMAPD), "vfmadd231pd (8 chains)", 8) \
  X(t_extr, EIGHT(I_EXTR), "vextractf64x4", 8) \
  X(t_addpd_fmapd, EIGHT2(I_ADDPD, I_FMAPD), "pairs: vaddpd + vfmadd231pd", 16) \
  X(t_addpd_cvtps2pd, EIGHT2(I_ADDPD, I_CVTPS2PD), "pairs: vaddpd + vcvtps2pd", 16) \
  X(t_fmapd_cvtps2pd, EIGHT2(I_FMAPD, I_CVTPS2PD), "pairs: vfmadd231pd + vcvtps2pd", 16) \
  X(t_mulps_cvtps2pd, EIGHT2(I_MULPS, I_CVTPS2PD), "pairs: vmulps + vcvtps2pd", 16) \
  X(t_addpd_cvtph2ps, EIGHT2(I_ADDPD, I_CVTPH2PS), "pairs: vaddpd + vcvtph2ps", 16) \
  X(t_fmapd_cvtph2ps, EIGHT2(I_FMAPD, I_CVTPH2PS), "pairs: vfmadd231pd + vcvtph2ps", 16) \
  X(t_addpd_extr, EIGHT2(I_ADDPD, I_EXTR), "pairs: vaddpd + vextractf64x4", 16) \
  X(t_cvtps2pd_extr, EIGHT2(I_CVTPS2PD, I_EXTR), "pairs: vcvtps2pd + vextractf64x4", 16) \
  X(t_cvtps2pd_cvtph2ps, EIGHT2(I_CVTPS2PD, I_CVTPH2PS), "pairs: vcvtps2pd + vcvtph2ps", 16) \
  X(t_cvtph2ps_y, EIGHT(I_CVTPH2PS_Y), "vcvtph2ps ymm (8 values)", 8) \
  X(t_cvtps2ph_y, EIGHT(I_CVTPS2PH_Y), "vcvtps2ph ymm (8 values)", 8) \
  X(t_ins, EIGHT(I_INS), "vinsertf64x4", 8) \
  X(t_addpd_cvtph2ps_y, EIGHT2(I_ADDPD, I_CVTPH2PS_Y), "pairs: vaddpd + vcvtph2ps ymm", 16) \
  X(t_ins_cvtps2pd, EIGHT2(I_INS, I_CVTPS2PD), "pairs: vinsertf64x4 + vcvtps2pd", 16) \
  X(t_cvtps2pd_y, EIGHT(I_CVTPS2PD_Y), "vcvtps2pd ymm (4 values)", 8) \
  X(t_addpd_y, EIGHT(I_ADDPD_Y), "vaddpd ymm", 8) \
  X(t_addpd_y_cvtps2pd_y, EIGHT2(I_ADDPD_Y, I_CVTPS2PD_Y), "pairs: vaddpd + vcvtps2pd, ymm", 16)
#define DEFINE_RUN(NAME, BODY, LABEL, PER) RUN(NAME, BODY)
THROUGHPUTS(DEFINE_RUN)
#undef DEFINE_RUN
/* chains: the output is the next input */
RUN(l_permw, "vpermw %%zmm1, %%zmm2, %%zmm2\n\t")
RUN(l_level, "vpermw %%zmm1, %%zmm2, %%zmm10\n\tvpcmpgtw %%zmm10, %%zmm3, %%k1\n\t"
             "vpaddw %%zmm1, %%zmm2, %%zmm2%{%%k1%}\n\t")
RUN(l_levels8, EIGHT(I_LEVEL))

typedef double (*timed)(long);

/* The best of reps runs of f(n), seconds per unit (n x per units a run). */
static double best(timed f, long n, int per, int reps) {
  double b = 1e30;
  for (int r = 0; r < reps; r++) {
    const double t = f(n);
    b = t < b ? t : b;
  }
  return b / ((double)n * per);
}

int main(int argc, char **argv) {
  const long n = argc > 1 ? atol(argv[1]) : 2000000;
  __builtin_cpu_init();
  if (n < 1 || !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vbmi")) {
    printf("zmm_costs: this CPU has no AVX-512 BW with VBMI; nothing to measure\n");
    return 0;
  }
  const double cycle = best(t_permps, n, 8, 5);
  printf("one cycle (vpermps zmm, 8 independent): %.4f ns (%.2f GHz)\n", cycle * 1e9, 1e-9 / cycle);
  const struct { const char *name; timed f; int per; } tp[] = {
#define ENTRY(NAME, BODY, LABEL, PER) {LABEL, NAME, PER},
      THROUGHPUTS(ENTRY)
#undef ENTRY
  };
  printf("throughput, cycles per instruction (8 independent, zmm):\n");
  for (size_t i = 0; i < sizeof tp / sizeof tp[0]; i++)
    printf("  %-28s %6.2f\n", tp[i].name, best(tp[i].f, n, tp[i].per, 5) / cycle);
  printf("latency, cycles:\n");
  printf("  %-28s %6.2f\n", "vpermw (index to result)", best(l_permw, n, 1, 5) / cycle);
  printf("  %-28s %6.2f\n", "key search level", best(l_level, n, 1, 5) / cycle);
  printf("key search level, 8 chains: %.2f cycles per level and 32 keys\n",
         best(l_levels8, n, 8, 5) / cycle);
  return 0;
}

#else

int main(void) {
  printf("zmm_costs: built for another machine or compiler; nothing to measure\n");
  return 0;
}

#endif
