/* gefen._C: the CPython binding of the C core. The only translation units
 * that include Python.h live in this folder. The module links no libtorch:
 * tensors arrive through DLPack (tensor_view.c). */
#include "quantizer_type.h" /* Python.h first */
#include "build_info.h"
#include "steps.h"

#include <string.h>

/* --------------------------------------------------------------- Quantizer */

static int read_codebook(PyObject *obj, float *out) {
  gefen_view_keep keep = {NULL};
  gefen_view v;
  const DLDevice cpu = {kDLCPU, 0};
  int rc = -1;
  if (gefen_view_get(obj, &v, &keep, "<codebook>", "the codebook") == 0 &&
      gefen_view_expect(&v, "<codebook>", "the codebook", kDLFloat, 32, GEFEN_CODEBOOK_SIZE,
                        cpu) == 0) {
    memcpy(out, v.data, GEFEN_CODEBOOK_SIZE * sizeof(float));
    rc = 0;
  }
  gefen_view_keep_release(&keep);
  return rc;
}

static PyObject *quantizer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"codebook", NULL};
  PyObject *cb_obj;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Quantizer", kwlist, &cb_obj)) return NULL;
  float cb[GEFEN_CODEBOOK_SIZE];
  if (read_codebook(cb_obj, cb) != 0) return NULL;
  gefen_quantizer *q = NULL;
  gefen_error err;
  gefen_status st = gefen_quantizer_create(cb, &q, &err);
  if (st != GEFEN_OK) {
    gefen_raise_status(st, NULL, err.msg);
    return NULL;
  }
  GefenQuantizer *self = (GefenQuantizer *)PyType_GenericAlloc(type, 0);
  if (!self) {
    gefen_quantizer_destroy(q);
    return NULL;
  }
  self->q = q;
  return (PyObject *)self;
}

static void quantizer_dealloc(GefenQuantizer *self) {
  PyTypeObject *tp = Py_TYPE(self);
  gefen_quantizer_destroy(self->q);
  PyObject_Free(self);
  Py_DECREF(tp); /* heap type */
}

static PyObject *quantizer_codebook(GefenQuantizer *self, PyObject *unused) {
  (void)unused;
  const gefen_quant_table *t = gefen_quantizer_table(self->q);
  PyObject *out = PyTuple_New(GEFEN_CODEBOOK_SIZE);
  if (!out) return NULL;
  for (int i = 0; i < GEFEN_CODEBOOK_SIZE; i++) {
    PyObject *f = PyFloat_FromDouble(t->codebook[i]);
    if (!f) {
      Py_DECREF(out);
      return NULL;
    }
    PyTuple_SetItem(out, i, f); /* steals f; cannot fail for i < size */
  }
  return out;
}

static PyObject *quantizer_nearest_one(GefenQuantizer *self, PyObject *arg) {
  double u = PyFloat_AsDouble(arg);
  if (u == -1.0 && PyErr_Occurred()) return NULL;
  return PyLong_FromLong(gefen_quantize_nearest(self->q, (float)u));
}

static PyObject *quantizer_stochastic_one(GefenQuantizer *self, PyObject *args) {
  float u;
  unsigned long long seed;
  long long index;
  if (!PyArg_ParseTuple(args, "fKL", &u, &seed, &index)) return NULL;
  return PyLong_FromLong(gefen_quantize_stochastic(self->q, u, seed, index));
}

/* nearest(u: float32 tensor, out: uint8 tensor of the same size) */
static PyObject *quantizer_nearest(GefenQuantizer *self, PyObject *args) {
  PyObject *u_obj, *out_obj;
  if (!PyArg_ParseTuple(args, "OO", &u_obj, &out_obj)) return NULL;
  gefen_view_keep keep = {NULL};
  gefen_view u, out;
  const DLDevice cpu = {kDLCPU, 0};
  PyObject *result = NULL;
  if (gefen_view_get(u_obj, &u, &keep, "<values>", "the values") != 0 ||
      gefen_view_expect(&u, "<values>", "the values", kDLFloat, 32, u.numel, cpu) != 0 ||
      gefen_view_get(out_obj, &out, &keep, "<values>", "the codes") != 0 ||
      gefen_view_expect(&out, "<values>", "the codes", kDLUInt, 8, u.numel, cpu) != 0)
    goto done;
  {
    gefen_error err;
    gefen_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gefen_quantize(self->q, (const float *)u.data, u.numel, (uint8_t *)out.data, &err);
    Py_END_ALLOW_THREADS
    if (st != GEFEN_OK) {
      gefen_raise_status(st, NULL, err.msg);
      goto done;
    }
  }
  result = Py_NewRef(Py_None);
done:
  gefen_view_keep_release(&keep);
  return result;
}

