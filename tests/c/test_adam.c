/* C tests of the whole Gefen step (gefen_adam_step, gefen_adam_factored_stats and
 * gefen_adam_update), above the block primitives that test_kernels.c checks:
 *
 * - momentum_in_stats (phase 1 forms the momentum, magnitudes and codes;
 *   phase 2 decodes them) gives, bit for bit, the state and parameters of the
 *   step without it: on every version of the primitives this CPU has
 *   (AVX-512 + VBMI, AVX-512, AVX2, portable), 1-3 threads, every dtype,
 *   row lengths 1-130 and long rows, periods below the row length, 1-D
 *   parameters (period 1, adam_period1) of every length 1-200 and 70001, several
 *   items and statistics chunks per call, a row shard (row offset, more global
 *   rows), NaN payloads, infinities, subnormals and +-0 in the gradient and
 *   parameters, codebooks with repeated, -0/+0, subnormal and tightly packed
 *   entries, nearest and stochastic rounding, over several steps (under
 *   AddressSanitizer the long sets on a rotating third of the versions: LIGHT);
 *   the flagged runs alternate between gefen_adam_step (the whole step in
 *   one call) and the two internal phases;
 * - the contract: without the flag phase 1 mutates no state; the public
 *   two-phase calls and any call without a quantiser refuse the flag before
 *   touching anything; block items ignore it; gefen_adam_step fails (an
 *   invalid item, an injected out-of-memory in the update's scratch) before
 *   its first write, and otherwise gives the plain two phases' bits. */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "block_ops.h"
#include "gefen_core.h"

#include "check.h"

/* ---------------------------------------------------------------- codebooks */

enum { CB_LEARNED, CB_PADDED, CB_ZEROS, CB_SUBNORMAL, CB_PACKED, N_CB };
static const char *cb_names[N_CB] = {"learned", "padded (repeated entries)", "-0/+0",
                                     "subnormal entries", "packed (no exact table)"};

static void make_codebook(int kind, float *c) {
  if (kind == CB_LEARNED || kind == CB_PADDED) {
    /* the exact solver on a bell-shaped histogram; fewer than 256 active bins
     * give a padded codebook with repeated entries */
    int64_t hist[GEFEN_HIST_BINS] = {0};
    const int active = kind == CB_LEARNED ? 3500 : 40;
    for (int i = 0; i < active; i++) {
      const int bin = (int)(test_rng() % GEFEN_HIST_BINS);
      const double x = -1.0 + (bin + 0.5) / 2048.0;
      hist[bin] += 1 + (int64_t)(1000.0 * exp(-8.0 * x * x)) + (int64_t)(test_rng() % 7);
    }
    gefen_error err;
    CHECK(gefen_codebook_solve(hist, c, &err) == GEFEN_OK, "solve: %s", err.msg);
    return;
  }
  for (int i = 0; i < 256; i++) c[i] = -1.0f + 2.0f * (float)i / 255.0f;
  if (kind == CB_ZEROS) {
    for (int i = 0; i < 127; i++) c[i] = -1.0f + (float)i / 127.0f;
    c[127] = -0.0f;
    c[128] = 0.0f;
    for (int i = 129; i < 256; i++) c[i] = (float)(i - 128) / 127.0f;
  } else if (kind == CB_SUBNORMAL) {
    for (int i = 112; i < 144; i++) c[i] = (float)(i - 128) * 0x1p-149f * (float)(1 + i % 3);
    for (int i = 113; i < 144; i++)
      if (!(c[i] > c[i - 1])) c[i] = nextafterf(c[i - 1], 1.0f);
  } else { /* closer than one bucket: no exact lookup table */
    for (int i = 100; i < 110; i++) c[i] = c[100] + (float)(i - 100) * 1e-5f;
  }
}

/* ------------------------------------------------------------------ states */

/* One parameter's local shard and its state. */
typedef struct {
  gefen_dtype dt;
  int64_t rows, cols, period, row_offset, global_rows;
  int factored;
  void *param, *grad;
  uint8_t *codes;
  float *magnitude, *vmean, *v_row, *v_col;
  double *col_stats, *row_stats;
} pstate;

static size_t esz(gefen_dtype dt) { return gefen_dtype_size(dt); }

static void *xcalloc(size_t n, size_t sz) {
  void *p = calloc(n ? n : 1, sz);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  return p;
}

static void ps_alloc(pstate *s) {
  const int64_t n = s->rows * s->cols, nb = s->rows * (s->cols / s->period);
  s->param = xcalloc((size_t)n, esz(s->dt));
  s->grad = xcalloc((size_t)n, esz(s->dt));
  s->codes = xcalloc((size_t)n, 1);
  s->magnitude = xcalloc((size_t)nb, 4);
  s->vmean = s->factored ? NULL : xcalloc((size_t)nb, 4);
  s->v_row = s->factored ? xcalloc((size_t)s->rows, 4) : NULL;
  s->v_col = s->factored ? xcalloc((size_t)s->cols, 4) : NULL;
  s->col_stats = s->factored ? xcalloc((size_t)s->cols + 1, 8) : NULL;
  s->row_stats = s->factored ? xcalloc((size_t)s->rows, 8) : NULL;
}

