/* Optional C fast path of the coordinator's ingest: one serialised AgentMessage carrying event
 * batches, read straight from the protobuf wire format into what MemoryIndex.apply_raw_sync takes.
 *
 * Why: for a 64-block batch with token ids the protobuf parse (mostly the 1,024 token id varints,
 * which the index never reads) plus building the raw events costs more than applying them. Here
 * token ids are only counted, and each event's hashes land in one packed uint64 buffer.
 *
 * Contract: scan() accepts only a strict, common subset of the wire format and returns None for
 * anything else: every other message, any field not listed below, a field repeated where the parser
 * would merge or overwrite, a packed field sent unpacked, a value the parser would truncate, malformed
 * bytes, and every input the Python path would reject. The caller then parses with protobuf as
 * before, so the answer for any input is exactly the Python path's: this code may only decline.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define K_STORE 0
#define K_REMOVE 1
#define K_CLEAR 2

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Rd;

/* A varint of at most 10 bytes that fits 64 bits; 0, or -1 (decline). */
static inline int
rd_varint(Rd *r, uint64_t *out)
{
    uint64_t v = 0;
    for (int i = 0; i < 10; i++) {
        if (r->p >= r->end) {
            return -1;
        }
        uint8_t b = *r->p++;
        if (i == 9 && b > 1) {
            return -1;
        }
        v |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

static inline int
rd_tag(Rd *r, uint32_t *field, uint32_t *wt)
{
    uint64_t t;
    if (rd_varint(r, &t) < 0 || t > 0xffffffffu) {
        return -1;
    }
    *field = (uint32_t)(t >> 3);
    *wt = (uint32_t)(t & 7);
    return *field == 0 ? -1 : 0;
}

static inline int
rd_len(Rd *r, Rd *sub)
{
    uint64_t n;
    if (rd_varint(r, &n) < 0 || n > (uint64_t)(r->end - r->p)) {
        return -1;
    }
    sub->p = r->p;
    sub->end = r->p + n;
    r->p += n;
    return 0;
}

/* Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF), as protobuf checks strings. */
static int
utf8_ok(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t k;
        uint32_t cp;
        if (c >= 0xc2 && c <= 0xdf) {
            k = 1;
            cp = c & 0x1f;
        } else if (c >= 0xe0 && c <= 0xef) {
            k = 2;
            cp = c & 0x0f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            k = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (i + k >= n) {
            return 0; /* truncated sequence */
        }
        for (size_t j = 1; j <= k; j++) {
            uint8_t d = s[i + j];
            if ((d & 0xc0) != 0x80) {
                return 0;
            }
            cp = (cp << 6) | (d & 0x3f);
        }
        if ((k == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (k == 3 && (cp < 0x10000 || cp > 0x10ffff))) {
            return 0;
        }
        i += k + 1;
    }
    return 1;
}

/* Packed uint64 varints: their count, each checked; -1 when malformed. Byte by byte. */
static Py_ssize_t
count_packed_bytes(const uint8_t *p, const uint8_t *end)
{
    Py_ssize_t n = 0;
    int run = 0;
    while (p < end) {
        uint8_t b = *p++;
        run++;
        if (run == 10 && b > 1) {
            return -1;
        }
        if (!(b & 0x80)) {
            n++;
            run = 0;
        } else if (run == 10) {
            return -1;
        }
    }
    return run ? -1 : n;
}

#define HIGH_BITS 0x8080808080808080ULL

/* count_packed_bytes, eight bytes at a time: a varint ends at each byte whose high bit is clear.
 * Token ids are short varints; the first run of 9+ continuation bytes (a varint that may be too long)
 * hands the whole field to the byte loop, which checks it exactly. */
static Py_ssize_t
count_packed(const uint8_t *p, const uint8_t *end)
{
    const uint8_t *start = p;
    Py_ssize_t n = 0;
    int run = 0; /* continuation bytes since the last terminal byte */
    while (end - p >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint64_t t = ~w & HIGH_BITS; /* terminal bytes (little-endian: byte i is bits 8i..8i+7) */
        if (t == 0) {
            run += 8;
        } else {
            int lead = __builtin_ctzll(t) >> 3;     /* continuation bytes before the first terminal */
            if (run + lead >= 9) {
                return count_packed_bytes(start, end);
            }
            n += __builtin_popcountll(t);
            run = __builtin_clzll(t) >> 3; /* continuation bytes after the last terminal */
        }
        if (run >= 9) {
            return count_packed_bytes(start, end);
        }
        p += 8;
    }
    while (p < end) {
        uint8_t b = *p++;
        if (b & 0x80) {
            if (++run >= 9) {
                return count_packed_bytes(start, end);
            }
        } else {
            n++;
            run = 0;
        }
    }
    return run ? -1 : n;
}

/* The msgpack of a list of nils (what vLLM publishes as extra_keys for plain blocks), exactly. */
static int
nil_array_ok(const uint8_t *p, size_t n)
{
    if (n == 0) {
        return 1; /* no extra_keys field value: None */
    }
    size_t count, head;
    if ((p[0] & 0xf0) == 0x90) {
        count = p[0] & 0x0f;
        head = 1;
    } else if (p[0] == 0xdc && n >= 3) {
        count = ((size_t)p[1] << 8) | p[2];
        head = 3;
    } else if (p[0] == 0xdd && n >= 5) {
        count = ((size_t)p[1] << 24) | ((size_t)p[2] << 16) | ((size_t)p[3] << 8) | p[4];
        head = 5;
    } else {
        return 0;
    }
    if (n - head != count) {
        return 0;
    }
    for (size_t i = head; i < n; i++) {
        if (p[i] != 0xc0) {
            return 0;
        }
    }
    return 1;
}

typedef struct {
    int kind;
    Py_ssize_t h_start, h_count;
    Rd medium; /* empty: None */
    int has_group;
    uint64_t group;
    int has_spec;
    Rd spec;
    Py_ssize_t n_tokens;
    uint64_t block_size;
    int parent_kind; /* 0 none, 1 uint64, 2 digest */
    uint64_t parent;
    Rd parent_digest;
} Ev;

typedef struct {
    uint64_t seq;
    double ts;
    uint64_t dp_rank;
    int absent;
    Py_ssize_t ev_start, ev_count;
    Py_ssize_t n_store, n_remove, n_clear;
    Py_ssize_t span_start, span_end;
} Bt;

typedef struct {
    const uint8_t *base;
    uint64_t *h;
    Py_ssize_t nh, caph;
    Ev *ev;
    Py_ssize_t nev, capev;
    Bt *bt;
    Py_ssize_t nbt, capbt;
} Scan;

static int
grow(void **arr, Py_ssize_t *cap, Py_ssize_t need, size_t item)
{
    if (need <= *cap) {
        return 0;
    }
    Py_ssize_t nc = *cap ? *cap : 16;
    while (nc < need) {
        nc *= 2;
    }
    void *na = PyMem_Realloc(*arr, (size_t)nc * item);
    if (na == NULL) {
        return -1;
    }
    *arr = na;
    *cap = nc;
    return 0;
}

/* Decode packed uint64 hashes into the scan's buffer. */
static int
take_hashes(Scan *s, Rd f, Ev *e)
{
    Py_ssize_t n = count_packed(f.p, f.end);
    if (n < 0 || grow((void **)&s->h, &s->caph, s->nh + n, sizeof(uint64_t)) < 0) {
        return -1;
    }
    e->h_start = s->nh;
    e->h_count = n;
    Rd r = f;
    for (Py_ssize_t i = 0; i < n; i++) {
        (void)rd_varint(&r, &s->h[s->nh++]); /* already checked by count_packed */
    }
    return 0;
}

#define SEEN(bit)                                                                                      \
    do {                                                                                               \
        if (seen & (1u << (bit))) {                                                                    \
            return -1;                                                                                 \
        }                                                                                              \
        seen |= 1u << (bit);                                                                           \
    } while (0)

static int
scan_stored(Scan *s, Rd r, Ev *e)
{
    uint32_t seen = 0;
    int has_hashes = 0;
    Rd hashes = {NULL, NULL};
    while (r.p < r.end) {
        uint32_t f, wt;
        uint64_t v;
        Rd sub;
        if (rd_tag(&r, &f, &wt) < 0) {
            return -1;
        }
        switch (f) {
        case 1: /* block_hashes, packed */
            SEEN(1);
            if (wt != 2 || rd_len(&r, &hashes) < 0) {
                return -1;
            }
            has_hashes = 1;
            break;
        case 3: /* parent_block_hash */
            SEEN(3);
            if (wt != 0 || rd_varint(&r, &v) < 0) {
                return -1;
            }
            e->parent_kind = 1;
            e->parent = v;
            break;
        case 4: /* parent_block_digest */
            SEEN(4);
            if (wt != 2 || rd_len(&r, &e->parent_digest) < 0 || e->parent_digest.p == e->parent_digest.end) {
                return -1;
            }
            break;
        case 5: /* token_ids, packed: counted, never decoded */
            SEEN(5);
            if (wt != 2 || rd_len(&r, &sub) < 0) {
                return -1;
            }
            e->n_tokens = count_packed(sub.p, sub.end);
            if (e->n_tokens < 0) {
                return -1;
            }
            break;
        case 6: /* block_size (uint32) */
            SEEN(6);
            if (wt != 0 || rd_varint(&r, &v) < 0 || v > 0xffffffffu) {
                return -1;
            }
            e->block_size = v;
            break;
        case 7:  /* lora_id (int64): not read by the index */
        case 13: /* kv_cache_spec_sliding_window (int32): not read */
            SEEN(f);
            if (wt != 0 || rd_varint(&r, &v) < 0) {
                return -1;
            }
            break;
        case 8: /* medium */
            SEEN(8);
            if (wt != 2 || rd_len(&r, &e->medium) < 0 ||
                !utf8_ok(e->medium.p, (size_t)(e->medium.end - e->medium.p))) {
                return -1;
            }
            break;
        case 9:  /* lora_name */
        case 14: /* locality */
        case 15: /* ownership */
        case 16: /* session_id */
            SEEN(f);
            if (wt != 2 || rd_len(&r, &sub) < 0 || !utf8_ok(sub.p, (size_t)(sub.end - sub.p))) {
                return -1;
            }
            break;
        case 10: /* extra_keys_msgpack: only a list of nils (anything else is checked in Python) */
            SEEN(10);
            if (wt != 2 || rd_len(&r, &sub) < 0 || !nil_array_ok(sub.p, (size_t)(sub.end - sub.p))) {
                return -1;
            }
            break;
        case 11: /* group_idx (int32): a negative one is an error the Python path words */
            SEEN(11);
            if (wt != 0 || rd_varint(&r, &v) < 0 || v > 0x7fffffffu) {
                return -1;
            }
            e->has_group = 1;
            e->group = v;
            break;
        case 12: /* kv_cache_spec_kind */
            SEEN(12);
            if (wt != 2 || rd_len(&r, &e->spec) < 0 || !utf8_ok(e->spec.p, (size_t)(e->spec.end - e->spec.p))) {
                return -1;
            }
            e->has_spec = 1;
            break;
        default: /* block_digests (2), lookahead_token_ids (17), unknown fields */
            return -1;
        }
    }
    if ((seen & (1u << 3)) && (seen & (1u << 4))) {
        return -1; /* both parent forms: the Python path's error */
    }
    if (seen & (1u << 4)) {
        e->parent_kind = 2;
    }
    if (e->n_tokens && (e->block_size == 0 || e->n_tokens % (Py_ssize_t)e->block_size)) {
        return -1; /* token ids that do not fill whole blocks: the Python path's error */
    }
    if (has_hashes) {
        return take_hashes(s, hashes, e);
    }
    e->h_start = s->nh;
    return 0;
}

static int
scan_removed(Scan *s, Rd r, Ev *e)
{
    uint32_t seen = 0;
    int has_hashes = 0;
    Rd hashes = {NULL, NULL};
    while (r.p < r.end) {
        uint32_t f, wt;
        uint64_t v;
        Rd sub;
        if (rd_tag(&r, &f, &wt) < 0) {
            return -1;
        }
        switch (f) {
        case 1:
            SEEN(1);
            if (wt != 2 || rd_len(&r, &hashes) < 0) {
                return -1;
            }
            has_hashes = 1;
            break;
        case 3:
            SEEN(3);
            if (wt != 2 || rd_len(&r, &e->medium) < 0 ||
                !utf8_ok(e->medium.p, (size_t)(e->medium.end - e->medium.p))) {
                return -1;
            }
            break;
        case 4:
            SEEN(4);
            if (wt != 0 || rd_varint(&r, &v) < 0 || v > 0x7fffffffu) {
                return -1;
            }
            e->has_group = 1;
            e->group = v;
            break;
        case 5:
        case 6:
            SEEN(f);
            if (wt != 2 || rd_len(&r, &sub) < 0 || !utf8_ok(sub.p, (size_t)(sub.end - sub.p))) {
                return -1;
            }
            break;
        default: /* block_digests (2), unknown fields */
            return -1;
        }
    }
    if (has_hashes) {
        return take_hashes(s, hashes, e);
    }
    e->h_start = s->nh;
    return 0;
}

static int
scan_event(Scan *s, Rd r, Bt *b)
{
    if (grow((void **)&s->ev, &s->capev, s->nev + 1, sizeof(Ev)) < 0) {
        return -1;
    }
    Ev *e = &s->ev[s->nev];
    memset(e, 0, sizeof(*e));
    uint32_t f, wt;
    Rd sub;
    if (rd_tag(&r, &f, &wt) < 0 || wt != 2 || rd_len(&r, &sub) < 0 || r.p != r.end) {
        return -1; /* exactly one member of the oneof, once */
    }
    if (f == 1) {
        e->kind = K_STORE;
        if (scan_stored(s, sub, e) < 0) {
            return -1;
        }
        b->n_store++;
    } else if (f == 2) {
        e->kind = K_REMOVE;
        if (scan_removed(s, sub, e) < 0) {
            return -1;
        }
        b->n_remove++;
    } else if (f == 3 && sub.p == sub.end) {
        e->kind = K_CLEAR;
        e->h_start = s->nh;
        b->n_clear++;
    } else {
        return -1;
    }
    s->nev++;
    return 0;
}

static int
scan_batch(Scan *s, Rd r)
{
    if (grow((void **)&s->bt, &s->capbt, s->nbt + 1, sizeof(Bt)) < 0) {
        return -1;
    }
    Bt *b = &s->bt[s->nbt];
    memset(b, 0, sizeof(*b));
    b->span_start = r.p - s->base;
    b->span_end = r.end - s->base;
    b->ev_start = s->nev;
    uint32_t seen = 0;
    while (r.p < r.end) {
        uint32_t f, wt;
        uint64_t v;
        Rd sub;
        if (rd_tag(&r, &f, &wt) < 0) {
            return -1;
        }
        switch (f) {
        case 1:
            SEEN(1);
            if (wt != 0 || rd_varint(&r, &b->seq) < 0) {
                return -1;
            }
            break;
        case 2:
            SEEN(2);
            if (wt != 1 || r.end - r.p < 8) {
                return -1;
            }
            memcpy(&v, r.p, 8); /* little-endian hosts only: checked at import */
            memcpy(&b->ts, &v, 8);
            r.p += 8;
            break;
        case 3:
            SEEN(3);
            if (wt != 0 || rd_varint(&r, &b->dp_rank) < 0 || b->dp_rank > 0xffffffffu) {
                return -1;
            }
            break;
        case 4:
            if (wt != 2 || rd_len(&r, &sub) < 0) {
                return -1;
            }
            if (scan_event(s, sub, b) < 0) {
                return -1;
            }
            break;
        case 5:
            SEEN(5);
            if (wt != 0 || rd_varint(&r, &v) < 0 || v > 1) {
                return -1;
            }
            b->absent = (int)v;
            break;
        default:
            return -1;
        }
    }
    b->ev_count = s->nev - b->ev_start;
    s->nbt++;
    return 0;
}

/* The whole message; 0, or -1 to decline (a MemoryError is signalled separately). */
static int
scan_message(Scan *s, Rd r)
{
    uint32_t f, wt;
    Rd sub;
    if (rd_tag(&r, &f, &wt) < 0 || wt != 2 || rd_len(&r, &sub) < 0 || r.p != r.end) {
        return -1; /* exactly one member of AgentMessage's oneof, once */
    }
    if (f == 2) {
        return scan_batch(s, sub);
    }
    if (f != 5) {
        return -1;
    }
    while (sub.p < sub.end) {
        Rd one;
        if (rd_tag(&sub, &f, &wt) < 0 || f != 1 || wt != 2 || rd_len(&sub, &one) < 0) {
            return -1;
        }
        if (scan_batch(s, one) < 0) {
            return -1;
        }
    }
    return s->nbt > 0 ? 0 : -1;
}

static PyObject *
str_or_none(Rd r, int none_if_empty)
{
    if (none_if_empty && r.p == r.end) {
        Py_RETURN_NONE;
    }
    return PyUnicode_DecodeUTF8((const char *)r.p, r.end - r.p, "strict");
}

static int
same_rd(Rd a, Rd b)
{
    return (a.end - a.p) == (b.end - b.p) && memcmp(a.p, b.p, (size_t)(a.end - a.p)) == 0;
}

/* b may join a's op: both stores to the same medium, group and kind, b's hashes right after a's. */
static int
same_target(const Ev *a, const Ev *b)
{
    return b->kind == K_STORE && a->has_group == b->has_group && a->group == b->group &&
           a->has_spec == b->has_spec && same_rd(a->medium, b->medium) &&
           (!a->has_spec || same_rd(a->spec, b->spec));
}

/* Append (n_hashes, n_tokens, block_size, parent, kind) of one BlockStored to `stored`. */
static int
stored_info(PyObject *stored, const Ev *e, PyObject *kind)
{
    PyObject *parent;
    if (e->parent_kind == 1) {
        parent = PyLong_FromUnsignedLongLong(e->parent);
    } else if (e->parent_kind == 2) {
        parent = PyBytes_FromStringAndSize((const char *)e->parent_digest.p, e->parent_digest.end - e->parent_digest.p);
    } else {
        parent = Py_NewRef(Py_None);
    }
    if (parent == NULL) {
        return -1;
    }
    PyObject *info = Py_BuildValue("(nnKNO)", e->h_count, e->n_tokens, (unsigned long long)e->block_size, parent, kind);
    if (info == NULL) {
        return -1;
    }
    int r = PyList_Append(stored, info);
    Py_DECREF(info);
    return r;
}

static PyObject *
build(Scan *s)
{
    PyObject *bytes = NULL, *flat = NULL, *view = NULL, *out = NULL, *empty = NULL;
    bytes = PyBytes_FromStringAndSize((const char *)s->h, s->nh * (Py_ssize_t)sizeof(uint64_t));
    if (bytes == NULL) {
        goto fail;
    }
    flat = PyMemoryView_FromObject(bytes);
    if (flat == NULL) {
        goto fail;
    }
    view = PyObject_CallMethod(flat, "cast", "s", "Q");
    if (view == NULL) {
        goto fail;
    }
    empty = PyTuple_New(0);
    out = PyList_New(s->nbt);
    if (empty == NULL || out == NULL) {
        goto fail;
    }
    for (Py_ssize_t bi = 0; bi < s->nbt; bi++) {
        Bt *b = &s->bt[bi];
        PyObject *events = PyList_New(0);
        PyObject *stored = PyList_New(0);
        if (events == NULL || stored == NULL) {
            Py_XDECREF(events);
            Py_XDECREF(stored);
            goto fail;
        }
        for (Py_ssize_t ei = 0; ei < b->ev_count;) {
            Ev *e = &s->ev[b->ev_start + ei];
            /* A run of stores to the same target becomes one op: storing A then B is storing A+B. */
            Py_ssize_t run = 1, nh = e->h_count;
            while (e->kind == K_STORE && ei + run < b->ev_count && same_target(e, e + run)) {
                nh += e[run].h_count;
                run++;
            }
            PyObject *t;
            if (e->kind == K_CLEAR) {
                t = Py_BuildValue("(iONNN)", K_CLEAR, empty, Py_NewRef(Py_None), Py_NewRef(Py_None),
                                  Py_NewRef(Py_None));
            } else {
                PyObject *hashes = PySequence_GetSlice(view, e->h_start, e->h_start + nh);
                PyObject *medium = hashes ? str_or_none(e->medium, 1) : NULL;
                PyObject *group = medium ? (e->has_group ? PyLong_FromUnsignedLongLong(e->group)
                                                         : Py_NewRef(Py_None))
                                         : NULL;
                PyObject *spec = group ? (e->has_spec ? str_or_none(e->spec, 0) : Py_NewRef(Py_None)) : NULL;
                if (spec == NULL) {
                    Py_XDECREF(hashes);
                    Py_XDECREF(medium);
                    Py_XDECREF(group);
                    t = NULL;
                } else {
                    t = Py_BuildValue("(iNNNN)", e->kind, hashes, medium, group, spec);
                }
                for (Py_ssize_t k = 0; t != NULL && e->kind == K_STORE && k < run; k++) {
                    if (stored_info(stored, &e[k], PyTuple_GET_ITEM(t, 4)) < 0) {
                        Py_CLEAR(t);
                    }
                }
            }
            if (t == NULL || PyList_Append(events, t) < 0) {
                Py_XDECREF(t);
                Py_DECREF(events);
                Py_DECREF(stored);
                goto fail;
            }
            Py_DECREF(t);
            ei += run;
        }
        PyObject *bt = Py_BuildValue("(KdkOnnnnNNnn)", (unsigned long long)b->seq, b->ts,
                                     (unsigned long)b->dp_rank, b->absent ? Py_True : Py_False, b->ev_count,
                                     b->n_store, b->n_remove, b->n_clear, events, stored, b->span_start,
                                     b->span_end);
        if (bt == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, bi, bt);
    }
    Py_DECREF(bytes);
    Py_DECREF(flat);
    Py_DECREF(view);
    Py_DECREF(empty);
    return out;
fail:
    Py_XDECREF(bytes);
    Py_XDECREF(flat);
    Py_XDECREF(view);
    Py_XDECREF(empty);
    Py_XDECREF(out);
    return NULL;
}

PyDoc_STRVAR(scan_doc,
"scan(data: bytes) -> list[ScannedBatch] | None\n\n"
"A serialised AgentMessage holding ``batch`` or ``batches``, as one tuple per EventBatch:\n"
"(seq, ts, dp_rank, dp_rank_absent, n_events, n_stored, n_removed, n_cleared, raw_events,\n"
" stored_info, start, end). raw_events are MemoryIndex RawEvent tuples whose hashes are memoryviews\n"
"of format 'Q', consecutive stores to one target merged into one (an error then names the merged\n"
"event: recheck the batch unmerged for the exact one); stored_info has (n_hashes, n_tokens, block_size, parent, kv_cache_spec_kind) per\n"
"BlockStored, parent being None, the uint64 or the digest; data[start:end] is the EventBatch.\n"
"None: not in the subset this scanner reads (parse it with protobuf instead).");

static PyObject *
scan(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Scan s;
    memset(&s, 0, sizeof(s));
    s.base = buf.buf;
    Rd r = {buf.buf, (const uint8_t *)buf.buf + buf.len};
    PyObject *res;
    if (scan_message(&s, r) < 0) {
        res = PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    } else {
        res = build(&s);
    }
    PyMem_Free(s.h);
    PyMem_Free(s.ev);
    PyMem_Free(s.bt);
    PyBuffer_Release(&buf);
    return res;
}

PyDoc_STRVAR(pack_uint64_doc,
"pack_uint64(seq) -> bytes | None\n\n"
"A list or tuple of ints in [0, 2**64) as protobuf packed varints (the payload of a packed repeated\n"
"uint64 field); None for anything else (bools are not ints here), for the caller's precise error.");

static PyObject *
pack_uint64(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (!PyList_Check(arg) && !PyTuple_Check(arg)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(arg);
    PyObject **items = PySequence_Fast_ITEMS(arg);
    uint8_t stack[4096];
    uint8_t *buf = (size_t)n * 10 <= sizeof(stack) ? stack : PyMem_Malloc((size_t)n * 10 + 1);
    if (buf == NULL) {
        return PyErr_NoMemory();
    }
    uint8_t *w = buf;
    PyObject *res = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        if (!PyLong_Check(o) || PyBool_Check(o)) {
            res = Py_NewRef(Py_None);
            goto done;
        }
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear(); /* negative or too large */
            res = Py_NewRef(Py_None);
            goto done;
        }
        while (v >= 0x80) {
            *w++ = (uint8_t)(v | 0x80);
            v >>= 7;
        }
        *w++ = (uint8_t)v;
    }
    res = PyBytes_FromStringAndSize((const char *)buf, w - buf);
done:
    if (buf != stack) {
        PyMem_Free(buf);
    }
    return res;
}

PyDoc_STRVAR(mirror_walk_doc,
"mirror_walk(copy: dict[int, bytes], hashes: list[int], live: dict[int, (model, node_id, rank)],\n"
"            allowed: set[int] | None, cls: type[NodeMatch]) -> list[NodeMatch] | None\n\n"
"The Redis lookup walk (kvcoord.index.redis._walk) over the mirror's copy, in one pass: each hash's\n"
"holder string (5-byte records: location id u32 big-endian, tier mask u8, sorted by id) up to the\n"
"first hash the copy lacks; the locations of the first block (live, and allowed when given) stay in\n"
"the run while every following block lists them. Returns cls(node_id, rank, run, (GPU, CPU, STORAGE\n"
"blocks)) per location of the first block, unsorted; None when a hash is not an int in [0, 2**64) or a holder string is\n"
"not well formed (the caller's Python path then words the error or walks it).");

typedef struct {
    uint32_t id;
    uint8_t mask;
    uint8_t active;
    Py_ssize_t run, t[3];
} Loc;

static int
holders_ok(PyObject *v)
{
    return PyBytes_Check(v) && PyBytes_GET_SIZE(v) % 5 == 0;
}

static inline uint32_t
rec_id(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* Every item an int in [0, 2**64); 1, 0 (no), -1 (error). */
static int
all_u64(PyObject **items, Py_ssize_t from, Py_ssize_t n)
{
    for (Py_ssize_t i = from; i < n; i++) {
        PyObject *o = items[i];
        if (!PyLong_Check(o) || PyBool_Check(o)) {
            return 0;
        }
        (void)PyLong_AsUnsignedLongLong(o);
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                return -1;
            }
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

/* The last `seg` blocks had the same holders: count them for every location still in the run. */
static void
add_seg(Loc *locs, Py_ssize_t nlocs, Py_ssize_t seg)
{
    if (seg == 0) {
        return;
    }
    for (Py_ssize_t k = 0; k < nlocs; k++) {
        Loc *l = &locs[k];
        if (l->active) {
            l->run += seg;
            l->t[(l->mask & 1) ? 0 : (l->mask & 2) ? 1 : 2] += seg;
        }
    }
}

static PyObject *
mirror_walk(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyDict_Check(args[0]) || !(PyList_Check(args[1]) || PyTuple_Check(args[1])) ||
        !PyDict_Check(args[2]) || !(args[3] == Py_None || PyAnySet_Check(args[3])) || !PyType_Check(args[4]) ||
        !PyType_IsSubtype((PyTypeObject *)args[4], &PyTuple_Type) ||
        ((PyTypeObject *)args[4])->tp_dictoffset != 0) {
        PyErr_SetString(PyExc_TypeError, "mirror_walk(dict, list, dict, set | None, NamedTuple class)");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)args[4];
    PyObject *copy = args[0], *live = args[2], *allowed = args[3] == Py_None ? NULL : args[3];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(args[1]);
    PyObject **items = PySequence_Fast_ITEMS(args[1]);
    Loc *locs = NULL;
    Py_ssize_t nlocs = 0;
    PyObject *prev = NULL, *out = NULL;
    Py_ssize_t i = 0, seg = 0; /* seg: blocks since the holders last changed, not yet counted */
    for (; i < n; i++) {
        PyObject *h = items[i];
        if (!PyLong_Check(h) || PyBool_Check(h)) {
            goto decline; /* an int found in the copy is a valid hash: its keys all are */
        }
        PyObject *v = PyDict_GetItemWithError(copy, h);
        if (v == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            break;
        }
        if (v == prev || (prev != NULL && PyBytes_Check(v) && PyBytes_GET_SIZE(v) == PyBytes_GET_SIZE(prev) &&
                          memcmp(PyBytes_AS_STRING(v), PyBytes_AS_STRING(prev), (size_t)PyBytes_GET_SIZE(v)) == 0)) {
            seg++; /* the same holders as the block before: the run goes on as it is */
            continue;
        }
        add_seg(locs, nlocs, seg);
        seg = 0;
        if (!holders_ok(v)) {
            goto decline;
        }
        {
            const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(v);
            Py_ssize_t nr = PyBytes_GET_SIZE(v) / 5;
            for (Py_ssize_t r = 1; r < nr; r++) {
                if (rec_id(p + 5 * r) <= rec_id(p + 5 * (r - 1))) {
                    goto decline; /* not sorted and unique: the Python walk handles it */
                }
            }
            if (prev == NULL) {
                locs = PyMem_Malloc((size_t)(nr > 0 ? nr : 1) * sizeof(Loc));
                if (locs == NULL) {
                    PyErr_NoMemory();
                    goto fail;
                }
                for (Py_ssize_t r = 0; r < nr; r++) {
                    PyObject *id = PyLong_FromUnsignedLong(rec_id(p + 5 * r));
                    if (id == NULL) {
                        goto fail;
                    }
                    int keep = PyDict_Contains(live, id);
                    if (keep > 0 && allowed != NULL) {
                        keep = PySet_Contains(allowed, id);
                    }
                    Py_DECREF(id);
                    if (keep < 0) {
                        goto fail;
                    }
                    if (keep) {
                        Loc *l = &locs[nlocs++];
                        memset(l, 0, sizeof(*l));
                        l->id = rec_id(p + 5 * r);
                        l->mask = p[5 * r + 4];
                        l->active = 1;
                    }
                }
                if (nlocs == 0) {
                    break;
                }
            } else {
                /* the run goes on for the active locations this block lists (both sorted by id) */
                Py_ssize_t r = 0, still = 0;
                for (Py_ssize_t k = 0; k < nlocs; k++) {
                    Loc *l = &locs[k];
                    if (!l->active) {
                        continue;
                    }
                    while (r < nr && rec_id(p + 5 * r) < l->id) {
                        r++;
                    }
                    if (r < nr && rec_id(p + 5 * r) == l->id) {
                        l->mask = p[5 * r + 4];
                        still++;
                    } else {
                        l->active = 2; /* drops out: not counted from this block on */
                    }
                }
                if (still == 0) {
                    break; /* no location holds this block too: the walk stops here */
                }
                for (Py_ssize_t k = 0; k < nlocs; k++) {
                    if (locs[k].active == 2) {
                        locs[k].active = 0;
                    }
                }
            }
            prev = v;
            seg = 1;
        }
    }
    add_seg(locs, nlocs, seg);
    {
        int ok = all_u64(items, i, n); /* the hashes past the stop were not looked at yet */
        if (ok < 0) {
            goto fail;
        }
        if (!ok) {
            goto decline;
        }
    }
    out = PyList_New(nlocs);
    if (out == NULL) {
        goto fail;
    }
    for (Py_ssize_t k = 0; k < nlocs; k++) {
        Loc *l = &locs[k];
        PyObject *id = PyLong_FromUnsignedLong(l->id);
        PyObject *where = id == NULL ? NULL : PyDict_GetItemWithError(live, id); /* (model, node, rank) */
        Py_XDECREF(id);
        if (where == NULL || !PyTuple_Check(where) || PyTuple_GET_SIZE(where) != 3) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "live location names must be (model, node_id, rank)");
            }
            Py_CLEAR(out);
            goto fail;
        }
        PyObject *tiers = Py_BuildValue("(nnn)", l->t[0], l->t[1], l->t[2]);
        PyObject *run = tiers == NULL ? NULL : PyLong_FromSsize_t(l->run);
        PyObject *row = run == NULL ? NULL : cls->tp_alloc(cls, 4);
        if (row == NULL) {
            Py_XDECREF(tiers);
            Py_XDECREF(run);
            Py_CLEAR(out);
            goto fail;
        }
        PyTuple_SET_ITEM(row, 0, Py_NewRef(PyTuple_GET_ITEM(where, 1)));
        PyTuple_SET_ITEM(row, 1, Py_NewRef(PyTuple_GET_ITEM(where, 2)));
        PyTuple_SET_ITEM(row, 2, run);
        PyTuple_SET_ITEM(row, 3, tiers);
        PyList_SET_ITEM(out, k, row);
    }
    PyMem_Free(locs);
    return out;
decline:
    PyMem_Free(locs);
    Py_RETURN_NONE;
fail:
    PyMem_Free(locs);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"scan", scan, METH_O, scan_doc},
    {"mirror_walk", (PyCFunction)(void (*)(void))mirror_walk, METH_FASTCALL, mirror_walk_doc},
    {"pack_uint64", pack_uint64, METH_O, pack_uint64_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvcoord._wirescan",
    .m_doc = "C reader of ingest event batches (optional; kvcoord parses with protobuf without it).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__wirescan(void)
{
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "kvcoord._wirescan reads doubles as little-endian");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "STORE", K_STORE) < 0 || PyModule_AddIntConstant(m, "REMOVE", K_REMOVE) < 0 ||
        PyModule_AddIntConstant(m, "CLEAR", K_CLEAR) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
