/* JSON arrays of integers straight to packed machine integers (kvcoord.coordinator.httpapi's fast path
 * for /query's token_ids and /query_by_hash's block_hashes; its twin is msgspec's typed decode, the
 * definition: the API decodes with msgspec whenever these answer None).
 *
 *   json_take_ints(data, key, kind)   one top-level member of an object, the rest handed back for msgspec
 *
 * Only the plainest forms are claimed: arrays of decimal integers without sign (or with '-' for the
 * signed kind), leading zeros, fraction or exponent; objects whose keys carry no escapes and appear once.
 * Anything else (floats, strings, nulls where ints are wanted, out-of-range values, escaped or repeated
 * keys, bad syntax) answers None, so the caller decodes the whole body with msgspec and gets msgspec's
 * value or msgspec's error. A wrong fast path can only be a missed speed-up, never a different answer;
 * the tests check both halves with hypothesis and a fuzzer.
 */
#include "native.h"

#define MAX_DEPTH 64 /* nesting json_take_ints skips through; deeper answers None */
#define MAX_KEYS 64  /* top-level members it tracks for repeats; more answers None */

static inline const unsigned char *
skip_ws(const unsigned char *p, const unsigned char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) {
        p++;
    }
    return p;
}

/* How many of the 8 bytes of x (little-endian: the first byte lowest) are leading ASCII digits, 0..8. */
static inline int
leading_digits(uint64_t x)
{
    uint64_t t = x - 0x3030303030303030ULL;
    /* a byte's high bit is set unless the byte is '0'..'9': below '0' borrows, above '9' overflows +0x76 */
    uint64_t bad = (t | (t + 0x7676767676767676ULL)) & 0x8080808080808080ULL;
    return bad == 0 ? 8 : __builtin_ctzll(bad) >> 3;
}

/* The value of n (1..8) ASCII digits, the first in the lowest byte of x (simdjson's eight-digit trick,
 * the number left-padded with zero bytes). */
static inline uint64_t
digits_value(uint64_t x, int n)
{
    x <<= 8 * (8 - n);
    x = ((x & 0x0F0F0F0F0F0F0F0FULL) * 2561) >> 8;
    x = ((x & 0x00FF00FF00FF00FFULL) * 6553601) >> 16;
    return ((x & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32;
}

static const uint64_t POW10[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000};

/* The value of the decimal digits at p (the first one checked already) in *out: the position after
 * them, or NULL when it is past uint64. Eight bytes at a time while the digits stay within 19 (which
 * cannot overflow uint64), then one at a time, the 20th checked. */
static inline const unsigned char *
parse_digits(const unsigned char *p, const unsigned char *end, uint64_t *out)
{
    const unsigned char *digits = p;
    uint64_t v = 0, x;
    if (end - p >= 8) {
        memcpy(&x, p, 8);
        int k = leading_digits(x);
        if (k < 8) { /* the common case (token ids): up to 7 digits and the byte after them */
            *out = digits_value(x, k);
            return p + k;
        }
        v = digits_value(x, 8);
        p += 8;
        while (end - p >= 8) {
            memcpy(&x, p, 8);
            k = leading_digits(x);
            if (k == 0 || (p - digits) + k > 19) {
                break;
            }
            v = v * POW10[k] + digits_value(x, k);
            p += k;
            if (k < 8) {
                *out = v;
                return p;
            }
        }
    }
    while (p < end && (unsigned)(*p - '0') <= 9 && p - digits < 19) {
        v = v * 10 + (unsigned)(*p - '0');
        p++;
    }
    if (p < end && (unsigned)(*p - '0') <= 9) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10) {
            return NULL; /* past uint64 */
        }
        v = v * 10 + d;
        p++;
        if (p < end && (unsigned)(*p - '0') <= 9) {
            return NULL;
        }
    }
    *out = v;
    return p;
}

/* Parse the int array starting at *pp ('[') into out (capacity cap values of width 4 or 8). On success
 * returns the count and leaves *pp after ']'; -1 when the input is not a plain int array that fits. */
