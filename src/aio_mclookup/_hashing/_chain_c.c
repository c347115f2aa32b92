/* The SHA-256 block chain of BlockHasher in one C loop (the compiled twin of the chain in
 * _hasher.py and the payload layout in _payload.py; docs/design.md, "Compiled extensions"),
 * and SGLang's page chain (below).
 *
 * Block i's hash is SHA-256(payload_i), payload_i = head + parent + body_i, parent being block
 * i-1's hash (the caller's start digest for block 0). The payload is vLLM's serialisation of
 * (parent, tuple(block tokens), extra): pickle protocol 5 (sha256) or canonical CBOR
 * (sha256_cbor); the layout is written out in _payload.py.
 *
 *   plain(tokens, block_size, cbor, parent) -> bytearray | None
 *       blocks without extra keys (extra = None), serialised here from the token ids (a 1-D
 *       buffer of 4- or 8-byte unsigned ints); None when an id of a full block is >= 2**63 or
 *       a pickle would need a second frame: the Python path then names or handles it.
 *   bodies(parent, bodies, cbor) -> bytearray
 *       blocks whose bodies the Python code built (extra keys): only the chain is done here.
 *
 * Both return the digests of every block, concatenated (n_blocks * 32 bytes).
 *
 * SGLang HiCache's page chain (the twin of _chain in sglang.py): page i's digest is
 * SHA-256(prior + body_i), the prior being page i-1's digest (the namespace seed, or nothing,
 * for page 0); the caller packs the bodies.
 *
 *   pages(seed, bodies, width) -> list[bytes]
 *       pages of `width` bytes back to back in one buffer (the usual case: every page narrow).
 *   page_list(seed, bodies) -> list[bytes]
 *       a sequence of bodies of any lengths (0.5.23's wide pages among narrow ones).
 *   pages_job(seed, bodies, width[, pages]) -> job;  page_digests(job) -> bytes
 *       pages() as a native job (../_native_job.h) for the coordinator's NativeWorker; the
 *       digests concatenated (n * 32 bytes), once the job ran.
 *
 *   ids_pages_job(seed, ids, page_size, pages) -> job | None;  ids_page_digests(job) -> bytes | None
 *       the chain of the first `pages` pages of `page_size` ids of a 1-D C-contiguous array
 *       of 4- or 8-byte integers, the ids narrowed and packed on the worker's thread too: the
 *       job reads the array's own buffer (held until the job is freed), so its owner must not
 *       write to it while the job may run (LookupCoordinator.lookup_tokens drops the result
 *       of a job whose caller stopped waiting). None at make for any other input (the caller
 *       packs the ids itself); the digests concatenated once the job ran, or None when some
 *       id of the array is outside 0 .. 2**32 - 1 (the Python path then hashes the pages).
 *
 *   narrow_ids(token_ids, limit) -> bytes | None
 *       the ids as uint32 little-endian (the twin of sglang.token_ids_q where every id fits):
 *       from a list or tuple of ints, or a 1-D C-contiguous buffer of integers, at most
 *       `limit` of them, each in 0 .. 2**32 - 1; None for anything else (the Python path then
 *       reads the ids, and names what is wrong).
 *
 * SHA-256 is OpenSSL's libcrypto (its SHA256_* functions, the ones with the CPU's SHA
 * instructions).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#include "../_native_job.h"

#define WIDTH 32
#define FRAME_LIMIT 65000     /* _payload.PICKLE_FRAME_LIMIT: one pickle frame below this */
#define TOKEN_LIMIT (1ULL << 63)
#define HEAD_ROOM 64          /* bytes before a body: the longest head (13) + the parent */
#define NOGIL_BLOCKS 64       /* chains of at least this many blocks let other threads run */

/* One token id's record; returns its length. */
static inline size_t
pickle_record(uint8_t *out, uint64_t v)
{
    if (v < 0x100) {
        out[0] = 0x4B; out[1] = (uint8_t)v; return 2;                    /* BININT1 */
    }
    if (v < 0x10000) {
        out[0] = 0x4D; out[1] = (uint8_t)v; out[2] = (uint8_t)(v >> 8); return 3;  /* BININT2 */
    }
    if (v < 0x80000000ULL) {
        out[0] = 0x4A;                                                   /* BININT */
        for (int i = 0; i < 4; i++) out[1 + i] = (uint8_t)(v >> (8 * i));
        return 5;
    }
    /* LONG1: little-endian two's complement, bit_length // 8 + 1 bytes */
    int bits = 64 - __builtin_clzll(v);
    size_t n = (size_t)(bits / 8 + 1);
    out[0] = 0x8A; out[1] = (uint8_t)n;
    for (size_t i = 0; i < n; i++) out[2 + i] = i < 8 ? (uint8_t)(v >> (8 * i)) : 0;
    return 2 + n;
}

