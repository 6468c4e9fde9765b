/*
 * gefen_core.h -- the public interface of gefen's pure-C11 core.
 *
 * No Python, no torch. Every function that can fail returns a gefen_status
 * and, on failure, writes a one-line message into a caller-provided
 * gefen_error. The core never prints, exits or aborts, keeps no globals and
 * never allocates or locks inside its per-element loops.
 *
 * Layout (DESIGN.md section 1): a parameter of global shape (d0, d1, ...) is
 * seen as an R x S matrix with R = d0 and S = d1*d2*... (S = 1 for 1-D and
 * 0-D parameters). A rank holds whole rows (its local shard) and passes the
 * index of its first row, so every decision keyed to an element (stochastic
 * rounding) uses the global index. Quantisation blocks are runs of P
 * consecutive elements inside one row, P divides S.
 *
 * Steps that need a global statistic are split into phases over flat
 * float64/int64 buffers: the caller may all-reduce those buffers between the
 * phases (sharded training) or not (one process).
 */
#ifndef GEFEN_CORE_H
#define GEFEN_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GEFEN_CORE_VERSION 3

#define GEFEN_CODEBOOK_SIZE 256   /* entries in a codebook, codes are uint8 */
#define GEFEN_HIST_BINS 4096      /* histogram bins over [-1, 1] */
#define GEFEN_LUT_BUCKETS 16384   /* quantiser lookup buckets over [-1, 1] */
#define GEFEN_MSG_LEN 256

/* ------------------------------------------------------------------ errors */

typedef enum {
  GEFEN_OK = 0,
  GEFEN_EVALUE = 1,   /* a bad value, size or shape      (Python: ValueError)   */
  GEFEN_ETYPE = 2,    /* a bad dtype or kind of input    (Python: TypeError)    */
  GEFEN_ENOMEM = 3,   /* an allocation failed            (Python: MemoryError)  */
  GEFEN_ERUNTIME = 4  /* anything else                   (Python: RuntimeError) */
} gefen_status;

typedef struct {
  char msg[GEFEN_MSG_LEN];
  int64_t item; /* index of the offending item of a list call, else -1 */
} gefen_error;

/* The message of the last failure written into err ("" when none). */
const char *gefen_error_message(const gefen_error *err);
/* Version of this core (GEFEN_CORE_VERSION of the build). */
int gefen_core_version(void);
/* 1 when the core was built with OpenMP threads, else 0. */
int gefen_core_has_threads(void);
/* The element kernels the core runs on this CPU (chosen at run time, all
 * bit-identical): "avx512bf16" (AVX-512 with VBMI and BF16), "avx512vbmi", "avx512",
 * "avx2" or "portable". */
const char *gefen_core_simd_path(void);
/* 1 when the AVX-512 + VBMI kernels search nearest codes over 16-bit keys on
 * this CPU (AMD; blocks of at least 512 with a codebook that allows it), 0
 * when they search over the floats (Intel and other CPUs, where that measured
 * faster) or this CPU has no VBMI. Both give the same codes. */
int gefen_core_key_search(void);
/* The threads a call with nthreads = 0 uses: OpenMP's default, 1 without it. */
int gefen_core_default_threads(void);

/* ------------------------------------------------------------------ dtypes */

typedef enum {
  GEFEN_F32 = 0,
  GEFEN_BF16 = 1,
  GEFEN_F16 = 2,
  GEFEN_F64 = 3
} gefen_dtype;

/* Bytes per element of a dtype (0 for an unknown value). */
size_t gefen_dtype_size(gefen_dtype dtype);

/* A contiguous row-major local shard seen as a (rows x cols) matrix. */
typedef struct {
  const void *data;
  gefen_dtype dtype;
  int64_t rows; /* local rows (dim 0 of the local shard) */
  int64_t cols; /* S, elements per dim-0 slice */
} gefen_matrix;

/* ------------------------------------------------------------ period (§2) */

/* The candidate periods of a parameter: every divisor d of cols with
 * d < numel, ascending. Writes at most cap of them to out (out may be NULL
 * when cap is 0) and returns how many there are (0 for numel <= 1). */
