/* kvtier._C: the CPython binding. The only file under csrc/ that includes
 * Python.h. Argument checks, buffers and errors here; work in plain C. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "fs_io.h"

/* Below this many bytes the CRC runs with the GIL held: releasing and
 * re-acquiring it costs about as much as checksumming a few KiB (CPython's
 * zlib.crc32 uses 5 KiB). Measured: benchmarks/gil_threshold.py. */
#define KVT_GIL_RELEASE_MIN (16 * 1024)

typedef struct {
    int unused;
} kvt_state;

/* ------------------------------------------------------------------ */
/* Buffers                                                             */
/* ------------------------------------------------------------------ */

/* Get a C-contiguous buffer; BufferError for strided/non-contiguous. */
static int get_contig_buffer(PyObject *obj, Py_buffer *view, int writable)
{
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        /* numpy and others may raise ValueError for non-contiguous data. */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_Format(PyExc_BufferError, "%.200s object: %S", Py_TYPE(obj)->tp_name, v ? v : Py_None);
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_BufferError, "%.200s object is not C-contiguous", Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

static int parse_crc_value(PyObject *obj, uint32_t *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "value must be int, not %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "value must be in range 0..0xFFFFFFFF");
        return -1;
    }
    if (v > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "value must be in range 0..0xFFFFFFFF");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* ------------------------------------------------------------------ */
/* CRC32C                                                              */
/* ------------------------------------------------------------------ */

static PyObject *run_crc(kvt_crc32c_fn fn, PyObject *data, PyObject *value)
{
    uint32_t crc = 0;
    if (value != NULL && parse_crc_value(value, &crc) < 0)
        return NULL;
    Py_buffer view;
    if (get_contig_buffer(data, &view, 0) < 0)
        return NULL;
    size_t len = (size_t)view.len;
    if (len >= KVT_GIL_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        crc = fn(crc, view.buf, len);
        Py_END_ALLOW_THREADS
    } else {
        crc = fn(crc, view.buf, len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

PyDoc_STRVAR(crc32c_doc,
"crc32c($module, data, value=0, /)\n--\n\n"
"CRC-32C (Castagnoli, RFC 3720) of a C-contiguous buffer, standard\n"
"presentation, through the active backend.\n\n"
"data: any buffer-protocol object (bytes, bytearray, memoryview, mmap,\n"
"numpy array, torch CPU tensor), any length including > 2 GiB.\n"
"value: previous CRC (0..0xFFFFFFFF) to chain: crc32c(b, crc32c(a)) ==\n"
"crc32c(a + b). Returns an int in 0..0xFFFFFFFF.\n"
"Raises BufferError for non-contiguous data, TypeError for non-buffers,\n"
"ValueError for value out of range. The GIL is released for inputs of\n"
"16 KiB and more.");

static PyObject *kvt_py_crc32c(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "crc32c() takes 1 or 2 positional arguments (%zd given)", nargs);
        return NULL;
    }
    return run_crc(kvt_crc32c_active()->fn, args[0], nargs > 1 ? args[1] : NULL);
}

static PyObject *backend_names_list(int only_available)
{
    size_t n;
    const kvt_crc32c_backend *b = kvt_crc32c_backends(&n);
    PyObject *lst = PyList_New(0);
    if (!lst)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        if (only_available && !b[i].available())
            continue;
        PyObject *s = PyUnicode_FromString(b[i].name);
        if (!s || PyList_Append(lst, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(lst);
            return NULL;
        }
        Py_DECREF(s);
    }
    return lst;
}

static const kvt_crc32c_backend *lookup_backend(const char *name)
{
    const kvt_crc32c_backend *b = kvt_crc32c_find(name);
    if (b != NULL && b->available())
        return b;
    PyObject *valid = backend_names_list(1);
    if (valid) {
        PyErr_Format(PyExc_ValueError, "CRC32C backend %R is %s; available backends: %S",
                     PyUnicode_FromString(name), b ? "not available on this host" : "unknown", valid);
        Py_DECREF(valid);
    }
    return NULL;
}

PyDoc_STRVAR(crc32c_using_doc,
"crc32c_using($module, backend, data, value=0, /)\n--\n\n"
"crc32c() through the named backend (see backends()), whatever is active.\n"
"Raises ValueError naming the available backends if `backend` is unknown\n"
"or not available here.");

static PyObject *kvt_py_crc32c_using(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "crc32c_using() takes 2 or 3 positional arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "backend must be str");
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(args[0]);
    if (!name)
        return NULL;
    const kvt_crc32c_backend *b = lookup_backend(name);
    if (!b)
        return NULL;
    return run_crc(b->fn, args[1], nargs > 2 ? args[2] : NULL);
}

PyDoc_STRVAR(crc32c_combine_doc,
"crc32c_combine($module, crc1, crc2, len2, /)\n--\n\n"
"CRC32C of A+B from crc1 = crc32c(A), crc2 = crc32c(B) and len2 = len(B)\n"
"in bytes (>= 0). O(log len2). Raises ValueError for out-of-range values.");

static PyObject *kvt_py_crc32c_combine(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "crc32c_combine() takes 3 positional arguments (%zd given)", nargs);
        return NULL;
    }
    uint32_t c1, c2;
    if (parse_crc_value(args[0], &c1) < 0 || parse_crc_value(args[1], &c2) < 0)
        return NULL;
    if (!PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "len2 must be int");
        return NULL;
    }
    unsigned long long len2 = PyLong_AsUnsignedLongLong(args[2]);
    if (len2 == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "len2 must be in range 0..2**64-1");
        return NULL;
    }
    return PyLong_FromUnsignedLong(kvt_crc32c_combine(c1, c2, (uint64_t)len2));
}

