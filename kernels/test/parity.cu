/*
 * GPU parity test of the CUDA kernels (needs a CUDA device).
 *
 *  - every launcher against the sequential emulation of emulate.h, bit for
 *    bit on every kind of data (the emulation has the kernels' exact
 *    reduction order; host_check.cu ties the emulation to the CPU core);
 *  - histogram and codes remap against the CPU core directly (integers);
 *  - determinism (two runs of a large step give the same bits), the
 *    caller-provided and the cudaMallocAsync scratch, error paths;
 *  - a rough bandwidth figure for one large step.
 *
 * Build and run: kernels/test/run.sh gpu
 */
#include <cuda_runtime.h>

#include "cases.h"
#include "emulate.h"
#include "gefen_cuda.h"

#define CUDA_OK(call)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(2);                                                                           \
    }                                                                                    \
  } while (0)

static cudaStream_t g_stream;

template <typename T>
static T *to_device(const std::vector<T> &v) {
  T *p = NULL;
  CUDA_OK(cudaMalloc((void **)&p, v.size() * sizeof(T) + 16));
  CUDA_OK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <typename T>
static void to_host(std::vector<T> &v, const T *p) {
  CUDA_OK(cudaMemcpy(v.data(), p, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
}
template <typename T>
static void upload(T *p, const std::vector<T> &v) {
  CUDA_OK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

static gefen_quant_table *device_table(const gefen_quantizer *q) {
  gefen_quant_table *d = NULL;
  gefen_error err;
  CUDA_OK(cudaMalloc((void **)&d, sizeof *d));
  CHECK(gefen_cuda_upload_table(d, gefen_quantizer_table(q), g_stream, &err) == GEFEN_OK, "%s",
        err.msg);
  return d;
}

/* The device twin of an AdamState. */
struct DevAdam {
  uint8_t *param, *grad, *codes;
  float *magnitude, *vmean, *v_row, *v_col;
  double *col_stats, *row_stats;

  explicit DevAdam(const AdamState &s) {
    param = to_device(s.param);
    grad = to_device(s.grad);
    codes = to_device(s.codes);
    magnitude = to_device(s.magnitude);
    vmean = to_device(s.vmean);
    v_row = to_device(s.v_row);
    v_col = to_device(s.v_col);
    col_stats = to_device(s.col_stats);
    row_stats = to_device(s.row_stats);
  }
  ~DevAdam() {
    void *ptrs[] = {param, grad, codes, magnitude, vmean, v_row, v_col, col_stats, row_stats};
    for (void *p : ptrs) cudaFree(p);
  }
  gefen_adam_item item(AdamState &host, int64_t step, int stochastic) {
    gefen_adam_item it = host.item(step, 1e-2, 0.1, stochastic);
    it.param = param;
    it.grad = grad;
    it.codes = codes;
    it.magnitude = magnitude;
    if (it.vmean) it.vmean = vmean;
    if (it.v_row) it.v_row = v_row;
    if (it.v_col) it.v_col = v_col;
    if (it.col_stats) it.col_stats = col_stats;
    if (it.row_stats) it.row_stats = row_stats;
    return it;
  }
  void download(AdamState &h) {
    to_host(h.param, (const uint8_t *)param);
    to_host(h.codes, (const uint8_t *)codes);
    to_host(h.magnitude, (const float *)magnitude);
    to_host(h.vmean, (const float *)vmean);
    to_host(h.v_row, (const float *)v_row);
    to_host(h.v_col, (const float *)v_col);
    to_host(h.col_stats, (const double *)col_stats);
    to_host(h.row_stats, (const double *)row_stats);
  }
};

/* One call of each launcher, with the launcher's own or a caller scratch. */
static gefen_status gpu_stats(const gefen_adam_item *it, int64_t n, int caller_scratch,
                              gefen_error *err) {
  if (!caller_scratch) return gefen_cuda_adam_factored_stats(it, n, NULL, 0, g_stream, err);
  const size_t bytes = gefen_cuda_adam_factored_stats_scratch_bytes(it, n);
  void *s = NULL;
  if (bytes) CUDA_OK(cudaMalloc(&s, bytes));
  gefen_status st = gefen_cuda_adam_factored_stats(it, n, s, bytes, g_stream, err);
  CUDA_OK(cudaStreamSynchronize(g_stream));
  cudaFree(s);
  return st;
}
static gefen_status gpu_update(const gefen_adam_item *it, int64_t n, const gefen_quant_table *t,
                               int caller_scratch, gefen_error *err) {
  if (!caller_scratch) return gefen_cuda_adam_update(it, n, t, NULL, 0, g_stream, err);
  const size_t bytes = gefen_cuda_adam_update_scratch_bytes(it, n);
  void *s = NULL;
  if (bytes) CUDA_OK(cudaMalloc(&s, bytes));
  gefen_status st = gefen_cuda_adam_update(it, n, t, s, bytes, g_stream, err);
  CUDA_OK(cudaStreamSynchronize(g_stream));
  cudaFree(s);
  return st;
}

/* ------------------------------------------------------------- Gefen step */

static void check_adam(void) {
  int n_cases = 0;
  for (int si = 0; si < kNumShapes; si++)
    for (gefen_dtype dt : kDtypes)
      for (int factored = 0; factored < 2; factored++)
        for (int kind = 0; kind < 3; kind++)
          for (int stochastic = 0; stochastic < 2; stochastic++) {
            const int cbk = (si + kind + stochastic) % 3;
            float cb[256];
            make_codebook(cbk, cb);
            gefen_quantizer *q = NULL;
            gefen_error err;
            if (gefen_quantizer_create(cb, &q, &err) != GEFEN_OK) {
              CHECK(0, "quantizer: %s", err.msg);
              continue;
            }
            gefen_quant_table *dtab = device_table(q);
            const shape3 s = kShapes[si];
            AdamState emu = make_adam_state(dt, s, factored, (si % 2) * 5, si % 3);
            AdamState got = emu;
            DevAdam dev(emu);
            char label[160];
            snprintf(label, sizeof label, "adam %s (%lld,%lld,P=%lld) %s %s %s cb=%s",
                     dtype_name(dt), (long long)s.rows, (long long)s.cols, (long long)s.period,
                     factored ? "factored" : "block", data_name(kind),
                     stochastic ? "stochastic" : "nearest", codebook_name(cbk));
            for (int64_t step = 1; step <= 3; step++) {
              emu.grad = make_tensor(dt, emu.numel(), kind, s.period);
              upload(dev.grad, emu.grad);
              gefen_adam_item ei = emu.item(step, 1e-2, 0.1, stochastic);
              gefen_adam_item di = dev.item(got, step, stochastic);
              const int caller_scratch = (int)((step + si) % 2);
              if (factored) {
                emu_adam_factored_stats(&ei, 1);
                CHECK(gpu_stats(&di, 1, caller_scratch, &err) == GEFEN_OK, "%s: %s", label, err.msg);
              }
              emu_adam_update(&ei, 1, gefen_quantizer_table(q));
              CHECK(gpu_update(&di, 1, dtab, caller_scratch, &err) == GEFEN_OK, "%s: %s", label,
                    err.msg);
              CUDA_OK(cudaStreamSynchronize(g_stream));
              dev.download(got);
              if (factored) {
                EXPECT_SAME("row_stats", got.row_stats.data(), emu.row_stats.data(), s.rows,
                            GEFEN_F64, 1);
                EXPECT_SAME("col_stats", got.col_stats.data(), emu.col_stats.data(), s.cols + 1,
                            GEFEN_F64, 1);
              }
              expect_same_state(label, got, emu);
            }
            cudaFree(dtab);
            gefen_quantizer_destroy(q);
            n_cases++;
          }
  printf("adam: %d cases x 3 steps\n", n_cases);
}

/* ------------------------------------------------------ GefenMuon momentum */

static void check_muon(void) {
  int n_cases = 0;
  for (int si = 0; si < kNumShapes; si++)
    for (gefen_dtype dt : kDtypes)
      for (int out_bf16 = 0; out_bf16 < 2; out_bf16++)
        for (int nesterov = 0; nesterov < 2; nesterov++)
          for (int kind = 0; kind < 3; kind++) {
            const int cbk = (si + kind + nesterov) % 3;
            float cb[256];
            make_codebook(cbk, cb);
            gefen_quantizer *q = NULL;
            gefen_error err;
            if (gefen_quantizer_create(cb, &q, &err) != GEFEN_OK) {
              CHECK(0, "quantizer: %s", err.msg);
              continue;
            }
            gefen_quant_table *dtab = device_table(q);
            const shape3 s = kShapes[si];
            const int64_t n = s.rows * s.cols, nb = s.rows * (s.cols / s.period);
            const gefen_dtype odt = out_bf16 ? GEFEN_BF16 : GEFEN_F32;
            std::vector<uint8_t> codes = make_codes(n), codes_got = codes;
            std::vector<float> mag = make_floats(nb, 0.0, 2.0, 9), mag_got = mag;
            std::vector<uint8_t> out((size_t)(n > 0 ? n : 1) * 4, 0), out_got = out;
            uint8_t *d_codes = to_device(codes), *d_out = to_device(out);
            float *d_mag = to_device(mag);
            char label[160];
            snprintf(label, sizeof label, "muon %s->%s (%lld,%lld,P=%lld) nesterov=%d %s cb=%s",
                     dtype_name(dt), dtype_name(odt), (long long)s.rows, (long long)s.cols,
                     (long long)s.period, nesterov, data_name(kind), codebook_name(cbk));
            for (int step = 0; step < 3; step++) {
              std::vector<uint8_t> grad = make_tensor(dt, n, kind, s.period);
              uint8_t *d_grad = to_device(grad);
              gefen_muon_item ei = {grad.data(), codes.data(), mag.data(), out.data(), dt,
                                    odt, s.rows, s.cols, s.period, 0.95, nesterov};
              gefen_muon_item di = {d_grad, d_codes, d_mag, d_out, dt,
                                    odt, s.rows, s.cols, s.period, 0.95, nesterov};
              emu_muon_momentum(&ei, 1, gefen_quantizer_table(q));
              CHECK(gefen_cuda_muon_momentum(&di, 1, dtab, g_stream, &err) == GEFEN_OK, "%s: %s",
                    label, err.msg);
              CUDA_OK(cudaStreamSynchronize(g_stream));
              to_host(codes_got, (const uint8_t *)d_codes);
              to_host(mag_got, (const float *)d_mag);
              to_host(out_got, (const uint8_t *)d_out);
              EXPECT_SAME("codes", codes_got.data(), codes.data(), n, DT_U8, 0);
              EXPECT_SAME("magnitude", mag_got.data(), mag.data(), nb, GEFEN_F32, 1);
              EXPECT_SAME("out", out_got.data(), out.data(), n, odt, 1);
              cudaFree(d_grad);
            }
            cudaFree(d_codes);
            cudaFree(d_out);
            cudaFree(d_mag);
            cudaFree(dtab);
            gefen_quantizer_destroy(q);
            n_cases++;
          }
  printf("muon: %d cases x 3 steps\n", n_cases);
}

/* ---------------------------------------- period statistics and histogram */

static const int64_t kStatShapes[][2] = {{8, 4096}, {1, 360}, {33, 120}, {5, 1}, {64, 6000},
                                         {3, 7},    {1, 1},   {0, 12},   {2, 5040}, {300, 96}};

static void check_period_stats(void) {
  int n_cases = 0;
  for (const auto &sh : kStatShapes)
    for (gefen_dtype dt : kDtypes)
      for (int kind = 0; kind < 3; kind++) {
        const int64_t rows = sh[0], cols = sh[1], n = rows * cols;
        const int64_t nc = gefen_period_candidates(cols, n, NULL, 0);
        std::vector<int64_t> cands((size_t)(nc > 0 ? nc : 1));
        gefen_period_candidates(cols, n, cands.data(), nc);
        std::vector<uint8_t> g = make_tensor(dt, n, kind, 0);
        gefen_matrix m = {g.data(), dt, rows, cols};
        const size_t w = (size_t)(nc > 0 ? nc : 1) * GEFEN_PERIOD_STAT_WIDTH;
        std::vector<int64_t> se(w, 0), sg(w, 0);
        emu_period_stats(&m, cands.data(), nc, se.data());
        uint8_t *d_g = to_device(g);
        int64_t *d_s = to_device(sg);
        gefen_matrix dm = {d_g, dt, rows, cols};
        gefen_error err;
        CHECK(gefen_cuda_period_stats(&dm, cands.data(), nc, d_s, NULL, 0, g_stream, &err) ==
                  GEFEN_OK, "%s", err.msg);
        CUDA_OK(cudaStreamSynchronize(g_stream));
        to_host(sg, (const int64_t *)d_s);
        char label[128];
        snprintf(label, sizeof label, "period stats %s (%lld,%lld) %s", dtype_name(dt),
                 (long long)rows, (long long)cols, data_name(kind));
        /* same block variances, exact sums: identical once carries are propagated */
        for (int64_t k = 0; k < nc; k++) {
          (void)gefen_xsum_normalize(&sg[(size_t)k * GEFEN_PERIOD_STAT_WIDTH]);
          (void)gefen_xsum_normalize(&se[(size_t)k * GEFEN_PERIOD_STAT_WIDTH]);
        }
        CHECK(sg == se, "%s: statistics differ from the emulation", label);
        cudaFree(d_g);
        cudaFree(d_s);
        n_cases++;
      }
  printf("period stats: %d cases\n", n_cases);
}

static void check_histogram(void) {
  int n_cases = 0;
  for (const auto &sh : kStatShapes)
    for (gefen_dtype dt : kDtypes)
      for (int kind = 0; kind < 3; kind++) {
        const int64_t rows = sh[0], cols = sh[1], n = rows * cols;
        const int64_t nc = gefen_period_candidates(cols, n > 1 ? n : 2, NULL, 0);
        std::vector<int64_t> periods((size_t)(nc > 0 ? nc : 1), 1);
        gefen_period_candidates(cols, n > 1 ? n : 2, periods.data(), nc);
        std::vector<uint8_t> g = make_tensor(dt, n, kind, 16);
        uint8_t *d_g = to_device(g);
        for (int64_t p : periods) {
          std::vector<int64_t> hc(GEFEN_HIST_BINS, 0), hg = hc;
          gefen_matrix m = {g.data(), dt, rows, cols}, dm = {d_g, dt, rows, cols};
          gefen_error err;
          CHECK(gefen_histogram(&m, p, hc.data(), 1, &err) == GEFEN_OK, "%s", err.msg);
          int64_t *d_h = to_device(hg);
          CHECK(gefen_cuda_histogram(&dm, p, d_h, g_stream, &err) == GEFEN_OK, "%s", err.msg);
          CUDA_OK(cudaStreamSynchronize(g_stream));
          to_host(hg, (const int64_t *)d_h);
          char label[128];
          snprintf(label, sizeof label, "histogram %s (%lld,%lld,P=%lld) %s", dtype_name(dt),
                   (long long)rows, (long long)cols, (long long)p, data_name(kind));
          EXPECT_SAME("hist", hg.data(), hc.data(), GEFEN_HIST_BINS, GEFEN_F64 /*8 bytes*/, 0);
          cudaFree(d_h);
          n_cases++;
        }
        cudaFree(d_g);
      }
  printf("histogram: %d cases\n", n_cases);
}

static void check_remap(void) {
  const int64_t n = 1000003;
  std::vector<uint8_t> codes = make_codes(n), map = make_codes(256), got = codes;
  uint8_t *d_codes = to_device(codes), *d_map = to_device(map);
  gefen_error err;
  CHECK(gefen_codes_remap(codes.data(), n, map.data(), 1, &err) == GEFEN_OK, "%s", err.msg);
  CHECK(gefen_cuda_codes_remap(d_codes, n, d_map, g_stream, &err) == GEFEN_OK, "%s", err.msg);
  CUDA_OK(cudaStreamSynchronize(g_stream));
  to_host(got, (const uint8_t *)d_codes);
  const char *label = "codes remap";
  EXPECT_SAME("codes", got.data(), codes.data(), n, DT_U8, 0);
  cudaFree(d_codes);
  cudaFree(d_map);
}

/* ------------------------------------- determinism, errors, a timing */

static void check_determinism_and_errors(void) {
  float cb[256];
  make_codebook(CB_LEARNED, cb);
  gefen_quantizer *q = NULL;
  gefen_error err;
  CHECK(gefen_quantizer_create(cb, &q, &err) == GEFEN_OK, "%s", err.msg);
  gefen_quant_table *dtab = device_table(q);
  for (int factored = 0; factored < 2; factored++) {
    const shape3 s = {1024, 4096, 128};
    AdamState base = make_adam_state(GEFEN_BF16, s, factored, 0, 0);
    base.grad = make_tensor(GEFEN_BF16, base.numel(), DATA_NORMAL, s.period);
    AdamState out1 = base, out2 = base;
    for (int run = 0; run < 2; run++) {
      DevAdam dev(base);
      gefen_adam_item di = dev.item(base, 7, 1);
      if (factored) CHECK(gpu_stats(&di, 1, run, &err) == GEFEN_OK, "%s", err.msg);
      CHECK(gpu_update(&di, 1, dtab, run, &err) == GEFEN_OK, "%s", err.msg);
      CUDA_OK(cudaStreamSynchronize(g_stream));
      dev.download(run ? out2 : out1);
    }
    const char *label = factored ? "determinism factored" : "determinism block";
    expect_same_state(label, out1, out2);
    if (factored)
      EXPECT_SAME("col_stats", out1.col_stats.data(), out2.col_stats.data(), s.cols + 1,
                  GEFEN_F64, 1);
  }
  /* errors: bad items are refused before any launch; small scratch refused */
  AdamState st = make_adam_state(GEFEN_F32, {4, 8, 4}, true, 0, 0);
  DevAdam dev(st);
  gefen_adam_item it = dev.item(st, 1, 0);
  it.period = 3;
  CHECK(gefen_cuda_adam_update(&it, 1, dtab, NULL, 0, g_stream, &err) == GEFEN_EVALUE &&
            err.item == 0, "bad period accepted: %s", err.msg);
  it.period = 4;
  char small[16];
  CHECK(gefen_cuda_adam_update(&it, 1, dtab, small, 4, g_stream, &err) == GEFEN_EVALUE,
        "small scratch accepted");
  CHECK(gefen_cuda_adam_update(&it, 1, NULL, NULL, 0, g_stream, &err) == GEFEN_EVALUE,
        "NULL table accepted");
  cudaFree(dtab);
  gefen_quantizer_destroy(q);
  printf("determinism and errors: done\n");
}

static void time_large_step(void) {
  float cb[256];
  make_codebook(CB_LEARNED, cb);
  gefen_quantizer *q = NULL;
  gefen_error err;
  CHECK(gefen_quantizer_create(cb, &q, &err) == GEFEN_OK, "%s", err.msg);
  gefen_quant_table *dtab = device_table(q);
  const shape3 shapes[] = {{4096, 4096, 4096}, {4096, 4096, 128}, {4096, 4096, 32}};
  for (const shape3 &s : shapes)
    for (int factored = 0; factored < 2; factored++) {
      AdamState st = make_adam_state(GEFEN_BF16, s, factored, 0, 0);
      DevAdam dev(st);
      gefen_adam_item it = dev.item(st, 3, 0);
      cudaEvent_t a, b;
      cudaEventCreate(&a);
      cudaEventCreate(&b);
      const int reps = 20;
      for (int r = 0; r <= reps; r++) {
        if (r == 1) cudaEventRecord(a, g_stream);
        if (factored) gefen_cuda_adam_factored_stats(&it, 1, NULL, 0, g_stream, &err);
        gefen_cuda_adam_update(&it, 1, dtab, NULL, 0, g_stream, &err);
      }
      cudaEventRecord(b, g_stream);
      CUDA_OK(cudaEventSynchronize(b));
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, a, b);
      ms /= reps;
      /* bf16 p (r+w), g (r; r twice when factored), codes (r+w) */
      const double bytes = (double)st.numel() * (2 + 2 + 2 + 2 + (factored ? 2 : 0));
      printf("time bf16 %lldx%lld P=%lld %s: %.3f ms/step, %.0f GB/s effective\n",
             (long long)s.rows, (long long)s.cols, (long long)s.period,
             factored ? "factored" : "block", ms, bytes / (ms * 1e-3) / 1e9);
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
  cudaFree(dtab);
  gefen_quantizer_destroy(q);
}

int main(void) {
  if (gefen_cuda_device_count() == 0) {
    printf("parity: no CUDA device, skipped\n");
    return 77;
  }
  CUDA_OK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  check_adam();
  check_muon();
  check_period_stats();
  check_histogram();
  check_remap();
  check_determinism_and_errors();
  time_large_step();
  if (g_failures) {
    printf("parity: %d FAILURES\n", g_failures);
    return 1;
  }
  printf("parity: all passed\n");
  return 0;
}
