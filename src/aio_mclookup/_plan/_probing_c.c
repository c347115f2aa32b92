/* A 0.32 / 0.33 probing round's answers recorded in C: the compiled twin of
 * EraCProbeState.record in _plan/probing_era_c.py (with probing.group_answers), docs/design.md,
 * "Compiled extensions". The Python method is the reference; tests/test_plan_probing.py runs
 * both on the same rounds.
 *
 *   record(groups, indices, present, answered, present_at, units, known, maybe[, unit])
 *       -> bool
 *       groups: per store group (key offset, namespaces k, probed positions) as int64 bytes;
 *       indices: the round's key indices (int64, ascending, whole positions: k keys each);
 *       present: one answer per key, or per `unit` consecutive keys (default 1; float64 or
 *           bool array, or a list of floats / ints), truthy = present;
 *       answered, present_at: per group, one bool per probed position;
 *       units: per group, the hash unit of each probed position (int64);
 *       known, maybe: per group, one bool per hash unit.
 *   keys_of(groups, found, units) -> bytes | None
 *       the twin of the mapping at the end of EraCProbeState.next_keys: per group the
 *       positions of the hash units `found` (int64 arrays) among its probed `units`, each as
 *       its k keys, ascending (int64 bytes).
 *
 *   unit_masks(known, maybe, units) -> bool
 *       the twin of the start of EraCProbeState.__init__: per group, every hash unit known
 *       (absent) but the probed ones, which are unknown (maybe present); False when not set
 *       here (arrays of another shape, a unit that does not fit): nothing was written.
 *
 *   record: for each group's keys among `indices` (every one of a position's k keys present: the
 *   position is), it sets answered and present_at at the position, known and maybe at its
 *   unit. True when recorded; False when not recorded here (arrays of another shape, answers
 *   of another type, a position that does not fit): nothing was written, and the Python
 *   method records them (or raises what it raises).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUPS 64
#define MAX_SIZE ((int64_t)1 << 30) /* offsets, positions, namespaces and keys taken here: their
                                       products and sums stay far within int64 */

/* A buffer of `format` (one char, any byte order prefix of native order) and 1 dimension. */
static int
get_1d(PyObject *obj, Py_buffer *view, int writable, const char *formats, Py_ssize_t itemsize)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '=' || *f == '@' || *f == '<')
        f++;
    if (view->ndim != 1 || view->itemsize != itemsize || !*f || f[1] || !strchr(formats, *f)) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

typedef struct {
    Py_buffer views[5 * MAX_GROUPS + 3];
    int held;
} Held;

static Py_buffer *
hold(Held *h, PyObject *obj, int writable, const char *formats, Py_ssize_t itemsize)
{
    Py_buffer *view = &h->views[h->held];
    if (!get_1d(obj, view, writable, formats, itemsize))
        return NULL;
    h->held++;
    return view;
}

/* `out[0:n]`, one answer per `unit` keys, spread in place to one per key (from the end). */
static uint8_t *
spread(uint8_t *out, Py_ssize_t n, Py_ssize_t unit)
{
    if (unit > 1)
        for (Py_ssize_t i = n - 1; i >= 0; i--)
            memset(out + i * unit, out[i], (size_t)unit);
    return out;
}

/* The answers as one byte per key (1 present), each of the n / unit answers read for
 * `unit` consecutive keys; or NULL (not of a type or length read here). */
