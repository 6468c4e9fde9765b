/* The per-step entry points of gefen._C: a whole group of parameters per
 * call. Every tensor is checked (device, dtype, shape, contiguity, overlap)
 * before the core touches anything; the GIL is released around the core.
 *
 * A call's tensors all live on one device. CPU calls run the C core; CUDA
 * calls (builds with GEFEN_WITH_CUDA) run the kernels/ launchers on the
 * stream Python passes, with the quantiser's table as a device tensor. */
#include "steps.h"

#include <stdlib.h>
#include <string.h>

#include "quantizer_type.h"
#ifdef GEFEN_WITH_CUDA
#include "gefen_cuda.h"
#endif

/* ---------------------------------------------------------------- helpers */

typedef struct {
  uintptr_t begin, end;
  Py_ssize_t index;
} span;

static int span_cmp(const void *a, const void *b) {
  const span *x = a, *y = b;
  return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

/* Parameters of one step must not share memory: an update would be applied
 * twice to the shared elements. */
static int check_disjoint(span *spans, Py_ssize_t n, const char *const *names) {
  qsort(spans, (size_t)n, sizeof *spans, span_cmp);
  for (Py_ssize_t i = 1; i < n; i++) {
    if (spans[i].begin < spans[i - 1].end) {
      PyErr_Format(PyExc_ValueError,
                   "parameters '%s' and '%s' overlap in memory; each parameter must own "
                   "its storage",
                   names[spans[i - 1].index], names[spans[i].index]);
      return -1;
    }
  }
  return 0;
}

static int get_f32(PyObject *obj, gefen_view *v, gefen_view_keep *keep, const char *name,
                   const char *what, int64_t numel, DLDevice dev, float **out) {
  if (obj == Py_None) {
    *out = NULL;
    return 0;
  }
  if (gefen_view_get(obj, v, keep, name, what) != 0) return -1;
  if (gefen_view_expect(v, name, what, kDLFloat, 32, numel, dev) != 0) return -1;
  *out = (float *)v->data;
  return 0;
}

static int get_f64(PyObject *obj, gefen_view *v, gefen_view_keep *keep, const char *name,
                   const char *what, int64_t numel, DLDevice dev, double **out) {
  if (obj == Py_None) {
    *out = NULL;
    return 0;
  }
  if (gefen_view_get(obj, v, keep, name, what) != 0) return -1;
  if (gefen_view_expect(v, name, what, kDLFloat, 64, numel, dev) != 0) return -1;
  *out = (double *)v->data;
  return 0;
}

/* A device the build can compute on: the CPU, or CUDA in CUDA builds. */
static int check_device(DLDevice dev, const char *name, const char *what) {
  if (dev.device_type == kDLCPU) return 0;
#ifdef GEFEN_WITH_CUDA
  if (dev.device_type == kDLCUDA) return 0;
  PyErr_Format(PyExc_ValueError, "parameter '%s': %s is on device type %d (gefen computes on "
               "the CPU and on CUDA)", name, what, (int)dev.device_type);
#else
  PyErr_Format(PyExc_ValueError,
               "parameter '%s': %s is on device type %d, but this build of gefen computes on "
               "the CPU only (rebuild with nvcc available, or GEFEN_CUDA=1, for CUDA)",
               name, what, (int)dev.device_type);
#endif
  return -1;
}

static int same_device(DLDevice a, DLDevice b) {
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

/* A parameter (and its gradient): a supported float dtype, contiguous, on a
 * device this build computes on; the gradient of the same dtype and shape. */
static int get_param_grad(PyObject *p_obj, PyObject *g_obj, gefen_view *p, gefen_view *g,
                          gefen_view_keep *keep, const char *name, const char *what,
                          gefen_dtype *dtype) {
  if (gefen_view_get(p_obj, p, keep, name, what) != 0) return -1;
  int dt = gefen_view_core_dtype(p->dtype);
  if (dt < 0) {
    PyErr_Format(PyExc_TypeError,
                 "parameter '%s': %s dtype %s is not supported (use float32, bfloat16, "
                 "float16 or float64)",
                 name, what, gefen_view_dtype_name(p->dtype));
    return -1;
  }
  if (check_device(p->device, name, what) != 0) return -1;
  if (!p->contiguous) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': %s must be contiguous", name, what);
    return -1;
  }
  if (g_obj) {
    if (gefen_view_get(g_obj, g, keep, name, "the gradient") != 0) return -1;
    if (g->dtype.code != p->dtype.code || g->dtype.bits != p->dtype.bits) {
      PyErr_Format(PyExc_TypeError, "parameter '%s': gradient dtype %s differs from parameter dtype %s",
                   name, gefen_view_dtype_name(g->dtype), gefen_view_dtype_name(p->dtype));
      return -1;
    }
    if (!gefen_view_same_shape(p, g)) {
      PyErr_Format(PyExc_ValueError, "parameter '%s': gradient shape differs from parameter shape",
                   name);
      return -1;
    }
    if (gefen_view_expect(g, name, "the gradient", p->dtype.code, p->dtype.bits, p->numel,
                          p->device) != 0)
      return -1;
  }
  *dtype = (gefen_dtype)dt;
  return 0;
}

static int raise_core(gefen_status st, const gefen_error *err, const char *const *names,
                      Py_ssize_t n) {
  const char *name = err->item >= 0 && err->item < n ? names[err->item] : NULL;
  gefen_raise_status(st, name, err->msg);
  return -1;
}

static int get_nthreads(int nthreads) { return nthreads > 0 ? nthreads : 0; }

/* How a call runs: threads (CPU), or stream and device table (CUDA). */
typedef struct {
  int nthreads;
  void *stream;
  PyObject *table_obj; /* the quantiser's table as a uint8 device tensor, or None */
  DLDevice device;     /* of the call's first parameter */
} call_options;

/* One device for a call: every item's device equals the first one's. */
static int check_one_device(call_options *opt, DLDevice dev, const char *name, Py_ssize_t i) {
  if (i == 0) {
    opt->device = dev;
    return 0;
  }
  if (same_device(dev, opt->device)) return 0;
  PyErr_Format(PyExc_ValueError,
               "parameter '%s' is on device (%d, %d), the call's first parameter on (%d, %d); "
               "one call steps the parameters of one device",
               name, (int)dev.device_type, (int)dev.device_id, (int)opt->device.device_type,
               (int)opt->device.device_id);
  return -1;
}

#ifdef GEFEN_WITH_CUDA
/* The device copy of the quantiser's table for a CUDA call. */
static const gefen_quant_table *device_table(const call_options *opt, gefen_view_keep *keep) {
  gefen_view v;
  if (!opt->table_obj || opt->table_obj == Py_None) {
    PyErr_SetString(PyExc_ValueError, "a CUDA step needs the quantizer table on the device");
    return NULL;
  }
  if (gefen_view_get(opt->table_obj, &v, keep, "<quantizer>", "the device table") != 0 ||
      gefen_view_expect(&v, "<quantizer>", "the device table", kDLUInt, 8,
                        (int64_t)sizeof(gefen_quant_table), opt->device) != 0)
    return NULL;
  return (const gefen_quant_table *)v.data;
}

/* The options of a single-tensor CUDA call: its device and the stream (an int or None). */
static int cuda_options(DLDevice device, PyObject *stream_obj, call_options *opt) {
  opt->nthreads = 0;
  opt->table_obj = NULL;
  opt->device = device;
  opt->stream = NULL;
  if (stream_obj != Py_None) {
    opt->stream = PyLong_AsVoidPtr(stream_obj);
    if (!opt->stream && PyErr_Occurred()) return -1;
  }
  return 0;
}

/* Runs `body` with the call's device current, restoring the previous one. */
#define WITH_CUDA_DEVICE(opt, err, st, body)                                  \
  do {                                                                        \
    int previous_ = 0;                                                        \
    st = gefen_cuda_set_device((opt)->device.device_id, &previous_, (err));   \
    if (st == GEFEN_OK) {                                                     \
      body;                                                                   \
      gefen_error ignored_;                                                   \
      gefen_cuda_set_device(previous_, NULL, &ignored_);                      \
    }                                                                         \
  } while (0)
#endif

/* The run options of a phase: (quantizer,) nthreads=0, stream=None,
 * device_table=None. */
static int parse_run_options(PyObject *args, PyObject *kwargs, PyObject **qobj,
                             call_options *opt) {
  static char *kw_q[] = {"quantizer", "nthreads", "stream", "device_table", NULL};
  static char *kw[] = {"nthreads", "stream", NULL};
  PyObject *stream_obj = NULL;
  opt->nthreads = 0;
  opt->table_obj = NULL;
  opt->stream = NULL;
  if (qobj) {
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|iOO", kw_q, GefenQuantizer_Type, qobj,
                                     &opt->nthreads, &stream_obj, &opt->table_obj))
      return -1;
  } else {
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|iO", kw, &opt->nthreads, &stream_obj))
      return -1;
  }
  if (stream_obj && stream_obj != Py_None) {
    opt->stream = PyLong_AsVoidPtr(stream_obj);
    if (!opt->stream && PyErr_Occurred()) return -1;
  }
  return 0;
}