static void ps_free(pstate *s) {
  free(s->param);
  free(s->grad);
  free(s->codes);
  free(s->magnitude);
  free(s->vmean);
  free(s->v_row);
  free(s->v_col);
  free(s->col_stats);
  free(s->row_stats);
}

#define COPY_FIELD(f, bytes) \
  if (src->f) memcpy(dst->f, src->f, bytes)

/* dst (allocated with the same layout) = src */
static void ps_copy(pstate *dst, const pstate *src) {
  const int64_t n = src->rows * src->cols, nb = src->rows * (src->cols / src->period);
  COPY_FIELD(param, (size_t)n * esz(src->dt));
  COPY_FIELD(grad, (size_t)n * esz(src->dt));
  COPY_FIELD(codes, (size_t)n);
  COPY_FIELD(magnitude, (size_t)nb * 4);
  COPY_FIELD(vmean, (size_t)nb * 4);
  COPY_FIELD(v_row, (size_t)src->rows * 4);
  COPY_FIELD(v_col, (size_t)src->cols * 4);
  COPY_FIELD(col_stats, ((size_t)src->cols + 1) * 8);
  COPY_FIELD(row_stats, (size_t)src->rows * 8);
}

static void ps_clone(pstate *dst, const pstate *src) {
  *dst = *src;
  ps_alloc(dst);
  ps_copy(dst, src);
}

/* The first differing element of two buffers, for the report. */
static char diff_at[160];
static int differs(const void *a, const void *b, size_t bytes, size_t elem) {
  if (memcmp(a, b, bytes) == 0) return 0;
  size_t i = 0;
  while (i < bytes && memcmp((const char *)a + i, (const char *)b + i, elem) == 0) i += elem;
  uint64_t x = 0, y = 0;
  memcpy(&x, (const char *)a + i, elem);
  memcpy(&y, (const char *)b + i, elem);
  snprintf(diff_at, sizeof diff_at, "(element %zu: %#llx vs %#llx)", i / elem,
           (unsigned long long)x, (unsigned long long)y);
  return 1;
}

static int is_nan(const void *p, gefen_dtype dt, int64_t i) {
  switch (dt) {
    case GEFEN_F32: return isnan(((const float *)p)[i]);
    case GEFEN_BF16: return (((const uint16_t *)p)[i] & 0x7fffu) > 0x7f80u;
    case GEFEN_F16: return (((const uint16_t *)p)[i] & 0x7fffu) > 0x7c00u;
    case GEFEN_F64: return isnan(((const double *)p)[i]);
  }
  return 0;
}

/* Parameters that agree bit for bit, or where both are NaN (any payloads). */
static int params_differ_but_nan(const pstate *a, const pstate *b) {
  const size_t pe = esz(a->dt);
  for (int64_t i = 0; i < a->rows * a->cols; i++) {
    const char *x = (const char *)a->param + (size_t)i * pe, *y = (const char *)b->param + (size_t)i * pe;
    if (memcmp(x, y, pe) != 0 && !(is_nan(a->param, a->dt, i) && is_nan(b->param, b->dt, i))) {
      differs(x, y, pe, pe);
      return 1;
    }
  }
  return 0;
}

/* Which buffers of a and b differ (bitwise); NULL when none. With nan_any,
 * two NaN parameters agree whatever their payloads: where two NaNs of
 * different payloads meet in a commutative operation (a row's and a column's
 * second moment, say), which one the result carries depends on the operand
 * order the compiler chose, which may differ between two inlined copies of
 * the same kernel -- as between the versions of the primitives. Every other
 * buffer, and every NaN of a run where one payload meets only itself, must
 * agree bit for bit. */
static const char *ps_diff_nan(const pstate *a, const pstate *b, int nan_any) {
  const int64_t n = a->rows * a->cols, nb = a->rows * (a->cols / a->period);
  const size_t pe = esz(a->dt);
#define DIFF(f, bytes, elem) \
  if (a->f && differs(a->f, b->f, bytes, elem)) return #f
  if (nan_any) {
    if (params_differ_but_nan(a, b)) return "param";
  } else {
    DIFF(param, (size_t)n * pe, pe);
  }
  DIFF(codes, (size_t)n, 1);
  DIFF(magnitude, (size_t)nb * 4, 4);
  DIFF(vmean, (size_t)nb * 4, 4);
  DIFF(v_row, (size_t)a->rows * 4, 4);
  DIFF(v_col, (size_t)a->cols * 4, 4);
  DIFF(col_stats, ((size_t)a->cols + 1) * 8, 8);
  DIFF(row_stats, (size_t)a->rows * 8, 8);
#undef DIFF
  return NULL;
}

static const char *ps_diff(const pstate *a, const pstate *b) { return ps_diff_nan(a, b, 0); }

