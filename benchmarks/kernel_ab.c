/* Two versions of the C core's block kernels against each other in one process: the
 * way docs/performance.md measures a kernel change or a per-CPU choice on a host whose
 * speed drifts (a VM's can move by a quarter within the hour, so runs of separate
 * programs are not comparable). Each repetition times every stage below on a few
 * blocks in cache with version A or B, in ABBA order; each figure is the median over
 * the repetitions of one side, in ns per element, one thread. Before timing, every
 * stage runs once with each version on the same inputs and the outputs (codes, m,
 * parameters, the bf16 Muon output, max|m|, the sums of g^2) must agree bit for bit,
 * or the program says where they differ and exits with 1 (with KERNEL_AB_UNCHECKED=1 in
 * the environment it says so and times them anyway: for upper bounds of a cost, a
 * stage left out on purpose, whose numbers are wrong).
 *
 *   kernel_ab A B [period] [blocks] [repetitions] [period_b]
 *   kernel_ab avx512vbmi avx512bf16            two tables of kernels
 *   kernel_ab avx512bf16 avx512bf16 2048 16 200 8192
 *                                              the same elements as blocks of 2048
 *                                              (A) and of 8192 (B): what a block
 *                                              costs besides its elements (the
 *                                              outputs differ, so they are not
 *                                              compared; docs/performance.md,
 *                                              "Per-block costs")
 *   kernel_ab avx512bf16-keys avx512bf16+keys  the 16-bit key search off and on
 *   kernel_ab portable avx2
 *
 * A version is a table (avx512bf16, avx512vbmi, avx512, avx2, portable) that this CPU
 * has, optionally followed by +keys or -keys to force the nearest-code search over
 * 16-bit keys on or off (the VBMI tables read it, the others ignore it; without it,
 * the CPU's default: keys on AMD); or TABLE@REV, the table TABLE (avx2, avx512bf16 or
 * avx512vbmi) of git revision REV, which kernel_ab.sh builds in as gefen_block_ops_a
 * (one revision per run; table_at_rev.sh), also with +keys or -keys after it:
 *
 *   bash benchmarks/kernel_ab.sh avx2@HEAD avx2     the last commit's AVX2 kernels
 *                                                   against the working tree's
 *   bash benchmarks/kernel_ab.sh avx512bf16@HEAD avx512bf16
 * Defaults: period 2048, 8 blocks, 200 repetitions per side, period_b the period.
 *
 *   stages: fp32 block step (Adam momentum with the sum of g^2, then requantisation and
 *   update in one pass), the same with bfloat16 gradients and parameters (the packed
 *   order where the table has it) and with float16 ones, the factored form's update
 *   (momentum, then its fused pass with a step size per column), GefenMuon's momentum
 *   and fused pass into a bf16 output, requantise alone, Adam momentum alone.
 *
 *   bash benchmarks/kernel_ab.sh A B [period] [blocks] [repetitions]   (builds and runs) */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "block_ops.h"
#include "quantizer_internal.h" /* key_ok / key_search, to force the key search */
#include "bench_clock.h"
#include "bench_codebook.h"

enum { N_STAGES = 7 };
static const char *stage_names[N_STAGES] = {
    "fp32 block step", "bf16 block step", "fp16 block step", "fp32 factored step",
    "muon momentum+fused", "requantize alone", "momentum alone"};

typedef struct {
  const char *spec;
  const gefen_block_ops *ops;
  gefen_quantizer *q;
} version;

/* The buffers one version works on: gradients (fp32, bf16, fp16), parameters of the
 * three dtypes, codes, the Muon output and the per-block scratch. */
typedef struct {
  float *g, *p, *m, *scol;
  float *gmax[2]; /* max|g| of each block of the period, and of period_b */
  uint16_t *g16, *p16, *h16, *ph16, *out;
  uint8_t *codes;
  float mx[N_STAGES];
  double sq[N_STAGES];
} buffers;

