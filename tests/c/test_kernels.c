/* C tests of the core's quantiser, element kernels and period search.
 *
 * - the lookup-table quantiser against a brute-force statement of the
 *   reference rule, on learned, padded and tightly packed codebooks;
 * - every SIMD version of the block primitives (AVX-512, AVX2) against the
 *   portable one, bit for bit, and the portable one against the quantiser;
 * - dtype conversions against exhaustive / double-precision references;
 * - validation errors and their item index.
 * (The period search has its own tests in test_period.c.) */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "block_ops.h"
#include "gefen_core.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <xmmintrin.h> /* MXCSR (test_bf16_subnormals_under_daz) */
#endif

#include "check.h"

static uint64_t rng(void) { return test_rng(); }
/* The rule of ALGORITHM.md §3 by a linear scan. */
static uint8_t brute_nearest(const float *c, float u) {
  int r = 255;
  for (int i = 0; i < 256; i++)
    if (c[i] >= u) {
      r = i;
      break;
    }
  int l = r > 0 ? r - 1 : 0;
  return (uint8_t)(fabsf(u - c[l]) <= fabsf(u - c[r]) ? l : r);
}

/* A learned codebook: the exact solver on a random bell-shaped histogram. */
static void learned_codebook(float *c, int active_bins) {
  int64_t hist[GEFEN_HIST_BINS] = {0};
  for (int i = 0; i < active_bins; i++) {
    int bin = (int)(rng() % GEFEN_HIST_BINS);
    double x = -1.0 + (bin + 0.5) / 2048.0;
    hist[bin] += 1 + (int64_t)(1000.0 * exp(-8.0 * x * x)) + (int64_t)(rng() % 7);
  }
  gefen_error err;
  gefen_status st = gefen_codebook_solve(hist, c, &err);
  CHECK(st == GEFEN_OK, "solve: %s", err.msg);
}

/* A uniform codebook with entries a few 2^-149 apart around 0: subnormal
 * thresholds, some of whose midpoint ties round up (the special case of the
 * search without division, quantizer_internal.h). */
static void subnormal_codebook(float *c) {
  for (int i = 0; i < 256; i++) c[i] = -1.0f + 2.0f * (float)i / 255.0f;
  for (int i = 112; i < 144; i++) c[i] = (float)(i - 128) * 0x1p-149f * (float)(1 + i % 3);
  for (int i = 113; i < 144; i++)
    if (!(c[i] > c[i - 1])) c[i] = nextafterf(c[i - 1], 1.0f);
}

/* 200 entries one histogram bin (2^-11) apart around 0, the closest a learned
 * codebook has them. */
static void one_bin_codebook(float *c) {
  for (int i = 0; i < 256; i++)
    c[i] = i < 28 ? -1.0f + (float)i * (1.0f - 100 * 0x1p-11f) / 28.0f
           : i < 228 ? (float)(i - 128) * 0x1p-11f
                     : 1.0f - (float)(255 - i) * (1.0f - 100 * 0x1p-11f) / 28.0f;
}

/* Entries 0.0015 apart around 0 and far apart elsewhere: buckets of 256
 * 16-bit keys (about 0.0078) around 0 hold two of the thresholds that the
 * key search's first six levels compare with (every fourth), so that its
 * look-up needs two comparisons after it (quantizer_internal.h, key_bucket). */
static void two_per_bucket_codebook(float *c) {
  for (int i = 0; i < 256; i++)
    c[i] = i < 108 ? -1.0f + (float)i * (0.97f / 108.0f)
           : i < 148 ? (float)(i - 128) * 0.0015f
                     : 0.03f + (float)(i - 148) * (0.97f / 107.0f);
  c[255] = 1.0f;
}

/* A uniform codebook but for a threshold (192) 2^-24 below 0.5, an edge of
 * every coarse width: the u at the threshold has u + 1 = 1.5 - 2^-24, which
 * rounds to the edge, so it falls in the bucket above the threshold, with the
 * code below it (the tie of its two distances goes to the lower entry). */
static void edge_threshold_codebook(float *c) {
  for (int i = 0; i < 256; i++) c[i] = -1.0f + 2.0f * (float)i / 255.0f;
  c[191] = 0.5f - 0x1p-24f - 0x1p-10f;
  c[192] = 0.5f - 0x1p-24f + 0x1p-10f;
}

static void probe_values(const float *c, float *out, int *n, int cap) {
  int k = 0;
  for (int i = 0; i < 256 && k + 8 < cap; i++) {
    out[k++] = c[i];
    out[k++] = nextafterf(c[i], -2.0f);
    out[k++] = nextafterf(c[i], 2.0f);
    if (i < 255) {
      float mid = 0.5f * (c[i] + c[i + 1]);
      out[k++] = mid;
      out[k++] = nextafterf(mid, -2.0f);
      out[k++] = nextafterf(mid, 2.0f);
    }
  }
  for (int b = 0; b <= GEFEN_LUT_BUCKETS && k + 3 < cap; b += 7) { /* bucket edges */
    float e = -1.0f + (float)b / (GEFEN_LUT_BUCKETS / 2);
    out[k++] = e;
    out[k++] = nextafterf(e, -2.0f);
    out[k++] = nextafterf(e, 2.0f);
  }
  while (k < cap) out[k++] = test_uniform(-1.0f, 1.0f);
  out[0] = 0.0f;
  out[1] = -0.0f;
  out[2] = -1.0f;
  out[3] = 1.0f;
  out[4] = 1e-30f;
  out[5] = -1e-30f;
  *n = k;
}

/* The coarse rows (quantizer_internal.h), where the codebook has them: the
 * code of the reference rule at the probes, at every threshold and the float
 * above it, and at every coarse bucket's edge and the 3 floats on either
 * side; NaN 255. */
static void check_coarse_rows(const gefen_quantizer *q, const float *c, const float *u, int n) {
  if (!q->coarse_div) return;
  int bad = 0;
  for (int i = 0; i < n; i++) /* the values a requantisation has: |u| <= 1 */
    if (fabsf(u[i]) <= 1.0f) bad += gefen_quant_coarse(q, u[i]) != brute_nearest(c, u[i]);
  for (int k = 1; k < 256; k++) {
    const float t = q->search.threshold[k], above = nextafterf(t, 2.0f);
    bad += gefen_quant_coarse(q, t) != brute_nearest(c, t);
    if (t < 1.0f) bad += gefen_quant_coarse(q, above) != brute_nearest(c, above);
  }
  const int buckets = GEFEN_LUT_BUCKETS / q->coarse_div;
  for (int b = 0; b <= buckets; b++) {
    const float e = -1.0f + (float)b / (float)(buckets / 2);
    float lo = e, hi = e;
    for (int i = 0; i < 4; i++) {
      if (lo >= -1.0f) bad += gefen_quant_coarse(q, lo) != brute_nearest(c, lo);
      if (hi <= 1.0f) bad += gefen_quant_coarse(q, hi) != brute_nearest(c, hi);
      lo = nextafterf(lo, -2.0f);
      hi = nextafterf(hi, 2.0f);
    }
  }
  CHECK(bad == 0, "coarse rows (%d buckets): %d codes differ from the rule", buckets, bad);
  CHECK(gefen_quant_coarse(q, NAN) == 255, "coarse rows: NaN must map to 255");
}

