/*
 * A sequential host emulation of the CUDA kernels: the same per-element
 * helpers (gefen_cuda_math.cuh), the same thread-group layout and the same
 * fixed reduction order (gefen_cuda_common.cuh). The GPU must match it bit
 * for bit on any data (kernels/test/parity.cu); it must match the CPU core
 * bit for bit wherever the core's float64 sums are exact
 * (kernels/test/host_check.cu).
 *
 * All pointers in the items are host pointers here.
 */
#ifndef GEFEN_CUDA_TEST_EMULATE_H
#define GEFEN_CUDA_TEST_EMULATE_H

#include <stdlib.h>
#include <vector>

#include "gefen_cuda_common.cuh"
#include "gefen_xsum.h"

/* ------------------------------------------------- the group reduction */

/* The order of group_reduce: butterfly over min(G, 32) lanes (every lane
 * ends with the same value; lane 0's is returned), then the warps of the
 * group in ascending order. */
static inline double emu_group_sum(const double *lane, int G) {
  std::vector<double> v(lane, lane + G), next(G);
  const int width = G < 32 ? G : 32;
  for (int off = width >> 1; off > 0; off >>= 1) {
    for (int i = 0; i < G; i++) next[i] = v[i] + v[i ^ off];
    v.swap(next);
  }
  double s = v[0];
  for (int w = 1; w < G / 32; w++) s = s + v[w * 32];
  return s;
}

static inline float emu_group_max(const float *lane, int G) {
  float m = lane[0];
  for (int i = 1; i < G; i++) m = lane[i] > m ? lane[i] : m;
  return m;
}

/* --------------------------------------------------------- Gefen update */

template <int DT>
static inline void emu_adam_item(const gefen_adam_item *it, const gefen_quant_table *t) {
  const int factored = it->vmean == NULL;
  const adam_consts k = adam_make_consts(it);
  std::vector<float> scol(it->cols > 0 ? (size_t)it->cols : 1);
  if (factored) { /* adam_factored_prepare_kernel */
    if (it->global_rows > 0)
      for (int64_t j = 0; j < it->cols; j++) {
        const float denom = factored_denom(it->col_stats[it->cols], it->global_rows);
        const float vc = factored_vcol(k, it->v_col[j], it->col_stats[j], it->global_rows);
        it->v_col[j] = vc;
        scol[j] = factored_scol(k, vc, denom);
      }
    if (it->cols > 0)
      for (int64_t r = 0; r < it->rows; r++)
        it->v_row[r] = factored_vrow(k.beta2, k.one_minus_beta2, it->v_row[r], it->row_stats[r]);
  }
  if (it->rows == 0 || it->cols == 0) return;
  const int64_t P = it->period, bpr = it->cols / P, nblocks = it->rows * bpr;
  const int G = gefen_group_size(P);
  std::vector<float> lmx(G);
  std::vector<double> lsq(G);
  for (int64_t b = 0; b < nblocks; b++) { /* adam_update_kernel, one group */
    const int64_t base = b * P;
    const float mag_old = it->magnitude[b];
    const float vmean_old = factored ? 0.0f : it->vmean[b];
    for (int lane = 0; lane < G; lane++) {
      lmx[lane] = 0.0f;
      lsq[lane] = 0.0;
      for (int64_t j = lane; j < P; j += G) {
        const float g = load_f32<DT>(it->grad, base + j);
        const float m = adam_momentum(t->codebook[it->codes[base + j]], mag_old, g, k.beta1,
                                      k.one_minus_beta1);
        lmx[lane] = max_abs(lmx[lane], m);
        if (!factored) lsq[lane] = add_sq(lsq[lane], g);
      }
    }
    const float mx = emu_group_max(lmx.data(), G);
    const double sum_sq = emu_group_sum(lsq.data(), G);
    float s = 0.0f, srow = 0.0f;
    int64_t col0 = 0;
    if (factored) {
      srow = f_sqrt(it->v_row[b / bpr]);
      col0 = (b % bpr) * P;
    } else {
      const float vm = block_vmean(k, vmean_old, sum_sq, P);
      it->vmean[b] = vm;
      s = block_step(k, vm);
    }
    it->magnitude[b] = mx;
    for (int64_t j = 0; j < P; j++) {
      const float g = load_f32<DT>(it->grad, base + j);
      const float m = adam_momentum(t->codebook[it->codes[base + j]], mag_old, g, k.beta1,
                                    k.one_minus_beta1);
      const uint8_t c = quantize(t, quant_input(m, mx), it->stochastic_round, it->seed,
                                 it->row_offset * it->cols + base + j);
      it->codes[base + j] = c;
      const float mq = f_mul(t->codebook[c], mx);
      const float sj = factored ? factored_step(k, srow, scol[col0 + j]) : s;
      apply_update<DT>(it->param, base + j, f_mul(mq, sj), k.decay, k.lr);
    }
  }
}

