/* kvtier._C: one extension module, so the CRC32C backend is chosen once for
 * every area. The areas (crc.c, blockio.c, dsa.c) each give a method table;
 * exec adds them, registers the DSA backends and chooses the backend. */
#include "args.h"

#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "dsa.h"
#include "env.h"

PyDoc_STRVAR(env_check_doc,
"env_check($module, group, /)\n--\n\n"
"The KVTIER_* settings the C core reads (csrc/env.c) that are set to a value\n"
"it does not take, for group 'io' (KVTIER_CRC_COPY, KVTIER_IO_URING) or\n"
"'dsa' (KVTIER_DSA, KVTIER_DSA_WAIT, KVTIER_DSA_MIN_SIZE, KVTIER_DSA_TIMEOUT_MS,\n"
"KVTIER_DSA_SELFCHECK_TIMEOUT_MS, KVTIER_DSA_MODEL_LATENCY_NS), as a list of\n"
"(name, value, why) tuples: why completes \"<name>=<value> is not valid<why>\"\n"
"(\"; valid values: ...\" or \": ..., an integer lo..hi\"). [] when every one\n"
"is unset, empty or valid (the core then uses it; on a value listed here it\n"
"keeps its default). ValueError for another group.");

static PyObject *kvt_py_env_check(PyObject *mod, PyObject *arg)
{
    const char *group = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (group == NULL || (strcmp(group, "io") != 0 && strcmp(group, "dsa") != 0)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "group must be 'io' or 'dsa', not %R", arg);
        return NULL;
    }
    const char *names[16];
    size_t n = kvt_env_names(group, names, 16);
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out != NULL && i < n; i++) {
        char why[300];
        if (kvt_env_problem(names[i], why, sizeof why) == NULL)
            continue;
        PyObject *t = Py_BuildValue("(sNs)", names[i], PyUnicode_DecodeFSDefault(getenv(names[i])), why);
        if (t == NULL || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"env_check", kvt_py_env_check, METH_O, env_check_doc},
    {NULL, NULL, 0, NULL},
};

/* Backend chosen once, here: KVTIER_CRC32C_BACKEND or the best available.
 * An unknown or unavailable name fails the import with ValueError. */
static int kvt_exec(PyObject *mod)
{
    if (PyModule_AddFunctions(mod, kvt_py_crc_methods) < 0 || PyModule_AddFunctions(mod, kvt_py_blockio_methods) < 0 ||
        PyModule_AddFunctions(mod, kvt_py_dsa_methods) < 0 || PyModule_AddFunctions(mod, module_methods) < 0)
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
