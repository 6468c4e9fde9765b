/* The whole C step of Gefen and GefenMuon's momentum on the parameter sets of
 * benchmarks/step_time.py (one attention block of width d: (3d, d), (d, d), (d,), (d,)),
 * without Python: the calls the extension makes (factored statistics, update), timed
 * per phase, with 1 and 2 threads, next to the memory floor of the same step measured
 * in the same run: a plain loop that reads and writes the same bytes (gradient read,
 * parameter read and written, codes read and written) and does nothing else.
 *
 *   bash benchmarks/core_breakdown.sh        (builds and runs this after the breakdown)
 *   core_step [d] [steps] [dtypes]           (default d = 2048, the 16M set; 4096: 64M;
 *                                             dtypes: a comma list of fp32, bf16, fp16,
 *                                             default fp32,bf16)
 *   GEFEN_BENCH_HUGE=1 core_step ...         the same on transparent huge pages
 *
 * Each figure is the median and the minimum of `steps` steps (ms). */
#define _DEFAULT_SOURCE
#include <math.h>
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gefen_core.h"
#include "block_ops.h" /* the phases of gefen_adam_step one at a time */
#include "core_internal.h" /* gefen_f32_to_f16 for the fp16 test data */
#include "bench_clock.h"
#include "bench_codebook.h"

#ifdef _OPENMP
#include <omp.h>
#endif

static double minimum(const double *v, int n) {
  double m = v[0];
  for (int i = 1; i < n; i++) m = v[i] < m ? v[i] : m;
  return m;
}

enum { N_TENSORS = 4 };

typedef struct {
  int64_t rows[N_TENSORS], cols[N_TENSORS];
  void *param[N_TENSORS], *grad[N_TENSORS];
  uint8_t *codes[N_TENSORS];
  float *magnitude[N_TENSORS], *vmean[N_TENSORS], *v_row[N_TENSORS], *v_col[N_TENSORS];
  double *col_stats[N_TENSORS], *row_stats[N_TENSORS];
  void *out[N_TENSORS]; /* Muon: bf16 Newton-Schulz input */
  gefen_dtype dtype;
  int64_t numel;
} param_set;

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float randn(void) { /* a rough normal from the sum of uniforms */
  float s = 0.0f;
  for (int i = 0; i < 4; i++) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    s += (float)(rng_state >> 40) * (1.0f / 16777216.0f);
  }
  return (s - 2.0f) * 1.7f;
}

/* GEFEN_BENCH_HUGE=1: big buffers on 2 MiB-aligned memory advised for
 * transparent huge pages (what torch does with THP_MEM_ALLOC_ENABLE=1). */
static void *alloc_big(size_t bytes) {
  const char *huge = getenv("GEFEN_BENCH_HUGE");
  if (!huge || strcmp(huge, "1") != 0 || bytes < (1u << 21)) return malloc(bytes);
  void *p = NULL;
  const size_t rounded = (bytes + (1u << 21) - 1) & ~(size_t)((1u << 21) - 1);
  if (posix_memalign(&p, 1u << 21, rounded) != 0) return NULL;
  madvise(p, rounded, MADV_HUGEPAGE);
  return p;
}

static void store(void *p, gefen_dtype dt, int64_t i, float v) {
  if (dt == GEFEN_F32) {
    ((float *)p)[i] = v;
  } else if (dt == GEFEN_F16) {
    ((uint16_t *)p)[i] = gefen_f32_to_f16(v);
  } else { /* bfloat16: truncation is fine for test data */
    uint32_t b;
    memcpy(&b, &v, 4);
    ((uint16_t *)p)[i] = (uint16_t)(b >> 16);
  }
}

static void make_set(param_set *s, int64_t d, gefen_dtype dt) {
  const int64_t rows[N_TENSORS] = {3 * d, d, d, d}, cols[N_TENSORS] = {d, d, 1, 1};
  const size_t esz = gefen_dtype_size(dt);
  s->dtype = dt;
  s->numel = 0;
  for (int t = 0; t < N_TENSORS; t++) {
    const int64_t n = rows[t] * cols[t];
    s->rows[t] = rows[t];
    s->cols[t] = cols[t];
    s->param[t] = alloc_big((size_t)n * esz);
    s->grad[t] = alloc_big((size_t)n * esz);
    s->out[t] = alloc_big((size_t)n * 2);
    s->codes[t] = alloc_big((size_t)n);
    memset(s->codes[t], 0, (size_t)n);
    s->magnitude[t] = calloc((size_t)rows[t], sizeof(float)); /* period = cols */
    s->vmean[t] = calloc((size_t)rows[t], sizeof(float));
    s->v_row[t] = calloc((size_t)rows[t], sizeof(float));
    s->v_col[t] = calloc((size_t)cols[t], sizeof(float));
    s->col_stats[t] = calloc((size_t)cols[t] + 1, sizeof(double));
    s->row_stats[t] = calloc((size_t)rows[t], sizeof(double));
    for (int64_t i = 0; i < n; i++) {
      store(s->param[t], dt, i, 0.02f * randn());
      store(s->grad[t], dt, i, randn());
    }
    s->numel += n;
  }
}

