/* vLLM's block-hash chains (kvcoord.hashing's native path; its pure-Python twin is
 * kvcoord.hashing._chain_reference, the definition), and SGLang's page-hash chain (sglang_chain; twin:
 * kvcoord.hashing._sglang_chain_reference).
 *
 * vLLM's block hash is H(serialise((parent, tuple(tokens), extra_keys))) with canonical CBOR or pickle
 * protocol 5. The serialised bytes are simple enough to write byte by byte. Each block's message is
 * written here, then hashed either in C (DIGEST_SHA256: OpenSSL's SHA256, when the build found OpenSSL;
 * DIGEST_XXH3_128: the vendored xxHash, canonical big-endian form) or by a Python hash callable
 * (hashlib.sha256 + .digest(), xxhash.xxh3_128_digest: what the reference itself calls). The C digests
 * keep a chain free of any Python call per block; the tests prove both equal to the reference.
 *
 * With keys_only, the answer is the packed uint64 keys (vLLM's int form of each digest: its last 8 bytes,
 * big-endian) instead of the digests, which is all a lookup needs.
 */
#include "native.h"

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "vendor/xxhash.h"

#ifdef KVN_HAVE_OPENSSL
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>
#endif

#define DIGEST_SHA256 1
#define DIGEST_XXH3_128 2

static PyObject *str_digest; /* interned "digest", set by kvn_hashchain_init */

/* The chain's hasher and the previous digest: in C (code > 0) the digest lives in `prev`; with a Python
 * callable it is the bytes object `prev_obj` (a strong reference). */
typedef struct {
    int code;
    PyObject *fn;
    int call_digest;
    unsigned char prev[256];
    Py_ssize_t plen;
    PyObject *prev_obj;
} chain_state;

static const unsigned char *
prev_bytes(const chain_state *st, Py_ssize_t *len)
{
    if (st->code) {
        *len = st->plen;
        return st->prev;
    }
    *len = PyBytes_GET_SIZE(st->prev_obj);
    return (const unsigned char *)PyBytes_AS_STRING(st->prev_obj);
}

/* vLLM's int form of a digest: int.from_bytes(digest, "big") & (2**64 - 1). */
static inline uint64_t
digest_key(const unsigned char *d, Py_ssize_t len)
{
    uint64_t key = 0;
    for (Py_ssize_t k = len > 8 ? len - 8 : 0; k < len; k++) {
        key = (key << 8) | d[k];
    }
    return key;
}

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

/* The arguments both chains share: (hasher, call_digest, parent, tokens, block_size, count[, ...]).
 * hasher is a DIGEST_* code (an int) or a Python callable; st->prev/prev_obj starts as the parent. */
static int
chain_args(PyObject *const *args, chain_state *st, Py_ssize_t *block_size, Py_ssize_t *count)
{
    memset(st, 0, sizeof *st);
    if (!PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "parent must be bytes");
        return -1;
    }
    if (PyLong_Check(args[0])) {
        long code = PyLong_AsLong(args[0]);
        if (code == -1 && PyErr_Occurred()) {
            return -1;
        }
#ifndef KVN_HAVE_OPENSSL
        if (code == DIGEST_SHA256) {
            PyErr_SetString(PyExc_ValueError, "this build has no C SHA-256 (OpenSSL was not found)");
            return -1;
        }
#endif
        if (code != DIGEST_SHA256 && code != DIGEST_XXH3_128) {
            PyErr_SetString(PyExc_ValueError, "unknown digest code");
            return -1;
        }
        if (PyBytes_GET_SIZE(args[2]) >= 256) {
            PyErr_SetString(PyExc_ValueError, "parent must be shorter than 256 bytes");
            return -1;
        }
        st->code = (int)code;
        st->plen = PyBytes_GET_SIZE(args[2]);
        if (st->plen > 0) {
            memcpy(st->prev, PyBytes_AS_STRING(args[2]), (size_t)st->plen);
        }
    } else {
        if (!PyCallable_Check(args[0])) {
            PyErr_SetString(PyExc_TypeError, "hasher must be a digest code or a callable");
            return -1;
        }
        st->call_digest = PyObject_IsTrue(args[1]);
        if (st->call_digest < 0) {
            return -1;
        }
        st->fn = args[0];
        st->prev_obj = Py_NewRef(args[2]);
    }
    *block_size = PyLong_AsSsize_t(args[4]);
    if (*block_size == -1 && PyErr_Occurred()) {
        goto fail;
    }
    *count = PyLong_AsSsize_t(args[5]);
    if (*count == -1 && PyErr_Occurred()) {
        goto fail;
    }
    if (*block_size < 0 || *count < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size and count must be >= 0");
        goto fail;
    }
    return 0;
