/* A policy's row lists (kvstore.core.policies.rows): its appends and its log's
   compaction steps. A lookup's touch of 1,000 rows, in array steps, gathers and scatters
   the rows' list and position arrays several times over; here it is one pass. */

#include "native.h"

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
KV_INTERNAL PyObject *
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
KV_INTERNAL PyObject *
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
