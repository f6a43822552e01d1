/* kvtier._C, CRC32C area: crc32c, crc32c_copy, crc32c_using,
 * crc32c_combine, the backend list, the benchmark peers (csrc/crc32c). */
#include "args.h"

#include <string.h>

#include "crc32c.h"

static PyObject *run_crc(kvt_crc32c_fn fn, PyObject *data, PyObject *value)
{
    uint32_t crc = 0;
    if (value != NULL && kvt_py_crc_value(value, &crc) < 0)
        return NULL;
    Py_buffer view;
    if (kvt_py_buffer(data, &view, 0) < 0)
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
"32 KiB and more (GIL_RELEASE_MIN).");

static PyObject *kvt_py_crc32c(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (kvt_py_nargs("crc32c", nargs, 1, 2) < 0)
        return NULL;
    return run_crc(kvt_crc32c_active()->fn, args[0], nargs > 1 ? args[1] : NULL);
}


PyDoc_STRVAR(crc32c_copy_doc,
"crc32c_copy($module, dst, src, value=0, /)\n--\n\n"
"Copy src into dst and return the CRC-32C (RFC 3720, standard presentation)\n"
"of the bytes copied, continued from value, in one pass: the fused kernel\n"
"named by crc_copy_status()['kernel'] (x86-64: non-temporal stores, so dst\n"
"ends up in memory, not in the CPU cache; 'generic': memcpy + the best CPU\n"
"backend). The copy of checksummed buffered loads; the pure-Python block\n"
"I/O fallback uses it when the C core is importable.\n\n"
"dst: writable C-contiguous buffer; src: C-contiguous buffer of the same\n"
"length in bytes, not overlapping dst. value: previous CRC (0..0xFFFFFFFF).\n"
"Returns an int in 0..0xFFFFFFFF.\n"
"Raises TypeError for non-buffers, BufferError for a non-contiguous buffer or\n"
"a read-only dst, ValueError for unequal lengths, overlapping buffers or value\n"
"out of range (dst untouched). The GIL is released from 32 KiB.");

