/* The HTTP API's lookup in one call (kvcoord.coordinator.fastpath): a whole `POST /query` (token ids) or
 * `POST /query_by_hash` request in, the whole HTTP answer out. Its twin, and the definition, is the Python
 * handler (kvcoord.coordinator.httpapi: HttpApi.query / query_by_hash): this path answers only requests it
 * can answer exactly as that handler would, byte for byte, and hands back everything else.
 *
 * Why: below ~256 blocks a lookup's own work (hash, match) is a few microseconds, and the Python around
 * it (HTTP callbacks, routing, decoding, per-node liveness and answer objects) cost ~80 us per request.
 *
 *   kvn_answer_request(data, models, generation, now, head, may_query, &res): 0 | 1 | 2 | -1
 *
 * 0: not claimed (anything but one complete, plain request: another route or method, chunked, a
 * body still arriving, pipelined requests, Expect, Connection other than keep-alive, with auth on a token
 * that may_query refuses or none, a body with keys or
 * values this parser does not vouch for, lora_name / cache_salt / include_unmatched set, too many blocks,
 * no hash profile): the caller runs the Python handler. 2: the partition's AnswerModel is missing or
 * stale (another generation, past valid_until, or the table's slots moved): res.out is its name (str),
 * for the caller to build it and ask again. 1: res.out is the answer (bytes), with what the caller's
 * metrics need (route 1 tokens, 2 hashes; the query's blocks; the best node's). -1: raised.
 * The caller is the Answerer (answerer.c).
 *
 * AnswerModel is the Python side's view of one partition at one generation: the table, each live slot's
 * node (its id and the tail of its `nodes` entry, already JSON, encoded by the twin's own encoder), the
 * hash chain's arguments, the tier weights and the limits. Liveness never goes stale silently: the view
 * names the registry generation and the table layout it was built at, and the time it is valid until.
 */
#include "native.h"

#define ROUTE_TOKENS 1
#define ROUTE_HASHES 2
#define MAX_BODY (8 * 1024 * 1024)   /* QUERY_BODY_LIMIT: a larger body is refused by the Python side */
#define MAX_HEADER_BYTES (64 * 1024) /* _MAX_HEADER_BYTES */

typedef struct {
    int live;
    uint32_t node;    /* dense index of the node id within the model: groups its ranks */
    uint32_t rank;    /* dp rank */
    PyObject *key;    /* bytes: the node id as a JSON string */
    PyObject *tail;   /* bytes: the `nodes` entry after its tiers (load, trust, url, cause, '}') */
} SlotView;

typedef struct {
    PyObject_HEAD
    PyObject *table;
    uint64_t layout;
    uint64_t generation;
    double valid_until;
    int chain;          /* 0 none (no token lookups), 1 cbor, 2 pickle */
    PyObject *code;     /* the chain's digest code (int) */
    PyObject *parent;   /* bytes: NONE_HASH */
    PyObject *bs_obj;   /* int: the profile's block size */
    Py_ssize_t block_size;
    Py_ssize_t hash_block_size; /* /query_by_hash answers' block_size (the model's, 0 when unknown) */
    Py_ssize_t max_blocks;
    double w[3];
    PyObject *model;    /* bytes: the partition's name as a JSON string */
    uint32_t nslots;
    uint32_t nnodes;
    SlotView *slots;
} AnswerModel;

static PyTypeObject AnswerModelType;
static PyObject *cbor_null; /* b"\xf6": no extra keys */

/* ------------------------------------------------------------------------------------ AnswerModel */

static void
AnswerModel_dealloc(AnswerModel *m)
{
    for (uint32_t i = 0; m->slots != NULL && i < m->nslots; i++) {
        Py_XDECREF(m->slots[i].key);
        Py_XDECREF(m->slots[i].tail);
    }
    PyMem_Free(m->slots);
    Py_XDECREF(m->table);
    Py_XDECREF(m->code);
    Py_XDECREF(m->parent);
    Py_XDECREF(m->bs_obj);
    Py_XDECREF(m->model);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

/* chain: None or (kind 'cbor'|'pickle', code int, parent bytes, block_size int). 0, or -1 raised. */
static int
model_chain(AnswerModel *m, PyObject *chain)
{
    if (chain == Py_None) {
        return 0;
    }
    if (!PyTuple_Check(chain) || PyTuple_GET_SIZE(chain) != 4 || !PyUnicode_Check(PyTuple_GET_ITEM(chain, 0)) ||
        !PyLong_Check(PyTuple_GET_ITEM(chain, 1)) || !PyBytes_Check(PyTuple_GET_ITEM(chain, 2)) ||
        !PyLong_Check(PyTuple_GET_ITEM(chain, 3))) {
        PyErr_SetString(PyExc_TypeError, "chain must be None or (kind, code, parent, block_size)");
        return -1;
    }
    const char *kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(chain, 0));
    if (kind == NULL) {
        return -1;
    }
    m->chain = strcmp(kind, "cbor") == 0 ? 1 : strcmp(kind, "pickle") == 0 ? 2 : 0;
    m->block_size = PyLong_AsSsize_t(PyTuple_GET_ITEM(chain, 3));
    if (m->chain == 0 || m->block_size <= 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "chain kind must be 'cbor' or 'pickle', block_size > 0");
        }
        return -1;
    }
    m->code = Py_NewRef(PyTuple_GET_ITEM(chain, 1));
    m->parent = Py_NewRef(PyTuple_GET_ITEM(chain, 2));
    m->bs_obj = Py_NewRef(PyTuple_GET_ITEM(chain, 3));
    return 0;
}