/* ------------------------------------------------------ named step items
 *
 * Python hands the extension step items whose fields are read by name
 * (gefen/_items.py defines them: AdamItem, MuonItem). Every object a parsed
 * item points into is kept referenced by the plan that parsed it, so the
 * pointers stay valid for the plan's life. */

/* The fields' names as interned str objects, made once: a step reads about
 * twenty fields of every item, and PyObject_GetAttrString would decode and
 * hash each name again and miss the type's attribute cache (which takes
 * interned names only) -- most of a plan's cost per item. Keyed by the
 * address of the field's string literal; NULL (an exception set) when out of
 * memory. The GIL serialises the first use. */
enum { FIELD_NAMES = 48 };
static struct {
  const char *key;
  PyObject *name; /* interned, never released */
} field_names[FIELD_NAMES];

static PyObject *field_name(const char *field) {
  for (int i = 0; i < FIELD_NAMES; i++) {
    if (field_names[i].key == field) return field_names[i].name;
    if (!field_names[i].key) {
      PyObject *name = PyUnicode_InternFromString(field);
      if (!name) return NULL;
      field_names[i].name = name;
      field_names[i].key = field;
      return name;
    }
  }
  PyErr_Format(PyExc_RuntimeError, "gefen: more than %d item field names", FIELD_NAMES);
  return NULL;
}

/* A field of an item (new reference kept in refs; the returned pointer is
 * borrowed from there), or NULL with an exception naming the field. */
static PyObject *item_field(PyObject *item, const char *field, PyObject *refs,
                            const char *kind) {
  PyObject *key = field_name(field);
  PyObject *v = key ? PyObject_GetAttr(item, key) : NULL;
  if (!v) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "a %s needs a field '%s'", kind, field);
    }
    return NULL;
  }
  int rc = PyList_Append(refs, v);
  Py_DECREF(v);
  return rc == 0 ? v : NULL;
}

static int item_int(PyObject *item, const char *field, PyObject *refs, const char *kind,
                    const char *name, long long *out) {
  PyObject *v = item_field(item, field, refs, kind);
  if (!v) return -1;
  *out = PyLong_AsLongLong(v);
  if (*out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "parameter '%s': item field '%s' must be an int", name, field);
    return -1;
  }
  return 0;
}

static int item_double(PyObject *item, const char *field, PyObject *refs, const char *kind,
                       const char *name, double *out) {
  PyObject *v = item_field(item, field, refs, kind);
  if (!v) return -1;
  *out = PyFloat_AsDouble(v);
  if (*out == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "parameter '%s': item field '%s' must be a float", name, field);
    return -1;
  }
  return 0;
}

static int item_bool(PyObject *item, const char *field, PyObject *refs, const char *kind,
                     int *out) {
  PyObject *v = item_field(item, field, refs, kind);
  if (!v) return -1;
  *out = PyObject_IsTrue(v);
  return *out < 0 ? -1 : 0;
}

static int item_name(PyObject *item, PyObject *refs, const char *kind, const char **name) {
  PyObject *v = item_field(item, "name", refs, kind);
  if (!v) return -1;
  if (!PyUnicode_Check(v)) {
    PyErr_Format(PyExc_TypeError, "a %s's field 'name' must be a str", kind);
    return -1;
  }
  *name = PyUnicode_AsUTF8AndSize(v, NULL); /* lives as long as refs holds v */
  return *name ? 0 : -1;
}

