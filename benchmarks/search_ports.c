/* The requantisation's inner loop counted in cycles of the shuffle port (port 5 on
 * Intel): is it bound by that port's throughput, or by something else (latency, the
 * out-of-order window, memory)? docs/performance.md, "Port 5 accounted".
 *
 * One thread, the VBMI kernels' own inline functions (block_avx512vbmi_kernels.h) on
 * 2048 values in L1, the thresholds scaled by the block's magnitude as the kernels
 * scale them. A cycle of port 5 is measured first, in the same process: eight
 * independent chains of vpermps zmm, which issue only there, one per cycle. Each
 * stage's time per 64 values is then given in those cycles, to be set beside the
 * number of port-5 instructions in its compiled loop (objdump -d), e.g. with GCC 12
 * -O3: the search 44 float permutes + 32 compares into masks; the codes stored 3
 * packs + 1 vpermd; the values formed 8 byte permutes (two cycles each) + 8 unpacks.
 *
 *   gcc -std=c11 -O3 -ffp-contract=off -fopenmp -I csrc/core \
 *       benchmarks/search_ports.c csrc/core/[a-z]*.c -o search_ports -lm
 *   ./search_ports [repetitions]     (default 400; the best repetition counts)
 *
 * Prints a line and exits 0 on a CPU without AVX-512 VBMI and GFNI, or where the
 * compiler cannot build those kernels. */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "block_ops.h"
#include "gefen_core.h"
#include "quantizer_internal.h"
#include "bench_clock.h"
#include "bench_codebook.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "block_avx512_common.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,gfni")))
#define INLINE TARGET static GEFEN_ALWAYS_INLINE
#define CVT_BF16 0

#include "block_avx512vbmi_kernels.h"

enum { N = 2048, CHAINS = 8 };

/* Seconds per vpermps zmm with CHAINS independent chains: one cycle of port 5.
 * Written in assembly so that the count does not depend on the optimisation level. */
TARGET __attribute__((noinline)) static double port5_cycle(const float *seed, const long n) {
  long iters = n;
  const double t0 = now();
  __asm__ volatile(
      "vmovups (%1), %%zmm0\n\t"
      "vmovups %%zmm0, %%zmm1\n\tvmovups %%zmm0, %%zmm2\n\tvmovups %%zmm0, %%zmm3\n\t"
      "vmovups %%zmm0, %%zmm4\n\tvmovups %%zmm0, %%zmm5\n\tvmovups %%zmm0, %%zmm6\n\t"
      "vmovups %%zmm0, %%zmm7\n\tvmovups %%zmm0, %%zmm8\n\t"
      "1:\n\t"
      "vpermps %%zmm1, %%zmm0, %%zmm1\n\tvpermps %%zmm2, %%zmm0, %%zmm2\n\t"
      "vpermps %%zmm3, %%zmm0, %%zmm3\n\tvpermps %%zmm4, %%zmm0, %%zmm4\n\t"
      "vpermps %%zmm5, %%zmm0, %%zmm5\n\tvpermps %%zmm6, %%zmm0, %%zmm6\n\t"
      "vpermps %%zmm7, %%zmm0, %%zmm7\n\tvpermps %%zmm8, %%zmm0, %%zmm8\n\t"
      "dec %0\n\tjnz 1b"
      : "+r"(iters)
      : "r"(seed)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "cc", "memory");
  return (now() - t0) / ((double)CHAINS * (double)n);
}

/* The stages, one pass over N values each. */
TARGET __attribute__((noinline)) static void search_codes(const float *order, const float *m,
                                                          uint8_t *codes) {
  for (int i = 0; i < N; i += 64) {
    __m512 u[4];
    __m512i bits[4];
    for (int v = 0; v < 4; v++) u[v] = _mm512_loadu_ps(m + i + 16 * v);
    search64(order, u, bits);
    store_codes64(NULL, bits, codes + i, ~(__mmask64)0);
  }
}

TARGET __attribute__((noinline)) static void search_values(const gefen_quant_search *s,
                                                           const float *order, float *m,
                                                           uint8_t *codes, float mx) {
  const __m512 vmx = _mm512_set1_ps(mx);
  for (int i = 0; i < N; i += 64) {
    __m512 u[4], c[4];
    __m512i bits[4];
    for (int v = 0; v < 4; v++) u[v] = _mm512_loadu_ps(m + i + 16 * v);
    search64(order, u, bits);
    store_and_decode64(s, bits, codes + i, ~(__mmask64)0, c);
    for (int v = 0; v < 4; v++) _mm512_storeu_ps(m + N + i + 16 * v, _mm512_mul_ps(c[v], vmx));
  }
}

TARGET __attribute__((noinline)) static void decode_values(const gefen_quant_search *s,
                                                           const uint8_t *codes, float *out) {
  for (int i = 0; i < N; i += 64) {
    __m512 c[4];
    decode_codes64(s, codes + i, ~(__mmask64)0, c);
    for (int v = 0; v < 4; v++) _mm512_storeu_ps(out + i + 16 * v, c[v]);
  }
}

/* The counts and ties of the 16-bit key search (all eight levels) for N keys, n vectors
 * of 32 keys per search step: n overlapping chains of (permute, compare into a mask,
 * masked add, the blend that keeps the key above the count). The kernels take
 * 2 x KEY_GROUPS (block_avx512_kernels.h). */