/* remap_table(new) -> bytes: code c of this codebook -> the nearest code of
 * `new` to its value (codebook refresh). */
static PyObject *quantizer_remap_table(GefenQuantizer *self, PyObject *arg) {
  if (!PyObject_TypeCheck(arg, GefenQuantizer_Type)) {
    PyErr_SetString(PyExc_TypeError, "remap_table expects a Quantizer");
    return NULL;
  }
  const gefen_quant_table *old = gefen_quantizer_table(self->q);
  const gefen_quantizer *target = ((GefenQuantizer *)arg)->q;
  char map[GEFEN_CODEBOOK_SIZE];
  for (int c = 0; c < GEFEN_CODEBOOK_SIZE; c++)
    map[c] = (char)gefen_quantize_nearest(target, old->codebook[c]);
  return PyBytes_FromStringAndSize(map, GEFEN_CODEBOOK_SIZE);
}

/* table_bytes() -> bytes of the plain gefen_quant_table (for devices). */
static PyObject *quantizer_table_bytes(GefenQuantizer *self, PyObject *unused) {
  (void)unused;
  return PyBytes_FromStringAndSize((const char *)gefen_quantizer_table(self->q),
                                   sizeof(gefen_quant_table));
}

static PyObject *quantizer_exact_lut(GefenQuantizer *self, void *closure) {
  (void)closure;
  return PyBool_FromLong(gefen_quantizer_table(self->q)->exact_lut);
}

