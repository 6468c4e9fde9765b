/*
 * Launch plumbing shared by the kernels: the fixed thread-group layout, the
 * deterministic group reduction, host-side error reporting and scratch.
 *
 * Thread groups. Most kernels work on "units" of `len` consecutive elements
 * (a quantisation block, a row, a variance block). A unit is handled by a
 * group of G threads, G = the power of two >= len capped at 256 (so 1, 2, 4,
 * ..., 256); a CTA of 256 threads holds 256 / G groups. Thread `lane` of a
 * group handles elements lane, lane + G, lane + 2G, ... in that order, so its
 * partial results are a fixed function of (len, lane). G depends only on
 * len, never on the device, the grid size or the scheduling: every reduction
 * below therefore has one fixed order, and results are reproducible
 * bit for bit.
 */
#ifndef GEFEN_CUDA_COMMON_CUH
#define GEFEN_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "gefen_core.h"
#include "gefen_cuda.h"
#include "gefen_cuda_math.cuh"

#define GEFEN_CTA 256           /* threads per CTA of every group kernel */
#define GEFEN_MAX_GRID (1 << 20) /* grid-stride loops beyond this many CTAs */

/* ----------------------------------------------------------- device side */

/* Reduces (max, sum) over the G threads of each group: max of the fp32 values
 * (NaN never wins) and sum of the float64 values. Every thread of the group
 * gets the same result. Must be called by every thread of the CTA (G is
 * uniform). Order: a butterfly inside each warp (lane i adds its partner's
 * value, and a + b == b + a bitwise, so all lanes agree), then for G > 32 the
 * warps of the group in ascending order. */
__device__ __forceinline__ void group_reduce(float *mx, double *sum, int G) {
  __shared__ float warp_max[GEFEN_CTA / 32];
  __shared__ double warp_sum[GEFEN_CTA / 32];
  const int width = G < 32 ? G : 32;
  for (int off = width >> 1; off > 0; off >>= 1) {
    const float m = __shfl_xor_sync(0xffffffffu, *mx, off);
    const double s = __shfl_xor_sync(0xffffffffu, *sum, off);
    *mx = m > *mx ? m : *mx;
    *sum = d_add(*sum, s);
  }
  if (G <= 32) {
    __syncwarp(); /* orders the group's earlier reads before its later writes */
    return;
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    warp_max[warp] = *mx;
    warp_sum[warp] = *sum;
  }
  __syncthreads();
  const int first = (threadIdx.x / G) * (G >> 5);
  float m = warp_max[first];
  double s = warp_sum[first];
  for (int w = 1; w < (G >> 5); w++) {
    m = warp_max[first + w] > m ? warp_max[first + w] : m;
    s = d_add(s, warp_sum[first + w]);
  }
  *mx = m;
  *sum = s;
  __syncthreads(); /* the shared slots are reused by the next call */
}

/* ------------------------------------------------------------- host side */

/* Group size for units of len elements (see the top of this file). */
static inline int gefen_group_size(int64_t len) {
  int g = 1;
  while (g < len && g < GEFEN_CTA) g <<= 1;
  return g;
}

/* CTAs for `units` units at `per_cta` units per CTA, capped (the kernels
 * loop); at least 1. */
static inline unsigned gefen_grid(int64_t units, int64_t per_cta) {
  int64_t n = (units + per_cta - 1) / per_cta;
  if (n > GEFEN_MAX_GRID) n = GEFEN_MAX_GRID;
  return (unsigned)(n > 0 ? n : 1);
}

/* Row chunks of the factored column sums: enough threads (cols per chunk) to
 * fill a large GPU, a fixed function of the shape. */
#define GEFEN_COL_TARGET_THREADS (1 << 18)
#define GEFEN_COL_MAX_CHUNKS 1024
static inline int64_t gefen_col_chunks(int64_t rows, int64_t cols) {
  int64_t want = cols > 0 ? (GEFEN_COL_TARGET_THREADS + cols - 1) / cols : 1;
  if (want > GEFEN_COL_MAX_CHUNKS) want = GEFEN_COL_MAX_CHUNKS;
  if (want > rows) want = rows;
  return want > 0 ? want : 1;
}

/* CTAs (= partial sums) of one period-statistics candidate. */
#define GEFEN_PERIOD_MAX_CTAS 512
static inline unsigned gefen_period_ctas(int64_t nblocks, int G) {
  const int64_t per_cta = GEFEN_CTA / G, ctas = (nblocks + per_cta - 1) / per_cta;
  return (unsigned)(ctas < GEFEN_PERIOD_MAX_CTAS ? ctas : GEFEN_PERIOD_MAX_CTAS);
}