static void put(void *p, gefen_dtype dt, int64_t i, float v) {
  switch (dt) {
    case GEFEN_F32: ((float *)p)[i] = v; break;
    case GEFEN_BF16: ((uint16_t *)p)[i] = gefen_f32_to_bf16_sel(v); break;
    case GEFEN_F16: ((uint16_t *)p)[i] = gefen_f32_to_f16_sel(v); break;
    case GEFEN_F64: ((double *)p)[i] = (double)v * (1.0 + 0x1p-40); break; /* beyond fp32 */
  }
}

/* Special values of each dtype: NaN with payloads (quiet and signalling, both
 * signs), infinities, +-0, subnormals, the largest finite. Entry 0 is the
 * NaN of the runs with one NaN payload (SPECIAL_ONE_NAN). */
static void put_special(void *p, gefen_dtype dt, int64_t i, int which) {
  static const uint32_t f32[] = {0x7fa12345u, 0xffc00001u, 0x7f800000u, 0xff800000u, 0x80000000u,
                                 0x00000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu, 0x00400000u};
  static const uint16_t bf16[] = {0x7fa1u, 0xffc1u, 0x7f80u, 0xff80u, 0x8000u,
                                  0x0000u, 0x0001u, 0x807fu, 0x7f7fu, 0x0040u};
  static const uint16_t f16[] = {0x7d23u, 0xfe01u, 0x7c00u, 0xfc00u, 0x8000u,
                                 0x0000u, 0x0001u, 0x83ffu, 0x7bffu, 0x0200u};
  static const uint64_t f64[] = {0x7ff4000000000123ull, 0xfff8000000000001ull,
                                 0x7ff0000000000000ull, 0xfff0000000000000ull,
                                 0x8000000000000000ull, 0x0000000000000000ull,
                                 0x0000000000000001ull, 0x3690000000000000ull, /* fp32 subnormal */
                                 0x47efffffe0000000ull, 0x8000000000000fffull};
  which %= 10;
  switch (dt) {
    case GEFEN_F32: memcpy((float *)p + i, &f32[which], 4); break;
    case GEFEN_BF16: ((uint16_t *)p)[i] = bf16[which]; break;
    case GEFEN_F16: ((uint16_t *)p)[i] = f16[which]; break;
    case GEFEN_F64: memcpy((double *)p + i, &f64[which], 8); break;
  }
}

/* Special values in a step's data:
 *  SPECIAL_NONE     none;
 *  SPECIAL_ONE_NAN  one NaN payload (in gradients and parameters), +-0 and
 *                   subnormals in both, infinities and the largest finite in
 *                   the parameters: wherever two NaNs meet they carry the same
 *                   payload, so every version of the primitives must give the
 *                   same bits (when two different NaNs meet, which one an
 *                   operation returns depends on its operand order, which the
 *                   compiler may swap for a commutative one; the kernel tests
 *                   make the same restriction);
 *  SPECIAL_ALL      every special value in both (NaNs of several payloads,
 *                   infinities and the default NaNs they make): compared
 *                   between the two phase splits of one version only, NaN
 *                   parameters of either payload agreeing (ps_diff_nan). */
enum { SPECIAL_NONE, SPECIAL_ONE_NAN, SPECIAL_ALL };

static int pick_special(int specials, int in_grad) {
  static const int grad_one_nan[5] = {0, 4, 5, 6, 7}; /* NaN, -0, +0, subnormals */
  if (specials == SPECIAL_ALL) return (int)(test_rng() % 10);
  if (in_grad) return grad_one_nan[test_rng() % 5];
  const int w = (int)(test_rng() % 9); /* not entry 1: another NaN */
  return w == 1 ? 9 : w;
}

/* Fresh data for a step: gradients over magnitudes 2^-12..2^12 (the order of
 * a sum shows in its bits), and special values in the gradient (not in every
 * row: a NaN in a row poisons its statistics) and the parameters, tiny and
 * zero gradients in some rows. */
static void new_grad(pstate *s, int specials) {
  const int64_t n = s->rows * s->cols;
  for (int64_t i = 0; i < n; i++)
    put(s->grad, s->dt, i, test_normal() * ldexpf(1.0f, (int)(test_rng() % 25) - 12) * 0.01f);
  if (specials == SPECIAL_NONE || n == 0) return;
  const int64_t k = 1 + n / 97;
  for (int64_t t = 0; t < k; t++) {
    put_special(s->grad, s->dt, (int64_t)(test_rng() % (uint64_t)n), pick_special(specials, 1));
    put_special(s->param, s->dt, (int64_t)(test_rng() % (uint64_t)n), pick_special(specials, 0));
  }
  /* a row of tiny values (subnormal squares) and an all-zero block */
  const int64_t r = (int64_t)(test_rng() % (uint64_t)s->rows);
  for (int64_t j = 0; j < s->cols; j++) put(s->grad, s->dt, r * s->cols + j, 1e-30f * test_normal());
  const int64_t b = (int64_t)(test_rng() % (uint64_t)(n / s->period));
  for (int64_t j = 0; j < s->period; j++) put(s->grad, s->dt, b * s->period + j, 0.0f);
}

