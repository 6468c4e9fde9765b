/* The per-step entry points of gefen._C: a whole group of parameters per
 * call. Every tensor is checked (device, dtype, shape, contiguity, overlap)
 * before the core touches anything; the GIL is released around the core. */
#include "steps.h"

#include <stdlib.h>

#include "quantizer_type.h"

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

static const DLDevice cpu_device = {kDLCPU, 0};

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

/* The parameter (and its gradient) of an item: a supported float dtype on
 * the CPU, contiguous, gradient of the same dtype and shape. */
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
  if (p->device.device_type != kDLCPU) {
    PyErr_Format(PyExc_ValueError,
                 "parameter '%s': %s is on device type %d, which this build does not support "
                 "(CPU only)",
                 name, what, (int)p->device.device_type);
    return -1;
  }
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

/* ------------------------------------------------------------ Gefen steps */

/* (name, param, grad, codes, magnitude, vmean, v_row, v_col, col_stats,
 *  row_stats, period, row_offset, global_rows, step, lr, beta1, beta2, eps,
 *  weight_decay, stochastic_round, seed) */
static int parse_adam_item(PyObject *tuple, gefen_adam_item *it, const char **name,
                           gefen_view_keep *keep, span *sp) {
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
  if (get_param_grad(p_obj, g_obj, &p, &g, keep, *name, "the parameter", &it->dtype) != 0) return -1;
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
  return 0;
}

typedef gefen_status (*adam_fn)(const gefen_adam_item *, int64_t, const gefen_quantizer *,
                                int, gefen_error *);

static gefen_status adam_stats_call(const gefen_adam_item *items, int64_t n,
                                    const gefen_quantizer *q, int nthreads, gefen_error *err) {
  (void)q;
  return gefen_adam_factored_stats(items, n, nthreads, err);
}

static PyObject *run_adam(PyObject *args, int with_quantizer, adam_fn fn) {
  PyObject *list, *qobj = NULL;
  int nthreads = 0;
  if (with_quantizer) {
    if (!PyArg_ParseTuple(args, "O!O!|i", &PyList_Type, &list, &GefenQuantizer_Type, &qobj,
                          &nthreads))
      return NULL;
  } else {
    if (!PyArg_ParseTuple(args, "O!|i", &PyList_Type, &list, &nthreads)) return NULL;
  }
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
    spans[i].index = i;
    if (parse_adam_item(PyList_GET_ITEM(list, i), &items[i], &names[i], &keep, &spans[i]) != 0)
      goto done;
  }
  if (check_disjoint(spans, n, names) != 0) goto done;
  {
    gefen_error err;
    gefen_status st;
    const gefen_quantizer *q = qobj ? ((GefenQuantizer *)qobj)->q : NULL;
    Py_BEGIN_ALLOW_THREADS
    st = fn(items, n, q, get_nthreads(nthreads), &err);
    Py_END_ALLOW_THREADS
    if (st != GEFEN_OK) {
      raise_core(st, &err, names, n);
      goto done;
    }
  }
  result = Py_NewRef(Py_None);
done:
  gefen_view_keep_release(&keep);
  PyMem_Free(items);
  PyMem_Free(names);
  PyMem_Free(spans);
  return result;
}

static gefen_status adam_validate_call(const gefen_adam_item *items, int64_t n,
                                       const gefen_quantizer *q, int nthreads, gefen_error *err) {
  (void)q;
  (void)nthreads;
  return gefen_adam_validate(items, n, err);
}

PyObject *gefen_py_adam_validate(PyObject *self, PyObject *args) {
  (void)self;
  return run_adam(args, 0, adam_validate_call);
}

PyObject *gefen_py_adam_factored_stats(PyObject *self, PyObject *args) {
  (void)self;
  return run_adam(args, 0, adam_stats_call);
}

PyObject *gefen_py_adam_update(PyObject *self, PyObject *args) {
  (void)self;
  return run_adam(args, 1, gefen_adam_update);
}

/* -------------------------------------------------------- Muon momentum */

/* (name, grad, codes, magnitude, out, period, beta, nesterov) */
static int parse_muon_item(PyObject *tuple, gefen_muon_item *it, const char **name,
                           gefen_view_keep *keep) {
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
  if (get_param_grad(g_obj, NULL, &g, NULL, keep, *name, "the gradient", &it->dtype) != 0) return -1;
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
  return 0;
}

typedef gefen_status (*muon_fn)(const gefen_muon_item *, int64_t, const gefen_quantizer *, int,
                                gefen_error *);