#define KEY_COUNTS(n)                                                                       \
  TARGET __attribute__((noinline)) static void key_counts_##n(                             \
      const key_tables *kt, const __m512i *q, __m512i *j, __mmask32 *tie) {                \
    for (int i = 0; i < N / 32; i += n) key_search(kt, n, q + i, j + i, tie + i, 0);       \
  }
KEY_COUNTS(2)
KEY_COUNTS(4)
KEY_COUNTS(8)
#undef KEY_COUNTS

/* The key tables of the block and the keys of its N values. */
TARGET __attribute__((noinline)) static void key_prepare(const gefen_quant_search *s,
                                                         const float *scaled, float mx,
                                                         const float *m, key_tables *kt,
                                                         __m512i *keys) {
  key_setup(s, scaled, mx, kt, 1);
  const __m512 vr = _mm512_set1_ps(kt->r), vtop = _mm512_set1_ps(kt->top);
  for (int i = 0; i < N / 32; i++)
    keys[i] = _mm512_packs_epi32(key16(_mm512_loadu_ps(m + 32 * i), vr, vtop, 1),
                                 key16(_mm512_loadu_ps(m + 32 * i + 16), vr, vtop, 1));
}

TARGET __attribute__((noinline)) static void scaled_thresholds(const gefen_quant_search *s,
                                                               float mx, float *out) {
  scale_order(s, mx, out);
}

int main(int argc, char **argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 400;
  if (!gefen_block_ops_avx512vbmi()) {
    printf("search_ports: this CPU has no AVX-512 VBMI with GFNI; nothing to measure\n");
    return 0;
  }
  (void)ops_vbmi; /* the table the included kernels define (unused here) */
  gefen_quantizer *q = bench_quantizer(300.0);
  if (!q) return 1;
  float *m = aligned_alloc(64, 2 * N * sizeof(float));
  uint8_t *codes = aligned_alloc(64, N);
  if (!m || !codes) return 1;
  uint64_t x = 0x9E3779B97F4A7C15ull;
  float mx = 0.0f;
  for (int i = 0; i < N; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    m[i] = ((float)(x >> 40) * (1.0f / 16777216.0f) - 0.5f) * ((float)(x & 255) / 64.0f);
    mx = fabsf(m[i]) > mx ? fabsf(m[i]) : mx;
  }
  _Alignas(64) float scaled[GEFEN_SEARCH_ENTRIES];
  scaled_thresholds(&q->search, mx, scaled);
  _Alignas(64) key_tables kt;
  __m512i *keys = aligned_alloc(64, 2 * (N / 32) * sizeof(__m512i)), *counts = keys + N / 32;
  __mmask32 *ties = malloc((N / 32) * sizeof(__mmask32));
  if (!keys || !ties) return 1;
  key_prepare(&q->search, scaled, mx, m, &kt, keys);
  _Alignas(64) float seed[16]; /* the permutes' index: the bits of small floats */
  for (int i = 0; i < 16; i++) seed[i] = 1.0f + (float)i;

  double cycle = 1e9, t_codes = 1e9, t_values = 1e9, t_decode = 1e9, t_keys[3] = {1e9, 1e9, 1e9};
  for (int r = 0; r < reps; r++) { /* interleaved, so that a drift of the clock hits all */
    const double c = port5_cycle(seed, 2000);
    double t0 = now();
    search_codes(scaled, m, codes);
    const double a = now() - t0;
    t0 = now();
    search_values(&q->search, scaled, m, codes, mx);
    const double b = now() - t0;
    t0 = now();
    decode_values(&q->search, codes, m + N);
    const double d = now() - t0;
    for (int k = 0; k < 3; k++) {
      t0 = now();
      if (k == 0) key_counts_2(&kt, keys, counts, ties);
      else if (k == 1) key_counts_4(&kt, keys, counts, ties);
      else key_counts_8(&kt, keys, counts, ties);
      const double e = now() - t0;
      t_keys[k] = e < t_keys[k] ? e : t_keys[k];
    }
    cycle = c < cycle ? c : cycle;
    t_codes = a < t_codes ? a : t_codes;
    t_values = b < t_values ? b : t_values;
    t_decode = d < t_decode ? d : t_decode;
  }
  const double per64 = 64.0 / N / cycle;
  printf("one cycle of port 5 (vpermps zmm, %d chains): %.4f ns (%.2f GHz)\n", CHAINS,
         cycle * 1e9, 1e-9 / cycle);
  printf("per 64 values, in cycles of port 5 (best of %d, %d values in L1, one thread):\n", reps,
         N);
  printf("  search, codes stored                 %6.1f\n", t_codes * per64);
  printf("  search, codes stored, values formed  %6.1f\n", t_values * per64);
  printf("  decode of stored codes               %6.1f\n", t_decode * per64);
  printf("  16-bit key search (counts and ties), 2 / 4 / 8 chains of 32 keys: %.1f / %.1f / %.1f\n",
         t_keys[0] * per64, t_keys[1] * per64, t_keys[2] * per64);
  gefen_quantizer_destroy(q);
  free(m);
  free(codes);
  free(keys);
  free(ties);
  return 0;
}

#else /* not x86-64 with GCC/Clang */

int main(void) {
  printf("search_ports: built without the AVX-512 kernels; nothing to measure\n");
  return 0;
}

#endif
