/* A native thread that runs native jobs (../_native_job.h) off the event loop and never takes
 * the GIL (docs/design.md, "Preparing plans off the loop"). A Python worker thread would not
 * do: it needs the GIL to pick up each job and to hand it back, and the event loop, busy,
 * gives the GIL up only every switch interval.
 *
 *   NativeWorker()              a thread and a pipe (OSError when either cannot be had)
 *     .submit(job, token[, wake])  queue a job (a capsule a maker's *_job function
 *                               returned); the worker holds it until it is collected. With
 *                               wake false the thread is not woken for it (see .wake)
 *     .wake()                   wake the thread for the jobs queued (waking a waiting thread
 *                               costs about 10 us on a 2-vCPU VM: a caller queueing many jobs
 *                               at once wakes it once)
 *     .fileno()                 readable when jobs are done
 *     .collect() -> [token]     the jobs done since, in any order (each job's maker reads its
 *                               result from the job)
 *     .close() -> [token]       stop the thread (after its current job, which the caller
 *                               waits for); the tokens of the jobs not collected
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../_native_job.h"

typedef struct Entry {
    struct Entry *next;
    PyObject *capsule, *token;
    NativeJob *job;
} Entry;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    Entry *todo_head, *todo_tail; /* submitted, not yet taken by the thread */
    Entry *done;                  /* run, not yet collected */
    int read_fd, write_fd;
    int stopping, started;
    int joining; /* a caller is joining the thread (others wait for it) */
} Worker;

static void *
run(void *arg)
{
    Worker *w = arg;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->todo_head && !w->stopping)
            pthread_cond_wait(&w->wake, &w->lock);
        if (w->stopping)
            break;
        Entry *entry = w->todo_head;
        w->todo_head = entry->next;
        if (!w->todo_head)
            w->todo_tail = NULL;
        pthread_mutex_unlock(&w->lock);
        entry->job->run(entry->job);
        __atomic_store_n(&entry->job->ran, 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&w->lock);
        entry->next = w->done;
        w->done = entry;
        if (!entry->next) {
            /* The first job done since the last collect wakes the loop; collect drains the
             * pipe before it takes the list, so a job that finds the list non-empty is taken
             * with the jobs before it. (Written outside the lock: submit waits for none.) */
            pthread_mutex_unlock(&w->lock);
            char byte = 1;
            ssize_t ignored = write(w->write_fd, &byte, 1); /* full: a wake is pending */
            (void)ignored;
            pthread_mutex_lock(&w->lock);
        }
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

static void
release(Entry *entry)
{
    Py_XDECREF(entry->capsule);
    Py_XDECREF(entry->token);
    PyMem_Free(entry);
}

static void
close_fds(Worker *w)
{
    for (int *fd = &w->read_fd; fd <= &w->write_fd; fd++)
        if (*fd >= 0) {
            close(*fd);
            *fd = -1;
        }
}

static PyObject *
worker_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "NativeWorker() takes no arguments");
        return NULL;
    }
    Worker *w = (Worker *)type->tp_alloc(type, 0);
    if (!w)
        return NULL;
    w->read_fd = w->write_fd = -1;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->wake, NULL);
    int fds[2];
    if (pipe(fds) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(w);
        return NULL;
    }
    w->read_fd = fds[0];
    w->write_fd = fds[1];
    for (int i = 0; i < 2; i++) {
        fcntl(fds[i], F_SETFL, fcntl(fds[i], F_GETFL) | O_NONBLOCK);
        fcntl(fds[i], F_SETFD, FD_CLOEXEC);
    }
    int err = pthread_create(&w->thread, NULL, run, w);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(w);
        return NULL;
    }
    w->started = 1;
    return (PyObject *)w;
}

/* Stop and join the thread; returns the entries never collected (run or not: the caller
 * releases them). */
static Entry *
stop(Worker *w)
{
    Entry *left = NULL;
    if (w->joining) { /* another thread is stopping it: wait for that, take nothing */
        while (w->started) {
            Py_BEGIN_ALLOW_THREADS
            usleep(1000);
            Py_END_ALLOW_THREADS
        }
        return NULL;
    }
    if (w->started) {
        w->joining = 1; /* (with the GIL: the join below lets other threads in) */
        pthread_mutex_lock(&w->lock);
        w->stopping = 1;
        pthread_cond_signal(&w->wake);
        pthread_mutex_unlock(&w->lock);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(w->thread, NULL);
        Py_END_ALLOW_THREADS
        w->started = 0;
        left = w->todo_head;
        w->todo_head = w->todo_tail = NULL;
        Entry *entry = w->done; /* run but not collected: their callers wait too */
        while (entry) {
            Entry *next = entry->next;
            entry->next = left;
            left = entry;
            entry = next;
        }
        w->done = NULL;
    }
    return left;
}

