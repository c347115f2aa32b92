/* The repeated-hash test of large plans on a native thread that never takes the GIL: the
 * compiled way of running _rows.rows_repeat off the event loop (docs/design.md, "Preparing
 * large plans"). A Python worker thread would not do: it needs the GIL to pick up each job
 * and to return it, and the event loop, busy, gives the GIL up only every switch interval.
 *
 *   RepeatWorker()                a thread and a pipe (ImportError-free: OSError on failure)
 *     .submit(rows, token)        test a 2-D uint8 array (its buffer is held until collected)
 *     .fileno()                   readable when tests are done
 *     .collect() -> [(token, repeats)]   the tests done since, in any order; repeats is a
 *                                 bool, or None when the worker could not tell (no memory,
 *                                 rows crafted to collide)
 *     .close() -> [token]         stop the thread (after its current test, which the caller
 *                                 waits for); the tokens of the tests not collected
 *
 * The test: each row into an open-addressing table keyed by a multiply-xor mix of its bytes;
 * a row whose mix matches an earlier one's is compared whole (memcmp). Exact: True iff two
 * rows are equal. Rows whose mixes collide (crafted so: the mix is not keyed) cannot make it
 * quadratic: past MAX_PROBES steps of one probe sequence it gives up and answers None (the
 * caller then tests the rows with _rows.rows_repeat, a sort).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct Job {
    struct Job *next;
    Py_buffer view;
    PyObject *token;
    int repeats; /* 1 yes, 0 no, negative: could not tell */
} Job;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    Job *todo_head, *todo_tail; /* submitted, not yet taken by the thread */
    Job *done;                  /* tested, not yet collected */
    int read_fd, write_fd;
    int stopping, started;
} Worker;

/* ------------------------------------------------------------------------------- test */

enum { MAX_PROBES = 64, BATCH = 32 };

static uint64_t
mix(const unsigned char *row, Py_ssize_t width)
{
    uint64_t h = 0x9E3779B97F4A7C15ULL;
    Py_ssize_t i = 0;
    for (; i + 8 <= width; i += 8) {
        uint64_t word;
        memcpy(&word, row + i, 8);
        h = (h ^ word) * 0xFF51AFD7ED558CCDULL;
    }
    if (i < width) {
        uint64_t word = 0;
        memcpy(&word, row + i, (size_t)(width - i));
        h = (h ^ word) * 0xFF51AFD7ED558CCDULL;
    }
    /* a full avalanche (MurmurHash3's finaliser): rows that differ in any bits spread */
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 33);
}

/* 1 if two rows are equal, 0 if none are, -1 without memory, -2 when a probe sequence grew
 * past MAX_PROBES (rows crafted to collide: the caller tests them another way). */
static int
rows_repeat(const unsigned char *buf, Py_ssize_t n, Py_ssize_t width, Py_ssize_t stride)
{
    if (n < 2)
        return 0;
    if (width == 0)
        return 1; /* rows of empty hashes are all equal */
    size_t size = 1024;
    while (size < (size_t)n * 2)
        size <<= 1;
    size_t mask = size - 1;
    /* an entry: the mix's high 32 bits, then 1 + the row's index (0: empty) */
    uint64_t *table = calloc(size, sizeof(uint64_t));
    if (!table)
        return -1;
    int found = 0;
    uint64_t mixes[BATCH];
    for (Py_ssize_t start = 0; start < n && !found; start += BATCH) {
        /* the batch's mixes first, their slots fetched meanwhile: the inserts then find
         * them in cache instead of waiting on each in turn */
        Py_ssize_t end = start + BATCH < n ? start + BATCH : n;
        for (Py_ssize_t i = start; i < end; i++) {
            mixes[i - start] = mix(buf + i * stride, width);
            __builtin_prefetch(&table[(size_t)mixes[i - start] & mask], 1);
        }
        for (Py_ssize_t i = start; i < end && !found; i++) {
            const unsigned char *row = buf + i * stride;
            uint64_t h = mixes[i - start];
            uint64_t tag = h & 0xFFFFFFFF00000000ULL;
            size_t slot = (size_t)h & mask;
            int probes = 0;
            for (;;) {
                uint64_t entry = table[slot];
                if (!entry) {
                    table[slot] = tag | (uint64_t)(i + 1);
                    break;
                }
                if ((entry & 0xFFFFFFFF00000000ULL) == tag) {
                    Py_ssize_t j = (Py_ssize_t)(entry & 0xFFFFFFFFULL) - 1;
                    if (memcmp(buf + j * stride, row, (size_t)width) == 0) {
                        found = 1;
                        break;
                    }
                }
                if (++probes > MAX_PROBES) {
                    found = -2;
                    break;
                }
                slot = (slot + 1) & mask;
            }
        }
    }
    free(table);
    return found;
}