static void test_quantizer_on(const float *c, int expect_exact) {
  gefen_quantizer *q = NULL;
  gefen_error err;
  CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create: %s", err.msg);
  if (!q) return;
  CHECK(gefen_quantizer_table(q)->exact_lut == expect_exact, "exact_lut %d, expected %d",
        gefen_quantizer_table(q)->exact_lut, expect_exact);
  enum { CAP = 20000 };
  static float u[CAP];
  int n;
  probe_values(c, u, &n, CAP);
  for (int i = 0; i < n; i++) {
    uint8_t a = gefen_quantize_nearest(q, u[i]), b = brute_nearest(c, u[i]);
    CHECK(a == b, "nearest(%.9g) = %d, rule says %d", u[i], a, b);
  }
  CHECK(gefen_quantize_nearest(q, NAN) == 255, "NaN must map to 255");
  CHECK(gefen_quantize_nearest(q, INFINITY) == brute_nearest(c, INFINITY), "+inf");
  CHECK(gefen_quantize_nearest(q, -INFINITY) == 0, "-inf");

  /* the portable requantisation is the quantiser, element by element */
  static float m1[CAP], m2[CAP];
  static uint8_t c1[CAP], c2[CAP];
  for (int i = 0; i < n; i++) m1[i] = u[i] * 3.5f;
  m1[n / 2] = NAN;
  gefen_block_ops_scalar.requantize(q, m1, 3.5f, n, c1);
  for (int i = 0; i < n; i++) {
    const float ui = i == n / 2 ? NAN : (u[i] * 3.5f) / 3.5f;
    const uint8_t want = gefen_quantize_nearest(q, ui);
    const float mq = c[want] * 3.5f;
    CHECK(c1[i] == want && memcmp(&m1[i], &mq, sizeof mq) == 0,
          "portable requantize of %.9g: code %d, quantiser %d", ui, c1[i], want);
  }

  /* the thresholds count the reference rule's code: at every probe, at every
   * threshold and the float above it */
  const gefen_quant_search *search = &q->search;
  for (int i = 0; i < n; i++) {
    const uint8_t want = brute_nearest(c, u[i]);
    CHECK(gefen_quant_count(search, u[i]) == want, "count(%.9g) = %d, rule says %d", u[i],
          gefen_quant_count(search, u[i]), want);
  }
  for (int k = 1; k < 256; k++) {
    const float t = search->threshold[k], above = nextafterf(t, 2.0f);
    CHECK(!signbit(t) || t != 0.0f, "threshold %d is -0", k);
    CHECK(gefen_quant_count(search, t) == brute_nearest(c, t), "count at threshold %d", k);
    if (t < 1.0f)
      CHECK(gefen_quant_count(search, above) == brute_nearest(c, above) &&
                brute_nearest(c, above) >= k,
            "count above threshold %d", k);
  }
  CHECK(gefen_quant_count(search, NAN) == 255, "NaN counts 255");
  check_coarse_rows(q, c, u, n);

  /* every SIMD requantisation gives the same codes and values as the portable
   * (the lookup-table ones only with an exact table); the AVX2 one with the
   * coarse rows where the codebook has them and without */
  const gefen_block_ops *simd[TEST_SIMD_MAX];
  const char *names[TEST_SIMD_MAX];
  const int ns = test_simd_tables(simd, names);
  const int coarse_div = q->coarse_div;
  for (int v = 0; v < 2 * ns; v++) {
    /* each table as built; then AVX2 again without the coarse rows if it had them */
    const int s = v / 2, coarse = v % 2 == 0;
    if (!expect_exact && simd[s] == gefen_block_ops_avx2()) continue; /* needs the table */
    if (!coarse && !(coarse_div && simd[s] == gefen_block_ops_avx2())) continue;
    q->coarse_div = coarse ? coarse_div : 0;
    for (int i = 0; i < n; i++) m1[i] = m2[i] = u[i] * 3.5f;
    m1[n / 2] = m2[n / 2] = NAN;
    for (int len = 1; len <= 40; len++) {
      gefen_block_ops_scalar.requantize(q, m1, 3.5f, len, c1);
      simd[s]->requantize(q, m2, 3.5f, len, c2);
      CHECK(memcmp(c1, c2, (size_t)len) == 0, "%s: requantize codes differ (len %d)", names[s],
            len);
      CHECK(memcmp(m1, m2, sizeof(float) * (size_t)len) == 0,
            "%s: requantize values differ (len %d)", names[s], len);
      for (int i = 0; i < len; i++) m1[i] = m2[i] = u[i] * 3.5f;
    }
    for (int i = 0; i < n; i++) m1[i] = m2[i] = u[i] * 3.5f;
    for (int i = 7; i < n; i += 1001) m1[i] = m2[i] = NAN; /* a NaN in some groups */
    gefen_block_ops_scalar.requantize(q, m1, 3.5f, n, c1);
    simd[s]->requantize(q, m2, 3.5f, n, c2);
    CHECK(memcmp(c1, c2, (size_t)n) == 0, "%s: requantize codes differ", names[s]);
    CHECK(memcmp(m1, m2, sizeof(float) * (size_t)n) == 0, "%s: requantize values differ",
          names[s]);
  }
  q->coarse_div = coarse_div;
  gefen_quantizer_destroy(q);
}

static void test_quantizer(void) {
  float c[256];
  for (int trial = 0; trial < 6; trial++) {
    learned_codebook(c, 3000 + trial * 100);
    test_quantizer_on(c, 1);
  }
  learned_codebook(c, 40); /* fewer than 256 active bins: padded, repeated entries */
  test_quantizer_on(c, 1);
  /* repeated entries -0, +0: the code above zero is +0's, and m = +0 * mx */
  for (int i = 0; i < 127; i++) c[i] = -1.0f + (float)i / 127.0f;
  c[127] = -0.0f;
  c[128] = 0.0f;
  for (int i = 129; i < 256; i++) c[i] = (float)(i - 128) / 127.0f;
  test_quantizer_on(c, 1);
  /* a valid codebook packed tighter than one bucket: binary-search fallback */
  for (int i = 0; i < 256; i++) c[i] = -1.0f + 2.0f * (float)i / 255.0f;
  for (int i = 100; i < 110; i++) c[i] = c[100] + (float)(i - 100) * 1e-5f;
  test_quantizer_on(c, 0);
  /* invalid codebooks are refused */
  gefen_quantizer *q = NULL;
  gefen_error err;
  c[0] = -0.5f;
  CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_EVALUE && !q, "first entry must be -1");
  c[0] = -1.0f;
  c[50] = c[49] - 0.1f;
  CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_EVALUE && !q, "unsorted codebook");
}

/* Which coarse width a codebook gets (quantizer.c, build_coarse): learned
 * codebooks get one, so the AVX2 path that reads it runs in the tests above;
 * entries one histogram bin (2^-11) apart, the closest a learned codebook can
 * have them, get none of the wider ones, which would hold three codes in a
 * bucket (test_quantizer_on checks that what is built is right); nor does
 * one whose top bucket holds three codes. */
static void test_coarse_width(void) {
  float c[256];
  gefen_quantizer *q = NULL;
  gefen_error err;
  for (int trial = 0; trial < 4; trial++) {
    learned_codebook(c, 3000 + 200 * trial);
    CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create: %s", err.msg);
    if (!q) return;
    CHECK(q->coarse_div >= 8, "learned codebook %d: coarse width %d", trial, q->coarse_div);
    gefen_quantizer_destroy(q);
  }
  one_bin_codebook(c);
  CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create: %s", err.msg);
  if (!q) return;
  CHECK(q->coarse_div <= 4, "entries one bin apart: coarse width %d", q->coarse_div);
  test_quantizer_on(c, 1);
  gefen_quantizer_destroy(q);
  /* a threshold just below a coarse edge: the bucket's lower bound has to
   * reach below the edge (build_coarse's margin) */
  edge_threshold_codebook(c);
  CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create: %s", err.msg);
  if (!q) return;
  CHECK(q->search.threshold[192] == 0.5f - 0x1p-24f && (q->search.threshold[192] + 1.0f) == 1.5f,
        "threshold 192 is %a", q->search.threshold[192]);
  CHECK(q->coarse_div == 32, "threshold near an edge: coarse width %d", q->coarse_div);
  test_quantizer_on(c, 1);
  gefen_quantizer_destroy(q);
  /* the top three entries 2^-12 apart (as close as the lookup table allows):
   * the top bucket of every width holds codes 253 to 255, so there are no
   * coarse rows and the AVX2 search takes the bucket's k */
  for (int i = 0; i < 256; i++) c[i] = -1.0f + 2.0f * (float)i / 255.0f;
  c[253] = 1.0f - 0x1p-11f;
  c[254] = 1.0f - 0x1p-12f;
  CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create: %s", err.msg);
  if (!q) return;
  CHECK(q->coarse_div == 0, "close top entries: coarse width %d", q->coarse_div);
  test_quantizer_on(c, 1);
  gefen_quantizer_destroy(q);
}

/* ----------------------------------------------------------- SIMD vs scalar */

static void fill_grad(void *g, gefen_dtype dt, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i++) {
    /* magnitudes over 2^-12..2^12, so that the order of a sum shows in its bits */
    float v = test_normal() * scale * ldexpf(1.0f, (int)(rng() % 25) - 12);
    switch (dt) {
      case GEFEN_F32: ((float *)g)[i] = v; break;
      case GEFEN_BF16: {
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        ((uint16_t *)g)[i] = (uint16_t)(bits >> 16);
        break;
      }
      case GEFEN_F16: {
        /* a float16 bit pattern with a moderate exponent */
        uint16_t h = (uint16_t)((rng() & 0x83ff) | ((10 + rng() % 10) << 10));
        ((uint16_t *)g)[i] = h;
        break;
      }
      case GEFEN_F64: ((double *)g)[i] = v; break;
    }
  }
}

/* Values that take the rare paths of the conversions: NaN with a payload
 * (signalling and quiet), infinities, zeros, subnormals, the largest finite. */
static void put_special(void *p, gefen_dtype dt, int64_t i, int s) {
  static const uint32_t f32[] = {0x7fa12345u, 0xffc00001u, 0x7f800000u, 0xff800000u,
                                 0x80000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu};
  static const uint16_t bf16[] = {0x7fa1u, 0xffc1u, 0x7f80u, 0xff80u,
                                  0x8000u, 0x0001u, 0x807fu, 0x7f7fu};
  static const uint16_t f16[] = {0x7d23u, 0xfe01u, 0x7c00u, 0xfc00u,
                                 0x8000u, 0x0001u, 0x83ffu, 0x7bffu};
  if (dt == GEFEN_F32)
    memcpy((float *)p + i, &f32[s], 4);
  else
    ((uint16_t *)p)[i] = dt == GEFEN_BF16 ? bf16[s] : f16[s];
}

static void put_specials(void *p, gefen_dtype dt, int64_t len) {
  for (int s = 0; s < 8 && 3 * s < len; s++) put_special(p, dt, (int64_t)(rng() % (uint64_t)len), s);
}

/* One SIMD version against the portable one. A pass with special values puts
 * them in the parameters and one NaN in the gradient (one NaN per sum, so the
 * NaN that comes out does not depend on the order of operands). */
