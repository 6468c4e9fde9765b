/* Two versions of one table of block kernels against each other on the sets of
 * core_step.c (one attention block of width d), in one process, with threads: what
 * kernel_ab.c does in cache on one thread, for whole C phases in DRAM. After one
 * untimed round of each version, each round times one phase with version A, then B
 * (even rounds) or B, then A (odd rounds), each side the best of 3 calls; printed
 * are the medians of each side and the median and range of the per-round ratios B/A.
 * The two versions are the same table (block_avx2.c by default, or an AVX-512 one)
 * compiled twice under two names (gefen_block_ops_a, gefen_block_ops_b; see
 * step_ab.sh), so everything around the kernels is shared. It times only: kernel_ab
 * and the C tests check the bits.
 *
 *   bash benchmarks/step_ab.sh [TABLE@]REV [d] [rounds] [threads] [dtypes] [phases]
 *     A: the table (avx2, avx512bf16 or avx512vbmi) at git revision REV, B: the
 *     working tree's
 *     phases: block (block-form update), factored (statistics + update), stats,
 *     once (the factored step reading the gradient once: momentum_in_stats, one
 *     gefen_adam_step call)
 *     defaults: d 2048 (16.8M), 12 rounds, 2 threads, fp32,bf16,fp16, stats,block,factored
 *
 * Needs a CPU with the table (it refuses otherwise). */
#define main core_step_main
#include "core_step.c"
#undef main

const gefen_block_ops *gefen_block_ops_a(void);
const gefen_block_ops *gefen_block_ops_b(void);

enum { PHASE_BLOCK, PHASE_FACTORED, PHASE_STATS, PHASE_ONCE, N_PHASES };
static const char *phase_names[N_PHASES] = {"block", "factored", "stats", "once"};

/* The best of 3 calls of one phase with ops (steps from *step on). */
static double best_of_3(const param_set *s, const gefen_quantizer *q, const gefen_block_ops *ops,
                        int nt, int phase, int64_t *step) {
  gefen_adam_item it[N_TENSORS];
  gefen_error err;
  double best = 1e30;
  for (int k = 0; k < 3; k++) {
    adam_items(s, phase != PHASE_BLOCK, (*step)++, it);
    if (phase == PHASE_ONCE)
      for (int t = 0; t < N_TENSORS; t++) it[t].momentum_in_stats = 1; /* block items ignore it */
    const double t0 = now();
    gefen_status st = GEFEN_OK;
    if (phase == PHASE_ONCE) {
      st = gefen_adam_step_with(ops, it, N_TENSORS, q, nt, &err);
    } else {
      if (phase != PHASE_BLOCK) st = gefen_adam_factored_stats_with(ops, it, N_TENSORS, q, nt, &err);
      if (st == GEFEN_OK && phase != PHASE_STATS)
        st = gefen_adam_update_with(ops, it, N_TENSORS, q, nt, &err);
    }
    const double t = now() - t0;
    if (st != GEFEN_OK) {
      fprintf(stderr, "step failed: %s\n", err.msg);
      exit(1);
    }
    best = t < best ? t : best;
  }
  return best;
}

int main(int argc, char **argv) {
  const int64_t d = argc > 1 ? atoll(argv[1]) : 2048;
  int rounds = argc > 2 ? atoi(argv[2]) : 12;
  const int nt = argc > 3 ? atoi(argv[3]) : 2;
  const char *dtype_list = argc > 4 ? argv[4] : "fp32,bf16,fp16";
  const char *phase_list = argc > 5 ? argv[5] : "stats,block,factored";
  if (rounds < 2) rounds = 2;
  if (!gefen_block_ops_a() || !gefen_block_ops_b()) {
    fprintf(stderr, "step_ab: this CPU lacks the table\n");
    return 1;
  }
  gefen_quantizer *q = bench_quantizer(300.0);
  if (!q) return 1;
  double *ta = malloc(sizeof(double) * (size_t)rounds), *tb = malloc(sizeof(double) * (size_t)rounds),
         *ratio = malloc(sizeof(double) * (size_t)rounds);
  for (int di = 0; di < 3; di++) {
    if (!strstr(dtype_list, set_dtypes[di].name)) continue;
    param_set s;
    make_set(&s, d, set_dtypes[di].dt);
    for (int phase = 0; phase < N_PHASES; phase++) {
      if (!strstr(phase_list, phase_names[phase])) continue;
      int64_t step = 1;
      best_of_3(&s, q, gefen_block_ops_a(), nt, phase, &step); /* warm-up, not timed */
      best_of_3(&s, q, gefen_block_ops_b(), nt, phase, &step);
      for (int r = 0; r < rounds; r++) {
        const int b_first = r % 2;
        const double t1 = best_of_3(&s, q, b_first ? gefen_block_ops_b() : gefen_block_ops_a(),
                                    nt, phase, &step);
        const double t2 = best_of_3(&s, q, b_first ? gefen_block_ops_a() : gefen_block_ops_b(),
                                    nt, phase, &step);
        ta[r] = b_first ? t2 : t1;
        tb[r] = b_first ? t1 : t2;
        ratio[r] = tb[r] / ta[r];
      }
      const double ma = median(ta, rounds), mb = median(tb, rounds),
                   mr = median(ratio, rounds); /* median() sorts: ratio[0] is the least */
      printf("d=%lld %s %-8s %d thread(s): A %8.3f ms  B %8.3f ms  B/A-1 %+6.1f%% (rounds %+.1f..%+.1f%%)\n",
             (long long)d, set_dtypes[di].name, phase_names[phase], nt, ma * 1e3, mb * 1e3,
             (mr - 1) * 100, (ratio[0] - 1) * 100, (ratio[rounds - 1] - 1) * 100);
      fflush(stdout);
    }
    free_set(&s);
  }
  free(ta);
  free(tb);
  free(ratio);
  gefen_quantizer_destroy(q);
  return 0;
}