static PyObject *
worker_submit(Worker *w, PyObject *args)
{
    PyObject *capsule, *token;
    int wake = 1;
    if (!PyArg_ParseTuple(args, "OO|p", &capsule, &token, &wake))
        return NULL;
    NativeJob *job = PyCapsule_GetPointer(capsule, NATIVE_JOB_CAPSULE);
    if (!job)
        return NULL; /* (ValueError: not a native job) */
    if (job->submitted) {
        PyErr_SetString(PyExc_ValueError, "this native job was already submitted");
        return NULL;
    }
    if (!w->started || w->joining) {
        PyErr_SetString(PyExc_RuntimeError, "the native worker is closed");
        return NULL;
    }
    Entry *entry = PyMem_Calloc(1, sizeof(Entry));
    if (!entry)
        return PyErr_NoMemory();
    job->submitted = 1;
    Py_INCREF(capsule);
    Py_INCREF(token);
    entry->capsule = capsule;
    entry->token = token;
    entry->job = job;
    pthread_mutex_lock(&w->lock);
    if (w->todo_tail)
        w->todo_tail->next = entry;
    else
        w->todo_head = entry;
    w->todo_tail = entry;
    if (wake)
        pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    Py_RETURN_NONE;
}

static PyObject *
worker_wake(Worker *w, PyObject *Py_UNUSED(unused))
{
    pthread_mutex_lock(&w->lock);
    if (w->todo_head)
        pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    Py_RETURN_NONE;
}

static PyObject *
worker_fileno(Worker *w, PyObject *Py_UNUSED(unused))
{
    return PyLong_FromLong(w->read_fd);
}

static PyObject *
worker_collect(Worker *w, PyObject *Py_UNUSED(unused))
{
    char drain[256];
    while (w->read_fd >= 0 && read(w->read_fd, drain, sizeof drain) > 0)
        ;
    pthread_mutex_lock(&w->lock);
    Entry *entries = w->done;
    w->done = NULL;
    pthread_mutex_unlock(&w->lock);
    Py_ssize_t n = 0;
    for (Entry *e = entries; e; e = e->next)
        n++;
    PyObject *out = PyList_New(n);
    if (!out) { /* (no memory) the entries go back, to be collected at the next wake */
        if (entries) {
            Entry *last = entries;
            while (last->next)
                last = last->next;
            pthread_mutex_lock(&w->lock);
            last->next = w->done;
            w->done = entries;
            pthread_mutex_unlock(&w->lock);
            char byte = 1;
            ssize_t ignored = write(w->write_fd, &byte, 1);
            (void)ignored;
        }
        return NULL;
    }
    for (Py_ssize_t i = 0; entries; i++) {
        Entry *next = entries->next;
        Py_INCREF(entries->token);
        PyList_SET_ITEM(out, i, entries->token);
        release(entries);
        entries = next;
    }
    return out;
}

static PyObject *
worker_close(Worker *w, PyObject *Py_UNUSED(unused))
{
    Entry *entry = stop(w);
    PyObject *out = PyList_New(0);
    while (entry) {
        Entry *next = entry->next;
        if (out && PyList_Append(out, entry->token) < 0)
            Py_CLEAR(out);
        release(entry);
        entry = next;
    }
    close_fds(w);
    return out;
}

static void
worker_dealloc(Worker *w)
{
    Entry *entry = stop(w);
    while (entry) {
        Entry *next = entry->next;
        release(entry);
        entry = next;
    }
    close_fds(w);
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->wake);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef worker_methods[] = {
    {"submit", (PyCFunction)worker_submit, METH_VARARGS,
     "submit(job, token, wake=True): run a native job (a capsule) on the thread; with wake "
     "false, once the thread is woken (wake())."},
    {"wake", (PyCFunction)worker_wake, METH_NOARGS,
     "wake(): wake the thread for the jobs queued."},
    {"fileno", (PyCFunction)worker_fileno, METH_NOARGS,
     "fileno(): readable when jobs are done."},
    {"collect", (PyCFunction)worker_collect, METH_NOARGS,
     "collect(): the tokens of the jobs done since the last call."},
    {"close", (PyCFunction)worker_close, METH_NOARGS,
     "close(): stop the thread; the tokens of the jobs never handed back."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WorkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aio_mclookup._coordinator._worker_c.NativeWorker",
    .tp_basicsize = sizeof(Worker),
    .tp_dealloc = (destructor)worker_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A native thread running native jobs without the GIL (see _worker_c.c).",
    .tp_methods = worker_methods,
    .tp_new = worker_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._coordinator._worker_c",
    "A native thread running native jobs off the event loop (see _worker_c.c).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__worker_c(void)
{
    if (PyType_Ready(&WorkerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&WorkerType);
    if (PyModule_AddObject(m, "NativeWorker", (PyObject *)&WorkerType) < 0) {
        Py_DECREF(&WorkerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