static void test_simd_blocks_on(const gefen_block_ops *simd, const char *name,
                                const float *c) {
  gefen_quantizer *q = NULL;
  gefen_error err;
  CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create");
  const gefen_dtype dts[3] = {GEFEN_F32, GEFEN_BF16, GEFEN_F16};
  const int64_t lens[] = {1, 5, 16, 17, 27, 64, 100, 128, 191, 768, 2048, 3072};
  enum { MAXL = 3072 };
  static float m1[MAXL], m2[MAXL], m3[MAXL], scol[MAXL];
  static uint8_t codes[MAXL], c1[MAXL], c2[MAXL];
  static uint16_t g16[MAXL], p16a[MAXL], p16b[MAXL], o16a[MAXL], o16b[MAXL];
  static float g32[MAXL], p32a[MAXL], p32b[MAXL], o32a[MAXL], o32b[MAXL];
  static double cs1[MAXL], cs2[MAXL];
  static uint8_t qa[4 * MAXL], qb[4 * MAXL]; /* parameters of any dtype, two copies */
  for (int d = 0; d < 3; d++) {
    const gefen_dtype dt = dts[d];
    void *g = dt == GEFEN_F32 ? (void *)g32 : (void *)g16;
    void *pa = dt == GEFEN_F32 ? (void *)p32a : (void *)p16a;
    void *pb = dt == GEFEN_F32 ? (void *)p32b : (void *)p16b;
    const size_t esz = dt == GEFEN_F32 ? 4 : 2;
    for (size_t li = 0; li < 2 * (sizeof lens / sizeof lens[0]); li++) {
      const int64_t len = lens[li % (sizeof lens / sizeof lens[0])];
      const int special = li >= sizeof lens / sizeof lens[0];
      fill_grad(g, dt, len, 0.01f);
      fill_grad(pa, dt, len, 1.0f);
      if (special) {
        put_specials(pa, dt, len);
        const int64_t i = (int64_t)(rng() % (uint64_t)len);
        if (dt == GEFEN_F32)
          g32[i] = NAN;
        else
          g16[i] = dt == GEFEN_BF16 ? 0x7fc0u : 0x7e00u;
      }
      memcpy(pb, pa, esz * (size_t)len);
      for (int64_t j = 0; j < len; j++) {
        codes[j] = (uint8_t)(rng() & 0xff);
        scol[j] = test_uniform(0.001f, 0.1f);
      }
      double sq1 = 0, sq2 = 0;
      float mx1 = gefen_block_ops_scalar.adam_momentum(g, dt, 0, codes, q, 0.02f, 0.9f, 0.1f,
                                                       len, m1, &sq1, 0);
      float mx2 = simd->adam_momentum(g, dt, 0, codes, q, 0.02f, 0.9f, 0.1f, len, m2, &sq2, 0);
      CHECK(mx1 == mx2, "%s: adam_momentum max differs (dt %d len %lld)", name, dt,
            (long long)len);
      CHECK(memcmp(m1, m2, 4 * (size_t)len) == 0, "%s: adam_momentum m differs (dt %d len %lld)",
            name, dt, (long long)len);
      CHECK(memcmp(&sq1, &sq2, sizeof sq1) == 0, "%s: sum of squares %.17g vs %.17g", name, sq1,
            sq2);
      /* without the sum of squares (the factored form): the same m */
      simd->adam_momentum(g, dt, 0, codes, q, 0.02f, 0.9f, 0.1f, len, m3, NULL, 0);
      CHECK(memcmp(m1, m3, 4 * (size_t)len) == 0, "%s: adam_momentum without sq", name);
      /* the momentum in the primitives' own order (packed) and the
       * requantisation reading it so, to a block and a factored Adam sink:
       * the element order's bits (codes, parameters, max, sum of squares) */
      for (int fac = 0; fac < 2; fac++) {
        static float ma[MAXL], mb[MAXL];
        static uint8_t ka[MAXL], kb[MAXL];
        memcpy(qa, pa, esz * (size_t)len);
        memcpy(qb, pa, esz * (size_t)len);
        memcpy(ka, codes, (size_t)len);
        memcpy(kb, codes, (size_t)len);
        double s1 = 0, s2 = 0;
        const float x1 = gefen_block_ops_scalar.adam_momentum(g, dt, 0, ka, q, 0.02f, 0.9f, 0.1f,
                                                              len, ma, fac ? NULL : &s1, 0);
        const gefen_sink_kind kind = fac ? GEFEN_SINK_ADAM_FACTORED : GEFEN_SINK_ADAM_BLOCK;
        const float x2 = simd->adam_momentum(g, dt, 0, kb, q, 0.02f, 0.9f, 0.1f, len, mb,
                                             fac ? NULL : &s2, (int)kind);
        gefen_sink sk = {.kind = kind,
                         .out = qa, .out_dtype = dt, .s = 0.7f, .scol = scol, .inv_bc1 = 1.1f,
                         .eps = 1e-8f, .decay = 0.999f, .lr = 1e-3f};
        gefen_block_ops_scalar.requantize_apply(q, ma, x1, len, ka, &sk);
        sk.out = qb;
        sk.packed = (int)kind;
        simd->requantize_apply(q, mb, x2, len, kb, &sk);
        CHECK(x1 == x2 && memcmp(&s1, &s2, sizeof s1) == 0,
              "%s: packed momentum: max %g vs %g, sum %.17g vs %.17g (dt %d len %lld)", name, x1,
              x2, s1, s2, dt, (long long)len);
        CHECK(memcmp(ka, kb, (size_t)len) == 0 && memcmp(qa, qb, esz * (size_t)len) == 0,
              "%s: packed %s step: %s differ (dt %d len %lld)", name, fac ? "factored" : "block",
              memcmp(ka, kb, (size_t)len) ? "codes" : "parameters", dt, (long long)len);
      }
      /* the stored codes decoded to a block and a factored Adam sink (the
       * factored form's read-once phase 2), with and without packed (which
       * dequantize_apply may use inside the call): the portable bits */
      for (int fac = 0; fac < 2; fac++)
        for (int packed = 0; packed < 2; packed++) {
          memcpy(qa, pa, esz * (size_t)len);
          memcpy(qb, pa, esz * (size_t)len);
          const gefen_sink_kind kind = fac ? GEFEN_SINK_ADAM_FACTORED : GEFEN_SINK_ADAM_BLOCK;
          gefen_sink sk = {.kind = kind, .out = qa, .out_dtype = dt, .s = 0.7f, .scol = scol,
                           .inv_bc1 = 1.1f, .eps = 1e-8f, .decay = 0.999f, .lr = 1e-3f};
          gefen_block_ops_scalar.dequantize_apply(q, codes, 0.02f, len, m3, &sk);
          sk.out = qb;
          sk.packed = packed ? (int)kind : 0;
          simd->dequantize_apply(q, codes, 0.02f, len, m3, &sk);
          CHECK(memcmp(qa, qb, esz * (size_t)len) == 0,
                "%s: dequantize_apply to a %s sink%s differs (dt %d len %lld)", name,
                fac ? "factored" : "block", packed ? " (packed)" : "", dt, (long long)len);
        }
      gefen_block_ops_scalar.requantize(q, m1, mx1, len, c1);
      simd->requantize(q, m2, mx2, len, c2);
      CHECK(memcmp(c1, c2, (size_t)len) == 0, "%s: codes differ (dt %d len %lld)", name, dt,
            (long long)len);
      CHECK(memcmp(m1, m2, 4 * (size_t)len) == 0, "%s: dequantised values differ", name);
      gefen_block_ops_scalar.apply_block(pa, dt, 0, m1, len, 0.7f, 0.999f, 1e-3f);
      simd->apply_block(pb, dt, 0, m2, len, 0.7f, 0.999f, 1e-3f);
      CHECK(memcmp(pa, pb, esz * (size_t)len) == 0, "%s: apply_block differs (dt %d len %lld)",
            name, dt, (long long)len);
      gefen_block_ops_scalar.apply_factored(pa, dt, 0, m1, len, 0.3f, scol, 1.1f, 1e-8f, 0.99f,
                                            1e-3f);
      simd->apply_factored(pb, dt, 0, m2, len, 0.3f, scol, 1.1f, 1e-8f, 0.99f, 1e-3f);
      CHECK(memcmp(pa, pb, esz * (size_t)len) == 0,
            "%s: apply_factored differs (dt %d len %lld)", name, dt, (long long)len);
      /* 1..17 rows of len / rows elements (the AVX-512 kernel takes 8 rows
       * at once, then the rest one by one: 17 = two groups and one) */
      for (int64_t rows = 1; rows <= 17 && rows <= len; rows++) {
        const int64_t cols = len / rows;
        double r1[17], r2[17];
        for (int64_t j = 0; j < cols; j++) cs1[j] = cs2[j] = 0.5;
        gefen_block_ops_scalar.row_stats(g, dt, 0, cols, rows, cs1, r1);
        simd->row_stats(g, dt, 0, cols, rows, cs2, r2);
        CHECK(memcmp(r1, r2, sizeof(double) * (size_t)rows) == 0,
              "%s: row sums %.17g vs %.17g (%lld rows of %lld)", name, r1[0], r2[0],
              (long long)rows, (long long)cols);
        CHECK(memcmp(cs1, cs2, 8 * (size_t)cols) == 0, "%s: column sums differ (%lld rows)", name,
              (long long)rows);
      }
      /* GefenMuon momentum and its Newton-Schulz input */
      mx1 = gefen_block_ops_scalar.muon_momentum(g, dt, 0, codes, q, 0.02f, 0.05f, len, m1);
      mx2 = simd->muon_momentum(g, dt, 0, codes, q, 0.02f, 0.05f, len, m2);
      CHECK(mx1 == mx2 && memcmp(m1, m2, 4 * (size_t)len) == 0,
            "%s: muon_momentum differs (dt %d len %lld)", name, dt, (long long)len);
      for (int nesterov = 0; nesterov < 2; nesterov++) {
        gefen_block_ops_scalar.muon_output(o16a, GEFEN_BF16, g, dt, 0, m1, len, 0.95f, 0.05f,
                                           nesterov);
        simd->muon_output(o16b, GEFEN_BF16, g, dt, 0, m2, len, 0.95f, 0.05f, nesterov);
        CHECK(memcmp(o16a, o16b, 2 * (size_t)len) == 0, "%s: muon_output bf16 differs", name);
        gefen_block_ops_scalar.muon_output(o32a, GEFEN_F32, g, dt, 0, m1, len, 0.95f, 0.05f,
                                           nesterov);
        simd->muon_output(o32b, GEFEN_F32, g, dt, 0, m2, len, 0.95f, 0.05f, nesterov);
        CHECK(memcmp(o32a, o32b, 4 * (size_t)len) == 0, "%s: muon_output f32 differs", name);
      }
    }
  }
  gefen_quantizer_destroy(q);
}

