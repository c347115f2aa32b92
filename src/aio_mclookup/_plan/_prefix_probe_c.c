/* Prefix mode in C: the compiled twin of ProbeState's prefix mode (a lone full-attention group
 * probed in rounds, _plan/probing.py), docs/design.md, "Compiled extensions". ProbeState is the
 * reference; tests/test_plan_prefix_probe.py runs both on the same random rounds and compares
 * every answer.
 *
 *   configure(empty, scout_window, scouts, first_false, per_key, int64_array, resolve_all,
 *             general)
 *       once, from _plan/rounds.py: the Python objects and numbers of probing.py this type
 *       follows (EMPTY, SCOUT_WINDOW, SCOUTS, first_false, per_key: what it hands back for
 *       answers other than lists and tuples), how to make an int64 array of native int64
 *       bytes, ProbeState's answer when every key came in one round, and how to build the
 *       general ProbeState that takes over when answers leave prefix mode.
 *   PrefixProbe(plan)
 *       ProbeState(plan) of a plan probed in prefix mode (plan.single_full_attention, rounds
 *       on, not plan.probe_in_one_round), with the same attributes and methods: hit, rounds,
 *       plan, answered_ahead, known_prefix, all_at_once, result, next_keys, record,
 *       record_present, leading_known.
 *
 * Prefix mode keeps two integers (the known-present prefix and the first chunk known absent),
 * the scouts' present chunks and the last scouted round. Answers that do not start at the
 * prefix leave prefix mode: the state hands over to a general ProbeState built from what it
 * knows (ProbeState._leave_prefix_mode's arrays) and forwards every call to it from then on.
 *
 * Where it parts from ProbeState, on input the coordinator never gives: a float window below
 * the chunks left raises TypeError, as range() does in Python (one at or past them, or NaN,
 * is no bound, as there); a state not initialised (or whose plan was refused) raises
 * RuntimeError, a plan of several groups ValueError; answers whose truth-testing records
 * other answers on the same state raise RuntimeError; a unit past any list's size raises
 * MemoryError at once; answered_ahead is ((), ()) while nothing is handed out.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *EMPTY, *FIRST_FALSE, *INT64_ARRAY, *RESOLVE_ALL, *GENERAL, *PER_KEY;
static PyObject *NONE_AHEAD; /* ((), ()): answered_ahead when nothing is */
static Py_ssize_t SCOUT_WINDOW = -1, SCOUTS;

typedef struct {
    PyObject_HEAD
    PyObject *plan;
    PyObject *general;        /* the ProbeState everything goes to once out of prefix mode */
    PyObject *hit;            /* an int, or NULL while unsettled */
    PyObject *result;         /* result_for_hit(hit), once asked */
    PyObject *scouted;        /* the key indices of the last round that carried scouts */
    PyObject *ahead;          /* [(chunk, answers), ...]: present scouts, ascending (or NULL) */
    PyObject *answered_ahead; /* ([positions], [answers]), or NONE_AHEAD */
    Py_ssize_t prefix, bound, limit, k, offset, num_keys, rounds, scouted_run;
} PrefixProbe;