/* A float32 state tensor of numel elements on dev, or NULL when the field is None. */
static int item_f32(PyObject *item, const char *field, PyObject *refs, gefen_view_keep *keep,
                    const char *kind, const char *name, const char *what, int64_t numel,
                    DLDevice dev, float **out) {
  gefen_view v;
  PyObject *obj = item_field(item, field, refs, kind);
  return obj ? get_f32(obj, &v, keep, name, what, numel, dev, out) : -1;
}

static int item_f64(PyObject *item, const char *field, PyObject *refs, gefen_view_keep *keep,
                    const char *kind, const char *name, const char *what, int64_t numel,
                    DLDevice dev, double **out) {
  gefen_view v;
  PyObject *obj = item_field(item, field, refs, kind);
  return obj ? get_f64(obj, &v, keep, name, what, numel, dev, out) : -1;
}

static int item_codes(PyObject *item, PyObject *refs, gefen_view_keep *keep, const char *kind,
                      const char *name, int64_t numel, DLDevice dev, uint8_t **out) {
  gefen_view v;
  PyObject *obj = item_field(item, "codes", refs, kind);
  if (!obj || gefen_view_get(obj, &v, keep, name, "state 'codes'") != 0 ||
      gefen_view_expect(&v, name, "state 'codes'", kDLUInt, 8, numel, dev) != 0)
    return -1;
  *out = (uint8_t *)v.data;
  return 0;
}

static int check_period(const char *name, long long period, int64_t cols) {
  if (period < 1 || (cols > 0 && cols % period)) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': period %lld does not divide %lld", name,
                 period, (long long)cols);
    return -1;
  }
  return 0;
}

static const char ADAM_KIND[] = "Gefen step item (gefen._items.AdamItem)";
static const char MUON_KIND[] = "GefenMuon momentum item (gefen._items.MuonItem)";

/* An AdamItem: the local shard of one parameter and its hyper-parameters. */
static int parse_adam_item(PyObject *item, PyObject *refs, gefen_adam_item *it,
                           const char **name, gefen_view_keep *keep, span *sp,
                           DLDevice *device) {
  const char *K = ADAM_KIND;
  long long period, row_offset, global_rows, step;
  unsigned long long seed;
  if (item_name(item, refs, K, name) != 0) return -1;
  PyObject *p_obj = item_field(item, "param", refs, K);
  PyObject *g_obj = p_obj ? item_field(item, "grad", refs, K) : NULL;
  gefen_view p, g;
  if (!g_obj || get_param_grad(p_obj, g_obj, &p, &g, keep, *name, "the parameter", &it->dtype))
    return -1;
  const int64_t rows = p.rows, cols = p.cols;
  if (item_int(item, "period", refs, K, *name, &period) != 0 || check_period(*name, period, cols))
    return -1;
  const int64_t nblocks = rows * (cols / period);
  const DLDevice dev = p.device;
  if (item_codes(item, refs, keep, K, *name, p.numel, dev, &it->codes) != 0 ||
      item_f32(item, "magnitude", refs, keep, K, *name, "state 'magnitude'", nblocks, dev,
               &it->magnitude) != 0)
    return -1;
  if (!it->magnitude) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': state 'magnitude' is missing", *name);
    return -1;
  }
  if (item_f32(item, "vmean", refs, keep, K, *name, "state 'vmean'", nblocks, dev, &it->vmean) ||
      item_f32(item, "v_row", refs, keep, K, *name, "state 'v_row'", rows, dev, &it->v_row) ||
      item_f32(item, "v_col", refs, keep, K, *name, "state 'v_col'", cols, dev, &it->v_col) ||
      item_f64(item, "col_stats", refs, keep, K, *name, "factored column statistics", cols + 1,
               dev, &it->col_stats) ||
      item_f64(item, "row_stats", refs, keep, K, *name, "factored row statistics", rows, dev,
               &it->row_stats))
    return -1;
  if (item_int(item, "row_offset", refs, K, *name, &row_offset) ||
      item_int(item, "global_rows", refs, K, *name, &global_rows) ||
      item_int(item, "step", refs, K, *name, &step) ||
      item_double(item, "lr", refs, K, *name, &it->lr) ||
      item_double(item, "beta1", refs, K, *name, &it->beta1) ||
      item_double(item, "beta2", refs, K, *name, &it->beta2) ||
      item_double(item, "eps", refs, K, *name, &it->eps) ||
      item_double(item, "weight_decay", refs, K, *name, &it->weight_decay) ||
      item_bool(item, "stochastic_round", refs, K, &it->stochastic_round) ||
      item_bool(item, "momentum_in_stats", refs, K, &it->momentum_in_stats))
    return -1;
  PyObject *seed_obj = item_field(item, "seed", refs, K);
  if (!seed_obj) return -1;
  seed = PyLong_AsUnsignedLongLong(seed_obj);
  if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "parameter '%s': item field 'seed' must be an int >= 0", *name);
    return -1;
  }
  it->param = p.data;
  it->grad = g.data;
  it->rows = rows;
  it->cols = cols;
  it->period = period;
  it->row_offset = row_offset;
  it->global_rows = global_rows;
  it->step = step;
  it->seed = seed;
  sp->begin = (uintptr_t)p.data;
  sp->end = sp->begin + (uintptr_t)(p.numel * (int64_t)gefen_dtype_size(it->dtype));
  *device = dev;
  return 0;
}

