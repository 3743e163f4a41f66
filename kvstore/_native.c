/* The few loops of kvstore's lookup path that pay for compiled code.

   `prefix_rows` (kvstore.table) walks a packed chain (N x 16-byte hashes) through the table's key slots
   and writes the row of each key of the longest indexed prefix, stopping at the first
   key that is absent. It is the loop `BlockTable.find` runs per key, over the same
   arrays, with the same slot hash: the numpy batch probe (`find_rows`) stays as the
   reference and as the fallback where this module was not built.

   A key is looked for first in the row after the previous key's: a chain put in one
   call fills consecutive rows, whose columns are then read in order, from cache. Keys
   not found that way are probed in groups: the slots of a group are prefetched, then the
   rows its slots name, then each key is checked in order, so the cache misses of a
   group's keys overlap instead of coming one after another (a table of millions of
   blocks is far larger than the cache, and each key costs a miss on its slot and one on
   its row).

   `top_tiers` (kvstore.store) reads the top tier of each row a lookup found: one byte
   per block, the form a lookup's answer carries.

   `rows_append` and `rows_compact` (kvstore.policies.rows) are a policy's appends and
   its log's compaction steps: a lookup's touch of 1,000 rows, which in array steps
   gathers and scatters the rows' list and position arrays several times over.

   `join_hashes` (kvstore.client) packs a list of 16-byte hashes into N x 16 bytes, and
   `pack_u32` (kvstore.hashing) a list of token ids into little-endian u32, each in one
   pass that checks every item.

   `chain_hashes` (kvstore.hashing) computes a token chain's block hashes, and
   `copy_hash` (the SDK's shared-memory plane) copies a block and hashes the copy in
   cache-sized pieces, each hashed while it is still in cache, so the copy is read once
   from cache rather than again from memory. Both call XXH3 in the library that the
   `xxhash` package already loaded (`bind_xxhash`); they are offered only once that
   binding has passed a check against XXH3's published empty-input values.

   Arrays come in through the buffer protocol (numpy arrays, memoryviews), so the module
   needs neither numpy's headers nor a particular numpy at build time. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <dlfcn.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define K1 0x9E3779B97F4A7C15ULL
#define C1 0xFF51AFD7ED558CCDULL

/* Keys probed together (see the module note). */
#define GROUP 32

/* How far ahead the loops over rows in no particular order (a touch, a compaction step,
   a lookup's tiers) prefetch the columns of the rows to come: each such row is a likely
   cache miss in a table of millions, and the misses then overlap. */
#define AHEAD 16

/* Linear probing from slot i for the key; its row or -1 (`BlockTable._walk`). */
static int64_t
walk(const int64_t *S, uint64_t mask, Py_ssize_t nslots, const uint64_t *H0, const uint64_t *H1,
     const uint32_t *NS, Py_ssize_t nrows, uint64_t i, int64_t tag, uint64_t q0, uint64_t q1,
     int check_ns, unsigned int ns)
{
    for (Py_ssize_t steps = 0; steps < nslots; steps++) {
        int64_t e = S[i];
        if (e == 0)
            return -1;
        if ((e >> 32) == tag) {
            int64_t r = (e & 0xFFFFFFFFLL) - 1;
            if (r >= 0 && r < nrows && H0[r] == q0 && H1[r] == q1 && (!check_ns || NS[r] == ns))
                return r;
        }
        i = (i + 1) & mask;
    }
    return -1;
}