static PyObject *kvt_py_crc32c_copy(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (kvt_py_nargs("crc32c_copy", nargs, 2, 3) < 0)
        return NULL;
    uint32_t crc = 0;
    if (nargs > 2 && kvt_py_crc_value(args[2], &crc) < 0)
        return NULL;
    Py_buffer dst, src;
    if (kvt_py_copy_buffers("crc32c_copy", args[0], args[1], &dst, &src) < 0)
        return NULL;
    size_t len = (size_t)src.len;
    if (len >= KVT_GIL_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        crc = kvt_crc32c_copy(crc, dst.buf, src.buf, len);
        Py_END_ALLOW_THREADS
    } else {
        crc = kvt_crc32c_copy(crc, dst.buf, src.buf, len);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyLong_FromUnsignedLong(crc);
}

/* A slow_probe backend's available() (DSA's) may run discovery and the
 * 1 MiB self-check (up to seconds) the first time: never with the GIL held.
 * The enable path is serialized in C (pthread_once, a mutex). */
static int backend_available(const kvt_crc32c_backend *b)
{
    if (!b->slow_probe)
        return b->available();
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = b->available();
    Py_END_ALLOW_THREADS
    return r;
}

static PyObject *backend_names_list(int only_available)
{
    size_t n;
    const kvt_crc32c_backend *b = kvt_crc32c_backends(&n);
    PyObject *lst = PyList_New(0);
    if (!lst)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        if (only_available && !backend_available(&b[i]))
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

const kvt_crc32c_backend *kvt_py_crc_backend(const char *name)
{
    const kvt_crc32c_backend *b = kvt_crc32c_find(name);
    if (b != NULL && backend_available(b))
        return b;
    PyObject *valid = backend_names_list(1);
    if (valid) {
        /* Names of backends another build or CPU has (crc32c.h), and numpy. */
        const char *why = "unknown";
        if (!b && strcmp(name, "armv8") == 0)
            why = "not built: aarch64 only";
        else if (!b && strcmp(name, "sse42") == 0)
            why = "not built: x86-64 only";
        else if (!b && strcmp(name, "isal") == 0)
            why = "not built in (libisal not found at build time, or KVTIER_NO_ISAL=1)";
        else if (!b && strcmp(name, "numpy") == 0)
            why = "the pure-Python fallback, used only without the C core";
        else if (b && strcmp(b->name, "dsa-model") == 0) /* never unavailable "on this host" */
            why = "not enabled (explicit only: KVTIER_DSA=model or KVTIER_CRC32C_BACKEND=dsa-model)";
        else if (b)
            why = "not available on this host";
        /* dsa-model is accepted by KVTIER_CRC32C_BACKEND even when not yet enabled */
        int model = 0;
        if (kvt_crc32c_find("dsa-model") != NULL) {
            PyObject *m = PyUnicode_FromString("dsa-model");
            model = m != NULL && PySequence_Contains(valid, m) == 0;
            Py_XDECREF(m);
            PyErr_Clear();
        }
        PyErr_Format(PyExc_ValueError, "CRC32C backend '%s' is %s; available backends: %S%s", name, why, valid,
                     model ? " (and 'dsa-model' through KVTIER_CRC32C_BACKEND, the software model of DSA)" : "");
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
    if (kvt_py_nargs("crc32c_using", nargs, 2, 3) < 0)
        return NULL;
    if (!PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "backend must be str");
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(args[0]);
    if (!name)
        return NULL;
    const kvt_crc32c_backend *b = kvt_py_crc_backend(name);
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
    if (kvt_py_nargs("crc32c_combine", nargs, 3, 3) < 0)
        return NULL;
    uint32_t c1, c2;
    if (kvt_py_crc_value(args[0], &c1) < 0 || kvt_py_crc_value(args[1], &c2) < 0)
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
        PyObject *t = Py_BuildValue("(sOs)", b[i].name, backend_available(&b[i]) ? Py_True : Py_False,
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

/* CRC peers: benchmark peers, not backends. They
 * are the baselines of the speed claims in docs/crc32c.md ("sse42" vs one
 * serial crc32q chain, "table" vs a byte-at-a-time table) and are called by
 * benchmarks/crc32c_bench.py and tests/test_crc32c.py only. */
PyDoc_STRVAR(crc32c_serial_crc32q_doc,
"_crc32c_serial_crc32q($module, data, value=0, /)\n--\n\n"
"Benchmark peer: crc32c() by one serial chain of SSE4.2 crc32q\n"
"instructions (x86-64). Raises RuntimeError where SSE4.2 is missing.");

static PyObject *kvt_py_crc32c_serial_crc32q(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (kvt_py_nargs("_crc32c_serial_crc32q", nargs, 1, 2) < 0)
        return NULL;
#ifdef KVT_CRC32C_HAVE_SSE42
    if (kvt_crc32c_sse42_available())
        return run_crc(kvt_crc32c_sse42_serial, args[0], nargs > 1 ? args[1] : NULL);
#endif
    PyErr_SetString(PyExc_RuntimeError, "the serial crc32q peer needs x86-64 with SSE4.2");
    return NULL;
}

PyDoc_STRVAR(crc32c_bytewise_doc,
"_crc32c_bytewise($module, data, value=0, /)\n--\n\n"
"Benchmark peer: crc32c() by a byte-at-a-time table loop.");

static PyObject *kvt_py_crc32c_bytewise(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (kvt_py_nargs("_crc32c_bytewise", nargs, 1, 2) < 0)
        return NULL;
    return run_crc(kvt_crc32c_bytewise, args[0], nargs > 1 ? args[1] : NULL);
}

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL

PyMethodDef kvt_py_crc_methods[] = {
    {"crc32c", FASTCALL(kvt_py_crc32c), crc32c_doc},
    {"crc32c_copy", FASTCALL(kvt_py_crc32c_copy), crc32c_copy_doc},
    {"crc32c_using", FASTCALL(kvt_py_crc32c_using), crc32c_using_doc},
    {"crc32c_combine", FASTCALL(kvt_py_crc32c_combine), crc32c_combine_doc},
    {"backends", kvt_py_backends, METH_NOARGS, backends_doc},
    {"active_backend", kvt_py_active_backend, METH_NOARGS, active_backend_doc},
    {"isal_version", kvt_py_isal_version, METH_NOARGS, isal_version_doc},
    {"_crc32c_serial_crc32q", FASTCALL(kvt_py_crc32c_serial_crc32q), crc32c_serial_crc32q_doc},
    {"_crc32c_bytewise", FASTCALL(kvt_py_crc32c_bytewise), crc32c_bytewise_doc},
    {NULL, NULL, 0, NULL},
};