/* A CBOR head of major type `major` with the shortest argument for `v`; returns its length. */
static inline size_t
cbor_head(uint8_t *out, unsigned major, uint64_t v)
{
    uint8_t mt = (uint8_t)(major << 5);
    if (v < 24) { out[0] = mt | (uint8_t)v; return 1; }
    size_t n; uint8_t info;
    if (v < 0x100) { n = 1; info = 24; }
    else if (v < 0x10000) { n = 2; info = 25; }
    else if (v < 0x100000000ULL) { n = 4; info = 26; }
    else { n = 8; info = 27; }
    out[0] = mt | info;
    for (size_t i = 0; i < n; i++) out[1 + i] = (uint8_t)(v >> (8 * (n - 1 - i)));
    return 1 + n;
}

/* The head before the parent, by body length; written to end at `end`; returns its start. */
static inline uint8_t *
put_head(uint8_t *end, size_t body_len, int cbor)
{
    if (cbor) {  /* 3-array, byte string of WIDTH */
        end -= 3;
        end[0] = 0x83; end[1] = 0x58; end[2] = WIDTH;
        return end;
    }
    end -= 13;   /* PROTO 5, FRAME (payload length - 11), BINBYTES WIDTH */
    uint64_t frame = WIDTH + body_len + 2;
    end[0] = 0x80; end[1] = 0x05; end[2] = 0x95;
    for (int i = 0; i < 8; i++) end[3 + i] = (uint8_t)(frame >> (8 * i));
    end[11] = 0x43; end[12] = WIDTH;
    return end;
}

static inline void
sha256(const uint8_t *data, size_t len, uint8_t *digest)
{
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, data, len);
    SHA256_Final(digest, &ctx);
}

static inline uint64_t
token_at(const char *buf, Py_ssize_t itemsize, Py_ssize_t i)
{
    if (itemsize == 8) { uint64_t v; memcpy(&v, buf + 8 * i, 8); return v; }
    uint32_t v; memcpy(&v, buf + 4 * i, 4); return v;
}

/* Serialise and hash n_blocks blocks; 0 on success, -1 when one needs the Python path. */
static int
chain_plain(const char *tokens, Py_ssize_t itemsize, Py_ssize_t n_blocks, Py_ssize_t h,
            int cbor, const uint8_t *start, uint8_t *out, uint8_t *buf)
{
    const uint8_t *parent = start;
    uint8_t *body = buf + HEAD_ROOM;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        uint8_t *p = body;
        const Py_ssize_t first = b * h;
        if (cbor) {
            p += cbor_head(p, 4, (uint64_t)h);
            for (Py_ssize_t j = 0; j < h; j++) {
                uint64_t v = token_at(tokens, itemsize, first + j);
                if (v >= TOKEN_LIMIT) return -1;
                p += cbor_head(p, 0, v);
            }
            *p++ = 0xF6;                                  /* None */
        } else {
            *p++ = 0x94;                                  /* MEMOIZE (the parent) */
            if (h > 3) *p++ = 0x28;                       /* MARK */
            for (Py_ssize_t j = 0; j < h; j++) {
                uint64_t v = token_at(tokens, itemsize, first + j);
                if (v >= TOKEN_LIMIT) return -1;
                p += pickle_record(p, v);
            }
            *p++ = h > 3 ? 0x74 : (uint8_t)(0x84 + h);    /* TUPLE or TUPLE1..3 */
            *p++ = 0x94;
            *p++ = 0x4E;                                  /* None */
            *p++ = 0x87; *p++ = 0x94; *p++ = 0x2E;        /* TUPLE3, MEMOIZE, STOP */
        }
        size_t body_len = (size_t)(p - body);
        if (!cbor && body_len + 2 + WIDTH >= FRAME_LIMIT) return -1;
        memcpy(body - WIDTH, parent, WIDTH);
        uint8_t *head = put_head(body - WIDTH, body_len, cbor);
        uint8_t *digest = out + b * WIDTH;
        sha256(head, (size_t)(p - head), digest);
        parent = digest;
    }
    return 0;
}