static Py_ssize_t
floordiv(Py_ssize_t a, Py_ssize_t b)
{
    Py_ssize_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* The int `value` holds (a new reference, released here; NULL: the error it stands for). */
static int
take_ssize(PyObject *value, Py_ssize_t *out)
{
    if (!value)
        return -1;
    *out = PyNumber_AsSsize_t(value, PyExc_OverflowError);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* int(obj.name) */
static int
attr_ssize(PyObject *obj, const char *name, Py_ssize_t *out)
{
    return take_ssize(PyObject_GetAttrString(obj, name), out);
}

/* int(seq[i]) */
static int
index_at(PyObject *seq, Py_ssize_t i, Py_ssize_t *out)
{
    return take_ssize(PySequence_GetItem(seq, i), out);
}

/* first_false(values, stop): *miss = the index of the first falsy value among the first
 * `stop` (-1: none). Lists, tuples and 1-D float64 or bool buffers here; anything else
 * through probing's first_false. */
static int
first_false(PyObject *values, Py_ssize_t stop, Py_ssize_t *miss)
{
    *miss = -1;
    if (PyList_CheckExact(values) || PyTuple_CheckExact(values)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
        if (stop < n)
            n = stop;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PySequence_Fast_GET_ITEM(values, i); /* (a list's may change size:
                                                                   re-read each time) */
            int truth;
            if (PyFloat_CheckExact(v))
                truth = PyFloat_AS_DOUBLE(v) != 0.0;
            else {
                Py_INCREF(v);
                truth = PyObject_IsTrue(v);
                Py_DECREF(v);
                if (truth < 0)
                    return -1;
            }
            if (!truth) {
                *miss = i;
                return 0;
            }
            if (PyList_CheckExact(values) && PyList_GET_SIZE(values) < n)
                n = PyList_GET_SIZE(values);
        }
        return 0;
    }
    Py_buffer view;
    if (PyObject_CheckBuffer(values) &&
        PyObject_GetBuffer(values, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        const char *f = view.format ? view.format : "B";
        if (*f == '=' || *f == '@' || *f == '<')
            f++;
        int floats = !strcmp(f, "d") && view.itemsize == 8, bools = !strcmp(f, "?");
        if (view.ndim == 1 && (floats || bools)) { /* (a wide round's answers, an array) */
            Py_ssize_t n = view.len / view.itemsize;
            if (stop < n)
                n = stop;
            for (Py_ssize_t i = 0; i < n && *miss < 0; i++)
                if (floats ? ((const double *)view.buf)[i] == 0.0 : !((const char *)view.buf)[i])
                    *miss = i;
            PyBuffer_Release(&view);
            return 0;
        }
        PyBuffer_Release(&view);
    }
    PyErr_Clear();
    PyObject *found = stop == PY_SSIZE_T_MAX
        ? PyObject_CallFunctionObjArgs(FIRST_FALSE, values, NULL)
        : PyObject_CallFunction(FIRST_FALSE, "On", values, stop);
    if (!found)
        return -1;
    if (found != Py_None) {
        *miss = PyNumber_AsSsize_t(found, PyExc_OverflowError);
        if (*miss == -1 && PyErr_Occurred()) {
            Py_DECREF(found);
            return -1;
        }
    }
    Py_DECREF(found);
    return 0;
}

static int
set_hit(PrefixProbe *self, Py_ssize_t chunks)
{
    PyObject *hit = PyObject_CallMethod(self->plan, "prefix_hit", "n", chunks);
    if (!hit)
        return -1;
    Py_XSETREF(self->hit, hit);
    return 0;
}

/* The plan's numbers prefix mode reads: its one group's limit and key offset, its key count
 * and its namespaces. -1 with an exception for a plan it cannot probe. */
static int
read_plan(PyObject *plan, Py_ssize_t *limit, Py_ssize_t *offset, Py_ssize_t *num_keys,
          Py_ssize_t *k)
{
    *limit = *offset = 0;
    PyObject *groups = PyObject_GetAttrString(plan, "groups");
    if (!groups)
        return -1;
    Py_ssize_t n_groups = PyObject_Length(groups);
    if (n_groups > 1) {
        PyErr_SetString(PyExc_ValueError, "prefix mode probes a plan of one group");
        n_groups = -1;
    }
    if (n_groups == 1) {
        PyObject *first = PySequence_GetItem(groups, 0);
        if (!first || attr_ssize(first, "limit", limit) < 0 ||
            attr_ssize(first, "key_offset", offset) < 0)
            n_groups = -1;
        Py_XDECREF(first);
    }
    Py_DECREF(groups);
    if (n_groups < 0 || attr_ssize(plan, "num_keys", num_keys) < 0)
        return -1;
    PyObject *geometry = PyObject_GetAttrString(plan, "geometry");
    if (!geometry)
        return -1;
    PyObject *namespaces = PyObject_GetAttrString(geometry, "namespaces");
    Py_DECREF(geometry);
    if (!namespaces)
        return -1;
    *k = PyObject_Length(namespaces);
    Py_DECREF(namespaces);
    if (*k <= 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a plan without namespaces");
        return -1;
    }
    return 0;
}

static int
probe_init(PrefixProbe *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"plan", NULL};
    PyObject *plan;
    if (kwds || PyTuple_GET_SIZE(args) != 1) {
        if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &plan))
            return -1;
    }
    else
        plan = PyTuple_GET_ITEM(args, 0);
    Py_CLEAR(self->plan); /* (unusable until the plan is read: see ready) */
    if (SCOUT_WINDOW < 0) {
        PyErr_SetString(PyExc_RuntimeError, "_prefix_probe_c is not configured");
        return -1;
    }
    Py_ssize_t limit, offset, num_keys, k;
    if (read_plan(plan, &limit, &offset, &num_keys, &k) < 0)
        return -1;
    Py_CLEAR(self->general);
    Py_CLEAR(self->hit);
    Py_CLEAR(self->result);
    Py_CLEAR(self->scouted);
    Py_CLEAR(self->ahead); /* (made when a scout is first found present) */
    Py_INCREF(NONE_AHEAD);
    Py_XSETREF(self->answered_ahead, NONE_AHEAD);
    self->prefix = self->rounds = self->scouted_run = 0;
    self->bound = self->limit = limit;
    self->offset = offset;
    self->num_keys = num_keys;
    self->k = k;
    Py_INCREF(plan);
    self->plan = plan;
    return 0;
}

