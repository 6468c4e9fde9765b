/* Tensors cross into C through DLPack. The fast path is the DLPack 1.3
 * exchange API (`type(t).__dlpack_c_exchange_api__`, PyTorch >= 2.10): it
 * fills a DLTensor on the stack with no allocation and no Python call. The
 * fallback is the `__dlpack__()` protocol; its capsules are kept alive in a
 * list until the call ends. */
#include "tensor_view.h"

#include <stdio.h>
#include <string.h>

/* The exchange tables of the last few tensor types seen (torch.Tensor and
 * torch.nn.Parameter in practice). Types are kept referenced so the cached
 * pointers stay valid for the life of the module. */
#define API_CACHE 4
static PyTypeObject *cached_type[API_CACHE];
static const DLPackExchangeAPI *cached_api[API_CACHE];

static const DLPackExchangeAPI *exchange_api(PyTypeObject *type) {
  for (int i = 0; i < API_CACHE; i++)
    if (cached_type[i] == type) return cached_api[i];
  const DLPackExchangeAPI *api = NULL;
  PyObject *cap = PyObject_GetAttrString((PyObject *)type, "__dlpack_c_exchange_api__");
  if (!cap) {
    PyErr_Clear();
  } else {
    if (PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
      api = (const DLPackExchangeAPI *)PyCapsule_GetPointer(cap, "dlpack_exchange_api");
      if (api && (api->header.version.major != DLPACK_MAJOR_VERSION ||
                  !api->dltensor_from_py_object_no_sync))
        api = NULL;
    }
    Py_DECREF(cap);
  }
  /* Evict the last slot; shift the others down. */
  Py_XDECREF(cached_type[API_CACHE - 1]);
  for (int i = API_CACHE - 1; i > 0; i--) {
    cached_type[i] = cached_type[i - 1];
    cached_api[i] = cached_api[i - 1];
  }
  Py_INCREF(type);
  cached_type[0] = type;
  cached_api[0] = api;
  return api;
}

static int keep_capsule(gefen_view_keep *keep, PyObject *capsule) {
  if (!keep->capsules) {
    keep->capsules = PyList_New(0);
    if (!keep->capsules) return -1;
  }
  return PyList_Append(keep->capsules, capsule);
}

void gefen_view_keep_release(gefen_view_keep *keep) { Py_CLEAR(keep->capsules); }

/* A tensor that requires grad, detached (a new reference; obj itself, with a
 * new reference, otherwise): torch's __dlpack__() refuses one that requires
 * grad, and the optimizer hands over its parameters as they are (the
 * exchange API reads them directly). */
static PyObject *detached(PyObject *obj) {
  PyObject *rg = PyObject_GetAttrString(obj, "requires_grad");
  if (!rg) { /* not a torch tensor */
    PyErr_Clear();
    Py_INCREF(obj);
    return obj;
  }
  const int requires_grad = PyObject_IsTrue(rg);
  Py_DECREF(rg);
  if (requires_grad < 0) return NULL;
  if (!requires_grad) {
    Py_INCREF(obj);
    return obj;
  }
  return PyObject_CallMethod(obj, "detach", NULL);
}

/* The __dlpack__() protocol: versioned capsule when the producer offers it. */
static int dltensor_from_protocol(PyObject *obj, DLTensor *out, uint64_t *flags,
                                  gefen_view_keep *keep) {
  PyObject *capsule = NULL;
  PyObject *src = detached(obj);
  if (!src) return -1;
  PyObject *method = PyObject_GetAttrString(src, "__dlpack__");
  Py_DECREF(src); /* the bound method holds it */
  if (!method) return -1;
  PyObject *kwargs = Py_BuildValue("{s:(ii)}", "max_version", 1, 0);
  PyObject *args = PyTuple_New(0);
  if (kwargs && args) capsule = PyObject_Call(method, args, kwargs);
  Py_XDECREF(kwargs);
  Py_XDECREF(args);
  if (!capsule && PyErr_ExceptionMatches(PyExc_TypeError)) { /* pre-1.0 producer */
    PyErr_Clear();
    capsule = PyObject_CallNoArgs(method);
  }
  Py_DECREF(method);
  if (!capsule) return -1;
  int rc = -1;
  if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
    if (m) {
      *out = m->dl_tensor;
      *flags = m->flags;
      rc = 0;
    }
  } else if (PyCapsule_IsValid(capsule, "dltensor")) {
    DLManagedTensor *m = PyCapsule_GetPointer(capsule, "dltensor");
    if (m) {
      *out = m->dl_tensor;
      *flags = 0;
      rc = 0;
    }
  } else {
    PyErr_SetString(PyExc_TypeError, "__dlpack__() did not return a DLPack capsule");
  }
  if (rc == 0 && keep_capsule(keep, capsule) != 0) rc = -1;
  Py_DECREF(capsule);
  return rc;
}