static void *xmalloc(size_t n) {
  void *p = malloc(n);
  if (!p) {
    fprintf(stderr, "kernel_ab: out of memory\n");
    exit(2);
  }
  return p;
}

static void buffers_init(buffers *b, int64_t n, int64_t P, int64_t PB) {
  const int64_t most = P > PB ? P : PB;
  b->g = xmalloc((size_t)n * 4);
  b->p = xmalloc((size_t)n * 4);
  b->m = xmalloc((size_t)most * 4);
  b->gmax[0] = xmalloc((size_t)(n / P) * 4);
  b->gmax[1] = xmalloc((size_t)(n / PB) * 4);
  b->scol = xmalloc((size_t)most * 4);
  b->g16 = xmalloc((size_t)n * 2);
  b->p16 = xmalloc((size_t)n * 2);
  b->h16 = xmalloc((size_t)n * 2);
  b->ph16 = xmalloc((size_t)n * 2);
  b->out = xmalloc((size_t)n * 2);
  b->codes = xmalloc((size_t)n);
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i < n; i++) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    b->g[i] = (float)((int)(s % 2001) - 1000) / 1000.0f;
    b->p[i] = 1.0f + (float)(s >> 40 & 1023) / 4096.0f;
    uint32_t bits;
    memcpy(&bits, &b->g[i], sizeof bits);
    b->g16[i] = (uint16_t)(bits >> 16); /* g truncated to bfloat16 */
    b->p16[i] = 0x3f80u;                /* 1.0 */
    b->h16[i] = (uint16_t)(0x3800u + (uint16_t)(s >> 20 & 0x3ff)) | (uint16_t)((s >> 31 & 1) << 15);
    b->ph16[i] = 0x3c00u; /* float16: g in +-[0.5, 1), p = 1.0 */
    b->out[i] = 0;
    b->codes[i] = (uint8_t)(s >> 50);
  }
  for (int64_t j = 0; j < most; j++) b->scol[j] = 0.5f + (float)(j % P) / (float)P;
  for (int i = 0; i < 2; i++) {
    const int64_t per = i ? PB : P;
    for (int64_t k = 0; k < n / per; k++) {
      float mx = 0.0f;
      for (int64_t j = 0; j < per; j++)
        mx = fabsf(b->g[k * per + j]) > mx ? fabsf(b->g[k * per + j]) : mx;
      b->gmax[i][k] = mx;
    }
  }
  memset(b->mx, 0, sizeof b->mx);
  memset(b->sq, 0, sizeof b->sq);
}

static void buffers_free(buffers *b) {
  free(b->g), free(b->p), free(b->m), free(b->scol), free(b->gmax[0]), free(b->gmax[1]);
  free(b->g16), free(b->p16);
  free(b->h16), free(b->ph16), free(b->out), free(b->codes);
}

/* A block step of Adam (momentum with the sum of g^2, then the fused pass into the
 * parameters) at base, in the table's own order when packed; returns max|m|. */
static float block_step(const version *v, const void *grad, gefen_dtype dt, void *param,
                        int packed, uint8_t *codes, int64_t base, float *m, double *sq,
                        int64_t P) {
  const float mx = v->ops->adam_momentum(grad, dt, base, codes, v->q, 0.5f, 0.9f, 0.1f, P, m,
                                         sq, packed ? GEFEN_SINK_ADAM_BLOCK : 0);
  const gefen_sink k = {.kind = GEFEN_SINK_ADAM_BLOCK, .out = param, .out_dtype = dt,
                        .base = base, .s = 0.1f, .decay = 0.999f, .lr = 1e-3f,
                        .packed = packed ? GEFEN_SINK_ADAM_BLOCK : 0,
                        .m_has_no_nan = gefen_m_has_no_nan(*sq, 0.5f)}; /* as adam.c */
  v->ops->requantize_apply(v->q, m, mx, P, codes, &k);
  return mx;
}

/* Stage s of version v over the blocks of b, P long (gm: b's gmax of that
 * period; the state it changes, codes and parameters, carries over from one
 * call to the next, as in a run of steps). */
