/* Where the time of a Gefen step goes on this CPU: each block primitive of the C core
 * timed alone (ns per element, one thread), in cache (a few blocks) and out of cache
 * (64M elements), for every version this CPU has (AVX-512 + VBMI + BF16, AVX-512 + VBMI,
 * AVX-512, AVX2, portable). In cache, each figure is the best of several repetitions, so
 * that a busy machine disturbs it less.
 *
 *   momentum      dequantise, update the momentum, max |m| and (block form) the sum
 *                 of g^2
 *   requantize    nearest codes of m / max|m|, dequantised values back into m
 *   apply         p = p * decay - lr * mq * s (block: one s; factored: s per element)
 *   fused         requantize_apply: the requantisation and the apply in one pass
 *   row_stats     the factored form's first pass (sums of g^2 per row and column)
 *   muon          GefenMuon's momentum and fused requantisation into a bf16 output
 *   bf16 step     a block step (momentum + fused) of bfloat16 gradients and parameters,
 *                 with the momentum between the passes in element order, and packed
 *                 (the VBMI versions' own order: no shuffles for the bf16 loads and
 *                 stores; the other versions ignore the flag, so both columns match)
 *   fp16 step     the same with float16 gradients and parameters (element order)
 *
 * A block step is momentum + fused (or requantize + apply); a factored step adds the
 * row statistics.
 *   bash benchmarks/core_breakdown.sh */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "block_ops.h"
#include "bench_clock.h"
#include "bench_codebook.h"

enum { N_STAGES = 12 };
static const char *stage_names[N_STAGES] = {
    "momentum(block)", "requantize",      "apply(block)", "apply(factored)",
    "fused(block)",    "fused(factored)", "row_stats",    "muon(momentum+fused)",
    "momentum(factored)", "bf16 step",       "bf16 step(packed)", "fp16 step"};

