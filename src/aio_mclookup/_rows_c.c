/* Comparisons of hash rows in C loops: the compiled twin of _rows.py (docs/design.md,
 * "Compiled extensions"). A hash-row array is a 2-D buffer of unsigned bytes (one hash per
 * row; rows may be strided, the bytes of a row are contiguous).
 *
 *   common_rows(a, b, limit) -> int
 *       how many leading rows a and b share, at most limit and the shorter one's length.
 *   rows_repeat(rows) -> bool
 *       whether two rows are equal (one pass over an open-addressing table of row numbers,
 *       keyed by a hash of each whole row, equal rows confirmed with memcmp).
 *
 * Both raise ValueError for buffers of another shape (the Python twin takes those).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NOGIL_ROWS 4096  /* from this many rows the table pass lets other threads run */

typedef struct {
    Py_buffer view;
    Py_ssize_t rows, width, stride;
} Rows;

/* Fill `r` from a 2-D unsigned-byte buffer; -1 with an exception set otherwise. */
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

/* A 64-bit hash of a whole row (words mixed in turn, then a finaliser). */
static inline uint64_t
row_hash(const unsigned char *p, Py_ssize_t width)
{
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)width;
    Py_ssize_t i = 0;
    for (; i + 8 <= width; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
        h ^= h >> 31;
    }
    if (i < width) {
        uint64_t w = 0;
        memcpy(&w, p + i, (size_t)(width - i));
        h = (h ^ w) * 0x94D049BB133111EBULL;
    }
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 32;
    return h;
}

/* 1 if two rows are equal, 0 if not, -1 when out of memory. */
static int
any_repeat(const unsigned char *base, Py_ssize_t n, Py_ssize_t width, Py_ssize_t stride)
{
    size_t size = 16;
    while (size < (size_t)n * 2)
        size <<= 1;
    uint32_t *slots = calloc(size, sizeof(uint32_t));  /* row number + 1; 0: empty */
    if (!slots)
        return -1;
    size_t mask = size - 1;
    int found = 0;
    for (Py_ssize_t i = 0; i < n && !found; i++) {
        const unsigned char *row = base + i * stride;
        size_t at = (size_t)row_hash(row, width) & mask;
        for (;;) {
            uint32_t s = slots[at];
            if (!s) {
                slots[at] = (uint32_t)(i + 1);
                break;
            }
            if (memcmp(base + (Py_ssize_t)(s - 1) * stride, row, (size_t)width) == 0) {
                found = 1;
                break;
            }
            at = (at + 1) & mask;
        }
    }
    free(slots);
    return found;
}

static PyObject *
rows_repeat(PyObject *self, PyObject *arg)
{
    Rows r;
    if (rows_of(arg, &r) < 0)
        return NULL;
    int found;
    if (r.rows < 2) {
        found = 0;
    } else if (!r.width) {
        found = 1;  /* empty hashes: every row equals every other */
    } else if (r.rows >= UINT32_MAX) {
        PyBuffer_Release(&r.view);
        PyErr_SetString(PyExc_ValueError, "too many hash rows");
        return NULL;
    } else if (r.rows >= NOGIL_ROWS) {
        Py_BEGIN_ALLOW_THREADS
        found = any_repeat(r.view.buf, r.rows, r.width, r.stride);
        Py_END_ALLOW_THREADS
    } else {
        found = any_repeat(r.view.buf, r.rows, r.width, r.stride);
    }
    PyBuffer_Release(&r.view);
    if (found < 0)
        return PyErr_NoMemory();
    return PyBool_FromLong(found);
}

static PyMethodDef methods[] = {
    {"common_rows", common_rows, METH_VARARGS,
     "common_rows(a, b, limit): how many leading hash rows a and b share (at most limit, "
     "unless it is negative)."},
    {"rows_repeat", rows_repeat, METH_O,
     "rows_repeat(rows): whether two hash rows are equal."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._rows_c",
    "Comparisons of hash rows in C loops (see _rows_c.c).", -1, methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__rows_c(void)
{
    return PyModule_Create(&module);
}
