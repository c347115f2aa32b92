/* vLLM 0.32 / 0.33's hit search in C: the compiled twin of _resolve/era_c.py's _Search (its
 * hit_for, with the unknown units every manager call notes), docs/design.md, "Compiled
 * extensions". The Python class is the reference; each function here names the method it
 * follows, and tests/test_resolve_search.py runs both on the same inputs.
 *
 *   hit_for(codes, present, known, num_tokens, lazy) -> (hit, depends) or None
 *       codes: the layout's rules as int64 (era_c._search_codes): hash block h, alignment,
 *           fine, multi_pass, the spec-group count, then per spec-group kind, block size,
 *           window blocks without and with EAGLE, attention chunk size, eagle, member count
 *           and the members' store group ids;
 *       present, known: per store group one bool per request hash (known: None when every
 *           presence is known), unknown units counting as present;
 *       depends: per spec-group the unknown units noted, ascending and unique, as int64 bytes.
 *   partial(codes, present, known, num_tokens, window, scouts) -> (hit, wanted) or None
 *       era_c.era_c_partial's search (lazy when window >= 0) and its choice of what to probe
 *       next: wanted is None when the hit is exact, else per store group the units to probe
 *       (int64 bytes; at most `window` per spec-group, a full-attention one with `scouts`
 *       units past a cut, each member group's own unknown ones).
 *       None: not searched here (a case where vLLM raises, a negative length, arrays of
 *       another shape, sizes past MAX_SIZE or a length past MAX_TOKENS): the Python search
 *       runs instead (and raises vLLM's error where there is one).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FULL = 0, WINDOW = 1, CHUNKED = 2, MAMBA = 3 };
#define MAX_GROUPS 64 /* spec-groups (a bit each in `verified`) and store groups */
#define MAX_SIZE ((Py_ssize_t)1 << 30)   /* sizes and hash counts searched here: products of */
#define MAX_TOKENS ((Py_ssize_t)1 << 61) /* two, and lengths plus a size, cannot overflow */

typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Units;

typedef struct {
    int kind, eagle;
    Py_ssize_t block, s, need_plain, need_eagle, chunk;
    const uint8_t *units, *known; /* merged over the members, by hash unit */
    uint8_t *own;                 /* the merged arrays when there are several members */
    Units depends;
} Group;

typedef struct {
    Py_ssize_t h, a, count;
    int fine, multi_pass, lazy, full_pending, bail, nomem, n;
    Group g[MAX_GROUPS];
} Search;

/* spec-group i's presence of chunk c: its last hash unit (_Search.chunks) */
#define CHUNK(g, c) ((g)->units[(c) * (g)->s + (g)->s - 1])
#define KNOWN_CHUNK(g, c) ((g)->known[(c) * (g)->s + (g)->s - 1])

/* _Search._note: one unknown unit that spec-group i's answer rests on */
static void
note(Search *S, int i, int64_t unit)
{
    Group *g = &S->g[i];
    if (g->depends.n == g->depends.cap) {
        Py_ssize_t cap = g->depends.cap ? 2 * g->depends.cap : 64;
        int64_t *v = realloc(g->depends.v, (size_t)cap * sizeof(int64_t));
        if (!v) {
            S->nomem = 1;
            return;
        }
        g->depends.v = v;
        g->depends.cap = cap;
    }
    g->depends.v[g->depends.n++] = unit;
    if (g->kind == FULL)
        S->full_pending = 1;
}

/* _Search._note_chunks of hits._unknown: the chunks in [lo, hi) not known yet */
static void
note_unknown_chunks(Search *S, int i, Py_ssize_t lo, Py_ssize_t hi)
{
    Group *g = &S->g[i];
    if (!g->known)
        return;
    for (Py_ssize_t c = lo; c < hi; c++)
        if (!KNOWN_CHUNK(g, c))
            note(S, i, (int64_t)((c + 1) * g->s - 1));
}