/* A MuonItem: one matrix's local rows for GefenMuon's momentum. */
static int parse_muon_item(PyObject *item, PyObject *refs, gefen_muon_item *it,
                           const char **name, gefen_view_keep *keep, span *sp,
                           DLDevice *device) {
  const char *K = MUON_KIND;
  long long period;
  gefen_view g, v;
  if (item_name(item, refs, K, name) != 0) return -1;
  PyObject *g_obj = item_field(item, "grad", refs, K);
  if (!g_obj || get_param_grad(g_obj, NULL, &g, NULL, keep, *name, "the gradient", &it->dtype))
    return -1;
  if (item_int(item, "period", refs, K, *name, &period) != 0 ||
      check_period(*name, period, g.cols) != 0)
    return -1;
  if (item_codes(item, refs, keep, K, *name, g.numel, g.device, &it->codes) != 0 ||
      item_f32(item, "magnitude", refs, keep, K, *name, "state 'magnitude'",
               g.rows * (g.cols / period), g.device, &it->magnitude) != 0)
    return -1;
  if (!it->magnitude) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': state 'magnitude' is missing", *name);
    return -1;
  }
  PyObject *out_obj = item_field(item, "out", refs, K);
  if (!out_obj || gefen_view_get(out_obj, &v, keep, *name, "the momentum output") != 0) return -1;
  const int out_dt = gefen_view_core_dtype(v.dtype);
  if (out_dt != GEFEN_F32 && out_dt != GEFEN_BF16) {
    PyErr_Format(PyExc_TypeError, "parameter '%s': the momentum output must be float32 or bfloat16",
                 *name);
    return -1;
  }
  if (gefen_view_expect(&v, *name, "the momentum output", v.dtype.code, v.dtype.bits, g.numel,
                        g.device) != 0)
    return -1;
  if (item_double(item, "beta", refs, K, *name, &it->beta) != 0 ||
      item_bool(item, "nesterov", refs, K, &it->nesterov) != 0)
    return -1;
  it->out = v.data;
  it->out_dtype = (gefen_dtype)out_dt;
  it->grad = g.data;
  it->rows = g.rows;
  it->cols = g.cols;
  it->period = period;
  sp->begin = (uintptr_t)v.data;
  sp->end = sp->begin + (uintptr_t)(g.numel * (int64_t)gefen_dtype_size(it->out_dtype));
  *device = g.device;
  return 0;
}

/* -------------------------------------------------------------- step plans
 *
 * AdamStep(items) / MuonStep(items): every item of one step on one device,
 * parsed and validated once (device, dtype, shape, contiguity, disjoint
 * outputs, the core's own checks) before anything runs; the phases then run
 * on the parsed items without reading a tensor again. A plan keeps every
 * object it points into alive. */

typedef struct {
  PyObject_HEAD
  Py_ssize_t n;
  void *items; /* gefen_adam_item[n] or gefen_muon_item[n] */
  const char **names;
  PyObject *refs; /* list of every object the items point into */
  gefen_view_keep keep;
  DLDevice device;
  int factored; /* AdamStep: some item has the factored form */
  double *scratch; /* AdamStep on the CPU: the statistics of items that gave none */
  void *work;      /* AdamStep.rebind(): the items being matched (n items) */
  PyObject *bound; /* AdamStep.rebind(): the gradients bound until unbind() (a list) */
  gefen_view_keep bound_keep;
} StepPlan;

typedef int (*parse_fn)(PyObject *item, PyObject *refs, void *it, const char **name,
                        gefen_view_keep *keep, span *sp, DLDevice *device);

static int parse_adam_any(PyObject *item, PyObject *refs, void *it, const char **name,
                          gefen_view_keep *keep, span *sp, DLDevice *device) {
  return parse_adam_item(item, refs, (gefen_adam_item *)it, name, keep, sp, device);
}

static int parse_muon_any(PyObject *item, PyObject *refs, void *it, const char **name,
                          gefen_view_keep *keep, span *sp, DLDevice *device) {
  return parse_muon_item(item, refs, (gefen_muon_item *)it, name, keep, sp, device);
}

/* AdamStep on the CPU: factored items whose col_stats and row_stats are None
 * (a whole step, CPU parameters that are not row-sharded: nothing is reduced
 * between the phases) get them from one block the plan owns, allocated here,
 * before anything runs. The core zeroes and fills them in phase 1. */
static int adam_scratch(StepPlan *self) {
  gefen_adam_item *items = self->items;
  int64_t total = 0;
  for (Py_ssize_t i = 0; i < self->n; i++) {
    if (items[i].vmean) continue; /* block form */
    if (!items[i].col_stats) total += items[i].cols + 1;
    if (!items[i].row_stats) total += items[i].rows;
  }
  if (total == 0) return 0;
  self->scratch = PyMem_Malloc((size_t)total * sizeof(double));
  if (!self->scratch) {
    PyErr_NoMemory();
    return -1;
  }
  double *at = self->scratch;
  for (Py_ssize_t i = 0; i < self->n; i++) {
    if (items[i].vmean) continue;
    if (!items[i].col_stats) {
      items[i].col_stats = at;
      at += items[i].cols + 1;
    }
    if (!items[i].row_stats) {
      items[i].row_stats = at;
      at += items[i].rows;
    }
  }
  return 0;
}

static void plan_dealloc(StepPlan *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyMem_Free(self->scratch);
  PyMem_Free(self->work);
  Py_XDECREF(self->bound);
  gefen_view_keep_release(&self->bound_keep);
  gefen_view_keep_release(&self->keep);
  Py_XDECREF(self->refs);
  PyMem_Free(self->items);
  PyMem_Free(self->names);
  PyObject_Free(self);
  Py_DECREF(tp); /* heap type */
}

/* Parses and validates every item of `seq` into a new plan of `type`. */
static PyObject *plan_build(PyTypeObject *type, PyObject *args, PyObject *kwargs, size_t item_size,
                            parse_fn parse, int is_adam) {
  static char *kw[] = {"items", NULL};
  PyObject *seq;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", kw, &seq)) return NULL;
  PyObject *list = PySequence_List(seq);
  if (!list) return NULL;
  const Py_ssize_t n = PyList_Size(list);
  StepPlan *self = PyObject_New(StepPlan, type);
  if (!self) {
    Py_DECREF(list);
    return NULL;
  }
  Py_INCREF(type); /* instances of heap types own a reference to the type */
  self->n = n;
  self->items = PyMem_Calloc((size_t)(n > 0 ? n : 1), item_size);
  self->names = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *self->names);
  self->refs = PyList_New(0);
  self->keep.capsules = NULL;
  self->factored = 0;
  self->scratch = NULL;
  self->work = NULL;
  self->bound = NULL;
  self->bound_keep.capsules = NULL;
  self->device.device_type = kDLCPU;
  self->device.device_id = 0;
  span *spans = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *spans);
  call_options opt;
  memset(&opt, 0, sizeof opt);
  int ok = self->items && self->names && self->refs && spans;
  if (!ok) PyErr_NoMemory();
  for (Py_ssize_t i = 0; ok && i < n; i++) {
    DLDevice dev;
    spans[i].index = i;
    PyObject *item = PyList_GetItem(list, i); /* borrowed */
    ok = item && parse(item, self->refs, (char *)self->items + (size_t)i * item_size,
                       &self->names[i], &self->keep, &spans[i], &dev) == 0 &&
         check_one_device(&opt, dev, self->names[i], i) == 0;
  }
  if (ok) ok = check_disjoint(spans, n, self->names) == 0;
  if (ok && is_adam && n > 0 && opt.device.device_type == kDLCPU) ok = adam_scratch(self) == 0;
  if (ok) {
    gefen_error err;
    gefen_status st = is_adam ? gefen_adam_validate((const gefen_adam_item *)self->items, n, &err)
                              : gefen_muon_validate((const gefen_muon_item *)self->items, n, &err);
    if (st != GEFEN_OK) {
      raise_core(st, &err, self->names, n);
      ok = 0;
    }
  }
  if (ok && n > 0) self->device = opt.device;
  if (ok && is_adam)
    for (Py_ssize_t i = 0; i < n; i++)
      if (!((const gefen_adam_item *)self->items)[i].vmean) self->factored = 1;
  PyMem_Free(spans);
  Py_DECREF(list);
  if (!ok) {
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject *)self;
}

