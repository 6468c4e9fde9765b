/* The quantiser's internals, shared by the kernels that inline it. */
#ifndef GEFEN_QUANTIZER_INTERNAL_H
#define GEFEN_QUANTIZER_INTERNAL_H

#include "core_internal.h"

struct gefen_quantizer {
  gefen_quant_table table;
  /* pair[k] = value[k] | value[k + 1] << 32 (as bits): both candidates of a
   * bucket in one 64-bit gather for the SIMD search */
  uint64_t pair[GEFEN_CODEBOOK_SIZE];
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

#endif /* GEFEN_QUANTIZER_INTERNAL_H */
