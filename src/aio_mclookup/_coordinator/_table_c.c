/* The key table's per-key entry in C: the compiled twin of table._enter_keys (docs/design.md,
 * "Compiled extensions").
 *
 *   enter_keys(waiting, sending, keys, subs) -> (to_send, fresh, shared)
 *       for each (sub, key) of zip(subs, keys): a key nobody waits for is entered with its
 *       subscriber (fresh); another joins the subscribers already there (an int becomes
 *       [int, sub], a list is appended to: shared). to_send lists the fresh keys and the
 *       joined ones not in sending, in order. waiting is a dict, sending a set (or frozenset).
 *
 *   subscribe(waiting, sending, cached, answering, keys, subs, present, base)
 *       -> (to_send, fresh, shared, hits, just_answered)
 *       the twin of table.subscribe_keys: a key cached (hits) or answering (just_answered)
 *       has that answer written to present[sub - base] (a list, or a 1-D float64 buffer);
 *       the others enter the table as by enter_keys, in one pass. subs is a range or a
 *       sequence of ints.
 *
 *   fan_out(waiting, lookups, keys, values) -> ready
 *       the twin of table.fan_out: one RPC's answers (values[i] for keys[i]) to the
 *       subscribers each key's entry in waiting holds (the entry leaves waiting): a
 *       subscriber's lookup (lookups[sub >> 32], skipped when missing or done) gets the
 *       value at round_present[sub & 0xffffffff] and one less to wait for; ready lists the
 *       lookups whose waiting reaches 0, keys with one subscriber first, then shared keys.
 *
 *   unsent(waiting, sending, abandoned, keys, pos, stop, room, wanted) -> (kept, pos, dropped)
 *       the twin of table.unsent: from keys[pos] on, each key waiting and not sending (an
 *       abandoned one only if wanted(waiting[key]) says so, else it leaves abandoned and
 *       waiting: dropped) is added to sending and kept, up to min(stop - pos, room) keys;
 *       pos is where the reading ended.
 *
 * Inputs as the core makes them: subscribers and base 64-bit ints, answers floats, a lookup's
 * waiting an int (where Python would take other types, these raise TypeError, or overflow).
 * Each reads tuple snapshots of its sequences and holds what it uses: Python code it runs (a
 * subscriber list's append, a lookup's attribute) cannot change what it reads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* One key's entry (enter_keys' loop body): 0, or -1 with an exception set. */
static int
enter_one(PyObject *waiting, PyObject *sending, PyObject *key, PyObject *sub, PyObject *to_send,
          Py_ssize_t *fresh, Py_ssize_t *shared)
{
    PyObject *others = PyDict_GetItemWithError(waiting, key); /* borrowed */
    if (!others || others == Py_None) { /* (waiting.get(key) is None) */
        if (PyErr_Occurred() || PyDict_SetItem(waiting, key, sub) < 0
            || PyList_Append(to_send, key) < 0)
            return -1;
        (*fresh)++;
        return 0;
    }
    if (PyLong_Check(others)) {
        PyObject *pair = PyList_New(2);
        if (!pair)
            return -1;
        Py_INCREF(others);
        Py_INCREF(sub);
        PyList_SET_ITEM(pair, 0, others);
        PyList_SET_ITEM(pair, 1, sub);
        int set = PyDict_SetItem(waiting, key, pair);
        Py_DECREF(pair);
        if (set < 0)
            return -1;
    } else if (PyList_CheckExact(others)) {
        if (PyList_Append(others, sub) < 0)
            return -1;
    } else {
        PyObject *done = PyObject_CallMethod(others, "append", "O", sub);
        if (!done)
            return -1;
        Py_DECREF(done);
    }
    (*shared)++;
    int in_flight = PySet_Contains(sending, key);
    if (in_flight < 0 || (!in_flight && PyList_Append(to_send, key) < 0))
        return -1;
    return 0;
}

