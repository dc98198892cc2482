/* JSON arrays of integers straight to packed machine integers (kvcoord.coordinator.httpapi's fast path
 * for /query's token_ids and /query_by_hash's block_hashes; its twin is msgspec's typed decode, the
 * definition: the API decodes with msgspec whenever this answers None).
 *
 * Only the plainest form is claimed: '[', optional whitespace, decimal integers without sign (or with
 * '-' for the signed kind), leading zeros, fraction or exponent, separated by ',', then ']'. Anything
 * else (floats, strings, nulls, nesting, out-of-range values, bad syntax) answers None, so the caller
 * decodes with msgspec and gets msgspec's value or msgspec's error. A wrong fast path can therefore
 * only be a missed speed-up, never a different answer; the tests check both halves with hypothesis.
 */
#include "native.h"

static inline int
json_ws(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

PyDoc_STRVAR(json_int_array_doc,
"json_int_array(data, kind) -> bytes | None\n\n"
"`data` (bytes-like) holding a JSON array of integers, as packed native integers: kind 'I' uint32\n"
"(0..2**32-1), 'Q' uint64 keys from int64 or uint64 values (-2**63..2**64-1, negative ones as their\n"
"two's complement). None for anything else (the caller then decodes with msgspec).");

static PyObject *
json_int_array(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "json_int_array(data, kind) takes a bytes-like and 'I' or 'Q'");
        return NULL;
    }
    const char *kind = PyUnicode_AsUTF8(args[1]);
    if (kind == NULL) {
        return NULL;
    }
    int u32 = strcmp(kind, "I") == 0;
    if (!u32 && strcmp(kind, "Q") != 0) {
        PyErr_SetString(PyExc_ValueError, "kind must be 'I' or 'Q'");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *p = view.buf, *end = p + view.len;
    Py_ssize_t width = u32 ? 4 : 8;
    /* an upper bound of the count: each value needs at least one digit and one separator */
    Py_ssize_t cap = view.len / 2 + 1;
    unsigned char *out = PyMem_Malloc((size_t)(cap * width));
    PyObject *result = NULL;
    Py_ssize_t n = 0;
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    while (p < end && json_ws(*p)) {
        p++;
    }
    if (p == end || *p++ != '[') {
        goto none;
    }
    while (p < end && json_ws(*p)) {
        p++;
    }
    if (p < end && *p == ']') {
        p++;
        goto tail;
    }
    for (;;) {
        int neg = 0;
        if (p < end && *p == '-') {
            if (u32) {
                goto none;
            }
            neg = 1;
            p++;
        }
        if (p == end || *p < '0' || *p > '9') {
            goto none;
        }
        if (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9') {
            goto none; /* leading zero: not JSON */
        }
        uint64_t v = 0;
        int digits = 0;
        while (p < end && *p >= '0' && *p <= '9') {
            unsigned d = (unsigned)(*p - '0');
            if (v > (UINT64_MAX - d) / 10) {
                goto none; /* past uint64 */
            }
            v = v * 10 + d;
            p++;
            digits++;
        }
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) {
            goto none; /* a float */
        }
        if (neg) {
            if (v > (uint64_t)1 << 63) {
                goto none;
            }
            v = (uint64_t)0 - v; /* two's complement: the int64's uint64 reinterpretation */
        } else if (u32 && v > 0xFFFFFFFFULL) {
            goto none;
        }
        if (n == cap) {
            goto none; /* cannot happen (cap bounds the count); refuse rather than overflow */
        }
        if (u32) {
            uint32_t w = (uint32_t)v;
            memcpy(out + 4 * n, &w, 4);
        } else {
            memcpy(out + 8 * n, &v, 8);
        }
        n++;
        while (p < end && json_ws(*p)) {
            p++;
        }
        if (p == end) {
            goto none;
        }
        if (*p == ',') {
            p++;
            while (p < end && json_ws(*p)) {
                p++;
            }
            continue;
        }
        if (*p == ']') {
            p++;
            break;
        }
        goto none;
    }
tail:
    while (p < end && json_ws(*p)) {
        p++;
    }
    if (p != end) {
        goto none;
    }
    result = PyBytes_FromStringAndSize((const char *)out, n * width);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(out);
    PyBuffer_Release(&view);
    return result;
}

PyMethodDef kvn_jsonints_methods[] = {
    {"json_int_array", (PyCFunction)(void (*)(void))json_int_array, METH_FASTCALL, json_int_array_doc},
    {NULL, NULL, 0, NULL},
};