fail:
    Py_CLEAR(st->prev_obj);
    return -1;
}

/* Hash one block's message and advance the chain. The digest goes to out[i] (a list) when out is not
 * NULL, its key to keys[i] when keys is not NULL. 0, or -1 with an exception. */
static int
chain_step(chain_state *st, const unsigned char *msg, Py_ssize_t len, PyObject *out, Py_ssize_t i,
           unsigned char *keys)
{
    const unsigned char *d;
    Py_ssize_t dlen;
    if (st->code == DIGEST_XXH3_128) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(msg, (size_t)len));
        memcpy(st->prev, c.digest, 16);
        st->plen = 16;
    }
#ifdef KVN_HAVE_OPENSSL
    else if (st->code == DIGEST_SHA256) {
        /* The low-level calls: OpenSSL 3's one-shot SHA256() fetches an EVP provider on every call,
         * which costs more than hashing a 100-byte block. */
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, msg, (size_t)len);
        SHA256_Final(st->prev, &ctx);
        st->plen = 32;
    }
#endif
    if (st->code) {
        d = st->prev;
        dlen = st->plen;
        if (out != NULL) {
            PyObject *b = PyBytes_FromStringAndSize((const char *)d, dlen);
            if (b == NULL) {
                return -1;
            }
            PyList_SET_ITEM(out, i, b);
        }
    } else {
        PyObject *digest = hash_message(st->fn, st->call_digest, msg, len);
        if (digest == NULL) {
            return -1;
        }
        if (out != NULL) {
            PyList_SET_ITEM(out, i, Py_NewRef(digest));
        }
        Py_SETREF(st->prev_obj, digest);
        d = (const unsigned char *)PyBytes_AS_STRING(digest);
        dlen = PyBytes_GET_SIZE(digest);
    }
    if (keys != NULL) {
        uint64_t key = digest_key(d, dlen);
        memcpy(keys + 8 * i, &key, 8);
    }
    return 0;
}

/* The chain's answer container: a list of count digests, or (keys_only) a bytes of count uint64 keys. */
static int
chain_output(int keys_only, Py_ssize_t count, PyObject **out, PyObject **keys)
{
    *out = NULL;
    *keys = NULL;
    if (keys_only) {
        *keys = PyBytes_FromStringAndSize(NULL, 8 * count);
        return *keys == NULL ? -1 : 0;
    }
    *out = PyList_New(count);
    return *out == NULL ? -1 : 0;
}

/* Token j of a uint64 or uint32 buffer that need not be aligned (a memoryview slice cast to 'Q' is not). */
static inline uint64_t
load_token(const unsigned char *p, Py_ssize_t itemsize, Py_ssize_t j)
{
    if (itemsize == 8) {
        uint64_t v;
        memcpy(&v, p + 8 * j, sizeof v);
        return v;
    }
    uint32_t v;
    memcpy(&v, p + 4 * j, sizeof v);
    return v;
}

/* The token buffer (array('Q') or array('I')), checked to hold count blocks; 0, or -1 with an exception
 * (view released). */
