/*
 * Device utilities of gefen_cuda.h: device selection, the quantiser table
 * upload and a stream wait, so that the C extension needs no CUDA header.
 */
#include "gefen_cuda_common.cuh"

extern "C" int gefen_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError(); /* "no device" is an answer, not a sticky error */
    return 0;
  }
  return n;
}

extern "C" gefen_status gefen_cuda_set_device(int device, int *previous, gefen_error *err) {
  gefen_cuda_clear(err);
  int cur = -1;
  gefen_status st = gefen_cuda_check(cudaGetDevice(&cur), "cudaGetDevice", -1, err);
  if (st != GEFEN_OK) return st;
  if (previous) *previous = cur;
  if (cur == device) return GEFEN_OK;
  return gefen_cuda_check(cudaSetDevice(device), "cudaSetDevice", -1, err);
}

extern "C" gefen_status gefen_cuda_upload_table(gefen_quant_table *device_table,
                                                const gefen_quant_table *host_table,
                                                void *stream, gefen_error *err) {
  gefen_cuda_clear(err);
  if (!device_table || !host_table)
    return gefen_cuda_fail(err, GEFEN_EVALUE, -1, "quantizer table is NULL");
  /* from pageable memory the copy is staged before this returns, so the host
   * table may change afterwards */
  return gefen_cuda_check(cudaMemcpyAsync(device_table, host_table, sizeof *host_table,
                                          cudaMemcpyHostToDevice, (cudaStream_t)stream),
                          "quantizer table upload", -1, err);
}

extern "C" gefen_status gefen_cuda_stream_sync(void *stream, gefen_error *err) {
  gefen_cuda_clear(err);
  return gefen_cuda_check(cudaStreamSynchronize((cudaStream_t)stream), "stream synchronize", -1,
                          err);
}