/* 0 when initialised (a plan read); else -1 with RuntimeError. */
static int
ready(PrefixProbe *self)
{
    if (self->plan && self->answered_ahead && self->k > 0)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "PrefixProbe is not initialised");
    return -1;
}

static int
probe_traverse(PrefixProbe *self, visitproc visit, void *arg)
{
    Py_VISIT(self->plan);
    Py_VISIT(self->general);
    Py_VISIT(self->hit);
    Py_VISIT(self->result);
    Py_VISIT(self->scouted);
    Py_VISIT(self->ahead);
    Py_VISIT(self->answered_ahead);
    return 0;
}

static int
probe_clear(PrefixProbe *self)
{
    Py_CLEAR(self->plan);
    Py_CLEAR(self->general);
    Py_CLEAR(self->hit);
    Py_CLEAR(self->result);
    Py_CLEAR(self->scouted);
    Py_CLEAR(self->ahead);
    Py_CLEAR(self->answered_ahead);
    return 0;
}

static void
probe_dealloc(PrefixProbe *self)
{
    PyObject_GC_UnTrack(self);
    probe_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ProbeState._take_ahead */
static int
take_ahead(PrefixProbe *self, Py_ssize_t start, Py_ssize_t stop)
{
    PyObject *positions = PyList_New(0), *answers = PyList_New(0), *later = PyList_New(0);
    if (!positions || !answers || !later)
        goto fail;
    Py_ssize_t n = PyList_GET_SIZE(self->ahead);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(self->ahead, i);
        Py_ssize_t chunk = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0));
        if (chunk == -1 && PyErr_Occurred())
            goto fail;
        if (chunk >= stop) {
            if (PyList_Append(later, entry) < 0)
                goto fail;
        }
        else if (chunk >= start) {
            Py_ssize_t first = (chunk - start) * self->k;
            for (Py_ssize_t j = 0; j < self->k; j++) {
                PyObject *pos = PyLong_FromSsize_t(first + j);
                if (!pos || PyList_Append(positions, pos) < 0) {
                    Py_XDECREF(pos);
                    goto fail;
                }
                Py_DECREF(pos);
            }
            Py_ssize_t at = PyList_GET_SIZE(answers);
            if (PyList_SetSlice(answers, at, at, PyTuple_GET_ITEM(entry, 1)) < 0)
                goto fail;
        }
    }
    Py_SETREF(self->ahead, later);
    PyObject *pair = PyTuple_Pack(2, positions, answers);
    Py_DECREF(positions);
    Py_DECREF(answers);
    if (!pair)
        return -1;
    Py_SETREF(self->answered_ahead, pair);
    return 0;
fail:
    Py_XDECREF(positions);
    Py_XDECREF(answers);
    Py_XDECREF(later);
    return -1;
}

static PyObject *
key_range(Py_ssize_t start, Py_ssize_t stop)
{
    return PyObject_CallFunction((PyObject *)&PyRange_Type, "nn", start, stop);
}

