/* kvtier._C: one extension module, so the CRC32C backend is chosen once for
 * every area. The areas (crc.c, blockio.c, dsa.c) each give a method table;
 * exec adds them, registers the DSA backends and chooses the backend. */
#include "args.h"

#include <stdlib.h>

#include "crc32c.h"
#include "dsa.h"

/* Backend chosen once, here: KVTIER_CRC32C_BACKEND or the best available.
 * An unknown or unavailable name fails the import with ValueError. */
static int kvt_exec(PyObject *mod)
{
    if (PyModule_AddFunctions(mod, kvt_py_crc_methods) < 0 || PyModule_AddFunctions(mod, kvt_py_blockio_methods) < 0 ||
        PyModule_AddFunctions(mod, kvt_py_dsa_methods) < 0)
        return -1;
    kvt_dsa_register_backends();
    const char *forced = getenv("KVTIER_CRC32C_BACKEND");
    if (forced != NULL && forced[0] != '\0') {
        if (kvt_py_crc_backend(forced) == NULL) {
            /* Re-phrase with the variable's name so the user knows where it came from. */
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_Format(PyExc_ValueError, "KVTIER_CRC32C_BACKEND=%s: %S", forced, v ? v : Py_None);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
            return -1;
        }
        kvt_crc32c_select(forced);
    } else {
        kvt_crc32c_select(NULL);
    }
    if (PyModule_AddIntConstant(mod, "GIL_RELEASE_MIN", KVT_GIL_RELEASE_MIN) < 0 || kvt_py_blockio_constants(mod) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot kvt_slots[] = {
    {Py_mod_exec, kvt_exec},
    {0, NULL},
};

static struct PyModuleDef kvt_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier._C",
    .m_doc = "kvtier C core: CRC32C engine, batched checksummed block I/O, Intel DSA offload.",
    .m_size = 0,
    .m_slots = kvt_slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&kvt_module); }
