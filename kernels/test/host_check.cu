/*
 * Host-only check of the CUDA kernels' math (no GPU needed): the
 * __host__ __device__ helpers of gefen_cuda_math.cuh and a sequential
 * emulation of every kernel's thread layout and reduction order
 * (emulate.h) against the CPU core.
 *
 *  - quantiser (lookup table, binary-search fallback, stochastic rounding,
 *    its uniform variate) against the core, on learned, padded and packed
 *    codebooks and on edge values;
 *  - dtype conversions against core_internal.h, exhaustively for 16-bit
 *    inputs and on a dense sample of fp32 inputs;
 *  - the Gefen step (block and factored, every dtype, nearest and stochastic,
 *    sharded rows) and GefenMuon's momentum over three steps; factored
 *    statistics and period statistics.
 * With EXACT data every float64 sum is exact, so everything must agree bit
 * for bit; with other data codes and magnitudes (which involve no sum) must
 * agree bit for bit and the rest to summation-order rounding.
 *
 * Build and run: kernels/test/run.sh (host part).
 */
#include "core_internal.h"

#include "cases.h"
#include "emulate.h"

/* ------------------------------------------------------------- quantiser */

static void check_quantizer(void) {
  for (int kind = 0; kind < 3; kind++) {
    float cb[256];
    make_codebook(kind, cb);
    gefen_quantizer *q = NULL;
    gefen_error err;
    if (gefen_quantizer_create(cb, &q, &err) != GEFEN_OK) {
      CHECK(0, "quantizer_create(%s): %s", codebook_name(kind), err.msg);
      continue;
    }
    const gefen_quant_table *t = gefen_quantizer_table(q);
    CHECK((kind == CB_PACKED) == (t->exact_lut == 0), "%s codebook: exact_lut %d",
          codebook_name(kind), t->exact_lut);
    std::vector<float> probes = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f,
                                 1.5f, -1.5f, nextafterf(1.0f, 2.0f), nextafterf(-1.0f, -2.0f),
                                 FLT_MIN, -FLT_MIN, 1e-40f, -1e-40f};
    for (int i = 0; i < 256; i++) {
      probes.push_back(cb[i]);
      probes.push_back(nextafterf(cb[i], -2.0f));
      probes.push_back(nextafterf(cb[i], 2.0f));
      if (i < 255) {
        const float mid = 0.5f * (cb[i] + cb[i + 1]);
        probes.push_back(mid);
        probes.push_back(nextafterf(mid, -2.0f));
        probes.push_back(nextafterf(mid, 2.0f));
      }
    }
    for (int b = 0; b <= GEFEN_LUT_BUCKETS; b += 7) { /* bucket edges */
      const float e = -1.0f + (float)b / (float)(GEFEN_LUT_BUCKETS / 2);
      probes.push_back(e);
      probes.push_back(nextafterf(e, -2.0f));
      probes.push_back(nextafterf(e, 2.0f));
    }
    for (int i = 0; i < 200000; i++) probes.push_back((float)uniform(-1.05, 1.05));
    for (size_t i = 0; i < probes.size(); i++) {
      const float u = probes[i];
      const uint8_t want = gefen_quantize_nearest(q, u), got = q_nearest(t, u);
      CHECK(want == got, "%s nearest(%a): core %d, cuda %d", codebook_name(kind), (double)u,
            want, got);
      const uint64_t seed = rng() % 1000;
      const int64_t gi = (int64_t)(rng() >> 20);
      const uint8_t sw = gefen_quantize_stochastic(q, u, seed, gi), sg = q_stochastic(t, u, seed, gi);
      CHECK(sw == sg, "%s stochastic(%a, %llu, %lld): core %d, cuda %d", codebook_name(kind),
            (double)u, (unsigned long long)seed, (long long)gi, sw, sg);
    }
    gefen_quantizer_destroy(q);
  }
  for (int i = 0; i < 100000; i++) {
    const uint64_t seed = rng();
    const int64_t gi = (int64_t)(rng() >> 1);
    const float a = gefen_sr_uniform(seed, gi), b = sr_uniform(seed, gi);
    CHECK(memcmp(&a, &b, sizeof a) == 0, "sr_uniform(%llu, %lld)", (unsigned long long)seed,
          (long long)gi);
  }
}

/* ----------------------------------------------------------- conversions */

static void check_conversions(void) {
  for (uint32_t h = 0; h < 65536; h++) {
    const float a = gefen_bf16_to_f32((uint16_t)h), b = bf16_to_f32((uint16_t)h);
    const float c = gefen_f16_to_f32((uint16_t)h), d = f16_to_f32((uint16_t)h);
    CHECK(memcmp(&a, &b, 4) == 0, "bf16 %04x", h);
    CHECK(memcmp(&c, &d, 4) == 0, "f16 %04x", h);
  }
  for (uint64_t u = 0; u <= 0xffffffffull; u += 251) {
    float f;
    const uint32_t bits = (uint32_t)u;
    memcpy(&f, &bits, 4);
    CHECK(gefen_f32_to_bf16(f) == f32_to_bf16(f), "f32->bf16 %08x", bits);
    CHECK(gefen_f32_to_f16(f) == f32_to_f16(f), "f32->f16 %08x", bits);
  }
}

