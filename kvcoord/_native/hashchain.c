/* vLLM's block-hash chains (kvcoord.hashing's native path; its pure-Python twin is
 * kvcoord.hashing._chain_reference, the definition).
 *
 * vLLM's block hash is H(serialise((parent, tuple(tokens), extra_keys))) with canonical CBOR or pickle
 * protocol 5. The serialised bytes are simple enough to write byte by byte; what makes the Python path
 * slow is the per-token and per-block interpreter work, not the hashing. Each block's message is
 * written here and hashed by the *same* Python hash callable the reference uses (hashlib.sha256 +
 * .digest(), or xxhash.xxh3_128_digest), so this file carries no digest implementation of its own.
 */
#include "native.h"

static PyObject *str_digest; /* interned "digest", set by kvn_hashchain_init */

/* Append the CBOR head of (major type, n) at p; return the number of bytes written (1..9). */
static Py_ssize_t
cbor_head(unsigned char *p, unsigned int major, uint64_t n)
{
    unsigned char m = (unsigned char)(major << 5);
    if (n < 24) {
        p[0] = m | (unsigned char)n;
        return 1;
    }
    if (n < 0x100) {
        p[0] = m | 24;
        p[1] = (unsigned char)n;
        return 2;
    }
    if (n < 0x10000) {
        p[0] = m | 25;
        p[1] = (unsigned char)(n >> 8);
        p[2] = (unsigned char)n;
        return 3;
    }
    if (n < 0x100000000ULL) {
        p[0] = m | 26;
        p[1] = (unsigned char)(n >> 24);
        p[2] = (unsigned char)(n >> 16);
        p[3] = (unsigned char)(n >> 8);
        p[4] = (unsigned char)n;
        return 5;
    }
    p[0] = m | 27;
    for (int i = 0; i < 8; i++) {
        p[1 + i] = (unsigned char)(n >> (56 - 8 * i));
    }
    return 9;
}

/* hash_fn(message), then .digest() of that when call_digest: a new reference to the digest bytes,
 * or NULL with an exception (also when the result is not bytes shorter than 256). */
static PyObject *
hash_message(PyObject *hash_fn, int call_digest, const unsigned char *buf, Py_ssize_t len)
{
    PyObject *msg = PyBytes_FromStringAndSize((const char *)buf, len);
    if (msg == NULL) {
        return NULL;
    }
    PyObject *digest = PyObject_CallOneArg(hash_fn, msg);
    Py_DECREF(msg);
    if (digest != NULL && call_digest) {
        PyObject *h = digest;
        digest = PyObject_CallMethodNoArgs(h, str_digest);
        Py_DECREF(h);
    }
    if (digest != NULL && (!PyBytes_CheckExact(digest) || PyBytes_GET_SIZE(digest) >= 256)) {
        Py_DECREF(digest);
        PyErr_SetString(PyExc_TypeError, "hash function must return bytes (shorter than 256)");
        return NULL;
    }
    return digest;
}

/* The arguments both chains share: (hash_fn, call_digest, parent, tokens, block_size, count). */
static int
chain_args(PyObject *const *args, int *call_digest, Py_ssize_t *block_size, Py_ssize_t *count)
{
    *call_digest = PyObject_IsTrue(args[1]);
    if (*call_digest < 0) {
        return -1;
    }
    if (!PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "parent must be bytes");
        return -1;
    }
    *block_size = PyLong_AsSsize_t(args[4]);
    if (*block_size == -1 && PyErr_Occurred()) {
        return -1;
    }
    *count = PyLong_AsSsize_t(args[5]);
    if (*count == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*block_size < 0 || *count < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size and count must be >= 0");
        return -1;
    }
    return 0;
}

/* Token j of a uint64 buffer that need not be 8-aligned (a memoryview slice cast to 'Q' is not). */
static inline uint64_t
load_u64(const unsigned char *p, Py_ssize_t j)
{
    uint64_t v;
    memcpy(&v, p + 8 * j, sizeof v);
    return v;
}