static int
token_view(PyObject *tokens, Py_buffer *view, Py_ssize_t block_size, Py_ssize_t count)
{
    if (PyObject_GetBuffer(tokens, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    int u64 = view->itemsize == 8 && view->format != NULL && strcmp(view->format, "Q") == 0;
    int u32 = view->itemsize == 4 && view->format != NULL && strcmp(view->format, "I") == 0;
    if (!u64 && !u32) { /* native uint64 or uint32 */
        PyErr_SetString(PyExc_TypeError, "tokens must be a uint64 or uint32 buffer (array('Q'), array('I'))");
    } else if (block_size != 0 && view->len / view->itemsize / block_size < count) {
        PyErr_SetString(PyExc_ValueError, "fewer tokens than count * block_size");
    } else {
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

/* The optional keys_only argument (index `at`): 0 or 1, or -1 with an exception. */
static int
keys_only_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t at)
{
    return nargs > at ? PyObject_IsTrue(args[at]) : 0;
}

PyDoc_STRVAR(cbor_chain_doc,
"cbor_chain(hasher, call_digest, parent, tokens, block_size, count, tails, keys_only=False)\n\n"
"Digests of `count` chained blocks: block i hashes canonical CBOR of\n"
"(previous digest or `parent`, tuple(tokens[i*block_size:(i+1)*block_size]), <tail>)\n"
"where the tail is already-encoded CBOR of the extra keys (b'\\xf6' for None): `tails` is\n"
"one bytes object for every block or a list of `count` bytes objects. `tokens` is a\n"
"buffer of uint64 or uint32 (array('Q'), array('I')). `hasher` is a digest code (1: SHA-256,\n"
"2: XXH3-128, hashed in C) or a callable: the digest is hasher(message), then .digest() of that\n"
"when `call_digest` is true (hashlib constructors). Returns a list of digests, or with keys_only\n"
"the bytes of `count` native uint64 keys (each digest's last 8 bytes, big-endian).");

static PyObject *
kvn_cbor_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "cbor_chain takes 7 or 8 arguments");
        return NULL;
    }
    chain_state st;
    Py_ssize_t block_size, count;
    if (chain_args(args, &st, &block_size, &count) < 0) {
        return NULL;
    }
    PyObject *out = NULL, *keys = NULL, *result = NULL;
    unsigned char *buf = NULL;
    int keys_only = keys_only_arg(args, nargs, 7);
    PyObject *tails = args[6];
    int shared_tail = PyBytes_Check(tails);
    if (keys_only < 0) {
        Py_XDECREF(st.prev_obj);
        return NULL;
    }
    if (!shared_tail && !PyList_Check(tails)) {
        PyErr_SetString(PyExc_TypeError, "tails must be bytes or a list of count bytes");
        Py_XDECREF(st.prev_obj);
        return NULL;
    }
    Py_buffer view;
    if (token_view(args[3], &view, block_size, count) < 0) {
        Py_XDECREF(st.prev_obj);
        return NULL;
    }
    Py_ssize_t cap = 0; /* scratch message buffer, grown to the largest message */
    const unsigned char *tokens = (const unsigned char *)view.buf;
    unsigned char bs_head[9];
    Py_ssize_t bs_head_len = cbor_head(bs_head, 4, (uint64_t)block_size);
    if (chain_output(keys_only, count, &out, &keys) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *tail = tails;
        if (!shared_tail) {
            /* checked per block: a hash callable may run Python code that changes the list */
            if (PyList_GET_SIZE(tails) != count || !PyBytes_Check(PyList_GET_ITEM(tails, i))) {
                PyErr_SetString(PyExc_TypeError, "tails must be bytes or a list of count bytes");
                goto done;
            }
            tail = PyList_GET_ITEM(tails, i);
        }
        Py_ssize_t plen;
        const unsigned char *prev = prev_bytes(&st, &plen);
        Py_ssize_t tlen = PyBytes_GET_SIZE(tail);
        Py_ssize_t need = 10 + plen + bs_head_len + 9 * block_size + tlen;
        if (need > cap) {
            unsigned char *nb = PyMem_Realloc(buf, (size_t)need);
            if (nb == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            buf = nb;
            cap = need;
        }
        unsigned char *p = buf;
        *p++ = 0x83; /* array of 3: (parent, tokens, extra keys) */
        p += cbor_head(p, 2, (uint64_t)plen);
        if (plen > 0) {
            memcpy(p, prev, (size_t)plen);
        }
        p += plen;
        memcpy(p, bs_head, (size_t)bs_head_len);
        p += bs_head_len;
        const unsigned char *t = tokens + view.itemsize * i * block_size;
        for (Py_ssize_t j = 0; j < block_size; j++) {
            p += cbor_head(p, 0, load_token(t, view.itemsize, j));
        }
        memcpy(p, PyBytes_AS_STRING(tail), (size_t)tlen);
        p += tlen;
        if (chain_step(&st, buf, p - buf, out, i,
                       keys != NULL ? (unsigned char *)PyBytes_AS_STRING(keys) : NULL) < 0) {
            goto done;
        }
    }
    result = keys_only ? Py_NewRef(keys) : Py_NewRef(out);

done:
    Py_XDECREF(out);
    Py_XDECREF(keys);
    Py_XDECREF(st.prev_obj);
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    return result;
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
"pickle_chain(hasher, call_digest, parent, tokens, block_size, count, keys_only=False)\n\n"
"vLLM's sha256 / xxhash chain for blocks without extra keys: block i hashes\n"
"pickle.dumps((previous digest or `parent`, tuple(tokens[i*block_size:(i+1)*block_size]), None),\n"
"protocol=5), byte for byte as CPython's pickler writes it (one frame, memoized bytes and tuples).\n"
"`tokens` is array('Q') or array('I'); block_size at most 4096. hasher, call_digest and keys_only\n"
"as for cbor_chain.");

static PyObject *
kvn_pickle_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "pickle_chain takes 6 or 7 arguments");
        return NULL;
    }
    if (!PyBytes_Check(args[2]) || PyBytes_GET_SIZE(args[2]) >= 256) {
        PyErr_SetString(PyExc_ValueError, "need a bytes parent shorter than 256 bytes and block_size <= 4096");
        return NULL;
    }
    chain_state st;
    Py_ssize_t block_size, count;
    if (chain_args(args, &st, &block_size, &count) < 0) {
        return NULL;
    }
    int keys_only = keys_only_arg(args, nargs, 6);
    if (keys_only < 0 || block_size > PICKLE_MAX_BLOCK) {
        if (keys_only >= 0) {
            PyErr_SetString(PyExc_ValueError, "need a parent shorter than 256 bytes and block_size <= 4096");
        }
        Py_XDECREF(st.prev_obj);
        return NULL;
    }
    Py_buffer view;
    if (token_view(args[3], &view, block_size, count) < 0) {
        Py_XDECREF(st.prev_obj);
        return NULL;
    }
    PyObject *out = NULL, *keys = NULL, *result = NULL;
    const unsigned char *tokens = (const unsigned char *)view.buf;
    unsigned char *buf = PyMem_Malloc((size_t)(32 + 255 + 11 * block_size));
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (chain_output(keys_only, count, &out, &keys) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t plen;
        const unsigned char *prev = prev_bytes(&st, &plen);
        if (plen >= 256) { /* a callable's digest: hash_message keeps them shorter, checked again here */
            PyErr_SetString(PyExc_ValueError, "digest too long for the pickle chain");
            goto done;
        }
        unsigned char *p = buf;
        *p++ = 0x80; /* PROTO 5 */
        *p++ = 5;
        *p++ = 0x95; /* FRAME, its length patched in below */
        unsigned char *frame_len = p;
        p += 8;
        unsigned char *frame = p;
        *p++ = 'C'; /* SHORT_BINBYTES: the parent digest */
        *p++ = (unsigned char)plen;
        if (plen > 0) {
            memcpy(p, prev, (size_t)plen);
        }
        p += plen;
        *p++ = 0x94; /* MEMOIZE */
        const unsigned char *t = tokens + view.itemsize * i * block_size;
        if (block_size == 0) {
            *p++ = ')'; /* EMPTY_TUPLE (not memoized) */
        } else {
            if (block_size > 3) {
                *p++ = '('; /* MARK */
            }
            for (Py_ssize_t j = 0; j < block_size; j++) {
                p += pickle_uint(p, load_token(t, view.itemsize, j));
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
        if (chain_step(&st, buf, p - buf, out, i,
                       keys != NULL ? (unsigned char *)PyBytes_AS_STRING(keys) : NULL) < 0) {
            goto done;
        }
    }
    result = keys_only ? Py_NewRef(keys) : Py_NewRef(out);
done:
    Py_XDECREF(out);
    Py_XDECREF(keys);
    Py_XDECREF(st.prev_obj);
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    return result;
}

#ifdef KVN_HAVE_OPENSSL
/* SGLang's published key of a chain digest: its first 8 bytes, big-endian (SGLang's signed int64 as
 * uint64); with a namespace seed (32 bytes), the first 8 bytes of SHA-256(seed || those 8 bytes). */
static uint64_t
sglang_key(const unsigned char *digest, const unsigned char *ns)
{
    unsigned char d[32];
    const unsigned char *src = digest;
    if (ns != NULL) {
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, ns, 32);
        SHA256_Update(&ctx, digest, 8);
        SHA256_Final(d, &ctx);
        src = d;
    }
    uint64_t key = 0;
    for (int k = 0; k < 8; k++) {
        key = (key << 8) | src[k];
    }
    return key;
}