static void test_simd_blocks(void) {
  const gefen_block_ops *simd[TEST_SIMD_MAX];
  const char *names[TEST_SIMD_MAX];
  const int n = test_simd_tables(simd, names);
  if (n == 0) printf("  (no SIMD primitives on this CPU: comparison skipped)\n");
  float c[256];
  learned_codebook(c, 3500);
  for (int s = 0; s < n; s++) {
    printf("  %s\n", names[s]);
    test_simd_blocks_on(simd[s], names[s], c);
  }
}

/* row_stats of every SIMD version against the portable one on rows long
 * enough for the kernels that take several rows at once only when rows are
 * long (block_avx2.c: from 8 KiB): 1..5 rows of 2048 + 5 and 4096 + 13
 * columns, each dtype, with NaN, infinities and subnormals in some rows. */
static void test_row_stats_long(void) {
  const gefen_block_ops *simd[TEST_SIMD_MAX];
  const char *names[TEST_SIMD_MAX];
  const int n = test_simd_tables(simd, names);
  const gefen_dtype dts[3] = {GEFEN_F32, GEFEN_BF16, GEFEN_F16};
  const int64_t colss[2] = {2048 + 5, 4096 + 13};
  enum { MAXR = 5, MAXC = 4096 + 13 };
  static float g32[MAXR * MAXC];
  static uint16_t g16[MAXR * MAXC];
  static double cs1[MAXC], cs2[MAXC];
  for (int s = 0; s < n; s++)
    for (int d = 0; d < 3; d++)
      for (int ci = 0; ci < 2; ci++)
        for (int64_t rows = 1; rows <= MAXR; rows++) {
          const gefen_dtype dt = dts[d];
          const int64_t cols = colss[ci];
          void *g = dt == GEFEN_F32 ? (void *)g32 : (void *)g16;
          fill_grad(g, dt, rows * cols, 0.01f);
          /* special s in row s % rows at a column = s mod 8: the two NaNs
           * (s = 0, 1) never meet in a row's sum or a column's (where two
           * NaNs meet, which one comes out is the compiler's choice: it may
           * swap the operands of an addition) */
          if (rows % 2 == 0)
            for (int sp = 0; sp < 8; sp++) {
              const int64_t col = (int64_t)(rng() % (uint64_t)(cols / 8)) * 8 + sp;
              put_special(g, dt, (sp % rows) * cols + col, sp);
            }
          double r1[MAXR], r2[MAXR];
          for (int64_t j = 0; j < cols; j++) cs1[j] = cs2[j] = 0.25 * (double)(j % 7);
          gefen_block_ops_scalar.row_stats(g, dt, 0, cols, rows, cs1, r1);
          simd[s]->row_stats(g, dt, 0, cols, rows, cs2, r2);
          CHECK(memcmp(r1, r2, sizeof(double) * (size_t)rows) == 0,
                "%s: long rows: row sums differ (dt %d, %lld rows of %lld)", names[s], dt,
                (long long)rows, (long long)cols);
          CHECK(memcmp(cs1, cs2, 8 * (size_t)cols) == 0,
                "%s: long rows: column sums differ (dt %d, %lld rows of %lld)", names[s], dt,
                (long long)rows, (long long)cols);
        }
}

/* bfloat16 sums of squares: the AVX-512 tables add the exact square by a
 * float64 multiply-add where block_avx512_common.h shows that it is the canonical
 * order's float32 square, and take the float32 squares where it cannot. Each
 * case below is one that the multiply-adds alone would get wrong, or one that
 * must still take them: tiny values whose float32 squares are rounded (in a
 * lane's first terms, in a column whose sum is still small), finite values
 * whose float32 squares overflow (with and without a NaN in the same sum), all
 * zeros. The sums are compared as float64 bits with the portable version's. */
static uint16_t tiny_bf16(void) { /* 2^-87 <= |g| < 2^-64: a rounded float32 square */
  return (uint16_t)(((rng() & 1) << 15) | ((40 + rng() % 23) << 7) | (rng() & 0x7f));
}

static uint16_t huge_bf16(void) { /* finite, |g| >= 2^64: a float32 square of +inf */
  return (uint16_t)(((rng() & 1) << 15) | (0x5f80 + rng() % (0x7f80 - 0x5f80)));
}

static void test_bf16_squares_on(const gefen_block_ops *simd, const char *name,
                                 gefen_quantizer *q) {
  enum { MAXL = 2048 + 37, NCASE = 8 };
  static uint16_t g[MAXL];
  static float m1[MAXL], m2[MAXL];
  static uint8_t codes[MAXL];
  const int64_t lens[] = {1, 16, 40, 64, 300, 2048 + 37};
  for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
    for (int c = 0; c < NCASE; c++) {
      const int64_t len = lens[li];
      fill_grad(g, GEFEN_BF16, len, 0.01f);
      for (int64_t j = 0; j < len; j++) codes[j] = (uint8_t)(rng() & 0xff);
      switch (c) {
        case 0: /* all tiny: no lane can start exact */
          for (int64_t j = 0; j < len; j++) g[j] = tiny_bf16();
          break;
        case 1: /* tiny after the first 16 terms: exact by multiply-adds */
          for (int64_t j = 16; j < len; j += 3) g[j] = tiny_bf16();
          break;
        case 2: /* a zero first term, then tiny ones */
          g[0] = 0;
          for (int64_t j = 1; j < len; j++) g[j] = tiny_bf16();
          break;
        case 3: /* one lane starts at 2^-40 (a square exact in float32, below 2^-72) */
          g[len > 5 ? 5 : 0] = 0x2b80;
          for (int64_t j = 16; j < len; j += 2) g[j] = tiny_bf16();
          break;
        case 4: /* squares that overflow float32 */
          g[(int64_t)(rng() % (uint64_t)len)] = huge_bf16();
          g[(int64_t)(rng() % (uint64_t)len)] = 0x5f80; /* 2^64 exactly */
          break;
        case 5: /* one that overflows and a NaN: the NaN */
          g[len - 1] = huge_bf16();
          g[(len - 1) / 2] = (len - 1) / 2 == len - 1 ? g[len - 1] : 0x7fa1;
          break;
        case 6: /* all zero */
          memset(g, 0, sizeof(uint16_t) * (size_t)len);
          break;
        default: /* the largest values that do not overflow, and their neighbours */
          for (int64_t j = 0; j < len; j += 7) g[j] = (uint16_t)(0x5f7e + rng() % 3);
          break;
      }
      double s1 = 0, s2 = 0;
      gefen_block_ops_scalar.adam_momentum(g, GEFEN_BF16, 0, codes, q, 0.02f, 0.9f, 0.1f, len, m1,
                                           &s1, 0);
      for (int packed = 0; packed < 2; packed++) {
        s2 = 0;
        simd->adam_momentum(g, GEFEN_BF16, 0, codes, q, 0.02f, 0.9f, 0.1f, len, m2, &s2,
                            packed ? (int)GEFEN_SINK_ADAM_BLOCK : 0);
        CHECK(memcmp(&s1, &s2, sizeof s1) == 0,
              "%s: bf16 squares, case %d, len %lld%s: block sum %.17g vs %.17g", name, c,
              (long long)len, packed ? " (packed)" : "", s1, s2);
      }
    }
  /* rows: 1..17 rows of 5..2085 columns; tiny columns from 16 on (the rows'
   * first terms allow multiply-adds, the columns' sums do not), or from 0 */
  enum { MAXC = 2048 + 37, MAXR = 17 };
  static uint16_t rg[MAXR * MAXC];
  static double cs1[MAXC], cs2[MAXC];
  const int64_t colss[] = {5, 16, 37, 2048 + 37};
  const int64_t rowss[] = {1, 3, 8, 9, 17};
  for (size_t ci = 0; ci < sizeof colss / sizeof colss[0]; ci++)
    for (size_t ri = 0; ri < sizeof rowss / sizeof rowss[0]; ri++)
      for (int c = 0; c < NCASE; c++) {
        const int64_t cols = colss[ci], rows = rowss[ri];
        fill_grad(rg, GEFEN_BF16, rows * cols, 0.01f);
        /* column sums from an earlier call: large (odd cases: only the rows'
         * first terms decide) or mostly zero (even cases) */
        for (int64_t j = 0; j < cols; j++) cs1[j] = cs2[j] = c % 2 || j % 3 == 0 ? 0.5 : 0.0;
        const int64_t from = c % 2 ? 0 : (cols > 16 ? 16 : 0);
        switch (c / 2) {
          case 0: /* tiny columns */
            for (int64_t j = from; j < cols; j += 2)
              for (int64_t r = 0; r < rows; r++) rg[r * cols + j] = tiny_bf16();
            break;
          case 1: /* rows of tiny values (odd cases) or a zero and tiny values */
            for (int64_t r = 0; r < rows; r += 4) {
              for (int64_t j = 0; j < cols; j++) rg[r * cols + j] = tiny_bf16();
              if (c % 2 == 0) rg[r * cols] = 0;
            }
            break;
          case 2: /* overflowing squares, one with a NaN in its row (another column) */
            for (int k = 0; k < 3; k++) {
              const int64_t r = (int64_t)(rng() % (uint64_t)rows);
              const int64_t j = (int64_t)(rng() % (uint64_t)cols);
              rg[r * cols + j] = huge_bf16();
              if (k == 0 && cols > 1) rg[r * cols + (j + 1) % cols] = 0x7fa1;
            }
            break;
          default: /* all zero but one row, or tiny columns whose first row is zero */
            if (c % 2) {
              memset(rg, 0, sizeof(uint16_t) * (size_t)(rows * cols));
              rg[(rows - 1) * cols] = 0x3f80;
            } else
              for (int64_t j = from; j < cols; j += 2) {
                rg[j] = 0;
                for (int64_t r = 1; r < rows; r++) rg[r * cols + j] = tiny_bf16();
              }
            break;
        }
        double r1[MAXR], r2[MAXR];
        gefen_block_ops_scalar.row_stats(rg, GEFEN_BF16, 0, cols, rows, cs1, r1);
        simd->row_stats(rg, GEFEN_BF16, 0, cols, rows, cs2, r2);
        int64_t bad = -1;
        for (int64_t j = 0; j < cols && bad < 0; j++)
          if (memcmp(&cs1[j], &cs2[j], 8)) bad = j;
        CHECK(memcmp(r1, r2, sizeof(double) * (size_t)rows) == 0,
              "%s: bf16 squares, case %d: row sums differ (%lld rows of %lld)", name, c,
              (long long)rows, (long long)cols);
        CHECK(bad < 0, "%s: bf16 squares, case %d: column %lld's sum %.17g vs %.17g (%lld rows of %lld)",
              name, c, (long long)bad, bad < 0 ? 0.0 : cs1[bad], bad < 0 ? 0.0 : cs2[bad],
              (long long)rows, (long long)cols);
      }
}