PyDoc_STRVAR(backends_doc,
"backends($module, /)\n--\n\n"
"Every CRC32C backend compiled in, best first, as a list of\n"
"(name, available, features) tuples.");

static PyObject *kvt_py_backends(PyObject *mod, PyObject *unused)
{
    size_t n;
    const kvt_crc32c_backend *b = kvt_crc32c_backends(&n);
    PyObject *lst = PyList_New((Py_ssize_t)n);
    if (!lst)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *t = Py_BuildValue("(sOs)", b[i].name, b[i].available() ? Py_True : Py_False,
                                    b[i].features ? b[i].features : "");
        if (!t) {
            Py_DECREF(lst);
            return NULL;
        }
        PyList_SET_ITEM(lst, (Py_ssize_t)i, t);
    }
    return lst;
}

PyDoc_STRVAR(active_backend_doc,
"active_backend($module, /)\n--\n\nName of the CRC32C backend crc32c() uses.");

static PyObject *kvt_py_active_backend(PyObject *mod, PyObject *unused)
{
    return PyUnicode_FromString(kvt_crc32c_active()->name);
}

PyDoc_STRVAR(isal_version_doc,
"isal_version($module, /)\n--\n\n"
"Version of the ISA-L library the core was built against (pkg-config), or\n"
"None when built without ISA-L.");

static PyObject *kvt_py_isal_version(PyObject *mod, PyObject *unused)
{
    const char *v = kvt_isal_version();
    if (!v)
        Py_RETURN_NONE;
    return PyUnicode_FromString(v);
}

/* ------------------------------------------------------------------ */
/* Block I/O (fs_io.c)                                                 */
/* ------------------------------------------------------------------ */

/* KVT-SECTION: block I/O bindings go here (batch_lookup, batch_store_block,
 * batch_load_block). */

/* ------------------------------------------------------------------ */
/* DSA (dsa/)                                                          */
/* ------------------------------------------------------------------ */

/* KVT-SECTION: DSA bindings go here. */

/* ------------------------------------------------------------------ */
/* Module                                                              */
/* ------------------------------------------------------------------ */

static PyMethodDef kvt_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))kvt_py_crc32c, METH_FASTCALL, crc32c_doc},
    {"crc32c_using", (PyCFunction)(void (*)(void))kvt_py_crc32c_using, METH_FASTCALL, crc32c_using_doc},
    {"crc32c_combine", (PyCFunction)(void (*)(void))kvt_py_crc32c_combine, METH_FASTCALL, crc32c_combine_doc},
    {"backends", kvt_py_backends, METH_NOARGS, backends_doc},
    {"active_backend", kvt_py_active_backend, METH_NOARGS, active_backend_doc},
    {"isal_version", kvt_py_isal_version, METH_NOARGS, isal_version_doc},
    /* KVT-METHODS: block I/O and DSA entries go here. */
    {NULL, NULL, 0, NULL},
};

/* Backend chosen once, here: KVTIER_CRC32C_BACKEND or the best available.
 * An unknown or unavailable name fails the import with ValueError. */
static int kvt_exec(PyObject *mod)
{
    const char *forced = getenv("KVTIER_CRC32C_BACKEND");
    if (forced != NULL && forced[0] != '\0') {
        const kvt_crc32c_backend *b = lookup_backend(forced);
        if (!b) {
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
    if (PyModule_AddIntConstant(mod, "GIL_RELEASE_MIN", KVT_GIL_RELEASE_MIN) < 0)
        return -1;
    if (PyModule_AddStringConstant(mod, "XATTR_NAME", KVT_XATTR_NAME) < 0)
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
    .m_size = sizeof(kvt_state),
    .m_methods = kvt_methods,
    .m_slots = kvt_slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&kvt_module); }