/* One page's message: uint32 little-endian ids, or (a page with an id above 2**32-1) 0xFF then uint64
 * little-endian ids. 0 with *len set, or -1 with ValueError for an id above 2**63-1 (SGLang's limit). */
static int
sglang_page(const unsigned char *p, Py_ssize_t itemsize, Py_ssize_t bs, unsigned char *buf, Py_ssize_t *len)
{
    int wide = 0;
    if (itemsize == 8) {
        for (Py_ssize_t j = 0; j < bs; j++) {
            uint64_t v = load_token(p, 8, j);
            if (v > (uint64_t)INT64_MAX) {
                PyErr_SetString(PyExc_ValueError, "token id must be a non-negative int64 (SGLang's limit)");
                return -1;
            }
            wide |= v > UINT32_MAX;
        }
    }
    unsigned char *w = buf;
    if (wide) {
        *w++ = 0xff;
    }
    for (Py_ssize_t j = 0; j < bs; j++) {
        uint64_t v = load_token(p, itemsize, j);
        for (int k = 0; k < (wide ? 8 : 4); k++) {
            *w++ = (unsigned char)(v >> (8 * k));
        }
    }
    *len = w - buf;
    return 0;
}

PyDoc_STRVAR(sglang_chain_doc,
"sglang_chain(parent, tokens, block_size, count, namespace, keys_only=False)\n\n"
"SGLang's page-hash chain: page i's digest is SHA-256(previous digest || page bytes), the first\n"
"page's previous digest being `parent` (b'' for none, else 32 bytes: a cache-salt seed). A page is\n"
"its ids as uint32 little-endian, or 0xFF and uint64 little-endian when an id exceeds 2**32-1.\n"
"`tokens` is a buffer of uint64 or uint32. Returns the list of `count` digests, or with keys_only\n"
"the bytes of `count` native uint64 keys: each digest's first 8 bytes, big-endian, rehashed as\n"
"SHA-256(namespace || those 8 bytes) when `namespace` (b'' or 32 bytes) is given.");

