/*
 * Test data shared by host_check.cu (emulation vs CPU core) and parity.cu
 * (GPU vs emulation): codebooks, case tables, deterministic data and
 * bitwise / tolerant comparisons. Host code only.
 */
#ifndef GEFEN_CUDA_TEST_CASES_H
#define GEFEN_CUDA_TEST_CASES_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "gefen_core.h"
#include "gefen_cuda_math.cuh"

static int g_failures = 0;
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      g_failures++;                                        \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      if (g_failures > 30) exit(1);                        \
    }                                                      \
  } while (0)

/* ------------------------------------------------------------------ data */

static uint64_t g_rng = 0x243F6A8885A308D3ull;
static inline uint64_t rng(void) {
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return g_rng * 0x2545F4914F6CDD1Dull;
}
static inline double uniform(double lo, double hi) {
  return lo + (hi - lo) * (double)(rng() >> 11) * (1.0 / 9007199254740992.0);
}
static inline double normal(void) {
  const double u = uniform(1e-12, 1.0), v = uniform(0.0, 1.0);
  return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* Gradient flavours: EXACT makes every float64 (and 16-lane fp32) sum of g^2
 * exact, so results cannot depend on summation order; NORMAL is ordinary
 * data over many binades; SPECIAL adds zero blocks, NaN, inf and huge values. */
enum { DATA_EXACT = 0, DATA_NORMAL = 1, DATA_SPECIAL = 2 };
static const char *data_name(int kind) {
  return kind == DATA_EXACT ? "exact" : kind == DATA_NORMAL ? "normal" : "special";
}

/* Codes compared as one-byte elements. */
#define DT_U8 ((gefen_dtype)100)
static inline size_t dsize(gefen_dtype dt) { return dt == DT_U8 ? 1 : gefen_dtype_size(dt); }

static inline void store_value(void *p, gefen_dtype dt, int64_t i, double v) {
  switch (dt) {
    case GEFEN_F32: ((float *)p)[i] = (float)v; break;
    case GEFEN_BF16: ((uint16_t *)p)[i] = f32_to_bf16((float)v); break;
    case GEFEN_F16: ((uint16_t *)p)[i] = f32_to_f16((float)v); break;
    case GEFEN_F64: ((double *)p)[i] = v; break;
    default: break;
  }
}
static inline double load_value(const void *p, gefen_dtype dt, int64_t i) {
  switch (dt) {
    case GEFEN_F32: return ((const float *)p)[i];
    case GEFEN_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case GEFEN_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    case GEFEN_F64: return ((const double *)p)[i];
    default: break;
  }
  return dt == DT_U8 ? (double)((const uint8_t *)p)[i] : 0.0;
}

static inline std::vector<uint8_t> make_tensor(gefen_dtype dt, int64_t n, int kind, int64_t block) {
  std::vector<uint8_t> buf((size_t)(n > 0 ? n : 1) * dsize(dt));
  double scale = 1.0;
  for (int64_t i = 0; i < n; i++) {
    if (block > 0 && i % block == 0) scale = ldexp(1.0, (int)(rng() % 13) - 10);
    double v;
    if (kind == DATA_EXACT) {
      v = (double)((int)(rng() % 129) - 64) / 64.0;
    } else {
      v = normal() * scale;
      if (kind == DATA_SPECIAL) {
        const uint64_t r = rng() % 1000;
        if (r == 0) v = NAN;
        else if (r == 1) v = INFINITY;
        else if (r == 2) v = -INFINITY;
        else if (r < 6) v = (dt == GEFEN_F16 ? 60000.0 : 1e30) * (r & 1 ? 1 : -1);
        if (block > 0 && (i / block) % 7 == 3) v = 0.0; /* all-zero blocks */
      }
    }
    store_value(buf.data(), dt, i, v);
  }
  return buf;
}

static inline std::vector<float> make_floats(int64_t n, double lo, double hi, int zero_every) {
  std::vector<float> v((size_t)(n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++)
    v[i] = (zero_every > 0 && rng() % zero_every == 0) ? 0.0f : (float)uniform(lo, hi);
  return v;
}

static inline std::vector<uint8_t> make_codes(int64_t n) {
  std::vector<uint8_t> v((size_t)(n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++) v[i] = (uint8_t)rng();
  return v;
}

/* ------------------------------------------------------------- codebooks */

enum { CB_LEARNED = 0, CB_PADDED = 1, CB_PACKED = 2 };
static const char *codebook_name(int kind) {
  return kind == CB_LEARNED ? "learned" : kind == CB_PADDED ? "padded" : "packed";
}

/* LEARNED: solved from a histogram of normal data (lookup table exact);
 * PADDED: few active bins, so repeated entries; PACKED: entries 1e-6 apart,
 * so the table is not exact and the quantiser falls back to binary search. */
static inline void make_codebook(int kind, float *c) {
  gefen_error err;
  if (kind == CB_PACKED) {
    for (int i = 0; i < 256; i++) c[i] = (float)(-1.0 + 2.0 * i / 255.0);
    for (int i = 101; i <= 110; i++) c[i] = c[100] + (float)(i - 100) * 1e-6f;
    c[0] = -1.0f;
    c[255] = 1.0f;
    return;
  }
  std::vector<int64_t> hist(GEFEN_HIST_BINS, 0);
  if (kind == CB_LEARNED) {
    const int64_t rows = 64, cols = 1024;
    std::vector<float> g((size_t)(rows * cols));
    for (auto &x : g) x = (float)normal();
    gefen_matrix m = {g.data(), GEFEN_F32, rows, cols};
    CHECK(gefen_histogram(&m, 64, hist.data(), 1, &err) == GEFEN_OK, "histogram: %s", err.msg);
  } else {
    for (int i = 0; i < 50; i++) hist[rng() % GEFEN_HIST_BINS] += 1 + (int64_t)(rng() % 100);
  }
  CHECK(gefen_codebook_solve(hist.data(), c, &err) == GEFEN_OK, "solve: %s", err.msg);
}

/* ----------------------------------------------------------- comparisons */

/* Bit-for-bit equality of n elements of `width` bytes; float elements that
 * are NaN on both sides count as equal (the GPU's NaN payloads differ). */
static inline int64_t count_mismatch(const void *a, const void *b, int64_t n, gefen_dtype dt,
                              int is_float, int64_t *first) {
  const size_t w = dsize(dt);
  int64_t bad = 0;
  *first = -1;
  for (int64_t i = 0; i < n; i++) {
    if (memcmp((const char *)a + i * w, (const char *)b + i * w, w) == 0) continue;
    if (is_float && isnan(load_value(a, dt, i)) && isnan(load_value(b, dt, i))) continue;
    if (*first < 0) *first = i;
    bad++;
  }
  return bad;
}

#define EXPECT_SAME(what, a, b, n, dt, is_float)                                             \
  do {                                                                                       \
    int64_t first_;                                                                          \
    const int64_t bad_ = count_mismatch((a), (b), (n), (dt), (is_float), &first_);           \
    CHECK(bad_ == 0, "%s: %s: %lld of %lld differ, first at %lld (%.9g vs %.9g)", label,      \
          what, (long long)bad_, (long long)(n), (long long)first_,                          \
          first_ >= 0 ? load_value((a), (dt), first_) : 0.0,                                 \
          first_ >= 0 ? load_value((b), (dt), first_) : 0.0);                                \
  } while (0)

/* Within rel * |value| + ulps of the dtype (NaN equal NaN): for results that
 * depend on the CPU core's float64 (or 16-lane fp32) summation order. */
static inline int64_t count_far(const void *a, const void *b, int64_t n, gefen_dtype dt, double rel,
                         int64_t *first) {
  const double ulp = dt == GEFEN_BF16 ? 0x1p-7 : dt == GEFEN_F16 ? 0x1p-10
                   : dt == GEFEN_F32 ? 0x1p-23 : 0x1p-52;
  int64_t bad = 0;
  *first = -1;
  for (int64_t i = 0; i < n; i++) {
    const double x = load_value(a, dt, i), y = load_value(b, dt, i);
    if (x == y || (isnan(x) && isnan(y))) continue;
    const double tol = rel * fabs(y) + 2.0 * ulp * fabs(y) + 1e-30;
    if (fabs(x - y) <= tol) continue;
    if (*first < 0) *first = i;
    bad++;
  }
  return bad;
}

#define EXPECT_CLOSE(what, a, b, n, dt, rel)                                                 \
  do {                                                                                       \
    int64_t first_;                                                                          \
    const int64_t bad_ = count_far((a), (b), (n), (dt), (rel), &first_);                     \
    CHECK(bad_ == 0, "%s: %s: %lld of %lld not within %g, first at %lld (%.9g vs %.9g)",      \
          label, what, (long long)bad_, (long long)(n), (double)(rel), (long long)first_,    \
          first_ >= 0 ? load_value((a), (dt), first_) : 0.0,                                 \
          first_ >= 0 ? load_value((b), (dt), first_) : 0.0);                                \
  } while (0)

/* ------------------------------------------------------------ case tables */

typedef struct {
  int64_t rows, cols, period;
} shape3;

/* Periods from 1 to beyond one CTA, powers of two and not, G < P and G > P,
 * zero-sized shards. */
static const shape3 kShapes[] = {
    {1, 1, 1},     {37, 1, 1},    {4, 8, 1},      {3, 12, 12},    {5, 48, 12},
    {4, 96, 3},    {16, 256, 32}, {9, 640, 640},  {7, 1000, 40},  {2, 4096, 4096},
    {64, 384, 384}, {6, 100, 100}, {3, 2048, 64}, {130, 24, 24},  {3, 1500, 1500},
    {2, 3000, 600}, {0, 16, 4},    {4, 0, 1},
};
static const int kNumShapes = (int)(sizeof kShapes / sizeof kShapes[0]);

static const gefen_dtype kDtypes[] = {GEFEN_F32, GEFEN_BF16, GEFEN_F16, GEFEN_F64};
static const char *dtype_name(gefen_dtype dt) {
  return dt == GEFEN_F32 ? "f32" : dt == GEFEN_BF16 ? "bf16" : dt == GEFEN_F16 ? "f16" : "f64";
}

/* One parameter's Gefen state on the host. */
struct AdamState {
  gefen_dtype dt;
  int64_t rows, cols, period, row_offset, global_rows;
  bool factored;
  std::vector<uint8_t> param, grad, codes;
  std::vector<float> magnitude, vmean, v_row, v_col;
  std::vector<double> col_stats, row_stats;

  int64_t numel() const { return rows * cols; }
  int64_t nblocks() const { return rows * (cols / period); }

  gefen_adam_item item(int64_t step, double lr, double wd, int stochastic) {
    gefen_adam_item it;
    memset(&it, 0, sizeof it);
    it.param = param.data();
    it.grad = grad.data();
    it.codes = codes.data();
    it.magnitude = magnitude.data();
    it.vmean = factored ? NULL : vmean.data();
    it.v_row = factored ? v_row.data() : NULL;
    it.v_col = factored ? v_col.data() : NULL;
    it.col_stats = factored ? col_stats.data() : NULL;
    it.row_stats = factored ? row_stats.data() : NULL;
    it.dtype = dt;
    it.rows = rows;
    it.cols = cols;
    it.period = period;
    it.row_offset = row_offset;
    it.global_rows = global_rows;
    it.step = step;
    it.lr = lr;
    it.beta1 = 0.9;
    it.beta2 = 0.999;
    it.eps = 1e-8;
    it.weight_decay = wd;
    it.stochastic_round = stochastic;
    it.seed = (uint64_t)(step - 1);
    return it;
  }
};

static inline AdamState make_adam_state(gefen_dtype dt, shape3 s, bool factored, int64_t row_offset,
                                 int64_t extra_rows) {
  AdamState st;
  st.dt = dt;
  st.rows = s.rows;
  st.cols = s.cols;
  st.period = s.period;
  st.row_offset = row_offset;
  st.global_rows = row_offset + s.rows + extra_rows;
  st.factored = factored;
  const int64_t n = st.numel();
  st.param = make_tensor(dt, n, DATA_NORMAL, 0);
  st.grad = make_tensor(dt, n, DATA_EXACT, 0);
  st.codes = make_codes(n);
  st.magnitude = make_floats(st.nblocks(), 0.0, 2.0, 9);
  st.vmean = make_floats(st.nblocks(), 0.01, 1.0, 0);
  st.v_row = make_floats(st.rows, 0.01, 1.0, 0);
  st.v_col = make_floats(st.cols, 0.01, 1.0, 0);
  st.col_stats.assign((size_t)st.cols + 1, 0.0);
  st.row_stats.assign((size_t)(st.rows > 0 ? st.rows : 1), 0.0);
  return st;
}

/* Every piece of state bit for bit (floats NaN-equal). */
static inline void expect_same_state(const char *label, const AdamState &a, const AdamState &b) {
  EXPECT_SAME("param", a.param.data(), b.param.data(), a.numel(), a.dt, 1);
  EXPECT_SAME("codes", a.codes.data(), b.codes.data(), a.numel(), DT_U8, 0);
  EXPECT_SAME("magnitude", a.magnitude.data(), b.magnitude.data(), a.nblocks(), GEFEN_F32, 1);
  if (a.factored) {
    EXPECT_SAME("v_row", a.v_row.data(), b.v_row.data(), a.rows, GEFEN_F32, 1);
    EXPECT_SAME("v_col", a.v_col.data(), b.v_col.data(), a.cols, GEFEN_F32, 1);
  } else {
    EXPECT_SAME("vmean", a.vmean.data(), b.vmean.data(), a.nblocks(), GEFEN_F32, 1);
  }
}

#endif /* GEFEN_CUDA_TEST_CASES_H */
