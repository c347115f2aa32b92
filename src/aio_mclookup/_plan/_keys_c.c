/* Key assembly in C: the compiled twin of _plan.keys.hex_keys and _plan.keys.hex_join
 * (docs/design.md, "Compiled extensions"). One bytes object per key or item, built in place:
 * no hex string, slice or join per key in Python.
 *
 *   hex_keys(rows, index, heads, tails) -> list[bytes]
 *       for each key index j of `index`, with k = len(heads):
 *       heads[j % k] + hex(rows[j // k]) + tails[j % k]
 *   hex_join(rows, index, joiners) -> list[bytes]
 *       for each row index i of `index`: hex(rows[i]).join(joiners)
 *   split_items(entries, end) -> (list[bytes], list[int])
 *       the keys of key-table entries (a tuple or list of bytes): an entry ending with the
 *       one byte `end` is an item, split at every `end` (the empty piece after its last one
 *       dropped); any other entry is one key; and where each entry's keys start
 *
 * `rows` is a 2-D buffer of unsigned bytes (one hash per row; rows may be strided, a row's
 * bytes are contiguous); `index` a range (step 1), or a list or tuple of ints; `heads`,
 * `tails` and `joiners` tuples or lists of bytes (`tails` as long as `heads`, at least one
 * head, at least two joiners). An index past the rows raises IndexError, anything else of
 * the wrong shape or type TypeError or ValueError, before any key is built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_hash_rows.h"

/* An index: a run start .. start + count (a range), or `count` positions read from a list
 * or tuple (owned, freed by index_free). */
typedef struct {
    Py_ssize_t start, count;
    Py_ssize_t *at;
} Index;

static void
index_free(Index *ix)
{
    PyMem_Free(ix->at);
    ix->at = NULL;
}

/* Read `obj` as an index whose every position is below `limit`; -1 with an exception set
 * otherwise. */
static int
index_of(PyObject *obj, Py_ssize_t limit, Index *ix)
{
    ix->at = NULL;
    ix->start = 0;
    if (PyRange_Check(obj)) {
        PyObject *start = PyObject_GetAttrString(obj, "start");
        PyObject *step = PyObject_GetAttrString(obj, "step");
        Py_ssize_t s = start ? PyLong_AsSsize_t(start) : -1;
        Py_ssize_t st = step ? PyLong_AsSsize_t(step) : -1;
        Py_XDECREF(start);
        Py_XDECREF(step);
        if (PyErr_Occurred())
            return -1;
        if (st != 1) {
            PyErr_SetString(PyExc_ValueError, "a range index must have step 1");
            return -1;
        }
        Py_ssize_t n = PyObject_Length(obj);
        if (n < 0)
            return -1;
        if (n && (s < 0 || s > limit - n)) {  /* (no s + n: it may overflow) */
            PyErr_SetString(PyExc_IndexError, "index out of range");
            return -1;
        }
        ix->start = s;
        ix->count = n;
        return 0;
    }
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "the index must be a range, a list or a tuple of ints");
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    ix->count = n;
    ix->at = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (!ix->at) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* (a list may shrink while an item's __index__ runs: re-read its size each time) */
        if (i >= PySequence_Fast_GET_SIZE(obj)) {
            PyErr_SetString(PyExc_RuntimeError, "the index changed size while being read");
            index_free(ix);
            return -1;
        }
        PyObject *item = PySequence_Fast_ITEMS(obj)[i];
        if (!PyLong_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "index positions must be ints");
            index_free(ix);
            return -1;
        }
        Py_ssize_t p = PyLong_AsSsize_t(item);
        if (p == -1 && PyErr_Occurred()) {
            index_free(ix);
            return -1;
        }
        if (p < 0 || p >= limit) {
            PyErr_SetString(PyExc_IndexError, "index out of range");
            index_free(ix);
            return -1;
        }
        ix->at[i] = p;
    }
    return 0;
}

static inline Py_ssize_t
index_at(const Index *ix, Py_ssize_t i)
{
    return ix->at ? ix->at[i] : ix->start + i;
}

/* Pieces: a tuple snapshot of bytes objects (held), with their pointers and lengths. */
typedef struct {
    PyObject *held;
    Py_ssize_t count, total;
    const char **data;
    Py_ssize_t *size;
} Pieces;

static void
pieces_free(Pieces *p)
{
    Py_CLEAR(p->held);
    PyMem_Free(p->data);
    PyMem_Free(p->size);
    p->data = NULL;
    p->size = NULL;
}

