/* kvcoord._native: the one C extension of kvcoord (see kvcoord/native.py, the switch).
 *
 * One file per hot path, each with a pure-Python twin that is the fallback and the tests' oracle:
 *   hashchain.c  vLLM's block-hash chains (kvcoord.hashing): cbor_chain, pickle_chain, C_DIGESTS
 *   jsonints.c   JSON integer arrays to packed integers (kvcoord.coordinator.httpapi): json_take_ints
 *   table.c      the memory index's block table (kvcoord.index.memory): Table (its match, and its rows
 *                packed for the HTTP API's fast path), validate_u64_seq, u64_view
 *   walk.c       the Redis lookup mirror's holder walk (kvcoord.index.redis.mirror): mirror_walk
 *   tally.c      Tally: a histogram as plain counts (twin: kvcoord.coordinator.metrics.PyTally)
 *   module.c     PyInit__native, which adds each file's functions and types
 *
 * Rules every file keeps (the sanitizer step, scripts/sanitize.sh, fuzzes them under ASan and UBSan):
 *   - all input is validated before anything is mutated;
 *   - a PyObject used across a call that may run Python code (a hash, a comparison, an allocation that
 *     may start the cyclic GC, a user callable) is held by a strong reference, never borrowed;
 *   - no memcpy/memset/memcmp with a NULL pointer, even for 0 bytes; unaligned input is read by memcpy.
 */
#ifndef KVCOORD_NATIVE_H
#define KVCOORD_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define KVN_PREFETCH(p) __builtin_prefetch(p)
#else
#define KVN_PREFETCH(p) ((void)0)
#endif

/* 0 when cls is None or a plain tuple subclass (a NamedTuple) whose instances tp_alloc(cls, n) may
 * build and fill like tuples; -1 with TypeError otherwise. */
static inline int
kvn_check_row_class(PyObject *cls, int none_ok)
{
    if (cls == Py_None && none_ok) {
        return 0;
    }
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, none_ok ? "cls must be a tuple subclass or None"
                                                 : "cls must be a tuple subclass");
        return -1;
    }
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (!PyType_IsSubtype(tp, &PyTuple_Type) || tp->tp_basicsize != PyTuple_Type.tp_basicsize ||
        tp->tp_itemsize != PyTuple_Type.tp_itemsize || tp->tp_dictoffset != 0 || tp->tp_alloc == NULL) {
        PyErr_SetString(PyExc_TypeError, "cls must be a plain tuple subclass (a NamedTuple)");
        return -1;
    }
    return 0;
}

/* Ready `type` and add it to `module` as `name`: 0, or -1 raised. */
static inline int
kvn_add_type(PyObject *module, const char *name, PyTypeObject *type)
{
    if (PyType_Ready(type) < 0) {
        return -1;
    }
    Py_INCREF(type);
    if (PyModule_AddObject(module, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

/* The block table (table.c). */
typedef struct {
    uint32_t slot;
    uint32_t matched;
    uint32_t cpu;
    uint32_t sto;
} KvnRow;

/* Tally (tally.c). */
#define KVN_TALLY_MAX_BOUNDS 31
typedef struct {
    PyObject_HEAD
    Py_ssize_t nbounds;
    double bounds[KVN_TALLY_MAX_BOUNDS];
    unsigned long long counts[KVN_TALLY_MAX_BOUNDS + 1]; /* the last one: past every bound */
    double sum;
} KvnTally;

/* Each file's part of the module: its functions (NULL-terminated) and an init hook. */
extern PyMethodDef kvn_hashchain_methods[];
extern PyMethodDef kvn_jsonints_methods[];
extern PyMethodDef kvn_table_methods[];
extern PyMethodDef kvn_walk_methods[];
int kvn_hashchain_init(PyObject *module);
int kvn_table_init(PyObject *module);
int kvn_tally_init(PyObject *module);

#endif /* KVCOORD_NATIVE_H */
