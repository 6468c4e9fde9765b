/* The AVX-512 + VBMI momentum and requantisation primitives (see block_ops.h
 * and block_avx512_kernels.h): a template (no include guard) included once by
 * block_avx512vbmi.c and once by block_avx512bf16.c, which differ only in
 * their target and in CVT_BF16 (1: bfloat16 values are rounded by the
 * AVX512-BF16 conversion, see block_avx512_kernels.h). The including file
 * defines TARGET, INLINE and CVT_BF16, includes block_avx512_common.h first,
 * and gets the table ops_vbmi.
 *
 * Codebook values without a gather (on the first CPUs we measured, one
 * 16-lane gather cost 25-40 cycles, more than all the arithmetic of a step;
 * on a Sapphire Rapids without the gather mitigation it costs about 8, and
 * gathers in place of the look-ups below still made the steps 0-13% slower,
 * docs/performance.md) and with byte permutes.
 *
 * Decoding C[code]: the 256 fp32 entries are four 256-byte tables, byte b of
 * every entry (gefen_quant_search.plane). Two vpermi2b and a blend look up one
 * byte plane for 64 codes, and four unpacks interleave the planes into 64
 * floats. The unpacks work inside 128-bit lanes, so they take the codes in a
 * transposed order (transpose_dwords) and give the floats in order. The
 * search's counts become code bytes in that same order by two packs, and
 * their bits are put back in order by one GFNI affine transform (reverse_bits;
 * it replaced a look-up of a 256-byte table, two vpermt2b and a blend:
 * docs/performance.md). The remaining primitives are block_avx512.c's. */

/* The 64 bytes of x as a 4 x 4 matrix of dwords, transposed: byte 16 * L +
 * 4 * k + i <-> byte 16 * k + 4 * L + i. Its own inverse. */
INLINE __m512i transpose_dwords(__m512i x) {
  return _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), x);
}

/* A 256-entry byte table at 64 byte indices. */
INLINE __m512i lookup_bytes(const uint8_t *table, __m512i idx) {
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(table), idx,
                                              _mm512_loadu_si512(table + 64));
  const __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(table + 128), idx,
                                              _mm512_loadu_si512(table + 192));
  return _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi);
}

/* The bits of every byte in reverse order (quantizer.c's bit_reverse8 of each
 * byte): the GF(2) affine transform whose matrix maps bit i to bit 7 - i. */
INLINE __m512i reverse_bits(__m512i x) {
  return _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64((long long)0x8040201008040201ull), 0);
}

/* A 256-entry float table given as four byte planes (byte b of entry i at
 * plane[b][i]) at 64 indices in transposed order, as four vectors of 16
 * floats in element order. */
INLINE void lookup_planes64(const uint8_t (*plane)[GEFEN_CODEBOOK_SIZE], __m512i idx_t,
                            __m512 out[4]) {
  const __m512i b0 = lookup_bytes(plane[0], idx_t), b1 = lookup_bytes(plane[1], idx_t);
  const __m512i b2 = lookup_bytes(plane[2], idx_t), b3 = lookup_bytes(plane[3], idx_t);
  const __m512i lo01 = _mm512_unpacklo_epi8(b0, b1), hi01 = _mm512_unpackhi_epi8(b0, b1);
  const __m512i lo23 = _mm512_unpacklo_epi8(b2, b3), hi23 = _mm512_unpackhi_epi8(b2, b3);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}

/* C[code] of 64 codes given in transposed order, as four vectors of 16 floats
 * in element order. */
INLINE void decode64(const gefen_quant_search *s, __m512i codes_t, __m512 out[4]) {
  lookup_planes64(s->plane, codes_t, out);
}

/* The entries of a 256-entry table given as byte planes (the codebook's, or a
 * block's value table, block_avx512_kernels.h) at the 64 codes at codes[0..64)
 * (the lanes of km). */
INLINE void decode_codes64_with(const uint8_t (*plane)[GEFEN_CODEBOOK_SIZE], const uint8_t *codes,
                                __mmask64 km, __m512 out[4]) {
  lookup_planes64(plane, transpose_dwords(_mm512_maskz_loadu_epi8(km, codes)), out);
}

INLINE void decode_codes64(const gefen_quant_search *s, const uint8_t *codes, __mmask64 km,
                           __m512 out[4]) {
  decode_codes64_with(s->plane, codes, km, out);
}

/* The four count vectors (each lane 0..255, bits reversed) as 64 code bytes
 * in the transposed order of decode64: the unsigned-saturating packs
 * interleave 4-lane groups, which is exactly that order. */