static Py_ssize_t
kvn_json_int_array(const unsigned char **pp, const unsigned char *end, int u32, unsigned char *out,
                Py_ssize_t cap)
{
    const unsigned char *p = *pp;
    Py_ssize_t n = 0;
    if (p == end || *p++ != '[') {
        return -1;
    }
    p = skip_ws(p, end);
    if (p < end && *p == ']') {
        *pp = p + 1;
        return 0;
    }
    for (;;) {
        int neg = 0;
        if (p < end && *p == '-') {
            if (u32) {
                return -1;
            }
            neg = 1;
            p++;
        }
        if (p == end || (unsigned)(*p - '0') > 9) {
            return -1;
        }
        if (*p == '0' && p + 1 < end && (unsigned)(p[1] - '0') <= 9) {
            return -1; /* leading zero: not JSON */
        }
        uint64_t v;
        if ((p = parse_digits(p, end, &v)) == NULL) {
            return -1;
        }
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) {
            return -1; /* a float */
        }
        if (neg) {
            if (v > (uint64_t)1 << 63) {
                return -1;
            }
            v = (uint64_t)0 - v; /* two's complement: the int64's uint64 reinterpretation */
        } else if (u32 && v > 0xFFFFFFFFULL) {
            return -1;
        }
        if (n == cap) {
            return -1; /* cannot happen (cap bounds the count); refuse rather than overflow */
        }
        if (u32) {
            uint32_t w = (uint32_t)v;
            memcpy(out + 4 * n, &w, 4);
        } else {
            memcpy(out + 8 * n, &v, 8);
        }
        n++;
        if (p < end && *p == ',') { /* the common case: no whitespace */
            p++;
            p = skip_ws(p, end);
            continue;
        }
        p = skip_ws(p, end);
        if (p == end) {
            return -1;
        }
        if (*p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (*p == ']') {
            *pp = p + 1;
            return n;
        }
        return -1;
    }
}

/* 'I' -> 1 (uint32), 'Q' -> 0; -1 with an exception otherwise. */
static int
kind_arg(PyObject *arg)
{
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "kind must be 'I' or 'Q'");
        return -1;
    }
    const char *kind = PyUnicode_AsUTF8(arg);
    if (kind == NULL) {
        return -1;
    }
    if (strcmp(kind, "I") == 0) {
        return 1;
    }
    if (strcmp(kind, "Q") == 0) {
        return 0;
    }
    PyErr_SetString(PyExc_ValueError, "kind must be 'I' or 'Q'");
    return -1;
}

/* The packed ints of the array at p..end (the whole of it up to `stop`), or NULL without an exception
 * when it is not claimed (*claimed = 0), or NULL with an exception. */
static PyObject *
packed_array(const unsigned char **pp, const unsigned char *end, int u32, int *claimed)
{
    Py_ssize_t width = u32 ? 4 : 8;
    /* an upper bound of the count: each value needs at least one digit and one separator */
    Py_ssize_t cap = (end - *pp) / 2 + 1;
    PyObject *out = PyBytes_FromStringAndSize(NULL, cap * width);
    *claimed = 0;
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t n = kvn_json_int_array(pp, end, u32, (unsigned char *)PyBytes_AS_STRING(out), cap);
    if (n < 0) {
        Py_DECREF(out);
        return NULL;
    }
    *claimed = 1;
    if (_PyBytes_Resize(&out, n * width) < 0) {
        return NULL;
    }
    return out;
}

/* Skip one JSON string at p ('"'); the position after it, or NULL when it is not a valid string. */
static const unsigned char *
kvn_json_skip_string(const unsigned char *p, const unsigned char *end, int *escaped)
{
    p++;
    while (p < end) {
        unsigned char c = *p++;
        if (c == '"') {
            return p;
        }
        if (c < 0x20) {
            return NULL; /* a raw control character: not JSON */
        }
        if (c == '\\') {
            *escaped = 1;
            if (p == end) {
                return NULL;
            }
            p++; /* the escaped character; msgspec checks escapes themselves when it decodes the rest */
        }
    }
    return NULL;
}

/* Skip one JSON value at p; the position after it, or NULL when this skipper does not vouch for it (the
 * rest of the body is decoded by msgspec, which checks numbers and literals exactly). */
static const unsigned char *
skip_value(const unsigned char *p, const unsigned char *end, int depth)
{
    if (p == end || depth > MAX_DEPTH) {
        return NULL;
    }
    unsigned char c = *p;
    if (c == '"') {
        int escaped = 0;
        return kvn_json_skip_string(p, end, &escaped);
    }
    if (c == '[' || c == '{') {
        unsigned char close = c == '[' ? ']' : '}';
        p = skip_ws(p + 1, end);
        if (p < end && *p == close) {
            return p + 1;
        }
        for (;;) {
            if (c == '{') {
                int escaped = 0;
                if (p == end || *p != '"' || (p = kvn_json_skip_string(p, end, &escaped)) == NULL) {
                    return NULL;
                }
                p = skip_ws(p, end);
                if (p == end || *p++ != ':') {
                    return NULL;
                }
                p = skip_ws(p, end);
            }
            p = skip_value(p, end, depth + 1);
            if (p == NULL) {
                return NULL;
            }
            p = skip_ws(p, end);
            if (p == end) {
                return NULL;
            }
            if (*p == ',') {
                p = skip_ws(p + 1, end);
                continue;
            }
            return *p == close ? p + 1 : NULL;
        }
    }
    /* a number or a literal: its characters, validated by msgspec on the rest */
    const unsigned char *start = p;
    while (p < end && (((unsigned)(*p - '0') <= 9) || ((unsigned)((*p | 0x20) - 'a') < 26) || *p == '-' ||
                       *p == '+' || *p == '.')) {
        p++;
    }
    return p > start ? p : NULL;
}

