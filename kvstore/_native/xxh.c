/* XXH3, bound at run time from the library the `xxhash` package already loaded, and the
   loops that call it.

   `chain_hashes` (kvstore.hashing) computes a token chain's block hashes. `copy_hash`
   (the SDK's shared-memory plane) copies a block and hashes the copy in cache-sized
   pieces, each hashed while it is still in cache, so the copy is read once from cache
   rather than again from memory; `frame_copy` (the servicer) does the same into the
   messages of a fetch. They are offered only once the binding (`bind_xxhash`) has passed
   a check against XXH3's published empty-input values. */

#include "native.h"

#include <dlfcn.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* The XXH3 functions bound from the xxhash package's own extension. Prototypes as
   xxhash 0.8 declares them; XXH128_hash_t is two u64 returned by value. */
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
KV_INTERNAL PyObject *
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
KV_INTERNAL PyObject *
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

/* rendezvous_scores(prefix, keys, key_bytes, out)

   XXH3-64 of `prefix || key` for each `key_bytes`-byte key of `keys`, into `out` (a
   writable buffer of one uint64 per key): one member's rendezvous scores for many
   placement units (kvstore.cluster.placement), without a Python step per unit. */
KV_INTERNAL PyObject *
rendezvous_scores(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer prefix, keys, out;
    Py_ssize_t key_bytes;
    if (!need_xxhash())
        return NULL;
    if (!PyArg_ParseTuple(args, "y*y*nw*", &prefix, &keys, &key_bytes, &out))
        return NULL;
    PyObject *result = NULL;
    unsigned char *buf = NULL;
    if (key_bytes <= 0 || keys.len % key_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "keys: %zd bytes is not a whole number of %zd-byte keys", keys.len, key_bytes);
        goto done;
    }
    Py_ssize_t n = keys.len / key_bytes;
    if (out.len != n * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_Format(PyExc_ValueError, "out: %zd bytes for %zd scores of 8 bytes", out.len, n);
        goto done;
    }
    buf = PyMem_RawMalloc((size_t)(prefix.len + key_bytes));
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(buf, prefix.buf, (size_t)prefix.len);
    const unsigned char *k = keys.buf;
    uint64_t *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(buf + prefix.len, k + i * key_bytes, (size_t)key_bytes);
        o[i] = X.h64(buf, (size_t)(prefix.len + key_bytes));
    }
    result = PyLong_FromSsize_t(n);
done:
    PyMem_RawFree(buf);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return result;
}

/* rendezvous_best(prefixes, keys, key_bytes, positions, out)

   For each placement unit, the index into `prefixes` (one per member, in the members'
   order) of its rendezvous owner: the highest XXH3-64 of `prefix || key`, the earlier
   member on a tie (as numpy's argmax of `rendezvous_scores`' rows picks). The units'
   keys are the `key_bytes`-byte keys of `keys` at `positions` (int64, in units of keys),
   or every key of `keys` where `positions` is None; `out`: one int64 per unit. */
KV_INTERNAL PyObject *
rendezvous_best(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *prefixes, *positions_obj, *out_obj;
    Py_buffer keys, out, positions = {0};
    Py_ssize_t key_bytes;
    if (!need_xxhash())
        return NULL;
    if (!PyArg_ParseTuple(args, "Oy*nOO", &prefixes, &keys, &key_bytes, &positions_obj, &out_obj))
        return NULL;
    if (get_i64(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    PyObject *result = NULL, *seq = NULL;
    unsigned char *buf = NULL;
    int have_positions = positions_obj != Py_None;
    if (have_positions && get_i64(positions_obj, &positions, 0, "positions") < 0) {
        have_positions = 0;
        goto done;
    }
    if (key_bytes <= 0 || keys.len % key_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "keys: %zd bytes is not a whole number of %zd-byte keys", keys.len, key_bytes);
        goto done;
    }
    Py_ssize_t nkeys = keys.len / key_bytes;
    Py_ssize_t n = have_positions ? positions.len / 8 : nkeys;
    if (out.len != n * 8) {
        PyErr_Format(PyExc_ValueError, "out: %zd bytes for %zd owners of 8 bytes", out.len, n);
        goto done;
    }
    seq = PySequence_Fast(prefixes, "prefixes must be a sequence of bytes");
    if (seq == NULL)
        goto done;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t longest = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        if (!PyBytes_Check(items[j])) {
            PyErr_SetString(PyExc_TypeError, "prefixes must be bytes");
            goto done;
        }
        if (PyBytes_GET_SIZE(items[j]) > longest)
            longest = PyBytes_GET_SIZE(items[j]);
    }
    const int64_t *pos = have_positions ? positions.buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pos != NULL && (pos[i] < 0 || pos[i] >= nkeys)) {
            PyErr_Format(PyExc_IndexError, "positions[%zd] = %lld is outside the %zd keys", i, (long long)pos[i], nkeys);
            goto done;
        }
    }
    buf = PyMem_RawMalloc((size_t)(longest + key_bytes));
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *k = keys.buf;
    int64_t *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *key = k + (pos != NULL ? pos[i] : i) * key_bytes;
        int64_t best = m > 0 ? 0 : -1;
        uint64_t best_score = 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            Py_ssize_t plen = PyBytes_GET_SIZE(items[j]);
            memcpy(buf, PyBytes_AS_STRING(items[j]), (size_t)plen);
            memcpy(buf + plen, key, (size_t)key_bytes);
            uint64_t score = X.h64(buf, (size_t)(plen + key_bytes));
            if (j == 0 || score > best_score) {
                best_score = score;
                best = j;
            }
        }
        o[i] = best;
    }
    result = PyLong_FromSsize_t(n);
done:
    PyMem_RawFree(buf);
    Py_XDECREF(seq);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    if (have_positions)
        PyBuffer_Release(&positions);
    return result;
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
KV_INTERNAL PyObject *
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
KV_INTERNAL PyObject *
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