/* ----------------------------------------------------------------------------- thread */

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
        Job *job = w->todo_head;
        w->todo_head = job->next;
        if (!w->todo_head)
            w->todo_tail = NULL;
        pthread_mutex_unlock(&w->lock);
        Py_buffer *v = &job->view;
        job->repeats = rows_repeat(v->buf, v->shape[0], v->shape[1], v->strides[0]);
        pthread_mutex_lock(&w->lock);
        job->next = w->done;
        w->done = job;
        char byte = 1;
        ssize_t ignored = write(w->write_fd, &byte, 1); /* full: a wake is pending anyway */
        (void)ignored;
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* ----------------------------------------------------------------------------- methods */

/* A 2-D uint8 buffer of fewer than 2**31 hash rows, bytes of a row contiguous, rows at a
 * non-negative stride; -1 with ValueError (or the buffer's own error) otherwise. */
static int
get_rows(PyObject *obj, Py_buffer *v)
{
    if (PyObject_GetBuffer(obj, v, PyBUF_RECORDS_RO) < 0)
        return -1;
    if (v->ndim != 2 || v->itemsize != 1 || (v->format && strcmp(v->format, "B") != 0)
        || (v->shape[1] > 1 && v->strides[1] != 1) || v->suboffsets || v->shape[0] >= 1LL << 31
        || v->strides[0] < 0) {
        PyBuffer_Release(v);
        PyErr_SetString(PyExc_ValueError,
                        "expected a 2-D array of uint8 hash rows (fewer than 2**31)");
        return -1;
    }
    return 0;
}

static void
release(Job *job)
{
    PyBuffer_Release(&job->view);
    Py_XDECREF(job->token);
    PyMem_Free(job);
}

static PyObject *
worker_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "RepeatWorker() takes no arguments");
        return NULL;
    }
    Worker *w = (Worker *)type->tp_alloc(type, 0);
    if (!w)
        return NULL;
    w->read_fd = w->write_fd = -1;
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
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->wake, NULL);
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

/* Stop and join the thread; returns the jobs never tested (the caller releases them). */
static Job *
stop(Worker *w)
{
    Job *left = NULL;
    if (w->started) {
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
        /* tested but not collected: their callers wait too */
        Job *job = w->done;
        while (job) {
            Job *next = job->next;
            job->next = left;
            left = job;
            job = next;
        }
        w->done = NULL;
    }
    return left;
}