static int
get(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items",
                     what, view->len, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* prefix_rows(packed, slots, h0, h1, ns_col, shift, ns, ns_fp, check_ns, out, every=False,
               flags=None, indexed=0) -> count

   packed: N x 16 bytes (h0, h1 little-endian u64 each); slots: i64 key slots, a power of
   two long, each (tag << 32) | (row + 1), 0 when empty; h0, h1: u64 columns; ns_col: u32
   column; shift: 64 - log2(len(slots)); out: writable i64, at least N long. With `every`,
   an absent key does not stop the walk: its entry in `out` is -1 and the count is N
   (`BlockTable.find_rows`).

   With `flags` (the u8 row flags) and `indexed` (the flag of a row in the key table), a
   key is first looked for in the row after the previous key's: the blocks of a chain put
   in one call sit in consecutive rows, and those rows' columns are read in order, from
   cache, where each probe of the key table is a miss. A key found there is the one the
   key table names, as an indexed key has exactly one row. From the first key not found
   there, a group of keys is probed in the key table as above, and the walk in row order
   resumes after it. */
static PyObject *
prefix_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_packed, *o_slots, *o_h0, *o_h1, *o_ns, *o_out, *o_flags = Py_None;
    unsigned int shift, ns, indexed = 0;
    unsigned long long ns_fp;
    int check_ns, every = 0;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOIIKpO|pOI", &o_packed, &o_slots, &o_h0, &o_h1, &o_ns,
                          &shift, &ns, &ns_fp, &check_ns, &o_out, &every, &o_flags, &indexed))
        return NULL;
    Py_buffer packed, slots, h0, h1, nsc, out, fl;
    fl.obj = NULL;
    if (get(o_packed, &packed, 16, 0, "packed hashes") < 0)
        return NULL;
    if (get(o_slots, &slots, 8, 0, "slots") < 0)
        goto e0;
    if (get(o_h0, &h0, 8, 0, "h0") < 0)
        goto e1;
    if (get(o_h1, &h1, 8, 0, "h1") < 0)
        goto e2;
    if (get(o_ns, &nsc, 4, 0, "ns") < 0)
        goto e3;
    if (get(o_out, &out, 8, 1, "out") < 0)
        goto e4;
    if (o_flags != Py_None && get(o_flags, &fl, 1, 0, "flags") < 0)
        goto e5;

    Py_ssize_t n = packed.len / 16, nslots = slots.len / 8, nrows = h0.len / 8;
    Py_ssize_t found = 0;
    if (out.len / 8 < n) {
        PyErr_SetString(PyExc_ValueError, "out is shorter than the chain");
        goto done;
    }
    if (nslots == 0 || (nslots & (nslots - 1)) != 0 || shift == 0 || shift > 64
        || ((Py_ssize_t)1 << (64 - shift)) != nslots || h1.len / 8 < nrows || nsc.len / 4 < nrows
        || (fl.obj != NULL && (fl.len < nrows || indexed == 0 || indexed > 255))) {
        PyErr_SetString(PyExc_ValueError, "the slots and columns do not describe one key table");
        goto done;
    }
    {
        const unsigned char *p = (const unsigned char *)packed.buf;
        const int64_t *S = (const int64_t *)slots.buf;
        const uint64_t *H0 = (const uint64_t *)h0.buf, *H1 = (const uint64_t *)h1.buf;
        const uint32_t *NS = (const uint32_t *)nsc.buf;
        const uint8_t *F = fl.obj != NULL ? (const uint8_t *)fl.buf : NULL;
        int64_t *o = (int64_t *)out.buf;
        const uint64_t mask = (uint64_t)nslots - 1;
        uint64_t home[GROUP];
        int64_t cand[GROUP];
        int64_t prev = -1; /* the row of the key before, -1 when absent or not yet probed */
        while (found < n) {
            if (F != NULL && prev >= 0) {
                /* The keys that sit in the rows after the previous key's, one after another. */
                while (found < n && prev + 1 < nrows) {
                    int64_t r = prev + 1;
                    uint64_t q0, q1;
                    memcpy(&q0, p + 16 * found, 8);
                    memcpy(&q1, p + 16 * found + 8, 8);
                    if (!(H0[r] == q0 && H1[r] == q1 && (F[r] & indexed) && (!check_ns || NS[r] == ns)))
                        break;
                    o[found++] = prev = r;
                }
                if (found == n)
                    break;
            }
            const unsigned char *q = p + 16 * found;
            Py_ssize_t g = n - found < GROUP ? n - found : GROUP;
            if (F != NULL && found == 0)
                g = 1; /* the first key alone: the keys after it are most often in the rows after */
            for (Py_ssize_t j = 0; j < g; j++) {
                uint64_t q0, q1;
                memcpy(&q0, q + 16 * j, 8); /* x86-64 and aarch64 are little-endian */
                memcpy(&q1, q + 16 * j + 8, 8);
                home[j] = (q0 ^ ns_fp ^ (q1 * K1)) * C1;
                __builtin_prefetch(&S[home[j] >> shift]);
            }
            for (Py_ssize_t j = 0; j < g; j++) {
                /* The row of the first slot from home whose tag matches (home is where most
                   keys sit; the few slots after it are mostly in the same cache line), so
                   that its columns are fetched with the others'; checked below. */
                uint64_t i = home[j] >> shift;
                const int64_t tag = (int64_t)(home[j] & 0x7FFFFFFFULL);
                cand[j] = -1;
                for (int k = 0; k < 8; k++, i = (i + 1) & mask) {
                    int64_t e = S[i];
                    if (e == 0)
                        break;
                    if ((e >> 32) == tag) {
                        int64_t r = (e & 0xFFFFFFFFLL) - 1;
                        if (r >= 0 && r < nrows) {
                            cand[j] = r;
                            __builtin_prefetch(&H0[r]);
                            __builtin_prefetch(&H1[r]);
                        }
                        break;
                    }
                }
            }
            for (Py_ssize_t j = 0; j < g; j++, found++) {
                uint64_t q0, q1;
                memcpy(&q0, q + 16 * j, 8);
                memcpy(&q1, q + 16 * j + 8, 8);
                int64_t r = cand[j];
                if (!(r >= 0 && H0[r] == q0 && H1[r] == q1 && (!check_ns || NS[r] == ns)))
                    r = walk(S, mask, nslots, H0, H1, NS, nrows, home[j] >> shift,
                             (int64_t)(home[j] & 0x7FFFFFFFULL), q0, q1, check_ns, ns);
                if (r < 0 && !every)
                    goto done_probe;
                o[found] = prev = r;
            }
        }
    }
done_probe:
    result = PyLong_FromSsize_t(found);
done:
    if (fl.obj != NULL)
        PyBuffer_Release(&fl);
e5:
    PyBuffer_Release(&out);
e4:
    PyBuffer_Release(&nsc);
e3:
    PyBuffer_Release(&h1);
e2:
    PyBuffer_Release(&h0);
e1:
    PyBuffer_Release(&slots);
e0:
    PyBuffer_Release(&packed);
    return result;
}

/* The arguments of `place_rows` and `unindex_rows`: rows (i64) and the key table they
   belong to: slots (i64, written), h0, h1 (u64 columns), ns_col (u32 column), ns_fp (u64,
   each namespace's fingerprint by its id), shift (64 - log2(len(slots))). */
