/* The quantiser's internals, shared by the kernels that inline it. */
#ifndef GEFEN_QUANTIZER_INTERNAL_H
#define GEFEN_QUANTIZER_INTERNAL_H

#include "core_internal.h"

/* The order in which the binary search below reads its thresholds: entry j
 * holds threshold[i + 1] with j the bits of i reversed. Level L (1..8)
 * compares u with the threshold at i = (the bits found so far, 0, 8 - L
 * ones), i.e. at j = GEFEN_LEVEL_AT(L) + (the bits found so far, reversed),
 * and records its bit as bit L - 1 of an index of those reversed bits, so
 * each level's table is one run of entries indexed by it directly: level 8
 * at 0..127, 7 at 128..191, 6 at 192..223, 5 at 224..239, 4 at 240..247, 3
 * at 248..251, 2 at 252..253 and level 1 at 254. Entry 255 (no threshold:
 * i = 255) and 16 entries of padding, so that every level's table loads as 16
 * floats, hold 1 (no count depends on them). */
#define GEFEN_LEVEL_AT(L) (((1 << (8 - (L))) - 1) << (L))
#define GEFEN_SEARCH_ENTRIES (GEFEN_CODEBOOK_SIZE + 16)

/* The levels of the key search that one look-up can take (5 or 6;
 * gefen_quant_search, key_bucket), and the most comparisons it may need after
 * the look-up. */
#ifndef GEFEN_BUCKET_LEVELS
#define GEFEN_BUCKET_LEVELS 6
#endif
#define GEFEN_BUCKET_FIXUPS 2
_Static_assert(GEFEN_BUCKET_LEVELS == 5 || GEFEN_BUCKET_LEVELS == 6,
               "GEFEN_BUCKET_LEVELS: 5 or 6 (the look-up's tables hold 64 entries)");

/* The 8 bits of x (0..255) in reverse order: the place of count x's
 * threshold in search order, and the reverse. */
static inline int gefen_bit_reverse8(int x) {
  int r = 0;
  for (int i = 0; i < 8; i++) r |= ((x >> i) & 1) << (7 - i);
  return r;
}

/* The nearest-code rule as a count of thresholds, for searches without table
 * look-ups in memory (quantizer.c builds it, the AVX-512 kernels use it).
 *
 * The code of the reference rule is a non-decreasing function of u, so it is
 * the number of c in 1..255 with u > threshold[c], where threshold[c] is the
 * largest float in [-1, 1] whose code is below c (found by bisection over the
 * floats with the reference rule itself, so the count equals the rule for
 * every u in [-1, 1]; never -0; 1 when no u in [-1, 1] reaches code c). A
 * jump of several codes at one point (repeated entries) gives equal
 * thresholds. NaN compares unordered: with "not u <= t" every comparison is
 * true and the count is 255, the code of NaN.
 *
 * Without the division: for a finite magnitude mx > 0 and any float m,
 * RN(m / mx) > t exactly when m / mx > b, where b is the midpoint of t and the
 * next float above it (or m / mx >= b when a tie at b rounds up, which needs
 * a subnormal t). b * mx is exact in float64 (25 by 24 significant bits), so
 * u > t exactly when m > RD(b * mx), rounded down to a float (or, for a tie
 * that rounds up, m > the float below RU(b * mx)). bound[] holds b for every
 * entry of order and tie_up[g] the entries of group g (16 entries) whose tie
 * rounds up: scaled by mx once per block, the search runs on m itself.
 *
 * The same in single precision: b = t + h with h = half_up[j], half the gap
 * from t to the float above it, a power of two; where h is a float and h * mx
 * a normal one, h * mx is exact and one fused multiply-add rounds t * mx +
 * h * mx = b * mx down once, as the float64 product is rounded (for a tie
 * that rounds up, t * mx plus the float below h * mx: the float below b * mx,
 * block_avx512_kernels.h, scale_order). The
 * AVX-512 kernels take that form for a block whose mx is at least
 * single_min_mx, except in the groups of 16 entries marked in single_off
 * (those with an entry whose h is below the floats: t zero or within 2^-125
 * of it), which stay in float64. */