static void init_state(pstate *s, gefen_dtype dt, int64_t rows, int64_t cols, int64_t period,
                       int factored, int64_t row_offset, int64_t extra_rows) {
  memset(s, 0, sizeof *s);
  s->dt = dt;
  s->rows = rows;
  s->cols = cols;
  s->period = period;
  s->factored = factored;
  s->row_offset = row_offset;
  s->global_rows = row_offset + rows + extra_rows;
  ps_alloc(s);
  for (int64_t i = 0; i < rows * cols; i++) put(s->param, dt, i, test_normal());
}

static gefen_adam_item make_item(const pstate *s, int64_t step, int stochastic, int flag) {
  gefen_adam_item it;
  memset(&it, 0, sizeof it);
  it.param = s->param;
  it.grad = s->grad;
  it.codes = s->codes;
  it.magnitude = s->magnitude;
  it.vmean = s->vmean;
  it.v_row = s->v_row;
  it.v_col = s->v_col;
  it.col_stats = s->col_stats;
  it.row_stats = s->row_stats;
  it.dtype = s->dt;
  it.rows = s->rows;
  it.cols = s->cols;
  it.period = s->period;
  it.row_offset = s->row_offset;
  it.global_rows = s->global_rows;
  it.step = step;
  it.lr = 1e-2;
  it.beta1 = 0.9;
  it.beta2 = 0.999;
  it.eps = 1e-8;
  it.weight_decay = 0.1;
  it.stochastic_round = stochastic;
  it.seed = (uint64_t)(step - 1) * 0x9E3779B9ull;
  it.momentum_in_stats = flag;
  return it;
}

enum { MAX_ITEMS = 4 };

/* One step of every state. Without the flag: phase 1 (no quantiser), then
 * the update. With it: the whole step in one call (gefen_adam_step) on odd
 * steps, the two internal phases (phase 1 with q) on even ones. */
static int run_step(const gefen_block_ops *ops, pstate *st, int n, const gefen_quantizer *q,
                    int64_t step, int stochastic, int flag, int nthreads) {
  gefen_adam_item items[MAX_ITEMS];
  for (int i = 0; i < n; i++) items[i] = make_item(&st[i], step, stochastic, flag);
  gefen_error err;
  gefen_status s;
  if (flag && step % 2) {
    s = gefen_adam_step_with(ops, items, n, q, nthreads, &err);
    CHECK(s == GEFEN_OK, "step: %s", err.msg);
    return s == GEFEN_OK ? 0 : -1;
  }
  s = gefen_adam_factored_stats_with(ops, items, n, flag ? q : NULL, nthreads, &err);
  CHECK(s == GEFEN_OK, "phase 1: %s", err.msg);
  if (s != GEFEN_OK) return -1;
  s = gefen_adam_update_with(ops, items, n, q, nthreads, &err);
  CHECK(s == GEFEN_OK, "update: %s", err.msg);
  return s == GEFEN_OK ? 0 : -1;
}

/* The primitives to test with q, as gefen_block_ops_for would allow them:
 * the portable ones, then every SIMD version (AVX2 only with an exact table). */
static int op_tables(const gefen_quantizer *q, const gefen_block_ops **ops, const char **names) {
  ops[0] = &gefen_block_ops_scalar;
  names[0] = "portable";
  const int ns = test_simd_tables(ops + 1, names + 1);
  int n = 1;
  for (int i = 1; i <= ns; i++) {
    if (ops[i] == gefen_block_ops_avx2() && !q->table.exact_lut) continue;
    ops[n] = ops[i];
    names[n++] = names[i];
  }
  return n;
}

typedef struct {
  gefen_dtype dt;
  int64_t rows, cols, period;
} shape;

static int64_t runs = 0;

/* Steps a set of parameters `steps` times in three ways from the same start:
 * the reference (portable primitives, one thread, no flag) and, for one
 * version of the primitives and a thread count, without and with the flag;
 * every buffer must agree bit for bit after every step (with SPECIAL_ALL,
 * the two with the same version). */