int64_t gefen_period_candidates(int64_t cols, int64_t numel, int64_t *out,
                                int64_t cap);

/* Exact sums (gefen_xsum.h): a sum of non-negative doubles carried as
 * GEFEN_XSUM_LIMBS int64 limbs, so that partial sums add exactly in any
 * order -- across threads, shards and an integer all-reduce. */
#define GEFEN_XSUM_LIMBS 66

/* The statistics of one period candidate, GEFEN_PERIOD_STAT_WIDTH int64s:
 * the exact sum of the block variances (limbs 0 .. GEFEN_XSUM_LIMBS - 1),
 * the number of blocks whose variance is not finite, and the number of
 * blocks. Every field is a sum over blocks, so statistics of row shards
 * add up (int64 all-reduce with SUM) to those of the whole parameter. */
#define GEFEN_PERIOD_STAT_WIDTH (GEFEN_XSUM_LIMBS + 2)
#define GEFEN_PERIOD_STAT_NONFINITE GEFEN_XSUM_LIMBS
#define GEFEN_PERIOD_STAT_BLOCKS (GEFEN_XSUM_LIMBS + 1)

/* Phase 1 of the period search. For candidate k, adds into
 * stats[k * GEFEN_PERIOD_STAT_WIDTH ...] the population variance of g*g
 * (squared in fp32, variance two-pass in float64) of every local block of
 * length cands[k], exactly. The caller zeroes stats and, when sharded,
 * all-reduces it (replicated copies counted once) before
 * gefen_period_choose. The result does not depend on how the rows are split
 * over ranks or threads. */
gefen_status gefen_period_stats(const gefen_matrix *g, const int64_t *cands,
                                int64_t n_cands, int64_t *stats, int nthreads,
                                gefen_error *err);

/* Phase 2: the period of ALGORITHM.md §2 from the (reduced) statistics:
 * err(d) = sqrt(S / n) with S the exact sum rounded once to float64 (NaN
 * when a block variance was not finite) and n the block count.
 * numel <= 1 or cols == 1 gives 1 without looking at the statistics;
 * ndim is the parameter's number of dimensions (for the fallback rule). */
gefen_status gefen_period_choose(int64_t cols, int64_t numel, int ndim,
                                 const int64_t *cands, int64_t n_cands,
                                 const int64_t *stats, int64_t *period,
                                 gefen_error *err);

/* The value of an exact sum (GEFEN_XSUM_LIMBS non-negative limbs) rounded
 * once to the nearest double, ties to even; +inf beyond the largest double. */
double gefen_exact_sum_value(const int64_t *limbs);

/* Adds the n finite non-negative values x into limbs (exactly). Returns
 * GEFEN_EVALUE for a negative or non-finite value, adding nothing. */
gefen_status gefen_exact_sum_add(int64_t *limbs, const double *x, int64_t n,
                                 gefen_error *err);

/* ---------------------------------------------------------- codebook (§3) */

/* Adds the histogram of the block-normalised values g / max|g| of every
 * local block of length period into hist[GEFEN_HIST_BINS] (int64 counts).
 * The caller zeroes hist and, when sharded, all-reduces it. */
gefen_status gefen_histogram(const gefen_matrix *g, int64_t period,
                             int64_t *hist, int nthreads, gefen_error *err);

/* Solves the weighted 1-D k-means of ALGORITHM.md §3 over the histogram
 * exactly and writes 256 ascending fp32 entries with ends exactly -1 and +1.
 * An all-zero histogram is an error (there is nothing to learn from). */
gefen_status gefen_codebook_solve(const int64_t *hist, float *codebook,
                                  gefen_error *err);

/* Checks a codebook: 256 finite entries, non-decreasing, first exactly -1 and
 * last exactly +1. */
gefen_status gefen_codebook_validate(const float *codebook, gefen_error *err);

/* ---------------------------------------------------------- quantiser */