static void run(const char *label, const gefen_block_ops *ops, const gefen_quantizer *q,
                int64_t n, int64_t P) {
  uint16_t *out = malloc((size_t)n * 2), *g16 = malloc((size_t)n * 2),
           *p16 = malloc((size_t)n * 2), *h16 = malloc((size_t)n * 2), *ph16 = malloc((size_t)n * 2);
  float *g = malloc((size_t)n * 4), *p = malloc((size_t)n * 4), *m = malloc((size_t)P * 4),
        *m0 = malloc((size_t)P * 4), *scol = malloc((size_t)P * 4);
  uint8_t *codes = malloc((size_t)n);
  double *colsum = calloc((size_t)P, 8);
  srand(1);
  for (int64_t i = 0; i < n; i++) {
    g[i] = (float)(rand() % 2001 - 1000) / 1000.0f;
    p[i] = 1.0f;
    uint32_t bits;
    memcpy(&bits, &g[i], sizeof bits);
    g16[i] = (uint16_t)(bits >> 16); /* g truncated to bfloat16 */
    p16[i] = 0x3f80u;                /* 1.0 */
    h16[i] = (uint16_t)(0x3800u + (uint16_t)(rand() & 0x3ff)) | (uint16_t)((rand() & 1) << 15);
    ph16[i] = 0x3c00u; /* float16: g in +-[0.5, 1), p = 1.0 */
    codes[i] = (uint8_t)(rand() & 255);
  }
  for (int64_t j = 0; j < P; j++) scol[j] = 0.5f;
  const int64_t nblk = n / P;
  const int in_cache = n <= (1 << 16);
  const int reps = in_cache ? 200 : 3;
  double best[N_STAGES], sum[N_STAGES];
  for (int s = 0; s < N_STAGES; s++) best[s] = 1e30, sum[s] = 0.0;
  for (int r = 0; r < reps; r++) {
    double t[N_STAGES] = {0};
    for (int64_t b = 0; b < nblk; b++) {
      const int64_t base = b * P;
      double sq = 0.0;
      double t0 = now();
      const float mx = ops->adam_momentum(g, GEFEN_F32, base, codes + base, q, 0.5f, 0.9f,
                                          0.1f, P, m, &sq, 0);
      double t1 = now();
      memcpy(m0, m, (size_t)P * 4);
      double t2 = now();
      ops->requantize(q, m, mx, P, codes + base);
      double t3 = now();
      ops->apply_block(p, GEFEN_F32, base, m, P, 0.1f, 0.999f, 1e-6f);
      double t4 = now();
      ops->apply_factored(p, GEFEN_F32, base, m, P, 0.3f, scol, 1.0f, 1e-8f, 0.999f, 1e-6f);
      double t5 = now();
      /* the Adam sinks' m_has_no_nan as adam.c finds it for these finite gradients */
      const gefen_sink sink = {.kind = GEFEN_SINK_ADAM_BLOCK, .out = p, .out_dtype = GEFEN_F32,
                               .base = base, .s = 0.1f, .decay = 0.999f, .lr = 1e-6f,
                               .m_has_no_nan = 1};
      ops->requantize_apply(q, m0, mx, P, codes + base, &sink);
      double t6 = now();
      const gefen_sink fsink = {.kind = GEFEN_SINK_ADAM_FACTORED, .out = p,
                                .out_dtype = GEFEN_F32, .base = base, .s = 0.3f, .scol = scol,
                                .inv_bc1 = 1.0f, .eps = 1e-8f, .decay = 0.999f, .lr = 1e-6f,
                                .m_has_no_nan = 1};
      double t6b = now();
      ops->adam_momentum(g, GEFEN_F32, base, codes + base, q, 0.5f, 0.9f, 0.1f, P, m0, NULL, 0);
      double t7 = now();
      ops->requantize_apply(q, m0, mx, P, codes + base, &fsink);
      double t8 = now();
      double sums[4]; /* the block as 4 rows of P / 4, as the factored pass reads them */
      ops->row_stats(g, GEFEN_F32, base, P / 4, 4, colsum, sums);
      double t9 = now();
      const gefen_sink msink = {.kind = GEFEN_SINK_MUON, .out = out, .out_dtype = GEFEN_BF16,
                                .grad = g, .dtype = GEFEN_F32, .base = base, .beta = 0.95f,
                                .one_minus_beta = 0.05f, .nesterov = 1};
      const float mxm =
          ops->muon_momentum(g, GEFEN_F32, base, codes + base, q, 0.5f, 0.05f, P, m0);
      ops->requantize_apply(q, m0, mxm, P, codes + base, &msink);
      double t10 = now();
      double tb[2];
      for (int packed = 0; packed < 2; packed++) {
        const double s0 = now();
        double bsq = 0.0;
        const float bmx = ops->adam_momentum(g16, GEFEN_BF16, base, codes + base, q, 0.5f, 0.9f,
                                             0.1f, P, m0, &bsq,
                                             packed ? GEFEN_SINK_ADAM_BLOCK : 0);
        const gefen_sink bsink = {.kind = GEFEN_SINK_ADAM_BLOCK, .out = p16,
                                  .out_dtype = GEFEN_BF16, .base = base, .s = 0.1f,
                                  .decay = 0.999f, .lr = 1e-6f,
                                  .packed = packed ? GEFEN_SINK_ADAM_BLOCK : 0,
                                  .m_has_no_nan = 1};
        ops->requantize_apply(q, m0, bmx, P, codes + base, &bsink);
        tb[packed] = now() - s0;
      }
      {
        const double s0 = now();
        double hsq = 0.0;
        const float hmx = ops->adam_momentum(h16, GEFEN_F16, base, codes + base, q, 0.5f, 0.9f,
                                             0.1f, P, m0, &hsq, 0);
        const gefen_sink hsink = {.kind = GEFEN_SINK_ADAM_BLOCK, .out = ph16,
                                  .out_dtype = GEFEN_F16, .base = base, .s = 0.1f,
                                  .decay = 0.999f, .lr = 1e-6f, .m_has_no_nan = 1};
        ops->requantize_apply(q, m0, hmx, P, codes + base, &hsink);
        t[11] += now() - s0;
      }
      t[9] += tb[0];
      t[10] += tb[1];
      t[0] += t1 - t0;
      t[1] += t3 - t2;
      t[2] += t4 - t3;
      t[3] += t5 - t4;
      t[4] += t6 - t5;
      t[5] += t8 - t7;
      t[8] += t7 - t6b;
      t[6] += t9 - t8;
      t[7] += t10 - t9;
    }
    for (int s = 0; s < N_STAGES; s++) {
      best[s] = t[s] < best[s] ? t[s] : best[s];
      sum[s] += t[s];
    }
  }
  const double e = 1e9 / ((double)nblk * (double)P);
  printf("%-10s %-9s", label, in_cache ? "in-cache" : "in-memory");
  for (int s = 0; s < N_STAGES; s++)
    printf("  %s %.3f", stage_names[s], (in_cache ? best[s] : sum[s] / reps) * e);
  printf("  ns/element\n");
  free(out);
  free(g16);
  free(p16);
  free(h16);
  free(ph16);
  free(g);
  free(p);
  free(m);
  free(m0);
  free(scol);
  free(codes);
  free(colsum);
}

int main(void) {
  const int64_t P = 2048;
  gefen_quantizer *q = bench_quantizer(400.0);
  if (!q) return 1;
  const struct {
    const char *name;
    const gefen_block_ops *ops;
  } paths[] = {{"avx512bf16", gefen_block_ops_avx512bf16()},
               {"avx512vbmi", gefen_block_ops_avx512vbmi()},
               {"avx512", gefen_block_ops_avx512()},
               {"avx2", gefen_block_ops_avx2()},
               {"portable", &gefen_block_ops_scalar}};
  for (int pass = 0; pass < 2; pass++) {
    const int64_t n = pass == 0 ? 8 * P : (int64_t)1 << 26;
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++)
      if (paths[i].ops) run(paths[i].name, paths[i].ops, q, n, P);
  }
  gefen_quantizer_destroy(q);
  return 0;
}
