/* The nearest-code quantiser (ALGORITHM.md §3, §6, §10).
 *
 * Reference rule: r = first index with C[r] >= u (clamped to 255),
 * l = max(r - 1, 0), choose l when |u - C[l]| <= |u - C[r]|.
 *
 * Fast exact form: adjacent distinct entries of a learned codebook are at
 * least half a histogram bin (2^-12) apart, twice the width of a lookup
 * bucket (2^-13), so a bucket holds at most one decision point. The table
 * stores the nearest distinct entry k of each bucket's lower edge; the answer
 * for any u in the bucket is k or k + 1, settled by the same fp32 distance
 * comparison as the reference (which is monotone in u). Codebooks that are
 * packed tighter (a loaded one, say) fall back to binary search. */
#include <stdlib.h>

#include "core_internal.h"
#include "quantizer_internal.h"

/* The bracket of u in the reference rule: r = the first index with c[r] >= u
 * (clamped to 255; no index qualifies for NaN), l = max(r - 1, 0). */
static void bracket(const float *c, float u, int *l, int *r) {
  int lo = 0, hi = GEFEN_CODEBOOK_SIZE;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (c[mid] >= u)
      hi = mid;
    else
      lo = mid + 1;
  }
  *r = lo > GEFEN_CODEBOOK_SIZE - 1 ? GEFEN_CODEBOOK_SIZE - 1 : lo;
  *l = *r > 0 ? *r - 1 : 0;
}

/* The reference rule by binary search; exact for every float, NaN included. */
uint8_t gefen_quantize_reference(const float *c, float u) {
  int l, r;
  bracket(c, u, &l, &r);
  return (uint8_t)(fabsf(u - c[l]) <= fabsf(u - c[r]) ? l : r);
}

static void build_table(gefen_quant_table *t, const float *c) {
  memcpy(t->codebook, c, sizeof t->codebook);
  int n = 0;
  for (int i = 0; i < GEFEN_CODEBOOK_SIZE; i++) {
    if (n > 0 && c[i] == t->value[n - 1]) {
      t->last[n - 1] = (uint8_t)i;
      continue;
    }
    t->value[n] = c[i];
    t->first[n] = t->last[n] = (uint8_t)i;
    n++;
  }
  for (int k = n; k <= GEFEN_CODEBOOK_SIZE; k++) t->value[k] = INFINITY;
  for (int k = n; k < GEFEN_CODEBOOK_SIZE; k++) t->first[k] = t->last[k] = 255;
  t->n_distinct = n;

  /* Two decision points fit in one bucket only if distinct entries are closer
   * than two buckets; then the table is not exact and is not used. */
  const float min_gap = 2.0f / (GEFEN_LUT_BUCKETS / 2);
  t->exact_lut = 1;
  for (int k = 1; k < n; k++)
    if (!(t->value[k] - t->value[k - 1] >= min_gap)) t->exact_lut = 0;

  /* Each bucket is keyed by a point a little below its lower edge, because
   * (u + 1) * 8192 rounds and may place a u just below the edge in the
   * bucket; the widened bucket still holds at most one decision point. */
  int k = 0;
  for (int b = 0; b < GEFEN_LUT_BUCKETS; b++) {
    const float edge = -1.0f + (float)b / (float)(GEFEN_LUT_BUCKETS / 2) - 0x1p-20f;
    /* nearest distinct entry of the edge, ties low (edges ascend, so k only grows) */
    while (k + 1 < n && !(fabsf(edge - t->value[k]) <= fabsf(edge - t->value[k + 1]))) k++;
    t->bucket[b] = (uint8_t)k;
  }
}