static int
parse_parent(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    if (view->len != WIDTH) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "parent must be %d bytes", WIDTH);
        return -1;
    }
    return 0;
}

static PyObject *
plain(PyObject *self, PyObject *args)
{
    PyObject *tokens_obj, *parent_obj;
    Py_ssize_t h;
    int cbor;
    if (!PyArg_ParseTuple(args, "OnpO:plain", &tokens_obj, &h, &cbor, &parent_obj)) return NULL;
    if (h < 1 || h > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "block_size out of range");
        return NULL;
    }
    Py_buffer tokens, parent;
    if (PyObject_GetBuffer(tokens_obj, &tokens, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (tokens.ndim != 1 || (tokens.itemsize != 4 && tokens.itemsize != 8) || tokens.format == NULL
        || strchr("IiLlQqNn", tokens.format[strlen(tokens.format) - 1]) == NULL) {
        PyBuffer_Release(&tokens);
        PyErr_SetString(PyExc_TypeError, "tokens must be a 1-D buffer of 4- or 8-byte ints");
        return NULL;
    }
    if (parse_parent(parent_obj, &parent) < 0) {
        PyBuffer_Release(&tokens);
        return NULL;
    }
    Py_ssize_t n_blocks = tokens.shape[0] / h;
    PyObject *result = PyByteArray_FromStringAndSize(NULL, n_blocks * WIDTH);
    /* a body: open (<= 10), records (<= 10 each), close (<= 6) */
    uint8_t *buf = result ? PyMem_RawMalloc((size_t)(HEAD_ROOM + 16 + 10 * h)) : NULL;
    if (result != NULL && buf == NULL) PyErr_NoMemory();
    int rc = -2;
    if (buf != NULL) {
        uint8_t start[WIDTH];
        memcpy(start, parent.buf, WIDTH);
        uint8_t *out = (uint8_t *)PyByteArray_AS_STRING(result);
        if (n_blocks >= NOGIL_BLOCKS) {
            Py_BEGIN_ALLOW_THREADS
            rc = chain_plain(tokens.buf, tokens.itemsize, n_blocks, h, cbor, start, out, buf);
            Py_END_ALLOW_THREADS
        } else {
            rc = chain_plain(tokens.buf, tokens.itemsize, n_blocks, h, cbor, start, out, buf);
        }
        PyMem_RawFree(buf);
    }
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&parent);
    if (rc == -2) {
        Py_XDECREF(result);
        return NULL;
    }
    if (rc < 0) {
        Py_DECREF(result);
        Py_RETURN_NONE;
    }
    return result;
}

static PyObject *
bodies(PyObject *self, PyObject *args)
{
    PyObject *parent_obj, *seq_obj;
    int cbor;
    if (!PyArg_ParseTuple(args, "OOp:bodies", &parent_obj, &seq_obj, &cbor)) return NULL;
    Py_buffer parent;
    if (parse_parent(parent_obj, &parent) < 0) return NULL;
    uint8_t digest[WIDTH];
    memcpy(digest, parent.buf, WIDTH);
    PyBuffer_Release(&parent);
    PyObject *seq = PySequence_Fast(seq_obj, "bodies must be a sequence of bytes");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *result = PyByteArray_FromStringAndSize(NULL, n * WIDTH);
    if (result == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    uint8_t *out = (uint8_t *)PyByteArray_AS_STRING(result);
    uint8_t head[HEAD_ROOM];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(item)) {
            Py_DECREF(seq);
            Py_DECREF(result);
            PyErr_SetString(PyExc_TypeError, "bodies must be a sequence of bytes");
            return NULL;
        }
        size_t len = (size_t)PyBytes_GET_SIZE(item);
        memcpy(head + HEAD_ROOM - WIDTH, i ? out + (i - 1) * WIDTH : digest, WIDTH);
        uint8_t *start = put_head(head + HEAD_ROOM - WIDTH, len, cbor);
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, start, (size_t)(head + HEAD_ROOM - start));
        SHA256_Update(&ctx, PyBytes_AS_STRING(item), len);
        SHA256_Final(out + i * WIDTH, &ctx);
    }
    Py_DECREF(seq);
    return result;
}