/* ProbeState._next_prefix_keys */
static PyObject *
next_prefix_keys(PrefixProbe *self, PyObject *window_obj)
{
    Py_ssize_t start = self->prefix, bound = self->bound, k = self->k, offset = self->offset;
    if (start >= bound) {
        if (set_hit(self, start) < 0)
            return NULL;
        Py_INCREF(EMPTY);
        return EMPTY;
    }
    Py_ssize_t window = 0, stop = bound;
    int windowed = window_obj != Py_None;
    if (windowed) {
        if (PyFloat_Check(window_obj)) { /* (Python's min() takes one past the bound, or NaN) */
            if (PyFloat_AS_DOUBLE(window_obj) < (double)(bound - start)) {
                PyErr_SetString(PyExc_TypeError,
                                "'float' object cannot be interpreted as an integer");
                return NULL;
            }
            window = PY_SSIZE_T_MAX;
        }
        else { /* (clamped: any window past the bound is the bound) */
            window = PyNumber_AsSsize_t(window_obj, NULL);
            if (window == -1 && PyErr_Occurred())
                return NULL;
        }
        if (window < bound - start) /* (start >= 0: no overflow) */
            stop = start + window;
    }
    /* (a window below 1 hands out no key: an empty range, whatever its ends) */
    PyObject *chunks = key_range(offset + start * k, offset + (stop > start ? stop : start) * k);
    if (!chunks)
        return NULL;
    if (self->ahead && PyList_GET_SIZE(self->ahead) && take_ahead(self, start, stop) < 0)
        goto fail;
    if (!windowed || window < SCOUT_WINDOW || stop >= bound)
        return chunks;
    Py_ssize_t quarter = window / 2; /* of the next window, twice as wide */
    Py_ssize_t end = stop + SCOUTS * quarter;
    if (end > bound)
        end = bound;
    /* the window's keys, then each scout's (as int64 bytes, made an array by INT64_ARRAY) */
    Py_ssize_t run = (stop - start) * k, scouts = (end - (stop + quarter - 1) + quarter - 1) / quarter;
    PyObject *raw = PyBytes_FromStringAndSize(NULL, (run + (scouts > 0 ? scouts : 0) * k) * 8);
    if (!raw)
        goto fail;
    int64_t *out = (int64_t *)PyBytes_AS_STRING(raw);
    Py_ssize_t n_keys = 0;
    for (Py_ssize_t key = offset + start * k; key < offset + stop * k; key++)
        out[n_keys++] = key;
    for (Py_ssize_t chunk = stop + quarter - 1; chunk < end; chunk += quarter) {
        int known = 0;
        Py_ssize_t n = self->ahead ? PyList_GET_SIZE(self->ahead) : 0;
        for (Py_ssize_t i = 0; i < n && !known; i++) {
            Py_ssize_t c = PyLong_AsSsize_t(PyTuple_GET_ITEM(PyList_GET_ITEM(self->ahead, i), 0));
            known = c == chunk;
        }
        if (known)
            continue;
        for (Py_ssize_t key = offset + chunk * k; key < offset + (chunk + 1) * k; key++)
            out[n_keys++] = key;
    }
    if (_PyBytes_Resize(&raw, n_keys * 8) < 0)
        goto fail;
    PyObject *scouted = PyObject_CallFunctionObjArgs(INT64_ARRAY, raw, NULL);
    Py_DECREF(raw);
    if (!scouted)
        goto fail;
    self->scouted_run = run;
    Py_DECREF(chunks);
    Py_INCREF(scouted);
    Py_XSETREF(self->scouted, scouted);
    return scouted;
fail:
    Py_DECREF(chunks);
    return NULL;
}

static PyObject *
probe_next_keys(PrefixProbe *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"window", "ahead", NULL};
    PyObject *window = Py_None, *ahead = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO", kwlist, &window, &ahead) || ready(self) < 0)
        return NULL;
    if (self->general)
        return PyObject_CallMethod(self->general, "next_keys", "OO", window, ahead);
    if (self->answered_ahead != NONE_AHEAD) {
        Py_INCREF(NONE_AHEAD);
        Py_SETREF(self->answered_ahead, NONE_AHEAD);
    }
    if (self->hit) {
        Py_INCREF(EMPTY);
        return EMPTY;
    }
    if (!self->num_keys) { /* vLLM answers 0 without an RPC */
        Py_XSETREF(self->hit, PyLong_FromLong(0));
        if (!self->hit)
            return NULL;
        Py_INCREF(EMPTY);
        return EMPTY;
    }
    self->rounds += 1;
    return next_prefix_keys(self, window);
}