static uint8_t *
truthy(PyObject *present, Py_ssize_t keys, Py_ssize_t unit, Held *h)
{
    if (unit < 1 || keys % unit)
        return NULL;
    Py_ssize_t n = keys / unit;
    uint8_t *out = malloc((size_t)(keys ? keys : 1));
    if (!out)
        return NULL;
    if (PyList_CheckExact(present)) {
        if (PyList_GET_SIZE(present) != n)
            goto refuse;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(present, i);
            if (PyFloat_CheckExact(item))
                out[i] = PyFloat_AS_DOUBLE(item) != 0.0; /* (NaN is truthy too) */
            else if (PyLong_CheckExact(item) || PyBool_Check(item))
                out[i] = PyObject_IsTrue(item) == 1;
            else
                goto refuse;
        }
        return spread(out, n, unit);
    }
    Py_buffer *view = hold(h, present, 0, "d", 8);
    if (view) {
        if (view->len / 8 != n)
            goto refuse;
        const double *values = view->buf;
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = values[i] != 0.0;
        return spread(out, n, unit);
    }
    view = hold(h, present, 0, "?", 1);
    if (view) {
        if (view->len != n)
            goto refuse;
        const uint8_t *values = view->buf;
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = values[i] != 0;
        return spread(out, n, unit);
    }
refuse:
    free(out);
    return NULL;
}