typedef struct {
  float threshold[GEFEN_CODEBOOK_SIZE]; /* [0] unused (-inf) */
  float order[GEFEN_SEARCH_ENTRIES];    /* the thresholds in search order */
  double bound[GEFEN_SEARCH_ENTRIES];
  uint16_t tie_up[GEFEN_SEARCH_ENTRIES / 16];
  float half_up[GEFEN_SEARCH_ENTRIES]; /* b - t (0 in the groups of single_off) */
  float single_min_mx;                  /* 2^-126 / the least h outside single_off */
  uint8_t single_off[GEFEN_SEARCH_ENTRIES / 16];
  /* every two consecutive thresholds at least 2^-12 apart, so that the 16-bit
   * keys of any block's scaled thresholds come out strictly increasing (the
   * key search of block_avx512_kernels.h, KEY_SEARCH) */
  int key_ok;
  /* key_ok, and the CPU runs the key search faster than the search over
   * floats (gefen_cpu_prefers_key_search): what the kernels read. Both give
   * the same codes; a test may set it to either value when key_ok is set. */
  int key_search;
  /* The keys of the thresholds the same for every block (key_fixed): with
   * keys RN(min(x * r, key_top)), r = key_top / mx (block_avx512_kernels.h,
   * KEY_SEARCH), a scaled threshold T of t has T * r = x (1 + e) + a with x =
   * t * key_top, |e| <= 7 x 2^-24 (T's rounding and its midpoint's offset,
   * 5 x 2^-24; r's; the product's) and |a| <= 2^-36 (subnormal T, mx >=
   * 2^-96), for every mx from 2^-96 to FLT_MAX. So where x is farther than
   * |x| 2^-20 + 2^-30 from the nearest half-integer, every block's key of T
   * is RN(x). build_search takes the largest key_top in 16384..32767 for
   * which every threshold is that far and the keys strictly increase (2-7%
   * of the scales qualify for learned codebooks, the first within 200 of
   * 32767 for those measured); a block then needs neither its scaled
   * thresholds nor their keys (the ties compare m / mx with t itself). None
   * found (key_fixed 0): key_top is 32767 and each block forms its keys. */
  int16_t key[GEFEN_CODEBOOK_SIZE + 32]; /* search order, then 32 zeros */
  float key_top;
  int key_fixed;
  /* The key search's first GEFEN_BUCKET_LEVELS levels by one look-up
   * (key_fixed only; block_avx512_kernels.h, key_levels_by_bucket): with K_c
   * the fixed key of threshold[c] and d = 2^(8 - GEFEN_BUCKET_LEVELS), those
   * levels count the keys K_di (i = 1 .. 256 / d - 1) below a key q.
   * bucket_count[h] is that count for the least q whose high byte is h (two's
   * complement), and a bucket of 256 keys holds at most key_bucket of the
   * K_di, so that key_bucket comparisons of q with the next of them,
   * bucket_key[count] (32767 after the last), finish the count exactly.
   * bucket_above[count] is the key above it for the ties (-32768: none),
   * bucket_rev[count] the count's bits reversed (the search's index). 0: the
   * binary search instead (a codebook with more in some bucket). */
  int key_bucket;
  uint8_t bucket_count[256];
  int16_t bucket_key[64], bucket_above[64], bucket_rev[64];
  /* codebook[code] by code, and by the search's reversed bits j (the value of
   * code j with its 8 bits reversed): sixteen 16-float registers each, for
   * decoding without VBMI */
  float value_of[GEFEN_CODEBOOK_SIZE];
  float value_of_bits[GEFEN_CODEBOOK_SIZE];
  /* byte b of the bits of codebook[i] at plane[b][i]: the codebook as four
   * 256-byte tables, for decoding 64 codes with byte permutes */
  uint8_t plane[4][GEFEN_CODEBOOK_SIZE];
} gefen_quant_search;

/* The coarse bucket widths tried (in lookup buckets, widest first) and the
 * narrowest, which sizes crow: 1024 rows (16 KiB) at 16, 4096 (64 KiB) at 4.
 * Coarser is faster on Zen 3 (kernel_ab, fp32 block step in cache, against
 * the two loads: 32 -16%, 16 -13%, 8 -12%, 4 -10%, 2 -8%; the 256 KiB table of 1,
 * one row per lookup bucket, was slower than the two loads for float16). */
#define GEFEN_COARSE_DIVS {32, 16, 8, 4}
#define GEFEN_COARSE_DIV_MIN 4