static void compare_set(const shape *shp, int n, const gefen_quantizer *q, const char *cb_name,
                        const gefen_block_ops *ops, const char *ops_name, int nthreads,
                        int stochastic, int specials, int sharded, int steps) {
  pstate ref[MAX_ITEMS], plain[MAX_ITEMS], flag[MAX_ITEMS];
  for (int i = 0; i < n; i++) {
    /* the last item of a set of several is a block item: it ignores the flag */
    const int factored = !(n > 1 && i == n - 1);
    init_state(&ref[i], shp[i].dt, shp[i].rows, shp[i].cols, shp[i].period, factored,
               sharded ? 5 : 0, sharded ? 9 : 0);
  }
  for (int64_t step = 1; step <= steps; step++) {
    for (int i = 0; i < n; i++) new_grad(&ref[i], specials);
    for (int i = 0; i < n; i++) {
      if (step == 1) {
        ps_clone(&plain[i], &ref[i]);
        ps_clone(&flag[i], &ref[i]);
      } else { /* new gradients and specials; the rest already agrees (checked below) */
        ps_copy(&plain[i], &ref[i]);
        ps_copy(&flag[i], &ref[i]);
      }
    }
    if (run_step(&gefen_block_ops_scalar, ref, n, q, step, stochastic, 0, 1) ||
        run_step(ops, plain, n, q, step, stochastic, 0, nthreads) ||
        run_step(ops, flag, n, q, step, stochastic, 1, nthreads))
      break;
    runs++;
    for (int i = 0; i < n; i++) {
      const pstate *want = specials == SPECIAL_ALL ? &plain[i] : &ref[i];
      const char *d1 = want == &plain[i] ? NULL : ps_diff(&ref[i], &plain[i]);
      const char *d2 = d1 ? NULL : ps_diff_nan(want, &flag[i], specials == SPECIAL_ALL);
      CHECK(!d1 && !d2,
            "%s, %d thread(s), codebook %s, item %d (dtype %d, %lld x %lld, period %lld%s), "
            "step %lld, %s rounding%s: %s differs %s %s",
            ops_name, nthreads, cb_name, i, shp[i].dt, (long long)shp[i].rows,
            (long long)shp[i].cols, (long long)shp[i].period, ref[i].factored ? "" : ", block",
            (long long)step, stochastic ? "stochastic" : "nearest",
            specials == SPECIAL_ALL ? ", all special values" : specials ? ", special values" : "",
            d1 ? d1 : d2,
            d1 ? "without the flag" : "with momentum_in_stats", diff_at);
      if (d1 || d2) step = steps; /* one report per set */
    }
  }
  for (int i = 0; i < n; i++) {
    ps_free(&ref[i]);
    ps_free(&plain[i]);
    ps_free(&flag[i]);
  }
}

/* Under AddressSanitizer (GCC and clang define __SANITIZE_ADDRESS__ or
 * __has_feature(address_sanitizer)) the long sets of test_equivalence run a
 * third of their dtype x thread-count pairs per version of the primitives,
 * rotating, so that each codebook still meets every pair (each on one version
 * instead of all; with fewer than three versions, every pair on each): the
 * sanitizers look for memory and undefined-behaviour errors, which the shapes
 * and paths find, and the optimised build runs all of them (in CI the
 * sanitizer build was the longest job). */
#if defined(__SANITIZE_ADDRESS__)
#define LIGHT 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LIGHT 1
#endif
#endif
#ifndef LIGHT
#define LIGHT 0
#endif

static const gefen_dtype all_dts[4] = {GEFEN_F32, GEFEN_BF16, GEFEN_F16, GEFEN_F64};

/* A divisor of cols below it (or cols itself), picked by k. */
static int64_t some_period(int64_t cols, unsigned k) {
  int64_t divs[64];
  int nd = 0;
  for (int64_t d = 1; d <= cols && nd < 64; d++)
    if (cols % d == 0) divs[nd++] = d;
  return divs[k % (unsigned)nd];
}

