/* The known prefixes' two reads in C: the compiled twins of KnownPrefixes.leading and
 * KnownPrefixes.after in _coordinator/caches.py (docs/design.md, "Compiled extensions"), over
 * the same trees of _Node objects (rows, until, children, miss, grown), which the Python code
 * builds and changes. tests/test_coordinator_caches.py runs both on the same trees.
 *
 *   leading(runs, key, rows, now) -> (int, float) | None
 *       how many of `rows` (a request's chunk hashes, from the first) the tree at `key` of
 *       `runs` holds as known present at `now`, and until when all of those are; None when
 *       the walk meets rows out of date (the Python method then drops them as it goes) or
 *       arrays it does not read.
 *   after(runs, key, rows, count) -> int | None
 *       what is likely of chunk `count` after the `count` rows the tree shares with the
 *       request: 0 likely present, 1 likely absent, 2 leaves the run (NextChunk's members,
 *       in that order); None for arrays it does not read.
 *
 * Neither changes a tree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#include "../_hash_rows.h"

static PyObject *s_rows, *s_until, *s_children, *s_miss, *s_grown;

/* A node's until (1-D float64) as a view; 0 when it is not one. */
static int
until_of(PyObject *node, Py_buffer *view)
{
    PyObject *until = PyObject_GetAttr(node, s_until);
    if (until == NULL)
        return 0;
    int got = PyObject_GetBuffer(until, view, PyBUF_RECORDS_RO) == 0;
    Py_DECREF(until);
    if (!got)
        return 0;
    if (view->ndim != 1 || view->itemsize != 8 || !view->format || strcmp(view->format, "d")
        || view->suboffsets) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* A node's rows as Rows of `width` bytes; 0 when they are not. */
static int
node_rows(PyObject *node, Rows *r, Py_ssize_t width)
{
    PyObject *rows = PyObject_GetAttr(node, s_rows);
    if (rows == NULL)
        return 0;
    int got = rows_of(rows, r) == 0;
    Py_DECREF(rows);
    if (!got)
        return 0;
    if (r->width != width) {
        PyBuffer_Release(&r->view);
        return 0;
    }
    return 1;
}

static inline double
until_at(const Py_buffer *v, Py_ssize_t i)
{
    double x;
    memcpy(&x, (const char *)v->buf + i * v->strides[0], 8);
    return x;
}

static inline const char *
row_at(const Rows *r, Py_ssize_t i)
{
    return (const char *)r->view.buf + i * r->stride;
}

/* The child of `node` whose first row is `row` (a new reference), NULL with no error when
 * there is none, NULL with an error on failure. */
static PyObject *
child_of(PyObject *node, const char *row, Py_ssize_t width)
{
    PyObject *children = PyObject_GetAttr(node, s_children);
    if (children == NULL)
        return NULL;
    PyObject *child = NULL;
    if (PyDict_CheckExact(children) && PyDict_GET_SIZE(children)) {
        PyObject *first = PyBytes_FromStringAndSize(row, width);
        if (first != NULL) {
            child = PyDict_GetItemWithError(children, first);
            Py_XINCREF(child);
            Py_DECREF(first);
        }
    }
    Py_DECREF(children);
    return child;
}

/* The root of the tree at `key` (borrowed), NULL with no error when there is none. */
static PyObject *
root_of(PyObject *runs, PyObject *key)
{
    PyObject *tree = PyDict_GetItemWithError(runs, key);
    if (tree == NULL || !PyList_CheckExact(tree) || PyList_GET_SIZE(tree) < 1)
        return NULL;
    return PyList_GET_ITEM(tree, 0);
}

static PyObject *
leading(PyObject *self, PyObject *args)
{
    PyObject *runs, *key, *rows_obj;
    double now;
    if (!PyArg_ParseTuple(args, "O!OOd:leading", &PyDict_Type, &runs, &key, &rows_obj, &now))
        return NULL;
    Rows rows;
    if (rows_of(rows_obj, &rows) < 0) { /* (None: the Python method reads them, or says why) */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = NULL;
    Py_ssize_t n = rows.rows, width = rows.width, depth = 0;
    double until = INFINITY;
    PyObject *node = n ? root_of(runs, key) : NULL;
    if (node == NULL) {
        if (!PyErr_Occurred())
            result = Py_BuildValue("(nd)", (Py_ssize_t)0, (double)INFINITY);
        goto done;
    }
    Py_INCREF(node);
    for (;;) {
        Py_buffer times;
        Rows edge_rows;
        if (!until_of(node, &times)) {
            PyErr_Clear();
            break; /* (None: the Python method reads it) */
        }
        if (!node_rows(node, &edge_rows, width)) {
            PyErr_Clear();
            PyBuffer_Release(&times);
            break;
        }
        Py_ssize_t edge = times.shape[0];
        Py_ssize_t m = edge < n - depth ? edge : n - depth;
        if (edge_rows.rows != edge || !edge || until_at(&times, 0) <= now
            || until_at(&times, m - 1) <= now) { /* (out of date: the Python method drops it) */
            PyBuffer_Release(&times);
            PyBuffer_Release(&edge_rows.view);
            break;
        }
        Py_ssize_t count = 0;
        while (count < m && !memcmp(row_at(&rows, depth + count), row_at(&edge_rows, count),
                                    (size_t)width))
            count++;
        if (count)
            until = until_at(&times, count - 1);
        depth += count;
        PyBuffer_Release(&times);
        PyBuffer_Release(&edge_rows.view);
        PyObject *child = NULL;
        if (count == edge && depth < n) {
            child = child_of(node, row_at(&rows, depth), width);
            if (child == NULL && PyErr_Occurred()) {
                Py_DECREF(node);
                goto done;
            }
        }
        Py_DECREF(node);
        if (child == NULL) {
            result = Py_BuildValue("(nd)", depth, until);
            goto done;
        }
        node = child;
    }
    Py_DECREF(node);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&rows.view);
    return result;
}

static PyObject *
after(PyObject *self, PyObject *args)
{
    PyObject *runs, *key, *rows_obj;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "O!OOn:after", &PyDict_Type, &runs, &key, &rows_obj, &count))
        return NULL;
    Rows rows;
    if (rows_of(rows_obj, &rows) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    long verdict = -1; /* 0 likely present, 1 likely absent, 2 leaves the run */
    Py_ssize_t width = rows.width, depth = 0;
    PyObject *node = count >= 0 && count < rows.rows ? root_of(runs, key) : NULL;
    if (node == NULL) {
        if (!PyErr_Occurred())
            verdict = 1;
        goto done;
    }
    const char *row = row_at(&rows, count);
    Py_INCREF(node);
    for (;;) {
        Py_buffer times;
        Rows edge_rows;
        if (!until_of(node, &times)) {
            PyErr_Clear();
            break;
        }
        Py_ssize_t edge = times.shape[0];
        PyBuffer_Release(&times);
        if (count < depth + edge) { /* chunk `count` is inside this edge */
            if (!node_rows(node, &edge_rows, width)) {
                PyErr_Clear();
                break;
            }
            if (edge_rows.rows == edge)
                verdict = memcmp(row, row_at(&edge_rows, count - depth), (size_t)width) ? 2 : 0;
            PyBuffer_Release(&edge_rows.view);
            break;
        }
        depth += edge;
        if (depth == count) {
            PyObject *children = PyObject_GetAttr(node, s_children);
            if (children == NULL)
                break;
            int branches = PyDict_CheckExact(children) && PyDict_GET_SIZE(children) > 0;
            int other = children != Py_None && !PyDict_CheckExact(children);
            Py_DECREF(children);
            if (other) /* (not a dict: the Python method reads it) */
                break;
            if (branches) {
                verdict = 0; /* a branch point (whichever branch) */
                break;
            }
            PyObject *miss = PyObject_GetAttr(node, s_miss);
            PyObject *grown = miss ? PyObject_GetAttr(node, s_grown) : NULL;
            if (grown != NULL) {
                int is_miss = PyBytes_CheckExact(miss) && PyBytes_GET_SIZE(miss) == width
                              && !memcmp(PyBytes_AS_STRING(miss), row, (size_t)width);
                int has_grown = PyObject_IsTrue(grown);
                if (has_grown >= 0)
                    verdict = is_miss || !has_grown ? 1 : 0;
            }
            Py_XDECREF(miss);
            Py_XDECREF(grown);
            break;
        }
        PyObject *child = child_of(node, row_at(&rows, depth), width);
        if (child == NULL) {
            if (!PyErr_Occurred())
                verdict = 1; /* (the request parted before `count`) */
            break;
        }
        Py_DECREF(node);
        node = child;
    }
    Py_DECREF(node);
done:
    PyBuffer_Release(&rows.view);
    if (PyErr_Occurred())
        return NULL;
    if (verdict < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(verdict);
}

static PyMethodDef methods[] = {
    {"leading", leading, METH_VARARGS,
     "leading(runs, key, rows, now): (known rows, until when) of the tree at key, or None "
     "where the Python method must walk it (rows out of date, arrays of another kind)."},
    {"after", after, METH_VARARGS,
     "after(runs, key, rows, count): 0 likely present, 1 likely absent, 2 leaves the run; "
     "None where the Python method must walk it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._coordinator._prefixes_c",
    "The known prefixes' reads in C (see _prefixes_c.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__prefixes_c(void)
{
    s_rows = PyUnicode_InternFromString("rows");
    s_until = PyUnicode_InternFromString("until");
    s_children = PyUnicode_InternFromString("children");
    s_miss = PyUnicode_InternFromString("miss");
    s_grown = PyUnicode_InternFromString("grown");
    if (!s_rows || !s_until || !s_children || !s_miss || !s_grown)
        return NULL;
    return PyModule_Create(&module);
}