typedef struct {
    Py_buffer buf[6]; /* rows, slots, h0, h1, ns_col, ns_fp */
    int held;         /* how many of buf are held */
    unsigned int shift;
    Py_ssize_t n, nslots, nrows;
    const int64_t *R;
    int64_t *S;
    const uint64_t *H0, *H1, *FP;
    const uint32_t *NS;
    uint64_t mask;
} KeyTable;

static void
table_release(KeyTable *t)
{
    while (t->held > 0)
        PyBuffer_Release(&t->buf[--t->held]);
}

/* Parse and check the arguments (every row inside the columns, with a namespace that has
   a fingerprint) before anything is written; -1 with an exception, nothing held, if not. */
static int
table_get(PyObject *args, KeyTable *t)
{
    static const Py_ssize_t itemsize[6] = {8, 8, 8, 8, 4, 8};
    static const char *const what[6] = {"rows", "slots", "h0", "h1", "ns", "ns_fp"};
    PyObject *o[6];
    t->held = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOI", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &t->shift))
        return -1;
    for (int i = 0; i < 6; i++) {
        if (get(o[i], &t->buf[i], itemsize[i], i == 1, what[i]) < 0) {
            table_release(t);
            return -1;
        }
        t->held++;
    }
    t->n = t->buf[0].len / 8;
    t->nslots = t->buf[1].len / 8;
    t->nrows = t->buf[2].len / 8;
    Py_ssize_t nfp = t->buf[5].len / 8;
    if (t->nslots == 0 || (t->nslots & (t->nslots - 1)) != 0 || t->shift == 0 || t->shift > 64
        || ((Py_ssize_t)1 << (64 - t->shift)) != t->nslots || t->buf[3].len / 8 < t->nrows
        || t->buf[4].len / 4 < t->nrows) {
        PyErr_SetString(PyExc_ValueError, "the slots and columns do not describe one key table");
        table_release(t);
        return -1;
    }
    t->R = (const int64_t *)t->buf[0].buf;
    t->S = (int64_t *)t->buf[1].buf;
    t->H0 = (const uint64_t *)t->buf[2].buf;
    t->H1 = (const uint64_t *)t->buf[3].buf;
    t->NS = (const uint32_t *)t->buf[4].buf;
    t->FP = (const uint64_t *)t->buf[5].buf;
    t->mask = (uint64_t)t->nslots - 1;
    for (Py_ssize_t j = 0; j < t->n; j++) {
        int64_t r = t->R[j];
        if (r < 0 || r >= t->nrows || r >= 0xFFFFFFFFLL || t->NS[r] >= (uint64_t)nfp) {
            PyErr_Format(PyExc_ValueError, "row %lld is not a row of this table", (long long)r);
            table_release(t);
            return -1;
        }
    }
    return 0;
}

/* The slot hash of row r (`BlockTable._hash_of_rows`). */
static uint64_t
row_hash(const KeyTable *t, int64_t r)
{
    return (t->H0[r] ^ t->FP[t->NS[r]] ^ (t->H1[r] * K1)) * C1;
}

/* place_rows(rows, slots, h0, h1, ns_col, ns_fp, shift) -> count

   Insert `rows` (indexed keys absent from the table and distinct) into the key slots,
   each at the first empty slot from its home, as `BlockTable.index_row` does one row at
   a time: the numpy placement (`BlockTable._place`) stays as the reference and the
   fallback. The caller keeps the table at most half full, so every probe ends at an
   empty slot. */
static PyObject *
place_rows(PyObject *self, PyObject *args)
{
    (void)self;
    KeyTable t;
    if (table_get(args, &t) < 0)
        return NULL;
    PyObject *result = NULL;
    for (Py_ssize_t j = 0; j < t.n; j++) {
        int64_t r = t.R[j];
        uint64_t hv = row_hash(&t, r);
        uint64_t i = hv >> t.shift;
        Py_ssize_t steps = 0;
        while (t.S[i] != 0) {
            i = (i + 1) & t.mask;
            if (++steps == t.nslots) {
                PyErr_SetString(PyExc_ValueError, "the key table is full");
                goto done;
            }
        }
        t.S[i] = ((int64_t)(hv & 0x7FFFFFFFULL) << 32) | (r + 1);
    }
    result = PyLong_FromSsize_t(t.n);
done:
    table_release(&t);
    return result;
}

/* unindex_rows(rows, slots, h0, h1, ns_col, ns_fp, shift) -> count

   Take `rows` (each indexed) out of the key slots by backward-shift deletion, one after
   another, as `BlockTable.unindex_row` does: an entry after the hole moves back into it
   unless its home lies cyclically in (hole, entry]. Arguments as `place_rows`. */
