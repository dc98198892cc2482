/* kvcoord._native: the module that holds every hot path's C implementation (layout: native.h).
 * kvcoord/native.py imports it, or leaves it alone under KVCOORD_NATIVE=0; nothing else imports it. */
#include "native.h"

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvcoord._native",
    .m_doc = "kvcoord's native hot paths (import kvcoord.native instead: it holds the switch).",
    .m_size = -1,
    .m_methods = NULL,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) {
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    /* not yet audited for free-threading: ask for the GIL rather than run unprotected */
    if (PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    if (PyModule_AddFunctions(m, kvn_hashchain_methods) < 0 || PyModule_AddFunctions(m, kvn_table_methods) < 0 ||
        PyModule_AddFunctions(m, kvn_walk_methods) < 0 || PyModule_AddFunctions(m, kvn_jsonints_methods) < 0 ||
        kvn_tally_init(m) < 0 ||
        kvn_hashchain_init(m) < 0 || kvn_table_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
