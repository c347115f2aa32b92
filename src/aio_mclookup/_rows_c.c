/* Comparisons of hash rows in C: the compiled twin of _rows.common_rows (docs/design.md,
 * "Compiled extensions"). A hash-row array is a 2-D buffer of unsigned bytes (one hash per
 * row; rows may be strided, the bytes of a row are contiguous).
 *
 *   common_rows(a, b, limit) -> int
 *       how many leading rows a and b share, at most limit (unless negative) and the shorter
 *       one's length; ValueError for buffers of another shape.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_hash_rows.h"

static PyObject *
common_rows(PyObject *self, PyObject *args)
{
    PyObject *a_obj, *b_obj;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OOn", &a_obj, &b_obj, &limit))
        return NULL;
    Rows a, b;
    if (rows_of(a_obj, &a) < 0)
        return NULL;
    if (rows_of(b_obj, &b) < 0) {
        PyBuffer_Release(&a.view);
        return NULL;
    }
    if (a.width != b.width) {
        PyBuffer_Release(&a.view);
        PyBuffer_Release(&b.view);
        PyErr_SetString(PyExc_ValueError, "hash rows of different widths");
        return NULL;
    }
    Py_ssize_t m = a.rows < b.rows ? a.rows : b.rows;
    if (limit >= 0 && limit < m)
        m = limit;
    Py_ssize_t i = 0;
    if (a.width) {
        const char *pa = a.view.buf, *pb = b.view.buf;
        if (a.stride == a.width && b.stride == b.width) {  /* contiguous: one memcmp first */
            if (memcmp(pa, pb, (size_t)(m * a.width)) == 0)
                i = m;
        }
        for (; i < m; i++)
            if (memcmp(pa + i * a.stride, pb + i * b.stride, (size_t)a.width) != 0)
                break;
    } else {
        i = m;  /* rows of empty hashes are all equal */
    }
    PyBuffer_Release(&a.view);
    PyBuffer_Release(&b.view);
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"common_rows", common_rows, METH_VARARGS,
     "common_rows(a, b, limit): how many leading hash rows a and b share (at most limit, "
     "unless it is negative)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._rows_c",
    "Comparisons of hash rows in C (see _rows_c.c).", -1, methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__rows_c(void)
{
    return PyModule_Create(&module);
}