/* The quantiser's lookup table as a plain struct, so that it can be copied as
 * bytes to a device. For a value u in [-1, 1], with
 *   b = min((int)((u + 1) * (GEFEN_LUT_BUCKETS / 2)), GEFEN_LUT_BUCKETS - 1),
 *   k = bucket[b]:
 * the nearest distinct entry is k + 1 when !(|u - value[k]| <= |u - value[k+1]|)
 * (value[n_distinct] is +inf), else k; its code is first[k] when u <= value[k]
 * and last[k] otherwise; NaN gets code 255. exact_lut is 0 when two distinct
 * entries are closer than one bucket: then the table is not used and the
 * quantiser falls back to binary search over the codebook. */
typedef struct {
  float codebook[GEFEN_CODEBOOK_SIZE];
  float value[GEFEN_CODEBOOK_SIZE + 1]; /* distinct entries ascending, +inf after */
  uint8_t first[GEFEN_CODEBOOK_SIZE];   /* first code holding value[k] */
  uint8_t last[GEFEN_CODEBOOK_SIZE];    /* last code holding value[k] */
  uint8_t bucket[GEFEN_LUT_BUCKETS];    /* nearest distinct index of each bucket's lower edge */
  int32_t n_distinct;
  int32_t exact_lut;
} gefen_quant_table;

typedef struct gefen_quantizer gefen_quantizer;

/* Validates the codebook (gefen_codebook_validate) and builds a quantiser. */
gefen_status gefen_quantizer_create(const float *codebook, gefen_quantizer **out,
                                    gefen_error *err);
void gefen_quantizer_destroy(gefen_quantizer *q);
const gefen_quant_table *gefen_quantizer_table(const gefen_quantizer *q);

/* Nearest code of ALGORITHM.md §3: r = first index with C[r] >= u (clamped to
 * 255), l = max(r - 1, 0); l if |u - C[l]| <= |u - C[r]| else r. NaN -> 255. */
uint8_t gefen_quantize_nearest(const gefen_quantizer *q, float u);

/* Stochastic rounding of ALGORITHM.md §6 with the element's global flat index. */
uint8_t gefen_quantize_stochastic(const gefen_quantizer *q, float u,
                                  uint64_t seed, int64_t global_index);

/* The uniform variate U in [0, 1) that §6 draws for (seed, global_index). */
float gefen_sr_uniform(uint64_t seed, int64_t global_index);

/* Nearest codes of n values (used by tests and by codebook refresh). */
gefen_status gefen_quantize(const gefen_quantizer *q, const float *u, int64_t n,
                            uint8_t *codes, gefen_error *err);

/* Rewrites each code c of codes[0..n) as map[c] (codebook refresh). */
gefen_status gefen_codes_remap(uint8_t *codes, int64_t n, const uint8_t *map,
                               int nthreads, gefen_error *err);

/* ------------------------------------------------------- Gefen step (§4) */

/* One parameter's local shard for a Gefen step. All pointers are contiguous.
 * Block form: vmean != NULL, v_row == v_col == NULL.
 * Factored form: vmean == NULL, v_row (rows) and v_col (cols) != NULL, and the
 * factored phase-1 buffers col_stats (cols + 1) and row_stats (rows). */
typedef struct {
  void *param;             /* rows * cols elements of dtype */
  const void *grad;        /* rows * cols elements of dtype */
  uint8_t *codes;          /* rows * cols */
  float *magnitude;        /* rows * (cols / period) */
  float *vmean;            /* block: rows * (cols / period) */
  float *v_row;            /* factored: rows */
  float *v_col;            /* factored: cols (replicated; every rank updates it) */
  double *col_stats;       /* factored: cols + 1, filled by phase 1, then reduced */
  double *row_stats;       /* factored: rows, filled by phase 1 (local) */
  gefen_dtype dtype;
  int64_t rows;            /* local rows */
  int64_t cols;            /* S */
  int64_t period;          /* P, divides cols */
  int64_t row_offset;      /* global index of the first local row */
  int64_t global_rows;     /* R over all ranks */
  int64_t step;            /* the step count after this step's increment (>= 1) */
  /* hyper-parameters as the user gave them; the kernels use fp32 values of
   * beta1, 1 - beta1, ... each rounded once from these doubles */
  double lr, beta1, beta2, eps, weight_decay;
  int stochastic_round;    /* 0: nearest, 1: §6 with seed */
  uint64_t seed;           /* the global step before increment */
  int momentum_in_stats;   /* factored items: phase 1 also forms the momentum, its new
                            * block magnitudes and codes (writing codes and magnitude);
                            * phase 2 then decodes them instead of reading the gradient
                            * again. Only gefen_adam_step takes it (the two-phase calls
                            * refuse it); CPU only: the CUDA launchers ignore it. Block
                            * items ignore it. */
} gefen_adam_item;

