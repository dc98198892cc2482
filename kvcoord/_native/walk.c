/* The Redis lookup mirror's holder walk (kvcoord.index.redis.mirror's native path; its pure-Python
 * twin is kvcoord.index.redis.walk._walk_runs over _holder_runs).
 *
 * Why: a lookup walks the mirror's copy of one bucket's inverted hashes block by block; in Python that
 * is a dict probe plus a struct unpack of every holder string. Here it is one dict probe per block up to
 * the stop, a memcmp per block, and the holder records parsed only where they change.
 *
 * Safety: a dict probe may run Python code (an int subclass's __hash__ or __eq__), which may change the
 * hashes list and the dicts. So only exact ints are walked (anything else: decline, the Python walk has
 * it); the list is re-read by index at every block (never through a saved item pointer or length); the
 * hash being probed and every dict value used across a probe or an allocation are strong references.
 */
#include "native.h"

PyDoc_STRVAR(mirror_walk_doc,
"mirror_walk(copy: dict[int, bytes], hashes: list[int], live: dict[int, (model, node_id, rank)],\n"
"            allowed: set[int] | None, cls: type[NodeMatch]) -> list[NodeMatch] | None\n\n"
"The Redis lookup walk (kvcoord.index.redis.walk) over the mirror's copy, in one pass: each hash's\n"
"holder string (5-byte records: location id u32 big-endian, tier mask u8, sorted by id) up to the\n"
"first hash the copy lacks; the locations of the first block (live, and allowed when given) stay in\n"
"the run while every following block lists them. Returns cls(node_id, rank, run, (GPU, CPU, STORAGE\n"
"blocks)) per location of the first block, unsorted; None when a hash is not an exact int in\n"
"[0, 2**64) or a holder string is not well formed (the caller's Python path then words the error or\n"
"walks it).");

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

/* Every hash from `from` on an exact int in [0, 2**64): 1, 0 (no: decline), -1 (error). Runs no Python
 * code. (Hashes the copy holds need no range check: its keys all are uint64s.) */
static int
valid_from(PyObject *seq, Py_ssize_t from)
{
    for (Py_ssize_t i = from; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyLong_CheckExact(o)) {
            return 0;
        }
        (void)PyLong_AsUnsignedLongLong(o);
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                return -1;
            }
            PyErr_Clear(); /* negative or wider than 64 bits */
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

static int
same_holders(PyObject *v, PyObject *prev)
{
    return v == prev || (prev != NULL && PyBytes_Check(v) && PyBytes_GET_SIZE(v) == PyBytes_GET_SIZE(prev) &&
                         memcmp(PyBytes_AS_STRING(v), PyBytes_AS_STRING(prev), (size_t)PyBytes_GET_SIZE(v)) == 0);
}

/* The first block's records: the live (and allowed) locations start the run. 1 ok, 0 decline, -1 error. */
static int
first_block(const uint8_t *p, Py_ssize_t nr, PyObject *live, PyObject *allowed, Loc **locs_out,
            Py_ssize_t *nlocs_out)
{
    Loc *locs = PyMem_Malloc((size_t)(nr > 0 ? nr : 1) * sizeof(Loc));
    if (locs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t nlocs = 0;
    for (Py_ssize_t r = 0; r < nr; r++) {
        PyObject *id = PyLong_FromUnsignedLong(rec_id(p + 5 * r));
        if (id == NULL) {
            PyMem_Free(locs);
            return -1;
        }
        int keep = PyDict_Contains(live, id);
        if (keep > 0 && allowed != NULL) {
            keep = PySet_Contains(allowed, id);
        }
        Py_DECREF(id);
        if (keep < 0) {
            PyMem_Free(locs);
            return -1;
        }
        if (keep) {
            Loc *l = &locs[nlocs++];
            memset(l, 0, sizeof(*l));
            l->id = rec_id(p + 5 * r);
            l->mask = p[5 * r + 4];
            l->active = 1;
        }
    }
    *locs_out = locs;
    *nlocs_out = nlocs;
    return 1;
}

/* A later block with other holders: the active locations it lists go on; the number still active. */
static Py_ssize_t
next_block(const uint8_t *p, Py_ssize_t nr, Loc *locs, Py_ssize_t nlocs)
{
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
    if (still > 0) {
        for (Py_ssize_t k = 0; k < nlocs; k++) {
            if (locs[k].active == 2) {
                locs[k].active = 0;
            }
        }
    }
    return still;
}

/* The answer rows, one per location of the first block; NULL with an exception. */
static PyObject *
build_rows(const Loc *locs, Py_ssize_t nlocs, PyObject *live, PyTypeObject *cls)
{
    PyObject *out = PyList_New(nlocs);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < nlocs; k++) {
        const Loc *l = &locs[k];
        PyObject *id = PyLong_FromUnsignedLong(l->id);
        PyObject *where = id == NULL ? NULL : PyDict_GetItemWithError(live, id); /* (model, node, rank) */
        Py_XDECREF(id);
        if (where == NULL || !PyTuple_Check(where) || PyTuple_GET_SIZE(where) != 3) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "live location names must be (model, node_id, rank)");
            }
            Py_DECREF(out);
            return NULL;
        }
        Py_INCREF(where); /* the allocations below may run the GC, and with it code that changes live */
        PyObject *tiers = Py_BuildValue("(nnn)", l->t[0], l->t[1], l->t[2]);
        PyObject *run = tiers == NULL ? NULL : PyLong_FromSsize_t(l->run);
        PyObject *row = run == NULL ? NULL : cls->tp_alloc(cls, 4);
        if (row == NULL) {
            Py_DECREF(where);
            Py_XDECREF(tiers);
            Py_XDECREF(run);
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(row, 0, Py_NewRef(PyTuple_GET_ITEM(where, 1)));
        PyTuple_SET_ITEM(row, 1, Py_NewRef(PyTuple_GET_ITEM(where, 2)));
        PyTuple_SET_ITEM(row, 2, run);
        PyTuple_SET_ITEM(row, 3, tiers);
        PyList_SET_ITEM(out, k, row);
        Py_DECREF(where);
    }
    return out;
}