/* Floats as unsigned keys in the same order (-0 just below +0), and back. */
static uint32_t float_key(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

static float key_float(uint32_t k) {
  const uint32_t b = (k & 0x80000000u) ? k & 0x7fffffffu : ~k;
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

/* The midpoint b of t and the next float above it (exact: 25 significant
 * bits), setting bit `bit` of *tie_up when a tie at b rounds up. */
static double bound_above(float t, uint16_t *tie_up, int bit) {
  const float up = nextafterf(t, INFINITY);
  uint32_t up_bits;
  memcpy(&up_bits, &up, sizeof up_bits);
  if ((up_bits & 1u) == 0) *tie_up |= (uint16_t)(1u << bit);
  return 0.5 * ((double)t + (double)up);
}

/* The look-up of the key search's first levels (gefen_quant_search,
 * key_bucket), from the fixed keys: key_bucket 1 .. GEFEN_BUCKET_FIXUPS, or 0
 * (not used). */
static void key_buckets(gefen_quant_search *s) {
  enum { N = (1 << GEFEN_BUCKET_LEVELS) - 1, D = 1 << (8 - GEFEN_BUCKET_LEVELS) };
  int16_t k[N]; /* K_Di: level L's thresholds are those at multiples of 2^(8 - L) */
  for (int i = 0; i < N; i++) k[i] = s->key[gefen_bit_reverse8(D * (i + 1) - 1)];
  int most = 0;
  for (int h = 0; h < 256; h++) {
    const int lo = 256 * (int)(int8_t)h; /* the bucket's keys: lo .. lo + 255 */
    int below = 0, in = 0;
    for (int i = 0; i < N; i++) {
      below += k[i] < lo;
      in += k[i] >= lo && k[i] <= lo + 255;
    }
    s->bucket_count[h] = (uint8_t)below;
    if (in > most) most = in;
  }
  for (int c = 0; c < 64; c++) {
    s->bucket_key[c] = c < N ? k[c] : 32767;
    s->bucket_above[c] = c < N ? k[c] : -32768;
    s->bucket_rev[c] = (int16_t)(gefen_bit_reverse8(c) >> (8 - GEFEN_BUCKET_LEVELS));
  }
  s->key_bucket = most <= GEFEN_BUCKET_FIXUPS ? most : 0;
}

/* The 16-bit keys of the thresholds, the same for every block, where a scale
 * allows them (gefen_quant_search, key_fixed): the largest key_top from
 * 32767 down to 16384 for which every x = t * key_top (exact in float64: 24
 * by 15 bits) is more than |x| 2^-20 + 2^-30 (twice the error bound) from a
 * half-integer and their nearest integers strictly increase. */
static void fixed_keys(gefen_quant_search *s) {
  s->key_top = 32767.0f;
  s->key_fixed = 0;
  s->key_bucket = 0;
  memset(s->key, 0, sizeof s->key);
  for (int top = 32767; s->key_ok && top >= 16384; top--) {
    double prev = -65536.0;
    int ok = 1;
    for (int c = 1; ok && c < GEFEN_CODEBOOK_SIZE; c++) {
      const double x = (double)s->threshold[c] * top, n = floor(x + 0.5);
      ok = fabs(x - n) <= 0.5 - (fabs(x) * 0x1p-20 + 0x1p-30) && n > prev;
      prev = n;
    }
    if (!ok) continue;
    s->key_top = (float)top;
    s->key_fixed = 1;
    for (int j = 0; j < GEFEN_CODEBOOK_SIZE; j++)
      s->key[j] = (int16_t)floor((double)s->order[j] * top + 0.5);
    key_buckets(s);
    return;
  }
}

/* The thresholds of gefen_quant_search by bisection over the floats of
 * [-1, 1] (the code is non-decreasing in u and the code of -1 is 0), then
 * the binary search's order and the codebook's byte planes. */
static void build_search(gefen_quant_search *s, const float *c) {
  s->threshold[0] = -INFINITY;
  for (int code = 1; code < GEFEN_CODEBOOK_SIZE; code++) {
    if (gefen_quantize_reference(c, 1.0f) < code) {
      s->threshold[code] = 1.0f;
      continue;
    }
    uint32_t lo = float_key(-1.0f), hi = float_key(1.0f); /* code(lo) < code <= code(hi) */
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (gefen_quantize_reference(c, key_float(mid)) < code)
        lo = mid;
      else
        hi = mid;
    }
    s->threshold[code] = key_float(lo) == 0.0f ? 0.0f : key_float(lo); /* never -0 */
  }
  /* the search order, the midpoints above its thresholds (for the search
   * without division), and whether they are far enough apart for 16-bit keys */
  memset(s->tie_up, 0, sizeof s->tie_up);
  s->key_ok = 1;
  for (int j = 0; j < GEFEN_SEARCH_ENTRIES; j++) {
    const int i = j < GEFEN_CODEBOOK_SIZE ? gefen_bit_reverse8(j) : GEFEN_CODEBOOK_SIZE - 1;
    const float t = i < GEFEN_CODEBOOK_SIZE - 1 ? s->threshold[i + 1] : 1.0f;
    s->order[j] = t;
    s->bound[j] = bound_above(t, &s->tie_up[j / 16], j % 16);
    if (i > 0 && i < GEFEN_CODEBOOK_SIZE - 1 &&
        !((double)t - (double)s->threshold[i] >= 0x1p-12))
      s->key_ok = 0;
  }
  for (int j = 0; j < GEFEN_CODEBOOK_SIZE; j++) {
    uint32_t bits;
    memcpy(&bits, &c[j], sizeof bits);
    for (int b = 0; b < 4; b++) s->plane[b][j] = (uint8_t)(bits >> (8 * b));
    s->value_of[j] = c[j];
    s->value_of_bits[j] = c[gefen_bit_reverse8(j)];
  }
  /* the single-precision scaling's half gaps, its groups left in float64, and
   * the least mx for which every other h * mx is a normal float (h and
   * 2^-126 / h are powers of two: exact) */
  double h_min = 1.0;
  for (int g = 0; g < GEFEN_SEARCH_ENTRIES / 16; g++) {
    double h[16];
    int off = 0;
    for (int k = 0; k < 16; k++) {
      h[k] = s->bound[16 * g + k] - (double)s->order[16 * g + k]; /* exact */
      off |= !(h[k] >= 0x1p-149);
    }
    s->single_off[g] = (uint8_t)off;
    for (int k = 0; k < 16; k++) {
      s->half_up[16 * g + k] = off ? 0.0f : (float)h[k];
      if (!off && h[k] < h_min) h_min = h[k];
    }
  }
  s->single_min_mx = (float)(0x1p-126 / h_min);
  s->key_search = s->key_ok && gefen_cpu_prefers_key_search();
  fixed_keys(s);
}

/* The coarse rows of ALGORITHM.md §10's table for a width of div lookup
 * buckets, if every coarse bucket admits one (quantizer_internal.h): 1, or 0
 * when some bucket's values can have three codes or more.
 *
 * Bucket c (of n = GEFEN_LUT_BUCKETS / div) holds the u with
 * floor(RN(u + 1) * n / 2) = c, the scaling by a power of two being exact;
 * so RN(u + 1) is in [c / h, (c + 1) / h) with h = n / 2, and u itself in
 * [c / h - 1 - 2^-20, (c + 1) / h - 1) (rounding moves u + 1 by at most
 * 2^-24 below 2; the bound is the lookup table's margin), or up to 1 in the
 * top bucket, which also takes u = 1 and NaN. The code of u is the count of
 * thresholds below u, non-decreasing; over the bucket it is at least lo =
 * #{t < the lower bound} and at most hi = #{t < the upper bound} (#{t < 1}
 * in the top bucket). With hi <= lo + 1 every u of the bucket has code lo or
 * lo + 1, the latter exactly when u > threshold[lo + 1]: row lo. The top
 * bucket needs lo >= 254 besides, for NaN to take code 255 and its value. */
static int build_coarse(gefen_quantizer *q, int div) {
  const int n = GEFEN_LUT_BUCKETS / div;
  const double h = n / 2;
  const float *t = q->search.threshold; /* t[1..255], ascending */
  int lo = 0, hi = 0;
  for (int c = 0; c < n; c++) {
    const double below = (double)c / h - 1.0 - 0x1p-20, above = (double)(c + 1) / h - 1.0;
    while (lo < GEFEN_CODEBOOK_SIZE - 1 && (double)t[lo + 1] < below) lo++;
    if (hi < lo) hi = lo;
    while (hi < GEFEN_CODEBOOK_SIZE - 1 && (double)t[hi + 1] < above) hi++;
    if (hi > lo + 1) return 0;
    if (c == n - 1 && lo < GEFEN_CODEBOOK_SIZE - 2) return 0;
    memcpy(q->crow[c], q->row[lo], sizeof q->crow[c]);
  }
  return 1;
}

gefen_status gefen_quantizer_create(const float *codebook, gefen_quantizer **out,
                                    gefen_error *err) {
  gefen_clear(err);
  if (!out) return gefen_fail(err, GEFEN_EVALUE, "quantizer output is NULL");
  *out = NULL;
  if (!codebook) return gefen_fail(err, GEFEN_EVALUE, "codebook is NULL");
  gefen_status st = gefen_codebook_validate(codebook, err);
  if (st != GEFEN_OK) return st;
  gefen_quantizer *q = calloc(1, sizeof *q);
  if (!q) return gefen_fail(err, GEFEN_ENOMEM, "quantizer: out of memory");
  build_table(&q->table, codebook);
  build_search(&q->search, codebook);
  for (int k = 0; k < GEFEN_CODEBOOK_SIZE; k++) {
    const int32_t code = k;
    const int top = k == GEFEN_CODEBOOK_SIZE - 1;
    q->row[k][0] = q->table.value[k];
    q->row[k][1] = q->table.value[top ? k : k + 1];
    memcpy(&q->row[k][2], &code, sizeof code);
    q->row[k][3] = top ? INFINITY : q->search.threshold[k + 1];
    q->sel_code[2 * k] = q->table.first[k];
    q->sel_code[2 * k + 1] = q->table.last[k];
  }
  for (int i = 0; i < 2 * GEFEN_CODEBOOK_SIZE; i++)
    q->sel_value[i] = q->table.codebook[q->sel_code[i]];
  static const int divs[] = GEFEN_COARSE_DIVS;
  q->coarse_div = 0;
  for (size_t i = 0; i < sizeof divs / sizeof divs[0] && !q->coarse_div; i++)
    if (build_coarse(q, divs[i])) q->coarse_div = divs[i];
  *out = q;
  return GEFEN_OK;
}

void gefen_quantizer_destroy(gefen_quantizer *q) { free(q); }

const gefen_quant_table *gefen_quantizer_table(const gefen_quantizer *q) {
  return q ? &q->table : NULL;
}

uint8_t gefen_quantize_nearest(const gefen_quantizer *q, float u) {
  if (u >= -1.0f && u <= 1.0f && q->table.exact_lut) return q->sel_code[gefen_quant_select(q, u)];
  return gefen_quantize_reference(q->table.codebook, u);
}

float gefen_sr_uniform(uint64_t seed, int64_t global_index) {
  uint64_t z = seed + UINT64_C(0x9E3779B97F4A7C15) * ((uint64_t)global_index + 1u);
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  z ^= z >> 31;
  return (float)(z >> 40) * (1.0f / 16777216.0f);
}

uint8_t gefen_quant_stochastic(const gefen_quant_table *t, float u, uint64_t seed,
                               int64_t global_index) {
  const float *c = t->codebook;
  int l, r;
  bracket(c, u, &l, &r);
  float span = c[r] - c[l];
  float p_up = span > 0.0f ? (u - c[l]) / span : 0.0f;
  return (uint8_t)(gefen_sr_uniform(seed, global_index) < p_up ? r : l);
}

uint8_t gefen_quantize_stochastic(const gefen_quantizer *q, float u,
                                  uint64_t seed, int64_t global_index) {
  return gefen_quant_stochastic(&q->table, u, seed, global_index);
}

gefen_status gefen_quantize(const gefen_quantizer *q, const float *u, int64_t n,
                            uint8_t *codes, gefen_error *err) {
  gefen_clear(err);
  if (!q) return gefen_fail(err, GEFEN_EVALUE, "quantizer is NULL");
  if (n < 0) return gefen_fail(err, GEFEN_EVALUE, "negative length %lld", (long long)n);
  if (n > 0 && (!u || !codes)) return gefen_fail(err, GEFEN_EVALUE, "NULL buffer");
  for (int64_t i = 0; i < n; i++) codes[i] = gefen_quantize_nearest(q, u[i]);
  return GEFEN_OK;
}

gefen_status gefen_codes_remap(uint8_t *codes, int64_t n, const uint8_t *map,
                               int nthreads, gefen_error *err) {
  gefen_clear(err);
  if (n < 0) return gefen_fail(err, GEFEN_EVALUE, "negative length %lld", (long long)n);
  if (n > 0 && (!codes || !map)) return gefen_fail(err, GEFEN_EVALUE, "NULL buffer");
  const int nt = gefen_threads(nthreads);
#pragma omp parallel for schedule(static) num_threads(nt) if (n > (1 << 16))
  for (int64_t i = 0; i < n; i++) codes[i] = map[codes[i]];
  return GEFEN_OK;
}