static PyObject *run_muon(PyObject *args, int with_quantizer, muon_fn fn) {
  PyObject *list, *qobj = NULL;
  int nthreads = 0;
  if (with_quantizer) {
    if (!PyArg_ParseTuple(args, "O!O!|i", &PyList_Type, &list, &GefenQuantizer_Type, &qobj,
                          &nthreads))
      return NULL;
  } else {
    if (!PyArg_ParseTuple(args, "O!|i", &PyList_Type, &list, &nthreads)) return NULL;
  }
  const Py_ssize_t n = PyList_GET_SIZE(list);
  gefen_muon_item *items = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *items);
  const char **names = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *names);
  gefen_view_keep keep = {NULL};
  PyObject *result = NULL;
  if (!items || !names) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++)
    if (parse_muon_item(PyList_GET_ITEM(list, i), &items[i], &names[i], &keep) != 0) goto done;
  {
    gefen_error err;
    gefen_status st;
    const gefen_quantizer *q = qobj ? ((GefenQuantizer *)qobj)->q : NULL;
    Py_BEGIN_ALLOW_THREADS
    st = fn(items, n, q, get_nthreads(nthreads), &err);
    Py_END_ALLOW_THREADS
    if (st != GEFEN_OK) {
      raise_core(st, &err, names, n);
      goto done;
    }
  }
  result = Py_NewRef(Py_None);
done:
  gefen_view_keep_release(&keep);
  PyMem_Free(items);
  PyMem_Free(names);
  return result;
}

static gefen_status muon_validate_call(const gefen_muon_item *items, int64_t n,
                                       const gefen_quantizer *q, int nthreads, gefen_error *err) {
  (void)q;
  (void)nthreads;
  return gefen_muon_validate(items, n, err);
}

PyObject *gefen_py_muon_validate(PyObject *self, PyObject *args) {
  (void)self;
  return run_muon(args, 0, muon_validate_call);
}

PyObject *gefen_py_muon_momentum(PyObject *self, PyObject *args) {
  (void)self;
  return run_muon(args, 1, gefen_muon_momentum);
}

/* ------------------------------------------------- first-step statistics */

/* period_stats(name, grad, candidates: int64, sums: float64, counts: float64, nthreads) */
PyObject *gefen_py_period_stats(PyObject *self, PyObject *args) {
  (void)self;
  const char *name;
  PyObject *g_obj, *c_obj, *s_obj, *n_obj;
  int nthreads = 0;
  if (!PyArg_ParseTuple(args, "sOOOO|i", &name, &g_obj, &c_obj, &s_obj, &n_obj, &nthreads))
    return NULL;
  gefen_view_keep keep = {NULL};
  PyObject *result = NULL;
  gefen_view g, c, s, cnt;
  gefen_dtype dt;
  if (get_param_grad(g_obj, NULL, &g, NULL, &keep, name, "the gradient", &dt) != 0) goto done;
  if (gefen_view_get(c_obj, &c, &keep, name, "period candidates") != 0) goto done;
  if (gefen_view_expect(&c, name, "period candidates", kDLInt, 64, c.numel, cpu_device) != 0)
    goto done;
  if (gefen_view_get(s_obj, &s, &keep, name, "period sums") != 0 ||
      gefen_view_expect(&s, name, "period sums", kDLFloat, 64, c.numel, cpu_device) != 0)
    goto done;
  if (gefen_view_get(n_obj, &cnt, &keep, name, "period counts") != 0 ||
      gefen_view_expect(&cnt, name, "period counts", kDLFloat, 64, c.numel, cpu_device) != 0)
    goto done;
  {
    gefen_matrix m = {g.data, dt, g.rows, g.cols};
    gefen_error err;
    gefen_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gefen_period_stats(&m, (const int64_t *)c.data, c.numel, (double *)s.data,
                            (double *)cnt.data, get_nthreads(nthreads), &err);
    Py_END_ALLOW_THREADS
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

/* histogram(name, grad, period, hist: int64[4096], nthreads) */
PyObject *gefen_py_histogram(PyObject *self, PyObject *args) {
  (void)self;
  const char *name;
  PyObject *g_obj, *h_obj;
  long long period;
  int nthreads = 0;
  if (!PyArg_ParseTuple(args, "sOLO|i", &name, &g_obj, &period, &h_obj, &nthreads)) return NULL;
  gefen_view_keep keep = {NULL};
  PyObject *result = NULL;
  gefen_view g, h;
  gefen_dtype dt;
  if (get_param_grad(g_obj, NULL, &g, NULL, &keep, name, "the gradient", &dt) != 0) goto done;
  if (gefen_view_get(h_obj, &h, &keep, name, "histogram") != 0 ||
      gefen_view_expect(&h, name, "histogram", kDLInt, 64, GEFEN_HIST_BINS, cpu_device) != 0)
    goto done;
  {
    gefen_matrix m = {g.data, dt, g.rows, g.cols};
    gefen_error err;
    gefen_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gefen_histogram(&m, period, (int64_t *)h.data, get_nthreads(nthreads), &err);
    Py_END_ALLOW_THREADS
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