static void run_stage(const version *v, buffers *b, int s, int64_t n, int64_t P, int gm) {
  const gefen_block_ops *ops = v->ops;
  const gefen_quantizer *q = v->q;
  for (int64_t base = 0; base < n; base += P) {
    uint8_t *c = b->codes + base;
    double sq = 0.0;
    float mx = 0.0f;
    switch (s) {
      case 0:
        mx = block_step(v, b->g, GEFEN_F32, b->p, 0, c, base, b->m, &sq, P);
        break;
      case 1:
        mx = block_step(v, b->g16, GEFEN_BF16, b->p16, 1, c, base, b->m, &sq, P);
        break;
      case 2:
        mx = block_step(v, b->h16, GEFEN_F16, b->ph16, 0, c, base, b->m, &sq, P);
        break;
      case 3: { /* momentum (no sum of squares) and the factored fused pass */
        mx = ops->adam_momentum(b->g, GEFEN_F32, base, c, q, 0.5f, 0.9f, 0.1f, P, b->m, NULL, 0);
        /* m_has_no_nan: adam.c's verdict from a row's squares; these are finite */
        const gefen_sink k = {.kind = GEFEN_SINK_ADAM_FACTORED, .out = b->p,
                              .out_dtype = GEFEN_F32, .base = base, .s = 0.3f, .scol = b->scol,
                              .inv_bc1 = 1.0f, .eps = 1e-8f, .decay = 0.999f, .lr = 1e-3f,
                              .m_has_no_nan = 1};
        ops->requantize_apply(q, b->m, mx, P, c, &k);
        break;
      }
      case 4: {
        mx = ops->muon_momentum(b->g, GEFEN_F32, base, c, q, 0.5f, 0.05f, P, b->m);
        const gefen_sink k = {.kind = GEFEN_SINK_MUON, .out = b->out, .out_dtype = GEFEN_BF16,
                              .grad = b->g, .dtype = GEFEN_F32, .base = base, .beta = 0.95f,
                              .one_minus_beta = 0.05f, .nesterov = 1};
        ops->requantize_apply(q, b->m, mx, P, c, &k);
        break;
      }
      case 5: /* m = the block's gradient, requantised into the codes */
        memcpy(b->m, b->g + base, (size_t)P * 4);
        mx = b->gmax[gm][base / P];
        ops->requantize(q, b->m, mx, P, c);
        break;
      default:
        mx = ops->adam_momentum(b->g, GEFEN_F32, base, c, q, 0.5f, 0.9f, 0.1f, P, b->m, &sq, 0);
        break;
    }
    b->mx[s] = fmaxf(b->mx[s], mx);
    b->sq[s] += sq;
  }
}

/* Stage s once with each version on identical inputs: 0 when every output agrees
 * bit for bit. */
static int same_outputs(const version *a, const version *b, int s, int64_t n, int64_t P) {
  buffers x, y;
  buffers_init(&x, n, P, P);
  buffers_init(&y, n, P, P);
  run_stage(a, &x, s, n, P, 0);
  run_stage(b, &y, s, n, P, 0);
  const char *what = NULL;
  if (memcmp(x.codes, y.codes, (size_t)n)) what = "codes";
  /* m is an output of the requantisation and of the momentum alone; after a fused
   * pass it is scratch (and in the packed order where a table keeps bfloat16 so) */
  else if (s >= 5 && memcmp(x.m, y.m, (size_t)P * 4)) what = "m of the last block";
  else if (memcmp(x.p, y.p, (size_t)n * 4)) what = "fp32 parameters";
  else if (memcmp(x.p16, y.p16, (size_t)n * 2)) what = "bf16 parameters";
  else if (memcmp(x.ph16, y.ph16, (size_t)n * 2)) what = "fp16 parameters";
  else if (memcmp(x.out, y.out, (size_t)n * 2)) what = "Muon output";
  else if (memcmp(&x.mx[s], &y.mx[s], sizeof x.mx[s])) what = "max|m|";
  else if (memcmp(&x.sq[s], &y.sq[s], sizeof x.sq[s])) what = "sum of g^2";
  if (what) fprintf(stderr, "kernel_ab: %s: %s differs between %s and %s\n", stage_names[s],
                    what, a->spec, b->spec);
  buffers_free(&x);
  buffers_free(&y);
  return what != NULL;
}

