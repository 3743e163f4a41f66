/* The block table's loops (kvstore.core.table): the chain probe, placement into and
   deletion from the key table, and a lookup's top tiers.

   `prefix_rows` walks a packed chain (N x 16-byte hashes) through the table's key slots
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

   The key table comes in as one tuple, `BlockTable.key_columns`:
   (slots, shift, h0, h1, ns, ns_fp, flags). slots: i64 key slots, a power of two long,
   each (tag << 32) | (row + 1), 0 when empty; shift: 64 - log2(len(slots)); h0, h1: u64
   columns; ns: u32 column; ns_fp: u64, each namespace's fingerprint by its id; flags: u8
   row flags. The table builds it once per growth, so a call costs no argument list.

   `top_tiers` (kvstore.core.store) reads the top tier of each row a lookup found: one
   byte per block, the form a lookup's answer carries. */

#include "native.h"

#define K1 0x9E3779B97F4A7C15ULL
#define C1 0xFF51AFD7ED558CCDULL

/* Keys probed together (see the note above). */
#define GROUP 32

/* The arrays of `BlockTable.key_columns`, checked once per call. */
typedef struct {
    Py_buffer buf[6]; /* slots, h0, h1, ns, ns_fp, flags */
    int held;         /* how many of buf are held */
    unsigned int shift;
    Py_ssize_t nslots, nrows, nfp;
    int64_t *S;
    const uint64_t *H0, *H1, *FP;
    const uint32_t *NS;
    const uint8_t *F;
    uint64_t mask;
} KeyTable;

static void
table_release(KeyTable *t)
{
    while (t->held > 0)
        PyBuffer_Release(&t->buf[--t->held]);
}

/* Take the key table's arrays (the slots writable if asked) and check that they describe
   one table; -1 with an exception, nothing held, if not. */
static int
table_get(PyObject *cols, KeyTable *t, int writable)
{
    static const int at[6] = {0, 2, 3, 4, 5, 6};
    static const Py_ssize_t itemsize[6] = {8, 8, 8, 4, 8, 1};
    static const char *const what[6] = {"slots", "h0", "h1", "ns", "ns_fp", "flags"};
    t->held = 0;
    if (!PyTuple_Check(cols) || PyTuple_GET_SIZE(cols) != 7) {
        PyErr_SetString(PyExc_TypeError, "the key table is a tuple (slots, shift, h0, h1, ns, ns_fp, flags)");
        return -1;
    }
    unsigned long shift = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(cols, 1));
    if (shift == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    for (int i = 0; i < 6; i++) {
        if (get(PyTuple_GET_ITEM(cols, at[i]), &t->buf[i], itemsize[i], i == 0 && writable, what[i]) < 0) {
            table_release(t);
            return -1;
        }
        t->held++;
    }
    t->nslots = t->buf[0].len / 8;
    t->nrows = t->buf[1].len / 8;
    t->nfp = t->buf[4].len / 8;
    if (t->nslots == 0 || (t->nslots & (t->nslots - 1)) != 0 || shift == 0 || shift > 64
        || ((Py_ssize_t)1 << (64 - shift)) != t->nslots || t->buf[2].len / 8 < t->nrows
        || t->buf[3].len / 4 < t->nrows || t->buf[5].len < t->nrows) {
        PyErr_SetString(PyExc_ValueError, "the slots and columns do not describe one key table");
        table_release(t);
        return -1;
    }
    t->shift = (unsigned int)shift;
    t->S = (int64_t *)t->buf[0].buf;
    t->H0 = (const uint64_t *)t->buf[1].buf;
    t->H1 = (const uint64_t *)t->buf[2].buf;
    t->NS = (const uint32_t *)t->buf[3].buf;
    t->FP = (const uint64_t *)t->buf[4].buf;
    t->F = (const uint8_t *)t->buf[5].buf;
    t->mask = (uint64_t)t->nslots - 1;
    return 0;
}

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

/* prefix_rows(packed, key_columns, ns, out, every=False, indexed=0) -> count

   packed: N x 16 bytes (h0, h1 little-endian u64 each); ns: the chain's namespace id;
   out: writable i64, at least N long. With `every`, an absent key does not stop the
   walk: its entry in `out` is -1 and the count is N (`BlockTable.find_rows`). The
   namespace column is read only where the table knows more than one namespace.

   With `indexed` (the flag of a row in the key table), a key is first looked for in the
   row after the previous key's: the blocks of a chain put in one call sit in consecutive
   rows, and those rows' columns are read in order, from cache, where each probe of the
   key table is a miss. A key found there is the one the key table names, as an indexed
   key has exactly one row. From the first key not found there, a group of keys is probed
   in the key table as above, and the walk in row order resumes after it. */