/* SGLang's page chain: digest_i = SHA-256(prior + body_i), prior the previous digest (the seed,
 * possibly empty, for page 0). `bodies` holds `n` bodies of `width` bytes each, back to back;
 * the digests go to `out` (n * WIDTH bytes). */
static void
chain_pages(const uint8_t *seed, size_t seed_len, const uint8_t *bodies, Py_ssize_t n,
            size_t width, uint8_t *out)
{
    const uint8_t *prior = seed;
    size_t prior_len = seed_len;
    for (Py_ssize_t i = 0; i < n; i++) {
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        if (prior_len) SHA256_Update(&ctx, prior, prior_len);
        SHA256_Update(&ctx, bodies + (size_t)i * width, width);
        SHA256_Final(out + i * WIDTH, &ctx);
        prior = out + i * WIDTH;
        prior_len = WIDTH;
    }
}

/* The seed argument: b"" (no seed) or WIDTH bytes; 0 on success. */
static int
parse_seed(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    if (view->len != 0 && view->len != WIDTH) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "seed must be empty or %d bytes", WIDTH);
        return -1;
    }
    return 0;
}

/* The seed argument copied into a job's `seed` (WIDTH bytes of room); 0 on success. */
static int
copy_seed(PyObject *obj, uint8_t *seed, size_t *len)
{
    Py_buffer view;
    if (parse_seed(obj, &view) < 0) return -1;
    memcpy(seed, view.buf, (size_t)view.len);
    *len = (size_t)view.len;
    PyBuffer_Release(&view);
    return 0;
}

/* The digests in `out` as a list of n bytes objects. */
static PyObject *
digest_list(const uint8_t *out, Py_ssize_t n)
{
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)out + i * WIDTH, WIDTH);
        if (digest == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, digest);
    }
    return list;
}

static PyObject *
pages(PyObject *self, PyObject *args)
{
    PyObject *seed_obj, *bodies_obj;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOn:pages", &seed_obj, &bodies_obj, &width)) return NULL;
    if (width < 1) {
        PyErr_SetString(PyExc_ValueError, "width must be >= 1");
        return NULL;
    }
    Py_buffer seed, bodies;
    if (parse_seed(seed_obj, &seed) < 0) return NULL;
    if (PyObject_GetBuffer(bodies_obj, &bodies, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&seed);
        return NULL;
    }
    if (bodies.len % width) {
        PyBuffer_Release(&seed);
        PyBuffer_Release(&bodies);
        PyErr_SetString(PyExc_ValueError, "bodies is not a whole number of pages");
        return NULL;
    }
    Py_ssize_t n = bodies.len / width;
    uint8_t *out = PyMem_RawMalloc((size_t)(n ? n : 1) * WIDTH);
    PyObject *result = NULL;
    if (out == NULL) {
        PyErr_NoMemory();
    } else {
        if (n >= NOGIL_BLOCKS) {
            Py_BEGIN_ALLOW_THREADS
            chain_pages(seed.buf, (size_t)seed.len, bodies.buf, n, (size_t)width, out);
            Py_END_ALLOW_THREADS
        } else {
            chain_pages(seed.buf, (size_t)seed.len, bodies.buf, n, (size_t)width, out);
        }
        result = digest_list(out, n);
        PyMem_RawFree(out);
    }
    PyBuffer_Release(&seed);
    PyBuffer_Release(&bodies);
    return result;
}

/* pages() as a native job (../_native_job.h): the chain on a NativeWorker's thread. */
typedef struct {
    NativeJob base;
    uint8_t seed[WIDTH];
    size_t seed_len, width;
    Py_ssize_t n;
    Py_buffer bodies; /* held until the job is freed */
    PyObject *digests; /* bytes of n * WIDTH, written by run_pages before anyone reads it */
    uint8_t *out;      /* their buffer (found with the GIL, when the job is made) */
} PagesJob;

static void
run_pages(NativeJob *job)
{
    PagesJob *p = (PagesJob *)job;
    chain_pages(p->seed, p->seed_len, p->bodies.buf, p->n, p->width, p->out);
}

static void
free_pages(PyObject *capsule)
{
    PagesJob *p = PyCapsule_GetPointer(capsule, NATIVE_JOB_CAPSULE);
    if (p) {
        PyBuffer_Release(&p->bodies);
        Py_XDECREF(p->digests);
        PyMem_Free(p);
    }
}

