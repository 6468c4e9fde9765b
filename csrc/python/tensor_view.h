/* Reading torch tensors (or any DLPack producer) as plain views. */
#ifndef GEFEN_TENSOR_VIEW_H
#define GEFEN_TENSOR_VIEW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "dlpack/dlpack.h"
#include "gefen_core.h"

/* A tensor seen through DLPack: its data pointer (byte offset applied),
 * element count, rows R = shape[0] (1 for 0-D) and S = prod(shape[1:]). */
typedef struct {
  void *data;
  int64_t numel, rows, cols;
  int ndim;
  const int64_t *shape; /* valid until the call returns */
  DLDataType dtype;
  DLDevice device;
  int contiguous;
} gefen_view;

/* Holds what keeps the views of one call alive (DLPack capsules from the
 * fallback path). Release exactly once, with the GIL held. */
typedef struct {
  PyObject *capsules; /* list, created on first use */
} gefen_view_keep;

/* Fills v from obj. Returns 0, or -1 with a Python exception set that names
 * `what` of parameter `name`. */
int gefen_view_get(PyObject *obj, gefen_view *v, gefen_view_keep *keep,
                   const char *name, const char *what);
void gefen_view_keep_release(gefen_view_keep *keep);

/* The core dtype of a DLPack dtype; -1 when it is not a float type gefen takes. */
int gefen_view_core_dtype(DLDataType dt);
/* "float32", "uint8", ...: for error messages. */
const char *gefen_view_dtype_name(DLDataType dt);

/* Checks that v is a contiguous tensor of dtype (code, bits) with numel
 * elements on device; sets ValueError/TypeError naming the parameter. */
int gefen_view_expect(const gefen_view *v, const char *name, const char *what,
                      uint8_t code, uint8_t bits, int64_t numel, DLDevice device);

/* 1 when a and b have the same shape. */
int gefen_view_same_shape(const gefen_view *a, const gefen_view *b);

/* Raises the Python exception for a core status, prefixed with `name`. */
void gefen_raise_status(gefen_status st, const char *name, const char *msg);

#endif /* GEFEN_TENSOR_VIEW_H */