/* ------------------------------------------------------------- Gefen step */

static void check_adam(void) {
  int n_cases = 0;
  for (int si = 0; si < kNumShapes; si++)
    for (gefen_dtype dt : kDtypes)
      for (int factored = 0; factored < 2; factored++)
        for (int kind = 0; kind < 3; kind++)
          for (int stochastic = 0; stochastic < 2; stochastic++) {
            const int cbk = (si + kind + stochastic) % 3; /* each codebook on every shape */
            float cb[256];
            make_codebook(cbk, cb);
            gefen_quantizer *q = NULL;
            gefen_error err;
            if (gefen_quantizer_create(cb, &q, &err) != GEFEN_OK) {
              CHECK(0, "quantizer: %s", err.msg);
              continue;
            }
            const gefen_quant_table *t = gefen_quantizer_table(q);
            const shape3 s = kShapes[si];
            const int64_t row_offset = (si % 2) * 5, extra = si % 3;
            AdamState core = make_adam_state(dt, s, factored, row_offset, extra);
            AdamState emu = core;
            char label[160];
            snprintf(label, sizeof label, "adam %s (%lld,%lld,P=%lld) %s %s %s cb=%s",
                     dtype_name(dt), (long long)s.rows, (long long)s.cols, (long long)s.period,
                     factored ? "factored" : "block", data_name(kind),
                     stochastic ? "stochastic" : "nearest", codebook_name(cbk));
            for (int64_t step = 1; step <= 3; step++) {
              core.grad = make_tensor(dt, core.numel(), kind, s.period);
              emu.grad = core.grad;
              gefen_adam_item ci = core.item(step, 1e-2, 0.1, stochastic);
              gefen_adam_item ei = emu.item(step, 1e-2, 0.1, stochastic);
              if (factored) {
                CHECK(gefen_adam_factored_stats(&ci, 1, 1, &err) == GEFEN_OK, "%s", err.msg);
                emu_adam_factored_stats(&ei, 1);
                if (kind == DATA_EXACT) {
                  EXPECT_SAME("row_stats", emu.row_stats.data(), core.row_stats.data(), s.rows,
                              GEFEN_F64, 1);
                  EXPECT_SAME("col_stats", emu.col_stats.data(), core.col_stats.data(),
                              s.cols + 1, GEFEN_F64, 1);
                } else {
                  EXPECT_CLOSE("row_stats", emu.row_stats.data(), core.row_stats.data(), s.rows,
                               GEFEN_F64, 1e-4);
                  EXPECT_CLOSE("col_stats", emu.col_stats.data(), core.col_stats.data(),
                               s.cols + 1, GEFEN_F64, 1e-4);
                }
                emu.col_stats = core.col_stats; /* the update sees the same statistics */
                emu.row_stats = core.row_stats;
              }
              CHECK(gefen_adam_update(&ci, 1, q, 1, &err) == GEFEN_OK, "%s", err.msg);
              emu_adam_update(&ei, 1, t);
              if (kind == DATA_EXACT) {
                expect_same_state(label, emu, core);
              } else {
                EXPECT_SAME("codes", emu.codes.data(), core.codes.data(), core.numel(), DT_U8, 0);
                EXPECT_SAME("magnitude", emu.magnitude.data(), core.magnitude.data(),
                            core.nblocks(), GEFEN_F32, 1);
                EXPECT_CLOSE("param", emu.param.data(), core.param.data(), core.numel(), dt, 1e-5);
                EXPECT_CLOSE("vmean", emu.vmean.data(), core.vmean.data(), core.nblocks(),
                             GEFEN_F32, 1e-4);
                EXPECT_CLOSE("v_row", emu.v_row.data(), core.v_row.data(), core.rows, GEFEN_F32,
                             1e-4);
                EXPECT_CLOSE("v_col", emu.v_col.data(), core.v_col.data(), core.cols, GEFEN_F32,
                             1e-4);
                emu = core; /* resynchronise before the next step */
              }
            }
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
            const shape3 s = kShapes[si];
            const int64_t n = s.rows * s.cols, nb = s.rows * (s.cols / s.period);
            const gefen_dtype odt = out_bf16 ? GEFEN_BF16 : GEFEN_F32;
            std::vector<uint8_t> codes_c = make_codes(n), codes_e = codes_c;
            std::vector<float> mag_c = make_floats(nb, 0.0, 2.0, 9), mag_e = mag_c;
            std::vector<uint8_t> out_c((size_t)(n > 0 ? n : 1) * 4, 0), out_e = out_c;
            char label[160];
            snprintf(label, sizeof label, "muon %s->%s (%lld,%lld,P=%lld) nesterov=%d %s cb=%s",
                     dtype_name(dt), dtype_name(odt), (long long)s.rows, (long long)s.cols,
                     (long long)s.period, nesterov, data_name(kind), codebook_name(cbk));
            for (int step = 0; step < 3; step++) {
              std::vector<uint8_t> grad = make_tensor(dt, n, kind, s.period);
              gefen_muon_item ci = {grad.data(), codes_c.data(), mag_c.data(), out_c.data(), dt,
                                    odt, s.rows, s.cols, s.period, 0.95, nesterov};
              gefen_muon_item ei = ci;
              ei.codes = codes_e.data();
              ei.magnitude = mag_e.data();
              ei.out = out_e.data();
              CHECK(gefen_muon_momentum(&ci, 1, q, 1, &err) == GEFEN_OK, "%s", err.msg);
              emu_muon_momentum(&ei, 1, gefen_quantizer_table(q));
              EXPECT_SAME("codes", codes_e.data(), codes_c.data(), n, DT_U8, 0);
              EXPECT_SAME("magnitude", mag_e.data(), mag_c.data(), nb, GEFEN_F32, 1);
              EXPECT_SAME("out", out_e.data(), out_c.data(), n, odt, 1);
            }
            gefen_quantizer_destroy(q);
            n_cases++;
          }
  printf("muon: %d cases x 3 steps\n", n_cases);
}