static PyObject *
unindex_rows(PyObject *self, PyObject *args)
{
    (void)self;
    KeyTable t;
    if (table_get(args, &t) < 0)
        return NULL;
    PyObject *result = NULL;
    for (Py_ssize_t j = 0; j < t.n; j++) {
        int64_t r = t.R[j];
        uint64_t i = row_hash(&t, r) >> t.shift;
        Py_ssize_t steps = 0;
        while ((t.S[i] & 0xFFFFFFFFLL) != r + 1) {
            if (t.S[i] == 0 || ++steps == t.nslots) {
                PyErr_Format(PyExc_ValueError, "row %lld is not indexed", (long long)r);
                goto done;
            }
            i = (i + 1) & t.mask;
        }
        uint64_t hole = i, k = i;
        for (;;) {
            k = (k + 1) & t.mask;
            int64_t e = t.S[k];
            if (e == 0)
                break;
            int64_t er = (e & 0xFFFFFFFFLL) - 1;
            if (er < 0 || er >= t.nrows || t.NS[er] >= (uint64_t)(t.buf[5].len / 8)) {
                PyErr_SetString(PyExc_ValueError, "the key table names a row outside its columns");
                goto done;
            }
            uint64_t home = row_hash(&t, er) >> t.shift;
            /* Move back into the hole unless home lies cyclically in (hole, k]. */
            if ((hole < k && (home <= hole || home > k)) || (hole > k && (home <= hole && home > k))) {
                t.S[hole] = e;
                hole = k;
            }
        }
        t.S[hole] = 0;
    }
    result = PyLong_FromSsize_t(t.n);
done:
    table_release(&t);
    return result;
}

/* join_hashes(hashes) -> bytes | None

   hashes: a list or tuple. The N x 16 bytes of its items when every one is a bytes
   object of exactly 16 bytes; None otherwise (the caller then finds which item is wrong,
   or packs other bytes-like items itself). */
static PyObject *
join_hashes(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != 16) {
            Py_DECREF(seq);
            Py_RETURN_NONE;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, 16 * n);
    if (out != NULL) {
        char *dst = PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy(dst + 16 * i, PyBytes_AS_STRING(items[i]), 16);
    }
    Py_DECREF(seq);
    return out;
}

/* pack_u32(items) -> bytes | None

   items: a list or tuple. Its items as little-endian u32 (token ids) when every one is
   an int in [0, 2**32); None otherwise (the caller's Python path then says what is
   wrong). */
static PyObject *
pack_u32(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyList_CheckExact(arg) && !PyTuple_CheckExact(arg))
        Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(arg, "items must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_Check(item))
            goto refuse;
        unsigned long long v = PyLong_AsUnsignedLongLong(item);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear(); /* negative, or past 64 bits */
            goto refuse;
        }
        if (v > 0xFFFFFFFFULL)
            goto refuse;
        dst[4 * i] = (unsigned char)v;
        dst[4 * i + 1] = (unsigned char)(v >> 8);
        dst[4 * i + 2] = (unsigned char)(v >> 16);
        dst[4 * i + 3] = (unsigned char)(v >> 24);
    }
    Py_DECREF(seq);
    return out;
refuse:
    Py_DECREF(seq);
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* XXH3, bound at run time from the xxhash package's own extension (see the module note).
   Prototypes as xxhash 0.8 declares them; XXH128_hash_t is two u64 returned by value. */
typedef struct { uint64_t low64, high64; } xxh128_t;
typedef uint64_t (*xxh64_fn)(const void *, size_t);
typedef xxh128_t (*xxh128_fn)(const void *, size_t);
typedef void *(*state_new_fn)(void);
typedef int (*state_free_fn)(void *);
typedef int (*state_reset_fn)(void *);
typedef int (*state_update_fn)(void *, const void *, size_t);
typedef uint64_t (*state_digest_fn)(const void *);

static struct {
    xxh64_fn h64;
    xxh128_fn h128;
    state_new_fn state_new;
    state_free_fn state_free;
    state_reset_fn reset;
    state_update_fn update;
    state_digest_fn digest;
    int bound;
} X;

/* The first of `names` (NULL-ended) that `lib` has. */
static void *
sym(void *lib, const char *const *names)
{
    for (; *names != NULL; names++) {
        void *f = dlsym(lib, *names);
        if (f != NULL)
            return f;
    }
    return NULL;
}

/* bind_xxhash(path) -> bool

   path: the file of an already loaded library that exports XXH3 (the xxhash package's
   extension). Binds its functions (the run-time dispatching variants where it has them)
   and checks them against XXH3's published values for the empty input; True when bound. */
static PyObject *
bind_xxhash(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL)
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        Py_RETURN_FALSE;
    static const char *const h64[] = {"XXH3_64bits_dispatch", "XXH3_64bits", NULL};
    static const char *const h128[] = {"XXH3_128bits_dispatch", "XXH3_128bits", NULL};
    static const char *const state_new[] = {"XXH3_createState", NULL};
    static const char *const state_free[] = {"XXH3_freeState", NULL};
    static const char *const reset[] = {"XXH3_64bits_reset", NULL};
    static const char *const update[] = {"XXH3_64bits_update_dispatch", "XXH3_64bits_update", NULL};
    static const char *const digest[] = {"XXH3_64bits_digest", NULL};
    X.h64 = (xxh64_fn)sym(lib, h64);
    X.h128 = (xxh128_fn)sym(lib, h128);
    X.state_new = (state_new_fn)sym(lib, state_new);
    X.state_free = (state_free_fn)sym(lib, state_free);
    X.reset = (state_reset_fn)sym(lib, reset);
    X.update = (state_update_fn)sym(lib, update);
    X.digest = (state_digest_fn)sym(lib, digest);
    dlclose(lib); /* the library stays loaded: the xxhash package holds it */
    X.bound = 0;
    if (!X.h64 || !X.h128 || !X.state_new || !X.state_free || !X.reset || !X.update || !X.digest)
        Py_RETURN_FALSE;
    xxh128_t e = X.h128("", 0);
    if (X.h64("", 0) != 0x2D06800538D394C2ULL || e.high64 != 0x99AA06D3014798D8ULL ||
        e.low64 != 0x6001C324468D497FULL)
        Py_RETURN_FALSE;
    void *st = X.state_new();
    if (st == NULL)
        return PyErr_NoMemory();
    int ok = X.reset(st) == 0 && X.update(st, "", 0) == 0 && X.digest(st) == 0x2D06800538D394C2ULL;
    X.state_free(st);
    if (!ok)
        Py_RETURN_FALSE;
    X.bound = 1;
    Py_RETURN_TRUE;
}