static PyObject *
kvn_sglang_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 5 || nargs > 6) {
        PyErr_SetString(PyExc_TypeError, "sglang_chain takes 5 or 6 arguments");
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || !PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "parent and namespace must be bytes");
        return NULL;
    }
    Py_ssize_t plen = PyBytes_GET_SIZE(args[0]), nslen = PyBytes_GET_SIZE(args[4]);
    if ((plen != 0 && plen != 32) || (nslen != 0 && nslen != 32)) {
        PyErr_SetString(PyExc_ValueError, "parent and namespace must be empty or 32 bytes");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[2]);
    if (bs == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (bs < 1 || count < 0 || bs > (PY_SSIZE_T_MAX - 1) / 8) {
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1 and count >= 0");
        return NULL;
    }
    int keys_only = keys_only_arg(args, nargs, 5);
    if (keys_only < 0) {
        return NULL;
    }
    Py_buffer view;
    if (token_view(args[1], &view, bs, count) < 0) {
        return NULL;
    }
    PyObject *out = NULL, *keys = NULL, *result = NULL;
    unsigned char *buf = PyMem_Malloc((size_t)(1 + 8 * bs));
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (chain_output(keys_only, count, &out, &keys) < 0) {
        goto done;
    }
    unsigned char prev[32];
    int have = plen == 32;
    if (have) {
        memcpy(prev, PyBytes_AS_STRING(args[0]), 32);
    }
    const unsigned char *ns = nslen ? (const unsigned char *)PyBytes_AS_STRING(args[4]) : NULL;
    const unsigned char *tok = view.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t len;
        if (sglang_page(tok + i * bs * view.itemsize, view.itemsize, bs, buf, &len) < 0) {
            goto done;
        }
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        if (have) {
            SHA256_Update(&ctx, prev, 32);
        }
        SHA256_Update(&ctx, buf, (size_t)len);
        SHA256_Final(prev, &ctx);
        have = 1;
        if (keys != NULL) {
            uint64_t key = sglang_key(prev, ns);
            memcpy(PyBytes_AS_STRING(keys) + 8 * i, &key, 8);
        } else {
            PyObject *b = PyBytes_FromStringAndSize((const char *)prev, 32);
            if (b == NULL) {
                goto done;
            }
            PyList_SET_ITEM(out, i, b);
        }
    }
    result = keys_only ? Py_NewRef(keys) : Py_NewRef(out);
