/* The per-step entry points of gefen._C: a whole group of parameters per
 * call. Every tensor is checked (device, dtype, shape, contiguity, overlap)
 * before the core touches anything; the GIL is released around the core.
 *
 * A call's tensors all live on one device. CPU calls run the C core; CUDA
 * calls (builds with GEFEN_WITH_CUDA) run the kernels/ launchers on the
 * stream Python passes, with the quantiser's table as a device tensor. */
#include "steps.h"

#include <stdlib.h>

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

static int parse_options(PyObject *args, PyObject *kwargs, PyObject **list, PyObject **qobj,
                         int need_quantizer, call_options *opt) {
  static char *kw_q[] = {"items", "quantizer", "nthreads", "stream", "device_table", NULL};
  static char *kw[] = {"items", "nthreads", "stream", NULL};
  PyObject *stream_obj = NULL;
  opt->nthreads = 0;
  opt->table_obj = NULL;
  opt->stream = NULL;
  if (need_quantizer) {
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!|iOO", kw_q, &PyList_Type, list,
                                     &GefenQuantizer_Type, qobj, &opt->nthreads, &stream_obj,
                                     &opt->table_obj))
      return -1;
  } else {
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|iO", kw, &PyList_Type, list,
                                     &opt->nthreads, &stream_obj))
      return -1;
  }
  if (stream_obj && stream_obj != Py_None) {
    opt->stream = PyLong_AsVoidPtr(stream_obj);
    if (!opt->stream && PyErr_Occurred()) return -1;
  }
  return 0;
}

/* ------------------------------------------------------------ Gefen steps */

/* (name, param, grad, codes, magnitude, vmean, v_row, v_col, col_stats,
 *  row_stats, period, row_offset, global_rows, step, lr, beta1, beta2, eps,
 *  weight_decay, stochastic_round, seed) */
static int parse_adam_item(PyObject *tuple, gefen_adam_item *it, const char **name,
                           gefen_view_keep *keep, span *sp, DLDevice *device) {
  PyObject *name_obj, *p_obj, *g_obj, *codes_obj, *mag_obj, *vmean_obj, *vrow_obj, *vcol_obj,
      *cstats_obj, *rstats_obj;
  long long period, row_offset, global_rows, step;
  unsigned long long seed;
  int sr;
  if (!PyTuple_Check(tuple)) {
    PyErr_SetString(PyExc_TypeError, "a step item must be a tuple");
    return -1;
  }
  if (!PyArg_ParseTuple(tuple, "UOOOOOOOOOLLLLdddddpK;a Gefen step item", &name_obj, &p_obj,
                        &g_obj, &codes_obj, &mag_obj, &vmean_obj, &vrow_obj, &vcol_obj,
                        &cstats_obj, &rstats_obj, &period, &row_offset, &global_rows, &step,
                        &it->lr, &it->beta1, &it->beta2, &it->eps, &it->weight_decay, &sr,
                        &seed))
    return -1;
  *name = PyUnicode_AsUTF8(name_obj);
  if (!*name) return -1;
  gefen_view p, g, v;
  if (get_param_grad(p_obj, g_obj, &p, &g, keep, *name, "the parameter", &it->dtype) != 0)
    return -1;
  const int64_t rows = p.rows, cols = p.cols;
  if (period < 1 || (cols > 0 && cols % period)) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': period %lld does not divide %lld", *name,
                 period, (long long)cols);
    return -1;
  }
  const int64_t nblocks = rows * (cols / period);
  const DLDevice dev = p.device;
  if (gefen_view_get(codes_obj, &v, keep, *name, "state 'codes'") != 0) return -1;
  if (gefen_view_expect(&v, *name, "state 'codes'", kDLUInt, 8, p.numel, dev) != 0) return -1;
  it->codes = (uint8_t *)v.data;
  if (get_f32(mag_obj, &v, keep, *name, "state 'magnitude'", nblocks, dev, &it->magnitude))
    return -1;
  if (!it->magnitude) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': state 'magnitude' is missing", *name);
    return -1;
  }
  if (get_f32(vmean_obj, &v, keep, *name, "state 'vmean'", nblocks, dev, &it->vmean) ||
      get_f32(vrow_obj, &v, keep, *name, "state 'v_row'", rows, dev, &it->v_row) ||
      get_f32(vcol_obj, &v, keep, *name, "state 'v_col'", cols, dev, &it->v_col) ||
      get_f64(cstats_obj, &v, keep, *name, "factored column statistics", cols + 1, dev,
              &it->col_stats) ||
      get_f64(rstats_obj, &v, keep, *name, "factored row statistics", rows, dev, &it->row_stats))
    return -1;
  it->param = p.data;
  it->grad = g.data;
  it->rows = rows;
  it->cols = cols;
  it->period = period;
  it->row_offset = row_offset;
  it->global_rows = global_rows;
  it->step = step;
  it->stochastic_round = sr;
  it->seed = seed;
  sp->begin = (uintptr_t)p.data;
  sp->end = sp->begin + (uintptr_t)(p.numel * (int64_t)gefen_dtype_size(it->dtype));
  *device = dev;
  return 0;
}

