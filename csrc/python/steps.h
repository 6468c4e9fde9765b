/* Step entry points of gefen._C (see steps.c). */
#ifndef GEFEN_STEPS_H
#define GEFEN_STEPS_H

#include "tensor_view.h"

/* Adds the step-plan types AdamStep and MuonStep to the module; -1 on error. */
int gefen_add_step_types(PyObject *module);
PyObject *gefen_py_period_stats(PyObject *self, PyObject *args);
PyObject *gefen_py_histogram(PyObject *self, PyObject *args);
PyObject *gefen_py_codes_remap(PyObject *self, PyObject *args);
PyObject *gefen_py_cuda_available(PyObject *self, PyObject *unused);
PyObject *gefen_py_built_with_cuda(PyObject *self, PyObject *unused);

#endif /* GEFEN_STEPS_H */