/* Insert (chunk, values) after every entry of a chunk no greater: the ascending order, ties in
 * arrival order (ProbeState sorts its list by chunk, stably). */
static int
insert_ahead(PyObject *ahead, Py_ssize_t chunk, PyObject *values)
{
    Py_ssize_t at = PyList_GET_SIZE(ahead);
    while (at > 0) {
        Py_ssize_t c = PyLong_AsSsize_t(PyTuple_GET_ITEM(PyList_GET_ITEM(ahead, at - 1), 0));
        if (c <= chunk)
            break;
        at--;
    }
    PyObject *key = PyLong_FromSsize_t(chunk);
    if (!key)
        return -1;
    PyObject *entry = PyTuple_Pack(2, key, values);
    Py_DECREF(key);
    if (!entry)
        return -1;
    int failed = PyList_Insert(ahead, at, entry);
    Py_DECREF(entry);
    return failed;
}

/* ProbeState._note_scouts, on key_indices[filled:] and present[filled:] */
static int
note_scouts(PrefixProbe *self, PyObject *key_indices, PyObject *present, Py_ssize_t filled)
{
    Py_ssize_t k = self->k, offset = self->offset, miss;
    PyObject *tail = PySequence_GetSlice(present, filled, PY_SSIZE_T_MAX); /* (present[filled:]) */
    if (!tail)
        return -1;
    if (first_false(tail, PY_SSIZE_T_MAX, &miss) < 0)
        goto fail;
    Py_ssize_t size = PyObject_Length(tail);
    if (size < 0)
        goto fail;
    Py_ssize_t end = miss < 0 ? size : miss - miss % k; /* (whole chunks before it) */
    if (end) {
        PyObject *answers;
        if (PyList_CheckExact(tail) || PyTuple_CheckExact(tail) ||
            !PyObject_HasAttrString(tail, "tolist"))
            answers = PySequence_List(tail);
        else
            answers = PyObject_CallMethod(tail, "tolist", NULL);
        if (!answers)
            goto fail;
        for (Py_ssize_t at = 0; at < end; at += k) {
            Py_ssize_t index;
            PyObject *values = PyList_GetSlice(answers, at, at + k);
            /* (read self->ahead after index_at, which may run Python code that leaves prefix
             * mode: ProbeState then appends to the fresh list it leaves behind) */
            if (!values || index_at(key_indices, filled + at, &index) < 0 ||
                (!self->ahead && !(self->ahead = PyList_New(0))) ||
                insert_ahead(self->ahead, floordiv(index - offset, k), values) < 0) {
                Py_XDECREF(values);
                Py_DECREF(answers);
                goto fail;
            }
            Py_DECREF(values);
        }
        Py_DECREF(answers);
    }
    if (miss >= 0) {
        Py_ssize_t index;
        if (index_at(key_indices, filled + miss, &index) < 0)
            goto fail;
        Py_ssize_t chunk = floordiv(index - offset, k);
        if (chunk < self->bound)
            self->bound = chunk;
    }
    Py_DECREF(tail);
    return 0;
fail:
    Py_DECREF(tail);
    return -1;
}

/* ProbeState._contiguous_run */
static int
contiguous_run(PyObject *indices, Py_ssize_t count, Py_ssize_t *run)
{
    *run = count;
    if (PyRange_Check(indices))
        return 0;
    Py_ssize_t first, last;
    if (index_at(indices, 0, &first) < 0 || index_at(indices, count - 1, &last) < 0)
        return -1;
    if (last - first == count - 1)
        return 0;
    Py_ssize_t previous = first;
    for (Py_ssize_t i = 1; i < count; i++) {
        Py_ssize_t value;
        if (index_at(indices, i, &value) < 0)
            return -1;
        if (value - previous != 1) {
            *run = i;
            return 0;
        }
        previous = value;
    }
    return 0;
}