static PyObject *
pages_job(PyObject *self, PyObject *args)
{
    PyObject *seed_obj, *bodies_obj;
    Py_ssize_t width, pages = -1;
    if (!PyArg_ParseTuple(args, "OOn|n:pages_job", &seed_obj, &bodies_obj, &width, &pages))
        return NULL;
    if (width < 1) {
        PyErr_SetString(PyExc_ValueError, "width must be >= 1");
        return NULL;
    }
    if (pages < -1) {
        PyErr_SetString(PyExc_ValueError, "pages must be >= 0 (or -1: every page)");
        return NULL;
    }
    if (!PyBytes_CheckExact(bodies_obj)) {  /* (immutable: the thread reads it unlocked) */
        PyErr_SetString(PyExc_TypeError, "a pages job's bodies must be bytes");
        return NULL;
    }
    PagesJob *p = PyMem_Calloc(1, sizeof(PagesJob));
    if (p == NULL) return PyErr_NoMemory();
    if (copy_seed(seed_obj, p->seed, &p->seed_len) < 0) {
        PyMem_Free(p);
        return NULL;
    }
    if (PyObject_GetBuffer(bodies_obj, &p->bodies, PyBUF_SIMPLE) < 0) {
        PyMem_Free(p);
        return NULL;
    }
    PyObject *capsule = NULL;
    if (pages < 0 && p->bodies.len % width) {
        PyErr_SetString(PyExc_ValueError, "bodies is not a whole number of pages");
    } else if (pages >= 0 && pages > p->bodies.len / width) {
        PyErr_SetString(PyExc_ValueError, "bodies is shorter than pages pages");
    } else {
        p->width = (size_t)width;
        p->n = pages < 0 ? p->bodies.len / width : pages;
        p->digests = PyBytes_FromStringAndSize(NULL, p->n * WIDTH);
        p->base.run = run_pages;
        if (p->digests != NULL) {
            p->out = (uint8_t *)PyBytes_AS_STRING(p->digests);
            capsule = PyCapsule_New(p, NATIVE_JOB_CAPSULE, free_pages);
        }
    }
    if (capsule == NULL) {
        PyBuffer_Release(&p->bodies);
        Py_XDECREF(p->digests);
        PyMem_Free(p);
    }
    return capsule;
}

static PyObject *
page_digests(PyObject *self, PyObject *capsule)
{
    PagesJob *p = PyCapsule_GetPointer(capsule, NATIVE_JOB_CAPSULE);
    if (p == NULL) return NULL;
    if (p->base.run != run_pages) {
        PyErr_SetString(PyExc_TypeError, "not a pages job");
        return NULL;
    }
    if (!native_job_ran(&p->base)) {
        PyErr_SetString(PyExc_RuntimeError, "the pages job has not run yet");
        return NULL;
    }
    Py_INCREF(p->digests);
    return p->digests;
}

/* The integer format of a buffer: 1 with its signedness, 0 for anything else. */
static int
integer_format(const char *f, int *is_signed)
{
    f = f ? f : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (!*f || f[1])
        return 0;
    switch (*f) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': *is_signed = 1; return 1;
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': *is_signed = 0; return 1;
    default: return 0;
    }
}

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* pages_job() of ids still to narrow and pack (ids_pages_job): the worker's thread reads them. */
typedef struct {
    NativeJob base;
    uint8_t seed[WIDTH];
    size_t seed_len;
    Py_buffer ids;     /* the caller's array, held until the job is freed */
    int itemsize, is_signed;
    Py_ssize_t page_size, n;
    uint32_t *body;    /* one page's ids as uint32 (page_size of them) */
    PyObject *digests; /* bytes of n * WIDTH, written by run_ids_pages before anyone reads it */
    uint8_t *out;
    int narrow;        /* set by run_ids_pages: every id of the array fits 32 bits */
} IdsPagesJob;

/* Whether every id of the buffer is in 0 .. 2**32 - 1 (one branch-free pass). */
static int
ids_fit(const char *src, Py_ssize_t count, int itemsize, int is_signed)
{
    if (itemsize == 8) {
        uint64_t any = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            uint64_t id;
            memcpy(&id, src + 8 * i, 8);
            any |= id;
        }
        return !(any >> 32);  /* (a negative int64 sets the high bits) */
    }
    if (!is_signed)
        return 1;
    uint32_t any = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t id;
        memcpy(&id, src + 4 * i, 4);
        any |= id;
    }
    return !(any >> 31);
}