static int
need_xxhash(void)
{
    if (!X.bound)
        PyErr_SetString(PyExc_RuntimeError, "XXH3 is not bound (bind_xxhash)");
    return X.bound;
}

static void
put_be64(unsigned char *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

/* Chains at least this long are hashed without the GIL. */
#define CHAIN_NOGIL_BLOCKS 64

/* Hash n blocks of `step` token bytes from src into dst (16 bytes each); buf holds the
   namespace (the chain's link), the count and the empty extra's length around room for
   one block's tokens. */
static void
chain_loop(unsigned char *buf, Py_ssize_t step, const unsigned char *src, unsigned char *dst, Py_ssize_t n)
{
    for (Py_ssize_t b = 0; b < n; b++) {
        memcpy(buf + 20, src + b * step, (size_t)step);
        xxh128_t h = X.h128(buf, (size_t)(step + 24));
        put_be64(dst + 16 * b, h.high64);
        put_be64(dst + 16 * b + 8, h.low64);
        memcpy(buf, dst + 16 * b, 16);
    }
}

/* chain_hashes(namespace, packed, block_size_tokens) -> bytes

   The chained hashes (N x 16 bytes, XXH3-128 canonical) of every full block of `packed`
   (little-endian u32 token ids), each block without extra bytes:
   h_i = H(h_{i-1} || u32le(block_size_tokens) || tokens_i || u32le(0)), h_-1 = namespace. */
static PyObject *
chain_hashes(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer ns, tokens;
    Py_ssize_t bst;
    if (!need_xxhash())
        return NULL;
    if (!PyArg_ParseTuple(args, "y*y*n", &ns, &tokens, &bst))
        return NULL;
    PyObject *out = NULL;
    if (ns.len != 16) {
        PyErr_Format(PyExc_ValueError, "namespace id must be 16 bytes, got %zd", ns.len);
        goto done;
    }
    if (bst <= 0 || (unsigned long long)bst > 0xFFFFFFFFULL || bst > (PY_SSIZE_T_MAX - 24) / 4) {
        PyErr_Format(PyExc_ValueError, "block_size_tokens must be positive and fit in 32 bits, got %zd", bst);
        goto done;
    }
    Py_ssize_t step = 4 * bst, n = tokens.len / step;
    out = PyBytes_FromStringAndSize(NULL, 16 * n);
    if (out == NULL)
        goto done;
    unsigned char *buf = PyMem_RawMalloc((size_t)(step + 24));
    if (buf == NULL) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *src = tokens.buf;
    uint32_t count = (uint32_t)bst;
    memcpy(buf, ns.buf, 16);
    for (int i = 0; i < 4; i++) {
        buf[16 + i] = (unsigned char)(count >> (8 * i));
        buf[20 + step + i] = 0;
    }
    if (n >= CHAIN_NOGIL_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        chain_loop(buf, step, src, dst, n);
        Py_END_ALLOW_THREADS
    } else {
        chain_loop(buf, step, src, dst, n);
    }
    PyMem_RawFree(buf);
done:
    PyBuffer_Release(&ns);
    PyBuffer_Release(&tokens);
    return out;
}

/* Bytes copied and then hashed at a time: small enough that the copy is still in the
   first-level cache when it is hashed. */
#ifndef COPY_PIECE
#define COPY_PIECE (64 * 1024)
#endif

/* Copy n bytes. glibc's memcpy moves mid-sized blocks (tens of KiB) with `rep movsb`,
   which some x86 cores run several times slower when the destination sits a few bytes
   past the source modulo 4 KiB (a page-aligned slot copied into a buffer from malloc,
   whose data starts 16 bytes into its page): a plain vector loop has no such case. */
static void
copy_piece(unsigned char *d, const unsigned char *s, size_t n)
{
#if defined(__SSE2__)
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_storeu_si128((__m128i *)(d + i), a);
        _mm_storeu_si128((__m128i *)(d + i + 16), b);
        _mm_storeu_si128((__m128i *)(d + i + 32), c);
        _mm_storeu_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}

/* Copy n bytes with stores that bypass the cache where dst is 16-byte aligned (the
   destination is not read back: a cached store would first read each line of it from
   memory, a third of the copy's traffic). The caller fences before it publishes. */
static void
stream_piece(unsigned char *d, const unsigned char *s, size_t n)
{
#if defined(__SSE2__)
    size_t i = 0;
    if (((uintptr_t)d & 15) == 0) {
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
    }
    copy_piece(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}

/* copy_hash(dst, src, of_source=False) -> int

   Copy `src` into `dst` (equal lengths) and return the XXH3-64 (seed 0) of the copy,
   read back piece by piece right after each piece is written. With `of_source`, the
   pieces are streamed past the cache (`stream_piece`) and the hash reads each source
   piece right after it was copied, while it is in cache: the same value for an exact
   copy, with a third less memory traffic. Runs without the GIL. */
static PyObject *
copy_hash(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dst_obj, *src_obj;
    Py_buffer dst, src;
    int of_source = 0;
    if (!need_xxhash())
        return NULL;
    if (!PyArg_ParseTuple(args, "OO|p", &dst_obj, &src_obj, &of_source))
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *out = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes into %zd bytes", src.len, dst.len);
        goto done;
    }
    void *st = X.state_new();
    if (st == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t sum;
    Py_BEGIN_ALLOW_THREADS
    unsigned char *d = dst.buf;
    const unsigned char *s = src.buf;
    X.reset(st);
    for (Py_ssize_t off = 0; off < src.len; off += COPY_PIECE) {
        size_t len = (size_t)(src.len - off < COPY_PIECE ? src.len - off : COPY_PIECE);
        if (of_source) {
            stream_piece(d + off, s + off, len);
            X.update(st, s + off, len);
        } else {
            copy_piece(d + off, s + off, len);
            X.update(st, d + off, len);
        }
    }
    sum = X.digest(st);
#if defined(__SSE2__)
    if (of_source)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    X.state_free(st);
    out = PyLong_FromUnsignedLongLong(sum);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}

/* frame_copy(prefixes, src, chunk) -> (messages, checksum)

   `src` cut into pieces of `chunk` bytes (the last may be shorter), one per prefix: each
   message is its prefix followed by a copy of its piece, made by copying into the new
   bytes object and hashing that copy while it is in cache; the checksum is the XXH3-64
   of all the copied pieces in order (the payload as sent). The copying runs without the
   GIL. */
static PyObject *
frame_copy(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *prefixes, *src_obj;
    Py_ssize_t chunk;
    if (!need_xxhash())
        return NULL;
    if (!PyArg_ParseTuple(args, "O!On", &PyList_Type, &prefixes, &src_obj, &chunk))
        return NULL;
    if (chunk <= 0) {
        PyErr_Format(PyExc_ValueError, "chunk must be positive, got %zd", chunk);
        return NULL;
    }
    Py_buffer src;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *messages = NULL, *result = NULL;
    void *st = NULL;
    Py_ssize_t n = PyList_GET_SIZE(prefixes);
    Py_ssize_t need = src.len == 0 ? 1 : (src.len + chunk - 1) / chunk;
    if (n != need) {
        PyErr_Format(PyExc_ValueError, "%zd prefixes for %zd pieces", n, need);
        goto done;
    }
    messages = PyList_New(n);
    if (messages == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *prefix = PyList_GET_ITEM(prefixes, i);
        if (!PyBytes_Check(prefix)) {
            PyErr_SetString(PyExc_TypeError, "prefixes must be bytes");
            goto done;
        }
        Py_ssize_t len = src.len - i * chunk < chunk ? src.len - i * chunk : chunk;
        PyObject *m = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(prefix) + len);
        if (m == NULL)
            goto done;
        memcpy(PyBytes_AS_STRING(m), PyBytes_AS_STRING(prefix), (size_t)PyBytes_GET_SIZE(prefix));
        PyList_SET_ITEM(messages, i, m);
    }
    st = X.state_new();
    if (st == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t sum;
    Py_BEGIN_ALLOW_THREADS
    X.reset(st);
    const unsigned char *s = src.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(messages, i);
        Py_ssize_t len = src.len - i * chunk < chunk ? src.len - i * chunk : chunk;
        unsigned char *d = (unsigned char *)PyBytes_AS_STRING(m) + (PyBytes_GET_SIZE(m) - len);
        for (Py_ssize_t off = 0; off < len; off += COPY_PIECE) {
            size_t piece = (size_t)(len - off < COPY_PIECE ? len - off : COPY_PIECE);
            copy_piece(d + off, s + i * chunk + off, piece);
            X.update(st, d + off, piece);
        }
    }
    sum = X.digest(st);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(OK)", messages, (unsigned long long)sum);
done:
    if (st != NULL)
        X.state_free(st);
    Py_XDECREF(messages);
    PyBuffer_Release(&src);
    return result;
}

/* top_tiers(rows, lt, out) -> count
   rows: i64; lt: two u8 tier ids per table row (its first and second copy, 0 for none);
   out: writable u8, at least len(rows) long. Writes each row's top tier id (the lower
   nonzero id of its two: ids follow the tier order) and returns how many rows hold a
   second copy (a third, mid-move, is not in `lt`: the caller checks those rows). */
static PyObject *
top_tiers(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_rows, *o_lt, *o_out;
    if (!PyArg_ParseTuple(args, "OOO", &o_rows, &o_lt, &o_out))
        return NULL;
    Py_buffer rows, lt, out;
    PyObject *result = NULL;
    if (get(o_rows, &rows, 8, 0, "rows") < 0)
        return NULL;
    if (get(o_lt, &lt, 2, 0, "lt") < 0)
        goto e0;
    if (get(o_out, &out, 1, 1, "out") < 0)
        goto e1;
    {
        Py_ssize_t n = rows.len / 8, nrows = lt.len / 2, second = 0;
        const int64_t *R = (const int64_t *)rows.buf;
        const uint8_t *L = (const uint8_t *)lt.buf;
        uint8_t *o = (uint8_t *)out.buf;
        if (out.len < n) {
            PyErr_SetString(PyExc_ValueError, "out is shorter than rows");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t r = R[i];
            if (r < 0 || r >= nrows) {
                PyErr_Format(PyExc_IndexError, "row %lld is not a row of the table", (long long)r);
                goto done;
            }
            if (i + AHEAD < n && R[i + AHEAD] >= 0 && R[i + AHEAD] < nrows)
                __builtin_prefetch(&L[2 * R[i + AHEAD]]);
            uint8_t a = L[2 * r], b = L[2 * r + 1];
            second += b != 0;
            o[i] = b != 0 && b < a ? b : a;
        }
        result = PyLong_FromSsize_t(second);
    }
done:
    PyBuffer_Release(&out);
e1:
    PyBuffer_Release(&lt);
e0:
    PyBuffer_Release(&rows);
    return result;
}

/* The arrays of a `RowLists` (kvstore.policies.rows), checked once per call. */
typedef struct {
    Py_buffer log, lst, pos;
    Py_ssize_t nlog, nrows;
} RowLogs;

static int
row_logs_get(RowLogs *L, PyObject *o_log, PyObject *o_lst, PyObject *o_pos)
{
    if (get(o_log, &L->log, 4, 1, "log") < 0)
        return -1;
    if (get(o_lst, &L->lst, 1, 1, "lst") < 0) {
        PyBuffer_Release(&L->log);
        return -1;
    }
    if (get(o_pos, &L->pos, 4, 1, "pos") < 0) {
        PyBuffer_Release(&L->lst);
        PyBuffer_Release(&L->log);
        return -1;
    }
    L->nlog = L->log.len / 4;
    L->nrows = L->lst.len < L->pos.len / 4 ? L->lst.len : L->pos.len / 4;
    return 0;
}

static void
row_logs_release(RowLogs *L)
{
    PyBuffer_Release(&L->pos);
    PyBuffer_Release(&L->lst);
    PyBuffer_Release(&L->log);
}

/* rows_append(log, lst, pos, which, tail, rows, tracked_only, moved) -> new tail

   Appends each of `rows` (i64), in order, at log[tail...] as the newest row of list
   `which`: its list becomes `which` and its position the new entry's index. A row
   named twice ends at its last entry; its earlier entry is left stale, as any moved
   row's is. With `tracked_only`, rows in no list (list 0) are skipped. `moved` (i64,
   one per list id) gains, per list, the rows taken out of it. The caller made room. */
static PyObject *
rows_append(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_log, *o_lst, *o_pos, *o_rows, *o_moved;
    unsigned int which;
    Py_ssize_t tail;
    int tracked_only;
    if (!PyArg_ParseTuple(args, "OOOInOpO", &o_log, &o_lst, &o_pos, &which, &tail, &o_rows, &tracked_only,
                          &o_moved))
        return NULL;
    RowLogs L;
    Py_buffer rows, moved;
    PyObject *result = NULL;
    if (row_logs_get(&L, o_log, o_lst, o_pos) < 0)
        return NULL;
    if (get(o_rows, &rows, 8, 0, "rows") < 0)
        goto e0;
    if (get(o_moved, &moved, 8, 1, "moved") < 0)
        goto e1;
    {
        Py_ssize_t n = rows.len / 8, nlists = moved.len / 8;
        const int64_t *R = (const int64_t *)rows.buf;
        int32_t *log = (int32_t *)L.log.buf, *pos = (int32_t *)L.pos.buf;
        uint8_t *lst = (uint8_t *)L.lst.buf;
        int64_t *M = (int64_t *)moved.buf;
        if (which == 0 || (Py_ssize_t)which >= nlists || which > 255 || tail < 0 || tail > L.nlog
            || L.nlog > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "rows_append: bad list id, tail or log");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t r = R[i];
            if (r < 0 || r >= L.nrows) {
                PyErr_Format(PyExc_IndexError, "row %lld is past the lists' rows", (long long)r);
                goto done;
            }
            if (i + AHEAD < n && R[i + AHEAD] >= 0 && R[i + AHEAD] < L.nrows) {
                __builtin_prefetch(&lst[R[i + AHEAD]], 1);
                __builtin_prefetch(&pos[R[i + AHEAD]], 1);
            }
            uint8_t old = lst[r];
            if (old == 0 && tracked_only)
                continue;
            if ((Py_ssize_t)old >= nlists) {
                PyErr_Format(PyExc_ValueError, "row %lld is in list %d, past `moved`", (long long)r, (int)old);
                goto done;
            }
            if (tail >= L.nlog) {
                PyErr_SetString(PyExc_ValueError, "rows_append: no room left in the log");
                goto done;
            }
            M[old] += old != 0;
            log[tail] = (int32_t)r;
            pos[r] = (int32_t)tail;
            lst[r] = (uint8_t)which;
            tail++;
        }
        result = PyLong_FromSsize_t(tail);
    }
done:
    PyBuffer_Release(&moved);
e1:
    PyBuffer_Release(&rows);
e0:
    row_logs_release(&L);
    return result;
}

