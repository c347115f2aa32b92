/* The repeated-hash test of large plans: the compiled way of _rows.rows_repeat, made to run
 * as a native job (../_native_job.h) on the coordinator's NativeWorker
 * (_coordinator/_worker_c.c), off the event loop (docs/design.md, "Preparing plans off the
 * loop").
 *
 *   test_job(rows) -> job            the test as a native job over a 2-D uint8 array (its
 *                                    buffer held until the job is freed)
 *   verdict(job) -> bool | None      a job's answer, once it ran
 *   repeats(rows) -> bool | None     the test run here and now (plans tested on the loop)
 *
 * An answer is True iff two rows are equal, or None when the test could not tell (no memory,
 * rows crafted to collide). The test: each row into an open-addressing table keyed by a
 * multiply-xor mix of its bytes; a row whose mix matches an earlier one's is compared whole
 * (memcmp). Rows whose mixes collide (crafted so: the mix is not keyed) cannot make it
 * quadratic: past MAX_PROBES steps of one probe sequence it gives up and answers None (the
 * caller then tests the rows with _rows.rows_repeat, a sort).
 *
 * From SIEVE_FROM rows a sieve goes first: each row's words folded (xor, each rotated by its
 * place) and multiplied into one bit of a bitmap of about 32 bits per row; only the rows
 * whose bit another row set too (about 1 in 16 when hashes are uniform) go through the table,
 * copied out. When more than a quarter of the rows meet a bit set already (rows that repeat,
 * or fold alike: crafted or structured so) the table reads them all where they are instead:
 * the answer is the same, at about one and a half times the cost of the table alone. Above
 * SIEVE_UP_TO rows the table runs alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../_native_job.h"

/* ------------------------------------------------------------------------------- test */

enum { MAX_PROBES = 64, BATCH = 32, SIEVE_FROM = 1024, SIEVE_UP_TO = 1 << 24 };

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
table_repeat(const unsigned char *buf, Py_ssize_t n, Py_ssize_t width, Py_ssize_t stride)
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

/* A row's words folded into one 64-bit value (each rotated by its place, then multiplied):
 * cheap, and spread enough for the sieve's bit; not a table's mix. */
static inline uint64_t
fold(const unsigned char *row, Py_ssize_t width)
{
    uint64_t f = 0;
    unsigned turn = 0;
    Py_ssize_t i = 0;
    for (; i + 8 <= width; i += 8, turn += 23) {
        uint64_t word;
        memcpy(&word, row + i, 8);
        f ^= (word << (turn & 63)) | (word >> ((64 - turn) & 63));
    }
    if (i < width) {
        uint64_t word = 0;
        memcpy(&word, row + i, (size_t)(width - i));
        f ^= (word << (turn & 63)) | (word >> ((64 - turn) & 63));
    }
    return f * 0xFF51AFD7ED558CCDULL;
}

/* The sieve's pass: each row's bit in `bit_of`, set in `seen`, and in `twice` when an earlier
 * row set it; returns how many rows found their bit set already. */
static inline __attribute__((always_inline)) Py_ssize_t
sieve(const unsigned char *buf, Py_ssize_t n, Py_ssize_t width, Py_ssize_t stride, int shift,
      uint64_t *seen, uint64_t *twice, uint32_t *bit_of)
{
    Py_ssize_t again = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bit = (uint32_t)(fold(buf + i * stride, width) >> (64 - shift));
        uint64_t mask = (uint64_t)1 << (bit & 63);
        bit_of[i] = bit;
        if (seen[bit >> 6] & mask) {
            twice[bit >> 6] |= mask;
            again++;
        }
        seen[bit >> 6] |= mask;
    }
    return again;
}