/* hits._align_down */
static Py_ssize_t
align_down(Py_ssize_t blocks, Py_ssize_t block, Py_ssize_t a)
{
    if (block == a)
        return blocks;
    while (blocks > 0 && (blocks * block) % a)
        blocks--;
    return blocks;
}

static Py_ssize_t
bail(Search *S)
{
    S->bail = 1;
    return -1;
}

/* _Search.manager: one spec-group's hit for max_length tokens (-1: not searched here) */
static Py_ssize_t
manager(Search *S, int i, Py_ssize_t max_length, int drop)
{
    Group *g = &S->g[i];
    if (max_length < 0)
        return bail(S);
    const Py_ssize_t block = g->block, s = g->s, h = S->h, a = S->a;
    const Py_ssize_t chunks = S->count / s; /* (the chunk view's length) */
    switch (g->kind) {
    case FULL: {
        Py_ssize_t limit = max_length / block < chunks ? max_length / block : chunks;
        Py_ssize_t blocks = 0;
        while (blocks < limit && CHUNK(g, blocks))
            blocks++;
        note_unknown_chunks(S, i, 0, blocks);
        if (!S->fine) { /* hits.full_attention_prefix_hit */
            if (drop && blocks)
                blocks--;
            return align_down(blocks, block, a) * block;
        }
        Py_ssize_t hit = blocks * block;
        if (block > h) { /* the next block's interior hash boundaries, highest first */
            Py_ssize_t first = blocks * s, stop = first + s - 1;
            if (stop > max_length / h)
                stop = max_length / h;
            if (stop > S->count)
                stop = S->count;
            for (Py_ssize_t u = stop - 1; u >= first; u--) {
                if (g->units[u]) {
                    hit = (u + 1) * h;
                    if (g->known && !g->known[u])
                        note(S, i, (int64_t)u);
                    break;
                }
            }
        }
        if (drop && hit > 0)
            hit -= h;
        return hit / a * a;
    }
    case WINDOW: { /* hits.sliding_window_hit */
        Py_ssize_t num_blocks = max_length / block;
        if (num_blocks > chunks)
            return bail(S); /* too few hashes: vLLM raises IndexError */
        Py_ssize_t need = drop ? g->need_eagle : g->need_plain;
        if (need < 1)
            need = 1;
        Py_ssize_t step = a / block, top; /* hits._top_opener */
        if (step < 1 && num_blocks > 0)
            return bail(S); /* (an alignment below the block: not a layout vLLM runs) */
        if (num_blocks <= 0)
            top = -1;
        else if (step == 1)
            top = num_blocks - 1;
        else
            top = drop ? (num_blocks - 1) / step * step : num_blocks / step * step - 1;
        Py_ssize_t blocks = -1;
        if (num_blocks > 0 && top >= need - 1) {
            /* the first opener from the top whose `need` blocks are all present: a miss at f
             * fails every opener whose run holds it, so the next one tried is below f */
            Py_ssize_t at = top;
            while (at >= need - 1) {
                Py_ssize_t miss = -1;
                for (Py_ssize_t c = at; c > at - need; c--) {
                    if (!CHUNK(g, c)) {
                        miss = c;
                        break;
                    }
                }
                if (miss < 0) {
                    blocks = at + 1;
                    note_unknown_chunks(S, i, at + 1 - need, at + 1);
                    break;
                }
                at -= ((at - miss) / step + 1) * step;
            }
        }
        if (blocks < 0) { /* no full run: the run the scan was counting at block 0 */
            Py_ssize_t leading = 0;
            while (leading < num_blocks && CHUNK(g, leading))
                leading++;
            note_unknown_chunks(S, i, 0, leading);
            Py_ssize_t below = top < leading ? top : top - ((top - leading) / step + 1) * step;
            blocks = align_down(below >= 0 ? below + 1 : 0, block, a);
        }
        if (drop && blocks)
            blocks = align_down(blocks - 1, block, a);
        return blocks * block;
    }
    case CHUNKED: { /* hits.chunked_local_hit (vLLM asserts no EAGLE, block == alignment) */
        if (drop || block != a)
            return bail(S);
        Py_ssize_t num_blocks = max_length / block;
        Py_ssize_t start = max_length / g->chunk * g->chunk / block;
        Py_ssize_t stop = num_blocks < chunks ? num_blocks : chunks, run = 0;
        while (start + run < stop && CHUNK(g, start + run))
            run++;
        if (start + run < num_blocks && start + run + 1 > chunks)
            return bail(S); /* too few hashes */
        note_unknown_chunks(S, i, start, start + run);
        return (start + run) * block;
    }
    default: { /* MAMBA */
        if (S->fine) { /* the rightmost present hash unit (never an EAGLE drop) */
            Py_ssize_t limit = max_length / h < S->count ? max_length / h : S->count;
            for (Py_ssize_t u = limit - 1; u >= 0; u--) {
                if (g->units[u]) {
                    if (g->known && !g->known[u])
                        note(S, i, (int64_t)u);
                    return (u + 1) * h;
                }
            }
            return 0;
        }
        Py_ssize_t num_blocks = max_length / block; /* hits.mamba_hit */
        if (num_blocks > chunks)
            return bail(S); /* too few hashes */
        for (Py_ssize_t c = num_blocks - 1; c >= 0; c--) {
            if (CHUNK(g, c) && (block == a || ((c + 1) * block) % a == 0)) {
                note_unknown_chunks(S, i, c, c + 1);
                return (c + 1) * block;
            }
        }
        return 0;
    }
    }
}