static int is_contiguous(const DLTensor *t) {
  if (!t->strides) return 1;
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] != 1 && t->strides[d] != expect) return 0;
    expect *= t->shape[d];
  }
  return 1;
}

int gefen_view_get(PyObject *obj, gefen_view *v, gefen_view_keep *keep,
                   const char *name, const char *what) {
  DLTensor t;
  uint64_t flags = 0;
  int rc;
  const DLPackExchangeAPI *api = exchange_api(Py_TYPE(obj));
  if (api) {
    rc = api->dltensor_from_py_object_no_sync((void *)obj, &t);
  } else {
    rc = dltensor_from_protocol(obj, &t, &flags, keep);
  }
  if (rc != 0) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *s = value ? PyObject_Str(value) : NULL;
    PyErr_Format(PyExc_TypeError, "parameter '%s': %s is not a readable tensor (%s)", name,
                 what, s ? PyUnicode_AsUTF8AndSize(s, NULL) : "unknown error");
    Py_XDECREF(s);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return -1;
  }
  if (flags & DLPACK_FLAG_BITMASK_READ_ONLY) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': %s is read-only", name, what);
    return -1;
  }
  v->data = (char *)t.data + t.byte_offset;
  v->ndim = t.ndim;
  v->dtype = t.dtype;
  v->device = t.device;
  v->contiguous = is_contiguous(&t);
  v->numel = 1;
  for (int d = 0; d < t.ndim; d++) v->numel *= t.shape[d];
  v->shape = t.shape;
  v->rows = t.ndim >= 1 ? t.shape[0] : 1;
  v->cols = 1;
  for (int d = 1; d < t.ndim; d++) v->cols *= t.shape[d];
  /* An empty tensor may have no storage (NULL data). The core tells "absent"
   * (NULL) from "present" (non-NULL) -- a block-form item has a vmean even
   * when a rank holds no rows of it -- so an empty tensor gets a pointer that
   * is never dereferenced. */
  static char empty_storage;
  if (!v->data && v->numel == 0) v->data = &empty_storage;
  return 0;
}

int gefen_view_core_dtype(DLDataType dt) {
  if (dt.lanes != 1) return -1;
  if (dt.code == kDLFloat && dt.bits == 32) return GEFEN_F32;
  if (dt.code == kDLFloat && dt.bits == 16) return GEFEN_F16;
  if (dt.code == kDLFloat && dt.bits == 64) return GEFEN_F64;
  if (dt.code == kDLBfloat && dt.bits == 16) return GEFEN_BF16;
  return -1;
}

const char *gefen_view_dtype_name(DLDataType dt) {
  switch (dt.code) {
    case kDLFloat:
      return dt.bits == 16 ? "float16" : dt.bits == 32 ? "float32" : dt.bits == 64 ? "float64" : "float";
    case kDLBfloat: return "bfloat16";
    case kDLUInt: return dt.bits == 8 ? "uint8" : "unsigned int";
    case kDLInt: return dt.bits == 64 ? "int64" : dt.bits == 32 ? "int32" : "int";
    case kDLComplex: return "complex";
    case kDLBool: return "bool";
    default: return "an unsupported dtype";
  }
}

int gefen_view_expect(const gefen_view *v, const char *name, const char *what,
                      uint8_t code, uint8_t bits, int64_t numel, DLDevice device) {
  if (v->dtype.code != code || v->dtype.bits != bits || v->dtype.lanes != 1) {
    DLDataType want = {code, bits, 1};
    PyErr_Format(PyExc_TypeError, "parameter '%s': %s must be %s, got %s", name, what,
                 gefen_view_dtype_name(want), gefen_view_dtype_name(v->dtype));
    return -1;
  }
  if (v->device.device_type != device.device_type || v->device.device_id != device.device_id) {
    PyErr_Format(PyExc_ValueError,
                 "parameter '%s': %s is on device (%d, %d) but the parameter is on (%d, %d)",
                 name, what, (int)v->device.device_type, (int)v->device.device_id,
                 (int)device.device_type, (int)device.device_id);
    return -1;
  }
  if (v->numel != numel) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': %s has %lld elements, expected %lld", name,
                 what, (long long)v->numel, (long long)numel);
    return -1;
  }
  if (!v->contiguous) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': %s must be contiguous", name, what);
    return -1;
  }
  return 0;
}

void gefen_raise_status(gefen_status st, const char *name, const char *msg) {
  PyObject *type = PyExc_RuntimeError;
  switch (st) {
    case GEFEN_EVALUE: type = PyExc_ValueError; break;
    case GEFEN_ETYPE: type = PyExc_TypeError; break;
    case GEFEN_ENOMEM: type = PyExc_MemoryError; break;
    default: break;
  }
  if (name)
    PyErr_Format(type, "parameter '%s': %s", name, msg);
  else
    PyErr_SetString(type, msg);
}

int gefen_view_same_shape(const gefen_view *a, const gefen_view *b) {
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}
