/* The memory index's block table (kvcoord.index.memory's native core; its pure-Python twin is
 * kvcoord.index.memory._Model): one model's block table.
 *
 * Why: the pure-Python index pays one dict operation (plus object overhead) per block and builds
 * Python objects per answer row; this table keeps uint64 keys and small (slot, tier mask) holders in
 * flat arrays, takes a whole event's hashes per call, and computes a whole match in one pass.
 *
 * Layout: open addressing, linear probing, Fibonacci hashing of the uint64 key, tombstones for
 * deletions (entries never move except on a resize, so a background sweep can walk the buckets with a
 * cursor). A bucket is a key, a one-byte control (EMPTY/TOMB/ONE/MANY) and an 8-byte value: either one
 * inline holder (slot uint32, tier mask uint8) or a pointer to a sorted array of holders.
 *
 * Slots are the small ints kvcoord.index.memory hands out per (node_id, dp_rank). The table keeps a
 * per-slot liveness byte (matches only see live slots) and a per-slot "being swept" byte: a sweep pass
 * strips those slots' holders from every bucket, after which the Python side may reuse the slot ids.
 *
 * Every method validates all of its input before it mutates anything, and no Python code can run while
 * the table is in an intermediate state.
 */
#include "native.h"
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#define HUGE_BUCKETS 1
#endif

#define C_EMPTY 0
#define C_TOMB 1
#define C_ONE 2
#define C_MANY 3

#define NTIERS 3
#define MAX_SLOT 0x7fffffffu
#define MIN_CAP 16
#define BIG_CAP ((size_t)1 << 20) /* from here a growing table grows 4x (see reserve) */
#define PF_DIST 32 /* blocks ahead whose bucket is prefetched (store, remove: all keys are wanted) */
#define MATCH_PF_DIST 16 /* the same for match, whose run may stop early: fewer wasted prefetches */

#define PREFETCH(p) KVN_PREFETCH(p)

typedef struct {
    uint32_t slot;
    uint8_t mask; /* bit t: held on tier t (0 GPU, 1 CPU, 2 STORAGE) */
    uint8_t pad[3];
} Holder;

typedef struct {
    uint32_t n;
    uint32_t cap;
    Holder h[]; /* sorted by slot, unique */
} Many;

/* 16 bytes, four to a cache line: a lookup touches one line (plus the holder array if shared). */
typedef struct {
    uint64_t key;
    uint32_t a;   /* C_ONE: the slot; C_MANY: index into Table.many */
    uint8_t mask; /* C_ONE: tier mask */
    uint8_t tag;  /* C_EMPTY, C_TOMB, C_ONE, C_MANY */
    uint16_t pad;
} Bucket;

typedef struct {
    PyObject_HEAD
    Bucket *b;
    size_t cap; /* 0 or a power of two */
    unsigned shift;
    size_t used;
    size_t tombs;
    /* holder arrays of multi-holder keys, addressed by index; NULL entries are free */
    Many **many;
    uint32_t nmany;
    uint32_t capmany;
    uint32_t *mfree;
    uint32_t nfree;
    size_t many_bytes;
    /* per slot */
    uint8_t *live;
    uint8_t *sweeping;
    uint32_t *rank;
    uint32_t nslots;
    uint64_t layout; /* bumped by set_live and set_order: a view of the slots taken before is stale */
    /* sweep pass */
    int sweep_active;
    size_t sweep_pos;
} Table;

/* ------------------------------------------------------------------------------------ helpers */

#define HUGE_MIN ((size_t)4 << 20) /* arrays at least this big get their own huge-page mapping */
#define HUGE_ALIGN ((size_t)2 << 20)
#define TRACE_DOMAIN 0               /* tracemalloc's default domain: they count as ordinary memory */

/* Zeroed bucket array (tag 0 is C_EMPTY). Big tables take an anonymous mapping aligned to 2 MiB and
 * advised MADV_HUGEPAGE: every new key lands on a random bucket, and with 4 KiB pages a table of a few
 * hundred MiB also misses the TLB on nearly every one (a page walk, costly under virtualisation). The
 * mapping is reported to tracemalloc so memory measurements still see it. */
static Bucket *
buckets_alloc(size_t n)
{
    size_t size = n * sizeof(Bucket);
#ifdef HUGE_BUCKETS
    if (size >= HUGE_MIN) {
        size_t span = size + HUGE_ALIGN;
        char *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) {
            return NULL;
        }
        char *p = (char *)(((uintptr_t)raw + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1));
        if (p > raw) {
            munmap(raw, (size_t)(p - raw));
        }
        size_t tail = (size_t)(raw + span - (p + size));
        if (tail > 0) {
            munmap(p + size, tail);
        }
#ifdef MADV_HUGEPAGE
        (void)madvise(p, size, MADV_HUGEPAGE); /* advice only: 4 KiB pages still work */
#endif
        (void)PyTraceMalloc_Track(TRACE_DOMAIN, (uintptr_t)p, size);
        return (Bucket *)p;
    }
#endif
    return PyMem_Calloc(n, sizeof(Bucket));
}

/* Free an array from buckets_alloc(n). */
static void
buckets_free(Bucket *b, size_t n)
{
    if (b == NULL) {
        return;
    }
#ifdef HUGE_BUCKETS
    size_t size = n * sizeof(Bucket);
    if (size >= HUGE_MIN) {
        (void)PyTraceMalloc_Untrack(TRACE_DOMAIN, (uintptr_t)b);
        munmap(b, size);
        return;
    }
#else
    (void)n;
#endif
    PyMem_Free(b);
}

static inline size_t
home(const Table *t, uint64_t key)
{
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

static inline size_t
many_size(uint32_t cap)
{
    return sizeof(Many) + (size_t)cap * sizeof(Holder);
}

/* Convert one element to uint64; 0 on success, -1 with an exception set. Never runs Python code. */
static int
as_u64(PyObject *o, uint64_t *out)
{
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "block hash must be int, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* Any sequence of hashes (list and tuple read in place; others, e.g. a protobuf repeated field,
 * copied once by PySequence_Fast) as a new reference to a list/tuple; NULL with an exception.
 * Unordered collections (sets, dicts) and str/bytes-like objects (whose items are characters or
 * small ints) are refused. */
static PyObject *
as_fast_seq(PyObject *seq)
{
    if (PyList_Check(seq) || PyTuple_Check(seq)) {
        Py_INCREF(seq);
        return seq;
    }
    if (!PySequence_Check(seq) || PyUnicode_Check(seq) || PyBytes_Check(seq) || PyByteArray_Check(seq) ||
        PyMemoryView_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "hashes must be a sequence of ints, not %.100s", Py_TYPE(seq)->tp_name);
        return NULL;
    }
    return PySequence_Fast(seq, "hashes must be a sequence of ints");
}

/* A memoryview of format 'Q' (what u64_view returns): its hashes copied to a fresh PyMem buffer.
 * Returns 1 on success, 0 when arg is not such a view, -1 with an exception. The view is read through
 * PyObject_GetBuffer, never PyMemoryView_GET_BUFFER: a released view keeps a dangling buf pointer, and
 * only the buffer protocol refuses it (ValueError). */