struct gefen_quantizer {
  gefen_quant_table table;
  gefen_quant_search search;
  /* row[k] = {value[k], value[k + 1], k (as int32 bits), search.threshold[k +
   * 1]}: a lookup bucket's two candidates, the code of the lower one and, for
   * a codebook of distinct entries, the threshold between them, in one 16-byte
   * load for the AVX2 search (which loads a row per lane and transposes them).
   * Row 255 holds value[255] twice and +inf: u <= +inf keeps code 255 for
   * every u but NaN, which takes the code above it (256, saturated to 255 in
   * the byte) and value[255] (= codebook[255] there), as the reference rule
   * does for NaN. */
  _Alignas(16) float row[GEFEN_CODEBOOK_SIZE][4];
  /* The rows by coarse bucket, for the AVX2 search without the byte load of
   * k: with n = GEFEN_LUT_BUCKETS / coarse_div coarse buckets over [-1, 1],
   *   c = min((int)((u + 1) * (n / 2)), n - 1)  (NaN: c = n - 1),
   * crow[c] = row[k] for the k with code(u) in {k, k + 1} for every u of
   * bucket c, so that code(u) = k + !(u <= threshold[k + 1]) (k >= 254 in the
   * top bucket, where NaN takes k + 1 = 255 or 256, saturated). coarse_div is
   * the largest of GEFEN_COARSE_DIVS for which every coarse bucket has such
   * a k (quantizer.c, build_coarse), 0 for none: the table then is not used. */
  int32_t coarse_div;
  _Alignas(16) float crow[GEFEN_LUT_BUCKETS / GEFEN_COARSE_DIV_MIN][4];
  /* The code and the dequantised value of the nearest distinct entry k,
   * interleaved so that the index 2 * k + (u > value[k]) picks them without a
   * data-dependent branch: sel_code[2k] = first[k], sel_code[2k + 1] =
   * last[k], sel_value[i] = codebook[sel_code[i]]. sel_value is codebook[code]
   * bit for bit, which value[k] is not when a run of equal entries mixes -0
   * and +0. sel_value follows sel_code, so a 4-byte gather at the last byte
   * index stays inside the struct. */
  uint8_t sel_code[2 * GEFEN_CODEBOOK_SIZE];
  float sel_value[2 * GEFEN_CODEBOOK_SIZE];
};

/* Whether this CPU runs the search over 16-bit keys faster than the one over
 * floats (block_avx512vbmi.c): measured faster on AMD Zen 4 (its 16-bit
 * permutes cost what its float ones do) and slower on Intel Sapphire Rapids
 * (where vpermw and vpermt2w have about 1.6 and 2.7 times the cost of a
 * float permute), so AMD CPUs with VBMI only. */
int gefen_cpu_prefers_key_search(void);

uint8_t gefen_quantize_reference(const float *codebook, float u);
uint8_t gefen_quant_stochastic(const gefen_quant_table *t, float u, uint64_t seed,
                               int64_t global_index);

/* Nearest code through the lookup table (see quantizer.c for why it is exact).
 * The k / k + 1 choice is taken as an integer, not a branch: it is a coin flip
 * per element and would mispredict half the time. */
static inline uint8_t gefen_quant_nearest(const gefen_quant_table *t, float u) {
  if (!(u >= -1.0f && u <= 1.0f) || !t->exact_lut)
    return gefen_quantize_reference(t->codebook, u);
  int b = (int)((u + 1.0f) * (float)(GEFEN_LUT_BUCKETS / 2));
  b = b < GEFEN_LUT_BUCKETS - 1 ? b : GEFEN_LUT_BUCKETS - 1;
  int k = t->bucket[b];
  k += !(fabsf(u - t->value[k]) <= fabsf(u - t->value[k + 1]));
  const uint8_t *code = u <= t->value[k] ? t->first : t->last;
  return code[k];
}

/* The same as gefen_quant_nearest for u in [-1, 1] with an exact table, through
 * the interleaved selection tables: returns the index i into sel_code and
 * sel_value, with no data-dependent branch. The caller handles NaN, values out
 * of [-1, 1] and tables that are not exact. */
static inline int gefen_quant_select(const gefen_quantizer *q, float u) {
  const gefen_quant_table *t = &q->table;
  int b = (int)((u + 1.0f) * (float)(GEFEN_LUT_BUCKETS / 2));
  b = b < GEFEN_LUT_BUCKETS - 1 ? b : GEFEN_LUT_BUCKETS - 1;
  int k = t->bucket[b];
  k += !(fabsf(u - t->value[k]) <= fabsf(u - t->value[k + 1]));
  /* u is not NaN here, so (u > value[k]) is !(u <= value[k]): last[k] */
  return 2 * k + (u > t->value[k]);
}

/* The code of u in [-1, 1] or NaN (what a requantisation divides out) by the
 * coarse rows (coarse_div > 0), as the AVX2 search computes it, for the tests. */
static inline uint8_t gefen_quant_coarse(const gefen_quantizer *q, float u) {
  const int n = GEFEN_LUT_BUCKETS / q->coarse_div;
  const float x = (u + 1.0f) * (float)(n / 2);
  const int c = x >= 0.0f && x < (float)(n - 1) ? (int)x : n - 1; /* NaN: the top */
  int32_t k;
  memcpy(&k, &q->crow[c][2], sizeof k);
  const int code = k + !(u <= q->crow[c][3]);
  return (uint8_t)(code > 255 ? 255 : code);
}

/* The code of u (any float) as the count of thresholds below it: equal to
 * gefen_quantize_reference for u in [-1, 1] and NaN (tests/c checks). */
static inline uint8_t gefen_quant_count(const gefen_quant_search *s, float u) {
  int c = 0;
  for (int step = GEFEN_CODEBOOK_SIZE / 2; step > 0; step /= 2)
    c += !(u <= s->threshold[c + step]) ? step : 0;
  return (uint8_t)c;
}

#endif /* GEFEN_QUANTIZER_INTERNAL_H */
