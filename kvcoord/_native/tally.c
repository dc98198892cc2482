/* Tally: a histogram's counts kept as plain numbers (kvcoord.coordinator.metrics exports them at scrape
 * time). Its twin is kvcoord.coordinator.metrics.PyTally.
 *
 * Why: prometheus_client's Histogram.observe takes a lock and walks Python objects, ~1.5 us a call; the
 * HTTP API's lookups observe two histograms a request, a good part of a small lookup's cost. A value goes to the first bucket whose bound is not below it (Prometheus' `le`; the
 * twin's bisect_left), or to the overflow bucket past the last bound; the sum adds every value.
 *
 *   Tally(bounds: tuple[float, ...]) .observe(value) .counts() -> (tuple[int, ...], float)
 */
#include "native.h"

static PyObject *
Tally_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *bounds;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Tally takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!:Tally", &PyTuple_Type, &bounds)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(bounds);
    if (n > KVN_TALLY_MAX_BOUNDS) {
        PyErr_SetString(PyExc_ValueError, "too many bounds");
        return NULL;
    }
    KvnTally *t = (KvnTally *)type->tp_alloc(type, 0);
    if (t == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double b = PyFloat_AsDouble(PyTuple_GET_ITEM(bounds, i));
        if (b == -1.0 && PyErr_Occurred()) {
            Py_DECREF(t);
            return NULL;
        }
        if (i > 0 && !(b > t->bounds[i - 1])) {
            Py_DECREF(t);
            PyErr_SetString(PyExc_ValueError, "bounds must increase");
            return NULL;
        }
        t->bounds[i] = b;
    }
    t->nbounds = n;
    return (PyObject *)t;
}

static void
kvn_tally_observe(KvnTally *t, double v)
{
    Py_ssize_t i = 0;
    while (i < t->nbounds && t->bounds[i] < v) {
        i++;
    }
    t->counts[i]++;
    t->sum += v;
}

static PyObject *
Tally_observe(KvnTally *t, PyObject *arg)
{
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    kvn_tally_observe(t, v);
    Py_RETURN_NONE;
}

static PyObject *
Tally_counts(KvnTally *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *counts = PyTuple_New(t->nbounds + 1);
    if (counts == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i <= t->nbounds; i++) {
        PyObject *c = PyLong_FromUnsignedLongLong(t->counts[i]);
        if (c == NULL) {
            Py_DECREF(counts);
            return NULL;
        }
        PyTuple_SET_ITEM(counts, i, c);
    }
    return Py_BuildValue("(Nd)", counts, t->sum);
}

static PyMethodDef Tally_methods[] = {
    {"observe", (PyCFunction)Tally_observe, METH_O, "observe(value): one value into its bucket and the sum"},
    {"counts", (PyCFunction)Tally_counts, METH_NOARGS,
     "counts() -> (per bucket, the overflow last; sum)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KvnTallyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcoord._native.Tally",
    .tp_basicsize = sizeof(KvnTally),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Tally(bounds): a histogram's bucket counts and sum as plain numbers (see tally.c)",
    .tp_new = Tally_new,
    .tp_methods = Tally_methods,
};

int
kvn_tally_init(PyObject *module)
{
    return kvn_add_type(module, "Tally", &KvnTallyType);
}