static int
view_to_u64(PyObject *arg, uint64_t **buf_out, Py_ssize_t *n_out)
{
    if (!PyMemoryView_Check(arg)) {
        return 0;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_FULL_RO) < 0) {
        return -1;
    }
    if (v.ndim != 1 || v.itemsize != 8 || v.format == NULL || strcmp(v.format, "Q") != 0 ||
        !PyBuffer_IsContiguous(&v, 'C')) {
        PyBuffer_Release(&v);
        return 0;
    }
    Py_ssize_t n = v.shape[0];
    uint64_t *buf = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(uint64_t) : 1);
    if (buf == NULL) {
        PyBuffer_Release(&v);
        PyErr_NoMemory();
        return -1;
    }
    if (n > 0) {
        memcpy(buf, v.buf, (size_t)n * sizeof(uint64_t));
    }
    PyBuffer_Release(&v);
    *buf_out = buf;
    *n_out = n;
    return 1;
}

/* All hashes of a sequence as a fresh uint64 buffer (PyMem); NULL with an exception on bad input. */
static uint64_t *
seq_to_u64(PyObject *arg, Py_ssize_t *n_out)
{
    uint64_t *vbuf;
    int r = view_to_u64(arg, &vbuf, n_out);
    if (r != 0) {
        return r > 0 ? vbuf : NULL;
    }
    PyObject *seq = as_fast_seq(arg);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *buf = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(uint64_t) : 1);
    if (buf == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u64(items[i], &buf[i]) < 0) {
            PyMem_Free(buf);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    *n_out = n;
    return buf;
}

static int
parse_slot(PyObject *o, uint32_t *out)
{
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "slot must be an int");
        return -1;
    }
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < 0 || (unsigned long)v > MAX_SLOT) {
        PyErr_SetString(PyExc_ValueError, "slot out of range");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static int
parse_tier(PyObject *o, uint8_t *bit)
{
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "tier must be an int");
        return -1;
    }
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < 0 || v >= NTIERS) {
        PyErr_SetString(PyExc_ValueError, "tier must be 0, 1 or 2");
        return -1;
    }
    *bit = (uint8_t)(1u << v);
    return 0;
}