/* A quantiser of a learned codebook (NULL, with a failure, if it cannot be made). */
static gefen_quantizer *learned_quantizer(void) {
  float c[256];
  learned_codebook(c, 3500);
  gefen_quantizer *q = NULL;
  gefen_error err;
  CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create: %s", err.msg);
  return q;
}

static void test_bf16_squares(void) {
  const gefen_block_ops *simd[TEST_SIMD_MAX];
  const char *names[TEST_SIMD_MAX];
  const int n = test_simd_tables(simd, names);
  gefen_quantizer *q = learned_quantizer();
  if (!q) return;
  for (int s = 0; s < n; s++) test_bf16_squares_on(simd[s], names[s], q);
  gefen_quantizer_destroy(q);
}

/* The largest float <= x, the smallest float >= x. */
static float float_down(double x) {
  float f = (float)x;
  return (double)f > x ? nextafterf(f, -INFINITY) : f;
}
static float float_up(double x) {
  float f = (float)x;
  return (double)f < x ? nextafterf(f, INFINITY) : f;
}

/* G(e, mx): the scaled threshold of search entry e for the magnitude mx, as the
 * rule of quantizer_internal.h gives it (u > t exactly when m > G). */
static float scaled_threshold(const gefen_quantizer *q, int e, float mx) {
  const double bm = q->search.bound[e] * (double)mx;
  const int tie = (q->search.tie_up[e / 16] >> (e % 16)) & 1;
  return tie ? nextafterf(float_up(bm), -INFINITY) : float_down(bm);
}

/* requantize_apply of one SIMD version against the portable one, for every
 * sink, dtype and length 1..130 (and some long ones), with special values in
 * m (NaN payloads, infinities, subnormals, +-0, +-mx), all-zero and all-NaN
 * blocks (mx = 0), and for each codebook of test_requantize_apply. */
static void requantize_apply_on(const gefen_block_ops *simd, const char *name,
                                const gefen_quantizer *q) {
  enum { MAXL = 3072 };
  static float m0[MAXL], m1[MAXL], m2[MAXL], scol[MAXL], g32[MAXL];
  static uint8_t c1[MAXL], c2[MAXL];
  static uint16_t g16[MAXL];
  static uint8_t out1[4 * MAXL], out2[4 * MAXL];
  static const uint32_t specials[] = {0x7fc00000u, 0xffa00001u, 0x7f800001u, 0x7f800000u,
                                      0xff800000u, 0x80000000u, 0x00000000u, 0x00000001u,
                                      0x807fffffu, 0x00800000u};
  const gefen_dtype dts[3] = {GEFEN_F32, GEFEN_BF16, GEFEN_F16};
  const gefen_sink_kind kinds[4] = {GEFEN_SINK_M, GEFEN_SINK_ADAM_BLOCK,
                                    GEFEN_SINK_ADAM_FACTORED, GEFEN_SINK_MUON};
  const float *bound_src = q->search.order;
  /* 1..130, then 261, 523, 709 (the key search's passes of four groups, then
   * two, one and a partial one: 2 x 256 + 128 + 64 + 5), 1024 (whole groups
   * of 128 only: with fixed keys no scaled thresholds), 1047, 2048, 2095 */
  for (int64_t len = 1; len <= MAXL;
       len = len < 130    ? len + 1
             : len == 523  ? 709
             : len == 709  ? 1024
             : len == 1024 ? 1047
             : len == 1047 ? 2048
             : len == 2048 ? 2095
                           : len * 2 + 1) {
    for (int variant = 0; variant < 8; variant++) {
      /* 0: plain, 1: special values, 2: all zero, 3: all NaN, 4: the decision
       * boundaries t * mx and b * mx (b the midpoint above t) and their
       * neighbours, with mx a power of two so that b * mx can be exact, 5:
       * tiny values (max |m| about 2^-118, where 32767 / max |m| overflows), 6:
       * NaNs among finite values (a finite max |m|: the key search sees them),
       * 7: magnitudes of all significands about the least one for which the
       * kernels scale the thresholds in single precision (single_min_mx: half
       * to twice it, where h * mx turns subnormal), m at the scaled thresholds
       * G and their neighbours */
      float mx = 0.0f;
      for (int64_t j = 0; j < len; j++) {
        m0[j] = variant == 2   ? 0.0f
                : variant == 3 ? NAN
                : variant == 5 ? test_normal() * 0x1p-120f
                               : test_normal() * 0.01f;
        scol[j] = test_uniform(0.001f, 0.1f);
        g32[j] = test_normal();
        memcpy(&g16[j], (const char *)&g32[j] + 2, 2);
      }
      if (variant == 1)
        for (int s = 0; s < 10 && s < len; s++) {
          const int64_t i = (int64_t)(rng() % (uint64_t)len);
          memcpy(&m0[i], &specials[s], 4);
        }
      if (variant == 6)
        for (int s = 0; s < 12 && s < len; s++) {
          const int64_t i = (int64_t)(rng() % (uint64_t)len);
          memcpy(&m0[i], &specials[s % 3], 4); /* the three NaNs */
        }
      if (variant == 0) /* special values in the gradient (Adam's parameters, Muon's
                         * Nesterov blend) where mq is finite, so that no two NaNs of
                         * different payloads meet (whose sum may take either); payloads
                         * in the low half reach the bfloat16 rounding, which quietens
                         * them without a carry into the high half */
        for (int s = 0; s < 12 && s < len; s++) {
          static const uint32_t more[2] = {0x7fffffffu, 0xffc0ffffu};
          const int64_t k = (int64_t)(rng() % (uint64_t)len);
          memcpy(&g32[k], s < 10 ? &specials[s] : &more[s - 10], 4);
          memcpy(&g16[k], (const char *)&g32[k] + 2, 2);
        }
      if (variant == 4) {
        const float scale = ldexpf(1.0f, (int)(rng() % 41) - 20);
        for (int64_t j = 0; j < len; j++) {
          const int e = (int)(rng() % GEFEN_SEARCH_ENTRIES);
          const double b = q->search.bound[e];
          const float at[4] = {bound_src[e] * scale, (float)(b * scale),
                               nextafterf((float)(b * scale), 2.0f),
                               nextafterf((float)(b * scale), -2.0f)};
          m0[j] = at[rng() % 4];
        }
        m0[0] = scale; /* max |m| is the scale itself */
      }
      if (variant == 7) {
        const float top = q->search.single_min_mx * test_uniform(0.5f, 2.0f);
        int64_t k = 0;
        for (int64_t j = 0; j < len; j++) {
          const float g = scaled_threshold(q, (int)(rng() % GEFEN_SEARCH_ENTRIES), top);
          const float at[3] = {g, nextafterf(g, INFINITY), nextafterf(g, -INFINITY)};
          const float x = at[rng() % 3];
          if (fabsf(x) < top) m0[k++] = x; /* top stays max |m| */
        }
        for (; k < len; k++) m0[k] = 0.0f;
        m0[0] = top;
      }
      for (int64_t j = 0; j < len; j++) {
        const float a = fabsf(m0[j]);
        mx = a > mx ? a : mx;
      }
      if (variant == 0 && len > 2) { /* u exactly -1, 0 and a threshold */
        m0[0] = -mx;
        m0[1] = 0.0f;
        m0[2] = q->search.threshold[1 + rng() % 255] * mx;
      }
      for (int ki = 0; ki < 4; ki++)
        for (int d = 0; d < 3; d++)
          for (int variant2 = 0; variant2 < (kinds[ki] == GEFEN_SINK_MUON ? 4 : 1); variant2++) {
            const gefen_dtype dt = dts[d];
            const size_t esz = dt == GEFEN_F32 ? 4 : 2;
            gefen_sink sk = {.kind = kinds[ki], .out_dtype = dt, .dtype = dt,
                             .grad = dt == GEFEN_F32 ? (const void *)g32 : (const void *)g16,
                             .base = 0, .s = 0.7f, .scol = scol, .inv_bc1 = 1.1f, .eps = 1e-8f,
                             .decay = 0.999f, .lr = 1e-3f, .beta = 0.95f, .one_minus_beta = 0.05f,
                             .nesterov = variant2 & 1};
            if (kinds[ki] == GEFEN_SINK_MUON) {
              sk.out_dtype = (variant2 & 2) ? GEFEN_BF16 : GEFEN_F32;
              if (dt == GEFEN_F16) sk.grad = g16; /* any bits will do */
            }
            const size_t osz = (sk.out_dtype == GEFEN_F32 ? 4 : 2) * (size_t)len;
            for (int64_t j = 0; j < len; j++) /* parameters: the gradient's bits */
              memcpy(out1 + esz * (size_t)j, (const char *)&g32[j] + (esz == 2 ? 2 : 0), esz);
            memcpy(out2, out1, osz);
            memcpy(m1, m0, 4 * (size_t)len);
            memcpy(m2, m0, 4 * (size_t)len);
            gefen_sink s1 = sk, s2 = sk;
            s1.out = out1;
            s2.out = out2;
            gefen_block_ops_scalar.requantize_apply(q, m1, mx, len, c1, &s1);
            simd->requantize_apply(q, m2, mx, len, c2, &s2);
            CHECK(memcmp(c1, c2, (size_t)len) == 0,
                  "%s: requantize_apply codes differ (sink %d dt %d len %lld variant %d)", name,
                  kinds[ki], dt, (long long)len, variant);
            CHECK(memcmp(out1, out2, osz) == 0,
                  "%s: requantize_apply output differs (sink %d dt %d len %lld variant %d)",
                  name, kinds[ki], dt, (long long)len, variant);
            if (kinds[ki] == GEFEN_SINK_M)
              CHECK(memcmp(m1, m2, 4 * (size_t)len) == 0,
                    "%s: requantized values differ (len %lld variant %d)", name, (long long)len,
                    variant);
          }
    }
  }
}