static inline void emu_adam_update(const gefen_adam_item *items, int64_t n, const gefen_quant_table *t) {
  for (int64_t i = 0; i < n; i++) {
#define EMU(DT) emu_adam_item<DT>(&items[i], t)
    GEFEN_DISPATCH_DTYPE(items[i].dtype, EMU);
#undef EMU
  }
}

/* ------------------------------------------------- factored statistics */

template <int DT>
static inline void emu_factored_stats_item(const gefen_adam_item *it) {
  const int64_t rows = it->rows, cols = it->cols;
  if (rows == 0 || cols == 0) {
    for (int64_t j = 0; j <= cols; j++) it->col_stats[j] = 0.0;
    return;
  }
  const int G = gefen_group_size(cols);
  std::vector<double> lane(GEFEN_CTA);
  for (int64_t r = 0; r < rows; r++) { /* factored_row_stats_kernel */
    for (int l = 0; l < G; l++) {
      lane[l] = 0.0;
      for (int64_t j = l; j < cols; j += G) lane[l] = add_sq(lane[l], load_f32<DT>(it->grad, r * cols + j));
    }
    it->row_stats[r] = d_div(emu_group_sum(lane.data(), G), (double)cols);
  }
  const int64_t nchunk = gefen_col_chunks(rows, cols);
  for (int64_t j = 0; j < cols; j++) { /* factored_col_partial + finish */
    double total = 0.0;
    for (int64_t c = 0; c < nchunk; c++) {
      double acc = 0.0;
      for (int64_t r = rows * c / nchunk; r < rows * (c + 1) / nchunk; r++)
        acc = add_sq(acc, load_f32<DT>(it->grad, r * cols + j));
      total = d_add(total, acc);
    }
    it->col_stats[j] = total;
  }
  const float beta2 = (float)it->beta2, omb2 = (float)(1.0 - it->beta2);
  for (int l = 0; l < GEFEN_CTA; l++) {
    lane[l] = 0.0;
    for (int64_t r = l; r < rows; r += GEFEN_CTA)
      lane[l] = d_add(lane[l], (double)factored_vrow(beta2, omb2, it->v_row[r], it->row_stats[r]));
  }
  it->col_stats[cols] = emu_group_sum(lane.data(), GEFEN_CTA);
}

static inline void emu_adam_factored_stats(const gefen_adam_item *items, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (items[i].vmean) continue;
#define EMU(DT) emu_factored_stats_item<DT>(&items[i])
    GEFEN_DISPATCH_DTYPE(items[i].dtype, EMU);
#undef EMU
  }
}

/* ----------------------------------------------------- GefenMuon momentum */

