/* The quantiser's internals, shared by the kernels that inline it. */
#ifndef GEFEN_QUANTIZER_INTERNAL_H
#define GEFEN_QUANTIZER_INTERNAL_H

#include "core_internal.h"

struct gefen_quantizer {
  gefen_quant_table table;
  /* pair[k] = value[k] | value[k + 1] << 32 (as bits): both candidates of a
   * bucket in one 64-bit gather for the SIMD search */
  uint64_t pair[GEFEN_CODEBOOK_SIZE];
};

uint8_t gefen_quantize_reference(const float *codebook, float u);
uint8_t gefen_quant_stochastic(const gefen_quant_table *t, float u, uint64_t seed,
                               int64_t global_index);

/* Nearest code through the lookup table (see quantizer.c for why it is exact). */
static inline uint8_t gefen_quant_nearest(const gefen_quant_table *t, float u) {
  if (!(u >= -1.0f && u <= 1.0f) || !t->exact_lut)
    return gefen_quantize_reference(t->codebook, u);
  int b = (int)((u + 1.0f) * (float)(GEFEN_LUT_BUCKETS / 2));
  if (b > GEFEN_LUT_BUCKETS - 1) b = GEFEN_LUT_BUCKETS - 1;
  int k = t->bucket[b];
  if (!(fabsf(u - t->value[k]) <= fabsf(u - t->value[k + 1]))) k++;
  return u <= t->value[k] ? t->first[k] : t->last[k];
}

#endif /* GEFEN_QUANTIZER_INTERNAL_H */