typedef enum { OP_VALIDATE, OP_STATS, OP_UPDATE } adam_op;

static gefen_status adam_cpu(adam_op op, const gefen_adam_item *items, int64_t n,
                             const gefen_quantizer *q, int nthreads, gefen_error *err) {
  switch (op) {
    case OP_STATS: return gefen_adam_factored_stats(items, n, nthreads, err);
    case OP_UPDATE: return gefen_adam_update(items, n, q, nthreads, err);
    default: return gefen_adam_validate(items, n, err);
  }
}

static PyObject *run_adam(PyObject *args, PyObject *kwargs, adam_op op) {
  PyObject *list, *qobj = NULL;
  call_options opt;
  if (parse_options(args, kwargs, &list, &qobj, op == OP_UPDATE, &opt) != 0) return NULL;
  const Py_ssize_t n = PyList_GET_SIZE(list);
  gefen_adam_item *items = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *items);
  const char **names = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *names);
  span *spans = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *spans);
  gefen_view_keep keep = {NULL};
  PyObject *result = NULL;
  if (!items || !names || !spans) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    DLDevice dev;
    spans[i].index = i;
    if (parse_adam_item(PyList_GET_ITEM(list, i), &items[i], &names[i], &keep, &spans[i],
                        &dev) != 0 ||
        check_one_device(&opt, dev, names[i], i) != 0)
      goto done;
  }
  if (check_disjoint(spans, n, names) != 0) goto done;
  if (n == 0 || op == OP_VALIDATE || opt.device.device_type == kDLCPU) {
    gefen_error err;
    gefen_status st;
    const gefen_quantizer *q = qobj ? ((GefenQuantizer *)qobj)->q : NULL;
    Py_BEGIN_ALLOW_THREADS
    st = adam_cpu(op, items, n, q, get_nthreads(opt.nthreads), &err);
    Py_END_ALLOW_THREADS
    if (st != GEFEN_OK) {
      raise_core(st, &err, names, n);
      goto done;
    }
  } else {
#ifdef GEFEN_WITH_CUDA
    gefen_error err;
    gefen_status st = GEFEN_OK;
    const gefen_quant_table *table = NULL;
    if (op == OP_UPDATE && !(table = device_table(&opt, &keep))) goto done;
    Py_BEGIN_ALLOW_THREADS
    WITH_CUDA_DEVICE(&opt, &err, st,
                     st = op == OP_STATS
                              ? gefen_cuda_adam_factored_stats(items, n, NULL, 0, opt.stream, &err)
                              : gefen_cuda_adam_update(items, n, table, NULL, 0, opt.stream, &err));
    Py_END_ALLOW_THREADS
    if (st != GEFEN_OK) {
      raise_core(st, &err, names, n);
      goto done;
    }
#endif
  }
  result = Py_NewRef(Py_None);
done:
  gefen_view_keep_release(&keep);
  PyMem_Free(items);
  PyMem_Free(names);
  PyMem_Free(spans);
  return result;
}