/* Out of prefix mode: a general ProbeState from what is known takes over. */
static int
leave_prefix_mode(PrefixProbe *self)
{
    PyObject *chunks = PyList_New(0);
    if (!chunks)
        return -1;
    for (Py_ssize_t i = 0; self->ahead && i < PyList_GET_SIZE(self->ahead); i++)
        if (PyList_Append(chunks, PyTuple_GET_ITEM(PyList_GET_ITEM(self->ahead, i), 0)) < 0) {
            Py_DECREF(chunks);
            return -1;
        }
    PyObject *general = PyObject_CallFunction(GENERAL, "OnnnOO", self->plan, self->rounds,
                                              self->prefix, self->bound, chunks,
                                              self->answered_ahead);
    Py_DECREF(chunks);
    if (!general)
        return -1;
    Py_XSETREF(self->general, general);
    Py_CLEAR(self->scouted);
    Py_CLEAR(self->ahead);
    return 0;
}

/* Answers whose truth-testing records other answers on this state out of order (so that it
 * left prefix mode meanwhile): an error here, where ProbeState goes on in ways of its own. */
static int
left_meanwhile(PrefixProbe *self)
{
    if (!self->general)
        return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "answers recorded on this probe state while its answers were read");
    return -1;
}

static PyObject *
record(PrefixProbe *self, PyObject *key_indices, PyObject *present)
{
    Py_ssize_t count = PyObject_Length(key_indices), k = self->k, miss;
    if (count < 0)
        return NULL;
    if (self->hit)
        Py_RETURN_NONE;
    if (self->rounds == 1 && count == self->num_keys) { /* every key at once */
        PyObject *hit = PyObject_CallFunctionObjArgs(RESOLVE_ALL, self->plan, present, NULL);
        if (!hit)
            return NULL;
        if (left_meanwhile(self) < 0) {
            Py_DECREF(hit);
            return NULL;
        }
        Py_XSETREF(self->hit, hit);
        /* (a repeated hash may count more: vLLM's hit does) */
        if (first_false(present, PY_SSIZE_T_MAX, &miss) < 0 || left_meanwhile(self) < 0)
            return NULL;
        self->prefix = (miss < 0 ? count : miss) / k;
        Py_RETURN_NONE;
    }
    if (!count)
        Py_RETURN_NONE;
    Py_ssize_t first;
    if (index_at(key_indices, 0, &first) < 0)
        return NULL;
    if (first - self->offset == self->prefix * k) {
        Py_ssize_t filled;
        if (key_indices == self->scouted) /* our own window and scouts */
            filled = self->scouted_run;
        else if (contiguous_run(key_indices, count, &filled) < 0)
            return NULL;
        if (first_false(present, filled, &miss) < 0 || left_meanwhile(self) < 0)
            return NULL;
        if (miss >= 0) {
            self->prefix += floordiv(miss, k);
            if (set_hit(self, self->prefix) < 0)
                return NULL;
            Py_RETURN_NONE;
        }
        self->prefix += floordiv(filled, k);
        if (filled < count && note_scouts(self, key_indices, present, filled) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    if (leave_prefix_mode(self) < 0)
        return NULL;
    return PyObject_CallMethod(self->general, "record", "OO", key_indices, present);
}

/* probing.per_key: one answer per `unit` keys as one per key (a list; NULL: not a list or
 * tuple, the Python function expands it). */
static PyObject *
per_key(PyObject *present, Py_ssize_t unit)
{
    if (!PyList_CheckExact(present) && !PyTuple_CheckExact(present))
        return PyObject_CallFunction(PER_KEY, "On", present, unit);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(present);
    if (n && unit > PY_SSIZE_T_MAX / n)
        return PyErr_NoMemory();
    PyObject *out = PyList_New(n * unit);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PySequence_Fast_GET_ITEM(present, i);
        for (Py_ssize_t j = 0; j < unit; j++) {
            Py_INCREF(value);
            PyList_SET_ITEM(out, i * unit + j, value);
        }
    }
    return out;
}

static PyObject *
probe_record(PrefixProbe *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"key_indices", "present", "unit", NULL};
    PyObject *key_indices, *present;
    Py_ssize_t unit = 1;
    if (kwds || PyTuple_GET_SIZE(args) < 2 || PyTuple_GET_SIZE(args) > 3) {
        if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|n", kwlist, &key_indices, &present,
                                         &unit))
            return NULL;
    }
    else {
        key_indices = PyTuple_GET_ITEM(args, 0);
        present = PyTuple_GET_ITEM(args, 1);
        if (PyTuple_GET_SIZE(args) == 3) {
            unit = PyNumber_AsSsize_t(PyTuple_GET_ITEM(args, 2), PyExc_OverflowError);
            if (unit == -1 && PyErr_Occurred())
                return NULL;
        }
    }
    if (ready(self) < 0)
        return NULL;
    if (self->general)
        return PyObject_CallMethod(self->general, "record", "OOn", key_indices, present, unit);
    if (unit <= 1)
        return record(self, key_indices, present);
    PyObject *keyed = per_key(present, unit);
    if (!keyed)
        return NULL;
    PyObject *done = record(self, key_indices, keyed);
    Py_DECREF(keyed);
    return done;
}