/* ------------------------------------------------------ period statistics */

static void check_period_stats(void) {
  static const int64_t shapes[][2] = {{8, 4096}, {1, 360}, {33, 120}, {5, 1}, {64, 6000},
                                      {3, 7}, {1, 1}, {0, 12}, {2, 5040}};
  int n_cases = 0;
  for (const auto &sh : shapes)
    for (gefen_dtype dt : kDtypes)
      for (int kind = 0; kind < 3; kind++) {
        const int64_t rows = sh[0], cols = sh[1], n = rows * cols;
        const int64_t nc = gefen_period_candidates(cols, n, NULL, 0);
        std::vector<int64_t> cands((size_t)(nc > 0 ? nc : 1));
        gefen_period_candidates(cols, n, cands.data(), nc);
        std::vector<uint8_t> g = make_tensor(dt, n, kind, 0);
        gefen_matrix m = {g.data(), dt, rows, cols};
        const size_t w = (size_t)(nc > 0 ? nc : 1) * GEFEN_PERIOD_STAT_WIDTH;
        std::vector<int64_t> sc(w, 0), se(w, 0);
        gefen_error err;
        CHECK(gefen_period_stats(&m, cands.data(), nc, sc.data(), 1, &err) == GEFEN_OK,
              "%s", err.msg);
        emu_period_stats(&m, cands.data(), nc, se.data());
        char label[128];
        snprintf(label, sizeof label, "period stats %s (%lld,%lld) %s", dtype_name(dt),
                 (long long)rows, (long long)cols, data_name(kind));
        /* the block variances differ in op order (group vs left to right):
         * compare the rounded sums closely and the counts exactly */
        std::vector<double> vc((size_t)(nc > 0 ? nc : 1)), ve = vc;
        std::vector<int64_t> nfc = std::vector<int64_t>(vc.size()), nfe = nfc, bc = nfc, be = nfc;
        for (int64_t k = 0; k < nc; k++) {
          const int64_t *a = &sc[(size_t)k * GEFEN_PERIOD_STAT_WIDTH];
          const int64_t *b = &se[(size_t)k * GEFEN_PERIOD_STAT_WIDTH];
          vc[k] = gefen_exact_sum_value(a);
          ve[k] = gefen_exact_sum_value(b);
          nfc[k] = a[GEFEN_PERIOD_STAT_NONFINITE];
          nfe[k] = b[GEFEN_PERIOD_STAT_NONFINITE];
          bc[k] = a[GEFEN_PERIOD_STAT_BLOCKS];
          be[k] = b[GEFEN_PERIOD_STAT_BLOCKS];
        }
        EXPECT_CLOSE("sums", ve.data(), vc.data(), nc, GEFEN_F64, 1e-12);
        CHECK(nfc == nfe, "%s: non-finite counts differ", label);
        CHECK(bc == be, "%s: block counts differ", label);
        n_cases++;
      }
  printf("period stats: %d cases\n", n_cases);
}

int main(void) {
  check_quantizer();
  printf("quantizer: done\n");
  check_conversions();
  printf("conversions: done\n");
  check_adam();
  check_muon();
  check_period_stats();
  if (g_failures) {
    printf("host_check: %d FAILURES\n", g_failures);
    return 1;
  }
  printf("host_check: all passed\n");
  return 0;
}
