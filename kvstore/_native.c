/* The few loops of kvstore's lookup path that pay for compiled code.

   `prefix_rows` (kvstore.table) walks a packed chain (N x 16-byte hashes) through the table's key slots
   and writes the row of each key of the longest indexed prefix, stopping at the first
   key that is absent. It is the loop `BlockTable.find` runs per key, over the same
   arrays, with the same slot hash: the numpy batch probe (`find_rows`) stays as the
   reference and as the fallback where this module was not built.

   Keys are probed in groups: the slots of a group are prefetched, then the rows its
   slots name, then each key is checked in order, so the cache misses of a group's keys
   overlap instead of coming one after another (a table of millions of blocks is far
   larger than the cache, and each key costs a miss on its slot and one on its row).

   `join_hashes` (kvstore.client) packs a list of 16-byte hashes into N x 16 bytes, and
   `pack_u32` (kvstore.hashing) a list of token ids into little-endian u32, each in one
   pass that checks every item.

   Arrays come in through the buffer protocol (numpy arrays, memoryviews), so the module
   needs neither numpy's headers nor a particular numpy at build time. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define K1 0x9E3779B97F4A7C15ULL
#define C1 0xFF51AFD7ED558CCDULL

/* Keys probed together (see the module note). */
#define GROUP 32

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

/* prefix_rows(packed, slots, h0, h1, ns_col, shift, ns, ns_fp, check_ns, out, every=False)
   -> count

   packed: N x 16 bytes (h0, h1 little-endian u64 each); slots: i64 key slots, a power of
   two long, each (tag << 32) | (row + 1), 0 when empty; h0, h1: u64 columns; ns_col: u32
   column; shift: 64 - log2(len(slots)); out: writable i64, at least N long. With `every`,
   an absent key does not stop the walk: its entry in `out` is -1 and the count is N
   (`BlockTable.find_rows`). */
static PyObject *
prefix_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_packed, *o_slots, *o_h0, *o_h1, *o_ns, *o_out;
    unsigned int shift, ns;
    unsigned long long ns_fp;
    int check_ns, every = 0;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOIIKpO|p", &o_packed, &o_slots, &o_h0, &o_h1, &o_ns,
                          &shift, &ns, &ns_fp, &check_ns, &o_out, &every))
        return NULL;
    Py_buffer packed, slots, h0, h1, nsc, out;
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

    Py_ssize_t n = packed.len / 16, nslots = slots.len / 8, nrows = h0.len / 8;
    Py_ssize_t found = 0;
    if (out.len / 8 < n) {
        PyErr_SetString(PyExc_ValueError, "out is shorter than the chain");
        goto done;
    }
    if (nslots == 0 || (nslots & (nslots - 1)) != 0 || shift == 0 || shift > 64
        || ((Py_ssize_t)1 << (64 - shift)) != nslots || h1.len / 8 < nrows || nsc.len / 4 < nrows) {
        PyErr_SetString(PyExc_ValueError, "the slots and columns do not describe one key table");
        goto done;
    }
    {
        const unsigned char *p = (const unsigned char *)packed.buf;
        const int64_t *S = (const int64_t *)slots.buf;
        const uint64_t *H0 = (const uint64_t *)h0.buf, *H1 = (const uint64_t *)h1.buf;
        const uint32_t *NS = (const uint32_t *)nsc.buf;
        int64_t *o = (int64_t *)out.buf;
        const uint64_t mask = (uint64_t)nslots - 1;
        uint64_t home[GROUP];
        int64_t cand[GROUP];
        while (found < n) {
            Py_ssize_t g = n - found < GROUP ? n - found : GROUP;
            const unsigned char *q = p + 16 * found;
            for (Py_ssize_t j = 0; j < g; j++) {
                uint64_t q0, q1;
                memcpy(&q0, q + 16 * j, 8); /* x86-64 and aarch64 are little-endian */
                memcpy(&q1, q + 16 * j + 8, 8);
                home[j] = (q0 ^ ns_fp ^ (q1 * K1)) * C1;
                __builtin_prefetch(&S[home[j] >> shift]);
            }
            for (Py_ssize_t j = 0; j < g; j++) {
                /* The row the home slot names if its tag matches; checked below. */
                int64_t e = S[home[j] >> shift];
                int64_t r = (e & 0xFFFFFFFFLL) - 1;
                cand[j] = (e >> 32) == (int64_t)(home[j] & 0x7FFFFFFFULL) && r >= 0 && r < nrows ? r : -1;
                if (cand[j] >= 0) {
                    __builtin_prefetch(&H0[r]);
                    __builtin_prefetch(&H1[r]);
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
                o[found] = r;
            }
        }
    }
done_probe:
    result = PyLong_FromSsize_t(found);
done:
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

static PyMethodDef methods[] = {
    {"prefix_rows", prefix_rows, METH_VARARGS,
     "prefix_rows(packed, slots, h0, h1, ns_col, shift, ns, ns_fp, check_ns, out, every=False) -> count\n\n"
     "Write the rows of the longest indexed prefix of a packed chain into `out`; return its length.\n"
     "With `every`, write the row of every key (-1 where absent) and return N."},
    {"join_hashes", join_hashes, METH_O,
     "join_hashes(hashes) -> bytes | None\n\n"
     "The items packed (N x 16 bytes) if each is a 16-byte bytes object, else None."},
    {"pack_u32", pack_u32, METH_O,
     "pack_u32(items) -> bytes | None\n\n"
     "A list or tuple of ints in [0, 2**32) as little-endian u32, else None."},
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