/* table_repeat's answer, the sieve first from SIEVE_FROM rows (see the head of this file). */
static int
rows_repeat(const unsigned char *buf, Py_ssize_t n, Py_ssize_t width, Py_ssize_t stride)
{
    if (n < SIEVE_FROM || n > SIEVE_UP_TO || width == 0) /* (above: bitmaps of hundreds of
                                                            megabytes; the table alone) */
        return table_repeat(buf, n, width, stride);
    int shift = 16;
    while (((size_t)1 << shift) < (size_t)n * 32)
        shift++;
    size_t words = ((size_t)1 << shift) / 64;
    uint64_t *seen = calloc(2 * words, sizeof(uint64_t)); /* then the bits set twice */
    uint32_t *bit_of = malloc((size_t)n * sizeof(uint32_t));
    if (!seen || !bit_of) {
        free(seen);
        free(bit_of);
        return -1;
    }
    uint64_t *twice = seen + words;
    Py_ssize_t again = width == 32 /* (the usual hash: a constant width the loop unrolls) */
                           ? sieve(buf, n, 32, stride, shift, seen, twice, bit_of)
                           : sieve(buf, n, width, stride, shift, seen, twice, bit_of);
    int found = 0;
    if (again > n / 4) { /* the sieve does not sift (rows that repeat, or fold alike): the
                            table reads the rows where they are, and stops at a repeat */
        found = table_repeat(buf, n, width, stride);
    } else if (again) {
        /* the rows on a bit set twice: at most 2 * again (each such bit's first row, and the
         * others, each counted in again) */
        Py_ssize_t room = 2 * again < n ? 2 * again : n, m = 0;
        unsigned char *suspects = malloc((size_t)room * (size_t)width);
        if (!suspects) {
            found = -1;
        } else {
            for (Py_ssize_t i = 0; i < n; i++)
                if ((twice[bit_of[i] >> 6] >> (bit_of[i] & 63)) & 1)
                    memcpy(suspects + (m++) * width, buf + i * stride, (size_t)width);
            found = table_repeat(suspects, m, width, width);
            free(suspects);
        }
    }
    free(seen);
    free(bit_of);
    return found;
}

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

/* ------------------------------------------------------------------------------ jobs */

typedef struct {
    NativeJob base;
    Py_buffer view; /* the rows, held until the job is freed */
    int repeats;    /* rows_repeat's answer */
} TestJob;

static void
run_test(NativeJob *job)
{
    TestJob *t = (TestJob *)job;
    Py_buffer *v = &t->view;
    t->repeats = rows_repeat(v->buf, v->shape[0], v->shape[1], v->strides[0]);
}

static void
free_test(PyObject *capsule)
{
    TestJob *t = PyCapsule_GetPointer(capsule, NATIVE_JOB_CAPSULE);
    if (t) {
        PyBuffer_Release(&t->view);
        PyMem_Free(t);
    }
}

static PyObject *
test_job(PyObject *Py_UNUSED(self), PyObject *arg)
{
    TestJob *t = PyMem_Calloc(1, sizeof(TestJob));
    if (!t)
        return PyErr_NoMemory();
    if (get_rows(arg, &t->view) < 0) {
        PyMem_Free(t);
        return NULL;
    }
    t->base.run = run_test;
    PyObject *capsule = PyCapsule_New(t, NATIVE_JOB_CAPSULE, free_test);
    if (!capsule) {
        PyBuffer_Release(&t->view);
        PyMem_Free(t);
    }
    return capsule;
}

static PyObject *
verdict(PyObject *Py_UNUSED(self), PyObject *capsule)
{
    TestJob *t = PyCapsule_GetPointer(capsule, NATIVE_JOB_CAPSULE);
    if (!t)
        return NULL;
    if (t->base.run != run_test) {
        PyErr_SetString(PyExc_TypeError, "not a repeated-hash test job");
        return NULL;
    }
    if (!native_job_ran(&t->base)) {
        PyErr_SetString(PyExc_RuntimeError, "the test has not run yet");
        return NULL;
    }
    if (t->repeats < 0)
        Py_RETURN_NONE;
    return PyBool_FromLong(t->repeats);
}

static PyObject *
repeats(PyObject *Py_UNUSED(self), PyObject *arg)
{
    Py_buffer v;
    if (get_rows(arg, &v) < 0)
        return NULL;
    int found = rows_repeat(v.buf, v.shape[0], v.shape[1], v.strides[0]);
    PyBuffer_Release(&v);
    if (found < 0)
        Py_RETURN_NONE;
    return PyBool_FromLong(found);
}

static PyMethodDef methods[] = {
    {"test_job", test_job, METH_O, "test_job(rows): the test as a native job."},
    {"verdict", verdict, METH_O, "verdict(job): a test job's answer, once it ran."},
    {"repeats", repeats, METH_O, "repeats(rows): the test run here and now."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._plan._repeats_c",
    "The repeated-hash test as a native job (see _repeats_c.c).", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC
PyInit__repeats_c(void)
{
    return PyModule_Create(&module);
}