/* _Search.margin */
static Py_ssize_t
margin(const Search *S, const Group *g)
{
    if (S->fine && g->kind == FULL && g->block > S->h)
        return S->h;
    return g->block;
}

/* _Search.longest: the store coordinator's convergence loop (-1: not searched here) */
static Py_ssize_t
longest(Search *S, Py_ssize_t max_length)
{
    if (S->n == 1)
        return manager(S, 0, max_length, S->g[0].eagle);
    const Py_ssize_t cap = S->count * S->h;
    Py_ssize_t hit = max_length, full_hits[MAX_GROUPS];
    uint64_t has_full = 0, verified = 0;
    for (;;) {
        Py_ssize_t cur = hit;
        for (int i = 0; i < S->n; i++) {
            Group *g = &S->g[i];
            uint64_t bit = (uint64_t)1 << i;
            if (has_full & bit) {
                if (full_hits[i] < cur)
                    cur = full_hits[i];
                continue;
            }
            if (S->lazy && S->full_pending)
                return cur;
            int drop = g->eagle && !(verified & bit);
            Py_ssize_t limit = cur;
            if (drop && g->kind != MAMBA) {
                limit = cur + margin(S, g);
                if (limit > cap)
                    limit = cap;
            }
            Py_ssize_t found = manager(S, i, limit, drop);
            if (S->bail || S->nomem)
                return -1;
            if (drop)
                verified |= bit;
            else if (found < cur)
                verified = 0;
            cur = found;
            if (g->kind == FULL) {
                has_full |= bit;
                full_hits[i] = cur;
            }
        }
        if (cur >= hit)
            break;
        hit = cur;
        if (!S->multi_pass)
            break;
    }
    return hit;
}

/* _Search.hit_for */
static Py_ssize_t
search_hit_for(Search *S, Py_ssize_t num_tokens)
{
    const Py_ssize_t a = S->a;
    Py_ssize_t hit = longest(S, num_tokens / a * a);
    if (S->bail || S->nomem)
        return -1;
    if (S->lazy && S->full_pending)
        return hit;
    if (hit >= num_tokens) {
        Py_ssize_t usable = num_tokens > 0 ? (num_tokens - 1) / a * a : 0;
        if (usable <= 0)
            return 0;
        hit = longest(S, usable);
        if (S->bail || S->nomem)
            return -1;
    }
    return hit > 0 ? hit : 0;
}