/* One slot's entry: None (not in answers) or (node index, dp rank, key json, tail json), node index
 * below `nodes_max`. 0, or -1 raised (the slot unchanged). */
static int
slot_entry(AnswerModel *m, uint32_t i, PyObject *it, unsigned long nodes_max)
{
    SlotView *v = &m->slots[i];
    if (it == Py_None) {
        Py_CLEAR(v->key);
        Py_CLEAR(v->tail);
        v->live = 0;
        return 0;
    }
    if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 4 || !PyBytes_Check(PyTuple_GET_ITEM(it, 2)) ||
        !PyBytes_Check(PyTuple_GET_ITEM(it, 3))) {
        PyErr_SetString(PyExc_TypeError, "a slot must be None or (node, rank, key, tail)");
        return -1;
    }
    unsigned long node = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(it, 0));
    unsigned long rank = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLong(PyTuple_GET_ITEM(it, 1));
    if (PyErr_Occurred() || node >= nodes_max || rank > UINT32_MAX) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "node index past the slots, or a rank past uint32");
        }
        return -1;
    }
    Py_XSETREF(v->key, Py_NewRef(PyTuple_GET_ITEM(it, 2)));
    Py_XSETREF(v->tail, Py_NewRef(PyTuple_GET_ITEM(it, 3)));
    v->live = 1;
    v->node = (uint32_t)node;
    v->rank = (uint32_t)rank;
    if (v->node + 1 > m->nnodes) {
        m->nnodes = v->node + 1;
    }
    return 0;
}

