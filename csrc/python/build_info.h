/* What this build of gefen._C is and what it picks on this machine, for
 * gefen.show_config() (see build_info.c). */
#ifndef GEFEN_BUILD_INFO_PY_H
#define GEFEN_BUILD_INFO_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *gefen_py_build_info(PyObject *self, PyObject *unused);
PyObject *gefen_py_simd_path(PyObject *self, PyObject *unused);
PyObject *gefen_py_key_search(PyObject *self, PyObject *unused);
PyObject *gefen_py_default_threads(PyObject *self, PyObject *unused);

#endif /* GEFEN_BUILD_INFO_PY_H */