KV_INTERNAL PyObject *
prefix_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_packed, *o_table, *o_out;
    unsigned int ns, indexed = 0;
    int every = 0;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "OOIO|pI", &o_packed, &o_table, &ns, &o_out, &every, &indexed))
        return NULL;
    Py_buffer packed, out;
    KeyTable t;
    if (get(o_packed, &packed, 16, 0, "packed hashes") < 0)
        return NULL;
    if (table_get(o_table, &t, 0) < 0)
        goto e0;
    if (get(o_out, &out, 8, 1, "out") < 0)
        goto e1;

    Py_ssize_t n = packed.len / 16, nslots = t.nslots, nrows = t.nrows;
    Py_ssize_t found = 0;
    if (out.len / 8 < n) {
        PyErr_SetString(PyExc_ValueError, "out is shorter than the chain");
        goto done;
    }
    if (indexed > 255) {
        PyErr_Format(PyExc_ValueError, "indexed must be a row flag (0 for none), got %u", indexed);
        goto done;
    }
    if ((Py_ssize_t)ns >= t.nfp) {
        PyErr_Format(PyExc_ValueError, "namespace %u is not interned in this table", ns);
        goto done;
    }
    {
        const unsigned char *p = (const unsigned char *)packed.buf;
        const int64_t *S = t.S;
        const uint64_t *H0 = t.H0, *H1 = t.H1;
        const uint32_t *NS = t.NS;
        const uint8_t *F = indexed != 0 ? t.F : NULL;
        const unsigned int shift = t.shift;
        const uint64_t ns_fp = t.FP[ns];
        const int check_ns = t.nfp > 1; /* with one namespace interned, every row is of it */
        int64_t *o = (int64_t *)out.buf;
        const uint64_t mask = t.mask;
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
    PyBuffer_Release(&out);
e1:
    table_release(&t);
e0:
    PyBuffer_Release(&packed);
    return result;
}

/* The rows of `place_rows` and `unindex_rows` (i64), each checked to be a row of the
   table with a namespace that has a fingerprint, before anything is written; -1 with an
   exception, nothing held, if not. */
static int
table_rows_get(PyObject *o_rows, Py_buffer *rows, const KeyTable *t)
{
    if (get(o_rows, rows, 8, 0, "rows") < 0)
        return -1;
    const int64_t *R = (const int64_t *)rows->buf;
    for (Py_ssize_t j = 0; j < rows->len / 8; j++) {
        int64_t r = R[j];
        if (r < 0 || r >= t->nrows || r >= 0xFFFFFFFFLL || t->NS[r] >= (uint64_t)t->nfp) {
            PyErr_Format(PyExc_ValueError, "row %lld is not a row of this table", (long long)r);
            PyBuffer_Release(rows);
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

/* place_rows(rows, key_columns) -> count

   Insert `rows` (indexed keys absent from the table and distinct) into the key slots,
   each at the first empty slot from its home, as `BlockTable.index_row` does one row at
   a time: the numpy placement (`BlockTable._place`) stays as the reference and the
   fallback. The caller keeps the table at most half full, so every probe ends at an
   empty slot. */
KV_INTERNAL PyObject *
place_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_rows, *o_table;
    if (!PyArg_ParseTuple(args, "OO", &o_rows, &o_table))
        return NULL;
    KeyTable t;
    Py_buffer rows;
    if (table_get(o_table, &t, 1) < 0)
        return NULL;
    if (table_rows_get(o_rows, &rows, &t) < 0) {
        table_release(&t);
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t *R = (const int64_t *)rows.buf;
    Py_ssize_t n = rows.len / 8;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t r = R[j];
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
    result = PyLong_FromSsize_t(n);
done:
    PyBuffer_Release(&rows);
    table_release(&t);
    return result;
}

/* unindex_rows(rows, key_columns) -> count

   Take `rows` (each indexed) out of the key slots by backward-shift deletion, one after
   another, as `BlockTable.unindex_row` does: an entry after the hole moves back into it
   unless its home lies cyclically in (hole, entry]. Arguments as `place_rows`. */
KV_INTERNAL PyObject *
unindex_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_rows, *o_table;
    if (!PyArg_ParseTuple(args, "OO", &o_rows, &o_table))
        return NULL;
    KeyTable t;
    Py_buffer rows;
    if (table_get(o_table, &t, 1) < 0)
        return NULL;
    if (table_rows_get(o_rows, &rows, &t) < 0) {
        table_release(&t);
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t *R = (const int64_t *)rows.buf;
    Py_ssize_t n = rows.len / 8;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t r = R[j];
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
            if (er < 0 || er >= t.nrows || t.NS[er] >= (uint64_t)t.nfp) {
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
    result = PyLong_FromSsize_t(n);
done:
    PyBuffer_Release(&rows);
    table_release(&t);
    return result;
}

/* top_tiers(rows, lt, out) -> count
   rows: i64; lt: two u8 tier ids per table row (its first and second copy, 0 for none);
   out: writable u8, at least len(rows) long. Writes each row's top tier id (the lower
   nonzero id of its two: ids follow the tier order) and returns how many rows hold a
   second copy (a third, mid-move, is not in `lt`: the caller checks those rows). */
KV_INTERNAL PyObject *
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