static PyObject *
enter_keys(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *waiting, *sending, *keys_obj, *subs_obj;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyDict_Type, &waiting, &sending, &keys_obj, &subs_obj))
        return NULL;
    if (!PyAnySet_Check(sending)) {
        PyErr_SetString(PyExc_TypeError, "sending must be a set");
        return NULL;
    }
    PyObject *keys = PySequence_Tuple(keys_obj); /* (a snapshot: see subscribe) */
    if (!keys)
        return NULL;
    PyObject *subs = PySequence_Tuple(subs_obj);
    if (!subs) {
        Py_DECREF(keys);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (PyTuple_GET_SIZE(subs) < n)
        n = PyTuple_GET_SIZE(subs); /* zip: the shorter */
    PyObject *to_send = PyList_New(0);
    Py_ssize_t fresh = 0, shared = 0;
    if (!to_send)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (enter_one(waiting, sending, PyTuple_GET_ITEM(keys, i),
                      PyTuple_GET_ITEM(subs, i), to_send, &fresh, &shared) < 0)
            goto fail;
    }
    Py_DECREF(keys);
    Py_DECREF(subs);
    PyObject *out = Py_BuildValue("(Nnn)", to_send, fresh, shared);
    return out;
fail:
    Py_DECREF(keys);
    Py_DECREF(subs);
    Py_XDECREF(to_send);
    return NULL;
}


/* present[pos] = until, as Python's item assignment would (a negative pos counts from the
 * end); a float64 buffer is written directly. */
static int
write_present(PyObject *present, Py_buffer *view, Py_ssize_t pos, PyObject *until)
{
    if (PyList_CheckExact(present)) {
        Py_ssize_t size = PyList_GET_SIZE(present);
        if (pos < 0)
            pos += size;
        if (pos < 0 || pos >= size) {
            PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
            return -1;
        }
        Py_INCREF(until);
        PyObject *old = PyList_GET_ITEM(present, pos);
        PyList_SET_ITEM(present, pos, until);
        Py_DECREF(old);
        return 0;
    }
    if (view->buf) {
        Py_ssize_t size = view->shape[0], at = pos < 0 ? pos + size : pos;
        if (at < 0 || at >= size) {
            PyErr_Format(PyExc_IndexError, "index %zd is out of bounds for axis 0 with size %zd",
                         pos, size);
            return -1;
        }
        Py_INCREF(until); /* (its __float__ may run Python code) */
        double value = PyFloat_AsDouble(until);
        Py_DECREF(until);
        if (value == -1.0 && PyErr_Occurred())
            return -1;
        *(double *)((char *)view->buf + at * view->strides[0]) = value;
        return 0;
    }
    PyObject *index = PyLong_FromSsize_t(pos); /* (anything else: its own assignment) */
    if (!index)
        return -1;
    Py_INCREF(until);
    int set = PyObject_SetItem(present, index, until);
    Py_DECREF(until);
    Py_DECREF(index);
    return set;
}

/* A view of present when it is a writable 1-D float64 buffer (else view->buf stays NULL). */
static void
float_view(PyObject *present, Py_buffer *view)
{
    view->buf = NULL;
    if (PyList_CheckExact(present) || !PyObject_CheckBuffer(present))
        return;
    if (PyObject_GetBuffer(present, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_STRIDES) < 0) {
        PyErr_Clear();
        view->buf = NULL;
        return;
    }
    if (view->ndim != 1 || view->itemsize != 8 || !view->format || strcmp(view->format, "d")) {
        PyBuffer_Release(view);
        view->buf = NULL;
    }
}

