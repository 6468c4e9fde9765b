/*
 * Codebook refresh (ALGORITHM.md §3), mirroring quantizer.c's
 * gefen_codes_remap: codes[i] = map[codes[i]], with the 256-byte map staged
 * in shared memory. Grid-stride over the codes.
 */
#include "gefen_cuda_common.cuh"

__global__ void __launch_bounds__(GEFEN_CTA)
    codes_remap_kernel(uint8_t *codes, int64_t n, const uint8_t *__restrict__ map) {
  __shared__ uint8_t m[GEFEN_CODEBOOK_SIZE];
  for (int i = threadIdx.x; i < GEFEN_CODEBOOK_SIZE; i += GEFEN_CTA) m[i] = map[i];
  __syncthreads();
  for (int64_t i = (int64_t)blockIdx.x * GEFEN_CTA + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * GEFEN_CTA)
    codes[i] = m[codes[i]];
}

extern "C" gefen_status gefen_cuda_codes_remap(uint8_t *codes, int64_t n,
                                               const uint8_t *device_map, void *stream,
                                               gefen_error *err) {
  gefen_cuda_clear(err);
  if (n < 0) return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "negative length %lld", (long long)n);
  if (n == 0) return GEFEN_OK;
  if (!codes || !device_map) return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "NULL buffer");
  codes_remap_kernel<<<gefen_grid(n, GEFEN_CTA), GEFEN_CTA, 0, (cudaStream_t)stream>>>(
      codes, n, device_map);
  return gefen_cuda_launched("codes remap", -1, err);
}