static PyObject *
worker_submit(Worker *w, PyObject *args)
{
    PyObject *rows, *token;
    if (!PyArg_ParseTuple(args, "OO", &rows, &token))
        return NULL;
    if (!w->started) {
        PyErr_SetString(PyExc_RuntimeError, "the repeat worker is closed");
        return NULL;
    }
    Job *job = PyMem_Calloc(1, sizeof(Job));
    if (!job)
        return PyErr_NoMemory();
    if (get_rows(rows, &job->view) < 0) {
        PyMem_Free(job);
        return NULL;
    }
    Py_INCREF(token);
    job->token = token;
    pthread_mutex_lock(&w->lock);
    if (w->todo_tail)
        w->todo_tail->next = job;
    else
        w->todo_head = job;
    w->todo_tail = job;
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
    Job *jobs = w->done;
    w->done = NULL;
    pthread_mutex_unlock(&w->lock);
    PyObject *out = PyList_New(0);
    for (Job *job = jobs; job && out; job = job->next) {
        PyObject *verdict = job->repeats < 0 ? Py_None : job->repeats ? Py_True : Py_False;
        PyObject *pair = PyTuple_Pack(2, job->token, verdict);
        if (!pair || PyList_Append(out, pair) < 0)
            Py_CLEAR(out);
        Py_XDECREF(pair);
    }
    if (!out) { /* (no memory) the jobs go back, to be collected at the next wake */
        if (jobs) {
            Job *last = jobs;
            while (last->next)
                last = last->next;
            pthread_mutex_lock(&w->lock);
            last->next = w->done;
            w->done = jobs;
            pthread_mutex_unlock(&w->lock);
            char byte = 1;
            ssize_t ignored = write(w->write_fd, &byte, 1);
            (void)ignored;
        }
        return NULL;
    }
    while (jobs) {
        Job *next = jobs->next;
        release(jobs);
        jobs = next;
    }
    return out;
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
worker_close(Worker *w, PyObject *Py_UNUSED(unused))
{
    Job *job = stop(w);
    PyObject *out = PyList_New(0);
    while (job) {
        Job *next = job->next;
        if (out && PyList_Append(out, job->token) < 0)
            Py_CLEAR(out);
        release(job);
        job = next;
    }
    close_fds(w);
    return out;
}

static void
worker_dealloc(Worker *w)
{
    Job *job = stop(w);
    while (job) {
        Job *next = job->next;
        release(job);
        job = next;
    }
    close_fds(w);
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->wake);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef worker_methods[] = {
    {"submit", (PyCFunction)worker_submit, METH_VARARGS,
     "submit(rows, token): test rows (a 2-D uint8 array) for repeats on the thread."},
    {"fileno", (PyCFunction)worker_fileno, METH_NOARGS,
     "fileno(): readable when tests are done."},
    {"collect", (PyCFunction)worker_collect, METH_NOARGS,
     "collect(): [(token, repeats)] of the tests done since the last call."},
    {"close", (PyCFunction)worker_close, METH_NOARGS,
     "close(): stop the thread; the tokens of the tests never handed back."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WorkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aio_mclookup._coordinator._repeats_c.RepeatWorker",
    .tp_basicsize = sizeof(Worker),
    .tp_dealloc = (destructor)worker_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A native thread testing hash rows for repeats (see _repeats_c.c).",
    .tp_methods = worker_methods,
    .tp_new = worker_new,
};

static PyObject *
repeats(PyObject *Py_UNUSED(self), PyObject *arg)
{
    Py_buffer v;
    if (get_rows(arg, &v) < 0)
        return NULL;
    int found;
    Py_BEGIN_ALLOW_THREADS
    found = rows_repeat(v.buf, v.shape[0], v.shape[1], v.strides[0]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    if (found == -1)
        return PyErr_NoMemory();
    if (found < 0)
        Py_RETURN_NONE;
    return PyBool_FromLong(found);
}

static PyMethodDef methods[] = {
    {"repeats", repeats, METH_O, "repeats(rows): whether two hash rows are equal, or None "
                                 "(crafted to collide): the worker's test, on this thread."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._coordinator._repeats_c",
    "The repeated-hash test on a native thread (see _repeats_c.c).", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC
PyInit__repeats_c(void)
{
    if (PyType_Ready(&WorkerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&WorkerType);
    if (PyModule_AddObject(m, "RepeatWorker", (PyObject *)&WorkerType) < 0) {
        Py_DECREF(&WorkerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