static PyObject *
subscribe(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *waiting, *sending, *cached, *answering, *keys_obj, *subs_obj, *present;
    long long base;
    if (!PyArg_ParseTuple(args, "O!OO!O!OOOL", &PyDict_Type, &waiting, &sending, &PyDict_Type,
                          &cached, &PyDict_Type, &answering, &keys_obj, &subs_obj, &present,
                          &base))
        return NULL;
    if (!PyAnySet_Check(sending)) {
        PyErr_SetString(PyExc_TypeError, "sending must be a set");
        return NULL;
    }
    /* (tuples: nothing the loop calls can change what it reads) */
    PyObject *keys = PySequence_Tuple(keys_obj);
    if (!keys)
        return NULL;
    PyObject *subs = NULL, *to_send = NULL;
    Py_ssize_t *open = NULL, n_open = 0;
    long long start = 0, step = 0;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    Py_ssize_t fresh = 0, shared = 0, hits = 0, just_answered = 0;
    Py_buffer view;
    view.buf = NULL;
    int viewed = 0;
    if (PyRange_Check(subs_obj)) { /* (the usual subs: base + position) */
        Py_ssize_t count = PyObject_Length(subs_obj);
        PyObject *first = PyObject_GetAttrString(subs_obj, "start");
        PyObject *stride = first ? PyObject_GetAttrString(subs_obj, "step") : NULL;
        if (stride) {
            start = PyLong_AsLongLong(first);
            step = PyLong_AsLongLong(stride);
        }
        Py_XDECREF(first);
        Py_XDECREF(stride);
        if (count < 0 || PyErr_Occurred())
            goto fail;
        if (count < n)
            n = count;
    } else {
        subs = PySequence_Tuple(subs_obj);
        if (!subs)
            goto fail;
        if (PyTuple_GET_SIZE(subs) < n)
            n = PyTuple_GET_SIZE(subs); /* zip: the shorter */
    }
    to_send = PyList_New(0);
    open = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1));
    if (!to_send || !open) {
        if (!open)
            PyErr_NoMemory();
        goto fail;
    }
    /* First the answers the cache and the RPC being fanned out give (an error there leaves the
     * table as it was, as the Python twin does), then the entry of the others. */
    int look_cached = PyDict_GET_SIZE(cached) > 0, look_answering = PyDict_GET_SIZE(answering) > 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        PyObject *until = NULL;
        if (look_cached) {
            until = PyDict_GetItemWithError(cached, key);
            if (until == Py_None)
                until = NULL;
            else if (until)
                hits++;
        }
        if (!until && look_answering && !PyErr_Occurred()) {
            until = PyDict_GetItemWithError(answering, key);
            if (until == Py_None)
                until = NULL;
            else if (until)
                just_answered++;
        }
        if (PyErr_Occurred())
            goto fail;
        if (!until) {
            open[n_open++] = i;
            continue;
        }
        long long sub_value = start + step * (long long)i;
        if (subs) {
            sub_value = PyLong_AsLongLong(PyTuple_GET_ITEM(subs, i));
            if (sub_value == -1 && PyErr_Occurred())
                goto fail;
        }
        if (!viewed) {
            float_view(present, &view);
            viewed = 1;
        }
        if (write_present(present, &view, (Py_ssize_t)(sub_value - base), until) < 0)
            goto fail;
    }
    for (Py_ssize_t j = 0; j < n_open; j++) {
        Py_ssize_t i = open[j];
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        if (subs) {
            if (enter_one(waiting, sending, key, PyTuple_GET_ITEM(subs, i), to_send, &fresh,
                          &shared) < 0)
                goto fail;
        } else {
            PyObject *made = PyLong_FromLongLong(start + step * (long long)i);
            int entered = made ? enter_one(waiting, sending, key, made, to_send, &fresh, &shared)
                               : -1;
            Py_XDECREF(made);
            if (entered < 0)
                goto fail;
        }
    }
    if (view.buf)
        PyBuffer_Release(&view);
    PyMem_Free(open);
    Py_DECREF(keys);
    Py_XDECREF(subs);
    return Py_BuildValue("(Nnnnn)", to_send, fresh, shared, hits, just_answered);
fail:
    if (view.buf)
        PyBuffer_Release(&view);
    PyMem_Free(open);
    Py_DECREF(keys);
    Py_XDECREF(subs);
    Py_XDECREF(to_send);
    return NULL;
}

/* The lookup a run of subscribers belongs to, its attributes read once (fan_out). */
typedef struct {
    int held; /* an ident is held (its lookup, or NULL when it has none) */
    long long ident;
    PyObject *lookup; /* strong; NULL when lookups has none (or it is done) */
    PyObject *present; /* strong */
    Py_buffer view;
    long long waiting;
} Held;

static PyObject *s_done, *s_round_present, *s_waiting;

/* Write the held lookup's waiting back and let it go: 0, or -1 with an exception set. */
static int
let_go(Held *held)
{
    int failed = 0;
    if (held->lookup) {
        PyObject *count = PyLong_FromLongLong(held->waiting);
        failed = !count || PyObject_SetAttr(held->lookup, s_waiting, count) < 0;
        Py_XDECREF(count);
    }
    if (held->view.buf)
        PyBuffer_Release(&held->view);
    held->view.buf = NULL;
    Py_CLEAR(held->lookup);
    Py_CLEAR(held->present);
    held->held = 0;
    return failed ? -1 : 0;
}

