/* Answerer: what the HTTP server calls with the bytes of a request, for the whole answer or None
 * (kvcoord.coordinator.httpd's `answer`; built by kvcoord.coordinator.fastpath.NativeAnswers).
 *
 * Why: once the lookup itself was native (answer.c), the Python around each call (the clocks, the view
 * refresh check, the status line and Date header, and three prometheus_client observations at ~1.5 us
 * each) cost several times the answer. Here a request costs no Python at all unless a view is stale.
 *
 *   Answerer(views, changes, refresh, gate, may_query, on_error, extra_headers, tally_tokens,
 *            tally_hashes, tally_matched)(data: bytes) -> bytes | None
 *
 * views: {partition: AnswerModel}; changes: the registry's change count is its `count`; refresh(partition,
 * now) -> bool brings a stale or missing view up to date (False: the handler answers); gate: answers only
 * while its `index_up` is true; may_query: None or the auth check (answer.c); on_error(exc): told of an
 * exception raised on the way (the request then goes to the handler); extra_headers: header lines sent
 * with every answer, before `date`; the tallies: latency by route (seconds) and the best node's share of
 * the query's blocks (kvcoord.coordinator.metrics exports them). `answered` counts the answers.
 *
 * The answer's head is the handler's (kvcoord.coordinator.httpd.render): status line, extra headers,
 * `date` (RFC 7231, as email.utils.formatdate(usegmt=True) writes it, formatted once a second),
 * `content-length`, then answer.c's `content-type`.
 */
#include "native.h"

#include <stddef.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *views;
    PyObject *changes;
    PyObject *refresh;
    PyObject *gate;
    PyObject *may_query;
    PyObject *on_error;
    PyObject *extra;
    KvnTally *tallies[3]; /* tokens, hashes, matched fraction */
    PyObject *head;       /* bytes for head_sec, or NULL */
    time_t head_sec;
    unsigned long long answered;
} Answerer;

static PyObject *str_count, *str_index_up;

static double
monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic() and time.perf_counter() */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The head up to the value of content-length, for the current second (a borrowed reference). */
static PyObject *
current_head(Answerer *a)
{
    static const char *days[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
    static const char *months[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                   "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt); /* time.time()'s clock: time(NULL) is the coarse one, a tick behind */
    time_t now = rt.tv_sec;
    if (a->head != NULL && now == a->head_sec) {
        return a->head;
    }
    struct tm tm;
    if (gmtime_r(&now, &tm) == NULL) {
        PyErr_SetString(PyExc_OverflowError, "the time is out of range");
        return NULL;
    }
    char date[64];
    int dlen = snprintf(date, sizeof date, "%s, %02d %s %04d %02d:%02d:%02d GMT", days[tm.tm_wday % 7],
                        tm.tm_mday, months[tm.tm_mon % 12], tm.tm_year + 1900, tm.tm_hour, tm.tm_min, tm.tm_sec);
    static const char status[] = "HTTP/1.1 200 OK\r\n", date_name[] = "date: ", length[] = "\r\ncontent-length: ";
    Py_ssize_t xlen = PyBytes_GET_SIZE(a->extra); /* copied whole: the extra lines' bytes as given */
    if (dlen < 0 || (size_t)dlen >= sizeof date) {
        PyErr_SetString(PyExc_OverflowError, "the date does not fit");
        return NULL;
    }
    PyObject *head = PyBytes_FromStringAndSize(
        NULL, (Py_ssize_t)(sizeof status - 1 + sizeof date_name - 1 + sizeof length - 1) + xlen + dlen);
    if (head == NULL) {
        return NULL;
    }
    char *p = PyBytes_AS_STRING(head);
    memcpy(p, status, sizeof status - 1);
    p += sizeof status - 1;
    if (xlen > 0) {
        memcpy(p, PyBytes_AS_STRING(a->extra), (size_t)xlen);
        p += xlen;
    }
    memcpy(p, date_name, sizeof date_name - 1);
    p += sizeof date_name - 1;
    memcpy(p, date, (size_t)dlen);
    p += dlen;
    memcpy(p, length, sizeof length - 1);
    Py_XSETREF(a->head, head);
    a->head_sec = now;
    return head;
}

/* The registry's change count: 0 (and *gen), or -1 raised. */
static int
generation(Answerer *a, uint64_t *gen)
{
    PyObject *count = PyObject_GetAttr(a->changes, str_count);
    if (count == NULL) {
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(count);
    Py_DECREF(count);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *gen = (uint64_t)v;
    return 0;
}

/* 1 while the gate's index_up is true, 0 when not, -1 raised. */
static int
gate_open(Answerer *a)
{
    PyObject *up = PyObject_GetAttr(a->gate, str_index_up);
    if (up == NULL) {
        return -1;
    }
    int r = PyObject_IsTrue(up);
    Py_DECREF(up);
    return r;
}

/* One request with a fresh view: 1 (res->out the answer), 0 not claimed, -1 raised. A stale view is
 * refreshed once; still stale, the handler answers. */
static int
answer_fresh(Answerer *a, PyObject *data, double now, KvnAnswered *res)
{
    PyObject *head = current_head(a);
    uint64_t gen;
    if (head == NULL) {
        return -1;
    }
    Py_INCREF(head); /* held: reading the count or a refresh may run code that replaces a->head */
    if (generation(a, &gen) < 0) {
        Py_DECREF(head);
        return -1;
    }
    int r = kvn_answer_request(data, a->views, gen, now, head, a->may_query, res);
    if (r == 2) {
        PyObject *nowf = PyFloat_FromDouble(now);
        PyObject *ok = nowf == NULL ? NULL : PyObject_CallFunctionObjArgs(a->refresh, res->out, nowf, NULL);
        Py_XDECREF(nowf);
        Py_CLEAR(res->out);
        r = ok == NULL ? -1 : PyObject_IsTrue(ok);
        Py_XDECREF(ok);
        if (r > 0 && (r = generation(a, &gen)) == 0) {
            r = kvn_answer_request(data, a->views, gen, now, head, a->may_query, res);
            if (r == 2) {
                Py_CLEAR(res->out);
                r = 0;
            }
        }
    }
    Py_DECREF(head);
    return r;
}

static PyObject *
Answerer_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Answerer *a = (Answerer *)self;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "Answerer(data: bytes)");
        return NULL;
    }
    if (a->views == NULL) { /* Answerer_clear empties every field at once */
        Py_RETURN_NONE; /* cleared by the GC (called from a finalizer in its cycle): the handler answers */
    }
    double t0 = monotonic();
    KvnAnswered res = {0};
    int r = gate_open(a);
    if (r > 0) {
        Py_INCREF(self); /* held: a refresh or the auth check runs Python code */
        r = answer_fresh(a, args[0], t0, &res);
        Py_DECREF(self);
    }
    if (r < 0) {
        /* a bug or out of memory: this request goes to the handler; on_error is told (it logs once) */
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        if (exc != NULL && tb != NULL) {
            PyException_SetTraceback(exc, tb);
        }
        PyObject *told = PyObject_CallOneArg(a->on_error, exc != NULL ? exc : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
        if (told == NULL) {
            return NULL;
        }
        Py_DECREF(told);
        Py_RETURN_NONE;
    }
    if (r == 0) {
        Py_RETURN_NONE;
    }
    a->answered++;
    kvn_tally_observe(a->tallies[res.route == 1 ? 0 : 1], monotonic() - t0);
    if (res.nkeys > 0) {
        kvn_tally_observe(a->tallies[2], (double)res.best / (double)res.nkeys);
    }
    return res.out;
}

static PyObject *
Answerer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *views, *changes, *refresh, *gate, *may_query, *on_error, *extra, *t[3];
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Answerer takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!OOOOOO!O!O!O!:Answerer", &PyDict_Type, &views, &changes, &refresh, &gate,
                          &may_query, &on_error, &PyBytes_Type, &extra, &KvnTallyType, &t[0], &KvnTallyType,
                          &t[1], &KvnTallyType, &t[2])) {
        return NULL;
    }
    if (!PyCallable_Check(refresh) || !PyCallable_Check(on_error) ||
        (may_query != Py_None && !PyCallable_Check(may_query))) {
        PyErr_SetString(PyExc_TypeError, "refresh and on_error must be callable, may_query callable or None");
        return NULL;
    }
    Answerer *a = (Answerer *)type->tp_alloc(type, 0);
    if (a == NULL) {
        return NULL;
    }
    a->vectorcall = Answerer_vectorcall;
    a->views = Py_NewRef(views);
    a->changes = Py_NewRef(changes);
    a->refresh = Py_NewRef(refresh);
    a->gate = Py_NewRef(gate);
    a->may_query = Py_NewRef(may_query);
    a->on_error = Py_NewRef(on_error);
    a->extra = Py_NewRef(extra);
    for (int i = 0; i < 3; i++) {
        a->tallies[i] = (KvnTally *)Py_NewRef(t[i]);
    }
    return (PyObject *)a;
}