/* slots: a list, per slot None (not in answers) or (node index, dp rank, key json, tail json). */
static int
model_slots(AnswerModel *m, PyObject *slots)
{
    if (!PyList_Check(slots) || PyList_GET_SIZE(slots) > (Py_ssize_t)UINT32_MAX / 2) {
        PyErr_SetString(PyExc_TypeError, "slots must be a list");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots);
    m->slots = PyMem_Calloc((size_t)(n ? n : 1), sizeof(SlotView));
    if (m->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->nslots = (uint32_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* the slot list is the caller's: read each item once, nothing here runs Python code */
        if (slot_entry(m, (uint32_t)i, PyList_GET_ITEM(slots, i), (unsigned long)n) < 0) {
            return -1;
        }
    }
    return 0;
}

static PyObject *
AnswerModel_set_slot(AnswerModel *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_slot(slot, entry)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[0]);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (i < 0 || i >= (Py_ssize_t)m->nslots) {
        PyErr_SetString(PyExc_IndexError, "slot out of range");
        return NULL;
    }
    if (slot_entry(m, (uint32_t)i, args[1], m->nslots) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
AnswerModel_renew(AnswerModel *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "renew(generation, valid_until)");
        return NULL;
    }
    unsigned long long generation = PyLong_AsUnsignedLongLong(args[0]);
    if (generation == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    double valid_until = PyFloat_AsDouble(args[1]);
    if (valid_until == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    m->generation = generation;
    m->valid_until = valid_until;
    Py_RETURN_NONE;
}

static PyMethodDef AnswerModel_methods[] = {
    {"set_slot", (PyCFunction)(void (*)(void))AnswerModel_set_slot, METH_FASTCALL,
     "set_slot(slot, entry): one slot's entry anew (None, or (node, rank, key, tail))."},
    {"renew", (PyCFunction)(void (*)(void))AnswerModel_renew, METH_FASTCALL,
     "renew(generation, valid_until): the view is current at this change count, until then."},
    {NULL, NULL, 0, NULL},
};

static PyObject *
AnswerModel_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"table", "layout", "generation", "valid_until", "chain", "hash_block_size",
                            "max_blocks", "weights", "model", "slots", NULL};
    PyObject *table, *chain, *model, *slots;
    unsigned long long layout, generation;
    double valid_until, w0, w1, w2;
    Py_ssize_t hash_bs, max_blocks;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKKdOnn(ddd)SO:AnswerModel", names, &table, &layout,
                                     &generation, &valid_until, &chain, &hash_bs, &max_blocks, &w0, &w1, &w2,
                                     &model, &slots)) {
        return NULL;
    }
    if (!kvn_is_table(table)) {
        PyErr_SetString(PyExc_TypeError, "table must be a kvcoord._native.Table");
        return NULL;
    }
    if (hash_bs < 0 || max_blocks < 0) {
        PyErr_SetString(PyExc_ValueError, "hash_block_size and max_blocks must be >= 0");
        return NULL;
    }
    AnswerModel *m = (AnswerModel *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    m->table = Py_NewRef(table);
    m->layout = layout;
    m->generation = generation;
    m->valid_until = valid_until;
    m->hash_block_size = hash_bs;
    m->max_blocks = max_blocks;
    m->w[0] = w0;
    m->w[1] = w1;
    m->w[2] = w2;
    m->model = Py_NewRef(model);
    if (model_chain(m, chain) < 0 || model_slots(m, slots) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static PyTypeObject AnswerModelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcoord._native.AnswerModel",
    .tp_doc = "AnswerModel(table, layout, generation, valid_until, chain, hash_block_size, max_blocks,\n"
              "weights, model, slots): one partition's view for the Answerer (see answer.c).",
    .tp_basicsize = sizeof(AnswerModel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = AnswerModel_new,
    .tp_dealloc = (destructor)AnswerModel_dealloc,
    .tp_methods = AnswerModel_methods,
};

/* ------------------------------------------------------------------------------------ the request */

typedef struct {
    int route;
    const unsigned char *body;
    Py_ssize_t body_len;
    const unsigned char *auth; /* the authorization header's value, or NULL */
    Py_ssize_t auth_len;
} HttpRequest;

static int
lower_eq(const unsigned char *p, Py_ssize_t n, const char *lit)
{
    Py_ssize_t k = (Py_ssize_t)strlen(lit);
    if (n != k) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = p[i];
        if (c >= 'A' && c <= 'Z') {
            c = (unsigned char)(c + 32);
        }
        if (c != (unsigned char)lit[i]) {
            return 0;
        }
    }
    return 1;
}

static int
tchar(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

/* One header line [p, eol): 1 fine (a header this path may ignore or has taken), 0 not claimed. */
static int
header_line(const unsigned char *p, const unsigned char *eol, Py_ssize_t *length, int *json, HttpRequest *req)
{
    const unsigned char *name = p;
    while (p < eol && tchar(*p)) {
        p++;
    }
    if (p == name || p == eol || *p != ':') {
        return 0;
    }
    Py_ssize_t nlen = p - name;
    p++;
    while (p < eol && (*p == ' ' || *p == '\t')) {
        p++;
    }
    const unsigned char *vend = eol;
    while (vend > p && (vend[-1] == ' ' || vend[-1] == '\t')) {
        vend--;
    }
    for (const unsigned char *c = p; c < vend; c++) {
        if ((*c < 0x20 && *c != '\t') || *c > 0x7e) {
            return 0; /* left to the real parser's rules */
        }
    }
    Py_ssize_t vlen = vend - p;
    if (lower_eq(name, nlen, "content-length")) {
        if (*length >= 0 || vlen == 0 || vlen > 8) {
            return 0;
        }
        Py_ssize_t v = 0;
        for (Py_ssize_t i = 0; i < vlen; i++) {
            if ((unsigned)(p[i] - '0') > 9) {
                return 0;
            }
            v = v * 10 + (p[i] - '0');
        }
        *length = v;
        return 1;
    }
    if (lower_eq(name, nlen, "content-type")) {
        /* application/json, parameters (charset=...) allowed, as the handler's check reads it */
        Py_ssize_t t = 0;
        while (t < vlen && p[t] != ';') {
            t++;
        }
        while (t > 0 && (p[t - 1] == ' ' || p[t - 1] == '\t')) {
            t--;
        }
        if (*json) {
            return 0;
        }
        *json = lower_eq(p, t, "application/json");
        return *json;
    }
    if (lower_eq(name, nlen, "connection")) {
        return lower_eq(p, vlen, "keep-alive");
    }
    if (lower_eq(name, nlen, "authorization")) {
        if (req->auth != NULL) {
            return 0; /* repeated: the server keeps the last, this path takes neither */
        }
        req->auth = p;
        req->auth_len = vlen;
        return 1;
    }
    /* what changes how the request is read or answered is the real server's */
    return !(lower_eq(name, nlen, "transfer-encoding") || lower_eq(name, nlen, "expect") ||
             lower_eq(name, nlen, "upgrade"));
}

/* The whole of data is one plain POST to a lookup route: 1, else 0. */
static int
parse_http(const unsigned char *p, Py_ssize_t len, HttpRequest *req)
{
    static const char q1[] = "POST /query HTTP/1.1\r\n", q2[] = "POST /query_by_hash HTTP/1.1\r\n";
    const unsigned char *end = p + len;
    if (len >= (Py_ssize_t)sizeof q1 - 1 && memcmp(p, q1, sizeof q1 - 1) == 0) {
        req->route = ROUTE_TOKENS;
        p += sizeof q1 - 1;
    } else if (len >= (Py_ssize_t)sizeof q2 - 1 && memcmp(p, q2, sizeof q2 - 1) == 0) {
        req->route = ROUTE_HASHES;
        p += sizeof q2 - 1;
    } else {
        return 0;
    }
    const unsigned char *headers = p;
    Py_ssize_t length = -1;
    req->auth = NULL;
    req->auth_len = 0;
    int json = 0;
    for (;;) {
        const unsigned char *eol = p;
        while (eol + 1 < end && !(eol[0] == '\r' && eol[1] == '\n')) {
            eol++;
        }
        if (eol + 1 >= end || eol - headers > MAX_HEADER_BYTES) {
            return 0; /* headers still arriving, or too big */
        }
        if (eol == p) {
            p += 2;
            break;
        }
        if (!header_line(p, eol, &length, &json, req)) {
            return 0;
        }
        p = eol + 2;
    }
    if (length < 0 || !json || length > MAX_BODY || end - p != length) {
        return 0;
    }
    req->body = p;
    req->body_len = length;
    return 1;
}

typedef struct {
    const unsigned char *model, *group;
    Py_ssize_t model_len, group_len;
    unsigned char *ints; /* PyMem: packed uint32 token ids or uint64 hashes */
    Py_ssize_t nints;
    int have_ints;
} QueryBody;

/* A string value without escapes: its span. 0 when not claimed. */
static int
plain_string(const unsigned char **pp, const unsigned char *end, const unsigned char **s, Py_ssize_t *n)
{
    const unsigned char *p = *pp;
    int escaped = 0;
    if (p == end || *p != '"') {
        return 0;
    }
    const unsigned char *after = kvn_json_skip_string(p, end, &escaped);
    if (after == NULL || escaped) {
        return 0;
    }
    *s = p + 1;
    *n = after - p - 2;
    *pp = after;
    return 1;
}

static int
literal(const unsigned char **pp, const unsigned char *end, const char *lit)
{
    size_t n = strlen(lit);
    if ((size_t)(end - *pp) < n || memcmp(*pp, lit, n) != 0) {
        return 0;
    }
    *pp += n;
    return 1;
}

#define KEY_IS(k, n, lit) ((n) == (Py_ssize_t)sizeof(lit) - 1 && memcmp((k), (lit), sizeof(lit) - 1) == 0)

/* One member's value at *pp, for key k: 1 taken, 0 not claimed, -1 memory error. */
static int
member(const unsigned char **pp, const unsigned char *end, int route, const unsigned char *k, Py_ssize_t n,
       QueryBody *b)
{
    const char *ints_key = route == ROUTE_TOKENS ? "token_ids" : "block_hashes";
    if (KEY_IS(k, n, "model_name")) {
        return plain_string(pp, end, &b->model, &b->model_len);
    }
    if (KEY_IS(k, n, "routing_group")) {
        return plain_string(pp, end, &b->group, &b->group_len);
    }
    if (KEY_IS(k, n, "tenant_id")) {
        const unsigned char *s;
        Py_ssize_t sl;
        if (!plain_string(pp, end, &s, &sl)) {
            return 0;
        }
        /* unused, but the handler's decoder refuses it unless it is UTF-8 */
        PyObject *text = PyUnicode_DecodeUTF8((const char *)s, sl, "strict");
        if (text == NULL) {
            return PyErr_ExceptionMatches(PyExc_UnicodeDecodeError) ? (PyErr_Clear(), 0) : -1;
        }
        Py_DECREF(text);
        return 1;
    }
    if (KEY_IS(k, n, "cache_salt") || (route == ROUTE_TOKENS && KEY_IS(k, n, "lora_name"))) {
        return literal(pp, end, "null");
    }
    if (KEY_IS(k, n, "include_unmatched")) {
        return literal(pp, end, "false");
    }
    if (n == (Py_ssize_t)strlen(ints_key) && memcmp(k, ints_key, (size_t)n) == 0) {
        int u32 = route == ROUTE_TOKENS;
        Py_ssize_t cap = (end - *pp) / 2 + 1;
        b->ints = PyMem_Malloc((size_t)cap * (u32 ? 4 : 8));
        if (b->ints == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->nints = kvn_json_int_array(pp, end, u32, b->ints, cap);
        b->have_ints = b->nints >= 0;
        return b->have_ints;
    }
    return 0; /* a key the Python handler reads (prompt, messages, ...) or ignores */
}

/* The body: an object of known keys, each once. 1 claimed, 0 not, -1 memory error. */
static int
parse_body(const unsigned char *p, Py_ssize_t len, int route, QueryBody *b)
{
    const unsigned char *end = p + len;
    const unsigned char *keys[8];
    Py_ssize_t lens[8];
    int nkeys = 0;
    p = kvn_json_skip_ws(p, end);
    if (p == end || *p++ != '{') {
        return 0;
    }
    p = kvn_json_skip_ws(p, end);
    if (p < end && *p == '}') {
        return 0; /* no model_name */
    }
    for (;;) {
        const unsigned char *k;
        Py_ssize_t n;
        if (!plain_string(&p, end, &k, &n) || nkeys == 8) {
            return 0;
        }
        for (int i = 0; i < nkeys; i++) {
            if (lens[i] == n && memcmp(keys[i], k, (size_t)n) == 0) {
                return 0; /* a repeat: the handler's 422 */
            }
        }
        keys[nkeys] = k;
        lens[nkeys++] = n;
        p = kvn_json_skip_ws(p, end);
        if (p == end || *p++ != ':') {
            return 0;
        }
        p = kvn_json_skip_ws(p, end);
        int r = member(&p, end, route, k, n, b);
        if (r <= 0) {
            return r;
        }
        p = kvn_json_skip_ws(p, end);
        if (p == end) {
            return 0;
        }
        if (*p == ',') {
            p = kvn_json_skip_ws(p + 1, end);
            continue;
        }
        if (*p++ != '}') {
            return 0;
        }
        break;
    }
    /* bytes after the object are ignored by the handler (as by Dynamo's serde), but only whitespace
     * is claimed here */
    return kvn_json_skip_ws(p, end) == end && b->model != NULL && b->have_ints;
}

/* The partition's name: model_name, or model_name@routing_group off the default group. NULL with no
 * exception when it is not valid UTF-8 (the handler's decoder says so). */
static PyObject *
partition_key(const QueryBody *b)
{
    PyObject *key;
    if (b->group == NULL || (b->group_len == 7 && memcmp(b->group, "default", 7) == 0)) {
        key = PyUnicode_DecodeUTF8((const char *)b->model, b->model_len, "strict");
    } else {
        Py_ssize_t n = b->model_len + 1 + b->group_len;
        char *buf = PyMem_Malloc((size_t)n);
        if (buf == NULL) {
            return PyErr_NoMemory();
        }
        memcpy(buf, b->model, (size_t)b->model_len);
        buf[b->model_len] = '@';
        if (b->group_len > 0) {
            memcpy(buf + b->model_len + 1, b->group, (size_t)b->group_len);
        }
        key = PyUnicode_DecodeUTF8(buf, n, "strict");
        PyMem_Free(buf);
    }
    if (key == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
    }
    return key;
}

/* ------------------------------------------------------------------------------------ the answer */

typedef struct {
    char *p;
    size_t n, cap;
    int failed;
} Buf;

static void
put(Buf *b, const void *s, size_t n)
{
    if (b->failed) {
        return;
    }
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->n + n) {
            cap *= 2;
        }
        char *q = PyMem_Realloc(b->p, cap);
        if (q == NULL) {
            b->failed = 1;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    if (n > 0) {
        memcpy(b->p + b->n, s, n);
        b->n += n;
    }
}

static void
puts_(Buf *b, const char *s)
{
    put(b, s, strlen(s));
}

static void
put_u64(Buf *b, uint64_t v)
{
    char tmp[24];
    char *p = tmp + sizeof tmp;
    do { /* an answer holds ~10 numbers a node: snprintf would be most of its cost */
        *--p = (char)('0' + v % 10);
        v /= 10;
    } while (v != 0);
    put(b, p, (size_t)(tmp + sizeof tmp - p));
}

static void
put_bytes(Buf *b, PyObject *bytes)
{
    put(b, PyBytes_AS_STRING(bytes), (size_t)PyBytes_GET_SIZE(bytes));
}

typedef struct {
    KvnRow row;
    SlotView *v;
    double score;
    size_t order;
} Hit;

static int
hit_cmp(const void *a, const void *b)
{
    const Hit *x = a, *y = b;
    if (x->score != y->score) {
        return x->score > y->score ? -1 : 1;
    }
    return x->order < y->order ? -1 : x->order > y->order;
}

/* The weighted score of a row, each product rounded on its own as the twin's Python floats are. */
static double
score(const AnswerModel *m, uint32_t g, uint32_t c, uint32_t s)
{
    volatile double a = (double)g * m->w[0];
    volatile double b = (double)c * m->w[1];
    volatile double d = (double)s * m->w[2];
    volatile double ab = a + b;
    return ab + d;
}

/* Dynamo's `scores` and `instances`, grouped by node in order of first appearance (the twin's dicts). */
static void
put_dynamo(Buf *b, const Hit *hits, size_t nh, uint64_t bs, uint32_t nnodes, uint32_t *first, uint32_t *next)
{
    /* per node, its hits in order: first[node] and next[hit] (UINT32_MAX ends) */
    uint32_t *last = first + nnodes;
    for (uint32_t i = 0; i < nnodes; i++) {
        first[i] = last[i] = UINT32_MAX;
    }
    for (size_t i = 0; i < nh; i++) {
        uint32_t node = hits[i].v->node;
        next[i] = UINT32_MAX;
        if (first[node] == UINT32_MAX) {
            first[node] = (uint32_t)i;
        } else {
            next[last[node]] = (uint32_t)i;
        }
        last[node] = (uint32_t)i;
    }
    /* scores: nodes in order of their first hit on GPU, each with its GPU ranks (last[] now marks the
     * nodes written) */
    puts_(b, "{\"scores\":{");
    for (uint32_t i = 0; i < nnodes; i++) {
        last[i] = 0;
    }
    int any = 0;
    for (size_t i = 0; i < nh; i++) {
        uint32_t node = hits[i].v->node;
        const KvnRow *r = &hits[i].row;
        if (r->matched - r->cpu - r->sto == 0 || last[node]) {
            continue;
        }
        last[node] = 1;
        if (any++) {
            puts_(b, ",");
        }
        put_bytes(b, hits[i].v->key);
        puts_(b, ":{");
        int k = 0;
        for (uint32_t j = (uint32_t)i; j != UINT32_MAX; j = next[j]) {
            const KvnRow *q = &hits[j].row;
            uint64_t gpu = (uint64_t)(q->matched - q->cpu - q->sto) * bs;
            if (gpu == 0) {
                continue;
            }
            puts_(b, k++ ? ",\"" : "\"");
            put_u64(b, hits[j].v->rank);
            puts_(b, "\":");
            put_u64(b, gpu);
        }
        puts_(b, "}");
    }
    puts_(b, "},\"frequencies\":[],\"instances\":{");
    any = 0;
    for (size_t i = 0; i < nh; i++) {
        uint32_t node = hits[i].v->node;
        if (first[node] != (uint32_t)i) {
            continue;
        }
        uint64_t gpu = 0, cpu = 0, disk = 0;
        for (uint32_t j = (uint32_t)i; j != UINT32_MAX; j = next[j]) {
            const KvnRow *q = &hits[j].row;
            uint64_t g = (uint64_t)(q->matched - q->cpu - q->sto) * bs;
            uint64_t c = (uint64_t)(q->matched - q->sto) * bs, d = (uint64_t)q->matched * bs;
            gpu = g > gpu ? g : gpu;
            cpu = c > cpu ? c : cpu;
            disk = d > disk ? d : disk;
        }
        if (any++) {
            puts_(b, ",");
        }
        put_bytes(b, hits[i].v->key);
        puts_(b, ":{\"longest_matched\":");
        put_u64(b, disk); /* the largest of gpu, cpu, disk over the ranks: disk >= cpu >= gpu per row */
        puts_(b, ",\"gpu\":");
        put_u64(b, gpu);
        puts_(b, ",\"dp\":{");
        for (uint32_t j = (uint32_t)i; j != UINT32_MAX; j = next[j]) {
            const KvnRow *q = &hits[j].row;
            puts_(b, j == (uint32_t)i ? "\"" : ",\"");
            put_u64(b, hits[j].v->rank);
            puts_(b, "\":");
            put_u64(b, (uint64_t)(q->matched - q->cpu - q->sto) * bs);
        }
        puts_(b, "},\"cpu\":");
        put_u64(b, cpu);
        puts_(b, ",\"disk\":");
        put_u64(b, disk);
        puts_(b, "}");
    }
    puts_(b, "}");
}

/* kvcoord's fields after Dynamo's: model, sizes, and `nodes` best first. */
static void
put_kvcoord(Buf *b, const AnswerModel *m, const Hit *hits, size_t nh, uint64_t block_size, uint64_t nblocks,
            uint64_t ntokens)
{
    puts_(b, ",\"model\":");
    put_bytes(b, m->model);
    puts_(b, ",\"block_size\":");
    put_u64(b, block_size);
    puts_(b, ",\"num_blocks\":");
    put_u64(b, nblocks);
    puts_(b, ",\"num_tokens\":");
    put_u64(b, ntokens);
    puts_(b, ",\"nodes\":[");
    for (size_t i = 0; i < nh; i++) {
        const KvnRow *r = &hits[i].row;
        puts_(b, i ? ",{\"node_id\":" : "{\"node_id\":");
        put_bytes(b, hits[i].v->key);
        puts_(b, ",\"dp_rank\":");
        put_u64(b, hits[i].v->rank);
        puts_(b, ",\"matched_blocks\":");
        put_u64(b, r->matched);
        puts_(b, ",\"tiers\":{\"GPU\":");
        put_u64(b, r->matched - r->cpu - r->sto);
        puts_(b, ",\"CPU\":");
        put_u64(b, r->cpu);
        puts_(b, ",\"STORAGE\":");
        put_u64(b, r->sto);
        puts_(b, "}");
        put_bytes(b, hits[i].v->tail);
    }
    puts_(b, "]}");
}

/* The live hits of the table's rows, best first by the tier weights (stable: the table's order, longest
 * first then by (node id, rank), breaks ties, as the twin's sort does). NULL with MemoryError. */
static Hit *
live_hits(const AnswerModel *m, const KvnRow *rows, size_t nrows, size_t *nh, uint32_t *best)
{
    Hit *hits = PyMem_Malloc((nrows ? nrows : 1) * sizeof(Hit));
    if (hits == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    size_t n = 0;
    *best = 0;
    for (size_t i = 0; i < nrows; i++) {
        const KvnRow *r = &rows[i];
        if (r->slot >= m->nslots || !m->slots[r->slot].live || r->matched == 0) {
            continue;
        }
        Hit *h = &hits[n];
        h->row = *r;
        h->v = &m->slots[r->slot];
        h->score = score(m, r->matched - r->cpu - r->sto, r->cpu, r->sto);
        h->order = n++;
        *best = r->matched > *best ? r->matched : *best;
    }
    qsort(hits, n, sizeof(Hit), hit_cmp);
    *nh = n;
    return hits;
}

/* The query's uint64 keys: the token ids hashed by the model's chain (a new bytes in *owner), or the
 * body's hashes. NULL without an exception when not claimed. */
static const uint64_t *
query_keys(const AnswerModel *m, int route, QueryBody *qb, Py_ssize_t *nkeys, PyObject **owner)
{
    *owner = NULL;
    if (route == ROUTE_HASHES) {
        *nkeys = qb->nints;
        return qb->nints <= m->max_blocks ? (const uint64_t *)qb->ints : NULL;
    }
    if (m->chain == 0) {
        return NULL; /* no profile: the handler's 400 */
    }
    Py_ssize_t count = qb->nints / m->block_size;
    if (count > m->max_blocks) {
        return NULL;
    }
    if (count == 0) {
        static const uint64_t none[1] = {0};
        *nkeys = 0;
        return none;
    }
    Py_ssize_t shape = qb->nints, stride = 4;
    Py_buffer view = {.buf = qb->ints, .obj = NULL, .len = qb->nints * 4, .itemsize = 4, .readonly = 1,
                      .ndim = 1, .format = "I", .shape = &shape, .strides = &stride};
    PyObject *tokens = PyMemoryView_FromBuffer(&view);
    PyObject *count_obj = PyLong_FromSsize_t(count);
    if (tokens == NULL || count_obj == NULL) {
        Py_XDECREF(tokens);
        Py_XDECREF(count_obj);
        return NULL;
    }
    PyObject *args[8] = {m->code, Py_False, m->parent, tokens, m->bs_obj, count_obj, cbor_null, Py_True};
    PyObject *keys = m->chain == 1 ? kvn_cbor_chain(NULL, args, 8)
                                   : kvn_pickle_chain(NULL, (PyObject *[]){m->code, Py_False, m->parent, tokens,
                                                                           m->bs_obj, count_obj, Py_True}, 7);
    /* the chain holds no reference to the view past the call: release it before the buffer goes */
    Py_DECREF(tokens);
    Py_DECREF(count_obj);
    if (keys == NULL || !PyBytes_Check(keys) || PyBytes_GET_SIZE(keys) != 8 * count) {
        Py_XDECREF(keys);
        return NULL;
    }
    *owner = keys;
    *nkeys = count;
    return (const uint64_t *)PyBytes_AS_STRING(keys);
}

/* The answer of a parsed request on a fresh model view (bytes; *nkeys and *best set), or NULL (with or
 * without an exception). */
static PyObject *
answer(AnswerModel *m, int route, QueryBody *qb, PyObject *head, Py_ssize_t *nkeys_out, Py_ssize_t *best_out)
{
    Py_ssize_t nkeys = 0;
    PyObject *owner = NULL, *out = NULL;
    KvnRow *rows = NULL;
    size_t nrows = 0, nh = 0;
    Hit *hits = NULL;
    uint32_t best = 0, *scratch = NULL;
    Buf body = {0};
    const uint64_t *keys = query_keys(m, route, qb, &nkeys, &owner);
    if (keys == NULL) {
        return NULL;
    }
    if (kvn_table_layout(m->table) != m->layout) {
        /* hashing allocated, and the GC may have run Python code that moved a slot: ask again */
        Py_XDECREF(owner);
        return NULL;
    }
    /* unaligned packed keys (a bytes' data is aligned; the body's hashes were copied into PyMem) */
    if (kvn_table_rows(m->table, keys, nkeys, &rows, &nrows) < 0 ||
        (hits = live_hits(m, rows, nrows, &nh, &best)) == NULL) {
        goto done;
    }
    scratch = PyMem_Malloc((2 * (size_t)m->nnodes + nh + 1) * sizeof(uint32_t));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t bs = route == ROUTE_TOKENS ? (uint64_t)m->block_size : (uint64_t)m->hash_block_size;
    put_dynamo(&body, hits, nh, bs ? bs : 1, m->nnodes, scratch, scratch + 2 * (size_t)m->nnodes);
    put_kvcoord(&body, m, hits, nh, bs, (uint64_t)nkeys, route == ROUTE_TOKENS ? (uint64_t)qb->nints : 0);
    Buf resp = {0};
    put_bytes(&resp, head);
    put_u64(&resp, body.n);
    puts_(&resp, "\r\ncontent-type: application/json\r\n\r\n");
    put(&resp, body.p, body.n);
    if (body.failed || resp.failed) {
        PyErr_NoMemory();
    } else {
        out = PyBytes_FromStringAndSize(resp.p, (Py_ssize_t)resp.n);
        *nkeys_out = nkeys;
        *best_out = (Py_ssize_t)best;
    }
    PyMem_Free(resp.p);
done:
    PyMem_Free(body.p);
    PyMem_Free(scratch);
    PyMem_Free(hits);
    PyMem_Free(rows);
    Py_XDECREF(owner);
    return out;
}

/* 1 when the request may be answered: no `may_query` (auth off), or may_query(its authorization header)
 * is True; 0 when not claimed (the handler answers 401); -1 raised. */
static int
authorized(PyObject *may_query, const HttpRequest *req)
{
    if (may_query == Py_None) {
        return 1;
    }
    if (req->auth == NULL) {
        return 0;
    }
    PyObject *value = PyUnicode_DecodeLatin1((const char *)req->auth, req->auth_len, NULL);
    if (value == NULL) {
        return -1;
    }
    PyObject *ok = PyObject_CallOneArg(may_query, value);
    Py_DECREF(value);
    if (ok == NULL) {
        return -1;
    }
    int r = ok == Py_True;
    Py_DECREF(ok);
    return r;
}

int
kvn_answer_request(PyObject *data, PyObject *models, uint64_t generation, double now, PyObject *head,
                   PyObject *may_query, KvnAnswered *res)
{
    HttpRequest req;
    QueryBody qb = {0};
    PyObject *key = NULL;
    AnswerModel *m = NULL;
    int r;
    res->out = NULL;
    /* the request bytes stay alive with data, a bytes (immutable), for the whole call */
    if (!parse_http((const unsigned char *)PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), &req)) {
        return 0;
    }
    r = authorized(may_query, &req);
    if (r > 0) {
        r = parse_body(req.body, req.body_len, req.route, &qb);
    }
    if (r <= 0 || (key = partition_key(&qb)) == NULL) {
        r = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    PyObject *found = PyDict_GetItemWithError(models, key);
    if (found == NULL || !Py_IS_TYPE(found, &AnswerModelType)) {
        if (PyErr_Occurred()) {
            r = -1;
        } else {
            res->out = Py_NewRef(key); /* build it */
            r = 2;
        }
        goto done;
    }
    m = (AnswerModel *)Py_NewRef(found); /* held: the answer allocates, and the GC may run Python code */
    if (m->generation != generation || now > m->valid_until || kvn_table_layout(m->table) != m->layout) {
        res->out = Py_NewRef(key);
        r = 2;
        goto done;
    }
    res->route = req.route;
    res->out = answer(m, req.route, &qb, head, &res->nkeys, &res->best);
    r = res->out != NULL ? 1 : (PyErr_Occurred() ? -1 : 0);
done:
    PyMem_Free(qb.ints);
    Py_XDECREF(key);
    Py_XDECREF(m);
    return r;
}

int
kvn_answer_init(PyObject *module)
{
    if (cbor_null == NULL) {
        cbor_null = PyBytes_FromStringAndSize("\xf6", 1);
    }
    if (cbor_null == NULL) {
        return -1;
    }
    return kvn_add_type(module, "AnswerModel", &AnswerModelType);
}
