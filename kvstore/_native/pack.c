/* Lists packed into bytes, each in one pass that checks every item: `join_hashes` (the
   SDK) packs 16-byte hashes into N x 16 bytes, `pack_u32` (kvstore.hashing) token ids
   into little-endian u32. Where an item does not fit, they answer None and the caller's
   Python path says which item is wrong. */

#include "native.h"

/* join_hashes(hashes) -> bytes | None

   hashes: a list or tuple. The N x 16 bytes of its items when every one is a bytes
   object of exactly 16 bytes; None otherwise (the caller then finds which item is wrong,
   or packs other bytes-like items itself). */
KV_INTERNAL PyObject *
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
KV_INTERNAL PyObject *
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
