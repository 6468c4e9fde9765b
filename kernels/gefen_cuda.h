/*
 * gefen_cuda.h -- CUDA launchers for the hot kernels of gefen's core.
 *
 * A C header (extern "C"): the CPython extension calls these from C, and the
 * definitions live in the kernels/ .cu files. Every launcher takes the same plain
 * structs as the CPU core (gefen_core.h) with DEVICE pointers in them, plus a
 * `stream` (a cudaStream_t passed as void *; NULL is the legacy default
 * stream), and enqueues its kernels on that stream without synchronising.
 *
 * Contract shared by every launcher:
 *  - The item structs are checked on the host first, by the same
 *    gefen_adam_validate / gefen_muon_validate as the CPU path, before anything
 *    is enqueued; a bad item returns GEFEN_EVALUE / GEFEN_ETYPE with err->item.
 *  - The calling thread's current device must be the device of the pointers
 *    and of the stream (see gefen_cuda_set_device).
 *  - Results are bit-for-bit those of the CPU core's portable path
 *    (block_scalar.c) wherever the core's result does not depend on the order
 *    of a float64 sum; every reduction here has a fixed order, so results
 *    never depend on scheduling, grid size or device (kernels/README.md).
 *  - Launch or runtime errors return GEFEN_ERUNTIME with the CUDA message.
 *
 * Scratch: three launchers need a small device buffer for deterministic
 * two-level reductions or per-column factors. Each has a *_scratch_bytes
 * query; pass a device buffer of at least that many bytes (for example a torch
 * uint8 tensor from the caching allocator, on the same stream), or NULL to
 * have the launcher cudaMallocAsync / cudaFreeAsync it on the stream.
 */
#ifndef GEFEN_CUDA_H
#define GEFEN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "gefen_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ device utils */

/* Number of visible CUDA devices (0 when there is no driver or no device). */
int gefen_cuda_device_count(void);

/* Makes `device` current for the calling thread and returns the previous one
 * in *previous (may be NULL), so the extension can restore it afterwards. */
gefen_status gefen_cuda_set_device(int device, int *previous, gefen_error *err);

/* Copies a quantiser table (gefen_quantizer_table(q)) as bytes into a device
 * buffer of sizeof(gefen_quant_table) bytes, on the stream. The host table
 * may be freed or changed as soon as this returns. */
gefen_status gefen_cuda_upload_table(gefen_quant_table *device_table,
                                     const gefen_quant_table *host_table, void *stream,
                                     gefen_error *err);

/* Waits for the stream (tests and benchmarks only; the optimizer never
 * synchronises). */
gefen_status gefen_cuda_stream_sync(void *stream, gefen_error *err);

/* ------------------------------------------------------- Gefen step (§4) */

/* Factored phase 1, as gefen_adam_factored_stats: for every item whose vmean
 * is NULL writes col_stats[0..cols) (column sums of g^2 over local rows),
 * col_stats[cols] (sum of the new v_row) and row_stats (row means of g^2).
 * Block-form items are skipped. Scratch: deterministic column partial sums. */
size_t gefen_cuda_adam_factored_stats_scratch_bytes(const gefen_adam_item *items,
                                                    int64_t n);
gefen_status gefen_cuda_adam_factored_stats(const gefen_adam_item *items, int64_t n,
                                            void *scratch, size_t scratch_bytes,
                                            void *stream, gefen_error *err);

/* The fused update, as gefen_adam_update. device_table is a device copy of
 * the quantiser's table. Factored items need their reduced phase-1 buffers.
 * Scratch: the per-column step factors of the factored items. */
size_t gefen_cuda_adam_update_scratch_bytes(const gefen_adam_item *items, int64_t n);
gefen_status gefen_cuda_adam_update(const gefen_adam_item *items, int64_t n,
                                    const gefen_quant_table *device_table, void *scratch,
                                    size_t scratch_bytes, void *stream, gefen_error *err);

/* --------------------------------------------- GefenMuon momentum (§7) */

/* As gefen_muon_momentum. Needs no scratch. */
gefen_status gefen_cuda_muon_momentum(const gefen_muon_item *items, int64_t n,
                                      const gefen_quant_table *device_table, void *stream,
                                      gefen_error *err);

/* ------------------------------------------- period search and codebook */

/* Phase 1 of the period search, as gefen_period_stats: adds the exact
 * statistics into device_stats (int64, n_cands * GEFEN_PERIOD_STAT_WIDTH, on
 * the device). cands is a HOST array (from gefen_period_candidates): the
 * launcher validates it and sizes each launch from it. No scratch (the size
 * function returns 0; kept so every launcher has the same shape). */
size_t gefen_cuda_period_stats_scratch_bytes(const gefen_matrix *g, int64_t n_cands);
gefen_status gefen_cuda_period_stats(const gefen_matrix *g, const int64_t *cands,
                                     int64_t n_cands, int64_t *device_stats, void *scratch,
                                     size_t scratch_bytes, void *stream, gefen_error *err);

/* As gefen_histogram: adds the counts into device_hist[GEFEN_HIST_BINS]
 * (int64). Integer atomics: exact and independent of scheduling. */
gefen_status gefen_cuda_histogram(const gefen_matrix *g, int64_t period,
                                  int64_t *device_hist, void *stream, gefen_error *err);

/* As gefen_codes_remap: codes[i] = device_map[codes[i]] (256-byte map). */
gefen_status gefen_cuda_codes_remap(uint8_t *codes, int64_t n, const uint8_t *device_map,
                                    void *stream, gefen_error *err);

#ifdef __cplusplus
}
#endif

#endif /* GEFEN_CUDA_H */