/* Hold the lookup of ident (NULL when it is missing or done): 0, or -1. */
static int
hold(Held *held, PyObject *lookups, long long ident)
{
    if (let_go(held) < 0)
        return -1;
    held->held = 1;
    held->ident = ident;
    PyObject *key = PyLong_FromLongLong(ident);
    if (!key)
        return -1;
    PyObject *lookup = PyDict_GetItemWithError(lookups, key); /* borrowed: taken at once */
    Py_DECREF(key);
    if (!lookup)
        return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(lookup);
    PyObject *done = PyObject_GetAttr(lookup, s_done);
    int is_done = done ? PyObject_IsTrue(done) : -1;
    Py_XDECREF(done);
    PyObject *present = is_done ? NULL : PyObject_GetAttr(lookup, s_round_present);
    PyObject *count = present ? PyObject_GetAttr(lookup, s_waiting) : NULL;
    long long waiting = count ? PyLong_AsLongLong(count) : -1;
    Py_XDECREF(count);
    if (is_done || !present || (waiting == -1 && PyErr_Occurred())) {
        Py_DECREF(lookup);
        Py_XDECREF(present);
        return is_done > 0 ? 0 : -1; /* (done: nothing held for it) */
    }
    held->lookup = lookup;
    held->present = present;
    held->waiting = waiting;
    float_view(present, &held->view);
    return 0;
}

/* One subscriber's answer: 0, or -1 with an exception set. */
static int
answer_one(Held *held, PyObject *lookups, PyObject *ready, PyObject *sub, PyObject *value)
{
    long long code = PyLong_AsLongLong(sub);
    if (code == -1 && PyErr_Occurred())
        return -1;
    long long ident = code >> 32;
    if ((!held->held || ident != held->ident) && hold(held, lookups, ident) < 0)
        return -1;
    if (!held->lookup)
        return 0;
    if (write_present(held->present, &held->view, (Py_ssize_t)(code & 0xffffffffLL), value) < 0)
        return -1;
    if (--held->waiting == 0 && PyList_Append(ready, held->lookup) < 0)
        return -1;
    return 0;
}

static PyObject *
fan_out(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *waiting, *lookups, *keys_obj, *values_obj;
    if (!PyArg_ParseTuple(args, "O!O!OO", &PyDict_Type, &waiting, &PyDict_Type, &lookups,
                          &keys_obj, &values_obj))
        return NULL;
    PyObject *keys = PySequence_Tuple(keys_obj); /* (snapshots: attribute reads and item
                                                  * assignments may run Python code) */
    if (!keys)
        return NULL;
    PyObject *values = PySequence_Tuple(values_obj);
    PyObject *ready = NULL, *result = NULL;
    PyObject **shared = NULL; /* pass 2: (subscribers list, value index) */
    Py_ssize_t *shared_at = NULL, n_shared = 0;
    Held held = {0, 0, NULL, NULL, {0}, 0};
    held.view.buf = NULL;
    if (!values)
        goto fail;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (PyTuple_GET_SIZE(values) < n)
        n = PyTuple_GET_SIZE(values); /* zip: the shorter */
    ready = PyList_New(0);
    shared = PyMem_Malloc(sizeof(PyObject *) * (n ? n : 1));
    shared_at = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1));
    if (!ready || !shared || !shared_at) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        PyObject *subscribers = PyDict_GetItemWithError(waiting, key); /* borrowed */
        if (!subscribers) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        Py_INCREF(subscribers);
        if (PyDict_DelItem(waiting, key) < 0) {
            Py_DECREF(subscribers);
            goto fail;
        }
        if (subscribers == Py_None) {
            Py_DECREF(subscribers);
            continue;
        }
        if (PyLong_Check(subscribers)) {
            int answered = answer_one(&held, lookups, ready, subscribers,
                                      PyTuple_GET_ITEM(values, i));
            Py_DECREF(subscribers);
            if (answered < 0)
                goto fail;
            continue;
        }
        shared[n_shared] = subscribers; /* (the reference moves there) */
        shared_at[n_shared++] = i;
    }
    for (Py_ssize_t j = 0; j < n_shared; j++) {
        PyObject *subs = PySequence_Tuple(shared[j]);
        if (!subs)
            goto fail;
        PyObject *value = PyTuple_GET_ITEM(values, shared_at[j]);
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(subs); k++) {
            if (answer_one(&held, lookups, ready, PyTuple_GET_ITEM(subs, k), value) < 0) {
                Py_DECREF(subs);
                goto fail;
            }
        }
        Py_DECREF(subs);
    }
    if (let_go(&held) < 0)
        goto fail;
    result = ready; /* (the reference moves there) */
    ready = NULL;
fail:
    if (held.held) { /* (keep the exception: write back what was counted) */
        PyObject *type, *val, *tb;
        PyErr_Fetch(&type, &val, &tb);
        if (let_go(&held) < 0)
            PyErr_Clear();
        PyErr_Restore(type, val, tb);
    }
    for (Py_ssize_t j = 0; j < n_shared; j++)
        Py_DECREF(shared[j]);
    PyMem_Free(shared);
    PyMem_Free(shared_at);
    Py_DECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(ready);
    return result;
}