static int
pieces_of(PyObject *obj, const char *what, Py_ssize_t at_least, Pieces *p)
{
    p->held = NULL;
    p->data = NULL;
    p->size = NULL;
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple or a list of bytes", what);
        return -1;
    }
    p->held = PySequence_Tuple(obj);  /* (a snapshot: nothing below runs Python code) */
    if (!p->held)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(p->held);
    if (n < at_least) {
        PyErr_Format(PyExc_ValueError, "%s must hold at least %zd bytes", what, at_least);
        pieces_free(p);
        return -1;
    }
    p->count = n;
    p->total = 0;
    p->data = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(char *));
    p->size = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (!p->data || !p->size) {
        pieces_free(p);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyTuple_GET_ITEM(p->held, i);
        if (!PyBytes_Check(b)) {
            PyErr_Format(PyExc_TypeError, "%s must be a tuple or a list of bytes", what);
            pieces_free(p);
            return -1;
        }
        p->data[i] = PyBytes_AS_STRING(b);
        p->size[i] = PyBytes_GET_SIZE(b);
        p->total += p->size[i];
    }
    return 0;
}

static const char HEX[] = "0123456789abcdef";

static inline char *
put_hex(char *out, const uint8_t *row, Py_ssize_t width)
{
    for (Py_ssize_t b = 0; b < width; b++) {
        *out++ = HEX[row[b] >> 4];
        *out++ = HEX[row[b] & 15];
    }
    return out;
}

static PyObject *
hex_keys(PyObject *self, PyObject *args)
{
    PyObject *rows_obj, *index_obj, *heads_obj, *tails_obj;
    if (!PyArg_ParseTuple(args, "OOOO:hex_keys", &rows_obj, &index_obj, &heads_obj, &tails_obj))
        return NULL;
    Rows rows;
    Pieces heads, tails;
    Index ix;
    PyObject *out = NULL;
    if (rows_of(rows_obj, &rows) < 0)
        return NULL;
    if (pieces_of(heads_obj, "heads", 1, &heads) < 0)
        goto release_rows;
    if (pieces_of(tails_obj, "tails", heads.count, &tails) < 0)
        goto release_heads;
    if (tails.count != heads.count) {
        PyErr_SetString(PyExc_ValueError, "heads and tails must be as many");
        goto release_tails;
    }
    Py_ssize_t k = heads.count;
    if (rows.rows > PY_SSIZE_T_MAX / k) {
        PyErr_SetString(PyExc_OverflowError, "too many keys");
        goto release_tails;
    }
    if (index_of(index_obj, rows.rows * k, &ix) < 0)
        goto release_tails;
    out = PyList_New(ix.count);
    if (!out)
        goto release_index;
    for (Py_ssize_t i = 0; i < ix.count; i++) {
        Py_ssize_t j = index_at(&ix, i), slot = j % k;
        Py_ssize_t size = heads.size[slot] + 2 * rows.width + tails.size[slot];
        PyObject *key = PyBytes_FromStringAndSize(NULL, size);
        if (!key) {
            Py_CLEAR(out);
            break;
        }
        char *p = PyBytes_AS_STRING(key);
        memcpy(p, heads.data[slot], (size_t)heads.size[slot]);
        p = put_hex(p + heads.size[slot], (const uint8_t *)rows.view.buf + (j / k) * rows.stride, rows.width);
        memcpy(p, tails.data[slot], (size_t)tails.size[slot]);
        PyList_SET_ITEM(out, i, key);
    }
release_index:
    index_free(&ix);
release_tails:
    pieces_free(&tails);
release_heads:
    pieces_free(&heads);
release_rows:
    PyBuffer_Release(&rows.view);
    return out;
}

