/* The key table's per-key entry in C: the compiled twin of table._enter_keys (docs/design.md,
 * "Compiled extensions").
 *
 *   enter_keys(waiting, sending, keys, subs) -> (to_send, fresh, shared)
 *       for each (sub, key) of zip(subs, keys): a key nobody waits for is entered with its
 *       subscriber (fresh); another joins the subscribers already there (an int becomes
 *       [int, sub], a list is appended to: shared). to_send lists the fresh keys and the
 *       joined ones not in sending, in order. waiting is a dict, sending a set (or frozenset).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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
    PyObject *keys = PySequence_Fast(keys_obj, "keys must be a sequence");
    if (!keys)
        return NULL;
    PyObject *subs = PySequence_Fast(subs_obj, "subs must be a sequence");
    if (!subs) {
        Py_DECREF(keys);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (PySequence_Fast_GET_SIZE(subs) < n)
        n = PySequence_Fast_GET_SIZE(subs); /* zip: the shorter */
    PyObject *to_send = PyList_New(0);
    Py_ssize_t fresh = 0, shared = 0;
    if (!to_send)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *sub = PySequence_Fast_GET_ITEM(subs, i);
        PyObject *others = PyDict_GetItemWithError(waiting, key); /* borrowed */
        if (!others || others == Py_None) { /* (waiting.get(key) is None) */
            if (PyErr_Occurred() || PyDict_SetItem(waiting, key, sub) < 0
                || PyList_Append(to_send, key) < 0)
                goto fail;
            fresh++;
            continue;
        }
        if (PyLong_Check(others)) {
            PyObject *pair = PyList_New(2);
            if (!pair)
                goto fail;
            Py_INCREF(others);
            Py_INCREF(sub);
            PyList_SET_ITEM(pair, 0, others);
            PyList_SET_ITEM(pair, 1, sub);
            int set = PyDict_SetItem(waiting, key, pair);
            Py_DECREF(pair);
            if (set < 0)
                goto fail;
        } else if (PyList_CheckExact(others)) {
            if (PyList_Append(others, sub) < 0)
                goto fail;
        } else {
            PyObject *done = PyObject_CallMethod(others, "append", "O", sub);
            if (!done)
                goto fail;
            Py_DECREF(done);
        }
        shared++;
        int in_flight = PySet_Contains(sending, key);
        if (in_flight < 0 || (!in_flight && PyList_Append(to_send, key) < 0))
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

static PyMethodDef methods[] = {
    {"enter_keys", enter_keys, METH_VARARGS,
     "enter_keys(waiting, sending, keys, subs): each key joins or enters the table; returns "
     "(to_send, fresh, shared)."},
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
    return PyModule_Create(&module);
}