/* The uint64 token buffer, checked to hold count blocks; 0, or -1 with an exception (view released). */
static int
token_view(PyObject *tokens, Py_buffer *view, Py_ssize_t block_size, Py_ssize_t count)
{
    if (PyObject_GetBuffer(tokens, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (view->itemsize != 8 || view->format == NULL || strcmp(view->format, "Q") != 0) { /* native uint64 */
        PyErr_SetString(PyExc_TypeError, "tokens must be a uint64 buffer (array('Q'))");
    } else if (block_size != 0 && view->len / 8 / block_size < count) {
        PyErr_SetString(PyExc_ValueError, "fewer tokens than count * block_size");
    } else {
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

PyDoc_STRVAR(cbor_chain_doc,
"cbor_chain(hash_fn, call_digest, parent, tokens, block_size, count, tails) -> list[bytes]\n\n"
"Digests of `count` chained blocks: block i hashes canonical CBOR of\n"
"(previous digest or `parent`, tuple(tokens[i*block_size:(i+1)*block_size]), <tail>)\n"
"where the tail is already-encoded CBOR of the extra keys (b'\\xf6' for None): `tails` is\n"
"one bytes object for every block or a list of `count` bytes objects. `tokens` is a\n"
"buffer of uint64 (array('Q')). The digest is hash_fn(message), then .digest() of that\n"
"when `call_digest` is true (hashlib constructors).");

static PyObject *
cbor_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "cbor_chain takes 7 arguments");
        return NULL;
    }
    int call_digest;
    Py_ssize_t block_size, count;
    if (chain_args(args, &call_digest, &block_size, &count) < 0) {
        return NULL;
    }
    PyObject *tails = args[6];
    int shared_tail = PyBytes_Check(tails);
    if (!shared_tail && !PyList_Check(tails)) {
        PyErr_SetString(PyExc_TypeError, "tails must be bytes or a list of count bytes");
        return NULL;
    }
    Py_buffer view;
    if (token_view(args[3], &view, block_size, count) < 0) {
        return NULL;
    }
    PyObject *out = NULL;
    unsigned char *buf = NULL;
    Py_ssize_t cap = 0; /* scratch message buffer, grown to the largest message */
    const unsigned char *tokens = (const unsigned char *)view.buf;
    PyObject *prev = args[2]; /* borrowed: parent, or the previous digest held by `out` */
    unsigned char bs_head[9];
    Py_ssize_t bs_head_len = cbor_head(bs_head, 4, (uint64_t)block_size);
    out = PyList_New(count);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *tail = tails;
        if (!shared_tail) {
            /* checked per block: hash_fn may run Python code that changes the list */
            if (PyList_GET_SIZE(tails) != count || !PyBytes_Check(PyList_GET_ITEM(tails, i))) {
                PyErr_SetString(PyExc_TypeError, "tails must be bytes or a list of count bytes");
                Py_CLEAR(out);
                goto done;
            }
            tail = PyList_GET_ITEM(tails, i);
        }
        Py_ssize_t plen = PyBytes_GET_SIZE(prev);
        Py_ssize_t tlen = PyBytes_GET_SIZE(tail);
        Py_ssize_t need = 10 + plen + bs_head_len + 9 * block_size + tlen;
        if (need > cap) {
            unsigned char *nb = PyMem_Realloc(buf, (size_t)need);
            if (nb == NULL) {
                PyErr_NoMemory();
                Py_CLEAR(out);
                goto done;
            }
            buf = nb;
            cap = need;
        }
        unsigned char *p = buf;
        *p++ = 0x83; /* array of 3: (parent, tokens, extra keys) */
        p += cbor_head(p, 2, (uint64_t)plen);
        memcpy(p, PyBytes_AS_STRING(prev), (size_t)plen);
        p += plen;
        memcpy(p, bs_head, (size_t)bs_head_len);
        p += bs_head_len;
        const unsigned char *t = tokens + 8 * i * block_size;
        for (Py_ssize_t j = 0; j < block_size; j++) {
            p += cbor_head(p, 0, load_u64(t, j));
        }
        memcpy(p, PyBytes_AS_STRING(tail), (size_t)tlen);
        p += tlen;
        PyObject *digest = hash_message(args[0], call_digest, buf, p - buf);
        if (digest == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, digest); /* steals the reference */
        prev = digest;
    }

done:
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    return out;
}

/* pickle protocol 5 of one non-negative int, exactly as CPython's _pickle writes it (save_long). */
static Py_ssize_t
pickle_uint(unsigned char *p, uint64_t v)
{
    if (v < 0x100) {
        p[0] = 'K'; /* BININT1 */
        p[1] = (unsigned char)v;
        return 2;
    }
    if (v < 0x10000) {
        p[0] = 'M'; /* BININT2 */
        p[1] = (unsigned char)v;
        p[2] = (unsigned char)(v >> 8);
        return 3;
    }
    if (v <= 0x7fffffffULL) {
        p[0] = 'J'; /* BININT: 4-byte signed */
        for (int i = 0; i < 4; i++) {
            p[1 + i] = (unsigned char)(v >> (8 * i));
        }
        return 5;
    }
    /* LONG1: little-endian two's complement in bit_length // 8 + 1 bytes (a zero top byte keeps the
     * sign positive) */
    int nbits = 64 - __builtin_clzll(v);
    int n = nbits / 8 + 1;
    p[0] = 0x8a;
    p[1] = (unsigned char)n;
    for (int i = 0; i < n; i++) {
        p[2 + i] = i < 8 ? (unsigned char)(v >> (8 * i)) : 0;
    }
    return 2 + n;
}