static void test_requantize_apply(void) {
  const gefen_block_ops *simd[TEST_SIMD_MAX];
  const char *names[TEST_SIMD_MAX];
  const int n = test_simd_tables(simd, names);
  float c[8][256];
  learned_codebook(c[0], 3500);
  subnormal_codebook(c[4]);
  learned_codebook(c[1], 40); /* padded: repeated entries */
  for (int i = 0; i < 127; i++) c[2][i] = -1.0f + (float)i / 127.0f; /* -0 and +0 */
  c[2][127] = -0.0f;
  c[2][128] = 0.0f;
  for (int i = 129; i < 256; i++) c[2][i] = (float)(i - 128) / 127.0f;
  for (int i = 0; i < 256; i++) c[3][i] = -1.0f + 2.0f * (float)i / 255.0f; /* not exact */
  for (int i = 100; i < 110; i++) c[3][i] = c[3][100] + (float)(i - 100) * 1e-5f;
  /* entries one histogram bin apart: the 16-bit keys of their thresholds are
   * about 8 apart */
  one_bin_codebook(c[5]);
  /* a top threshold within 2^-16 of 1 (0.99999): its 16-bit key is a NaN's,
   * 32767, so a NaN's count ties it and the comparison must make it 255 */
  for (int i = 0; i < 254; i++) c[6][i] = -1.0f + 2.0f * (float)i / 255.0f;
  c[6][254] = 0.99998f;
  c[6][255] = 1.0f;
  two_per_bucket_codebook(c[7]);
  for (int k = 0; k < 8; k++) {
    gefen_quantizer *q = NULL;
    gefen_error err;
    CHECK(gefen_quantizer_create(c[k], &q, &err) == GEFEN_OK, "create: %s", err.msg);
    /* the search over 16-bit keys (block_avx512_kernels.h) runs for the
     * learned and the close codebook, not for repeated or too close entries */
    if (q && (k == 0 || k == 5 || k == 1 || k == 3 || k == 6))
      CHECK(q->search.key_ok == (k == 0 || k == 5 || k == 6), "codebook %d: key_ok %d", k,
            q->search.key_ok);
    if (q)
      CHECK(q->search.key_search == (q->search.key_ok && gefen_cpu_prefers_key_search()),
            "codebook %d: key_search %d", k, q->search.key_search);
    /* the learned codebooks' keys are the same for every block */
    if (q && (k == 0 || k == 5))
      CHECK(q->search.key_fixed, "codebook %d: no fixed keys", k);
    /* the first levels by look-up, with one comparison after it or two, or not
     * (test_fixed_keys) */
    if (q && (k == 0 || k == 5 || k == 7))
      CHECK(q->search.key_bucket == (k == 0 ? 1 : k == 7 ? 2 : 0), "codebook %d: key_bucket %d",
            k, q->search.key_bucket);
    if (q && k == 4) {
      int ties = 0;
      for (int g = 0; g < GEFEN_SEARCH_ENTRIES / 16; g++)
        for (int b = 0; b < 16; b++) ties += (q->search.tie_up[g] >> b) & 1;
      CHECK(ties > 16, "the subnormal codebook has only %d ties that round up", ties);
    }
    if (!q) continue;
    /* where the codebook allows the key search, both searches, whichever
     * this CPU prefers */
    /* and with fixed keys, each block's own keys too (at the same scale), and
     * the first levels by look-up where the codebook has it as well as by the
     * binary search */
    const int key_fixed = q->search.key_fixed, key_bucket = q->search.key_bucket;
    for (int keys = q->search.key_ok; keys >= 0; keys--)
      for (int fixed = keys ? key_fixed : 0; fixed >= 0; fixed--)
        for (int bucket = fixed ? key_bucket : 0; bucket >= 0; bucket = bucket ? 0 : -1) {
          q->search.key_search = keys;
          q->search.key_fixed = fixed;
          q->search.key_bucket = bucket;
          for (int s = 0; s < n; s++)
            if (q->table.exact_lut || simd[s] != gefen_block_ops_avx2())
              requantize_apply_on(simd[s], names[s], q);
        }
    q->search.key_fixed = key_fixed;
    q->search.key_bucket = key_bucket;
    /* the AVX2 search without the coarse rows too, where it has them */
    const int coarse_div = q->coarse_div;
    q->coarse_div = 0;
    for (int s = 0; s < n; s++)
      if (coarse_div && q->table.exact_lut && simd[s] == gefen_block_ops_avx2())
        requantize_apply_on(simd[s], names[s], q);
    q->coarse_div = coarse_div;
    gefen_quantizer_destroy(q);
  }
}

/* The rule behind the search without division (quantizer_internal.h), in
 * plain C: RN(m / mx) > t exactly when m > G(t, mx), at and around G, for
 * magnitudes over the whole float range (subnormal, powers of two, near
 * FLT_MAX) and the thresholds of codebooks with normal and subnormal ones. */
static void test_scaled_rule(void) {
  float c[2][256];
  learned_codebook(c[0], 3500);
  subnormal_codebook(c[1]);
  int64_t checked = 0;
  for (int k = 0; k < 2; k++) {
    gefen_quantizer *q = NULL;
    gefen_error err;
    gefen_quantizer_create(c[k], &q, &err);
    if (!q) continue;
    const float *t = q->search.order;
    for (int trial = 0; trial < 400; trial++) {
      float mx;
      switch (trial % 4) {
        case 0: mx = ldexpf(1.0f, (int)(rng() % 250) - 125); break;
        case 1: mx = test_uniform(0.5f, 1.0f) * ldexpf(1.0f, (int)(rng() % 250) - 124); break;
        case 2: mx = test_uniform(0.0f, 1.0f) * 0x1p-126f + 0x1p-149f; break; /* subnormal */
        default: mx = FLT_MAX * test_uniform(0.5f, 1.0f); break;
      }
      for (int e = 0; e < GEFEN_SEARCH_ENTRIES; e++) {
        const double bm = q->search.bound[e] * (double)mx;
        const float g = scaled_threshold(q, e, mx);
        const float ms[5] = {g, nextafterf(g, INFINITY), nextafterf(g, -INFINITY),
                             t[e] * mx, (float)bm};
        for (int i = 0; i < 5; i++) {
          const float u = ms[i] / mx;
          const int above_u = !(u <= t[e]), above_m = !(ms[i] <= g);
          checked++;
          CHECK(above_u == above_m, "t %a mx %a m %a: u > t is %d, m > G is %d", t[e], mx,
                ms[i], above_u, above_m);
        }
      }
    }
    gefen_quantizer_destroy(q);
  }
  printf("  scaled thresholds: %lld comparisons\n", (long long)checked);
}

/* The look-up of the key search's first levels (quantizer_internal.h,
 * key_bucket), as block_avx512_kernels.h reads it, for every key q from
 * -32767 to 32767: the bucket of q's high byte and key_bucket comparisons
 * give the count of the levels' keys below q, with the key above that count
 * (-32768 after the last) and the count's bits reversed; a codebook without
 * it (key_bucket 0) has a bucket with more of those keys than the
 * comparisons could settle. looked_up[key_bucket] counts the codebooks. */