/* The table of another revision (TABLE@REV), when kernel_ab.sh links one in. */
extern const gefen_block_ops *gefen_block_ops_a(void) __attribute__((weak));

/* "table[+keys|-keys]" or "TABLE@REV[+keys|-keys]" -> the table and a quantiser with
 * the key search as asked. */
static int parse_version(const char *spec, const float *cb, version *v) {
  static const struct {
    const char *name;
    const gefen_block_ops *(*get)(void);
  } tables[] = {{"avx512bf16", gefen_block_ops_avx512bf16},
                {"avx512vbmi", gefen_block_ops_avx512vbmi},
                {"avx512", gefen_block_ops_avx512},
                {"avx2", gefen_block_ops_avx2}};
  char name[32];
  const char *at = strchr(spec, '@'); /* TABLE@REV: the revision's table built in */
  const int revision = at != NULL;
  /* the key search's sign: after the table's name, or at the end of TABLE@REV */
  const size_t n = strlen(spec);
  const char *sign = !revision ? strpbrk(spec, "+-")
                     : n > 5 && (!strcmp(spec + n - 5, "+keys") || !strcmp(spec + n - 5, "-keys"))
                         ? spec + n - 5
                         : NULL;
  const size_t len = revision ? (size_t)(at - spec) : sign ? (size_t)(sign - spec) : strlen(spec);
  if (len == 0 || len >= sizeof name) goto bad;
  memcpy(name, spec, len);
  name[len] = '\0';
  int keys = -1; /* the CPU's default */
  if (sign) {
    if (!strcmp(sign, "+keys")) keys = 1;
    else if (!strcmp(sign, "-keys")) keys = 0;
    else goto bad;
  }
  v->spec = spec;
  v->ops = NULL;
  size_t i = 0;
  for (; i < sizeof tables / sizeof tables[0]; i++)
    if (!strcmp(name, tables[i].name)) break;
  const int known = i < sizeof tables / sizeof tables[0];
  if (revision) { /* a table that table_at_rev.sh takes: not the plain avx512 */
    if (!at[1] || !known || !strcmp(name, "avx512")) goto bad;
    if (!gefen_block_ops_a) {
      fprintf(stderr, "kernel_ab: %s: no other revision's table is built in (run it "
                      "through kernel_ab.sh)\n", spec);
      return 2;
    }
    v->ops = gefen_block_ops_a();
  } else if (!strcmp(name, "portable")) {
    v->ops = &gefen_block_ops_scalar;
  } else {
    if (!known) goto bad;
    v->ops = tables[i].get();
  }
  if (!v->ops) {
    fprintf(stderr, "kernel_ab: this CPU (or this build) has no %s table\n", name);
    return 2;
  }
  gefen_error err;
  if (gefen_quantizer_create(cb, &v->q, &err) != GEFEN_OK) {
    fprintf(stderr, "kernel_ab: %s\n", err.msg);
    return 2;
  }
  if (keys == 1 && !v->q->search.key_ok) {
    fprintf(stderr, "kernel_ab: this codebook does not allow the key search\n");
    gefen_quantizer_destroy(v->q);
    v->q = NULL;
    return 2;
  }
  if (keys >= 0) v->q->search.key_search = keys && v->q->search.key_ok;
  return 0;
bad:
  fprintf(stderr,
          "kernel_ab: %s: a version is avx512bf16, avx512vbmi, avx512, avx2 or portable, "
          "optionally followed by +keys or -keys, or TABLE@REV (avx2, avx512bf16, "
          "avx512vbmi)\n",
          spec);
  return 2;
}