static void
run_ids_pages(NativeJob *job)
{
    IdsPagesJob *p = (IdsPagesJob *)job;
    const char *src = p->ids.buf;
    if (!ids_fit(src, p->ids.shape[0], p->itemsize, p->is_signed)) {
        p->narrow = 0;
        return;
    }
    const uint8_t *prior = p->seed;
    size_t prior_len = p->seed_len, width = (size_t)p->page_size * 4;
    for (Py_ssize_t i = 0; i < p->n; i++) {
        const char *page = src + (size_t)i * (size_t)p->page_size * (size_t)p->itemsize;
        for (Py_ssize_t j = 0; j < p->page_size; j++) {
            if (p->itemsize == 8) {
                uint64_t id;
                memcpy(&id, page + 8 * j, 8);
                p->body[j] = (uint32_t)id;
            } else {
                memcpy(&p->body[j], page + 4 * j, 4);
            }
        }
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        if (prior_len) SHA256_Update(&ctx, prior, prior_len);
        SHA256_Update(&ctx, p->body, width);
        SHA256_Final(p->out + i * WIDTH, &ctx);
        prior = p->out + i * WIDTH;
        prior_len = WIDTH;
    }
    p->narrow = 1;
}

static void
free_ids_pages(PyObject *capsule)
{
    IdsPagesJob *p = PyCapsule_GetPointer(capsule, NATIVE_JOB_CAPSULE);
    if (p) {
        PyBuffer_Release(&p->ids);
        Py_XDECREF(p->digests);
        PyMem_Free(p->body);
        PyMem_Free(p);
    }
}
#endif

static PyObject *
ids_pages_job(PyObject *self, PyObject *args)
{
    PyObject *seed_obj, *ids_obj;
    Py_ssize_t page_size, pages;
    if (!PyArg_ParseTuple(args, "OOnn:ids_pages_job", &seed_obj, &ids_obj, &page_size, &pages))
        return NULL;
    if (page_size < 1 || pages < 0) {
        PyErr_SetString(PyExc_ValueError, "page_size must be >= 1 and pages >= 0");
        return NULL;
    }
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (!PyObject_CheckBuffer(ids_obj) || PyBytes_Check(ids_obj) || PyByteArray_Check(ids_obj))
        Py_RETURN_NONE;
    IdsPagesJob *p = PyMem_Calloc(1, sizeof(IdsPagesJob));
    if (p == NULL) return PyErr_NoMemory();
    if (copy_seed(seed_obj, p->seed, &p->seed_len) < 0) {
        PyMem_Free(p);
        return NULL;
    }
    if (PyObject_GetBuffer(ids_obj, &p->ids, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyMem_Free(p);
        Py_RETURN_NONE;
    }
    int is_signed = 0;
    if (p->ids.ndim != 1 || (p->ids.itemsize != 4 && p->ids.itemsize != 8)
        || !integer_format(p->ids.format, &is_signed)
        || pages > p->ids.shape[0] / page_size) {
        PyBuffer_Release(&p->ids);
        PyMem_Free(p);
        Py_RETURN_NONE;
    }
    p->itemsize = (int)p->ids.itemsize;
    p->is_signed = is_signed;
    p->page_size = page_size;
    p->n = pages;
    p->body = PyMem_Malloc((size_t)(pages ? page_size : 1) * 4); /* (a page fits the ids) */
    p->digests = PyBytes_FromStringAndSize(NULL, pages * WIDTH);
    PyObject *capsule = NULL;
    if (p->body == NULL || p->digests == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
    } else {
        p->out = (uint8_t *)PyBytes_AS_STRING(p->digests);
        p->base.run = run_ids_pages;
        capsule = PyCapsule_New(p, NATIVE_JOB_CAPSULE, free_ids_pages);
    }
    if (capsule == NULL) {
        PyBuffer_Release(&p->ids);
        Py_XDECREF(p->digests);
        PyMem_Free(p->body);
        PyMem_Free(p);
    }
    return capsule;
#else
    Py_RETURN_NONE;  /* (the packing here assumes a little-endian host) */
#endif
}

static PyObject *
ids_page_digests(PyObject *self, PyObject *capsule)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    IdsPagesJob *p = PyCapsule_GetPointer(capsule, NATIVE_JOB_CAPSULE);
    if (p == NULL) return NULL;
    if (p->base.run != run_ids_pages) {
        PyErr_SetString(PyExc_TypeError, "not an ids pages job");
        return NULL;
    }
    if (!native_job_ran(&p->base)) {
        PyErr_SetString(PyExc_RuntimeError, "the ids pages job has not run yet");
        return NULL;
    }
    if (!p->narrow) Py_RETURN_NONE;
    Py_INCREF(p->digests);
    return p->digests;
#else
    PyErr_SetString(PyExc_TypeError, "not an ids pages job");
    return NULL;
#endif
}

