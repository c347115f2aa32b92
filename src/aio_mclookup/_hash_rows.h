/* Hash rows in C: a 2-D buffer of unsigned bytes, one hash per row (rows may be strided, the
 * bytes of a row are contiguous), as the extensions that read them take it (_rows_c.c,
 * _plan/_keys_c.c).
 */
#ifndef AIO_MCLOOKUP_HASH_ROWS_H
#define AIO_MCLOOKUP_HASH_ROWS_H

#include <Python.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    Py_ssize_t rows, width, stride;
} Rows;

/* Fill `r` from a 2-D unsigned-byte buffer (release r->view after); -1 with ValueError set
 * otherwise. */
static int
rows_of(PyObject *obj, Rows *r)
{
    if (PyObject_GetBuffer(obj, &r->view, PyBUF_RECORDS_RO) < 0)
        return -1;
    Py_buffer *v = &r->view;
    if (v->ndim != 2 || v->itemsize != 1 || (v->format && strcmp(v->format, "B") != 0)
        || (v->shape[1] > 1 && v->strides[1] != 1) || v->suboffsets) {
        PyBuffer_Release(v);
        PyErr_SetString(PyExc_ValueError, "expected a 2-D array of uint8 hash rows");
        return -1;
    }
    r->rows = v->shape[0];
    r->width = v->shape[1];
    r->stride = v->strides[0];
    return 0;
}

#endif
