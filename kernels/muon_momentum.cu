/*
 * GefenMuon's quantised momentum (ALGORITHM.md §7), mirroring muon.c:
 * one thread group per quantisation block,
 *   pass 1: m = mo + (1 - beta) (g - mo), mo = C[code] * magnitude; max|m|
 *   pass 2: the same m requantised (nearest), codes and magnitude written,
 *           out = beta * m_q + (1 - beta) * g (nesterov) or m_q, fp32 or bf16.
 * The two-pass layout and its exactness are those of adam_update.cu.
 */
#include "gefen_cuda_common.cuh"

typedef struct {
  const void *grad;
  uint8_t *codes;
  float *magnitude;
  void *out;
  int out_dtype;
  int64_t period, nblocks;
  int group;
  int nesterov;
  float beta, one_minus_beta;
} muon_args;

template <int DT>
__global__ void __launch_bounds__(GEFEN_CTA)
    muon_momentum_kernel(muon_args a, const gefen_quant_table *__restrict__ t) {
  const int G = a.group, per_cta = GEFEN_CTA / G;
  const int lane = threadIdx.x % G, slot = threadIdx.x / G;
  const int64_t P = a.period;
  for (int64_t first = (int64_t)blockIdx.x * per_cta; first < a.nblocks;
       first += (int64_t)gridDim.x * per_cta) {
    const int64_t b = first + slot, base = b * P;
    const bool active = b < a.nblocks;
    const float mag_old = active ? a.magnitude[b] : 0.0f;

    float mx = 0.0f;
    double unused = 0.0;
    if (active) {
      for (int64_t j = lane; j < P; j += G) {
        const float g = load_f32<DT>(a.grad, base + j);
        mx = max_abs(mx, muon_momentum(ro(&t->codebook[a.codes[base + j]]), mag_old, g,
                                       a.one_minus_beta));
      }
    }
    group_reduce(&mx, &unused, G);
    if (!active) continue;
    if (lane == 0) a.magnitude[b] = mx;

    for (int64_t j = lane; j < P; j += G) {
      const float g = load_f32<DT>(a.grad, base + j);
      const float m =
          muon_momentum(ro(&t->codebook[a.codes[base + j]]), mag_old, g, a.one_minus_beta);
      const uint8_t c = q_nearest(t, quant_input(m, mx));
      a.codes[base + j] = c;
      const float mq = f_mul(ro(&t->codebook[c]), mx);
      store_out(a.out, a.out_dtype, base + j,
                muon_output(mq, g, a.beta, a.one_minus_beta, a.nesterov));
    }
  }
}

extern "C" gefen_status gefen_cuda_muon_momentum(const gefen_muon_item *items, int64_t n,
                                                 const gefen_quant_table *device_table,
                                                 void *stream, gefen_error *err) {
  gefen_status st = gefen_muon_validate(items, n, err);
  if (st != GEFEN_OK) return st;
  if (!device_table) return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "quantizer table is NULL");
  const cudaStream_t s = (cudaStream_t)stream;
  for (int64_t i = 0; i < n; i++) {
    const gefen_muon_item *it = &items[i];
    if (it->rows == 0 || it->cols == 0) continue;
    muon_args a;
    a.grad = it->grad;
    a.codes = it->codes;
    a.magnitude = it->magnitude;
    a.out = it->out;
    a.out_dtype = (int)it->out_dtype;
    a.period = it->period;
    a.nblocks = it->rows * (it->cols / it->period);
    a.group = gefen_group_size(it->period);
    a.nesterov = it->nesterov;
    a.beta = (float)it->beta;
    a.one_minus_beta = (float)(1.0 - it->beta);
    const unsigned grid = gefen_grid(a.nblocks, GEFEN_CTA / a.group);
#define LAUNCH(DT) muon_momentum_kernel<DT><<<grid, GEFEN_CTA, 0, s>>>(a, device_table)
    GEFEN_DISPATCH_DTYPE(it->dtype, LAUNCH);
#undef LAUNCH
    st = gefen_cuda_launched("GefenMuon momentum", i, err);
    if (st != GEFEN_OK) return st;
  }
  return GEFEN_OK;
}