static PyMethodDef quantizer_methods[] = {
    {"codebook", (PyCFunction)quantizer_codebook, METH_NOARGS,
     "codebook() -> tuple of the 256 codebook entries"},
    {"nearest_one", (PyCFunction)quantizer_nearest_one, METH_O,
     "nearest_one(u) -> the nearest code of u"},
    {"stochastic_one", (PyCFunction)quantizer_stochastic_one, METH_VARARGS,
     "stochastic_one(u, seed, global_index) -> the stochastically rounded code of u"},
    {"nearest", (PyCFunction)quantizer_nearest, METH_VARARGS,
     "nearest(u, out) -> None: nearest codes of a float32 tensor into a uint8 tensor"},
    {"remap_table", (PyCFunction)quantizer_remap_table, METH_O,
     "remap_table(new) -> bytes mapping each code to the nearest code of new"},
    {"table_bytes", (PyCFunction)quantizer_table_bytes, METH_NOARGS,
     "table_bytes() -> the lookup table as bytes (layout of gefen_quant_table)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef quantizer_getset[] = {
    {"exact_lut", (getter)quantizer_exact_lut, NULL,
     "True when the fast lookup table is exact for this codebook", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

/* A heap type (the limited API has no static types), made once at module init. */
PyTypeObject *GefenQuantizer_Type = NULL;

static PyType_Slot quantizer_slots[] = {
    {Py_tp_new, (void *)quantizer_new},
    {Py_tp_dealloc, (void *)quantizer_dealloc},
    {Py_tp_methods, quantizer_methods},
    {Py_tp_getset, quantizer_getset},
    {Py_tp_doc,
     (void *)"Quantizer(codebook): nearest-code quantiser for a 256-entry float32 codebook"},
    {0, NULL}};

/* Immutable like the static type it replaces: its attributes cannot be reassigned. */
static PyType_Spec quantizer_spec = {"gefen._C.Quantizer", sizeof(GefenQuantizer), 0,
                                     Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
                                     quantizer_slots};

/* ----------------------------------------------------------- free functions */

static PyObject *py_period_candidates(PyObject *self, PyObject *args) {
  (void)self;
  long long cols, numel;
  if (!PyArg_ParseTuple(args, "LL", &cols, &numel)) return NULL;
  int64_t n = gefen_period_candidates(cols, numel, NULL, 0);
  int64_t *buf = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
  if (!buf) return PyErr_NoMemory();
  gefen_period_candidates(cols, numel, buf, n);
  PyObject *out = PyList_New((Py_ssize_t)n);
  for (int64_t i = 0; out && i < n; i++) {
    PyObject *v = PyLong_FromLongLong(buf[i]);
    if (!v) {
      Py_CLEAR(out);
      break;
    }
    PyList_SetItem(out, (Py_ssize_t)i, v); /* steals v; cannot fail for i < size */
  }
  PyMem_Free(buf);
  return out;
}

/* period_choose(cols, numel, ndim, candidates, stats) -> int, with the
 * candidates and their (reduced) statistics as int64 CPU tensors. */
static PyObject *py_period_choose(PyObject *self, PyObject *args) {
  (void)self;
  long long cols, numel;
  int ndim;
  PyObject *c_obj, *s_obj;
  if (!PyArg_ParseTuple(args, "LLiOO", &cols, &numel, &ndim, &c_obj, &s_obj)) return NULL;
  gefen_view_keep keep = {NULL};
  gefen_view c, s;
  const DLDevice cpu = {kDLCPU, 0};
  PyObject *result = NULL;
  if (gefen_view_get(c_obj, &c, &keep, "<period>", "candidates") != 0 ||
      gefen_view_expect(&c, "<period>", "candidates", kDLInt, 64, c.numel, cpu) != 0 ||
      gefen_view_get(s_obj, &s, &keep, "<period>", "statistics") != 0 ||
      gefen_view_expect(&s, "<period>", "statistics", kDLInt, 64,
                        c.numel * GEFEN_PERIOD_STAT_WIDTH, cpu) != 0)
    goto done;
  {
    int64_t period = 0;
    gefen_error err;
    gefen_status st = gefen_period_choose(cols, numel, ndim, (const int64_t *)c.data, c.numel,
                                          (const int64_t *)s.data, &period, &err);
    if (st != GEFEN_OK)
      gefen_raise_status(st, NULL, err.msg);
    else
      result = PyLong_FromLongLong(period);
  }
done:
  gefen_view_keep_release(&keep);
  return result;
}

/* exact_sum(values: float64 CPU tensor) -> float: the exact sum of finite
 * non-negative values rounded once (what the period search uses). */
/* tensor_bytes(t) -> bytes: a copy of the memory of a contiguous CPU tensor
 * (checkpoint digests hash state rows with the standard library's hashlib;
 * torch offers no buffer view of a tensor without numpy). */
static PyObject *py_tensor_bytes(PyObject *self, PyObject *arg) {
  (void)self;
  gefen_view_keep keep = {NULL};
  gefen_view v;
  PyObject *result = NULL;
  if (gefen_view_get(arg, &v, &keep, "<tensor_bytes>", "the tensor") != 0) goto done;
  if (v.device.device_type != kDLCPU || !v.contiguous || v.dtype.lanes != 1 ||
      v.dtype.bits % 8) {
    PyErr_SetString(PyExc_ValueError, "tensor_bytes needs a contiguous CPU tensor");
    goto done;
  }
  result = PyBytes_FromStringAndSize((const char *)v.data,
                                     (Py_ssize_t)(v.numel * (int64_t)(v.dtype.bits / 8)));
done:
  gefen_view_keep_release(&keep);
  return result;
}

static PyObject *py_exact_sum(PyObject *self, PyObject *arg) {
  (void)self;
  gefen_view_keep keep = {NULL};
  gefen_view v;
  const DLDevice cpu = {kDLCPU, 0};
  PyObject *result = NULL;
  int64_t limbs[GEFEN_XSUM_LIMBS] = {0};
  if (gefen_view_get(arg, &v, &keep, "<exact_sum>", "the values") != 0 ||
      gefen_view_expect(&v, "<exact_sum>", "the values", kDLFloat, 64, v.numel, cpu) != 0)
    goto done;
  {
    gefen_error err;
    gefen_status st = gefen_exact_sum_add(limbs, (const double *)v.data, v.numel, &err);
    if (st != GEFEN_OK)
      gefen_raise_status(st, NULL, err.msg);
    else
      result = PyFloat_FromDouble(gefen_exact_sum_value(limbs));
  }
done:
  gefen_view_keep_release(&keep);
  return result;
}

/* codebook_solve(hist: int64[4096], out: float32[256]) */
static PyObject *py_codebook_solve(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *h_obj, *o_obj;
  if (!PyArg_ParseTuple(args, "OO", &h_obj, &o_obj)) return NULL;
  gefen_view_keep keep = {NULL};
  gefen_view h, o;
  const DLDevice cpu = {kDLCPU, 0};
  PyObject *result = NULL;
  if (gefen_view_get(h_obj, &h, &keep, "<codebook>", "the histogram") != 0 ||
      gefen_view_expect(&h, "<codebook>", "the histogram", kDLInt, 64, GEFEN_HIST_BINS, cpu) != 0 ||
      gefen_view_get(o_obj, &o, &keep, "<codebook>", "the codebook") != 0 ||
      gefen_view_expect(&o, "<codebook>", "the codebook", kDLFloat, 32, GEFEN_CODEBOOK_SIZE,
                        cpu) != 0)
    goto done;
  {
    gefen_error err;
    gefen_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gefen_codebook_solve((const int64_t *)h.data, (float *)o.data, &err);
    Py_END_ALLOW_THREADS
    if (st != GEFEN_OK) {
      gefen_raise_status(st, NULL, err.msg);
      goto done;
    }
  }
  result = Py_NewRef(Py_None);
done:
  gefen_view_keep_release(&keep);
  return result;
}

static PyObject *py_codebook_validate(PyObject *self, PyObject *arg) {
  (void)self;
  float cb[GEFEN_CODEBOOK_SIZE];
  if (read_codebook(arg, cb) != 0) return NULL;
  gefen_error err;
  gefen_status st = gefen_codebook_validate(cb, &err);
  if (st != GEFEN_OK) {
    gefen_raise_status(st, NULL, err.msg);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *py_sr_uniform(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long seed;
  long long index;
  if (!PyArg_ParseTuple(args, "KL", &seed, &index)) return NULL;
  return PyFloat_FromDouble(gefen_sr_uniform(seed, index));
}

static PyObject *py_core_version(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyLong_FromLong(gefen_core_version());
}

static PyObject *py_has_threads(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyBool_FromLong(gefen_core_has_threads());
}

static PyMethodDef module_methods[] = {
    {"core_version", py_core_version, METH_NOARGS, "core_version() -> int"},
    {"has_threads", py_has_threads, METH_NOARGS, "has_threads() -> bool: built with OpenMP"},
    {"build_info", gefen_py_build_info, METH_NOARGS,
     "build_info() -> dict: distribution, version, compiler, flags, OpenMP, CUDA of this build"},
    {"simd_path", gefen_py_simd_path, METH_NOARGS,
     "simd_path() -> 'avx512bf16', 'avx512vbmi', 'avx512', 'avx2' or 'portable': the element "
     "kernels chosen on this CPU"},
    {"key_search", gefen_py_key_search, METH_NOARGS,
     "key_search() -> bool: the VBMI kernels search nearest codes over 16-bit keys here "
     "(AMD), else over floats; the same codes either way"},
    {"default_threads", gefen_py_default_threads, METH_NOARGS,
     "default_threads() -> int: threads of a core call with nthreads=0 (OpenMP's default)"},
    {"built_with_cuda", gefen_py_built_with_cuda, METH_NOARGS,
     "built_with_cuda() -> bool: the CUDA kernels are compiled in"},
    {"cuda_available", gefen_py_cuda_available, METH_NOARGS,
     "cuda_available() -> bool: built with CUDA and a device is visible"},
    {"period_candidates", py_period_candidates, METH_VARARGS,
     "period_candidates(cols, numel) -> list of candidate periods"},
    {"period_stats", gefen_py_period_stats, METH_VARARGS,
     "period_stats(name, grad, candidates, stats, nthreads=0, stream=None): add the exact "
     "phase-1 statistics (int64, PERIOD_STAT_WIDTH per candidate)"},
    {"period_choose", py_period_choose, METH_VARARGS,
     "period_choose(cols, numel, ndim, candidates, stats) -> period"},
    {"tensor_bytes", py_tensor_bytes, METH_O,
     "tensor_bytes(t) -> bytes: a copy of a contiguous CPU tensor's memory"},
    {"exact_sum", py_exact_sum, METH_O,
     "exact_sum(values) -> float: exact sum of finite non-negative float64 values, rounded once"},
    {"histogram", gefen_py_histogram, METH_VARARGS,
     "histogram(name, grad, period, hist, nthreads=0, stream=None): add the block-normalised "
     "histogram"},
    {"codebook_solve", py_codebook_solve, METH_VARARGS,
     "codebook_solve(hist, out): the exact k-means codebook of a histogram"},
    {"codebook_validate", py_codebook_validate, METH_O,
     "codebook_validate(codebook): raise ValueError unless it is a valid codebook"},
    {"codes_remap", gefen_py_codes_remap, METH_VARARGS,
     "codes_remap(codes, map, nthreads=0, stream=None): codes[i] = map[codes[i]]"},
    {"sr_uniform", py_sr_uniform, METH_VARARGS,
     "sr_uniform(seed, global_index) -> the stochastic-rounding variate"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "gefen._C",
    "The C core of gefen: kernels, codebook solver and period search.", -1, module_methods,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) {
  if (!GefenQuantizer_Type) {
    GefenQuantizer_Type = (PyTypeObject *)PyType_FromSpec(&quantizer_spec);
    if (!GefenQuantizer_Type) return NULL;
  }
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return NULL;
  if (PyModule_AddObjectRef(m, "Quantizer", (PyObject *)GefenQuantizer_Type) < 0 ||
      gefen_add_step_types(m) < 0 ||
      PyModule_AddIntConstant(m, "CODEBOOK_SIZE", GEFEN_CODEBOOK_SIZE) < 0 ||
      PyModule_AddIntConstant(m, "HIST_BINS", GEFEN_HIST_BINS) < 0 ||
      PyModule_AddIntConstant(m, "PERIOD_STAT_WIDTH", GEFEN_PERIOD_STAT_WIDTH) < 0 ||
      PyModule_AddIntConstant(m, "QUANT_TABLE_BYTES", (long)sizeof(gefen_quant_table)) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