static void free_set(param_set *s) {
  for (int t = 0; t < N_TENSORS; t++) {
    free(s->param[t]);
    free(s->grad[t]);
    free(s->out[t]);
    free(s->codes[t]);
    free(s->magnitude[t]);
    free(s->vmean[t]);
    free(s->v_row[t]);
    free(s->v_col[t]);
    free(s->col_stats[t]);
    free(s->row_stats[t]);
  }
}

/* The dtypes a run can take, by the names its dtype list uses. */
static const struct {
  const char *name;
  gefen_dtype dt;
} set_dtypes[3] = {{"fp32", GEFEN_F32}, {"bf16", GEFEN_BF16}, {"fp16", GEFEN_F16}};

/* The items of one step; 1-D tensors always take the block form (period 1). */
static void adam_items(const param_set *s, int factored, int64_t step, gefen_adam_item *it) {
  for (int t = 0; t < N_TENSORS; t++) {
    const int fac = factored && s->cols[t] > 1;
    it[t] = (gefen_adam_item){.param = s->param[t], .grad = s->grad[t], .codes = s->codes[t],
                              .magnitude = s->magnitude[t], .vmean = fac ? NULL : s->vmean[t],
                              .v_row = fac ? s->v_row[t] : NULL, .v_col = fac ? s->v_col[t] : NULL,
                              .col_stats = fac ? s->col_stats[t] : NULL,
                              .row_stats = fac ? s->row_stats[t] : NULL, .dtype = s->dtype,
                              .rows = s->rows[t], .cols = s->cols[t], .period = s->cols[t],
                              .row_offset = 0, .global_rows = s->rows[t], .step = step,
                              .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                              .weight_decay = 0.01};
  }
}

/* The floor: the same bytes read and written by the simplest loop. */
static void floor_pass(const param_set *s, int nt) {
  for (int t = 0; t < N_TENSORS; t++) {
    const int64_t n = s->rows[t] * s->cols[t];
    if (s->dtype == GEFEN_F32) {
      float *p = s->param[t];
      const float *g = s->grad[t];
      uint8_t *c = s->codes[t];
#pragma omp parallel for simd schedule(static) num_threads(nt)
      for (int64_t i = 0; i < n; i++) {
        p[i] = p[i] * 0.99999f - 1e-9f * g[i];
        c[i] = (uint8_t)(c[i] + 1u);
      }
    } else {
      uint16_t *p = s->param[t];
      const uint16_t *g = s->grad[t];
      uint8_t *c = s->codes[t];
#pragma omp parallel for simd schedule(static) num_threads(nt)
      for (int64_t i = 0; i < n; i++) {
        p[i] = (uint16_t)(p[i] ^ (g[i] & 1u));
        c[i] = (uint8_t)(c[i] + 1u);
      }
    }
  }
}

static void report(const char *what, double *v, int n) {
  const double mn = minimum(v, n), md = median(v, n);
  printf("  %-34s median %8.3f  min %8.3f ms\n", what, md * 1e3, mn * 1e3);
}

/* Times `steps` Gefen steps (after two warm-up steps) of the set: the factored
 * statistics (t_a), the update (t_b) and both (t_c), as the extension calls them;
 * with momentum_in_stats the phases through the internal calls (the public ones
 * refuse the flag) and, into t_d, the same step in one call (gefen_adam_step). */