done:
    Py_XDECREF(out);
    Py_XDECREF(keys);
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    return result;
}
#endif

PyMethodDef kvn_hashchain_methods[] = {
    {"cbor_chain", (PyCFunction)(void (*)(void))kvn_cbor_chain, METH_FASTCALL, cbor_chain_doc},
    {"pickle_chain", (PyCFunction)(void (*)(void))kvn_pickle_chain, METH_FASTCALL, pickle_chain_doc},
#ifdef KVN_HAVE_OPENSSL
    {"sglang_chain", (PyCFunction)(void (*)(void))kvn_sglang_chain, METH_FASTCALL, sglang_chain_doc},
#endif
    {NULL, NULL, 0, NULL},
};

int
kvn_hashchain_init(PyObject *module)
{
    if (str_digest == NULL) {
        str_digest = PyUnicode_InternFromString("digest");
    }
    if (str_digest == NULL) {
        return -1;
    }
    /* The digests this build hashes in C, by vLLM's name for the function: hashing.py picks the code. */
#ifdef KVN_HAVE_OPENSSL
    PyObject *codes = Py_BuildValue("{s:i,s:i}", "sha256", DIGEST_SHA256, "xxh3_128", DIGEST_XXH3_128);
#else
    PyObject *codes = Py_BuildValue("{s:i}", "xxh3_128", DIGEST_XXH3_128);
#endif
    if (codes == NULL) {
        return -1;
    }
    int r = PyModule_AddObjectRef(module, "C_DIGESTS", codes);
    Py_DECREF(codes);
    return r;
}