static PyObject *
unsent(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *waiting, *sending, *abandoned, *keys_obj, *wanted;
    Py_ssize_t pos, stop, room;
    if (!PyArg_ParseTuple(args, "O!OOOnnnO", &PyDict_Type, &waiting, &sending, &abandoned,
                          &keys_obj, &pos, &stop, &room, &wanted))
        return NULL;
    if (!PySet_Check(sending) || !PySet_Check(abandoned)) {
        PyErr_SetString(PyExc_TypeError, "sending and abandoned must be sets");
        return NULL;
    }
    if (pos < 0) {
        PyErr_SetString(PyExc_ValueError, "pos must be >= 0");
        return NULL;
    }
    /* (a list as it is, no copy: a queued round's share reads a slice of it; its size is read
     * again after each call that may run Python code, and each key held while in use) */
    PyObject *keys = PySequence_Fast(keys_obj, "keys must be a sequence");
    if (!keys)
        return NULL;
    PyObject *kept = PyList_New(0), *key = NULL;
    if (!kept) {
        Py_DECREF(keys);
        return NULL;
    }
    Py_ssize_t want = stop - pos < room ? stop - pos : room, dropped = 0;
    while (pos < PySequence_Fast_GET_SIZE(keys) && PyList_GET_SIZE(kept) < want) {
        key = PySequence_Fast_GET_ITEM(keys, pos);
        Py_INCREF(key);
        pos++;
        int skip = PySet_Contains(sending, key); /* sending, or not waiting: taken already */
        if (skip == 0) {
            int has = PyDict_Contains(waiting, key);
            skip = has < 0 ? -1 : !has;
        }
        if (skip < 0)
            goto fail;
        if (skip) {
            Py_CLEAR(key);
            continue;
        }
        int left = PySet_Discard(abandoned, key);
        if (left < 0)
            goto fail;
        if (left) { /* abandoned: sent only if someone joined it since */
            /* (read after the discard, which may run Python code, as Python does) */
            PyObject *subscribers = PyDict_GetItemWithError(waiting, key);
            if (!subscribers) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, key);
                goto fail;
            }
            Py_INCREF(subscribers);
            PyObject *answer = PyObject_CallOneArg(wanted, subscribers);
            Py_DECREF(subscribers);
            int truth = answer ? PyObject_IsTrue(answer) : -1;
            Py_XDECREF(answer);
            if (truth < 0)
                goto fail;
            if (!truth) {
                if (PyDict_DelItem(waiting, key) < 0)
                    goto fail;
                dropped++;
                Py_CLEAR(key);
                continue;
            }
        }
        if (PySet_Add(sending, key) < 0 || PyList_Append(kept, key) < 0)
            goto fail;
        Py_CLEAR(key);
    }
    Py_DECREF(keys);
    return Py_BuildValue("(Nnn)", kept, pos, dropped);
fail:
    Py_XDECREF(key);
    Py_DECREF(keys);
    Py_DECREF(kept);
    return NULL;
}

static PyMethodDef methods[] = {
    {"enter_keys", enter_keys, METH_VARARGS,
     "enter_keys(waiting, sending, keys, subs): each key joins or enters the table; returns "
     "(to_send, fresh, shared)."},
    {"subscribe", subscribe, METH_VARARGS,
     "subscribe(waiting, sending, cached, answering, keys, subs, present, base): answer the "
     "keys cached or answering, enter the others; returns (to_send, fresh, shared, hits, "
     "just_answered)."},
    {"fan_out", fan_out, METH_VARARGS,
     "fan_out(waiting, lookups, keys, values): one RPC's answers to their subscribers; "
     "returns the lookups whose waiting reached 0."},
    {"unsent", unsent, METH_VARARGS,
     "unsent(waiting, sending, abandoned, keys, pos, stop, room, wanted): a queued round's "
     "keys still to send, now sending; returns (kept, pos, dropped)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._coordinator._table_c",
    "The key table's per-key entry in C (see _table_c.c).", -1, methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__table_c(void)
{
    s_done = PyUnicode_InternFromString("done");
    s_round_present = PyUnicode_InternFromString("round_present");
    s_waiting = PyUnicode_InternFromString("waiting");
    if (!s_done || !s_round_present || !s_waiting)
        return NULL;
    return PyModule_Create(&module);
}