static void test_equivalence(void) {
  for (int cbk = 0; cbk < N_CB; cbk++) {
    float c[256];
    make_codebook(cbk, c);
    gefen_quantizer *q = NULL;
    gefen_error err;
    CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create: %s", err.msg);
    if (!q) continue;
    const gefen_block_ops *ops[1 + TEST_SIMD_MAX];
    const char *names[1 + TEST_SIMD_MAX];
    const int nops = op_tables(q, ops, names);
    const int64_t before = runs;
    for (int o = 0; o < nops; o++) {
      /* the 16-bit key search (VBMI tables, blocks >= 512) on every other
       * table, whichever search this CPU prefers: where two VBMI tables exist
       * (avx512bf16 at 1, avx512vbmi at 2) whole steps run both searches */
      q->search.key_search = q->search.key_ok && o % 2;
      /* every row length 1..130: one or a few short rows, period = cols on
       * odd lengths and a smaller divisor on even ones (so blocks of 1..130),
       * threads, dtype, rounding and special values cycling */
      for (int64_t cols = 1; cols <= 130; cols++) {
        const unsigned k = (unsigned)(cols + 7 * o + 3 * cbk);
        const shape s = {all_dts[k % 4], 1 + (int64_t)(k % 5), cols,
                         cols % 2 ? cols : some_period(cols, k)};
        compare_set(&s, 1, q, cb_names[cbk], ops[o], names[o], 1 + (int)(k % 3), (k / 4) % 2,
                    (int)((k / 3) % 3), (k / 5) % 2, 2);
      }
      /* 1-D parameters (n x 1, period 1: the block item last), every
       * length 1..200 (whole groups of 64 and tails), every dtype, threads,
       * both roundings (stochastic: the per-block path) and special values */
      for (int64_t len = 1; len <= 200; len++) {
        const unsigned k = (unsigned)(len + 5 * o + 3 * cbk);
        const shape set[2] = {{all_dts[(k + 1) % 4], 1, 24, 8}, {all_dts[k % 4], len, 1, 1}};
        compare_set(set, 2, q, cb_names[cbk], ops[o], names[o], 1 + (int)(k % 3),
                    (k / 7) % 4 == 0, (int)((k / 3) % 3), (k / 5) % 2, 2);
      }
      /* long rows, several items per call (a block item last), several
       * statistics chunks (rows x cols >= 2 x 32768), every dtype, thread
       * count and rounding */
      for (int d = 0; d < 4; d++)
        for (int nt = 1; nt <= 3; nt++) {
          /* the sanitizer build: see LIGHT (fewer than three versions: all pairs on each) */
          if (LIGHT && nops >= 3 && (d + nt + o) % 3) continue;
          const int stochastic = (nt + d) % 2, specials = (nt + d) % 3;
          const shape set[3] = {{all_dts[d], 40, 3000, d % 2 ? 1000 : 3000},
                                {all_dts[(d + 1) % 4], 3, 4096, 4096},
                                {all_dts[(d + 2) % 4], 6, 130, 13}};
          compare_set(set, 3, q, cb_names[cbk], ops[o], names[o], nt, stochastic, specials,
                      d % 2, 3);
          /* a 1-D parameter (n x 1, period 1: adam_period1) long enough
           * for several chunks and threads */
          const shape one_d[2] = {{all_dts[(d + 3) % 4], 2, 64, 16}, {all_dts[d], 70001, 1, 1}};
          compare_set(one_d, 2, q, cb_names[cbk], ops[o], names[o], nt, 0, specials, 0, 3);
          const shape big = {all_dts[d], 70, 2048, d < 2 ? 2048 : 512};
          compare_set(&big, 1, q, cb_names[cbk], ops[o], names[o], nt, !stochastic,
                      (specials + 1) % 3, nt == 3, 2);
          /* blocks long enough for the key search in the block form (the
           * item last), NaN gradients among the special values: the keys
           * keep their clamp in a block whose squares are not finite */
          const shape block_keys[2] = {{all_dts[(d + 1) % 4], 2, 64, 16},
                                       {all_dts[d], 8, 2048, d < 2 ? 2048 : 512}};
          compare_set(block_keys, 2, q, cb_names[cbk], ops[o], names[o], nt, !stochastic,
                      (specials + 1) % 3 ? (specials + 1) % 3 : SPECIAL_ONE_NAN, 0, 2);
        }
    }
    printf("  codebook %-26s %d version(s) of the primitives, %lld steps compared\n",
           cb_names[cbk], nops, (long long)(runs - before));
    gefen_quantizer_destroy(q);
  }
}

/* -------------------------------------------------------------- contract */

/* Every buffer of s equal to before's (bitwise). */
#define UNCHANGED(s, before, what)                                  \
  do {                                                              \
    for (int i_ = 0; i_ < 2; i_++) {                                \
      const char *d_ = ps_diff(&(s)[i_], &(before)[i_]);            \
      CHECK(!d_, "%s: item %d: %s changed", what, i_, d_ ? d_ : ""); \
    }                                                               \
  } while (0)