static PyObject *
probe_record_present(PrefixProbe *self, PyObject *key_indices)
{
    if (ready(self) < 0)
        return NULL;
    if (self->general)
        return PyObject_CallMethod(self->general, "record_present", "O", key_indices);
    Py_ssize_t count = PyObject_Length(key_indices), start;
    if (count < 0)
        return NULL;
    int at_prefix = 0;
    if (!self->hit && count && !(self->rounds == 1 && count == self->num_keys)) {
        if (attr_ssize(key_indices, "start", &start) < 0) /* (read only here, as Python does) */
            return NULL;
        at_prefix = start - self->offset == self->prefix * self->k;
    }
    if (at_prefix) {
        self->prefix += floordiv(count, self->k); /* what record() does, without the scan */
        Py_RETURN_NONE;
    }
    PyObject *present = PyList_New(count);
    if (!present)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_INCREF(Py_True);
        PyList_SET_ITEM(present, i, Py_True);
    }
    PyObject *done = record(self, key_indices, present);
    Py_DECREF(present);
    return done;
}

static PyObject *
probe_leading_known(PrefixProbe *self, PyObject *group)
{
    if (ready(self) < 0)
        return NULL;
    if (self->general)
        return PyObject_CallMethod(self->general, "leading_known", "O", group);
    return Py_BuildValue("nO", self->prefix, self->prefix < self->limit ? Py_True : Py_False);
}

/* The attributes read alike: each the general state's once out of prefix mode. */
enum { HIT, ROUNDS, KNOWN_PREFIX, ALL_AT_ONCE, ANSWERED_AHEAD, RESULT };
static const char *const attribute_names[] = {
    "hit", "rounds", "known_prefix", "all_at_once", "answered_ahead", "result",
};

/* result_for_hit(hit), asked once */
static PyObject *
result_of(PrefixProbe *self)
{
    if (!self->hit)
        Py_RETURN_NONE;
    if (!self->result) {
        PyObject *result = PyObject_CallMethod(self->plan, "result_for_hit", "O", self->hit);
        if (!result)
            return NULL;
        if (self->result) /* (result_for_hit asked for it meanwhile: the first one stays) */
            Py_DECREF(result);
        else
            self->result = result;
    }
    Py_INCREF(self->result);
    return self->result;
}

static PyObject *
probe_get(PrefixProbe *self, void *closure)
{
    int which = (int)(intptr_t)closure;
    if (ready(self) < 0)
        return NULL;
    if (self->general)
        return PyObject_GetAttrString(self->general, attribute_names[which]);
    PyObject *value;
    switch (which) {
    case HIT:
        value = self->hit ? self->hit : Py_None;
        break;
    case ROUNDS:
        return PyLong_FromSsize_t(self->rounds);
    case KNOWN_PREFIX:
        return PyLong_FromSsize_t(self->prefix);
    case ALL_AT_ONCE:
        value = Py_False;
        break;
    case ANSWERED_AHEAD:
        value = self->answered_ahead;
        break;
    default:
        return result_of(self);
    }
    Py_INCREF(value);
    return value;
}

static PyObject *
probe_get_plan(PrefixProbe *self, void *closure)
{
    PyObject *plan = self->plan ? self->plan : Py_None;
    Py_INCREF(plan);
    return plan;
}