/* Checks the sizes, pointers and hyper-parameters of items without touching
 * any data. Every other gefen_adam_* call runs it first. */
gefen_status gefen_adam_validate(const gefen_adam_item *items, int64_t n,
                                 gefen_error *err);

/* Factored phase 1 (items whose vmean is NULL; others are skipped): writes
 * col_stats[j] = sum over local rows of g_ij^2 (j < cols),
 * col_stats[cols] = sum over local rows of the new v_row_i, and
 * row_stats[i] = mean_j g_ij^2. Reads only; mutates no state. The caller then
 * all-reduces col_stats over the ranks that share the parameter. Refuses
 * (GEFEN_EVALUE) factored items with momentum_in_stats: they take the whole
 * step in one call (gefen_adam_step). */
gefen_status gefen_adam_factored_stats(const gefen_adam_item *items, int64_t n,
                                       int nthreads, gefen_error *err);

/* The fused update of ALGORITHM.md §4 for every item (factored items need
 * their reduced phase-1 buffers). Mutates param, codes, magnitude and the
 * second moments. Refuses (GEFEN_EVALUE, before touching anything) factored
 * items with momentum_in_stats, as gefen_adam_factored_stats does. */
gefen_status gefen_adam_update(const gefen_adam_item *items, int64_t n,
                               const gefen_quantizer *q, int nthreads,
                               gefen_error *err);

/* The whole step, both phases in one call, for items whose column sums need
 * no reduction across ranks (every row of the parameter is local, or the
 * caller wants the local rows' statistics alone): factored phase 1, then the
 * update, bit for bit what gefen_adam_factored_stats followed by
 * gefen_adam_update give. Factored items with momentum_in_stats form their
 * momentum, block magnitudes and codes in phase 1, while the gradient's rows
 * are in cache, and phase 2 decodes C[code] * magnitude instead of reading
 * the gradient again (CPU only; the CUDA launchers ignore the flag). Checks
 * every item and allocates every scratch buffer of both phases before the
 * first write: on failure (GEFEN_EVALUE, GEFEN_ENOMEM, ...) nothing has
 * changed; after the first write nothing can fail. (momentum_in_stats moves
 * 15 instead of 18 bytes per parameter but adds a decoding pass; where the
 * step is compute-bound, as on the 2-core machine of docs/performance.md, it
 * is 1-5% slower with two threads, so the Python layer leaves it off.) */
gefen_status gefen_adam_step(const gefen_adam_item *items, int64_t n,
                             const gefen_quantizer *q, int nthreads, gefen_error *err);

/* --------------------------------------------- GefenMuon momentum (§7) */

typedef struct {
  const void *grad;   /* rows * cols elements of dtype */
  uint8_t *codes;     /* rows * cols */
  float *magnitude;   /* rows * (cols / period) */
  void *out;          /* rows * cols elements of out_dtype (F32 or BF16) */
  gefen_dtype dtype;
  gefen_dtype out_dtype;
  int64_t rows, cols, period;
  double beta;        /* momentum */
  int nesterov;       /* out = beta * m_q + (1 - beta) * g, else m_q */
} gefen_muon_item;

gefen_status gefen_muon_validate(const gefen_muon_item *items, int64_t n,
                                 gefen_error *err);

/* m = C[code] * magnitude; m += (1 - beta) * (g - m); requantise m into
 * codes/magnitude; write the Newton-Schulz input into out. */
gefen_status gefen_muon_momentum(const gefen_muon_item *items, int64_t n,
                                 const gefen_quantizer *q, int nthreads,
                                 gefen_error *err);

#ifdef __cplusplus
}
#endif

#endif /* GEFEN_CORE_H */