/* Both versions' quantisers (NULL where none was made: gefen_quantizer_destroy takes it). */
static void versions_free(version v[2]) {
  for (int i = 0; i < 2; i++) gefen_quantizer_destroy(v[i].q);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: kernel_ab A B [period] [blocks] [repetitions] [period_b]\n");
    return 2;
  }
  const int64_t P = argc > 3 ? atoll(argv[3]) : 2048;
  const int64_t blocks = argc > 4 ? atoll(argv[4]) : 8;
  const int reps = argc > 5 ? atoi(argv[5]) : 200;
  const int64_t PB = argc > 6 ? atoll(argv[6]) : P; /* B's period */
  if (P < 1 || blocks < 1 || reps < 1 || PB < 1) {
    fprintf(stderr, "kernel_ab: periods, blocks and repetitions must be positive\n");
    return 2;
  }
  const int64_t n = P * blocks;
  if (n % PB) {
    fprintf(stderr, "kernel_ab: period_b must divide period x blocks (%lld)\n", (long long)n);
    return 2;
  }
  float cb[GEFEN_CODEBOOK_SIZE];
  if (bench_codebook(400.0, cb) != 0) return 2;
  version v[2] = {{0}};
  for (int i = 0; i < 2; i++) {
    const int st = parse_version(argv[1 + i], cb, &v[i]);
    if (st) {
      versions_free(v);
      return st;
    }
  }
  int differ = 0;
  if (PB == P) /* (blocks of another length give other outputs) */
    for (int s = 0; s < N_STAGES; s++) differ |= same_outputs(&v[0], &v[1], s, n, P);
  const char *unchecked = getenv("KERNEL_AB_UNCHECKED");
  if (differ && !(unchecked && strcmp(unchecked, "1") == 0)) {
    versions_free(v);
    return 1;
  }
  printf("A = %s (key search %s), B = %s (key search %s): outputs %s; "
         "%lld blocks of %lld",
         v[0].spec, v[0].q->search.key_search ? "on" : "off", v[1].spec,
         v[1].q->search.key_search ? "on" : "off",
         PB != P  ? "not compared (blocks of two lengths)"
         : differ ? "DIFFER (KERNEL_AB_UNCHECKED=1: timed anyway, for a bound only)"
                  : "identical",
         (long long)blocks, (long long)P);
  if (PB != P) printf(" (B: the same elements as %lld blocks of %lld)", (long long)(n / PB),
                      (long long)PB);
  printf(", one thread, medians of %d repetitions per side, ABBA\n", reps);
  /* both versions on the same buffers (their outputs agree, so the state they carry
   * from one repetition to the next is the same), so that neither gains from where
   * its buffers happen to lie */
  buffers b;
  buffers_init(&b, n, P, PB);
  double *t[2][N_STAGES];
  for (int i = 0; i < 2; i++)
    for (int s = 0; s < N_STAGES; s++) t[i][s] = xmalloc(sizeof(double) * (size_t)reps);
  int taken[2] = {0, 0};
  for (int r = 0; r < 2 * reps; r++) {
    const int side = ((r + 1) / 2) % 2; /* A B B A A B B A ... */
    for (int s = 0; s < N_STAGES; s++) {
      const double t0 = now();
      run_stage(&v[side], &b, s, n, side ? PB : P, side);
      t[side][s][taken[side]] = now() - t0;
    }
    taken[side]++;
  }
  const double per = 1e9 / (double)n;
  printf("%-22s %10s %10s %8s\n", "stage (ns/element)", "A", "B", "B/A-1");
  for (int s = 0; s < N_STAGES; s++) {
    const double a = median(t[0][s], reps) * per, bb = median(t[1][s], reps) * per;
    printf("%-22s %10.3f %10.3f %+7.1f%%\n", stage_names[s], a, bb, 100.0 * (bb / a - 1.0));
  }
  buffers_free(&b);
  for (int i = 0; i < 2; i++)
    for (int s = 0; s < N_STAGES; s++) free(t[i][s]);
  versions_free(v);
  return 0;
}