INLINE __m512i codes_t_of(const __m512i bits[4]) {
  const __m512i w01 = _mm512_packus_epi32(bits[0], bits[1]);
  const __m512i w23 = _mm512_packus_epi32(bits[2], bits[3]);
  return reverse_bits(_mm512_packus_epi16(w01, w23));
}

/* 64 codes given in transposed order stored in element order. */
INLINE void store_t(__m512i codes_t, uint8_t *codes, __mmask64 km) {
  _mm512_mask_storeu_epi8(codes, km, transpose_dwords(codes_t));
}

/* The codes of bits[4] stored in element order; returns them transposed. */
INLINE __m512i store_codes_t(const __m512i bits[4], uint8_t *codes, __mmask64 km) {
  const __m512i codes_t = codes_t_of(bits);
  store_t(codes_t, codes, km);
  return codes_t;
}

INLINE void store_and_decode64(const gefen_quant_search *s, const __m512i bits[4],
                               uint8_t *codes, __mmask64 km, __m512 out[4]) {
  decode64(s, store_codes_t(bits, codes, km), out);
}

INLINE void store_codes64(const gefen_quant_search *s, const __m512i bits[4], uint8_t *codes,
                          __mmask64 km) {
  (void)s; /* the table's contract (block_avx512_kernels.h); no table needed here */
  (void)store_codes_t(bits, codes, km);
}

/* The packed order of bfloat16 Adam steps (block_avx512_kernels.h): vector v
 * of a whole group holds its elements e(v, i) = 32 (v / 2) + 2 i + v % 2.
 * decode64 gives out[v] lane 4 L + d the entry of byte 16 L + 4 v + d, so the
 * codes go in through a byte permute putting code e(v, 4 L + d) there (one
 * vpermb, as transpose_dwords is one vpermd), and the search's counts, packed
 * to bytes in that same order, go out through its inverse. */
#define PACKED_BF16 1

INLINE void decode_codes64_packed(const uint8_t (*plane)[GEFEN_CODEBOOK_SIZE], const uint8_t *codes,
                                  __m512 out[4]) {
  static const uint8_t in[64] = {0,  2,  4,  6,  1,  3,  5,  7,  32, 34, 36, 38, 33, 35, 37, 39,
                                 8,  10, 12, 14, 9,  11, 13, 15, 40, 42, 44, 46, 41, 43, 45, 47,
                                 16, 18, 20, 22, 17, 19, 21, 23, 48, 50, 52, 54, 49, 51, 53, 55,
                                 24, 26, 28, 30, 25, 27, 29, 31, 56, 58, 60, 62, 57, 59, 61, 63};
  lookup_planes64(plane, _mm512_permutexvar_epi8(_mm512_loadu_si512(in), _mm512_loadu_si512(codes)),
                  out);
}

/* 64 codes given in transposed order stored for a packed group (element
 * order). */
INLINE void store_packed_t(__m512i codes_t, uint8_t *codes) {
  static const uint8_t back[64] = {0,  4,  1,  5,  2,  6,  3,  7,  16, 20, 17, 21, 18, 22, 19, 23,
                                   32, 36, 33, 37, 34, 38, 35, 39, 48, 52, 49, 53, 50, 54, 51, 55,
                                   8,  12, 9,  13, 10, 14, 11, 15, 24, 28, 25, 29, 26, 30, 27, 31,
                                   40, 44, 41, 45, 42, 46, 43, 47, 56, 60, 57, 61, 58, 62, 59, 63};
  _mm512_storeu_si512(codes, _mm512_permutexvar_epi8(_mm512_loadu_si512(back), codes_t));
}

/* The same, and their entries of the table plane in the packed order. */
INLINE void store_and_decode64_packed_t(const uint8_t (*plane)[GEFEN_CODEBOOK_SIZE],
                                        __m512i codes_t, uint8_t *codes, __m512 out[4]) {
  store_packed_t(codes_t, codes);
  lookup_planes64(plane, codes_t, out);
}

INLINE void store_and_decode64_packed(const gefen_quant_search *s, const __m512i bits[4],
                                      uint8_t *codes, __m512 out[4]) {
  store_and_decode64_packed_t(s->plane, codes_t_of(bits), codes, out);
}

/* The search over 16-bit keys (block_avx512_kernels.h, KEY_SEARCH): it needs
 * the byte look-ups above. */
#define KEY_SEARCH 1

#include "block_avx512_kernels.h"

static const gefen_block_ops ops_vbmi = {
    adam_momentum,    muon_momentum,           requantize,
    requantize_apply, gefen_avx512_row_stats,  gefen_avx512_apply_block,
    gefen_avx512_apply_factored, gefen_avx512_muon_output, dequantize_apply,
    adam_period1,
};