static int time_adam(const param_set *s, const gefen_quantizer *q, int nt, int factored,
                     int in_stats, int steps, double *t_a, double *t_b, double *t_c,
                     double *t_d) {
  const gefen_block_ops *ops = gefen_block_ops_for(q);
  gefen_adam_item it[N_TENSORS];
  gefen_error err;
  for (int r = 0; r < steps + 2; r++) {
    adam_items(s, factored, r + 1, it);
    for (int t = 0; t < N_TENSORS; t++) it[t].momentum_in_stats = in_stats;
    double t0 = now();
    gefen_status st = in_stats ? gefen_adam_factored_stats_with(ops, it, N_TENSORS, q, nt, &err)
                               : gefen_adam_factored_stats(it, N_TENSORS, nt, &err);
    double t1 = now();
    if (st == GEFEN_OK)
      st = in_stats ? gefen_adam_update_with(ops, it, N_TENSORS, q, nt, &err)
                    : gefen_adam_update(it, N_TENSORS, q, nt, &err);
    double t2 = now();
    if (st == GEFEN_OK && t_d) st = gefen_adam_step(it, N_TENSORS, q, nt, &err);
    double t3 = now();
    if (st != GEFEN_OK) {
      fprintf(stderr, "step failed: %s\n", err.msg);
      return 1;
    }
    if (r >= 2) {
      t_a[r - 2] = t1 - t0;
      t_b[r - 2] = t2 - t1;
      t_c[r - 2] = t2 - t0;
      if (t_d) t_d[r - 2] = t3 - t2;
    }
  }
  return 0;
}

int main(int argc, char **argv) {
  const int64_t d = argc > 1 ? atoll(argv[1]) : 2048;
  const int steps = argc > 2 ? atoi(argv[2]) : 10;
  gefen_quantizer *q = bench_quantizer(300.0);
  if (!q) return 1;
  gefen_error err;
  double *t_a = malloc(sizeof(double) * (size_t)steps), *t_b = malloc(sizeof(double) * (size_t)steps),
         *t_c = malloc(sizeof(double) * (size_t)steps), *t_d = malloc(sizeof(double) * (size_t)steps);
  const char *dtype_list = argc > 3 ? argv[3] : "fp32,bf16";
  for (int di = 0; di < 3; di++) {
    if (!strstr(dtype_list, set_dtypes[di].name)) continue;
    const gefen_dtype dt = set_dtypes[di].dt;
    param_set s;
    make_set(&s, d, dt);
    for (int nt = 1; nt <= 2; nt++) {
      printf("d=%lld (%lld parameters) %s, %d thread(s)\n", (long long)d, (long long)s.numel,
             set_dtypes[di].name, nt);
      for (int r = 0; r < steps + 2; r++) {
        double t0 = now();
        floor_pass(&s, nt);
        if (r >= 2) t_a[r - 2] = now() - t0;
      }
      report("memory floor (same bytes, no math)", t_a, steps);
      for (int factored = 0; factored < 2; factored++) {
        if (time_adam(&s, q, nt, factored, 0, steps, t_a, t_b, t_c, NULL) != 0) return 1;
        if (factored) report("factored: statistics phase", t_a, steps);
        report(factored ? "factored: update phase" : "block: update", t_b, steps);
        if (factored) report("factored: whole step", t_c, steps);
      }
      if (time_adam(&s, q, nt, 1, 1, steps, t_a, t_b, t_c, t_d) != 0) return 1;
      report("momentum_in_stats: statistics+momentum", t_a, steps);
      report("momentum_in_stats: decode+apply", t_b, steps);
      report("momentum_in_stats: both phases", t_c, steps);
      report("gefen_adam_step (one call)", t_d, steps);
      gefen_muon_item mi[2];
      for (int t = 0; t < 2; t++)
        mi[t] = (gefen_muon_item){.grad = s.grad[t], .codes = s.codes[t],
                                  .magnitude = s.magnitude[t], .out = s.out[t],
                                  .dtype = s.dtype, .out_dtype = GEFEN_BF16, .rows = s.rows[t],
                                  .cols = s.cols[t], .period = s.cols[t], .beta = 0.95,
                                  .nesterov = 1};
      for (int r = 0; r < steps + 2; r++) {
        double t0 = now();
        if (gefen_muon_momentum(mi, 2, q, nt, &err) != GEFEN_OK) {
          fprintf(stderr, "muon failed: %s\n", err.msg);
          return 1;
        }
        if (r >= 2) t_a[r - 2] = now() - t0;
      }
      report("GefenMuon momentum (2-D only)", t_a, steps);
    }
    free_set(&s);
  }
  free(t_a);
  free(t_b);
  free(t_c);
  free(t_d);
  gefen_quantizer_destroy(q);
  return 0;
}