static PyObject *adam_step_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  return plan_build(type, args, kwargs, sizeof(gefen_adam_item), parse_adam_any, 1);
}

static PyObject *muon_step_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  return plan_build(type, args, kwargs, sizeof(gefen_muon_item), parse_muon_any, 0);
}

typedef enum { PHASE_STATS, PHASE_UPDATE, PHASE_MOMENTUM, PHASE_STEP } plan_phase;

/* Runs one phase of a plan on its device: the core on the CPU, the kernels on CUDA. */
static PyObject *plan_run(StepPlan *self, PyObject *args, PyObject *kwargs, plan_phase phase) {
  PyObject *qobj = NULL;
  call_options opt;
  if (parse_run_options(args, kwargs, phase == PHASE_STATS ? NULL : &qobj, &opt) != 0)
    return NULL;
  opt.device = self->device;
  const gefen_quantizer *q = qobj ? ((GefenQuantizer *)qobj)->q : NULL;
  const int64_t n = self->n;
  gefen_error err;
  gefen_status st = GEFEN_OK;
  if (n == 0 || (phase == PHASE_STATS && !self->factored)) Py_RETURN_NONE;
  if (phase == PHASE_STEP && self->device.device_type != kDLCPU) {
    PyErr_SetString(PyExc_RuntimeError,
                    "AdamStep.step() runs on the CPU only; on CUDA run factored_stats() then "
                    "update()");
    return NULL;
  }
  if (self->device.device_type == kDLCPU) {
    const int nt = get_nthreads(opt.nthreads);
    Py_BEGIN_ALLOW_THREADS
    switch (phase) {
      case PHASE_STATS: st = gefen_adam_factored_stats(self->items, n, nt, &err); break;
      case PHASE_UPDATE: st = gefen_adam_update(self->items, n, q, nt, &err); break;
      case PHASE_STEP: st = gefen_adam_step(self->items, n, q, nt, &err); break;
      default: st = gefen_muon_momentum(self->items, n, q, nt, &err); break;
    }
    Py_END_ALLOW_THREADS
  } else {
#ifdef GEFEN_WITH_CUDA
    gefen_view_keep keep = {NULL};
    const gefen_quant_table *table = NULL;
    if (phase != PHASE_STATS && !(table = device_table(&opt, &keep))) {
      gefen_view_keep_release(&keep);
      return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    WITH_CUDA_DEVICE(&opt, &err, st, switch (phase) {
      case PHASE_STATS:
        st = gefen_cuda_adam_factored_stats(self->items, n, NULL, 0, opt.stream, &err);
        break;
      case PHASE_UPDATE:
        st = gefen_cuda_adam_update(self->items, n, table, NULL, 0, opt.stream, &err);
        break;
      default: st = gefen_cuda_muon_momentum(self->items, n, table, opt.stream, &err); break;
    });
    Py_END_ALLOW_THREADS
    gefen_view_keep_release(&keep);
#else
    PyErr_SetString(PyExc_RuntimeError, "this build of gefen has no CUDA kernels");
    return NULL;
#endif
  }
  if (st != GEFEN_OK) {
    raise_core(st, &err, self->names, n);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *adam_step_factored_stats(StepPlan *self, PyObject *args, PyObject *kwargs) {
  return plan_run(self, args, kwargs, PHASE_STATS);
}

static PyObject *adam_step_update(StepPlan *self, PyObject *args, PyObject *kwargs) {
  return plan_run(self, args, kwargs, PHASE_UPDATE);
}

static PyObject *adam_step_step(StepPlan *self, PyObject *args, PyObject *kwargs) {
  return plan_run(self, args, kwargs, PHASE_STEP);
}

static PyObject *muon_step_momentum(StepPlan *self, PyObject *args, PyObject *kwargs) {
  return plan_run(self, args, kwargs, PHASE_MOMENTUM);
}

/* ---------------------------------------------------------- steady steps
 *
 * AdamStep.rebind() / unbind(): a plan kept across steps (Gefen's steady
 * step, built with each item's parameter in place of its gradient, so that it
 * holds no gradient between steps) takes this step's gradients, step counters
 * and hyper-parameters; its phases then run as after a build, and unbind()
 * lets the gradients go. Every tensor rebind() reads must match what the plan
 * parsed -- the parameter at the same address, contiguous, of the same dtype
 * and shape on the same device, its gradient likewise -- or it changes
 * nothing and returns False: the caller then takes the full path, which
 * raises the error that input deserves or builds a new plan. A CUDA plan's
 * phases take the stream of their call, as after a build; the gradients it
 * lets go stay PyTorch's, whose allocator reuses their memory in stream order. */

/* The hyper-parameters of one item: (lr, beta1, beta2, eps, weight_decay,
 * stochastic_round). 0, or -1 (no exception set) when they do not parse. */
static int rebind_hyper(PyObject *h, gefen_adam_item *it) {
  if (!PyTuple_Check(h) || PyTuple_Size(h) != 6) return -1;
  double *dst[5] = {&it->lr, &it->beta1, &it->beta2, &it->eps, &it->weight_decay};
  for (int k = 0; k < 5; k++) {
    *dst[k] = PyFloat_AsDouble(PyTuple_GetItem(h, k));
    if (*dst[k] == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return -1;
    }
  }
  const int sr = PyObject_IsTrue(PyTuple_GetItem(h, 5));
  if (sr < 0) {
    PyErr_Clear();
    return -1;
  }
  it->stochastic_round = sr;
  return 0;
}

/* Item i of the plan with this step's tensors and scalars into *out: 1 when
 * they match the plan, 0 when not (no exception set). */
static int rebind_item(const StepPlan *self, Py_ssize_t i, PyObject *p_obj, PyObject *g_obj,
                       PyObject *step_obj, PyObject *h_obj, gefen_view_keep *keep,
                       gefen_adam_item *out) {
  const gefen_adam_item *it = (const gefen_adam_item *)self->items + i;
  const char *name = self->names[i];
  gefen_view p, g;
  if (gefen_view_get(p_obj, &p, keep, name, "the parameter") != 0 ||
      gefen_view_get(g_obj, &g, keep, name, "the gradient") != 0) {
    PyErr_Clear();
    return 0;
  }
  if (p.data != it->param || !p.contiguous || !g.contiguous ||
      gefen_view_core_dtype(p.dtype) != (int)it->dtype ||
      gefen_view_core_dtype(g.dtype) != (int)it->dtype || p.rows != it->rows ||
      p.cols != it->cols || !gefen_view_same_shape(&p, &g) ||
      !same_device(p.device, self->device) || !same_device(g.device, self->device))
    return 0;
  const long long step = PyLong_AsLongLong(step_obj);
  if (step == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  *out = *it;
  if (rebind_hyper(h_obj, out) != 0) return 0;
  out->grad = g.data;
  out->step = step;
  return 1;
}

/* Points every item's gradient back at its parameter (an address the plan
 * keeps alive and never reads as a gradient) and lets the bound ones go. */
static void unbind_all(StepPlan *self) {
  gefen_adam_item *items = self->items;
  for (Py_ssize_t i = 0; i < self->n; i++) items[i].grad = items[i].param;
  Py_CLEAR(self->bound);
  gefen_view_keep_release(&self->bound_keep);
}

static PyObject *adam_step_rebind(StepPlan *self, PyObject *args, PyObject *kwargs) {
  static char *kw[] = {"params", "grads", "steps", "hypers", "seed", NULL};
  PyObject *params, *grads, *steps, *hypers;
  unsigned long long seed;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!O!K", kw, &PyList_Type, &params,
                                   &PyList_Type, &grads, &PyList_Type, &steps, &PyList_Type,
                                   &hypers, &seed))
    return NULL;
  const Py_ssize_t n = self->n;
  if (PyList_Size(params) != n || PyList_Size(grads) != n || PyList_Size(steps) != n ||
      PyList_Size(hypers) != n) {
    PyErr_Format(PyExc_ValueError, "AdamStep.rebind: the plan has %zd items; params, grads, "
                 "steps and hypers must have one entry each", n);
    return NULL;
  }
  if (n == 0) Py_RETURN_TRUE;
  if (!self->work && !(self->work = PyMem_Malloc((size_t)n * sizeof(gefen_adam_item))))
    return PyErr_NoMemory();
  gefen_adam_item *work = self->work;
  gefen_view_keep keep = {NULL}; /* the fallback protocol's capsules, while bound */
  int match = 1;
  for (Py_ssize_t i = 0; match && i < n; i++) {
    match = rebind_item(self, i, PyList_GetItem(params, i), PyList_GetItem(grads, i),
                        PyList_GetItem(steps, i), PyList_GetItem(hypers, i), &keep, &work[i]);
    work[i].seed = seed;
  }
  if (!match) {
    gefen_view_keep_release(&keep);
    Py_RETURN_FALSE;
  }
  PyObject *bound = PyList_GetSlice(grads, 0, n); /* a copy: the caller's list may change */
  if (!bound) {
    gefen_view_keep_release(&keep);
    return NULL;
  }
  unbind_all(self);
  memcpy(self->items, work, (size_t)n * sizeof(gefen_adam_item));
  self->bound = bound;
  self->bound_keep = keep;
  Py_RETURN_TRUE;
}

static PyObject *adam_step_unbind(StepPlan *self, PyObject *unused) {
  (void)unused;
  unbind_all(self);
  Py_RETURN_NONE;
}

static PyObject *plan_len(StepPlan *self, void *closure) {
  (void)closure;
  return PyLong_FromSsize_t(self->n);
}

static PyObject *plan_factored(StepPlan *self, void *closure) {
  (void)closure;
  return PyBool_FromLong(self->factored);
}

/* AdamStep.momentum_in_stats: whether the factored items of a CPU plan form
 * their momentum in the statistics pass of step() (the bits are the same
 * either way; Gefen chooses by timing, gefen/_tuning.py). Setting it changes
 * every factored item of the plan. */
static PyObject *plan_get_in_stats(StepPlan *self, void *closure) {
  (void)closure;
  const gefen_adam_item *items = self->items;
  for (Py_ssize_t i = 0; i < self->n; i++)
    if (!items[i].vmean && items[i].momentum_in_stats) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

static int plan_set_in_stats(StepPlan *self, PyObject *value, void *closure) {
  (void)closure;
  if (!value) {
    PyErr_SetString(PyExc_AttributeError, "AdamStep.momentum_in_stats cannot be deleted");
    return -1;
  }
  if (!PyBool_Check(value)) {
    PyErr_SetString(PyExc_TypeError, "AdamStep.momentum_in_stats must be a bool");
    return -1;
  }
  const int flag = value == Py_True;
  if (flag && self->n > 0 && self->device.device_type != kDLCPU) {
    PyErr_SetString(PyExc_RuntimeError,
                    "AdamStep.momentum_in_stats: only CPU plans run step(), which takes it");
    return -1;
  }
  gefen_adam_item *items = self->items;
  for (Py_ssize_t i = 0; i < self->n; i++)
    if (!items[i].vmean) items[i].momentum_in_stats = flag;
  return 0;
}

#define PLAN_KW(f) (PyCFunction)(void (*)(void))(f), METH_VARARGS | METH_KEYWORDS

static PyMethodDef adam_step_methods[] = {
    {"factored_stats", PLAN_KW(adam_step_factored_stats),
     "factored_stats(nthreads=0, stream=None): phase 1 of the factored items (column sums into "
     "their col_stats, row means into row_stats); reads only. A no-op without factored items."},
    {"update", PLAN_KW(adam_step_update),
     "update(quantizer, nthreads=0, stream=None, device_table=None): the fused Gefen update of "
     "every item (factored items need their reduced col_stats). Neither phase takes items with "
     "momentum_in_stats: they run through step()."},
    {"step", PLAN_KW(adam_step_step),
     "step(quantizer, nthreads=0, stream=None, device_table=None): the whole step of every item "
     "in one call (CPU only): the factored statistics, then the update, with nothing reduced "
     "between them, so only for items whose column sums need no all-reduce (every row local). "
     "Factored items with momentum_in_stats form their momentum and codes while their rows are "
     "in cache and apply the decoded codes in the update, without reading the gradient twice; "
     "the bits are those of factored_stats() then update(). Allocates everything before the "
     "first write: when it raises, no item has changed. stream and device_table are accepted "
     "for symmetry with update() and ignored."},
    {"rebind", PLAN_KW(adam_step_rebind),
     "rebind(params, grads, steps, hypers, seed) -> bool: a CPU plan takes this step's "
     "gradients, step counters and hyper-parameters (lists with one entry per item; hypers: "
     "(lr, beta1, beta2, eps, weight_decay, stochastic_round) tuples) and keeps the gradients "
     "referenced until unbind(); its phases then run on them. Returns False, changing "
     "nothing, when a parameter or gradient differs from what the plan parsed (address of the "
     "parameter, dtype, shape, contiguity, device) or a scalar does not parse."},
    {"unbind", (PyCFunction)(void (*)(void))adam_step_unbind, METH_NOARGS,
     "unbind(): let the gradients of the last rebind() go (the plan holds none after it)."},
    {NULL, NULL, 0, NULL}};

static PyMethodDef muon_step_methods[] = {
    {"momentum", PLAN_KW(muon_step_momentum),
     "momentum(quantizer, nthreads=0, stream=None, device_table=None): GefenMuon's quantised "
     "momentum of every item, writing the Newton-Schulz inputs into the items' outputs"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef adam_step_getset[] = {
    {"size", (getter)plan_len, NULL, "number of items", NULL},
    {"factored", (getter)plan_factored, NULL, "whether some item has the factored form", NULL},
    {"momentum_in_stats", (getter)plan_get_in_stats, (setter)plan_set_in_stats,
     "whether step() forms the factored items' momentum and codes in the statistics pass "
     "(a bool; setting it sets every factored item; True only on CPU plans; the bits are "
     "the same either way, only the time differs)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyGetSetDef muon_step_getset[] = {
    {"size", (getter)plan_len, NULL, "number of items", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot adam_step_slots[] = {
    {Py_tp_new, (void *)adam_step_new},
    {Py_tp_dealloc, (void *)plan_dealloc},
    {Py_tp_methods, adam_step_methods},
    {Py_tp_getset, adam_step_getset},
    {Py_tp_doc, (void *)"AdamStep(items): the validated Gefen step of one device (items: "
                        "gefen._items.AdamItem); run factored_stats() then update(), or step() on the CPU "
                        "when no column sums need reducing"},
    {0, NULL}};

static PyType_Slot muon_step_slots[] = {
    {Py_tp_new, (void *)muon_step_new},
    {Py_tp_dealloc, (void *)plan_dealloc},
    {Py_tp_methods, muon_step_methods},
    {Py_tp_getset, muon_step_getset},
    {Py_tp_doc, (void *)"MuonStep(items): GefenMuon's validated momentum step of one device "
                        "(items: gefen._items.MuonItem); run momentum()"},
    {0, NULL}};

static PyType_Spec adam_step_spec = {"gefen._C.AdamStep", sizeof(StepPlan), 0,
                                     Py_TPFLAGS_DEFAULT, adam_step_slots};
static PyType_Spec muon_step_spec = {"gefen._C.MuonStep", sizeof(StepPlan), 0,
                                     Py_TPFLAGS_DEFAULT, muon_step_slots};

int gefen_add_step_types(PyObject *module) {
  PyObject *adam = PyType_FromSpec(&adam_step_spec);
  if (!adam) return -1;
  int rc = PyModule_AddObjectRef(module, "AdamStep", adam);
  Py_DECREF(adam);
  if (rc < 0) return -1;
  PyObject *muon = PyType_FromSpec(&muon_step_spec);
  if (!muon) return -1;
  rc = PyModule_AddObjectRef(module, "MuonStep", muon);
  Py_DECREF(muon);
  return rc;
}

/* ------------------------------------------------- first-step statistics */

/* period_stats(name, grad, candidates, stats, nthreads=0, stream=None):
 * candidates int64 on the CPU; stats int64 of len(candidates) *
 * PERIOD_STAT_WIDTH on the gradient's device (exact sums, see gefen_core.h). */
PyObject *gefen_py_period_stats(PyObject *self, PyObject *args) {
  (void)self;
  const char *name;
  PyObject *g_obj, *c_obj, *s_obj, *stream_obj = Py_None;
  int nthreads = 0;
  if (!PyArg_ParseTuple(args, "sOOO|iO", &name, &g_obj, &c_obj, &s_obj, &nthreads, &stream_obj))
    return NULL;
  gefen_view_keep keep = {NULL};
  PyObject *result = NULL;
  gefen_view g, c, s;
  gefen_dtype dt;
  const DLDevice cpu = {kDLCPU, 0};
  if (get_param_grad(g_obj, NULL, &g, NULL, &keep, name, "the gradient", &dt) != 0) goto done;
  if (gefen_view_get(c_obj, &c, &keep, name, "period candidates") != 0 ||
      gefen_view_expect(&c, name, "period candidates", kDLInt, 64, c.numel, cpu) != 0 ||
      gefen_view_get(s_obj, &s, &keep, name, "period statistics") != 0 ||
      gefen_view_expect(&s, name, "period statistics", kDLInt, 64,
                        c.numel * GEFEN_PERIOD_STAT_WIDTH, g.device) != 0)
    goto done;
  {
    gefen_matrix m = {g.data, dt, g.rows, g.cols};
    gefen_error err;
    gefen_status st = GEFEN_OK;
    if (g.device.device_type == kDLCPU) {
      Py_BEGIN_ALLOW_THREADS
      st = gefen_period_stats(&m, (const int64_t *)c.data, c.numel, (int64_t *)s.data,
                              get_nthreads(nthreads), &err);
      Py_END_ALLOW_THREADS
    } else {
#ifdef GEFEN_WITH_CUDA
      call_options opt;
      if (cuda_options(g.device, stream_obj, &opt) != 0) goto done;
      Py_BEGIN_ALLOW_THREADS
      WITH_CUDA_DEVICE(&opt, &err, st,
                       st = gefen_cuda_period_stats(&m, (const int64_t *)c.data, c.numel,
                                                    (int64_t *)s.data, NULL, 0, opt.stream,
                                                    &err));
      Py_END_ALLOW_THREADS
#endif
    }
    if (st != GEFEN_OK) {
      gefen_raise_status(st, name, err.msg);
      goto done;
    }
  }
  result = Py_NewRef(Py_None);
done:
  gefen_view_keep_release(&keep);
  return result;
}

/* histogram(name, grad, period, hist, nthreads=0, stream=None): hist int64[4096]
 * on the gradient's device. */
PyObject *gefen_py_histogram(PyObject *self, PyObject *args) {
  (void)self;
  const char *name;
  PyObject *g_obj, *h_obj, *stream_obj = Py_None;
  long long period;
  int nthreads = 0;
  if (!PyArg_ParseTuple(args, "sOLO|iO", &name, &g_obj, &period, &h_obj, &nthreads, &stream_obj))
    return NULL;
  gefen_view_keep keep = {NULL};
  PyObject *result = NULL;
  gefen_view g, h;
  gefen_dtype dt;
  if (get_param_grad(g_obj, NULL, &g, NULL, &keep, name, "the gradient", &dt) != 0) goto done;
  if (gefen_view_get(h_obj, &h, &keep, name, "histogram") != 0 ||
      gefen_view_expect(&h, name, "histogram", kDLInt, 64, GEFEN_HIST_BINS, g.device) != 0)
    goto done;
  {
    gefen_matrix m = {g.data, dt, g.rows, g.cols};
    gefen_error err;
    gefen_status st = GEFEN_OK;
    if (g.device.device_type == kDLCPU) {
      Py_BEGIN_ALLOW_THREADS
      st = gefen_histogram(&m, period, (int64_t *)h.data, get_nthreads(nthreads), &err);
      Py_END_ALLOW_THREADS
    } else {
#ifdef GEFEN_WITH_CUDA
      call_options opt;
      if (cuda_options(g.device, stream_obj, &opt) != 0) goto done;
      Py_BEGIN_ALLOW_THREADS
      WITH_CUDA_DEVICE(&opt, &err, st,
                       st = gefen_cuda_histogram(&m, period, (int64_t *)h.data, opt.stream, &err));
      Py_END_ALLOW_THREADS
#endif
    }
    if (st != GEFEN_OK) {
      gefen_raise_status(st, name, err.msg);
      goto done;
    }
  }
  result = Py_NewRef(Py_None);
done:
  gefen_view_keep_release(&keep);
  return result;
}

/* codes_remap(codes, map, nthreads=0, stream=None): map is 256 bytes (CPU codes)
 * or a uint8 tensor of 256 on the codes' device. */
PyObject *gefen_py_codes_remap(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *c_obj, *map_obj, *stream_obj = Py_None;
  int nthreads = 0;
  if (!PyArg_ParseTuple(args, "OO|iO", &c_obj, &map_obj, &nthreads, &stream_obj)) return NULL;
  gefen_view_keep keep = {NULL};
  gefen_view c, mv = {0};
  PyObject *result = NULL;
  if (gefen_view_get(c_obj, &c, &keep, "<codes>", "the codes") != 0 ||
      gefen_view_expect(&c, "<codes>", "the codes", kDLUInt, 8, c.numel, c.device) != 0 ||
      check_device(c.device, "<codes>", "the codes") != 0)
    goto done;
  const uint8_t *map = NULL;
  if (PyBytes_Check(map_obj)) {
    if (PyBytes_Size(map_obj) != GEFEN_CODEBOOK_SIZE) {
      PyErr_SetString(PyExc_ValueError, "the code map must have 256 entries");
      goto done;
    }
    map = (const uint8_t *)PyBytes_AsString(map_obj);
  } else {
    if (gefen_view_get(map_obj, &mv, &keep, "<codes>", "the code map") != 0 ||
        gefen_view_expect(&mv, "<codes>", "the code map", kDLUInt, 8, GEFEN_CODEBOOK_SIZE,
                          c.device) != 0)
      goto done;
    map = (const uint8_t *)mv.data;
  }
  if (c.device.device_type == kDLCPU && !PyBytes_Check(map_obj) &&
      mv.device.device_type != kDLCPU) {
    PyErr_SetString(PyExc_ValueError, "the code map must be on the codes' device");
    goto done;
  }
  {
    gefen_error err;
    gefen_status st = GEFEN_OK;
    if (c.device.device_type == kDLCPU) {
      Py_BEGIN_ALLOW_THREADS
      st = gefen_codes_remap((uint8_t *)c.data, c.numel, map, get_nthreads(nthreads), &err);
      Py_END_ALLOW_THREADS
    } else {
#ifdef GEFEN_WITH_CUDA
      if (PyBytes_Check(map_obj)) {
        PyErr_SetString(PyExc_ValueError, "CUDA codes need the code map as a device tensor");
        goto done;
      }
      call_options opt;
      if (cuda_options(c.device, stream_obj, &opt) != 0) goto done;
      Py_BEGIN_ALLOW_THREADS
      WITH_CUDA_DEVICE(&opt, &err, st,
                       st = gefen_cuda_codes_remap((uint8_t *)c.data, c.numel, map, opt.stream,
                                                   &err));
      Py_END_ALLOW_THREADS
#endif
    }
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

/* cuda_available() -> bool: built with CUDA kernels and a device is visible. */
PyObject *gefen_py_cuda_available(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
#ifdef GEFEN_WITH_CUDA
  return PyBool_FromLong(gefen_cuda_device_count() > 0);
#else
  Py_RETURN_FALSE;
#endif
}

/* built_with_cuda() -> bool */
PyObject *gefen_py_built_with_cuda(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
#ifdef GEFEN_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}