static PyObject *
page_list(PyObject *self, PyObject *args)
{
    PyObject *seed_obj, *seq_obj;
    if (!PyArg_ParseTuple(args, "OO:page_list", &seed_obj, &seq_obj)) return NULL;
    Py_buffer seed;
    if (parse_seed(seed_obj, &seed) < 0) return NULL;
    PyObject *seq = PySequence_Fast(seq_obj, "bodies must be a sequence of bytes");
    if (seq == NULL) {
        PyBuffer_Release(&seed);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *result = PyList_New(n);
    uint8_t prior[WIDTH];
    size_t prior_len = (size_t)seed.len;
    memcpy(prior, seed.buf, prior_len);
    PyBuffer_Release(&seed);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(item)) {
            Py_CLEAR(result);
            PyErr_SetString(PyExc_TypeError, "bodies must be a sequence of bytes");
            break;
        }
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        if (prior_len) SHA256_Update(&ctx, prior, prior_len);
        SHA256_Update(&ctx, PyBytes_AS_STRING(item), (size_t)PyBytes_GET_SIZE(item));
        SHA256_Final(prior, &ctx);
        prior_len = WIDTH;
        PyObject *digest = PyBytes_FromStringAndSize((const char *)prior, WIDTH);
        if (digest == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, digest);
    }
    Py_DECREF(seq);
    return result;
}

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* The usual dtypes in one branch-free, vectorisable pass each: an id out of 0 .. 2**32 - 1
 * leaves high bits in the OR of all ids (a negative one its sign bit); 1 when every id fits.
 * `dst` is a fresh bytes object's buffer (aligned, apart from `src`). */
static int
narrow_u64(const void *restrict buf, Py_ssize_t n, uint32_t *restrict dst)
{
    const char *restrict src = buf; /* (a view may be misaligned: loads through memcpy) */
    uint64_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t id;
        memcpy(&id, src + 8 * i, 8);
        any |= id;
        dst[i] = (uint32_t)id;
    }
    return !(any >> 32);
}

static int
narrow_u32(const void *restrict buf, Py_ssize_t n, uint32_t *restrict dst, int is_signed)
{
    const char *restrict src = buf;
    uint32_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t id;
        memcpy(&id, src + 4 * i, 4);
        any |= id;
        dst[i] = id;
    }
    return !is_signed || !(any >> 31);
}
#endif

/* narrow_ids of a buffer: 1 packed, 0 not narrow or not an integer buffer. */
static int
narrow_buffer(const Py_buffer *v, uint8_t *out)
{
    int is_signed;
    if (!integer_format(v->format, &is_signed))
        return 0;
    Py_ssize_t n = v->shape[0], size = v->itemsize;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (size == 8)
        return narrow_u64(v->buf, n, (uint32_t *)out);
    if (size == 4)
        return narrow_u32(v->buf, n, (uint32_t *)out, is_signed);
#endif
    const uint8_t *p = v->buf;
    for (Py_ssize_t i = 0; i < n; i++, p += size) {
        int64_t value;
        uint64_t raw;
        switch (size) {
        case 1: value = is_signed ? *(const int8_t *)p : *p; break;
        case 2: { uint16_t x; memcpy(&x, p, 2); value = is_signed ? (int16_t)x : x; break; }
        case 4: { uint32_t x; memcpy(&x, p, 4); value = is_signed ? (int32_t)x : (int64_t)x; break; }
        case 8:
            memcpy(&raw, p, 8);
            if (!is_signed && raw >> 32)
                return 0;
            value = (int64_t)raw;
            break;
        default: return 0;
        }
        if (value < 0 || (uint64_t)value >> 32)
            return 0;
        uint32_t id = (uint32_t)value;
        out[4 * i] = (uint8_t)id;
        out[4 * i + 1] = (uint8_t)(id >> 8);
        out[4 * i + 2] = (uint8_t)(id >> 16);
        out[4 * i + 3] = (uint8_t)(id >> 24);
    }
    return 1;
}