static PyGetSetDef probe_getset[] = {
    {"hit", (getter)probe_get, NULL, "The hit, once settled; else None.", (void *)HIT},
    {"rounds", (getter)probe_get, NULL, "Rounds handed out so far.", (void *)ROUNDS},
    {"known_prefix", (getter)probe_get, NULL,
     "Chunks from the first known present (None once out of prefix mode).",
     (void *)KNOWN_PREFIX},
    {"all_at_once", (getter)probe_get, NULL, "False: rounds.", (void *)ALL_AT_ONCE},
    {"answered_ahead", (getter)probe_get, NULL,
     "Positions of the last next_keys known present already, and their answers.",
     (void *)ANSWERED_AHEAD},
    {"result", (getter)probe_get, NULL, "The lookup result once settled; else None.",
     (void *)RESULT},
    {"plan", (getter)probe_get_plan, NULL, "The plan probed.", NULL},
    {NULL},
};

static PyMethodDef probe_methods[] = {
    {"next_keys", (PyCFunction)(void (*)(void))probe_next_keys, METH_VARARGS | METH_KEYWORDS,
     "next_keys(window=None, ahead=None): key indices to probe next (ProbeState.next_keys)."},
    {"record", (PyCFunction)(void (*)(void))probe_record, METH_VARARGS | METH_KEYWORDS,
     "record(key_indices, present): record a round's answers (ProbeState.record)."},
    {"record_present", (PyCFunction)probe_record_present, METH_O,
     "record_present(key_indices): a run of keys known present (ProbeState.record_present)."},
    {"leading_known", (PyCFunction)probe_leading_known, METH_O,
     "leading_known(group): (chunks known present from the first, next known absent)."},
    {NULL},
};

static PyTypeObject PrefixProbeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aio_mclookup._plan._prefix_probe_c.PrefixProbe",
    .tp_doc = "ProbeState's prefix mode in C (see _prefix_probe_c.c).",
    .tp_basicsize = sizeof(PrefixProbe),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)probe_init,
    .tp_dealloc = (destructor)probe_dealloc,
    .tp_traverse = (traverseproc)probe_traverse,
    .tp_clear = (inquiry)probe_clear,
    .tp_methods = probe_methods,
    .tp_getset = probe_getset,
};

static PyObject *
configure(PyObject *module, PyObject *args)
{
    PyObject *empty, *first_false_fn, *per_key_fn, *int64_array, *resolve_all, *general;
    Py_ssize_t window, scouts;
    if (!PyArg_ParseTuple(args, "OnnOOOOO", &empty, &window, &scouts, &first_false_fn,
                          &per_key_fn, &int64_array, &resolve_all, &general))
        return NULL;
    if (window < 2 || scouts < 1) {
        PyErr_SetString(PyExc_ValueError, "scout_window must be 2 or more, scouts 1 or more");
        return NULL;
    }
    Py_INCREF(empty);
    Py_XSETREF(EMPTY, empty);
    Py_INCREF(first_false_fn);
    Py_XSETREF(FIRST_FALSE, first_false_fn);
    Py_INCREF(per_key_fn);
    Py_XSETREF(PER_KEY, per_key_fn);
    Py_INCREF(int64_array);
    Py_XSETREF(INT64_ARRAY, int64_array);
    Py_INCREF(resolve_all);
    Py_XSETREF(RESOLVE_ALL, resolve_all);
    Py_INCREF(general);
    Py_XSETREF(GENERAL, general);
    if (!NONE_AHEAD && !(NONE_AHEAD = Py_BuildValue("(()())")))
        return NULL;
    SCOUT_WINDOW = window;
    SCOUTS = scouts;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(empty, scout_window, scouts, first_false, per_key, int64_array, resolve_all, "
     "general): "
     "what probing.py decides, once (see _prefix_probe_c.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._plan._prefix_probe_c",
    "ProbeState's prefix mode in C (see _prefix_probe_c.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__prefix_probe_c(void)
{
    if (PyType_Ready(&PrefixProbeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&PrefixProbeType);
    if (PyModule_AddObject(m, "PrefixProbe", (PyObject *)&PrefixProbeType) < 0) {
        Py_DECREF(&PrefixProbeType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