PyObject *gefen_py_adam_validate(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  return run_adam(args, kwargs, OP_VALIDATE);
}

PyObject *gefen_py_adam_factored_stats(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  return run_adam(args, kwargs, OP_STATS);
}

PyObject *gefen_py_adam_update(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  return run_adam(args, kwargs, OP_UPDATE);
}

/* -------------------------------------------------------- Muon momentum */

/* (name, grad, codes, magnitude, out, period, beta, nesterov) */
static int parse_muon_item(PyObject *tuple, gefen_muon_item *it, const char **name,
                           gefen_view_keep *keep, DLDevice *device) {
  PyObject *name_obj, *g_obj, *codes_obj, *mag_obj, *out_obj;
  long long period;
  int nesterov;
  if (!PyTuple_Check(tuple)) {
    PyErr_SetString(PyExc_TypeError, "a momentum item must be a tuple");
    return -1;
  }
  if (!PyArg_ParseTuple(tuple, "UOOOOLdp;a GefenMuon momentum item", &name_obj, &g_obj,
                        &codes_obj, &mag_obj, &out_obj, &period, &it->beta, &nesterov))
    return -1;
  *name = PyUnicode_AsUTF8(name_obj);
  if (!*name) return -1;
  gefen_view g, v;
  if (get_param_grad(g_obj, NULL, &g, NULL, keep, *name, "the gradient", &it->dtype) != 0)
    return -1;
  if (period < 1 || (g.cols > 0 && g.cols % period)) {
    PyErr_Format(PyExc_ValueError, "parameter '%s': period %lld does not divide %lld", *name,
                 period, (long long)g.cols);
    return -1;
  }
  if (gefen_view_get(codes_obj, &v, keep, *name, "state 'codes'") != 0) return -1;
  if (gefen_view_expect(&v, *name, "state 'codes'", kDLUInt, 8, g.numel, g.device) != 0)
    return -1;
  it->codes = (uint8_t *)v.data;
  if (get_f32(mag_obj, &v, keep, *name, "state 'magnitude'", g.rows * (g.cols / period),
              g.device, &it->magnitude))
    return -1;
  if (gefen_view_get(out_obj, &v, keep, *name, "the momentum output") != 0) return -1;
  const int out_dt = gefen_view_core_dtype(v.dtype);
  if (out_dt != GEFEN_F32 && out_dt != GEFEN_BF16) {
    PyErr_Format(PyExc_TypeError, "parameter '%s': the momentum output must be float32 or bfloat16",
                 *name);
    return -1;
  }
  if (gefen_view_expect(&v, *name, "the momentum output", v.dtype.code, v.dtype.bits, g.numel,
                        g.device) != 0)
    return -1;
  it->out = v.data;
  it->out_dtype = (gefen_dtype)out_dt;
  it->grad = g.data;
  it->rows = g.rows;
  it->cols = g.cols;
  it->period = period;
  it->nesterov = nesterov;
  *device = g.device;
  return 0;
}

static PyObject *run_muon(PyObject *args, PyObject *kwargs, int validate_only) {
  PyObject *list, *qobj = NULL;
  call_options opt;
  if (parse_options(args, kwargs, &list, &qobj, !validate_only, &opt) != 0) return NULL;
  const Py_ssize_t n = PyList_GET_SIZE(list);
  gefen_muon_item *items = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *items);
  const char **names = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *names);
  gefen_view_keep keep = {NULL};
  PyObject *result = NULL;
  if (!items || !names) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    DLDevice dev;
    if (parse_muon_item(PyList_GET_ITEM(list, i), &items[i], &names[i], &keep, &dev) != 0 ||
        check_one_device(&opt, dev, names[i], i) != 0)
      goto done;
  }
  if (n == 0 || validate_only || opt.device.device_type == kDLCPU) {
    gefen_error err;
    gefen_status st;
    const gefen_quantizer *q = qobj ? ((GefenQuantizer *)qobj)->q : NULL;
    Py_BEGIN_ALLOW_THREADS
    st = validate_only ? gefen_muon_validate(items, n, &err)
                       : gefen_muon_momentum(items, n, q, get_nthreads(opt.nthreads), &err);
    Py_END_ALLOW_THREADS
    if (st != GEFEN_OK) {
      raise_core(st, &err, names, n);
      goto done;
    }
  } else {
#ifdef GEFEN_WITH_CUDA
    gefen_error err;
    gefen_status st = GEFEN_OK;
    const gefen_quant_table *table = device_table(&opt, &keep);
    if (!table) goto done;
    Py_BEGIN_ALLOW_THREADS
    WITH_CUDA_DEVICE(&opt, &err, st,
                     st = gefen_cuda_muon_momentum(items, n, table, opt.stream, &err));
    Py_END_ALLOW_THREADS
    if (st != GEFEN_OK) {
      raise_core(st, &err, names, n);
      goto done;
    }
#endif
  }
  result = Py_NewRef(Py_None);