static PyObject *
narrow_ids(PyObject *self, PyObject *args)
{
    PyObject *ids;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "On:narrow_ids", &ids, &limit)) return NULL;
    if (PyList_CheckExact(ids) || PyTuple_CheckExact(ids)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
        if (n > limit) Py_RETURN_NONE;
        PyObject *packed = PyBytes_FromStringAndSize(NULL, 4 * n);
        if (packed == NULL) return NULL;
        uint8_t *out = (uint8_t *)PyBytes_AS_STRING(packed);
        PyObject **items = PySequence_Fast_ITEMS(ids);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = items[i];
            if (!PyLong_Check(item)) {
                Py_DECREF(packed);
                Py_RETURN_NONE;
            }
            int overflow;
            long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || value < 0 || (unsigned long long)value >> 32) {
                Py_DECREF(packed);
                if (value == -1 && PyErr_Occurred()) return NULL;
                Py_RETURN_NONE;
            }
            uint32_t id = (uint32_t)value;
            out[4 * i] = (uint8_t)id;
            out[4 * i + 1] = (uint8_t)(id >> 8);
            out[4 * i + 2] = (uint8_t)(id >> 16);
            out[4 * i + 3] = (uint8_t)(id >> 24);
        }
        return packed;
    }
    if (!PyObject_CheckBuffer(ids) || PyBytes_Check(ids) || PyByteArray_Check(ids))
        Py_RETURN_NONE;  /* (bytes-likes are refused by the Python path) */
    Py_buffer v;
    if (PyObject_GetBuffer(ids, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *packed = NULL;
    if (v.ndim == 1 && v.shape[0] <= limit) {
        packed = PyBytes_FromStringAndSize(NULL, 4 * v.shape[0]);
        if (packed != NULL && !narrow_buffer(&v, (uint8_t *)PyBytes_AS_STRING(packed))) {
            Py_DECREF(packed);
            packed = Py_None;
            Py_INCREF(packed);
        }
    } else {
        packed = Py_None;
        Py_INCREF(packed);
    }
    PyBuffer_Release(&v);
    return packed;
}

static PyMethodDef methods[] = {
    {"plain", plain, METH_VARARGS,
     "plain(tokens, block_size, cbor, parent): the digests of the full blocks without extra "
     "keys, concatenated (a bytearray), or None (the Python path must take them)."},
    {"bodies", bodies, METH_VARARGS,
     "bodies(parent, bodies, cbor): the digests of blocks with these payload bodies, "
     "concatenated (a bytearray)."},
    {"pages", pages, METH_VARARGS,
     "pages(seed, bodies, width): SGLang's page chain over the pages of `width` bytes in the "
     "buffer `bodies` (seed: b'' or 32 bytes); a list of 32-byte digests."},
    {"narrow_ids", narrow_ids, METH_VARARGS,
     "narrow_ids(token_ids, limit): the ids as uint32 little-endian bytes when every one of "
     "at most `limit` ids fits, else None (the Python path reads them)."},
    {"pages_job", pages_job, METH_VARARGS,
     "pages_job(seed, bodies, width[, pages]): pages() of the first pages pages (default: all) "
     "as a native job (bodies: bytes)."},
    {"page_digests", page_digests, METH_O,
     "page_digests(job): a pages job's digests, concatenated (bytes), once it ran."},
    {"ids_pages_job", ids_pages_job, METH_VARARGS,
     "ids_pages_job(seed, ids, page_size, pages): the chain of an integer array's first pages "
     "pages as a native job that also narrows and packs the ids (None: not such an array)."},
    {"ids_page_digests", ids_page_digests, METH_O,
     "ids_page_digests(job): an ids pages job's digests, concatenated (bytes), once it ran; "
     "None when some id does not fit 32 bits."},
    {"page_list", page_list, METH_VARARGS,
     "page_list(seed, bodies): SGLang's page chain over a sequence of page bodies (bytes); a "
     "list of 32-byte digests."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._hashing._chain_c",
    "The SHA-256 chains of vLLM's block hashes and SGLang's page hashes in C loops (see "
    "_chain_c.c).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__chain_c(void)
{
    return PyModule_Create(&module);
}