static PyObject *
hex_join(PyObject *self, PyObject *args)
{
    PyObject *rows_obj, *index_obj, *joiners_obj;
    if (!PyArg_ParseTuple(args, "OOO:hex_join", &rows_obj, &index_obj, &joiners_obj))
        return NULL;
    Rows rows;
    Pieces joiners;
    Index ix;
    PyObject *out = NULL;
    if (rows_of(rows_obj, &rows) < 0)
        return NULL;
    if (pieces_of(joiners_obj, "joiners", 2, &joiners) < 0)
        goto release_rows;
    if (index_of(index_obj, rows.rows, &ix) < 0)
        goto release_joiners;
    Py_ssize_t holes = joiners.count - 1;
    if (rows.width > (PY_SSIZE_T_MAX - joiners.total) / 2 / holes) {
        PyErr_SetString(PyExc_OverflowError, "items too long");
        goto release_index;
    }
    Py_ssize_t size = joiners.total + holes * 2 * rows.width;
    out = PyList_New(ix.count);
    if (!out)
        goto release_index;
    for (Py_ssize_t i = 0; i < ix.count; i++) {
        const uint8_t *row = (const uint8_t *)rows.view.buf + index_at(&ix, i) * rows.stride;
        PyObject *item = PyBytes_FromStringAndSize(NULL, size);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        char *p = PyBytes_AS_STRING(item);
        memcpy(p, joiners.data[0], (size_t)joiners.size[0]);
        char *hex = p + joiners.size[0];
        p = put_hex(hex, row, rows.width);
        for (Py_ssize_t h = 1; h < joiners.count; h++) {
            memcpy(p, joiners.data[h], (size_t)joiners.size[h]);
            p += joiners.size[h];
            if (h < holes) {
                memcpy(p, hex, (size_t)(2 * rows.width));
                p += 2 * rows.width;
            }
        }
        PyList_SET_ITEM(out, i, item);
    }
release_index:
    index_free(&ix);
release_joiners:
    pieces_free(&joiners);
release_rows:
    PyBuffer_Release(&rows.view);
    return out;
}

static PyObject *
split_items(PyObject *self, PyObject *args)
{
    PyObject *entries_obj;
    char end;
    if (!PyArg_ParseTuple(args, "Oc:split_items", &entries_obj, &end))
        return NULL;
    if (!PyList_Check(entries_obj) && !PyTuple_Check(entries_obj)) {
        PyErr_SetString(PyExc_TypeError, "entries must be a tuple or a list of bytes");
        return NULL;
    }
    PyObject *entries = PySequence_Tuple(entries_obj);  /* (a snapshot) */
    if (!entries)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(entries), count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {  /* count the keys first: one list of the right size */
        PyObject *e = PyTuple_GET_ITEM(entries, i);
        if (!PyBytes_Check(e)) {
            PyErr_SetString(PyExc_TypeError, "entries must be a tuple or a list of bytes");
            Py_DECREF(entries);
            return NULL;
        }
        Py_ssize_t size = PyBytes_GET_SIZE(e);
        const char *data = PyBytes_AS_STRING(e);
        if (size && data[size - 1] == end) {
            for (const char *at = data, *stop = data + size;
                 (at = memchr(at, end, (size_t)(stop - at))) != NULL; at++)
                count++;
        } else {
            count++;
        }
    }
    PyObject *keys = PyList_New(count), *starts = PyList_New(n), *out = NULL;
    if (!keys || !starts)
        goto done;
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyTuple_GET_ITEM(entries, i);
        PyObject *start = PyLong_FromSsize_t(at);
        if (!start)
            goto done;
        PyList_SET_ITEM(starts, i, start);
        Py_ssize_t size = PyBytes_GET_SIZE(e);
        const char *data = PyBytes_AS_STRING(e);
        if (!size || data[size - 1] != end) {
            Py_INCREF(e);
            PyList_SET_ITEM(keys, at++, e);
            continue;
        }
        const char *from = data, *stop = data + size, *cut;
        while ((cut = memchr(from, end, (size_t)(stop - from))) != NULL) {
            PyObject *key = PyBytes_FromStringAndSize(from, cut - from);
            if (!key)
                goto done;
            PyList_SET_ITEM(keys, at++, key);
            from = cut + 1;
        }
    }
    out = PyTuple_Pack(2, keys, starts);
done:
    Py_XDECREF(keys);
    Py_XDECREF(starts);
    Py_DECREF(entries);
    return out;
}

static PyMethodDef methods[] = {
    {"hex_keys", hex_keys, METH_VARARGS,
     "hex_keys(rows, index, heads, tails): for each key index j, "
     "heads[j % k] + hex(rows[j // k]) + tails[j % k] (k = len(heads))."},
    {"hex_join", hex_join, METH_VARARGS,
     "hex_join(rows, index, joiners): for each row index i, hex(rows[i]).join(joiners)."},
    {"split_items", split_items, METH_VARARGS,
     "split_items(entries, end): the keys of key-table entries (items split at `end`), and "
     "where each entry's keys start."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_keys_c", "Key assembly in C (see aio_mclookup._plan.keys).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__keys_c(void)
{
    return PyModule_Create(&module);
}