static void test_contract(void) {
  float c[256];
  make_codebook(CB_LEARNED, c);
  gefen_quantizer *q = NULL;
  gefen_error err;
  gefen_quantizer_create(c, &q, &err);
  if (!q) return;
  pstate s[2], before[2];
  init_state(&s[0], GEFEN_F32, 7, 48, 16, 1, 0, 0);
  init_state(&s[1], GEFEN_BF16, 5, 32, 8, 0, 0, 0); /* block: ignores the flag */
  for (int step = 1; step <= 2; step++) {
    for (int i = 0; i < 2; i++) new_grad(&s[i], 0);
    /* run whole steps first so that codes and magnitudes are not zero */
    CHECK(run_step(&gefen_block_ops_scalar, s, 2, q, step, 0, 1, 2) == 0, "step");
  }
  for (int i = 0; i < 2; i++) {
    new_grad(&s[i], 0);
    ps_clone(&before[i], &s[i]);
  }
  gefen_adam_item items[2];
  for (int i = 0; i < 2; i++) items[i] = make_item(&s[i], 3, 0, 0);
  /* without the flag, phase 1 writes its buffers only */
  CHECK(gefen_adam_factored_stats(items, 2, 2, &err) == GEFEN_OK, "%s", err.msg);
  CHECK(memcmp(s[0].codes, before[0].codes, 7 * 48) == 0 &&
            memcmp(s[0].magnitude, before[0].magnitude, 7 * 3 * 4) == 0 &&
            memcmp(s[0].param, before[0].param, 7 * 48 * 4) == 0 &&
            memcmp(s[0].v_row, before[0].v_row, 7 * 4) == 0 &&
            memcmp(s[0].v_col, before[0].v_col, 48 * 4) == 0,
        "phase 1 without momentum_in_stats mutated state");
  for (int i = 0; i < 2; i++) ps_copy(&s[i], &before[i]);
  /* the public two-phase calls refuse a flagged factored item, touching nothing */
  items[0].momentum_in_stats = 1;
  s[0].col_stats[0] = before[0].col_stats[0] = 12345.0;
  CHECK(gefen_adam_factored_stats(items, 2, 2, &err) == GEFEN_EVALUE && err.item == 0 &&
            strstr(err.msg, "gefen_adam_step"),
        "gefen_adam_factored_stats must refuse momentum_in_stats (%s)", err.msg);
  CHECK(gefen_adam_update(items, 2, q, 2, &err) == GEFEN_EVALUE && err.item == 0 &&
            strstr(err.msg, "gefen_adam_step"),
        "gefen_adam_update must refuse momentum_in_stats (%s)", err.msg);
  /* the internal phase 1 without a quantiser refuses it too */
  CHECK(gefen_adam_factored_stats_with(&gefen_block_ops_scalar, items, 2, NULL, 2, &err) ==
            GEFEN_EVALUE,
        "a NULL quantiser with momentum_in_stats");
  CHECK(gefen_adam_step(items, 2, NULL, 2, &err) == GEFEN_EVALUE, "gefen_adam_step without q");
  UNCHANGED(s, before, "a refused call");
  /* a flagged block item: accepted by the two phases, which ignore the flag */
  items[0].momentum_in_stats = 0;
  items[1].momentum_in_stats = 1;
  CHECK(gefen_adam_factored_stats(items, 2, 2, &err) == GEFEN_OK, "%s", err.msg);
  CHECK(memcmp(s[1].codes, before[1].codes, 5 * 32) == 0, "a block item's phase 1");
  for (int i = 0; i < 2; i++) ps_copy(&s[i], &before[i]);
  /* a later item that fails validation: the step fails before touching the
   * flagged one */
  items[0].momentum_in_stats = 1;
  items[1].beta2 = 1.5;
  CHECK(gefen_adam_step(items, 2, q, 2, &err) == GEFEN_EVALUE && err.item == 1,
        "an invalid item must fail the step (%s)", err.msg);
  UNCHANGED(s, before, "a step that failed validation");
  items[1].beta2 = 0.999;
  /* injected out-of-memory in the update's scratch (after phase 1's scratch
   * is allocated): an empty factored item whose column factors cannot be
   * allocated. The step must fail before its first write: the flagged item's
   * codes and magnitudes (written by phase 1) are as they were. */
  {
    double big_stats[2] = {-1.0, -1.0};
    float big_v[1] = {-1.0f};
    gefen_adam_item three[3] = {items[0], items[1], items[0]};
    gefen_adam_item *huge = &three[2];
    huge->rows = 0;
    huge->cols = huge->period = (int64_t)1 << 60; /* 4 EiB of column factors */
    huge->row_offset = huge->global_rows = 0;
    huge->param = NULL;
    huge->grad = NULL;
    huge->codes = NULL;
    huge->magnitude = NULL;
    huge->v_row = huge->v_col = big_v;
    huge->col_stats = big_stats;
    huge->row_stats = NULL;
    const gefen_status st = gefen_adam_step(three, 3, q, 2, &err);
    CHECK(st == GEFEN_ENOMEM && strstr(err.msg, "out of memory"),
          "an impossible scratch must fail the step with GEFEN_ENOMEM (status %d: %s)", (int)st,
          err.msg);
    UNCHANGED(s, before, "a step that ran out of memory");
    CHECK(big_stats[0] == -1.0 && big_v[0] == -1.0f, "the failed item's buffers were written");
  }
  /* the step: the flagged item's state as the plain two phases give it */
  CHECK(gefen_adam_step(items, 2, q, 2, &err) == GEFEN_OK, "%s", err.msg);
  for (int i = 0; i < 2; i++) items[i] = make_item(&before[i], 3, 0, 0);
  CHECK(gefen_adam_factored_stats(items, 2, 1, &err) == GEFEN_OK, "%s", err.msg);
  CHECK(gefen_adam_update(items, 2, q, 1, &err) == GEFEN_OK, "%s", err.msg);
  for (int i = 0; i < 2; i++) {
    const char *d = ps_diff(&s[i], &before[i]);
    CHECK(!d, "public calls: item %d: %s differs", i, d);
  }
  for (int i = 0; i < 2; i++) {
    ps_free(&s[i]);
    ps_free(&before[i]);
  }
  gefen_quantizer_destroy(q);
}

/* ------------------------------------------------ statistics in batches */

static float load_grad(const pstate *s, int64_t i) {
  switch (s->dt) {
    case GEFEN_BF16: return gefen_bf16_to_f32(((const uint16_t *)s->grad)[i]);
    case GEFEN_F16: return gefen_f16_to_f32_sel(((const uint16_t *)s->grad)[i]);
    case GEFEN_F64: return (float)((const double *)s->grad)[i];
    default: return ((const float *)s->grad)[i];
  }
}

