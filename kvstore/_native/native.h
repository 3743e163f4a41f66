/* What the sources of kvstore._native share: Python's headers, the buffer helper every
   function takes its arrays through, the prefetch distance, and the functions that
   module.c lists in the method table.

   This folder holds sources only: it must never gain an __init__.py, which would make
   it a package that hides the built module of the same name. */

#ifndef KVSTORE_NATIVE_H
#define KVSTORE_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Shared between the files of this one extension, exported to no one else. */
#define KV_INTERNAL __attribute__((visibility("hidden")))

/* How far ahead the loops over rows in no particular order (a touch, a compaction step,
   a lookup's tiers) prefetch the columns of the rows to come: each such row is a likely
   cache miss in a table of millions, and the misses then overlap. */
#define AHEAD 16

/* The buffer of `obj` (writable if asked) as a whole number of `itemsize`-byte items;
   -1 with an exception, nothing held, if not. */
static inline int
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

/* The buffer of `obj` (writable if asked) as C-contiguous int64 items: a numpy int64
   array (or any buffer that says its items are signed 64-bit integers); -1 with an
   exception, nothing held, if not. */
static inline int
get_i64(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *f = view->format != NULL ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s: int64 items expected, not format '%s' of %zd bytes", what,
                     view->format != NULL ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* table.c: the block table's key table and location columns (kvstore.core.table). */
KV_INTERNAL PyObject *prefix_rows(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *place_rows(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *unindex_rows(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *top_tiers(PyObject *self, PyObject *args);

/* rows.c: a policy's row lists (kvstore.core.policies.rows). */
KV_INTERNAL PyObject *rows_append(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *rows_compact(PyObject *self, PyObject *args);

/* pack.c: lists packed into bytes in one checked pass (kvstore.hashing, the SDK). */
KV_INTERNAL PyObject *join_hashes(PyObject *self, PyObject *arg);
KV_INTERNAL PyObject *pack_u32(PyObject *self, PyObject *arg);

/* xxh.c: XXH3, bound from the xxhash package, and the loops that call it. */
KV_INTERNAL PyObject *bind_xxhash(PyObject *self, PyObject *arg);
KV_INTERNAL PyObject *chain_hashes(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *copy_hash(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *frame_copy(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *rendezvous_scores(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *rendezvous_best(PyObject *self, PyObject *args);

/* units.c: a lookup round's steps over a chain's placement units (kvstore.cluster.remote_lookup). */
KV_INTERNAL PyObject *gather_ranges(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *spread_prefix(PyObject *self, PyObject *args);
KV_INTERNAL PyObject *units_reach(PyObject *self, PyObject *args);

#endif