template <int DT>
static inline void emu_muon_item(const gefen_muon_item *it, const gefen_quant_table *t) {
  if (it->rows == 0 || it->cols == 0) return;
  const int64_t P = it->period, nblocks = it->rows * (it->cols / P);
  const int G = gefen_group_size(P);
  const float beta = (float)it->beta, omb = (float)(1.0 - it->beta);
  std::vector<float> lmx(G);
  for (int64_t b = 0; b < nblocks; b++) {
    const int64_t base = b * P;
    const float mag_old = it->magnitude[b];
    for (int lane = 0; lane < G; lane++) {
      lmx[lane] = 0.0f;
      for (int64_t j = lane; j < P; j += G)
        lmx[lane] = max_abs(lmx[lane], muon_momentum(t->codebook[it->codes[base + j]], mag_old,
                                                     load_f32<DT>(it->grad, base + j), omb));
    }
    const float mx = emu_group_max(lmx.data(), G);
    it->magnitude[b] = mx;
    for (int64_t j = 0; j < P; j++) {
      const float g = load_f32<DT>(it->grad, base + j);
      const float m = muon_momentum(t->codebook[it->codes[base + j]], mag_old, g, omb);
      const uint8_t c = q_nearest(t, quant_input(m, mx));
      it->codes[base + j] = c;
      const float mq = f_mul(t->codebook[c], mx);
      store_out(it->out, (int)it->out_dtype, base + j, muon_output(mq, g, beta, omb, it->nesterov));
    }
  }
}

static inline void emu_muon_momentum(const gefen_muon_item *items, int64_t n, const gefen_quant_table *t) {
  for (int64_t i = 0; i < n; i++) {
#define EMU(DT) emu_muon_item<DT>(&items[i], t)
    GEFEN_DISPATCH_DTYPE(items[i].dtype, EMU);
#undef EMU
  }
}

/* ---------------------------------------------------- period statistics */

template <int DT>
static inline void emu_period_stats_t(const gefen_matrix *g, const int64_t *cands, int64_t n_cands,
                               int64_t *stats) {
  const int64_t rows = g->rows, cols = g->cols;
  if (rows == 0 || cols == 0) return;
  for (int64_t k = 0; k < n_cands; k++) {
    const int64_t d = cands[k], nblocks = rows * (cols / d);
    int64_t *out = stats + k * GEFEN_PERIOD_STAT_WIDTH;
    if (d > 1) {
      const int G = gefen_group_size(d);
      std::vector<double> lane(G);
      /* exact sums: the CTA and slot a block lands in do not matter */
      for (int64_t b = 0; b < nblocks; b++) {
        const int64_t base = b * d;
        for (int l = 0; l < G; l++) {
          lane[l] = 0.0;
          for (int64_t j = l; j < d; j += G) lane[l] = add_sq(lane[l], load_f32<DT>(g->data, base + j));
        }
        const double mean = d_div(emu_group_sum(lane.data(), G), (double)d);
        for (int l = 0; l < G; l++) {
          lane[l] = 0.0;
          for (int64_t j = l; j < d; j += G) {
            const float x = load_f32<DT>(g->data, base + j);
            const double dv = d_sub((double)f_mul(x, x), mean);
            lane[l] = d_add(lane[l], d_mul(dv, dv));
          }
        }
        const double var = d_div(emu_group_sum(lane.data(), G), (double)d);
        if (!gefen_xsum_accepts(var))
          out[GEFEN_PERIOD_STAT_NONFINITE]++;
        else
          gefen_xsum_add(out, var);
      }
      (void)gefen_xsum_normalize(out);
    }
    out[GEFEN_PERIOD_STAT_BLOCKS] += nblocks;
  }
}

static inline void emu_period_stats(const gefen_matrix *g, const int64_t *cands, int64_t n_cands,
                             int64_t *stats) {
#define EMU(DT) emu_period_stats_t<DT>(g, cands, n_cands, stats)
  GEFEN_DISPATCH_DTYPE(g->dtype, EMU);
#undef EMU
}

#endif /* GEFEN_CUDA_TEST_EMULATE_H */