static PyObject *
mirror_walk(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyDict_Check(args[0]) || !(PyList_Check(args[1]) || PyTuple_Check(args[1])) ||
        !PyDict_Check(args[2]) || !(args[3] == Py_None || PyAnySet_Check(args[3]))) {
        PyErr_SetString(PyExc_TypeError, "mirror_walk(dict, list, dict, set | None, NamedTuple class)");
        return NULL;
    }
    if (kvn_check_row_class(args[4], 0) < 0) {
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)args[4];
    PyObject *copy = args[0], *hashes = args[1], *live = args[2], *allowed = args[3] == Py_None ? NULL : args[3];
    Loc *locs = NULL;
    Py_ssize_t nlocs = 0, i = 0;
    PyObject *prev = NULL, *out = NULL; /* prev: a strong reference to the last block's holders */
    Py_ssize_t seg = 0;                 /* blocks since the holders last changed, not yet counted */
    int declined = 0;
    for (; i < PySequence_Fast_GET_SIZE(hashes); i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(hashes, i);
        if (!PyLong_CheckExact(h)) {
            declined = 1; /* an int subclass or anything else: the Python walk */
            goto done;
        }
        Py_INCREF(h);
        PyObject *v = PyDict_GetItemWithError(copy, h); /* an exact int found in the copy is a uint64 */
        Py_DECREF(h);
        if (v == NULL) {
            if (PyErr_Occurred()) {
                goto done;
            }
            break;
        }
        if (same_holders(v, prev)) {
            seg++; /* the same holders as the block before: the run goes on as it is */
            continue;
        }
        add_seg(locs, nlocs, seg);
        seg = 0;
        if (!holders_ok(v)) {
            declined = 1;
            goto done;
        }
        Py_INCREF(v); /* held while its bytes are read: the set and dict probes below may run code */
        Py_XSETREF(prev, v);
        const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(v);
        Py_ssize_t nr = PyBytes_GET_SIZE(v) / 5;
        for (Py_ssize_t r = 1; r < nr; r++) {
            if (rec_id(p + 5 * r) <= rec_id(p + 5 * (r - 1))) {
                declined = 1; /* not sorted and unique: the Python walk handles it */
                goto done;
            }
        }
        if (locs == NULL) {
            if (first_block(p, nr, live, allowed, &locs, &nlocs) < 0) {
                goto done;
            }
            if (nlocs == 0) {
                break;
            }
        } else if (next_block(p, nr, locs, nlocs) == 0) {
            break; /* no location holds this block too: the walk stops here */
        }
        seg = 1;
    }
    add_seg(locs, nlocs, seg);
    {
        int ok = valid_from(hashes, i); /* the hashes from the stop on were not looked up, or not found */
        if (ok <= 0) {
            declined = ok == 0;
            goto done;
        }
    }
    out = build_rows(locs, nlocs, live, cls);
done:
    Py_XDECREF(prev);
    PyMem_Free(locs);
    if (declined) {
        Py_RETURN_NONE;
    }
    return out;
}

PyMethodDef kvn_walk_methods[] = {
    {"mirror_walk", (PyCFunction)(void (*)(void))mirror_walk, METH_FASTCALL, mirror_walk_doc},
    {NULL, NULL, 0, NULL},
};
