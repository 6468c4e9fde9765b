/* gefen._C.Quantizer: a Python object owning a core quantiser. */
#ifndef GEFEN_QUANTIZER_TYPE_H
#define GEFEN_QUANTIZER_TYPE_H

#include "tensor_view.h"

typedef struct {
  PyObject_HEAD
  gefen_quantizer *q;
} GefenQuantizer;

/* The Quantizer type; set by the module's init (PyInit__C). */
extern PyTypeObject *GefenQuantizer_Type;

#endif /* GEFEN_QUANTIZER_TYPE_H */