static void check_key_buckets(const gefen_quant_search *s, int k, int *looked_up) {
  enum { N = (1 << GEFEN_BUCKET_LEVELS) - 1, D = 1 << (8 - GEFEN_BUCKET_LEVELS) };
  int key[N + 1], most = 0;
  for (int i = 0; i < N; i++) key[i] = s->key[gefen_bit_reverse8(D * (i + 1) - 1)];
  key[N] = 32768; /* above every q */
  CHECK(s->key_bucket >= 0 && s->key_bucket <= GEFEN_BUCKET_FIXUPS, "codebook %d: key_bucket %d",
        k, s->key_bucket);
  looked_up[s->key_bucket]++;
  for (int i = 0, lo = -32768; lo < 32768; lo += 256) { /* the buckets in key order */
    int in = 0;
    while (key[i] <= lo + 255) i++, in++;
    if (in > most) most = in;
  }
  if (!s->key_bucket) {
    CHECK(most > GEFEN_BUCKET_FIXUPS, "codebook %d: no look-up, with %d keys in a bucket", k, most);
    return;
  }
  CHECK(most == s->key_bucket, "codebook %d: key_bucket %d, %d keys in a bucket", k,
        s->key_bucket, most);
  for (int q = -32767, want = 0; q <= 32767; q++) {
    while (key[want] < q) want++; /* the keys below q */
    int c = s->bucket_count[(uint16_t)q >> 8];
    for (int f = 0; f < s->key_bucket; f++) c += q > s->bucket_key[c];
    if (c != want) {
      CHECK(0, "codebook %d: key %d counts %d keys below it, not %d", k, q, c, want);
      return;
    }
    const int above = c < N ? key[c] : -32768;
    if (s->bucket_above[c] != above || s->bucket_rev[c] != gefen_bit_reverse8(c) >> (8 - GEFEN_BUCKET_LEVELS)) {
      CHECK(0, "codebook %d: count %d: key above %d (not %d), reversed %d", k, c,
            s->bucket_above[c], above, s->bucket_rev[c]);
      return;
    }
  }
}

/* The fixed keys (quantizer_internal.h, key_fixed) are every block's own:
 * for learned codebooks of several widths, entries one bin apart and a top
 * threshold near 1, the key of each scaled threshold, RN(min(G * r,
 * key_top)) with r = key_top / mx, equals the fixed key for magnitudes over
 * the key search's whole range (2^-96 to FLT_MAX: powers of two, every
 * significand, the ends). */
static void test_fixed_keys(void) {
  int64_t checked = 0;
  int fixed = 0, looked_up[GEFEN_BUCKET_FIXUPS + 1] = {0};
  for (int k = 0; k < 25; k++) {
    float c[256];
    if (k == 0) one_bin_codebook(c);
    else if (k == 1) {
      for (int i = 0; i < 254; i++) c[i] = -1.0f + 2.0f * (float)i / 255.0f;
      c[254] = 0.99998f;
      c[255] = 1.0f;
    } else if (k == 24) two_per_bucket_codebook(c);
    else learned_codebook(c, 200 + 150 * k);
    gefen_quantizer *q = NULL;
    gefen_error err;
    CHECK(gefen_quantizer_create(c, &q, &err) == GEFEN_OK, "create: %s", err.msg);
    if (!q) continue;
    const gefen_quant_search *s = &q->search;
    if (k >= 2) CHECK(s->key_fixed, "learned codebook %d: no fixed keys", k);
    if (!s->key_fixed) {
      gefen_quantizer_destroy(q);
      continue;
    }
    fixed++;
    CHECK(s->key_top >= 16384.0f && s->key_top <= 32767.0f, "key_top %g", (double)s->key_top);
    for (int i = 2; i < GEFEN_CODEBOOK_SIZE; i++) /* strictly increasing by count */
      CHECK(s->key[gefen_bit_reverse8(i - 1)] > s->key[gefen_bit_reverse8(i - 2)],
            "codebook %d: keys of counts %d and %d", k, i - 2, i - 1);
    check_key_buckets(s, k, looked_up);
    for (int trial = 0; trial < 600; trial++) {
      float mx;
      switch (trial % 6) {
        case 0: mx = ldexpf(1.0f, (int)(rng() % 224) - 96); break;
        case 1: mx = test_uniform(1.0f, 2.0f) * ldexpf(1.0f, (int)(rng() % 223) - 96); break;
        case 2: mx = 0x1p-96f * test_uniform(1.0f, 2.0f); break;
        case 3: mx = FLT_MAX * test_uniform(0.5f, 1.0f); break;
        case 4: mx = test_uniform(1e-6f, 10.0f); break;
        default: mx = nextafterf(ldexpf(1.0f, (int)(rng() % 223) - 95), 0.0f); break;
      }
      const float r = s->key_top / mx;
      for (int e = 0; e < GEFEN_CODEBOOK_SIZE; e++) {
        const float g = scaled_threshold(q, e, mx);
        const long key = lrintf(fminf(g * r, s->key_top));
        checked++;
        CHECK(key == s->key[e], "codebook %d mx %a entry %d: key %ld, fixed %d", k, mx, e, key,
              s->key[e]);
      }
    }
    gefen_quantizer_destroy(q);
  }
  printf("  fixed keys: %d codebooks, %lld keys compared\n", fixed, (long long)checked);
  /* the codebooks above take each number of comparisons after the look-up,
   * and the binary search (0) */
  for (int f = 0; f <= GEFEN_BUCKET_FIXUPS; f++)
    CHECK(looked_up[f] > 0, "no codebook with key_bucket %d", f);
  printf("  first levels by look-up: key_bucket 0 / 1 / 2 in %d / %d / %d codebooks\n",
         looked_up[0], looked_up[1], looked_up[2]);
}

/* GEFEN_SLOW=1: the threshold count and the coarse rows against the reference
 * rule for every float in [-1, 1] (2^31 values), on a learned and a padded
 * codebook, entries one bin apart and a threshold just below a coarse edge. */
static void test_count_exhaustive(void) {
  const char *slow = getenv("GEFEN_SLOW");
  if (!slow || strcmp(slow, "1") != 0) return;
  for (int k = 0; k < 4; k++) {
    float c[256];
    if (k < 2) learned_codebook(c, k == 0 ? 3500 : 40);
    else if (k == 2) one_bin_codebook(c);
    else edge_threshold_codebook(c);
    gefen_quantizer *q = NULL;
    gefen_error err;
    gefen_quantizer_create(c, &q, &err);
    int64_t bad = 0;
    for (uint32_t sign = 0; sign < 2; sign++) {
      int64_t bad_part = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad_part)
      for (int64_t b = 0; b <= 0x3f800000; b++) {
        const uint32_t bits = (sign << 31) | (uint32_t)b;
        float u;
        memcpy(&u, &bits, 4);
        const uint8_t want = gefen_quantize_reference(c, u);
        bad_part += gefen_quant_count(&q->search, u) != want;
        if (q->coarse_div) bad_part += gefen_quant_coarse(q, u) != want;
      }
      bad += bad_part;
    }
    CHECK(bad == 0, "exhaustive: %lld floats in [-1, 1] counted wrong", (long long)bad);
    printf("  exhaustive count and coarse rows (%d), codebook %d: %lld mismatches\n",
           q->coarse_div, k, (long long)bad);
    gefen_quantizer_destroy(q);
  }
}

/* The requantisation into Adam sinks under MXCSR's flush-to-zero and
 * denormals-are-zero modes (DAZ alone, FTZ alone, both: torch's
 * set_flush_denormal sets both), every SIMD version against the portable one,
 * with moments of ordinary size and tiny ones (max|m| about 1e-37, where
 * thresholds scaled by it would be subnormal: the division-free search must not
 * run), and parameters and learning rate near the subnormals. With DAZ and not
 * FTZ, arithmetic still makes subnormals while vfpclassps reports none: the
 * BF16 conversion must still send them the integer way. */