#define PICKLE_MAX_BLOCK 4096 /* past this a block's pickle may span frames (64 KiB): not written here */

PyDoc_STRVAR(pickle_chain_doc,
"pickle_chain(hash_fn, call_digest, parent, tokens, block_size, count) -> list[bytes]\n\n"
"vLLM's sha256 / xxhash chain for blocks without extra keys: block i hashes\n"
"pickle.dumps((previous digest or `parent`, tuple(tokens[i*block_size:(i+1)*block_size]), None),\n"
"protocol=5), byte for byte as CPython's pickler writes it (one frame, memoized bytes and tuples).\n"
"`tokens` is array('Q'); block_size at most 4096. hash_fn as for cbor_chain.");

static PyObject *
pickle_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "pickle_chain takes 6 arguments");
        return NULL;
    }
    int call_digest;
    Py_ssize_t block_size, count;
    if (chain_args(args, &call_digest, &block_size, &count) < 0) {
        return NULL;
    }
    if (PyBytes_GET_SIZE(args[2]) >= 256 || block_size > PICKLE_MAX_BLOCK) {
        PyErr_SetString(PyExc_ValueError, "need a parent shorter than 256 bytes and block_size <= 4096");
        return NULL;
    }
    Py_buffer view;
    if (token_view(args[3], &view, block_size, count) < 0) {
        return NULL;
    }
    PyObject *out = NULL;
    const unsigned char *tokens = (const unsigned char *)view.buf;
    PyObject *prev = args[2];
    unsigned char *buf = PyMem_Malloc((size_t)(32 + 255 + 11 * block_size));
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyList_New(count);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t plen = PyBytes_GET_SIZE(prev);
        unsigned char *p = buf;
        *p++ = 0x80; /* PROTO 5 */
        *p++ = 5;
        *p++ = 0x95; /* FRAME, its length patched in below */
        unsigned char *frame_len = p;
        p += 8;
        unsigned char *frame = p;
        *p++ = 'C'; /* SHORT_BINBYTES: the parent digest */
        *p++ = (unsigned char)plen;
        memcpy(p, PyBytes_AS_STRING(prev), (size_t)plen);
        p += plen;
        *p++ = 0x94; /* MEMOIZE */
        const unsigned char *t = tokens + 8 * i * block_size;
        if (block_size == 0) {
            *p++ = ')'; /* EMPTY_TUPLE (not memoized) */
        } else {
            if (block_size > 3) {
                *p++ = '('; /* MARK */
            }
            for (Py_ssize_t j = 0; j < block_size; j++) {
                p += pickle_uint(p, load_u64(t, j));
            }
            *p++ = block_size == 1 ? 0x85 : block_size == 2 ? 0x86 : block_size == 3 ? 0x87 : 't';
            *p++ = 0x94; /* MEMOIZE */
        }
        *p++ = 'N';  /* None: no extra keys */
        *p++ = 0x87; /* TUPLE3 */
        *p++ = 0x94; /* MEMOIZE */
        *p++ = '.';  /* STOP */
        uint64_t flen = (uint64_t)(p - frame);
        for (int k = 0; k < 8; k++) {
            frame_len[k] = (unsigned char)(flen >> (8 * k));
        }
        PyObject *digest = hash_message(args[0], call_digest, buf, p - buf);
        if (digest == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, digest);
        prev = digest; /* shorter than 256: hash_message checked */
    }
done:
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    return out;
}

PyMethodDef kvn_hashchain_methods[] = {
    {"cbor_chain", (PyCFunction)(void (*)(void))cbor_chain, METH_FASTCALL, cbor_chain_doc},
    {"pickle_chain", (PyCFunction)(void (*)(void))pickle_chain, METH_FASTCALL, pickle_chain_doc},
    {NULL, NULL, 0, NULL},
};

int
kvn_hashchain_init(PyObject *module)
{
    (void)module;
    if (str_digest == NULL) {
        str_digest = PyUnicode_InternFromString("digest");
    }
    return str_digest == NULL ? -1 : 0;
}