static inline void gefen_cuda_clear(gefen_error *err) {
  if (err) {
    err->msg[0] = '\0';
    err->item = -1;
  }
}

static inline gefen_status gefen_cuda_fail(gefen_error *err, gefen_status status, int64_t item,
                                           const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
static inline gefen_status gefen_cuda_fail(gefen_error *err, gefen_status status, int64_t item,
                                           const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    err->item = item;
  }
  return status;
}

/* GEFEN_ERUNTIME naming the CUDA error, or GEFEN_OK. */
static inline gefen_status gefen_cuda_check(cudaError_t e, const char *what, int64_t item,
                                            gefen_error *err) {
  if (e == cudaSuccess) return GEFEN_OK;
  return gefen_cuda_fail(err, e == cudaErrorMemoryAllocation ? GEFEN_ENOMEM : GEFEN_ERUNTIME,
                         item, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/* After a launch: a bad configuration or an earlier asynchronous fault. */
static inline gefen_status gefen_cuda_launched(const char *what, int64_t item,
                                               gefen_error *err) {
  return gefen_cuda_check(cudaGetLastError(), what, item, err);
}

/* Device scratch: the caller's buffer, or one allocated on the stream. */
typedef struct {
  void *ptr;
  int owned;
  cudaStream_t stream;
} gefen_cuda_scratch;

static inline gefen_status gefen_scratch_get(gefen_cuda_scratch *s, void *given,
                                             size_t given_bytes, size_t need,
                                             cudaStream_t stream, const char *what,
                                             gefen_error *err) {
  s->ptr = NULL;
  s->owned = 0;
  s->stream = stream;
  if (need == 0) return GEFEN_OK;
  if (given) {
    if (given_bytes < need)
      return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "%s: scratch of %zu bytes, need %zu", what,
                             given_bytes, need);
    if ((uintptr_t)given % 16u)
      return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "%s: scratch must be 16-byte aligned",
                             what);
    s->ptr = given;
    return GEFEN_OK;
  }
  gefen_status st = gefen_cuda_check(cudaMallocAsync(&s->ptr, need, stream), what, -1, err);
  if (st != GEFEN_OK) {
    s->ptr = NULL;
    return st;
  }
  s->owned = 1;
  return GEFEN_OK;
}

/* Releases an owned scratch (stream-ordered) and passes `status` through. */
static inline gefen_status gefen_scratch_put(gefen_cuda_scratch *s, gefen_status status,
                                             const char *what, gefen_error *err) {
  if (s->owned) {
    const cudaError_t e = cudaFreeAsync(s->ptr, s->stream);
    if (status == GEFEN_OK) status = gefen_cuda_check(e, what, -1, err);
    s->ptr = NULL;
    s->owned = 0;
  }
  return status;
}

/* The checks of period.c's check_matrix, for the statistics launchers. */
static inline gefen_status gefen_cuda_check_matrix(const gefen_matrix *g, gefen_error *err) {
  if (!g) return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "gradient view is NULL");
  if (g->rows < 0 || g->cols < 0)
    return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "negative gradient shape (%lld, %lld)",
                           (long long)g->rows, (long long)g->cols);
  if (gefen_dtype_size(g->dtype) == 0)
    return gefen_cuda_fail(err, GEFEN_ETYPE, -1, "unknown gradient dtype %d", (int)g->dtype);
  if (g->rows > 0 && g->cols > 0 && !g->data)
    return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "gradient data is NULL");
  if (g->cols > 0 && g->rows > INT64_MAX / g->cols)
    return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "gradient shape overflows int64");
  return GEFEN_OK;
}

/* Calls LAUNCH(DT) with DT the gefen_dtype as a compile-time constant. */
#define GEFEN_DISPATCH_DTYPE(dtype, LAUNCH) \
  do {                                      \
    switch (dtype) {                        \
      case GEFEN_F32: LAUNCH(GEFEN_F32); break;   \
      case GEFEN_BF16: LAUNCH(GEFEN_BF16); break; \
      case GEFEN_F16: LAUNCH(GEFEN_F16); break;   \
      case GEFEN_F64: LAUNCH(GEFEN_F64); break;   \
    }                                       \
  } while (0)

#endif /* GEFEN_CUDA_COMMON_CUH */