/* The first index in the ascending `v[0:n]` holding a value >= x (numpy's searchsorted). */
static Py_ssize_t
search_left(const int64_t *v, Py_ssize_t n, int64_t x)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (v[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static PyObject *
record(PyObject *self, PyObject *args)
{
    PyObject *indices_obj, *present_obj, *answered_obj, *present_at_obj, *units_obj,
        *known_obj, *maybe_obj;
    Py_buffer codes;
    PyObject *unit_obj = NULL;
    if (!PyArg_ParseTuple(args, "y*OOOOOOO|O:record", &codes, &indices_obj, &present_obj,
                          &answered_obj, &present_at_obj, &units_obj, &known_obj, &maybe_obj,
                          &unit_obj))
        return NULL;
    Py_ssize_t unit = 1; /* (an int out of range, or not an int: not recorded here) */
    if (unit_obj && (!PyLong_CheckExact(unit_obj)
                     || (unit = PyLong_AsSsize_t(unit_obj)) == -1)) {
        PyErr_Clear();
        unit = 0;
    }
    Held h = {.held = 0};
    uint8_t *got = NULL;
    int recorded = 0;
    Py_buffer *groups = &codes;
    Py_buffer *indices = hold(&h, indices_obj, 0, "lq", 8);
    PyObject *tuples[5] = {answered_obj, present_at_obj, units_obj, known_obj, maybe_obj};
    if (!groups || !indices || groups->len % 24)
        goto done;
    Py_ssize_t g = groups->len / 24, n = indices->len / 8;
    if (g < 1 || g > MAX_GROUPS)
        goto done;
    for (int t = 0; t < 5; t++)
        if (!PyTuple_CheckExact(tuples[t]) || PyTuple_GET_SIZE(tuples[t]) != g)
            goto done;
    got = truthy(present_obj, n, unit, &h);
    if (!got)
        goto done;
    const int64_t *spec = groups->buf, *keys = indices->buf;
    Py_buffer *answered[MAX_GROUPS], *present_at[MAX_GROUPS], *units[MAX_GROUPS],
        *known[MAX_GROUPS], *maybe[MAX_GROUPS];
    Py_ssize_t lo[MAX_GROUPS], hi[MAX_GROUPS];
    for (Py_ssize_t i = 0; i < g; i++) { /* every check first: nothing written if one fails */
        int64_t offset = spec[3 * i], k = spec[3 * i + 1], size = spec[3 * i + 2];
        if (k < 1 || k > MAX_SIZE || size < 0 || size > MAX_SIZE || offset < 0
            || offset > MAX_SIZE)
            goto done;
        if (!(answered[i] = hold(&h, PyTuple_GET_ITEM(answered_obj, i), 1, "?", 1))
            || !(present_at[i] = hold(&h, PyTuple_GET_ITEM(present_at_obj, i), 1, "?", 1))
            || !(units[i] = hold(&h, PyTuple_GET_ITEM(units_obj, i), 0, "lq", 8))
            || !(known[i] = hold(&h, PyTuple_GET_ITEM(known_obj, i), 1, "?", 1))
            || !(maybe[i] = hold(&h, PyTuple_GET_ITEM(maybe_obj, i), 1, "?", 1)))
            goto done;
        Py_ssize_t positions = answered[i]->len;
        if (present_at[i]->len != positions || units[i]->len / 8 != positions
            || maybe[i]->len != known[i]->len)
            goto done;
        if (g == 1) {
            lo[i] = 0;
            hi[i] = n;
        } else {
            lo[i] = search_left(keys, n, offset);
            hi[i] = search_left(keys, n, offset + size * k);
        }
        if (hi[i] <= lo[i])
            continue;
        if ((hi[i] - lo[i]) % k)
            goto done; /* (not whole positions: the Python method raises) */
        const int64_t *unit = units[i]->buf;
        for (Py_ssize_t j = lo[i]; j < hi[i]; j += k) {
            if (keys[j] < offset)
                goto done;
            int64_t at = (keys[j] - offset) / k;
            if (at >= positions || unit[at] < 0 || unit[at] >= known[i]->len)
                goto done;
        }
    }
    for (Py_ssize_t i = 0; i < g; i++) {
        int64_t offset = spec[3 * i], k = spec[3 * i + 1];
        uint8_t *ans = answered[i]->buf, *pres = present_at[i]->buf, *kn = known[i]->buf,
                *may = maybe[i]->buf;
        const int64_t *unit = units[i]->buf;
        for (Py_ssize_t j = lo[i]; j < hi[i]; j += k) {
            int64_t at = (keys[j] - offset) / k;
            uint8_t all = 1;
            for (int64_t m = 0; m < k; m++)
                all &= got[j + m];
            ans[at] = 1;
            pres[at] = all;
            kn[unit[at]] = 1;
            may[unit[at]] = all;
        }
    }
    recorded = 1;
done:
    free(got);
    for (int j = 0; j < h.held; j++)
        PyBuffer_Release(&h.views[j]);
    PyBuffer_Release(&codes);
    if (PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(recorded);
}

static PyObject *
unit_masks(PyObject *self, PyObject *args)
{
    PyObject *known_obj, *maybe_obj, *units_obj;
    if (!PyArg_ParseTuple(args, "O!O!O!:unit_masks", &PyTuple_Type, &known_obj, &PyTuple_Type,
                          &maybe_obj, &PyTuple_Type, &units_obj))
        return NULL;
    Held h = {.held = 0};
    int set = 0;
    Py_ssize_t g = PyTuple_GET_SIZE(units_obj);
    Py_buffer *known[MAX_GROUPS], *maybe[MAX_GROUPS], *units[MAX_GROUPS];
    if (g > MAX_GROUPS || PyTuple_GET_SIZE(known_obj) != g || PyTuple_GET_SIZE(maybe_obj) != g)
        goto done;
    for (Py_ssize_t i = 0; i < g; i++) { /* every check first: nothing written if one fails */
        if (!(known[i] = hold(&h, PyTuple_GET_ITEM(known_obj, i), 1, "?", 1))
            || !(maybe[i] = hold(&h, PyTuple_GET_ITEM(maybe_obj, i), 1, "?", 1))
            || !(units[i] = hold(&h, PyTuple_GET_ITEM(units_obj, i), 0, "lq", 8))
            || maybe[i]->len != known[i]->len)
            goto done;
        const int64_t *unit = units[i]->buf;
        for (Py_ssize_t j = 0; j < units[i]->len / 8; j++)
            if (unit[j] < 0 || unit[j] >= known[i]->len)
                goto done;
    }
    for (Py_ssize_t i = 0; i < g; i++) {
        uint8_t *kn = known[i]->buf, *may = maybe[i]->buf;
        const int64_t *unit = units[i]->buf;
        memset(kn, 1, (size_t)known[i]->len);
        memset(may, 0, (size_t)maybe[i]->len);
        for (Py_ssize_t j = 0; j < units[i]->len / 8; j++) {
            kn[unit[j]] = 0;
            may[unit[j]] = 1;
        }
    }
    set = 1;
done:
    for (int j = 0; j < h.held; j++)
        PyBuffer_Release(&h.views[j]);
    if (PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(set);
}

/* keys_of: the key indices of the units a round probes. */
static PyObject *
keys_of(PyObject *self, PyObject *args)
{
    Py_buffer codes;
    PyObject *found_obj, *units_obj, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*OO:keys_of", &codes, &found_obj, &units_obj))
        return NULL;
    Held h = {.held = 0};
    Py_ssize_t g = codes.len / 24, total = 0;
    const int64_t *spec = codes.buf;
    Py_buffer *found[MAX_GROUPS], *units[MAX_GROUPS];
    if (codes.len % 24 || g < 1 || g > MAX_GROUPS || !PyList_CheckExact(found_obj)
        || !PyTuple_CheckExact(units_obj) || PyList_GET_SIZE(found_obj) < g
        || PyTuple_GET_SIZE(units_obj) != g)
        goto done;
    for (Py_ssize_t i = 0; i < g; i++) {
        if (!(found[i] = hold(&h, PyList_GET_ITEM(found_obj, i), 0, "lq", 8))
            || !(units[i] = hold(&h, PyTuple_GET_ITEM(units_obj, i), 0, "lq", 8)))
            goto done;
        int64_t k = spec[3 * i + 1];
        if (k < 1 || k > MAX_SIZE || spec[3 * i] < 0 || spec[3 * i] > MAX_SIZE
            || found[i]->len / 8 > MAX_SIZE)
            goto done;
        total += found[i]->len / 8 * k;
        if (total > MAX_SIZE)
            goto done;
    }
    if (!total)
        goto done; /* (no key: the Python code says what that round is) */
    PyObject *out = PyBytes_FromStringAndSize(NULL, total * 8);
    if (!out)
        goto done;
    int64_t *keys = (int64_t *)PyBytes_AS_STRING(out), last = -1;
    Py_ssize_t n = 0;
    int ascending = 1;
    for (Py_ssize_t i = 0; i < g; i++) { /* (group-major: ascending, as groups' keys are) */
        int64_t offset = spec[3 * i], k = spec[3 * i + 1];
        const int64_t *want = found[i]->buf, *probed = units[i]->buf;
        Py_ssize_t wanted = found[i]->len / 8, positions = units[i]->len / 8;
        for (Py_ssize_t j = 0; j < wanted; j++) {
            int64_t pos = search_left(probed, positions, want[j]);  /* (numpy's searchsorted) */
            for (int64_t m = 0; m < k; m++) {
                int64_t key = offset + pos * k + m;
                ascending = ascending && key > last;
                keys[n++] = last = key;
            }
        }
    }
    if (!ascending) { /* (not a round of this plan's layout: the Python code sorts it out) */
        Py_DECREF(out);
        goto done;
    }
    result = out;
done:
    for (int j = 0; j < h.held; j++)
        PyBuffer_Release(&h.views[j]);
    PyBuffer_Release(&codes);
    if (PyErr_Occurred()) {
        Py_XDECREF(result);
        return NULL;
    }
    if (!result)
        Py_RETURN_NONE;
    return result;
}

static PyMethodDef methods[] = {
    {"keys_of", keys_of, METH_VARARGS,
     "keys_of(groups, found, units): the key indices (int64 bytes, ascending) of the hash units "
     "`found` per group, each position's k keys; None where the Python code must map them."},
    {"unit_masks", unit_masks, METH_VARARGS,
     "unit_masks(known, maybe, units): per group every hash unit known but the probed ones, "
     "which are maybe present; False when the Python code must set them."},
    {"record", record, METH_VARARGS,
     "record(groups, indices, present, answered, present_at, units, known, maybe[, unit]): a "
     "0.32 / 0.33 round's answers (one per key, or per unit keys) recorded; False when the "
     "Python method must record them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._plan._probing_c",
    "A 0.32 / 0.33 probing round's answers recorded in C (see _probing_c.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__probing_c(void)
{
    return PyModule_Create(&module);
}
