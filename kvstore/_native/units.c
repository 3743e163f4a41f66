/* A lookup round's steps over a chain's placement units (kvstore.cluster.remote_lookup), each
   in one pass where numpy takes several whole-array steps: the hashes of some units' ranges
   laid end to end (a request to one node, a pull's hashes), a node's answer spread over
   the units it was asked for, and how far the units reach with what was found. A
   1,000-block chain has hundreds of units, and each numpy step costs microseconds of
   its own on a path that is timed in hundreds. */

#include "native.h"

/* The int64 buffers of a call, released together. */
typedef struct {
    Py_buffer views[4];
    int held;
} Views;

static int
take(Views *v, PyObject *obj, int writable, const char *what)
{
    if (get_i64(obj, &v->views[v->held], writable, what) < 0)
        return -1;
    v->held++;
    return 0;
}

static void
release(Views *v)
{
    for (int i = 0; i < v->held; i++)
        PyBuffer_Release(&v->views[i]);
    v->held = 0;
}

/* gather_ranges(packed, item_bytes, starts, stops, idx) -> bytes

   The items [starts[j], stops[j]) of `packed` (`item_bytes` each) for each j of `idx`
   in its order (every j where `idx` is None), laid end to end. */
KV_INTERNAL PyObject *
gather_ranges(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *starts_obj, *stops_obj, *idx_obj;
    Py_buffer packed;
    Py_ssize_t item;
    if (!PyArg_ParseTuple(args, "y*nOOO", &packed, &item, &starts_obj, &stops_obj, &idx_obj))
        return NULL;
    Views v = {.held = 0};
    PyObject *out = NULL;
    if (item <= 0 || packed.len % item != 0) {
        PyErr_Format(PyExc_ValueError, "packed: %zd bytes is not a whole number of %zd-byte items", packed.len, item);
        goto done;
    }
    if (take(&v, starts_obj, 0, "starts") < 0 || take(&v, stops_obj, 0, "stops") < 0)
        goto done;
    if (idx_obj != Py_None && take(&v, idx_obj, 0, "idx") < 0)
        goto done;
    const int64_t *starts = v.views[0].buf, *stops = v.views[1].buf;
    Py_ssize_t units = v.views[0].len / 8, items = packed.len / item;
    if (v.views[1].len / 8 != units) {
        PyErr_SetString(PyExc_ValueError, "starts and stops differ in length");
        goto done;
    }
    const int64_t *idx = idx_obj != Py_None ? v.views[2].buf : NULL;
    Py_ssize_t n = idx != NULL ? v.views[2].len / 8 : units, total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t j = idx != NULL ? idx[i] : i;
        if (j < 0 || j >= units) {
            PyErr_Format(PyExc_IndexError, "idx[%zd] = %lld is outside the %zd ranges", i, (long long)j, units);
            goto done;
        }
        if (starts[j] < 0 || starts[j] > stops[j] || stops[j] > items) {
            PyErr_Format(PyExc_IndexError, "range %lld is [%lld, %lld) of %zd items", (long long)j,
                         (long long)starts[j], (long long)stops[j], items);
            goto done;
        }
        total += (Py_ssize_t)(stops[j] - starts[j]);
    }
    out = PyBytes_FromStringAndSize(NULL, total * item);
    if (out == NULL)
        goto done;
    char *dst = PyBytes_AS_STRING(out);
    const char *src = packed.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t j = idx != NULL ? idx[i] : i;
        size_t len = (size_t)(stops[j] - starts[j]) * (size_t)item;
        memcpy(dst, src + starts[j] * item, len);
        dst += len;
    }
done:
    release(&v);
    PyBuffer_Release(&packed);
    return out;
}

/* spread_prefix(count, sizes, idx, out) -> int

   A node answered that it holds the first `count` blocks of the units `idx` (of units
   `sizes` blocks long) laid end to end in that order: how many of each unit's blocks
   that is, into `out` (one int64 per unit, 0 for units not in `idx`). Returns the blocks
   counted (`count`, at most the units' total). */
KV_INTERNAL PyObject *
spread_prefix(PyObject *self, PyObject *args)
{
    (void)self;
    long long count;
    PyObject *sizes_obj, *idx_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "LOOO", &count, &sizes_obj, &idx_obj, &out_obj))
        return NULL;
    Views v = {.held = 0};
    PyObject *result = NULL;
    if (take(&v, sizes_obj, 0, "sizes") < 0 || take(&v, idx_obj, 0, "idx") < 0 || take(&v, out_obj, 1, "out") < 0)
        goto done;
    const int64_t *sizes = v.views[0].buf, *idx = v.views[1].buf;
    int64_t *out = v.views[2].buf;
    Py_ssize_t units = v.views[0].len / 8, n = v.views[1].len / 8;
    if (v.views[2].len / 8 != units) {
        PyErr_SetString(PyExc_ValueError, "out and sizes differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (idx[i] < 0 || idx[i] >= units) {
            PyErr_Format(PyExc_IndexError, "idx[%zd] = %lld is outside the %zd units", i, (long long)idx[i], units);
            goto done;
        }
    }
    memset(out, 0, (size_t)units * 8);
    long long left = count > 0 ? count : 0, counted = 0;
    for (Py_ssize_t i = 0; i < n && left > 0; i++) {
        int64_t size = sizes[idx[i]] > 0 ? sizes[idx[i]] : 0;
        int64_t got = left < size ? left : size;
        out[idx[i]] = got;
        left -= got;
        counted += got;
    }
    result = PyLong_FromLongLong(counted);
done:
    release(&v);
    return result;
}

/* units_reach(locs, found, sizes, best) -> (short, copied)

   Per unit, the leading blocks held here (`locs`) and found on one other node (`found`)
   of its `sizes`: `best` gets the larger of the two; `short` is the first unit whose
   best falls short of its size (the number of units where none does), where the chain
   ends; `copied` whether a unit up to and including that one was found elsewhere beyond
   what is held here (there is something to pull). */
KV_INTERNAL PyObject *
units_reach(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *locs_obj, *found_obj, *sizes_obj, *best_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &locs_obj, &found_obj, &sizes_obj, &best_obj))
        return NULL;
    Views v = {.held = 0};
    PyObject *result = NULL;
    if (take(&v, locs_obj, 0, "locs") < 0 || take(&v, found_obj, 0, "found") < 0 ||
        take(&v, sizes_obj, 0, "sizes") < 0 || take(&v, best_obj, 1, "best") < 0)
        goto done;
    Py_ssize_t n = v.views[0].len / 8;
    if (v.views[1].len / 8 != n || v.views[2].len / 8 != n || v.views[3].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "locs, found, sizes and best differ in length");
        goto done;
    }
    const int64_t *locs = v.views[0].buf, *found = v.views[1].buf, *sizes = v.views[2].buf;
    int64_t *best = v.views[3].buf;
    Py_ssize_t shortest = n;
    int copied = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        best[i] = locs[i] > found[i] ? locs[i] : found[i];
        if (shortest == n) {
            copied |= found[i] > locs[i];
            if (best[i] < sizes[i])
                shortest = i;
        }
    }
    result = Py_BuildValue("nO", shortest, copied ? Py_True : Py_False);
done:
    release(&v);
    return result;
}