/* Phase 1's column sums (and the slot of the v_row sum) as the specification
 * of adam.c has them, written out plainly: the rows split into a fixed
 * number of chunks that depends on the shape only, each chunk's float64 sums
 * of fp32 squares taken row after row, the chunks added in order. */
static void stats_reference(const pstate *s, double *col) {
  const int64_t rows = s->rows, cols = s->cols;
  int64_t c = rows * cols / 32768; /* GEFEN_CHUNK_ELEMS */
  if (c > 64) c = 64;
  if (c > rows) c = rows;
  if (c < 1) c = 1;
  double *part = xcalloc((size_t)cols + 1, sizeof(double));
  memset(col, 0, ((size_t)cols + 1) * sizeof(double));
  const float b2 = 0.999f, omb2 = (float)(1.0 - 0.999);
  for (int64_t k = 0; k < c; k++) {
    memset(part, 0, ((size_t)cols + 1) * sizeof(double));
    double vsum = 0.0;
    for (int64_t r = rows * k / c; r < rows * (k + 1) / c; r++) {
      double lanes[GEFEN_SUM_LANES] = {0};
      for (int64_t j = 0; j < cols; j++) {
        const float g = load_grad(s, r * cols + j), x = g * g;
        part[j] += x;
        lanes[j % GEFEN_SUM_LANES] += x;
      }
      const double mean = gefen_sum_lanes(lanes) / (double)cols;
      vsum += b2 * s->v_row[r] + omb2 * (float)mean;
    }
    part[cols] += vsum;
    for (int64_t j = 0; j <= cols; j++) col[j] += part[j];
  }
  free(part);
}

/* Items whose chunks' partial sums do not all fit the buffer at once (2 MiB:
 * 1024 x 2048 has 64 chunks of 2049 doubles, two of them are one more than
 * fits), so phase 1 takes them in three batches: the sums must be those of
 * the specification above, bit for bit, on every version and thread count. */
static void test_stats_batches(void) {
  const shape shp[4] = {{GEFEN_F32, 1024, 2048, 2048}, {GEFEN_BF16, 1024, 2048, 2048},
                        {GEFEN_F32, 64, 64, 64}, {GEFEN_F16, 700, 3000, 3000}};
  pstate st[4];
  for (int i = 0; i < 4; i++) {
    init_state(&st[i], shp[i].dt, shp[i].rows, shp[i].cols, shp[i].period, 1, 0, 0);
    new_grad(&st[i], SPECIAL_NONE);
    for (int64_t r = 0; r < st[i].rows; r++) st[i].v_row[r] = (float)(test_rng() % 1000) * 1e-6f;
  }
  const gefen_block_ops *ops[1 + TEST_SIMD_MAX];
  const char *names[1 + TEST_SIMD_MAX];
  float c[256];
  make_codebook(CB_LEARNED, c);
  gefen_quantizer *q = NULL;
  gefen_error err;
  CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create: %s", err.msg);
  const int nops = q ? op_tables(q, ops, names) : 0;
  double *want[4]; /* the specification's sums, the same for every version and thread count */
  for (int i = 0; i < 4; i++) {
    want[i] = xcalloc((size_t)st[i].cols + 1, sizeof(double));
    stats_reference(&st[i], want[i]);
  }
  for (int o = 0; o < nops; o++)
    for (int nt = 1; nt <= 3; nt++) {
      gefen_adam_item items[4];
      for (int i = 0; i < 4; i++) {
        items[i] = make_item(&st[i], 1, 0, 0);
        memset(st[i].col_stats, 0xff, ((size_t)st[i].cols + 1) * 8); /* no earlier run's sums */
      }
      CHECK(gefen_adam_factored_stats_with(ops[o], items, 4, NULL, nt, &err) == GEFEN_OK, "%s",
            err.msg);
      for (int i = 0; i < 4; i++)
        CHECK(!differs(want[i], st[i].col_stats, ((size_t)st[i].cols + 1) * 8, 8),
              "%s, %d thread(s): item %d (%lld x %lld): column sums differ from the "
              "specification %s",
              names[o], nt, i, (long long)st[i].rows, (long long)st[i].cols, diff_at);
    }
  for (int i = 0; i < 4; i++) {
    free(want[i]);
    ps_free(&st[i]);
  }
  gefen_quantizer_destroy(q);
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(void) {
  double t0 = seconds();
  printf("test_adam: phase 1 in batches against its specification\n");
  test_stats_batches();
  printf("  (%.1f s)\n", seconds() - t0);
  t0 = seconds();
  printf("test_adam: momentum_in_stats against the plain step, bit for bit%s\n",
         LIGHT ? " (sanitizer build: long sets on a third of the versions, rotating)" : "");
  test_equivalence();
  printf("  (%.1f s)\n", seconds() - t0);
  printf("test_adam: contract of the phases\n");
  test_contract();
  if (failures) {
    fprintf(stderr, "test_adam: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_adam: all passed (%lld steps compared)\n", (long long)runs);
  return 0;
}