/* Grow the per-slot arrays to hold slot `slot`. */
static int
ensure_slot(Table *t, uint32_t slot)
{
    if (slot < t->nslots) {
        return 0;
    }
    uint32_t n = t->nslots ? t->nslots : 64;
    while (n <= slot) {
        n = n > MAX_SLOT / 2 ? MAX_SLOT + 1u : n * 2;
    }
    uint8_t *live = PyMem_Realloc(t->live, n);
    if (live == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->live = live;
    uint8_t *sw = PyMem_Realloc(t->sweeping, n);
    if (sw == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->sweeping = sw;
    uint32_t *rank = PyMem_Realloc(t->rank, (size_t)n * sizeof(uint32_t));
    if (rank == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->rank = rank;
    for (uint32_t i = t->nslots; i < n; i++) {
        live[i] = 0;
        sw[i] = 0;
        rank[i] = i;
    }
    t->nslots = n;
    return 0;
}

/* Register a holder array; its index, or -1 (memory error, exception set; m not taken). */
static long
many_add(Table *t, Many *m)
{
    uint32_t idx;
    if (t->nfree) {
        idx = t->mfree[--t->nfree];
    }
    else {
        if (t->nmany == t->capmany) {
            if (t->capmany >= 0x40000000u) {
                PyErr_NoMemory();
                return -1;
            }
            uint32_t ncap = t->capmany ? t->capmany * 2 : 64;
            Many **g = PyMem_Realloc(t->many, (size_t)ncap * sizeof(Many *));
            if (g == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->many = g;
            uint32_t *f = PyMem_Realloc(t->mfree, (size_t)ncap * sizeof(uint32_t));
            if (f == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->mfree = f;
            t->capmany = ncap;
        }
        idx = t->nmany++;
    }
    t->many[idx] = m;
    t->many_bytes += many_size(m->cap);
    return (long)idx;
}

/* Validate a list/tuple of slots and grow the per-slot arrays to the largest; -1 with an exception
 * set otherwise. Shared by every method that takes a batch of slots, so none can write past the arrays. */
static int
ensure_slot_list(Table *t, PyObject *slots, const char *what)
{
    if (!PyList_Check(slots) && !PyTuple_Check(slots)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of slots", what);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    PyObject **items = PySequence_Fast_ITEMS(slots);
    uint32_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t s;
        if (parse_slot(items[i], &s) < 0) {
            return -1;
        }
        if (s > top) {
            top = s;
        }
    }
    return n > 0 ? ensure_slot(t, top) : 0;
}

/* Free the holder array at idx (mfree has room: it is as long as many). */
static void
many_drop(Table *t, uint32_t idx)
{
    Many *m = t->many[idx];
    t->many_bytes -= many_size(m->cap);
    PyMem_Free(m);
    t->many[idx] = NULL;
    t->mfree[t->nfree++] = idx;
}

/* Holders of bucket i as (pointer, count); a single holder is copied into *one. */
static inline const Holder *
holders(const Table *t, size_t i, uint32_t *n, Holder *one)
{
    const Bucket *bk = &t->b[i];
    if (bk->tag == C_ONE) {
        one->slot = bk->a;
        one->mask = bk->mask;
        one->pad[0] = one->pad[1] = one->pad[2] = 0;
        *n = 1;
        return one;
    }
    const Many *m = t->many[bk->a];
    *n = m->n;
    return m->h;
}

static inline Py_ssize_t
find(const Table *t, uint64_t key)
{
    if (t->cap == 0) {
        return -1;
    }
    size_t mask = t->cap - 1;
    size_t i = home(t, key);
    for (;;) {
        const Bucket *bk = &t->b[i];
        if (bk->tag == C_EMPTY) {
            return -1;
        }
        if (bk->key == key && bk->tag >= C_ONE) {
            return (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
}

static inline void
prefetch_key(const Table *t, uint64_t key)
{
    if (t->cap) {
        PREFETCH(&t->b[home(t, key)]);
    }
}

static void
free_bucket(Table *t, size_t i)
{
    if (t->b[i].tag == C_MANY) {
        many_drop(t, t->b[i].a);
    }
    t->b[i].tag = C_TOMB;
    t->used--;
    t->tombs++;
}

/* After holders were dropped from a MANY bucket: collapse to ONE or free it. */
static void
normalize(Table *t, size_t i)
{
    Bucket *bk = &t->b[i];
    if (bk->tag != C_MANY) {
        return;
    }
    Many *m = t->many[bk->a];
    if (m->n == 0) {
        free_bucket(t, i);
    }
    else if (m->n == 1) {
        Holder h = m->h[0];
        many_drop(t, bk->a);
        bk->a = h.slot;
        bk->mask = h.mask;
        bk->tag = C_ONE;
    }
}

/* Strip the holders of slots being swept from bucket i. */
static void
strip_swept(Table *t, size_t i)
{
    const uint8_t *sw = t->sweeping;
    uint32_t ns = t->nslots;
    Bucket *bk = &t->b[i];
    if (bk->tag == C_ONE) {
        uint32_t s = bk->a;
        if (s < ns && sw[s]) {
            free_bucket(t, i);
        }
        return;
    }
    Many *m = t->many[bk->a];
    uint32_t k = 0;
    for (uint32_t j = 0; j < m->n; j++) {
        uint32_t s = m->h[j].slot;
        if (!(s < ns && sw[s])) {
            m->h[k++] = m->h[j];
        }
    }
    if (k != m->n) {
        m->n = k;
        normalize(t, i);
    }
}

/* Rebuild into a table sized for `want` keys (dropping tombstones; stripping swept slots if a pass is
 * active, which then completes the pass). */
static int
resize(Table *t, size_t want)
{
    size_t cap = MIN_CAP;
    while (cap < 2 * want) {
        cap *= 2;
    }
    unsigned bits = 0;
    while (((size_t)1 << bits) < cap) {
        bits++;
    }
    Bucket *nb = buckets_alloc(cap);
    if (nb == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (t->sweep_active) {
        for (size_t i = 0; i < t->cap; i++) {
            if (t->b[i].tag >= C_ONE) {
                strip_swept(t, i);
            }
        }
        t->sweep_pos = (size_t)-1; /* the pass is complete */
    }
    Bucket *ob = t->b;
    size_t ocap = t->cap;
    t->b = nb;
    t->cap = cap;
    t->shift = 64 - bits;
    t->tombs = 0;
    size_t mask = cap - 1;
    for (size_t i = 0; i < ocap; i++) {
        if (i + 16 < ocap && ob[i + 16].tag >= C_ONE) {
            PREFETCH(&nb[home(t, ob[i + 16].key)]);
        }
        if (ob[i].tag < C_ONE) {
            continue;
        }
        size_t j = home(t, ob[i].key);
        while (nb[j].tag != C_EMPTY) {
            j = (j + 1) & mask;
        }
        nb[j] = ob[i];
    }
    buckets_free(ob, ocap);
    return 0;
}

/* Make room for n more keys up front, so the apply loop never resizes half-way. Small tables double;
 * from BIG_CAP buckets on, a table that must grow grows 4x: each rebuild re-inserts every key into
 * freshly faulted memory, and at that size the rebuilds cost more than the extra buckets do (the
 * Mooncake store loop runs ~13% faster; at 5M entries the table stays well under 100 bytes/entry).
 * A rebuild forced by tombstones alone sizes for the live keys. */
static int
reserve(Table *t, size_t n)
{
    if (t->cap != 0 && (t->used + t->tombs + n) * 4 <= t->cap * 3) {
        return 0;
    }
    size_t want = t->used + n;
    if (t->cap >= BIG_CAP && want * 4 > t->cap * 3) {
        want *= 2;
    }
    return resize(t, want);
}

/* Bucket for key, inserting a ONE placeholder when absent (room reserved by the caller). */
static size_t
find_or_insert(Table *t, uint64_t key, int *found)
{
    size_t mask = t->cap - 1;
    size_t i = home(t, key);
    size_t tomb = (size_t)-1;
    for (;;) {
        uint8_t c = t->b[i].tag;
        if (c == C_EMPTY) {
            break;
        }
        if (c == C_TOMB) {
            if (tomb == (size_t)-1) {
                tomb = i;
            }
        }
        else if (t->b[i].key == key) {
            *found = 1;
            return i;
        }
        i = (i + 1) & mask;
    }
    if (tomb != (size_t)-1) {
        i = tomb;
        t->tombs--;
    }
    *found = 0;
    t->b[i].key = key;
    t->b[i].tag = C_ONE;
    t->b[i].pad = 0;
    t->used++;
    return i;
}

/* Binary search for slot in a sorted holder array: index, or -(insertion point) - 1. */
static inline long
hsearch(const Holder *h, uint32_t n, uint32_t slot)
{
    long lo = 0, hi = (long)n;
    while (lo < hi) {
        long mid = (lo + hi) / 2;
        if (h[mid].slot < slot) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    if ((uint32_t)lo < n && h[lo].slot == slot) {
        return lo;
    }
    return -lo - 1;
}

/* Add (slot, bit) to existing bucket i: 1 if added, 0 if already held, -1 on memory error (bucket
 * unchanged). */
static int
add_holder(Table *t, size_t i, uint32_t slot, uint8_t bit)
{
    Bucket *bk = &t->b[i];
    if (bk->tag == C_ONE) {
        if (bk->a == slot) {
            if (bk->mask & bit) {
                return 0;
            }
            bk->mask |= bit;
            return 1;
        }
        Many *m = PyMem_Malloc(many_size(4));
        if (m == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        Holder old = {bk->a, bk->mask, {0, 0, 0}};
        Holder nh = {slot, bit, {0, 0, 0}};
        m->n = 2;
        m->cap = 4;
        m->h[0] = old.slot < slot ? old : nh;
        m->h[1] = old.slot < slot ? nh : old;
        long idx = many_add(t, m);
        if (idx < 0) {
            PyMem_Free(m);
            return -1;
        }
        bk->a = (uint32_t)idx;
        bk->mask = 0;
        bk->tag = C_MANY;
        return 1;
    }
    Many *m = t->many[bk->a];
    long at = hsearch(m->h, m->n, slot);
    if (at >= 0) {
        if (m->h[at].mask & bit) {
            return 0;
        }
        m->h[at].mask |= bit;
        return 1;
    }
    at = -at - 1;
    if (m->n == m->cap) {
        uint32_t ocap = m->cap, ncap = m->cap * 2;
        Many *g = PyMem_Realloc(m, many_size(ncap));
        if (g == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->many_bytes += many_size(ncap) - many_size(ocap);
        g->cap = ncap;
        m = g;
        t->many[bk->a] = m;
    }
    memmove(&m->h[at + 1], &m->h[at], (size_t)(m->n - (uint32_t)at) * sizeof(Holder));
    Holder nh = {slot, bit, {0, 0, 0}};
    m->h[at] = nh;
    m->n++;
    return 1;
}

/* Drop (slot, bit) from bucket i: 1 if it was held. */
static int
del_holder(Table *t, size_t i, uint32_t slot, uint8_t bit)
{
    Bucket *bk = &t->b[i];
    if (bk->tag == C_ONE) {
        if (bk->a != slot || !(bk->mask & bit)) {
            return 0;
        }
        bk->mask &= (uint8_t)~bit;
        if (bk->mask == 0) {
            free_bucket(t, i);
        }
        return 1;
    }
    Many *m = t->many[bk->a];
    long at = hsearch(m->h, m->n, slot);
    if (at < 0 || !(m->h[at].mask & bit)) {
        return 0;
    }
    m->h[at].mask &= (uint8_t)~bit;
    if (m->h[at].mask == 0) {
        memmove(&m->h[at], &m->h[at + 1], (size_t)(m->n - (uint32_t)at - 1) * sizeof(Holder));
        m->n--;
        normalize(t, i);
    }
    return 1;
}

/* ------------------------------------------------------------------------------------ methods */

/* The shared prologue of store() and remove(): (slot, tier, hashes) -> a PyMem buffer of n keys. */
static uint64_t *
parse_op_args(PyObject *const *args, Py_ssize_t nargs, const char *usage, uint32_t *slot, uint8_t *bit,
              Py_ssize_t *n)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if (parse_slot(args[0], slot) < 0 || parse_tier(args[1], bit) < 0) {
        return NULL;
    }
    return seq_to_u64(args[2], n);
}

static PyObject *
Table_store(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t slot;
    uint8_t bit;
    Py_ssize_t n;
    uint64_t *hs = parse_op_args(args, nargs, "store(slot, tier, hashes)", &slot, &bit, &n);
    if (hs == NULL) {
        return NULL;
    }
    /* Room for every key is reserved up front, so the loop never resizes. The only failure left
     * is running out of memory for a holder array, raised as MemoryError part-way (stores are
     * idempotent, so a retry of the event converges). */
    if (ensure_slot(t, slot) < 0 || reserve(t, (size_t)n) < 0) {
        PyMem_Free(hs);
        return NULL;
    }
    Py_ssize_t added = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k + PF_DIST < n) {
            prefetch_key(t, hs[k + PF_DIST]);
        }
        int found;
        size_t i = find_or_insert(t, hs[k], &found);
        if (!found) {
            t->b[i].a = slot;
            t->b[i].mask = bit;
            added++;
            continue;
        }
        int r = add_holder(t, i, slot, bit);
        if (r < 0) {
            PyMem_Free(hs);
            return NULL;
        }
        added += r;
    }
    PyMem_Free(hs);
    return PyLong_FromSsize_t(added);
}

static PyObject *
Table_remove(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t slot;
    uint8_t bit;
    Py_ssize_t n;
    uint64_t *hs = parse_op_args(args, nargs, "remove(slot, tier, hashes)", &slot, &bit, &n);
    if (hs == NULL) {
        return NULL;
    }
    Py_ssize_t done = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k + PF_DIST < n) {
            prefetch_key(t, hs[k + PF_DIST]);
        }
        Py_ssize_t i = find(t, hs[k]);
        if (i >= 0) {
            done += del_holder(t, (size_t)i, slot, bit);
        }
    }
    PyMem_Free(hs);
    return PyLong_FromSsize_t(done);
}

static PyObject *
Table_set_live(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t slot;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_live(slot, live)");
        return NULL;
    }
    if (parse_slot(args[0], &slot) < 0) {
        return NULL;
    }
    int flag = PyObject_IsTrue(args[1]);
    if (flag < 0 || ensure_slot(t, slot) < 0) {
        return NULL;
    }
    t->live[slot] = (uint8_t)flag;
    t->layout++;
    Py_RETURN_NONE;
}

static PyObject *
Table_set_order(Table *t, PyObject *order)
{
    if (ensure_slot_list(t, order, "order") < 0) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(order);
    PyObject **items = PySequence_Fast_ITEMS(order);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* cannot fail: validated above and items are ints */
        t->rank[(uint32_t)PyLong_AsLong(items[i])] = (uint32_t)i;
    }
    t->layout++;
    Py_RETURN_NONE;
}

typedef KvnRow Row; /* (slot, matched, cpu, sto): native.h */

/* A big group (e.g. every node matched the same run): place rows by rank, O(nslots + n).
 * 0 done, -1 memory error, 1 ranks not usable (out of range or repeated): use the fallback sort. */
static int
sort_by_rank(Row *g, size_t n, const uint32_t *rank, uint32_t nslots)
{
    Row *tmp = PyMem_Malloc(n * sizeof(Row));
    uint32_t *at = PyMem_Malloc((size_t)nslots * sizeof(uint32_t));
    if (tmp == NULL || at == NULL) {
        PyMem_Free(tmp);
        PyMem_Free(at);
        return -1;
    }
    memset(at, 0xff, (size_t)nslots * sizeof(uint32_t));
    int ok = 1;
    for (size_t i = 0; i < n; i++) {
        uint32_t r = rank[g[i].slot];
        if (r >= nslots || at[r] != UINT32_MAX) {
            ok = 0;
            break;
        }
        tmp[i] = g[i];
        at[r] = (uint32_t)i;
    }
    if (ok) {
        size_t k = 0;
        for (uint32_t r = 0; r < nslots && k < n; r++) {
            if (at[r] != UINT32_MAX) {
                g[k++] = tmp[at[r]];
            }
        }
    }
    PyMem_Free(tmp);
    PyMem_Free(at);
    return ok ? 0 : 1;
}

/* Sort rows[lo:hi] (equal matched) by rank; -1 on memory error. */
static int
sort_group(Row *rows, size_t lo, size_t hi, const uint32_t *rank, uint32_t nslots)
{
    size_t n = hi - lo;
    if (n < 2) {
        return 0;
    }
    Row *g = rows + lo;
    if (n > 24) {
        int r = sort_by_rank(g, n, rank, nslots);
        if (r <= 0) {
            return r;
        }
    }
    {
        for (size_t i = 1; i < n; i++) {
            Row r = g[i];
            uint32_t rr = rank[r.slot];
            size_t j = i;
            while (j > 0 && rank[g[j - 1].slot] > rr) {
                g[j] = g[j - 1];
                j--;
            }
            g[j] = r;
        }
        return 0;
    }
    return 0;
}

/* A holder not on GPU (mask bit 0) counts its block on its fastest tier: CPU, else storage. */
static inline void
count_tier(uint8_t mask, uint32_t *cpu, uint32_t *sto, uint32_t s)
{
    if (mask & 2) {
        cpu[s]++;
    }
    else {
        sto[s]++;
    }
}

/* The first block's holders among the candidates (state 1) start the walk as survivors (state 2), their
 * counts at 0 but for this block's tier; *exc is set when one holds it off GPU. Returns how many. */
static inline uint32_t
start_walk(const Holder *h, uint32_t hn, uint32_t ns, uint8_t *state, uint32_t *seen, uint32_t *cpu,
           uint32_t *sto, uint32_t *surv, int *exc)
{
    uint32_t nsurv = 0;
    for (uint32_t j = 0; j < hn; j++) {
        uint32_t s = h[j].slot;
        if (s < ns && state[s] == 1) {
            state[s] = 2;
            seen[s] = 0;
            cpu[s] = sto[s] = 0;
            surv[nsurv++] = s;
            if (!(h[j].mask & 1)) {
                *exc = 1;
                count_tier(h[j].mask, cpu, sto, s);
            }
        }
    }
    return nsurv;
}

/* A block with the previous block's holders: every survivor continues; count the off-GPU ones' tiers. */
static inline void
count_again(const Holder *h, uint32_t hn, uint32_t ns, const uint8_t *state, uint32_t *cpu, uint32_t *sto)
{
    for (uint32_t j = 0; j < hn; j++) {
        uint32_t s = h[j].slot;
        if (s < ns && state[s] == 2 && !(h[j].mask & 1)) {
            count_tier(h[j].mask, cpu, sto, s);
        }
    }
}

/* A block with other holders: stamp the survivors that hold it and count their tiers; *exc is set when
 * one holds it off GPU. Returns how many survivors hold it. */
static inline uint32_t
mark_seen(const Holder *h, uint32_t hn, uint32_t ns, const uint8_t *state, uint32_t *seen, uint32_t stamp,
          uint32_t *cpu, uint32_t *sto, int *exc)
{
    uint32_t kept = 0;
    for (uint32_t j = 0; j < hn; j++) {
        uint32_t s = h[j].slot;
        if (s < ns && state[s] == 2) {
            seen[s] = stamp;
            kept++;
            if (!(h[j].mask & 1)) {
                *exc = 1;
                count_tier(h[j].mask, cpu, sto, s);
            }
        }
    }
    return kept;
}

/* match_walk's conversion of the query's Python ints, ahead of block i in chunks, so the bucket
 * MATCH_PF_DIST blocks further on can be prefetched; the first that is not a uint64 int cuts *qlen. */
static inline void
convert_ahead(const Table *t, PyObject **q, uint64_t *qh, Py_ssize_t i, Py_ssize_t *nconv, Py_ssize_t *qlen)
{
    Py_ssize_t stop = i + MATCH_PF_DIST + 64;
    if (stop > *qlen) {
        stop = *qlen;
    }
    while (*nconv < stop) {
        Py_ssize_t c = *nconv;
        if (as_u64(q[c], &qh[c]) < 0) {
            PyErr_Clear();
            *qlen = c;
            return;
        }
        if (c <= i + MATCH_PF_DIST) {
            prefetch_key(t, qh[c]);
        }
        *nconv = c + 1;
    }
}

/* The survivors not seen at block `matched` (their stamp is not `stamp`) stop there: each becomes a row
 * and leaves the walk. Returns how many survive, compacted at the front of surv. */
static inline uint32_t
drop_stopped(uint32_t *surv, uint32_t nsurv, const uint32_t *seen, uint32_t stamp, uint8_t *state,
             const uint32_t *cpu, const uint32_t *sto, uint32_t matched, Row *rows, size_t *nrows)
{
    uint32_t k = 0;
    for (uint32_t j = 0; j < nsurv; j++) {
        uint32_t s = surv[j];
        if (seen[s] == stamp) {
            surv[k++] = s;
        }
        else {
            Row r = {s, matched, cpu[s], sto[s]};
            rows[(*nrows)++] = r;
            state[s] = 0;
        }
    }
    return k;
}

/* Rows come in ascending matched order: reverse them to longest first, then sort each group of equal
 * matched by rank. -1 on memory error. */
static int
order_rows(Row *rows, size_t nrows, const uint32_t *rank, uint32_t ns)
{
    for (size_t a = 0, b = nrows ? nrows - 1 : 0; a < b; a++, b--) {
        Row tmp = rows[a];
        rows[a] = rows[b];
        rows[b] = tmp;
    }
    for (size_t lo = 0; lo < nrows;) {
        size_t hi = lo + 1;
        while (hi < nrows && rows[hi].matched == rows[lo].matched) {
            hi++;
        }
        if (sort_group(rows, lo, hi, rank, ns) < 0) {
            return -1;
        }
        lo = hi;
    }
    return 0;
}

PyDoc_STRVAR(match_doc,
"match(hashes, candidates, keys, cls) -> list\n\n"
"Per live slot (restricted to the `candidates` slots unless None): the gap-free leading run of\n"
"`hashes` it holds on any tier, with (gpu, cpu, storage) counts of each block's fastest tier.\n"
"Rows are (keys[slot][0], keys[slot][1], matched, tiers), longest first then by the rank given\n"
"to set_order; built as `cls` (a NamedTuple) or plain tuples when cls is None. A hash that is not\n"
"a uint64 int ends the run there.");

/* The walk of every match (Table.match, kvn_table_rows): for the slots whose state byte is 1, rows
 * (slot, matched, cpu, sto) of the gap-free leading run of the query each holds, longest first, ties by
 * rank. The query is qh[0..nq) when q is NULL, else the Python ints q[0..nq), converted into qh (room
 * for nq) as the walk reaches them, so a run that stops early converts little; the first that is not a
 * uint64 int ends the query there. *rows_out (PyMem; NULL when nothing matched) holds *nrows_out rows.
 * Runs no Python code. 0, or -1 with MemoryError. */
static int
match_walk(Table *t, uint8_t *state, PyObject **q, uint64_t *qh, Py_ssize_t nq, Row **rows_out,
           size_t *nrows_out)
{
    uint32_t ns = t->nslots;
    Row *rows = NULL;
    size_t nrows = 0;
    *rows_out = NULL;
    *nrows_out = 0;
    /* scratch: seen stamp, cpu/sto counts, survivor list */
    uint32_t *scratch = PyMem_Malloc((size_t)ns * 4 * sizeof(uint32_t));
    if (scratch == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t *seen = scratch, *cpu = scratch + ns, *sto = scratch + 2 * (size_t)ns;
    uint32_t *surv = scratch + 3 * (size_t)ns;
    uint32_t nsurv = 0;
    Py_ssize_t i;
    Py_ssize_t qlen = nq; /* cut at the first element that is not a uint64 int */
    Py_ssize_t nconv = q == NULL ? nq : 0;
    const Holder *prev = NULL;
    uint32_t prevn = 0;
    int prev_exc = 0;
    Holder onebuf[2]; /* single holders are copied out; two buffers so `prev` stays valid */
    int ob = 0;
    for (Py_ssize_t k = 0; q == NULL && k < nq && k < MATCH_PF_DIST; k++) {
        prefetch_key(t, qh[k]);
    }
    for (i = 0; i < qlen; i++) {
        /* convert ahead in chunks, so the bucket MATCH_PF_DIST blocks further on can be prefetched */
        if (nconv <= i + MATCH_PF_DIST && nconv < qlen) {
            convert_ahead(t, q, qh, i, &nconv, &qlen);
            if (i >= qlen) {
                break;
            }
        }
        if (i + MATCH_PF_DIST < nconv) {
            prefetch_key(t, qh[i + MATCH_PF_DIST]);
        }
        Py_ssize_t b = find(t, qh[i]);
        if (b < 0) {
            break;
        }
        uint32_t hn;
        const Holder *h = holders(t, (size_t)b, &hn, &onebuf[ob]);
        ob ^= 1;
        if (i == 0) {
            nsurv = start_walk(h, hn, ns, state, seen, cpu, sto, surv, &prev_exc);
            if (nsurv == 0) {
                break;
            }
            rows = PyMem_Malloc((size_t)nsurv * sizeof(Row));
            if (rows == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            prev = h;
            prevn = hn;
            continue;
        }
        if (hn == prevn && memcmp(h, prev, (size_t)hn * sizeof(Holder)) == 0) {
            /* same holders as the previous block: the survivors all continue */
            if (prev_exc) {
                count_again(h, hn, ns, state, cpu, sto);
            }
            prev = h;
            continue;
        }
        int exc = 0;
        uint32_t stamp = (uint32_t)i;
        uint32_t kept = mark_seen(h, hn, ns, state, seen, stamp, cpu, sto, &exc);
        if (kept < nsurv) {
            nsurv = drop_stopped(surv, nsurv, seen, stamp, state, cpu, sto, (uint32_t)i, rows, &nrows);
            if (nsurv == 0) {
                break;
            }
        }
        prev = h;
        prevn = hn;
        prev_exc = exc;
    }
    for (uint32_t j = 0; j < nsurv; j++) {
        uint32_t s = surv[j];
        Row r = {s, (uint32_t)i, cpu[s], sto[s]};
        rows[nrows++] = r;
    }
    if (order_rows(rows, nrows, t->rank, ns) < 0) {
        PyErr_NoMemory();
        goto fail;
    }
    PyMem_Free(scratch);
    *rows_out = rows;
    *nrows_out = nrows;
    return 0;
fail:
    PyMem_Free(scratch);
    PyMem_Free(rows);
    return -1;
}

static int
kvn_table_rows(PyObject *table, const uint64_t *keys, Py_ssize_t nkeys, KvnRow **rows, size_t *nrows)
{
    Table *t = (Table *)table;
    *rows = NULL;
    *nrows = 0;
    if (t->nslots == 0 || nkeys == 0 || t->used == 0) {
        return 0;
    }
    uint8_t *state = PyMem_Malloc(t->nslots);
    if (state == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(state, t->live, t->nslots);
    /* the walk only reads the keys (q is NULL: nothing to convert) */
    int r = match_walk(t, state, NULL, (uint64_t *)(uintptr_t)keys, nkeys, rows, nrows);
    PyMem_Free(state);
    return r;
}

/* Table.match's answer from the walk's rows: (node_id, dp_rank, matched, tiers) per row, as `cls` or plain
 * tuples, rows of equal figures sharing their int and tiers objects. NULL with an exception. */
static PyObject *
match_answer(const Row *rows, size_t nrows, PyObject *keys, PyObject *cls)
{
    PyObject *out = PyList_New((Py_ssize_t)nrows);
    if (out == NULL) {
        return NULL;
    }
    PyObject *last_tiers = NULL, *last_matched = NULL;
    uint32_t lg = 0, lc = 0, lsto = 0, lm = 0;
    for (size_t r = 0; r < nrows; r++) {
        const Row *row = &rows[r];
        PyObject *key2 = NULL;
        /* A strong reference: the allocations below may start the cyclic GC, whose finalizers and
         * callbacks may replace keys[slot] and so free a borrowed key (and its node_id) under us. */
        if (row->slot < (uint32_t)PyList_GET_SIZE(keys)) {
            key2 = Py_NewRef(PyList_GET_ITEM(keys, row->slot));
        }
        if (key2 == NULL || !PyTuple_Check(key2) || PyTuple_GET_SIZE(key2) != 2) {
            PyErr_SetString(PyExc_RuntimeError, "slot without a (node_id, dp_rank) key");
            Py_XDECREF(key2);
            Py_XDECREF(last_tiers);
            Py_XDECREF(last_matched);
            Py_DECREF(out);
            return NULL;
        }
        uint32_t g = row->matched - row->cpu - row->sto;
        if (last_matched == NULL || lm != row->matched) {
            Py_XDECREF(last_matched);
            last_matched = PyLong_FromUnsignedLong(row->matched);
            lm = row->matched;
            if (last_matched == NULL) {
                Py_DECREF(key2);
                Py_XDECREF(last_tiers);
                Py_DECREF(out);
                return NULL;
            }
        }
        if (last_tiers == NULL || lg != g || lc != row->cpu || lsto != row->sto) {
            Py_XDECREF(last_tiers);
            last_tiers = Py_BuildValue("(kkk)", (unsigned long)g, (unsigned long)row->cpu,
                                       (unsigned long)row->sto);
            lg = g;
            lc = row->cpu;
            lsto = row->sto;
            if (last_tiers == NULL) {
                Py_DECREF(key2);
                Py_XDECREF(last_matched);
                Py_DECREF(out);
                return NULL;
            }
        }
        PyObject *item;
        if (cls == Py_None) {
            item = PyTuple_New(4);
        }
        else {
            PyTypeObject *tp = (PyTypeObject *)cls;
            item = tp->tp_alloc(tp, 4);
        }
        if (item == NULL) {
            Py_DECREF(key2);
            Py_XDECREF(last_tiers);
            Py_XDECREF(last_matched);
            Py_DECREF(out);
            return NULL;
        }
        PyObject *name = PyTuple_GET_ITEM(key2, 0), *dp = PyTuple_GET_ITEM(key2, 1);
        Py_INCREF(name);
        Py_INCREF(dp);
        Py_DECREF(key2); /* the row holds what it needs of it */
        Py_INCREF(last_matched);
        Py_INCREF(last_tiers);
        PyTuple_SET_ITEM(item, 0, name);
        PyTuple_SET_ITEM(item, 1, dp);
        PyTuple_SET_ITEM(item, 2, last_matched);
        PyTuple_SET_ITEM(item, 3, last_tiers);
        PyList_SET_ITEM(out, (Py_ssize_t)r, item);
    }
    Py_XDECREF(last_tiers);
    Py_XDECREF(last_matched);
    return out;
}

static PyObject *
Table_match(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "match(hashes, candidates, keys, cls)");
        return NULL;
    }
    PyObject *cands = args[1], *keys = args[2], *cls = args[3];
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list");
        return NULL;
    }
    if (kvn_check_row_class(cls, 1) < 0) {
        return NULL;
    }
    if (cands != Py_None && !PyList_Check(cands) && !PyTuple_Check(cands)) {
        PyErr_SetString(PyExc_TypeError, "candidates must be a list/tuple of slots or None");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "hashes must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    uint32_t ns = t->nslots;
    Py_ssize_t nq = PySequence_Fast_GET_SIZE(seq);
    PyObject **q = PySequence_Fast_ITEMS(seq);
    /* state: 0 out, 1 candidate, 2 surviving */
    uint8_t *state = NULL;
    uint64_t *qh = NULL;
    Row *rows = NULL;
    size_t nrows = 0;
    PyObject *out = NULL;
    if (ns == 0 || nq == 0 || t->used == 0) {
        Py_DECREF(seq);
        return PyList_New(0);
    }
    state = PyMem_Malloc(ns);
    qh = PyMem_Malloc((size_t)nq * sizeof(uint64_t));
    if (state == NULL || qh == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (cands == Py_None) {
        memcpy(state, t->live, ns);
    }
    else {
        memset(state, 0, ns);
        Py_ssize_t nc = PySequence_Fast_GET_SIZE(cands);
        PyObject **ci = PySequence_Fast_ITEMS(cands);
        for (Py_ssize_t i = 0; i < nc; i++) {
            uint32_t s;
            if (parse_slot(ci[i], &s) < 0) {
                goto done;
            }
            if (s < ns) {
                state[s] = t->live[s];
            }
        }
    }
    if (match_walk(t, state, q, qh, nq, &rows, &nrows) < 0) {
        goto done;
    }
    PyMem_Free(state);
    state = NULL;

    /* build the answer: no table access from here on (object creation may run arbitrary code) */
    out = match_answer(rows, nrows, keys, cls);
done:
    Py_DECREF(seq);
    PyMem_Free(state);
    PyMem_Free(qh);
    PyMem_Free(rows);
    return out;
}

PyDoc_STRVAR(rows_doc,
"rows(keys) -> bytes: Table.match's rows for the live slots as packed native uint32 quadruples\n"
"(slot, matched, cpu, storage), longest first, ties by set_order's rank; `keys` is a buffer of\n"
"native uint64 keys (bytes, or a memoryview of format 'Q'). No Python objects per row: the HTTP\n"
"API's fast path (kvcoord.coordinator.fastpath) turns them into its answer.");

static PyObject *
Table_rows(Table *t, PyObject *arg)
{
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (v.len % 8 != 0) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "keys must be whole uint64s (a multiple of 8 bytes)");
        return NULL;
    }
    Py_ssize_t nkeys = v.len / 8;
    uint64_t *copy = NULL;
    const uint64_t *keys = (const uint64_t *)v.buf;
    if (nkeys > 0 && ((uintptr_t)v.buf % _Alignof(uint64_t)) != 0) { /* unaligned: read through a copy */
        copy = PyMem_Malloc((size_t)v.len);
        if (copy == NULL) {
            PyBuffer_Release(&v);
            return PyErr_NoMemory();
        }
        memcpy(copy, v.buf, (size_t)v.len);
        keys = copy;
    }
    KvnRow *rows = NULL;
    size_t nrows = 0;
    int r = kvn_table_rows((PyObject *)t, keys, nkeys, &rows, &nrows); /* runs no Python code */
    PyMem_Free(copy);
    PyBuffer_Release(&v);
    if (r < 0) {
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(rows != NULL ? (const char *)rows : "",
                                              (Py_ssize_t)(nrows * sizeof(KvnRow)));
    PyMem_Free(rows);
    return out;
}

typedef struct {
    uint64_t key;
    uint8_t tier;
} Pair;

static int
pair_cmp(const void *a, const void *b)
{
    const Pair *x = a, *y = b;
    if (x->key != y->key) {
        return x->key < y->key ? -1 : 1;
    }
    return (x->tier > y->tier) - (x->tier < y->tier);
}

/* The tier mask slot holds in bucket i (0: none, or the bucket is empty). */
static inline uint8_t
slot_mask(const Table *t, size_t i, uint32_t slot)
{
    if (t->b[i].tag < C_ONE) {
        return 0;
    }
    if (t->b[i].tag == C_ONE) {
        return t->b[i].a == slot ? t->b[i].mask : 0;
    }
    const Many *m = t->many[t->b[i].a];
    long at = hsearch(m->h, m->n, slot);
    return at >= 0 ? m->h[at].mask : 0;
}

static PyObject *
Table_columns(Table *t, PyObject *arg)
{
    uint32_t slot;
    if (parse_slot(arg, &slot) < 0) {
        return NULL;
    }
    Py_ssize_t n[NTIERS] = {0};
    for (size_t i = 0; i < t->cap; i++) {
        uint8_t mask = slot_mask(t, i, slot);
        for (int tier = 0; tier < NTIERS; tier++) {
            n[tier] += (mask >> tier) & 1;
        }
    }
    PyObject *out = PyTuple_New(NTIERS);
    if (out == NULL) {
        return NULL;
    }
    PyObject *lists[NTIERS];
    for (int tier = 0; tier < NTIERS; tier++) {
        lists[tier] = PyList_New(n[tier]);
        if (lists[tier] == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, tier, lists[tier]);
        n[tier] = 0;
    }
    for (size_t i = 0; i < t->cap; i++) {
        uint8_t mask = slot_mask(t, i, slot);
        for (int tier = 0; mask && tier < NTIERS; tier++) {
            if (!(mask & (1u << tier))) {
                continue;
            }
            PyObject *h = PyLong_FromUnsignedLongLong((unsigned long long)t->b[i].key);
            if (h == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(lists[tier], n[tier]++, h);
        }
    }
    return out;
}

static PyObject *
Table_export(Table *t, PyObject *arg)
{
    uint32_t slot;
    if (parse_slot(arg, &slot) < 0) {
        return NULL;
    }
    size_t n = 0, cap = 64;
    Pair *ps = PyMem_Malloc(cap * sizeof(Pair));
    if (ps == NULL) {
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < t->cap; i++) {
        uint8_t mask = slot_mask(t, i, slot);
        for (uint8_t tier = 0; tier < NTIERS; tier++) {
            if (!(mask & (1u << tier))) {
                continue;
            }
            if (n == cap) {
                Pair *g = PyMem_Realloc(ps, cap * 2 * sizeof(Pair));
                if (g == NULL) {
                    PyMem_Free(ps);
                    return PyErr_NoMemory();
                }
                ps = g;
                cap *= 2;
            }
            ps[n].key = t->b[i].key;
            ps[n].tier = tier;
            n++;
        }
    }
    qsort(ps, n, sizeof(Pair), pair_cmp);
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out == NULL) {
        PyMem_Free(ps);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        PyObject *item = Py_BuildValue("(Ki)", (unsigned long long)ps[i].key, (int)ps[i].tier);
        if (item == NULL) {
            Py_DECREF(out);
            PyMem_Free(ps);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    PyMem_Free(ps);
    return out;
}

static PyObject *
Table_sweep_begin(Table *t, PyObject *slots)
{
    if (t->sweep_active) {
        PyErr_SetString(PyExc_RuntimeError, "a sweep pass is already running");
        return NULL;
    }
    if (ensure_slot_list(t, slots, "slots") < 0) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    PyObject **items = PySequence_Fast_ITEMS(slots);
    for (Py_ssize_t i = 0; i < n; i++) {
        t->sweeping[(uint32_t)PyLong_AsLong(items[i])] = 1;
    }
    t->sweep_active = 1;
    t->sweep_pos = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sweep_step_doc,
"sweep_step(budget) -> (visited, finished)\n\n"
"Strip the swept slots from up to about `budget` keys. When `finished`, the pass is over and\n"
"the swept slot ids no longer occur anywhere.");

static PyObject *
Table_sweep_step(Table *t, PyObject *arg)
{
    Py_ssize_t budget = PyLong_AsSsize_t(arg);
    if (budget == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!t->sweep_active) {
        return Py_BuildValue("(nO)", (Py_ssize_t)0, Py_True);
    }
    Py_ssize_t visited = 0, empties = 0;
    size_t pos = t->sweep_pos;
    while (pos < t->cap && visited + empties / 16 < budget) {
        if (t->b[pos].tag >= C_ONE) {
            strip_swept(t, pos);
            visited++;
        }
        else {
            empties++;
        }
        pos++;
    }
    t->sweep_pos = pos;
    if (pos < t->cap) {
        return Py_BuildValue("(nO)", visited, Py_False);
    }
    if (t->nslots > 0) {
        memset(t->sweeping, 0, t->nslots); /* NULL before any slot exists (memset(NULL, 0, 0) is UB) */
    }
    t->sweep_active = 0;
    return Py_BuildValue("(nO)", visited, Py_True);
}

static PyObject *
Table_layout(Table *t, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(t->layout);
}

static PyObject *
Table_nbytes(Table *t, PyObject *Py_UNUSED(ignored))
{
    size_t b = sizeof(Table) + t->cap * sizeof(Bucket) + t->many_bytes +
               (size_t)t->capmany * (sizeof(Many *) + sizeof(uint32_t)) +
               (size_t)t->nslots * (2 + sizeof(uint32_t));
    return PyLong_FromSize_t(b);
}

static Py_ssize_t
Table_len(Table *t)
{
    return (Py_ssize_t)t->used;
}

static PyObject *
Table_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Table() takes no arguments");
        return NULL;
    }
    Table *t = (Table *)type->tp_alloc(type, 0);
    return (PyObject *)t; /* tp_alloc zero-fills: empty table, no slots */
}

static void
Table_dealloc(Table *t)
{
    for (uint32_t i = 0; i < t->nmany; i++) {
        PyMem_Free(t->many[i]); /* NULL for free entries */
    }
    PyMem_Free(t->many);
    PyMem_Free(t->mfree);
    buckets_free(t->b, t->cap);
    PyMem_Free(t->live);
    PyMem_Free(t->sweeping);
    PyMem_Free(t->rank);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef Table_methods[] = {
    {"store", (PyCFunction)(void (*)(void))Table_store, METH_FASTCALL,
     "store(slot, tier, hashes) -> int: add the blocks for slot on tier; returns entries added."},
    {"remove", (PyCFunction)(void (*)(void))Table_remove, METH_FASTCALL,
     "remove(slot, tier, hashes) -> int: drop the blocks for slot on tier; returns entries removed."},
    {"set_live", (PyCFunction)(void (*)(void))Table_set_live, METH_FASTCALL,
     "set_live(slot, live): whether matches may report slot."},
    {"set_order", (PyCFunction)Table_set_order, METH_O,
     "set_order(slots): tie-break order of match rows (slots sorted by (node_id, dp_rank))."},
    {"match", (PyCFunction)(void (*)(void))Table_match, METH_FASTCALL, match_doc},
    {"columns", (PyCFunction)Table_columns, METH_O,
     "columns(slot) -> (gpu, cpu, storage): the hashes slot holds on each tier, in table order."},
    {"rows", (PyCFunction)Table_rows, METH_O, rows_doc},
    {"export", (PyCFunction)Table_export, METH_O,
     "export(slot) -> list[(hash, tier)]: every entry of slot, sorted."},
    {"sweep_begin", (PyCFunction)Table_sweep_begin, METH_O,
     "sweep_begin(slots): start a pass that strips these (retired) slots from every key."},
    {"sweep_step", (PyCFunction)Table_sweep_step, METH_O, sweep_step_doc},
    {"nbytes", (PyCFunction)Table_nbytes, METH_NOARGS, "nbytes() -> int: memory held by the table."},
    {"layout", (PyCFunction)Table_layout, METH_NOARGS,
     "layout() -> int: bumped by every set_live and set_order (a view of the slots built before is stale)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Table_as_sequence = {
    .sq_length = (lenfunc)Table_len,
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcoord._native.Table",
    .tp_doc = "One model's block table: uint64 key -> holders (slot, tier mask).",
    .tp_basicsize = sizeof(Table),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Table_new,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
    .tp_as_sequence = &Table_as_sequence,
};

/* ------------------------------------------------------------------------------------ module */

PyDoc_STRVAR(validate_doc,
"validate_u64_seq(seq) -> bool\n\n"
"True when seq is a sequence (list, tuple, protobuf repeated field, ...; not str/bytes) of ints\n"
"(bool excluded) in [0, 2**64). Never raises for a bad element or a non-sequence: the caller takes\n"
"its slow path to produce the precise error.");

static PyObject *
validate_u64_seq(PyObject *Py_UNUSED(module), PyObject *arg)
{
    PyObject *seq = as_fast_seq(arg);
    if (seq == NULL) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        if (as_u64(items[i], &v) < 0) {
            PyErr_Clear();
            Py_DECREF(seq);
            Py_RETURN_FALSE;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(u64_view_doc,
"u64_view(seq) -> Sequence[int] | None\n\n"
"validate_u64_seq's check that also converts: None when seq is not all ints in [0, 2**64); else seq\n"
"itself when short, or its hashes already packed as a memoryview of format 'Q' (which Table's methods\n"
"read with a memcpy). A long event is then converted once, in the validation pass, instead of twice.");

#define VIEW_MIN 32 /* shorter sequences are returned as they are: a view costs a few allocations */

static PyObject *
u64_view(PyObject *Py_UNUSED(module), PyObject *arg)
{
    PyObject *seq = as_fast_seq(arg);
    if (seq == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (n < VIEW_MIN) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v;
            if (as_u64(items[i], &v) < 0) {
                PyErr_Clear();
                Py_DECREF(seq);
                Py_RETURN_NONE;
            }
        }
        return seq; /* the new reference from as_fast_seq */
    }
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (bytes == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    uint64_t *out = (uint64_t *)(void *)PyBytes_AS_STRING(bytes);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PF_DIST < n) {
            PREFETCH(items[i + PF_DIST]);
        }
        if (as_u64(items[i], &out[i]) < 0) {
            PyErr_Clear();
            Py_DECREF(bytes);
            Py_DECREF(seq);
            Py_RETURN_NONE;
        }
    }
    Py_DECREF(seq);
    PyObject *raw = PyMemoryView_FromObject(bytes);
    Py_DECREF(bytes);
    if (raw == NULL) {
        return NULL;
    }
    PyObject *view = PyObject_CallMethod(raw, "cast", "s", "Q");
    Py_DECREF(raw);
    return view;
}

PyDoc_STRVAR(store_fits_doc,
"store_fits(ev) -> bool\n\n"
"kvcoord.validate.py_store_fits in C: whether a BlockStored (model struct or relay view) carries no token\n"
"ids, or block_size of them per block hash. A relay view's ids are raw msgpack: the array head is read.");

static PyObject *str_token_ids, *str_block_size, *str_block_hashes;

/* Token ids of a store: a sequence's length, or the count in a raw msgpack array's head (a relay view's);
   -1 when it is neither (that fits: the decoder judges it). */
static Py_ssize_t
token_count(PyObject *ids)
{
    if (PyTuple_CheckExact(ids)) {
        return PyTuple_GET_SIZE(ids);
    }
    if (PyList_CheckExact(ids)) {
        return PyList_GET_SIZE(ids);
    }
    Py_buffer b;
    if (!PyObject_CheckBuffer(ids) || PyObject_GetBuffer(ids, &b, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return -1;
    }
    const unsigned char *p = (const unsigned char *)b.buf;
    Py_ssize_t len = b.len, n = -1;
    if (len == 0 || p[0] == 0xc0) {
        n = 0;
    } else if (p[0] >= 0x90 && p[0] <= 0x9f) {
        n = p[0] & 0x0f;
    } else if (p[0] == 0xdc && len >= 3) {
        n = ((Py_ssize_t)p[1] << 8) | p[2];
    } else if (p[0] == 0xdd && len >= 5) {
        n = ((Py_ssize_t)p[1] << 24) | ((Py_ssize_t)p[2] << 16) | ((Py_ssize_t)p[3] << 8) | p[4];
    }
    PyBuffer_Release(&b);
    return n;
}

static PyObject *
store_fits(PyObject *Py_UNUSED(module), PyObject *ev)
{
    if (str_token_ids == NULL) {
        str_token_ids = PyUnicode_InternFromString("token_ids");
        str_block_size = PyUnicode_InternFromString("block_size");
        str_block_hashes = PyUnicode_InternFromString("block_hashes");
        if (str_token_ids == NULL || str_block_size == NULL || str_block_hashes == NULL) {
            return NULL;
        }
    }
    PyObject *ids = PyObject_GetAttr(ev, str_token_ids);
    if (ids == NULL) {
        return NULL;
    }
    Py_ssize_t n = token_count(ids);
    Py_DECREF(ids);
    if (n <= 0) {
        Py_RETURN_TRUE;
    }
    PyObject *bs = PyObject_GetAttr(ev, str_block_size);
    if (bs == NULL) {
        return NULL;
    }
    Py_ssize_t size = PyLong_Check(bs) ? PyLong_AsSsize_t(bs) : -1;
    Py_DECREF(bs);
    PyObject *hashes = PyObject_GetAttr(ev, str_block_hashes);
    if (hashes == NULL) {
        return NULL;
    }
    Py_ssize_t count = PyObject_Length(hashes);
    Py_DECREF(hashes);
    if (size < 0 || count < 0) {
        PyErr_Clear();
        Py_RETURN_TRUE; /* not this check's to judge: the validation names a bad field */
    }
    return PyBool_FromLong(size != 0 && count <= PY_SSIZE_T_MAX / size && n == size * count);
}

PyMethodDef kvn_table_methods[] = {
    {"store_fits", store_fits, METH_O, store_fits_doc},
    {"validate_u64_seq", validate_u64_seq, METH_O, validate_doc},
    {"u64_view", u64_view, METH_O, u64_view_doc},
    {NULL, NULL, 0, NULL},
};

int
kvn_table_init(PyObject *module)
{
    return kvn_add_type(module, "Table", &TableType);
}