static int
cmp_units(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

/* Buffers of the bool arrays, one per store group (count bools each). */
typedef struct {
    Py_buffer views[MAX_GROUPS];
    int held;
} Arrays;

static void
release(Arrays *arrays)
{
    for (int j = 0; j < arrays->held; j++)
        PyBuffer_Release(&arrays->views[j]);
    arrays->held = 0;
}

/* 1: filled; 0: not of the expected shape (no exception set); -1: an exception */
static int
arrays_of(PyObject *seq, Py_ssize_t groups, Py_ssize_t *count, Arrays *out)
{
    out->held = 0;
    if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != groups)
        return 0;
    for (Py_ssize_t j = 0; j < groups; j++) {
        Py_buffer *v = &out->views[j];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, j), v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_TypeError)
                && !PyErr_ExceptionMatches(PyExc_ValueError))
                return -1;
            PyErr_Clear();
            release(out);
            return 0;
        }
        out->held++;
        if (v->ndim != 1 || v->itemsize != 1 || !v->format || strcmp(v->format, "?") != 0
            || (*count >= 0 && v->len != *count)) {
            release(out);
            return 0;
        }
        *count = v->len;
    }
    return 1;
}

/* era_c.era_c_partial's choice of what to probe next from the units noted: per spec-group
 * at most `window` (the lowest; a full-attention group cut there also gets `scouts` units past
 * it), each member group's own unknown ones. Per store group, int64 bytes. */
static PyObject *
wanted_units(Search *S, Arrays *known, Py_ssize_t groups, Py_ssize_t window, Py_ssize_t scouts,
             const int64_t *members_of[], const Py_ssize_t members_count[])
{
    PyObject *out = PyTuple_New(groups);
    if (!out)
        return NULL;
    for (Py_ssize_t j = 0; j < groups; j++) {
        PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
        if (!empty) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, j, empty);
    }
    for (int i = 0; i < S->n; i++) {
        const Units *d = &S->g[i].depends; /* (sorted, once each) */
        Py_ssize_t m = d->n, keep = m, step = 1, ahead_from = m, ahead_to = m;
        if (!m)
            continue;
        if (window >= 0 && m > window) {
            keep = window;
            if (scouts && S->g[i].kind == FULL) {
                step = window / 2 > 1 ? window / 2 : 1;
                ahead_from = window + step - 1;
                ahead_to = window + scouts * step < m ? window + scouts * step : m;
            }
        }
        int64_t *mine = malloc((size_t)m * sizeof(int64_t));
        if (!mine) {
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t k = 0; k < members_count[i]; k++) {
            int64_t gid = members_of[i][k];
            const uint8_t *kn = known->views[gid].buf;
            Py_ssize_t n = 0;
            for (Py_ssize_t j = 0; j < keep; j++)
                if (!kn[d->v[j]])
                    mine[n++] = d->v[j];
            for (Py_ssize_t j = ahead_from; j < ahead_to; j += step)
                if (!kn[d->v[j]])
                    mine[n++] = d->v[j];
            if (!n)
                continue;
            PyObject *b = PyBytes_FromStringAndSize((const char *)mine, n * (Py_ssize_t)sizeof(int64_t));
            if (!b) {
                free(mine);
                Py_DECREF(out);
                return NULL;
            }
            PyObject *was = PyTuple_GET_ITEM(out, gid);
            PyTuple_SET_ITEM(out, gid, b);
            Py_DECREF(was);
        }
        free(mine);
    }
    return out;
}