static int
Answerer_traverse(Answerer *a, visitproc visit, void *arg)
{
    Py_VISIT(a->views);
    Py_VISIT(a->changes);
    Py_VISIT(a->refresh);
    Py_VISIT(a->gate);
    Py_VISIT(a->may_query);
    Py_VISIT(a->on_error);
    for (int i = 0; i < 3; i++) {
        Py_VISIT(a->tallies[i]);
    }
    return 0;
}

static int
Answerer_clear(Answerer *a)
{
    Py_CLEAR(a->views);
    Py_CLEAR(a->changes);
    Py_CLEAR(a->refresh);
    Py_CLEAR(a->gate);
    Py_CLEAR(a->may_query);
    Py_CLEAR(a->on_error);
    Py_CLEAR(a->extra);
    Py_CLEAR(a->head);
    for (int i = 0; i < 3; i++) {
        Py_CLEAR(a->tallies[i]);
    }
    return 0;
}

static void
Answerer_dealloc(Answerer *a)
{
    PyObject_GC_UnTrack(a);
    Answerer_clear(a);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *
Answerer_get_answered(Answerer *a, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(a->answered);
}

static PyGetSetDef Answerer_getset[] = {
    {"answered", (getter)Answerer_get_answered, NULL, "requests answered natively", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject AnswererType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcoord._native.Answerer",
    .tp_basicsize = sizeof(Answerer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Answerer(views, changes, refresh, gate, may_query, on_error, extra_headers, tally_tokens, "
              "tally_hashes, tally_matched)(data) -> bytes | None (see answerer.c)",
    .tp_new = Answerer_new,
    .tp_dealloc = (destructor)Answerer_dealloc,
    .tp_traverse = (traverseproc)Answerer_traverse,
    .tp_clear = (inquiry)Answerer_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Answerer, vectorcall),
    .tp_getset = Answerer_getset,
};

int
kvn_answerer_init(PyObject *module)
{
    if (str_count == NULL && (str_count = PyUnicode_InternFromString("count")) == NULL) {
        return -1;
    }
    if (str_index_up == NULL && (str_index_up = PyUnicode_InternFromString("index_up")) == NULL) {
        return -1;
    }
    return kvn_add_type(module, "Answerer", &AnswererType);
}