done:
  gefen_view_keep_release(&keep);
  PyMem_Free(items);
  PyMem_Free(names);
  return result;
}

PyObject *gefen_py_muon_validate(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  return run_muon(args, kwargs, 1);
}

PyObject *gefen_py_muon_momentum(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  return run_muon(args, kwargs, 0);
}

/* ------------------------------------------------- first-step statistics */

/* period_stats(name, grad, candidates, sums, counts, nthreads=0, stream=None):
 * candidates int64 on the CPU; sums/counts float64 on the gradient's device. */
PyObject *gefen_py_period_stats(PyObject *self, PyObject *args) {
  (void)self;
  const char *name;
  PyObject *g_obj, *c_obj, *s_obj, *n_obj, *stream_obj = Py_None;
  int nthreads = 0;
  if (!PyArg_ParseTuple(args, "sOOOO|iO", &name, &g_obj, &c_obj, &s_obj, &n_obj, &nthreads,
                        &stream_obj))
    return NULL;
  gefen_view_keep keep = {NULL};
  PyObject *result = NULL;
  gefen_view g, c, s, cnt;
  gefen_dtype dt;
  const DLDevice cpu = {kDLCPU, 0};
  if (get_param_grad(g_obj, NULL, &g, NULL, &keep, name, "the gradient", &dt) != 0) goto done;
  if (gefen_view_get(c_obj, &c, &keep, name, "period candidates") != 0 ||
      gefen_view_expect(&c, name, "period candidates", kDLInt, 64, c.numel, cpu) != 0 ||
      gefen_view_get(s_obj, &s, &keep, name, "period sums") != 0 ||
      gefen_view_expect(&s, name, "period sums", kDLFloat, 64, c.numel, g.device) != 0 ||
      gefen_view_get(n_obj, &cnt, &keep, name, "period counts") != 0 ||
      gefen_view_expect(&cnt, name, "period counts", kDLFloat, 64, c.numel, g.device) != 0)
    goto done;
  {
    gefen_matrix m = {g.data, dt, g.rows, g.cols};
    gefen_error err;
    gefen_status st = GEFEN_OK;
    if (g.device.device_type == kDLCPU) {
      Py_BEGIN_ALLOW_THREADS
      st = gefen_period_stats(&m, (const int64_t *)c.data, c.numel, (double *)s.data,
                              (double *)cnt.data, get_nthreads(nthreads), &err);
      Py_END_ALLOW_THREADS
    } else {
#ifdef GEFEN_WITH_CUDA
      call_options opt;
      if (cuda_options(g.device, stream_obj, &opt) != 0) goto done;
      Py_BEGIN_ALLOW_THREADS
      WITH_CUDA_DEVICE(&opt, &err, st,
                       st = gefen_cuda_period_stats(&m, (const int64_t *)c.data, c.numel,
                                                    (double *)s.data, (double *)cnt.data, NULL,
                                                    0, opt.stream, &err));
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
    if (PyBytes_GET_SIZE(map_obj) != GEFEN_CODEBOOK_SIZE) {
      PyErr_SetString(PyExc_ValueError, "the code map must have 256 entries");
      goto done;
    }
    map = (const uint8_t *)PyBytes_AS_STRING(map_obj);
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
