/* Error messages, versions and thread counts shared by the whole core. */
#include <stdio.h>

#include "core_internal.h"

gefen_status gefen_fail(gefen_error *err, gefen_status status, const char *fmt,
                        ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
  }
  return status;
}

gefen_status gefen_fail_item(gefen_error *err, gefen_status status, int64_t item,
                             const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    err->item = item;
  }
  return status;
}

const char *gefen_error_message(const gefen_error *err) {
  return err ? err->msg : "";
}

int gefen_core_version(void) { return GEFEN_CORE_VERSION; }

int gefen_core_has_threads(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int gefen_threads(int nthreads) {
  if (nthreads > 0) return nthreads;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

int gefen_core_default_threads(void) { return gefen_threads(0); }

size_t gefen_dtype_size(gefen_dtype dtype) {
  switch (dtype) {
    case GEFEN_F32: return 4;
    case GEFEN_BF16: return 2;
    case GEFEN_F16: return 2;
    case GEFEN_F64: return 8;
  }
  return 0;
}

gefen_status gefen_check_layout(gefen_dtype dtype, int64_t rows, int64_t cols, int64_t period,
                                int64_t item, gefen_error *err) {
  if (gefen_dtype_size(dtype) == 0)
    return gefen_fail_item(err, GEFEN_ETYPE, item, "unknown dtype %d", (int)dtype);
  if (rows < 0 || cols < 0)
    return gefen_fail_item(err, GEFEN_EVALUE, item, "negative shape (%lld, %lld)",
                           (long long)rows, (long long)cols);
  if (cols > 0 && rows > INT64_MAX / cols)
    return gefen_fail_item(err, GEFEN_EVALUE, item, "shape overflows int64");
  if (period < 1 || (cols > 0 && cols % period))
    return gefen_fail_item(err, GEFEN_EVALUE, item, "period %lld does not divide %lld",
                           (long long)period, (long long)cols);
  return GEFEN_OK;
}
