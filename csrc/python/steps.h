/* Step entry points of gefen._C (see steps.c). */
#ifndef GEFEN_STEPS_H
#define GEFEN_STEPS_H

#include "tensor_view.h"

PyObject *gefen_py_adam_validate(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *gefen_py_adam_factored_stats(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *gefen_py_adam_update(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *gefen_py_muon_validate(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *gefen_py_muon_momentum(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *gefen_py_period_stats(PyObject *self, PyObject *args);
PyObject *gefen_py_histogram(PyObject *self, PyObject *args);
PyObject *gefen_py_codes_remap(PyObject *self, PyObject *args);
PyObject *gefen_py_cuda_available(PyObject *self, PyObject *unused);
PyObject *gefen_py_built_with_cuda(PyObject *self, PyObject *unused);

#endif /* GEFEN_STEPS_H */