/* rows_compact(log, lst, pos, which, w, r, stop, into) -> new w

   Moves the valid entries of log[r:stop] (a row of list `which` whose position is the
   entry's index) down to log[w...], in order, and points each row's position at its new
   index; with `into` (a longer log, or None), writes them there at the same indices
   too. w <= r, so each write lands at or below the entry being read. */
static PyObject *
rows_compact(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_log, *o_lst, *o_pos, *o_into;
    unsigned int which;
    Py_ssize_t w, r, stop;
    if (!PyArg_ParseTuple(args, "OOOInnnO", &o_log, &o_lst, &o_pos, &which, &w, &r, &stop, &o_into))
        return NULL;
    RowLogs L;
    Py_buffer into;
    int has_into = o_into != Py_None;
    PyObject *result = NULL;
    if (row_logs_get(&L, o_log, o_lst, o_pos) < 0)
        return NULL;
    if (has_into && get(o_into, &into, 4, 1, "into") < 0)
        goto e0;
    {
        int32_t *log = (int32_t *)L.log.buf, *pos = (int32_t *)L.pos.buf;
        const uint8_t *lst = (const uint8_t *)L.lst.buf;
        int32_t *to = has_into ? (int32_t *)into.buf : NULL;
        if (w < 0 || w > r || r > stop || stop > L.nlog || (has_into && into.len / 4 < stop)) {
            PyErr_SetString(PyExc_ValueError, "rows_compact: cursors outside the log");
            goto done;
        }
        for (Py_ssize_t i = r; i < stop; i++) {
            int32_t e = log[i];
            if (i + AHEAD < stop && log[i + AHEAD] >= 0 && log[i + AHEAD] < L.nrows) {
                __builtin_prefetch(&lst[log[i + AHEAD]]);
                __builtin_prefetch(&pos[log[i + AHEAD]], 1);
            }
            if (e < 0 || e >= L.nrows || lst[e] != which || pos[e] != i)
                continue; /* stale */
            log[w] = e;
            if (to != NULL)
                to[w] = e;
            pos[e] = (int32_t)w;
            w++;
        }
        result = PyLong_FromSsize_t(w);
    }
done:
    if (has_into)
        PyBuffer_Release(&into);
e0:
    row_logs_release(&L);
    return result;
}