/* The object base..p as bytes, its member value vstart..vend (when vstart is not NULL) replaced by
 * null. NULL with an exception when out of memory. */
static PyObject *
object_with_null(const unsigned char *base, const unsigned char *p, const unsigned char *vstart,
                 const unsigned char *vend)
{
    if (vstart == NULL) {
        return PyBytes_FromStringAndSize((const char *)base, p - base);
    }
    Py_ssize_t head = vstart - base, tail = p - vend;
    PyObject *rest = PyBytes_FromStringAndSize(NULL, head + 4 + tail);
    if (rest != NULL) {
        char *r = PyBytes_AS_STRING(rest);
        memcpy(r, base, (size_t)head);
        memcpy(r + head, "null", 4);
        if (tail > 0) {
            memcpy(r + head + 4, vend, (size_t)tail);
        }
    }
    return rest;
}

PyDoc_STRVAR(json_take_ints_doc,
"json_take_ints(data, key, kind) -> tuple[bytes | None, bytes] | None\n\n"
"`data` holding a JSON object: (the packed ints of its top-level member `key` (kind 'I': uint32\n"
"0..2**32-1; 'Q': uint64 keys of int64 or uint64 values, negative ones as their two's complement),\n"
"or None when the object has no such member; the object itself, up to its closing brace, with that\n"
"member's value replaced by null). None when this fast path does not claim the input: not an object,\n"
"a key with escapes, a key given twice, `key`'s value not a plain int array, or anything the skipper\n"
"cannot vouch for. Bytes after the object are dropped (Dynamo's indexer ignores them too, and so does\n"
"the typed decode the API falls back to).");

static PyObject *
json_take_ints(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "json_take_ints(data, key, kind): a bytes-like, a str, 'I' or 'Q'");
        return NULL;
    }
    Py_ssize_t klen;
    const char *key = PyUnicode_AsUTF8AndSize(args[1], &klen);
    if (key == NULL) {
        return NULL;
    }
    int u32 = kind_arg(args[2]);
    if (u32 < 0) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *base = view.buf, *end = base + view.len;
    const unsigned char *p = skip_ws(base, end);
    const unsigned char *keys[MAX_KEYS];
    Py_ssize_t lens[MAX_KEYS];
    int nkeys = 0;
    PyObject *ints = NULL, *result = NULL;
    const unsigned char *vstart = NULL, *vend = NULL;
    if (p == end || *p++ != '{') {
        goto none;
    }
    p = skip_ws(p, end);
    if (p < end && *p == '}') {
        p++;
        goto closed;
    }
    for (;;) {
        int escaped = 0;
        if (p == end || *p != '"') {
            goto none;
        }
        const unsigned char *kstart = p + 1;
        p = kvn_json_skip_string(p, end, &escaped);
        if (p == NULL || escaped || nkeys == MAX_KEYS) {
            goto none;
        }
        Py_ssize_t len = p - 1 - kstart;
        for (int i = 0; i < nkeys; i++) {
            if (lens[i] == len && memcmp(keys[i], kstart, (size_t)len) == 0) {
                goto none; /* a repeated key: msgspec's decode and the duplicate check answer it */
            }
        }
        keys[nkeys] = kstart;
        lens[nkeys++] = len;
        p = skip_ws(p, end);
        if (p == end || *p++ != ':') {
            goto none;
        }
        p = skip_ws(p, end);
        if (len == klen && memcmp(kstart, key, (size_t)klen) == 0) {
            vstart = p;
            int claimed;
            ints = packed_array(&p, end, u32, &claimed);
            if (ints == NULL) {
                goto none; /* an exception, if any, propagates from `none` */
            }
            vend = p;
        } else if ((p = skip_value(p, end, 1)) == NULL) {
            goto none;
        }
        p = skip_ws(p, end);
        if (p == end) {
            goto none;
        }
        if (*p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (*p++ != '}') {
            goto none;
        }
        break;
    }
closed:;
    PyObject *rest = object_with_null(base, p, vstart, vend);
    if (rest != NULL) {
        result = PyTuple_Pack(2, ints != NULL ? ints : Py_None, rest);
        Py_DECREF(rest);
    }
    Py_XDECREF(ints);
    PyBuffer_Release(&view);
    return result;
none:
    Py_XDECREF(ints);
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyMethodDef kvn_jsonints_methods[] = {
    {"json_take_ints", (PyCFunction)(void (*)(void))json_take_ints, METH_FASTCALL, json_take_ints_doc},
    {NULL, NULL, 0, NULL},
};