static void test_bf16_subnormals_under_daz(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const gefen_block_ops *simd[TEST_SIMD_MAX];
  const char *names[TEST_SIMD_MAX];
  const int n = test_simd_tables(simd, names);
  gefen_quantizer *q = learned_quantizer();
  if (!q) return;
  enum { L = 1000 };
  static float m0[L], m1[L], m2[L], scol[L];
  static uint8_t c1[L], c2[L];
  static uint16_t p0[L], o1[L], o2[L];
  const unsigned csr = _mm_getcsr();
  static const unsigned modes[3] = {0x0040u, 0x8000u, 0x8040u}; /* DAZ, FTZ, both */
  int subnormal_outputs = 0;
  for (int tiny = 0; tiny < 2; tiny++) {
    float mx = 0.0f;
    for (int j = 0; j < L; j++) {
      m0[j] = test_normal() * (tiny ? 1e-37f : 0.01f);
      scol[j] = test_uniform(0.5f, 2.0f);
      const float p = test_normal() * 4e-38f; /* bfloat16 parameters near the subnormals */
      memcpy(&p0[j], (const char *)&p + 2, 2);
      mx = fabsf(m0[j]) > mx ? fabsf(m0[j]) : mx;
    }
    for (int mode = 0; mode < 3; mode++) {
      _mm_setcsr((csr & ~0x8040u) | modes[mode]);
      const gefen_sink_kind kinds[2] = {GEFEN_SINK_ADAM_BLOCK, GEFEN_SINK_ADAM_FACTORED};
      for (int s = 0; s < n; s++)
        for (int ki = 0; ki < 2; ki++) {
          const gefen_sink sk = {.kind = kinds[ki], .out_dtype = GEFEN_BF16, .dtype = GEFEN_BF16,
                                 .base = 0, .s = 0.7f, .scol = scol, .inv_bc1 = 1.1f,
                                 .eps = 1e-8f, .decay = 0.999f, .lr = 1e-36f};
          gefen_sink s1 = sk, s2 = sk;
          memcpy(o1, p0, sizeof p0);
          memcpy(o2, p0, sizeof p0);
          memcpy(m1, m0, sizeof m0);
          memcpy(m2, m0, sizeof m0);
          s1.out = o1;
          s2.out = o2;
          gefen_block_ops_scalar.requantize_apply(q, m1, mx, L, c1, &s1);
          simd[s]->requantize_apply(q, m2, mx, L, c2, &s2);
          for (int j = 0; j < L; j++)
            subnormal_outputs += mode == 0 && (o1[j] & 0x7f80u) == 0 && (o1[j] & 0x7fu) != 0;
          CHECK(memcmp(c1, c2, sizeof c1) == 0,
                "%s: codes differ under MXCSR %#x (sink %d, tiny moments %d)", names[s],
                modes[mode], kinds[ki], tiny);
          CHECK(memcmp(o1, o2, sizeof o1) == 0,
                "%s: bfloat16 outputs differ under MXCSR %#x (sink %d, tiny moments %d)",
                names[s], modes[mode], kinds[ki], tiny);
        }
    }
  }
  _mm_setcsr(csr);
  CHECK(n == 0 || subnormal_outputs > 0, "the DAZ test made no subnormal bfloat16 outputs");
  if (n) printf("  under FTZ/DAZ: %d subnormal bfloat16 outputs compared\n", subnormal_outputs);
  gefen_quantizer_destroy(q);
#endif
}

/* ------------------------------------------------------------ conversions */

static void test_conversions(void) {
  /* every bfloat16 and float16 value survives fp32 and back */
  for (uint32_t h = 0; h < 65536; h++) {
    const float fb = gefen_bf16_to_f32((uint16_t)h);
    if (!isnan(fb)) CHECK(gefen_f32_to_bf16(fb) == h, "bf16 round trip %04x", h);
    const float fh = gefen_f16_to_f32((uint16_t)h);
    if (!isnan(fh)) CHECK(gefen_f32_to_f16(fh) == h, "f16 round trip %04x", h);
    else CHECK(isnan(gefen_f16_to_f32(gefen_f32_to_f16(fh))), "f16 NaN stays NaN");
  }
  /* float16 decoding against ldexp */
  for (uint32_t h = 0; h < 0x7c00; h++) {
    const uint32_t e = h >> 10, m = h & 0x3ff;
    const double want = e ? ldexp(1.0 + m / 1024.0, (int)e - 15) : ldexp((double)m, -24);
    CHECK(gefen_f16_to_f32((uint16_t)h) == (float)want, "f16 decode %04x", h);
  }
  /* rounding to nearest even: the result is the nearer neighbour */
  for (int i = 0; i < 200000; i++) {
    uint32_t bits = (uint32_t)rng();
    float f;
    memcpy(&f, &bits, 4);
    if (isnan(f) || isinf(f)) continue;
    const uint16_t b = gefen_f32_to_bf16(f);
    const float fb = gefen_bf16_to_f32(b);
    if (isinf(fb) || (b & 0x7fff) == 0 || (b & 0x7fff) >= 0x7f7f) continue; /* no neighbours */
    const float lo = gefen_bf16_to_f32((uint16_t)(b - 1)), hi = gefen_bf16_to_f32((uint16_t)(b + 1));
    const double err = fabs((double)f - fb);
    CHECK(err <= fabs((double)f - lo) && err <= fabs((double)f - hi), "bf16 rounding of %a", f);
    if (fabsf(f) < 60000.0f) {
      const uint16_t h = gefen_f32_to_f16(f);
      const double eh = fabs((double)f - gefen_f16_to_f32(h));
      if ((h & 0x7fff) < 0x7bff && (h & 0x7fff) > 0) {
        const double e_lo = fabs((double)f - gefen_f16_to_f32((uint16_t)(h - 1)));
        const double e_hi = fabs((double)f - gefen_f16_to_f32((uint16_t)(h + 1)));
        CHECK(eh <= e_lo && eh <= e_hi, "f16 rounding of %a", f);
      }
    }
  }
  /* the branch-free twins of block_ops.h: float16 decoding on every value,
   * encoding on random bits and on every float16 value, tie and neighbour */
  for (uint32_t h = 0; h < 65536; h++) {
    const float a = gefen_f16_to_f32((uint16_t)h), b = gefen_f16_to_f32_sel((uint16_t)h);
    CHECK(memcmp(&a, &b, 4) == 0, "f16 decode twin %04x", h);
    uint32_t bits;
    memcpy(&bits, &a, 4);
    for (int d = -2; d <= 2; d++) {
      const uint32_t x[3] = {bits + (uint32_t)d, bits + 0x1000u + (uint32_t)d,
                             (((uint32_t)h << 16) | 0x8000u) + (uint32_t)d};
      for (int t = 0; t < 3; t++) {
        float f;
        memcpy(&f, &x[t], 4);
        CHECK(gefen_f32_to_f16(f) == gefen_f32_to_f16_sel(f), "f16 encode twin %08x", x[t]);
        CHECK(gefen_f32_to_bf16(f) == gefen_f32_to_bf16_sel(f), "bf16 encode twin %08x", x[t]);
      }
    }
  }
  for (int i = 0; i < 200000; i++) {
    const uint32_t bits = (uint32_t)rng();
    float f;
    memcpy(&f, &bits, 4);
    CHECK(gefen_f32_to_f16(f) == gefen_f32_to_f16_sel(f), "f16 encode twin %08x", bits);
    CHECK(gefen_f32_to_bf16(f) == gefen_f32_to_bf16_sel(f), "bf16 encode twin %08x", bits);
  }
  CHECK(gefen_f32_to_f16(70000.0f) == 0x7c00, "f16 overflow to inf");
  CHECK(gefen_f32_to_bf16(-0.0f) == 0x8000, "bf16 negative zero");
}

/* ------------------------------------------------------------ validation */

static void test_validation(void) {
  float param[12] = {0}, grad[12] = {0}, mag[3] = {0}, vmean[3] = {0};
  uint8_t codes[12] = {0};
  gefen_adam_item items[2];
  memset(items, 0, sizeof items);
  for (int i = 0; i < 2; i++) {
    items[i] = (gefen_adam_item){.param = param, .grad = grad, .codes = codes, .magnitude = mag,
                                 .vmean = vmean, .dtype = GEFEN_F32, .rows = 3, .cols = 4,
                                 .period = 4, .global_rows = 3, .step = 1, .lr = 1e-3f,
                                 .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
  }
  gefen_error err;
  CHECK(gefen_adam_validate(items, 2, &err) == GEFEN_OK, "%s", err.msg);
  CHECK(err.item == -1, "no item on success");
  items[1].period = 3;
  CHECK(gefen_adam_validate(items, 2, &err) == GEFEN_EVALUE && err.item == 1,
        "period 3 of 4 columns must fail on item 1 (item %lld: %s)", (long long)err.item, err.msg);
  items[1].period = 4;
  items[1].beta2 = 1.0f;
  CHECK(gefen_adam_validate(items, 2, &err) == GEFEN_EVALUE && strstr(err.msg, "betas"),
        "beta2 = 1 must fail");
  items[1].beta2 = 0.999f;
  items[0].eps = 0.0f;
  CHECK(gefen_adam_validate(items, 2, &err) == GEFEN_EVALUE && err.item == 0, "eps = 0 must fail");
  items[0].eps = 1e-8f;
  items[0].v_row = mag;
  CHECK(gefen_adam_validate(items, 2, &err) == GEFEN_EVALUE, "block and factored together");
  items[0].v_row = NULL;
  /* a failed update touches nothing */
  param[0] = 1.0f;
  grad[0] = 1.0f;
  items[1].step = 0;
  float c[256];
  learned_codebook(c, 3000);
  gefen_quantizer *q = NULL;
  gefen_quantizer_create(c, &q, &err);
  CHECK(gefen_adam_update(items, 2, q, 1, &err) == GEFEN_EVALUE, "step 0 must fail");
  CHECK(param[0] == 1.0f && mag[0] == 0.0f && codes[0] == 0, "nothing mutated on failure");
  items[1].step = 1;
  CHECK(gefen_adam_update(items, 1, q, 1, &err) == GEFEN_OK, "%s", err.msg);
  CHECK(param[0] < 1.0f && mag[0] > 0.0f, "a valid update moves the parameter");
  gefen_quantizer_destroy(q);
}

int main(void) {
  printf("test_kernels: quantizer\n");
  test_quantizer();
  test_coarse_width();
  printf("test_kernels: SIMD vs portable blocks\n");
  test_simd_blocks();
  test_row_stats_long();
  test_bf16_squares();
  printf("test_kernels: fused requantisation and sinks vs portable\n");
  test_scaled_rule();
  test_fixed_keys();
  test_requantize_apply();
  test_count_exhaustive();
  test_bf16_subnormals_under_daz();
  printf("test_kernels: dtype conversions\n");
  test_conversions();
  printf("test_kernels: validation\n");
  test_validation();
  if (failures) {
    fprintf(stderr, "test_kernels: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_kernels: all passed\n");
  return 0;
}