static PyMethodDef methods[] = {
    {"prefix_rows", prefix_rows, METH_VARARGS,
     "prefix_rows(packed, slots, h0, h1, ns_col, shift, ns, ns_fp, check_ns, out, every=False, flags=None,\n"
     "            indexed=0) -> count\n\n"
     "Write the rows of the longest indexed prefix of a packed chain into `out`; return its length.\n"
     "With `every`, write the row of every key (-1 where absent) and return N. With `flags`, look\n"
     "for each key in the row after the previous key's first (rows flagged `indexed` only)."},
    {"top_tiers", top_tiers, METH_VARARGS,
     "top_tiers(rows, lt, out) -> count\n\n"
     "Write each row's top tier id (the lower nonzero of its two location tiers) into `out`;\n"
     "return how many of the rows hold a second copy."},
    {"rows_append", rows_append, METH_VARARGS,
     "rows_append(log, lst, pos, which, tail, rows, tracked_only, moved) -> tail\n\n"
     "Append rows in order as the newest of list `which` (RowLists.append, one pass)."},
    {"rows_compact", rows_compact, METH_VARARGS,
     "rows_compact(log, lst, pos, which, w, r, stop, into) -> w\n\n"
     "Move the valid entries of log[r:stop] down to log[w:] (RowLists._compact_step, one pass)."},
    {"place_rows", place_rows, METH_VARARGS,
     "place_rows(rows, slots, h0, h1, ns_col, ns_fp, shift) -> count\n\n"
     "Insert rows (absent, distinct keys) into the key slots at the first empty slot from each home."},
    {"unindex_rows", unindex_rows, METH_VARARGS,
     "unindex_rows(rows, slots, h0, h1, ns_col, ns_fp, shift) -> count\n\n"
     "Take indexed rows out of the key slots by backward-shift deletion."},
    {"join_hashes", join_hashes, METH_O,
     "join_hashes(hashes) -> bytes | None\n\n"
     "The items packed (N x 16 bytes) if each is a 16-byte bytes object, else None."},
    {"pack_u32", pack_u32, METH_O,
     "pack_u32(items) -> bytes | None\n\n"
     "A list or tuple of ints in [0, 2**32) as little-endian u32, else None."},
    {"bind_xxhash", bind_xxhash, METH_O,
     "bind_xxhash(path) -> bool\n\n"
     "Bind XXH3 from the already loaded library at `path`; True when bound and checked."},
    {"chain_hashes", chain_hashes, METH_VARARGS,
     "chain_hashes(namespace, packed, block_size_tokens) -> bytes\n\n"
     "The chained XXH3-128 block hashes (N x 16 bytes) of packed u32 token ids."},
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(dst, src, of_source=False) -> int\n\n"
     "Copy src into dst and return the XXH3-64 of the copy (read from src with of_source), without the GIL."},
    {"frame_copy", frame_copy, METH_VARARGS,
     "frame_copy(prefixes, src, chunk) -> (messages, checksum)\n\n"
     "Each prefix followed by a copy of its chunk of src, and the XXH3-64 of the copied payload."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore._native", "Compiled loops of the lookup path.", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