static PyObject *
search(PyObject *args, int partial)
{
    Py_buffer codes;
    PyObject *present_obj, *known_obj, *result = NULL;
    Py_ssize_t num_tokens, window = -1, scouts = 0;
    int lazy;
    const int64_t *members_of[MAX_GROUPS];
    Py_ssize_t members_count[MAX_GROUPS];
    if (partial) {
        if (!PyArg_ParseTuple(args, "y*OOnnn:partial", &codes, &present_obj, &known_obj,
                              &num_tokens, &window, &scouts))
            return NULL;
        if (window < -1 || window > MAX_SIZE || scouts < 0 || scouts > 64) {
            PyBuffer_Release(&codes);
            Py_RETURN_NONE; /* (not a round's window or scouts: the Python code's) */
        }
        lazy = window >= 0;
    } else if (!PyArg_ParseTuple(args, "y*OOnp:hit_for", &codes, &present_obj, &known_obj,
                                 &num_tokens, &lazy)) {
        return NULL;
    }
    Search *S = calloc(1, sizeof(Search));
    Arrays present = {.held = 0}, known = {.held = 0};
    if (!S) {
        PyBuffer_Release(&codes);
        return PyErr_NoMemory();
    }
    const int64_t *c = codes.buf, *end = c + codes.len / (Py_ssize_t)sizeof(int64_t);
    int ok = 0;
    if (codes.len % (Py_ssize_t)sizeof(int64_t) || end - c < 5 || num_tokens < 0)
        goto unsupported;
    S->h = (Py_ssize_t)c[0];
    S->a = (Py_ssize_t)c[1];
    S->fine = (int)c[2];
    S->multi_pass = (int)c[3];
    S->n = (int)c[4];
    S->lazy = lazy;
    c += 5;
    if (S->h <= 0 || S->h > MAX_SIZE || S->a <= 0 || S->a > MAX_SIZE || S->n < 1
        || S->n > MAX_GROUPS || !PyTuple_Check(present_obj) || num_tokens > MAX_TOKENS)
        goto unsupported;
    Py_ssize_t groups = PyTuple_GET_SIZE(present_obj), count = -1;
    uint64_t claimed = 0;
    if (groups < 1 || groups > MAX_GROUPS)
        goto unsupported;
    int got = arrays_of(present_obj, groups, &count, &present);
    if (got > 0 && known_obj != Py_None)
        got = arrays_of(known_obj, groups, &count, &known);
    if (got < 0)
        goto done;
    if (got == 0)
        goto unsupported;
    if (count > MAX_SIZE)
        goto unsupported;
    S->count = count;
    for (int i = 0; i < S->n; i++) { /* _Search.__init__: presence merged over the members */
        Group *g = &S->g[i];
        if (end - c < 7)
            goto unsupported;
        g->kind = (int)c[0];
        g->block = (Py_ssize_t)c[1];
        g->need_plain = (Py_ssize_t)c[2];
        g->need_eagle = (Py_ssize_t)c[3];
        g->chunk = (Py_ssize_t)c[4];
        g->eagle = (int)c[5];
        Py_ssize_t members = (Py_ssize_t)c[6];
        c += 7;
        if (members < 1 || end - c < members || g->kind < FULL || g->kind > MAMBA
            || g->block < S->h || g->block > MAX_SIZE || g->block % S->h
            || (g->kind == CHUNKED && (g->chunk <= 0 || g->chunk > MAX_SIZE))
            || g->need_plain < 0 || g->need_plain > MAX_SIZE || g->need_eagle < 0
            || g->need_eagle > MAX_SIZE)
            goto unsupported;
        g->s = g->block / S->h;
        for (Py_ssize_t m = 0; m < members; m++) { /* each store group in one spec-group */
            if (c[m] < 0 || c[m] >= groups || (claimed & ((uint64_t)1 << c[m])))
                goto unsupported;
            claimed |= (uint64_t)1 << c[m];
        }
        members_of[i] = c;
        members_count[i] = members;
        const uint8_t *first = present.views[c[0]].buf;
        const uint8_t *first_known = known.held ? known.views[c[0]].buf : NULL;
        if (members == 1) {
            g->units = first;
            g->known = first_known;
        } else {
            g->own = malloc((size_t)(count ? 2 * count : 1));
            if (!g->own) {
                PyErr_NoMemory();
                goto done;
            }
            uint8_t *units = g->own, *kn = g->own + count;
            memcpy(units, first, (size_t)count);
            if (first_known)
                memcpy(kn, first_known, (size_t)count);
            for (Py_ssize_t m = 1; m < members; m++) {
                const uint8_t *p = present.views[c[m]].buf;
                for (Py_ssize_t u = 0; u < count; u++) /* (any non-zero byte is True) */
                    units[u] = units[u] && p[u];
                if (first_known) {
                    const uint8_t *k = known.views[c[m]].buf;
                    for (Py_ssize_t u = 0; u < count; u++)
                        kn[u] = kn[u] && k[u];
                }
            }
            if (first_known)
                for (Py_ssize_t u = 0; u < count; u++)
                    kn[u] = kn[u] || !units[u];
            g->units = units;
            g->known = first_known ? kn : NULL;
        }
        c += members;
    }
    Py_ssize_t hit = search_hit_for(S, num_tokens);
    if (S->nomem) {
        PyErr_NoMemory();
        goto done;
    }
    if (S->bail)
        goto unsupported;
    int noted = 0;
    for (int i = 0; i < S->n; i++) {
        Units *d = &S->g[i].depends;
        Py_ssize_t kept = 0;
        if (d->n) { /* ascending and once each (several calls may note one unit) */
            qsort(d->v, (size_t)d->n, sizeof(int64_t), cmp_units);
            for (Py_ssize_t j = 0; j < d->n; j++)
                if (!kept || d->v[kept - 1] != d->v[j])
                    d->v[kept++] = d->v[j];
        }
        d->n = kept;
        noted = noted || kept;
    }
    if (partial) {
        if (!noted) {
            result = Py_BuildValue("(nO)", hit, Py_None);
            goto done;
        }
        if (!known.held)
            goto unsupported;
        PyObject *wanted = wanted_units(S, &known, groups, window, scouts, members_of,
                                        members_count);
        if (wanted)
            result = Py_BuildValue("(nN)", hit, wanted);
        goto done;
    }
    PyObject *depends = PyTuple_New(S->n);
    if (!depends)
        goto done;
    for (int i = 0; i < S->n; i++) {
        Units *d = &S->g[i].depends;
        Py_ssize_t kept = d->n;
        PyObject *b = PyBytes_FromStringAndSize((const char *)d->v, kept * (Py_ssize_t)sizeof(int64_t));
        if (!b) {
            Py_DECREF(depends);
            goto done;
        }
        PyTuple_SET_ITEM(depends, i, b);
    }
    result = Py_BuildValue("(nN)", hit, depends);
    goto done;
unsupported:
    ok = 1;
done:
    for (int i = 0; i < MAX_GROUPS; i++) {
        free(S->g[i].own);
        free(S->g[i].depends.v);
    }
    free(S);
    release(&present);
    release(&known);
    PyBuffer_Release(&codes);
    if (ok && !result && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
}

static PyObject *
hit_for(PyObject *self, PyObject *args)
{
    return search(args, 0);
}

static PyObject *
partial(PyObject *self, PyObject *args)
{
    return search(args, 1);
}

static PyMethodDef methods[] = {
    {"partial", partial, METH_VARARGS,
     "partial(codes, present, known, num_tokens, window, scouts): era_c_partial's search and "
     "its choice of units: (hit, None) when exact, else (hit, per store group the units to "
     "probe next as int64 bytes); None where the Python search must run. window < 0: none."},
    {"hit_for", hit_for, METH_VARARGS,
     "hit_for(codes, present, known, num_tokens, lazy): vLLM 0.32 / 0.33's hit and, per "
     "spec-group, the unknown units it rests on; None where the Python search must run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aio_mclookup._resolve._search_c",
    "vLLM 0.32 / 0.33's hit search in C (see _search_c.c).", -1, methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__search_c(void)
{
    return PyModule_Create(&module);
}
