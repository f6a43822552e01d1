/* kvtier._C: the CPython binding. The only file under csrc/ that includes
 * Python.h. Argument checks, buffers and errors here; work in plain C. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "dsa.h"
#include "fs_io.h"
#include "uring.h"

/* Below this many bytes the CRC runs with the GIL held. Measured with
 * `python benchmarks/gil_threshold.py` (docs/crc32c.md): one uncontended
 * release + re-acquire costs 18-44 ns (two runs); on the fastest backend
 * (isal, ~25-60 GB/s) that is <= 5 % of the CRC from 32 KiB (0.6-1.3 us) in
 * both runs, sse42 reaches it at 8 KiB and table at 0.5-2 KiB. Below
 * 32 KiB a call holds the GIL for at most ~20 us (table backend), far under
 * the 5 ms switch interval.
 * (CPython's zlib.crc32 uses 5 KiB, ICRAR crc32c 32 KiB.) */
#define KVT_GIL_RELEASE_MIN (32 * 1024)

typedef struct {
    int unused;
} kvt_state;

/* ------------------------------------------------------------------ */
/* Buffers                                                             */
/* ------------------------------------------------------------------ */

/* 1 if obj is a torch tensor (its type comes from a "torch" module). torch
 * tensors do not export the buffer protocol; Tensor.numpy() returns an
 * ndarray sharing the tensor's memory (CPU only; it raises for CUDA tensors
 * and tensors requiring grad), never a copy, so loads land in the tensor. */
static int is_torch_tensor(PyObject *obj)
{
    PyObject *mod = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__module__");
    if (!mod) {
        PyErr_Clear();
        return 0;
    }
    const char *m = PyUnicode_Check(mod) ? PyUnicode_AsUTF8(mod) : NULL;
    int yes = m != NULL && strncmp(m, "torch", 5) == 0 && (m[5] == '\0' || m[5] == '.');
    if (m == NULL)
        PyErr_Clear();
    Py_DECREF(mod);
    return yes;
}

/* A uint8 ndarray aliasing a contiguous CPU torch tensor's bytes (any dtype,
 * bf16 included): t.detach().reshape(-1).view(torch.uint8).numpy().
 * BufferError for a non-contiguous tensor; torch's own error otherwise
 * (e.g. TypeError for a CUDA tensor). */
static PyObject *torch_bytes_view(PyObject *t)
{
    PyObject *c = PyObject_CallMethod(t, "is_contiguous", NULL);
    if (!c)
        return NULL;
    int contig = PyObject_IsTrue(c);
    Py_DECREF(c);
    if (contig < 0)
        return NULL;
    if (!contig) {
        PyErr_SetString(PyExc_BufferError, "torch tensor is not contiguous");
        return NULL;
    }
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch)
        return NULL;
    PyObject *u8 = PyObject_GetAttrString(torch, "uint8");
    Py_DECREF(torch);
    if (!u8)
        return NULL;
    PyObject *a = PyObject_CallMethod(t, "detach", NULL);
    PyObject *b = a ? PyObject_CallMethod(a, "reshape", "(i)", -1) : NULL;
    PyObject *v = b ? PyObject_CallMethod(b, "view", "(O)", u8) : NULL;
    PyObject *arr = v ? PyObject_CallMethod(v, "numpy", NULL) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(v);
    Py_DECREF(u8);
    return arr;
}

/* Get a C-contiguous buffer; BufferError for strided/non-contiguous.
 * torch CPU tensors are taken through torch_bytes_view(). */
static int get_contig_buffer(PyObject *obj, Py_buffer *view, int writable)
{
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (!PyObject_CheckBuffer(obj) && is_torch_tensor(obj)) {
        PyObject *arr = torch_bytes_view(obj);
        if (!arr)
            return -1;
        int rc = get_contig_buffer(arr, view, writable); /* view->obj keeps arr alive */
        Py_DECREF(arr);
        return rc;
    }
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
"32 KiB and more (GIL_RELEASE_MIN).");

static PyObject *kvt_py_crc32c(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "crc32c() takes 1 or 2 positional arguments (%zd given)", nargs);
        return NULL;
    }
    return run_crc(kvt_crc32c_active()->fn, args[0], nargs > 1 ? args[1] : NULL);
}

/* The two buffers of a copy: dst writable, both C-contiguous, the same
 * length, not overlapping. 0, or -1 with an exception set (TypeError /
 * BufferError / ValueError naming `fname`) and nothing held. */
static int get_copy_buffers(const char *fname, PyObject *dst_obj, PyObject *src_obj, Py_buffer *dst, Py_buffer *src)
{
    if (get_contig_buffer(dst_obj, dst, 1) < 0)
        return -1;
    if (get_contig_buffer(src_obj, src, 0) < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    uintptr_t da = (uintptr_t)dst->buf, sa = (uintptr_t)src->buf, n = (uintptr_t)src->len;
    if (dst->len != src->len)
        PyErr_Format(PyExc_ValueError, "%s(): dst has %zd bytes, src %zd", fname, dst->len, src->len);
    else if (n && da < sa + n && sa < da + n)
        PyErr_Format(PyExc_ValueError, "%s(): dst and src overlap (dst at src%s%zd, %zd bytes)", fname,
                     da >= sa ? "+" : "-", (Py_ssize_t)(da >= sa ? da - sa : sa - da), src->len);
    else
        return 0;
    PyBuffer_Release(dst);
    PyBuffer_Release(src);
    return -1;
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
    if (nargs < 2 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "crc32c_copy() takes 2 or 3 positional arguments (%zd given)", nargs);
        return NULL;
    }
    uint32_t crc = 0;
    if (nargs > 2 && parse_crc_value(args[2], &crc) < 0)
        return NULL;
    Py_buffer dst, src;
    if (get_copy_buffers("crc32c_copy", args[0], args[1], &dst, &src) < 0)
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

static const kvt_crc32c_backend *lookup_backend(const char *name)
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
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "_crc32c_serial_crc32q() takes 1 or 2 positional arguments (%zd given)", nargs);
        return NULL;
    }
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
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "_crc32c_bytewise() takes 1 or 2 positional arguments (%zd given)", nargs);
        return NULL;
    }
    return run_crc(kvt_crc32c_bytewise, args[0], nargs > 1 ? args[1] : NULL);
}

/* ------------------------------------------------------------------ */
/* Block I/O (fs_io.c)                                                 */
/* ------------------------------------------------------------------ */

/* Arguments gathered with the GIL held; the batch then runs without it. */
typedef struct {
    Py_ssize_t n;
    PyObject **paths_a;   /* bytes objects (os.fsencode), owned */
    PyObject **paths_b;   /* second path list (store: dest), owned, or NULL */
    const char **ca;
    const char **cb;
    Py_buffer *views;     /* n views, `nviews` of them acquired */
    Py_ssize_t nviews;
    void **bufs;
    size_t *lens;
} kvt_batch_args;

static void batch_args_free(kvt_batch_args *a)
{
    for (Py_ssize_t i = 0; i < a->n; i++) {
        if (a->paths_a)
            Py_XDECREF(a->paths_a[i]);
        if (a->paths_b)
            Py_XDECREF(a->paths_b[i]);
    }
    for (Py_ssize_t i = 0; i < a->nviews; i++)
        PyBuffer_Release(&a->views[i]);
    PyMem_Free(a->paths_a);
    PyMem_Free(a->paths_b);
    PyMem_Free((void *)a->ca);
    PyMem_Free((void *)a->cb);
    PyMem_Free(a->views);
    PyMem_Free(a->bufs);
    PyMem_Free(a->lens);
    memset(a, 0, sizeof *a);
}

static int check_list(PyObject *obj, const char *what)
{
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list, not %.200s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* str / bytes / os.PathLike -> owned bytes (os.fsencode); TypeError, or
 * ValueError for an embedded NUL. */
static int convert_paths(PyObject *seq, Py_ssize_t n, PyObject **out, const char **cout, const char *what)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (PyUnicode_CheckExact(item) && PyUnicode_IS_COMPACT_ASCII(item)) {
            /* An ASCII str is its own file-system encoding: its characters,
             * NUL-terminated, held by the (immutable) str itself; no bytes
             * object per path (os.fsencode gives the same bytes). */
            Py_ssize_t len = PyUnicode_GET_LENGTH(item);
            const char *c = (const char *)PyUnicode_DATA(item);
            if ((Py_ssize_t)strlen(c) != len) {
                PyErr_SetString(PyExc_ValueError, "embedded null byte");
                return -1;
            }
            out[i] = Py_NewRef(item);
            cout[i] = c;
            continue;
        }
        if (!PyUnicode_Check(item) && !PyBytes_Check(item) && !PyObject_HasAttrString(item, "__fspath__")) {
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be str, bytes or os.PathLike, not %.200s", what, i,
                         Py_TYPE(item)->tp_name);
            return -1;
        }
        if (!PyUnicode_FSConverter(item, &out[i]))
            return -1;
        cout[i] = PyBytes_AS_STRING(out[i]);
    }
    return 0;
}

/* with_buffers: 0 none, 1 one Py_buffer per block (a list of buffers), 2 one
 * for all (one buffer and offsets). */
static int alloc_args(kvt_batch_args *a, Py_ssize_t n, int two_path_lists, int with_buffers)
{
    memset(a, 0, sizeof *a);
    a->n = n;
    size_t m = n > 0 ? (size_t)n : 1;
    a->paths_a = PyMem_Calloc(m, sizeof(PyObject *));
    a->ca = PyMem_Calloc(m, sizeof(char *));
    if (two_path_lists) {
        a->paths_b = PyMem_Calloc(m, sizeof(PyObject *));
        a->cb = PyMem_Calloc(m, sizeof(char *));
    }
    if (with_buffers) {
        a->views = PyMem_Calloc(with_buffers == 2 ? 1 : m, sizeof(Py_buffer));
        a->bufs = PyMem_Calloc(m, sizeof(void *));
        a->lens = PyMem_Calloc(m, sizeof(size_t));
    }
    if (!a->paths_a || !a->ca || (two_path_lists && (!a->paths_b || !a->cb)) ||
        (with_buffers && (!a->views || !a->bufs || !a->lens))) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int gather_buffers(kvt_batch_args *a, PyObject *seq, int writable)
{
    for (Py_ssize_t i = 0; i < a->n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (get_contig_buffer(item, &a->views[i], writable) < 0) {
            if (writable && PyErr_ExceptionMatches(PyExc_BufferError)) {
                /* read-only exporters raise BufferError: name the index */
                PyObject *t, *v, *tb;
                PyErr_Fetch(&t, &v, &tb);
                PyErr_Format(PyExc_BufferError, "buffers[%zd] must be a writable C-contiguous buffer: %S", i,
                             v ? v : Py_None);
                Py_XDECREF(t);
                Py_XDECREF(v);
                Py_XDECREF(tb);
            }
            return -1;
        }
        a->nviews = i + 1;
        a->bufs[i] = a->views[i].buf;
        a->lens[i] = (size_t)a->views[i].len;
    }
    return 0;
}

/* One buffer and offsets (the `offsets=` / `block_size=` form): block i is
 * buf[offsets[i] : offsets[i] + block_size]. One Py_buffer for the batch, no
 * per-block memoryview. TypeError for a non-list or a non-int offset or
 * block_size, ValueError for a block_size <= 0 or a block outside buf. */
static int gather_at(kvt_batch_args *a, PyObject *buf_obj, PyObject *offsets, PyObject *bs_obj, int writable)
{
    if (bs_obj == NULL || PyBool_Check(bs_obj) || !PyLong_Check(bs_obj)) {
        PyErr_Format(PyExc_TypeError, "block_size must be int with offsets, not %.100s",
                     bs_obj ? Py_TYPE(bs_obj)->tp_name : "missing");
        return -1;
    }
    long long bs = PyLong_AsLongLong(bs_obj);
    if (bs == -1 && PyErr_Occurred())
        return -1;
    if (bs <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be > 0 bytes, got %lld", bs);
        return -1;
    }
    if (check_list(offsets, "offsets") < 0)
        return -1;
    if (PySequence_Fast_GET_SIZE(offsets) != a->n) {
        PyErr_Format(PyExc_ValueError, "paths and offsets must have equal lengths (%zd, %zd)", a->n,
                     PySequence_Fast_GET_SIZE(offsets));
        return -1;
    }
    if (get_contig_buffer(buf_obj, &a->views[0], writable) < 0) {
        if (writable && PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_Format(PyExc_BufferError, "buffers must be a writable C-contiguous buffer: %S", v ? v : Py_None);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
        return -1;
    }
    a->nviews = 1;
    long long limit = (long long)a->views[0].len - bs;
    for (Py_ssize_t i = 0; i < a->n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(offsets, i);
        if (PyBool_Check(o) || !PyLong_Check(o)) {
            PyErr_Format(PyExc_TypeError, "offsets[%zd] must be int, not %.100s", i, Py_TYPE(o)->tp_name);
            return -1;
        }
        int overflow;
        long long off = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (off == -1 && PyErr_Occurred())
            return -1;
        if (overflow || off < 0 || off > limit) {
            PyErr_Format(PyExc_ValueError, "offsets[%zd] = %S: block of %lld bytes is outside the view of %zd bytes",
                         i, o, bs, a->views[0].len);
            return -1;
        }
        a->bufs[i] = (char *)a->views[0].buf + off;
        a->lens[i] = (size_t)bs;
    }
    return 0;
}

/* OSError(errno, strerror, path) (the errno-specific subclass, e.g.
 * FileNotFoundError) with num_succeeded, checksum_failed and num_retried
 * (blocks of the batch re-read after a first checksum mismatch, the failing
 * one included; 0 for stores) set.
 * Built by calling OSError directly, not PyErr_SetFromErrno*: those run
 * PyErr_CheckSignals() when errno is EINTR and could replace the error with
 * KeyboardInterrupt, losing the errno and the attributes. If building or
 * decorating the exception fails, that failure (MemoryError...) is raised. */
static const char *const op_names[KVT_NOPS] = KVT_OP_NAMES;
static const char *const cause_names[] = KVT_CAUSE_NAMES;
static const char *const count_names[KVT_NCOUNTS] = KVT_COUNT_NAMES;

static void raise_batch_error(const kvt_batch_result *res, PyObject *path)
{
    int err = res->err;
    /* a condemned block, or a file of another size kept: the message says why
     * (kvtier/fallback.py _condemned_message) */
    char msg[256];
    switch (res->condemned) {
    case KVT_CAUSE_SIZE:
        snprintf(msg, sizeof msg, "block condemned (size): %llu bytes, expected %llu", res->size_seen,
                 res->size_expected);
        break;
    case KVT_CAUSE_CHECKSUM:
        snprintf(msg, sizeof msg, "block condemned (checksum): CRC32C mismatch (or malformed record) on two reads");
        break;
    case KVT_CAUSE_IDENTITY:
        snprintf(msg, sizeof msg, "block condemned (identity): identity record of another block or layout on "
                                  "two reads");
        break;
    case KVT_CAUSE_SHORT:
        snprintf(msg, sizeof msg, "block condemned (short_read): short read of %llu bytes on two opens",
                 res->size_expected);
        break;
    default:
        if (res->size_kept == KVT_SIZE_KEPT_INTACT)
            snprintf(msg, sizeof msg,
                     "block size mismatch (kept): the file has %llu bytes, the block size asked for is %llu; "
                     "its own CRC record verifies all its bytes (a block of another block size)",
                     res->size_seen, res->size_expected);
        else if (res->size_kept == KVT_SIZE_KEPT_UNSURE)
            snprintf(msg, sizeof msg,
                     "block size mismatch (kept): the file has %llu bytes, the block size asked for is %llu; "
                     "not confirmed (its size changed between opens, or its record could not be read)",
                     res->size_seen, res->size_expected);
        else
            snprintf(msg, sizeof msg, "%s", strerror(err));
    }
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "isO", err, msg, path);
    if (exc == NULL)
        return; /* the constructor's error is set */
    PyObject *ns = PyLong_FromSize_t(res->index);
    PyObject *nr = ns ? PyLong_FromSize_t(res->retried) : NULL;
    PyObject *opn = nr ? PyUnicode_FromString(op_names[res->op >= 0 && res->op < KVT_NOPS ? res->op : 0]) : NULL;
    PyObject *cn = NULL;
    if (opn) {
        if (res->condemned > 0 && res->condemned <= KVT_CAUSE_SHORT)
            cn = PyUnicode_FromString(cause_names[res->condemned]);
        else
            cn = Py_NewRef(Py_None);
    }
    int bad = cn == NULL || PyObject_SetAttrString(exc, "operation", opn) < 0 ||
              PyObject_SetAttrString(exc, "condemned", cn) < 0;
    Py_XDECREF(opn);
    Py_XDECREF(cn);
    if (bad || PyObject_SetAttrString(exc, "num_succeeded", ns) < 0 ||
        PyObject_SetAttrString(exc, "checksum_failed", res->checksum_failed ? Py_True : Py_False) < 0 ||
        PyObject_SetAttrString(exc, "num_retried", nr) < 0) {
        Py_XDECREF(ns);
        Py_XDECREF(nr);
        Py_DECREF(exc);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return; /* keep the new error: never return NULL without one */
    }
    Py_DECREF(ns);
    Py_DECREF(nr);
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
}

PyDoc_STRVAR(batch_lookup_doc,
"batch_lookup($module, paths, block_size=0, /)\n--\n\n"
"For each path (str, bytes or os.PathLike) whether it is a regular file\n"
"(lstat(2): a symlink, directory or FIFO is not) of block_size bytes (any\n"
"size when 0). Returns a list of bool of the same length. The GIL is\n"
"released for the whole batch. Raises TypeError for a non-list or a bad\n"
"path type, ValueError for a negative block_size.");

static PyObject *kvt_py_batch_lookup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 && nargs != 2) {
        PyErr_Format(PyExc_TypeError, "batch_lookup() takes 1 or 2 positional arguments (%zd given)", nargs);
        return NULL;
    }
    unsigned long long block_size = 0;
    if (nargs == 2) {
        if (PyBool_Check(args[1]) || !PyLong_Check(args[1])) {
            PyErr_Format(PyExc_TypeError, "block_size must be int, not %.100s", Py_TYPE(args[1])->tp_name);
            return NULL;
        }
        long long bs = PyLong_AsLongLong(args[1]);
        if (bs == -1 && PyErr_Occurred())
            return NULL;
        if (bs < 0) {
            PyErr_SetString(PyExc_ValueError, "block_size must be >= 0");
            return NULL;
        }
        block_size = (unsigned long long)bs;
    }
    if (check_list(args[0], "paths") < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "paths must be a list");
    if (!seq)
        return NULL;
    kvt_batch_args a;
    PyObject *out = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint8_t *found = NULL;
    if (alloc_args(&a, n, 0, 0) < 0 || convert_paths(seq, n, a.paths_a, a.ca, "paths") < 0)
        goto done;
    found = PyMem_Calloc(n > 0 ? (size_t)n : 1, 1);
    if (!found) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    kvt_batch_lookup(a.ca, (size_t)n, (uint64_t)block_size, found);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (!out)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(out, i, PyBool_FromLong(found[i]));
done:
    PyMem_Free(found);
    batch_args_free(&a);
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(batch_store_block_doc,
"batch_store_block($module, tmp_paths, dest_paths, buffers, /, use_o_direct=True,\n"
"                  checksum=False, durable=False, *, job_state=None, counts=None,\n"
"                  offsets=None, block_size=None)\n--\n\n"
"Store each buffers[i] (C-contiguous, its whole length in bytes) as the file\n"
"dest_paths[i] through the temp tmp_paths[i]: skip if dest exists; create\n"
"the temp with O_CREAT|O_EXCL (missing parents are created), write it (with\n"
"O_DIRECT when use_o_direct and the buffer address and length meet the\n"
"filesystem's alignment, else buffered), with checksum set xattr\n"
"user.vllm.kv_crc32c = CRC32C (RFC 3720) as 4 bytes big-endian and the\n"
"identity record user.kvtier.id (identity + the same CRC) on the open temp,\n"
"close, rename onto dest. The GIL is released for the whole batch.\n"
"With durable, fdatasync the temp before the rename and fsync the parent\n"
"directory after it (survives power loss; costs a device flush per block).\n"
"With offsets (a list of int) and block_size (int > 0), buffers is one\n"
"buffer and block i is buffers[offsets[i] : offsets[i] + block_size] (no\n"
"per-block buffer object; ValueError for a block outside it).\n\n"
"Raises TypeError (non-list, bad path or buffer type), ValueError (unequal\n"
"lengths, NUL in a path), BufferError (non-contiguous buffer) before any\n"
"I/O. The batch stops at the first failing block: OSError with its errno,\n"
"filename = its dest path, num_succeeded = its index, checksum_failed =\n"
"False, num_retried = 0; its temp is removed, earlier blocks stay stored.\n\n"
"job_state: None, or the job's state word (see job_state_cas): a block\n"
"begins only while it is JOB_LIVE and is renamed in a commit section (LIVE\n"
"-> COMMITTING -> LIVE); a job no longer LIVE stops the batch with\n"
"OSError(ETIMEDOUT), its temp removed, nothing published after that.");

PyDoc_STRVAR(batch_load_block_doc,
"batch_load_block($module, source_paths, buffers, /, use_o_direct=True,\n"
"                 checksum=False, *, job_state=None, counts=None, offsets=None,\n"
"                 block_size=None)\n--\n\n"
"Load each file source_paths[i] into buffers[i] (writable, C-contiguous; its\n"
"length in bytes is the block size). O_DIRECT when use_o_direct and the\n"
"buffer address and length meet the filesystem's alignment, else buffered.\n"
"With checksum, verify the CRC32C (RFC 3720) read through the same fd: the\n"
"one the identity record user.kvtier.id carries (12 bytes: identity, CRC),\n"
"else xattr user.vllm.kv_crc32c (4 bytes big-endian); a block without\n"
"either (ENODATA, legacy) is accepted. The GIL is released for the whole batch.\n"
"With offsets (a list of int) and block_size (int > 0), buffers is one\n"
"writable buffer and block i is buffers[offsets[i] : offsets[i] +\n"
"block_size] (as batch_store_block).\n\n"
"A first checksum mismatch is retried once (page cache dropped, record and\n"
"data re-read); returns the number of blocks so retried that then\n"
"verified (int). A second mismatch condemns the block.\n\n"
"Raises TypeError / ValueError / BufferError (read-only or non-contiguous\n"
"buffer) before any I/O. The batch stops at the first failing block:\n"
"OSError with filename = its path, num_succeeded = its index,\n"
"num_retried = blocks of this batch re-read after a first mismatch (int;\n"
"the failing block included, e.g. 1 for a block condemned on its re-read),\n"
"and\n"
"  errno EBADMSG, checksum_failed=True: CRC mismatch or record length != 4\n"
"    (file removed);\n"
"  errno EIO: file size != buffer length (file removed);\n"
"  any other errno (ENOENT, ELOOP, EACCES, EIO, EOPNOTSUPP from getxattr,\n"
"    EBADMSG from the filesystem ...): checksum_failed=False, file kept.\n"
"The failing block's buffer: after a CRC mismatch of its data, the bytes\n"
"its re-read got (the file's, corrupt: the copy + CRC writes the buffer\n"
"before the CRC is known); refused on its records (identity, malformed\n"
"record), untouched; after other errors, possibly part of what was read.\n"
"The same with or without job_state (the fallback's too).\n\n"
"job_state: None, or the job's state word (see job_state_cas): the bytes\n"
"are read into a private per-thread buffer and copied into buffers[i]\n"
"(with the fused copy + CRC where available) only in commit sections\n"
"(JOB_LIVE -> JOB_COMMITTING -> JOB_LIVE, per piece), and each block whole\n"
"and verified is counted in the word (blocks << 2 | phase). A job no longer\n"
"LIVE at a commit point stops the batch with OSError(ETIMEDOUT),\n"
"num_succeeded = the blocks counted; no byte is written into a buffer after\n"
"that.");

PyDoc_STRVAR(checksum_stats_doc,
"checksum_stats($module, /)\n--\n\n"
"Process-wide counters of batch_load_block since import, as a dict:\n"
"checksum_retries (first mismatches, re-read once) and checksum_condemned\n"
"(mismatched again: EBADMSG, file removed). A diagnostic summed over every\n"
"caller; per-call counts are batch_load_block's return value and the\n"
"OSError's num_retried / checksum_failed.");

PyDoc_STRVAR(policy_info_doc,
"policy_info($module, /)\n--\n\n"
"The error policy's vocabulary and process-wide totals, as a dict:\n"
"counts (tuple of counter names, the keys a batch call's counts= dict\n"
"gets), operations (names an OSError's `operation` takes), causes (names\n"
"of `condemned`), totals (dict name -> int since import, every caller),\n"
"retry_eintr_max (EINTR retries in a row per call), retry_transient\n"
"(EAGAIN/ESTALE retries per block), backoff_us (first\n"
"backoff, doubled each retry), id_xattr (the identity xattr name).");

static PyObject *kvt_py_policy_info(PyObject *mod, PyObject *unused)
{
    kvt_counts t;
    kvt_policy_totals(&t);
    PyObject *names = PyTuple_New(KVT_NCOUNTS), *ops = PyTuple_New(KVT_NOPS - 1),
             *causes = PyTuple_New(KVT_CAUSE_SHORT), *totals = PyDict_New(), *out = NULL;
    if (!names || !ops || !causes || !totals)
        goto done;
    for (int i = 0; i < KVT_NCOUNTS; i++) {
        PyObject *k = PyUnicode_FromString(count_names[i]);
        if (!k)
            goto done;
        PyTuple_SET_ITEM(names, i, k);
        PyObject *v = PyLong_FromUnsignedLongLong(t.v[i]);
        if (!v || PyDict_SetItem(totals, k, v) < 0) {
            Py_XDECREF(v);
            goto done;
        }
        Py_DECREF(v);
    }
    for (int i = 1; i < KVT_NOPS; i++) {
        PyObject *k = PyUnicode_FromString(op_names[i]);
        if (!k)
            goto done;
        PyTuple_SET_ITEM(ops, i - 1, k);
    }
    for (int i = 1; i <= KVT_CAUSE_SHORT; i++) {
        PyObject *k = PyUnicode_FromString(cause_names[i]);
        if (!k)
            goto done;
        PyTuple_SET_ITEM(causes, i - 1, k);
    }
    out = Py_BuildValue("{sOsOsOsOsisisIss}", "counts", names, "operations", ops, "causes", causes, "totals", totals,
                        "retry_eintr_max", KVT_RETRY_EINTR_MAX, "retry_transient", KVT_RETRY_TRANSIENT, "backoff_us", (unsigned)KVT_RETRY_BACKOFF_US,
                        "id_xattr", KVT_ID_XATTR_NAME);
done:
    Py_XDECREF(names);
    Py_XDECREF(ops);
    Py_XDECREF(causes);
    Py_XDECREF(totals);
    return out;
}

static PyObject *kvt_py_checksum_stats(PyObject *mod, PyObject *unused)
{
    uint64_t r, c;
    kvt_checksum_stats(&r, &c);
    return Py_BuildValue("{sKsK}", "checksum_retries", (unsigned long long)r, "checksum_condemned",
                         (unsigned long long)c);
}

PyDoc_STRVAR(io_engine_status_doc,
"io_engine_status($module, /)\n--\n\n"
"The block I/O engine, as a dict: engine (str: 'io_uring' or 'plain', what\n"
"O_DIRECT blocks use), liburing (bool: built with liburing), setting (str:\n"
"KVTIER_IO_URING as read: 'unset', '0' or '1'), setup_errno (int: why the\n"
"kernel refused a ring, e.g. ENOSYS under seccomp or EPERM with\n"
"kernel.io_uring_disabled; 0 if it did not), uring_ops (int: reads/writes\n"
"completed through io_uring), plain_blocks (int: O_DIRECT blocks that took\n"
"plain pread/pwrite because no ring was available). Counters since import.");

static PyObject *kvt_py_io_engine_status(PyObject *mod, PyObject *unused)
{
    kvt_uring_stats st;
    kvt_uring_info(&st);
    return Py_BuildValue("{sssOsssisKsK}", "engine", st.active ? "io_uring" : "plain", "liburing",
                         st.built ? Py_True : Py_False, "setting",
                         st.setting < 0 ? "unset" : (st.setting ? "1" : "0"), "setup_errno", st.setup_errno,
                         "uring_ops", (unsigned long long)st.ops, "plain_blocks", (unsigned long long)st.plain);
}

PyDoc_STRVAR(crc_copy_status_doc,
"crc_copy_status($module, /)\n--\n\n"
"The fused copy + CRC that moves the C core's checksummed loads from private\n"
"memory into the caller's buffer (copy with non-temporal stores while the\n"
"CRC32C is folded in, one pass; csrc/crc32c/copy.c), as a dict: kernel (str:\n"
"'avx512-vpclmulqdq', 'pclmulqdq' or 'generic', the best this CPU runs),\n"
"enabled (bool: the path is used: KVTIER_CRC_COPY is not 0/false/no/off, the\n"
"kernel is not 'generic', and the active CRC32C backend is the best CPU\n"
"backend, i.e. not forced to another one or to DSA; otherwise each piece is\n"
"checksummed by the active backend, then copied), blocks (int: loads that\n"
"went through it), bytes (int: bytes it copied and checksummed). Counters\n"
"are since import.");

static PyObject *kvt_py_crc_copy_status(PyObject *mod, PyObject *unused)
{
    kvt_crc_copy_stats st;
    kvt_crc_copy_info(&st);
    return Py_BuildValue("{sssOsKsK}", "kernel", st.kernel, "enabled", st.enabled ? Py_True : Py_False, "blocks",
                         (unsigned long long)st.blocks, "bytes", (unsigned long long)st.bytes);
}

/* ------------------------------------------------------------------ */
/* Job state (job_state.h)                                             */
/* ------------------------------------------------------------------ */

/* The state word of `obj` (a writable buffer of >= 4 bytes whose address is
 * 4-byte aligned: bytearray(8), numpy int32[2] ...), kept acquired in *view.
 * TypeError / BufferError / ValueError naming `what`. */
static kvt_job_state *get_job_state(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_Format(PyErr_GivenExceptionMatches(t, PyExc_BufferError) ? PyExc_BufferError : PyExc_TypeError,
                         "%s must be a writable buffer of >= 4 bytes (e.g. bytearray(8)), not %.200s: %S", what,
                         Py_TYPE(obj)->tp_name, v ? v : Py_None);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
        return NULL;
    }
    if (view->len < 4 || ((uintptr_t)view->buf & 3u) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 4 bytes at a 4-byte aligned address (%zd bytes at %p)", what,
                     view->len, view->buf);
        PyBuffer_Release(view);
        return NULL;
    }
    return (kvt_job_state *)view->buf;
}

PyDoc_STRVAR(job_state_cas_doc,
"job_state_cas($module, buf, old, new, /)\n--\n\n"
"Atomically (C11, sequentially consistent) replace the 32-bit job state word\n"
"at the start of `buf` (a writable buffer of >= 4 bytes, 4-byte aligned, e.g.\n"
"bytearray(8)) by `new` if it holds `old`. Returns True if it did, False if\n"
"it held another value. The word is blocks << 2 | phase; phases: JOB_LIVE,\n"
"JOB_COMMITTING, JOB_EXPIRED, JOB_DONE (module constants); the load/store\n"
"commit sections of batch_load_block / batch_store_block(job_state=buf) take\n"
"LIVE -> COMMITTING -> LIVE, a load counts each block whole and verified\n"
"(LIVE -> LIVE, blocks + 1), every change keeps the count (csrc/job_state.h).\n"
"ValueError for a value outside 0..2**32-1.");

static PyObject *kvt_py_job_state_cas(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "job_state_cas() takes 3 positional arguments (%zd given)", nargs);
        return NULL;
    }
    uint32_t v[2];
    for (int i = 0; i < 2; i++) {
        unsigned long long x = PyLong_AsUnsignedLongLong(args[1 + i]);
        if (x == (unsigned long long)-1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                x = 1ull << 32;
            } else
                return NULL;
        }
        if (x > 0xffffffffull) {
            PyErr_Format(PyExc_ValueError, "job_state_cas(): %s must be in 0..2**32-1", i ? "new" : "old");
            return NULL;
        }
        v[i] = (uint32_t)x;
    }
    Py_buffer view;
    kvt_job_state *js = get_job_state(args[0], &view, "buf");
    if (js == NULL)
        return NULL;
    int ok = kvt_job_cas(js, v[0], v[1]);
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* durable == NULL: the call has no `durable` flag (loads). */
/* `checksum`: a bool, or "strict" (KVT_CHECK_STRICT). */
static int parse_checksum(PyObject *o, int *checksum)
{
    if (PyUnicode_Check(o)) {
        if (PyUnicode_CompareWithASCIIString(o, "strict") == 0) {
            *checksum = KVT_CHECK_STRICT;
            return 0;
        }
        PyErr_Format(PyExc_ValueError, "checksum must be True, False or 'strict', not %R", o);
        return -1;
    }
    int t = PyObject_IsTrue(o);
    if (t < 0)
        return -1;
    *checksum = t ? KVT_CHECK_ON : KVT_CHECK_OFF;
    return 0;
}

/* Add this batch's nonzero policy counters into the dict `counts` (None:
 * nothing). Returns 0 or -1 with an exception set. */
static int add_counts(PyObject *counts, const kvt_counts *c)
{
    if (counts == NULL || counts == Py_None)
        return 0;
    for (int i = 0; i < KVT_NCOUNTS; i++) {
        if (!c->v[i])
            continue;
        PyObject *key = PyUnicode_FromString(count_names[i]);
        if (!key)
            return -1;
        PyObject *old = PyDict_GetItemWithError(counts, key);
        if (!old && PyErr_Occurred()) {
            Py_DECREF(key);
            return -1;
        }
        unsigned long long base = old ? PyLong_AsUnsignedLongLong(old) : 0;
        if (base == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(key);
            return -1;
        }
        PyObject *v = PyLong_FromUnsignedLongLong(base + c->v[i]);
        int r = v ? PyDict_SetItem(counts, key, v) : -1;
        Py_XDECREF(v);
        Py_DECREF(key);
        if (r < 0)
            return -1;
    }
    return 0;
}

static int parse_io_flags(PyObject *kwnames, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t npos,
                          const char *fname, int *use_o_direct, int *checksum, int *durable, PyObject **job_state,
                          PyObject **counts, PyObject **offsets, PyObject **block_size)
{
    *job_state = NULL;
    *counts = NULL;
    *offsets = NULL;
    *block_size = NULL;
    *use_o_direct = 1;
    *checksum = 0;
    if (durable)
        *durable = 0;
    Py_ssize_t nflags = durable ? 3 : 2;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs < npos || nargs > npos + nflags) {
        PyErr_Format(PyExc_TypeError, "%s() takes from %zd to %zd positional arguments (%zd given)", fname, npos,
                     npos + nflags, nargs);
        return -1;
    }
    PyObject *flag_obj[3] = {NULL, NULL, NULL};
    for (Py_ssize_t i = npos; i < nargs; i++)
        flag_obj[i - npos] = args[i];
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int idx;
        if (PyUnicode_CompareWithASCIIString(name, "use_o_direct") == 0)
            idx = 0;
        else if (PyUnicode_CompareWithASCIIString(name, "checksum") == 0)
            idx = 1;
        else if (durable && PyUnicode_CompareWithASCIIString(name, "durable") == 0)
            idx = 2;
        else if (PyUnicode_CompareWithASCIIString(name, "job_state") == 0) {
            *job_state = args[nargs + k] == Py_None ? NULL : args[nargs + k];
            continue;
        } else if (PyUnicode_CompareWithASCIIString(name, "offsets") == 0) {
            *offsets = args[nargs + k] == Py_None ? NULL : args[nargs + k];
            continue;
        } else if (PyUnicode_CompareWithASCIIString(name, "block_size") == 0) {
            *block_size = args[nargs + k] == Py_None ? NULL : args[nargs + k];
            continue;
        } else if (PyUnicode_CompareWithASCIIString(name, "counts") == 0) {
            PyObject *c = args[nargs + k];
            if (c != Py_None && !PyDict_Check(c)) {
                PyErr_Format(PyExc_TypeError, "%s(): counts must be a dict or None, not %.100s", fname,
                             Py_TYPE(c)->tp_name);
                return -1;
            }
            *counts = c;
            continue;
        } else {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fname, name);
            return -1;
        }
        if (flag_obj[idx] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument %R", fname, name);
            return -1;
        }
        flag_obj[idx] = args[nargs + k];
    }
    if (flag_obj[0] && (*use_o_direct = PyObject_IsTrue(flag_obj[0])) < 0)
        return -1;
    if (flag_obj[1] && parse_checksum(flag_obj[1], checksum) < 0)
        return -1;
    if (flag_obj[2] && (*durable = PyObject_IsTrue(flag_obj[2])) < 0)
        return -1;
    return 0;
}

static PyObject *kvt_py_batch_store_block(PyObject *mod, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames)
{
    int use_o_direct, checksum, durable;
    PyObject *js_obj, *counts, *offsets, *bs_obj;
    if (parse_io_flags(kwnames, args, nargs, 3, "batch_store_block", &use_o_direct, &checksum, &durable, &js_obj,
                       &counts, &offsets, &bs_obj) < 0)
        return NULL;
    if (check_list(args[0], "tmp_paths") < 0 || check_list(args[1], "dest_paths") < 0 ||
        (offsets ? check_list(offsets, "offsets") : check_list(args[2], "buffers")) < 0)
        return NULL;
    Py_ssize_t n = PySequence_Size(args[0]);
    if (offsets && PySequence_Size(args[1]) != n) {
        PyErr_Format(PyExc_ValueError, "tmp_paths, dest_paths must have equal lengths (%zd, %zd)", n,
                     PySequence_Size(args[1]));
        return NULL;
    }
    if (!offsets && (PySequence_Size(args[1]) != n || PySequence_Size(args[2]) != n)) {
        PyErr_Format(PyExc_ValueError, "tmp_paths, dest_paths and buffers must have equal lengths (%zd, %zd, %zd)",
                     n, PySequence_Size(args[1]), PySequence_Size(args[2]));
        return NULL;
    }
    /* Own references to the lists' items: the lists themselves may change
     * in another thread while the GIL is released. */
    PyObject *s0 = PySequence_Fast(args[0], ""), *s1 = PySequence_Fast(args[1], ""),
             *s2 = PySequence_Fast(offsets ? offsets : args[2], "");
    PyObject *ret = NULL;
    kvt_batch_args a;
    memset(&a, 0, sizeof a);
    Py_buffer js_view;
    kvt_job_state *js = NULL;
    if (!s0 || !s1 || !s2)
        goto done;
    if (js_obj && (js = get_job_state(js_obj, &js_view, "job_state")) == NULL)
        goto done;
    if (alloc_args(&a, n, 1, offsets ? 2 : 1) < 0 || convert_paths(s0, n, a.paths_a, a.ca, "tmp_paths") < 0 ||
        convert_paths(s1, n, a.paths_b, a.cb, "dest_paths") < 0 ||
        (offsets ? gather_at(&a, args[2], s2, bs_obj, 0) : gather_buffers(&a, s2, 0)) < 0)
        goto done;
    kvt_batch_result res;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvt_batch_store(a.ca, a.cb, (const void *const *)a.bufs, a.lens, (size_t)n, use_o_direct,
                         checksum, durable, js, &res);
    Py_END_ALLOW_THREADS
    if (add_counts(counts, &res.counts) < 0)
        goto done;
    if (rc != 0) {
        /* index n: the last block was published as its job expired (its path) */
        size_t at = res.index < (size_t)n ? res.index : (size_t)n - 1;
        raise_batch_error(&res, PySequence_Fast_GET_ITEM(s1, (Py_ssize_t)at));
        goto done;
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    if (js)
        PyBuffer_Release(&js_view);
    batch_args_free(&a);
    Py_XDECREF(s0);
    Py_XDECREF(s1);
    Py_XDECREF(s2);
    return ret;
}

static PyObject *kvt_py_batch_load_block(PyObject *mod, PyObject *const *args, Py_ssize_t nargs,
                                         PyObject *kwnames)
{
    int use_o_direct, checksum;
    PyObject *js_obj, *counts, *offsets, *bs_obj;
    if (parse_io_flags(kwnames, args, nargs, 2, "batch_load_block", &use_o_direct, &checksum, NULL, &js_obj,
                       &counts, &offsets, &bs_obj) < 0)
        return NULL;
    if (check_list(args[0], "source_paths") < 0 ||
        (offsets ? check_list(offsets, "offsets") : check_list(args[1], "buffers")) < 0)
        return NULL;
    Py_ssize_t n = PySequence_Size(args[0]);
    if (!offsets && PySequence_Size(args[1]) != n) {
        PyErr_Format(PyExc_ValueError, "source_paths and buffers must have equal lengths (%zd, %zd)", n,
                     PySequence_Size(args[1]));
        return NULL;
    }
    PyObject *s0 = PySequence_Fast(args[0], ""), *s1 = PySequence_Fast(offsets ? offsets : args[1], "");
    PyObject *ret = NULL;
    kvt_batch_args a;
    memset(&a, 0, sizeof a);
    Py_buffer js_view;
    kvt_job_state *js = NULL;
    if (!s0 || !s1)
        goto done;
    if (js_obj && (js = get_job_state(js_obj, &js_view, "job_state")) == NULL)
        goto done;
    if (alloc_args(&a, n, 0, offsets ? 2 : 1) < 0 || convert_paths(s0, n, a.paths_a, a.ca, "source_paths") < 0 ||
        (offsets ? gather_at(&a, args[1], s1, bs_obj, 1) : gather_buffers(&a, s1, 1)) < 0)
        goto done;
    kvt_batch_result res;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvt_batch_load(a.ca, a.bufs, a.lens, (size_t)n, use_o_direct, checksum, js, &res);
    Py_END_ALLOW_THREADS
    if (add_counts(counts, &res.counts) < 0)
        goto done;
    if (rc != 0) {
        raise_batch_error(&res, PySequence_Fast_GET_ITEM(s0, (Py_ssize_t)res.index));
        goto done;
    }
    ret = PyLong_FromSize_t(res.retried);
done:
    if (js)
        PyBuffer_Release(&js_view);
    batch_args_free(&a);
    Py_XDECREF(s0);
    Py_XDECREF(s1);
    return ret;
}

/* ------------------------------------------------------------------ */
/* DSA (dsa/)                                                          */
/* ------------------------------------------------------------------ */

static int dsa_which(const char *name)
{
    if (strcmp(name, "dsa") == 0)
        return KVT_DSA_DEVICE;
    if (strcmp(name, "dsa-model") == 0)
        return KVT_DSA_MODEL;
    PyErr_Format(PyExc_ValueError, "DSA backend must be 'dsa' or 'dsa-model', not '%s'", name);
    return -1;
}

/* A backend argument: str "dsa" or "dsa-model"; TypeError / ValueError. */
static int parse_which_arg(PyObject *arg)
{
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "backend must be str");
        return -1;
    }
    const char *name = PyUnicode_AsUTF8(arg);
    return name ? dsa_which(name) : -1;
}

static int dict_set(PyObject *d, const char *k, PyObject *v)
{
    if (!v)
        return -1;
    int r = PyDict_SetItemString(d, k, v);
    Py_DECREF(v);
    return r;
}

static PyObject *wq_dict(const kvt_dsa_wq_info *w)
{
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    if (dict_set(d, "name", PyUnicode_FromString(w->name)) < 0 ||
        dict_set(d, "device", PyUnicode_FromString(w->device)) < 0 ||
        dict_set(d, "path", PyUnicode_DecodeFSDefault(w->path)) < 0 ||
        dict_set(d, "state", PyUnicode_FromString(w->state)) < 0 ||
        dict_set(d, "type", PyUnicode_FromString(w->type)) < 0 ||
        dict_set(d, "mode", PyUnicode_FromString(w->mode)) < 0 ||
        dict_set(d, "size", PyLong_FromUnsignedLong(w->size)) < 0 ||
        dict_set(d, "max_transfer_size", PyLong_FromUnsignedLongLong(w->max_transfer_size)) < 0 ||
        dict_set(d, "block_on_fault", PyBool_FromLong(w->block_on_fault)) < 0 ||
        dict_set(d, "gen_cap", PyLong_FromUnsignedLongLong(w->gen_cap)) < 0 ||
        dict_set(d, "usable", PyBool_FromLong(w->usable)) < 0 ||
        dict_set(d, "reason", PyUnicode_FromString(w->reason)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

PyDoc_STRVAR(dsa_discover_doc,
"dsa_discover($module, /, sysfs_root=None, dev_root=None, wq=None)\n--\n\n"
"Scan <sysfs_root>/bus/dsa/devices for Intel DSA work queues (WQs).\n\n"
"sysfs_root: default env KVTIER_DSA_SYSFS or '/sys'; dev_root: default env\n"
"KVTIER_DSA_DEV or '/dev' (device nodes <dev_root>/dsa/wqN.M); wq: only this\n"
"WQ name (default env KVTIER_DSA_WQ). Returns a dict: devices_dir (str),\n"
"devices_dir_present (bool), wqs (list of dicts: name, device, path, state,\n"
"type, mode, size, max_transfer_size (bytes), block_on_fault, gen_cap,\n"
"usable, reason), chosen (name of the preferred usable WQ or None).");

static PyObject *kvt_py_dsa_discover(PyObject *mod, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"sysfs_root", "dev_root", "wq", NULL};
    const char *sys = NULL, *dev = NULL, *want = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|zzz:dsa_discover", kwlist, &sys, &dev, &want))
        return NULL;
    kvt_dsa_discovery *d = PyMem_Malloc(sizeof *d);
    if (!d)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    kvt_dsa_discover(sys, dev, want, d);
    Py_END_ALLOW_THREADS
    PyObject *res = PyDict_New(), *lst = PyList_New(0);
    if (!res || !lst)
        goto fail;
    for (size_t i = 0; i < d->n; i++) {
        PyObject *w = wq_dict(&d->wqs[i]);
        if (!w || PyList_Append(lst, w) < 0) {
            Py_XDECREF(w);
            goto fail;
        }
        Py_DECREF(w);
    }
    if (dict_set(res, "devices_dir", PyUnicode_DecodeFSDefault(d->devices_dir)) < 0 ||
        dict_set(res, "devices_dir_present", PyBool_FromLong(d->devices_dir_present)) < 0)
        goto fail;
    if (PyDict_SetItemString(res, "wqs", lst) < 0)
        goto fail;
    Py_CLEAR(lst);
    if (d->chosen >= 0) {
        if (dict_set(res, "chosen", PyUnicode_FromString(d->wqs[d->chosen].name)) < 0)
            goto fail;
    } else if (PyDict_SetItemString(res, "chosen", Py_None) < 0) {
        goto fail;
    }
    PyMem_Free(d);
    return res;
fail:
    PyMem_Free(d);
    Py_XDECREF(res);
    Py_XDECREF(lst);
    return NULL;
}

PyDoc_STRVAR(dsa_enable_doc,
"dsa_enable($module, /, sysfs_root=None, dev_root=None, wq=None)\n--\n\n"
"Try to enable the real Intel DSA device for the 'dsa' backend: discovery\n"
"(see dsa_discover), open the WQ, 1 MiB self-check of CRCGEN and COPY_CRC\n"
"that must complete on the device and match the CPU. Returns True when\n"
"enabled; the reason either way is in dsa_status('dsa')['reason'].");

static PyObject *kvt_py_dsa_enable(PyObject *mod, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"sysfs_root", "dev_root", "wq", NULL};
    const char *sys = NULL, *dev = NULL, *want = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|zzz:dsa_enable", kwlist, &sys, &dev, &want))
        return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = kvt_dsa_enable_device(sys, dev, want);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

PyDoc_STRVAR(dsa_model_enable_doc,
"dsa_model_enable($module, /, *, shared=False, size=32, max_transfer_size=2097152,\n"
"                 block_on_fault=False, gen_cap=5, latency_ns=0, reject_status=0)\n--\n\n"
"Enable the software model of a DSA WQ for the 'dsa-model' backend (never\n"
"reported as 'dsa'). shared: shared WQ (ENQCMD) instead of dedicated\n"
"(MOVDIR64B); size: WQ slots (>= 1); max_transfer_size: bytes (1..2**32-1);\n"
"gen_cap: device GENCAP (bit 0x4 = cache control, 0x1 = block on fault);\n"
"latency_ns: extra per-descriptor delay; reject_status: if nonzero the model\n"
"completes every descriptor with this DSA_COMP_* status (linux/idxd.h).\n"
"Runs the 1 MiB self-check; returns True when it passed. Replaces any model\n"
"enabled before. ValueError for out-of-range arguments.");

static PyObject *kvt_py_dsa_model_enable(PyObject *mod, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"shared", "size", "max_transfer_size", "block_on_fault",
                             "gen_cap", "latency_ns", "reject_status", NULL};
    int shared = 0, bof = 0, reject = 0;
    unsigned long size = 32, latency = 0;
    unsigned long long maxx = 2u << 20, gen_cap = KVT_DSA_GENCAP_CACHE_CONTROL | KVT_DSA_GENCAP_BLOCK_ON_FAULT;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$pkKpKki:dsa_model_enable", kwlist, &shared, &size,
                                     &maxx, &bof, &gen_cap, &latency, &reject))
        return NULL;
    if (size == 0 || size > 4096) {
        PyErr_SetString(PyExc_ValueError, "size must be in 1..4096");
        return NULL;
    }
    if (maxx == 0 || maxx > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "max_transfer_size must be in 1..2**32-1 bytes");
        return NULL;
    }
    if (reject < 0 || reject > 0x7f || reject == DSA_COMP_SUCCESS) {
        PyErr_SetString(PyExc_ValueError, "reject_status must be 0 or a DSA_COMP_* error status (2..0x7f)");
        return NULL;
    }
    if (latency > 1000000000ul) {
        PyErr_SetString(PyExc_ValueError, "latency_ns must be <= 1e9");
        return NULL;
    }
    kvt_dsa_model_config cfg = {.shared = shared, .size = (unsigned)size, .max_transfer_size = maxx,
                                .block_on_fault = bof, .gen_cap = gen_cap, .latency_ns = (unsigned)latency};
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = kvt_dsa_enable_model(&cfg, reject);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

PyDoc_STRVAR(dsa_disable_doc,
"dsa_disable($module, backend, /)\n--\n\n"
"Disable and release the 'dsa' or 'dsa-model' engine (waits for users).\n"
"If it was the active CRC32C backend, crc32c() then computes on the CPU.");

static PyObject *kvt_py_dsa_disable(PyObject *mod, PyObject *arg)
{
    int w = parse_which_arg(arg);
    if (w < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    kvt_dsa_disable(w);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *counters_dict(const kvt_dsa_counters *c)
{
    PyObject *d = PyDict_New(), *by = PyDict_New();
    if (!d || !by)
        goto fail;
#define CNT(f) if (dict_set(d, #f, PyLong_FromUnsignedLongLong(c->f)) < 0) goto fail
    CNT(descriptors_submitted);
    CNT(completed_on_device);
    CNT(page_fault_resumes);
    CNT(enqcmd_retries);
    CNT(wait_ns);
    CNT(bytes_on_device);
    CNT(below_min_size);
    CNT(submit_failures);
    CNT(cpu_redo_total);
    CNT(timeouts);
    CNT(commit_ops);
    CNT(commit_bytes_on_device);
    CNT(commit_bytes_cpu);
#undef CNT
    for (int s = 0; s < 128; s++) {
        if (!c->cpu_redo_by_status[s])
            continue;
        char buf[32];
        const char *n = kvt_dsa_status_name(s);
        if (!n) {
            snprintf(buf, sizeof buf, "status_0x%02x", s);
            n = buf;
        }
        if (dict_set(by, n, PyLong_FromUnsignedLongLong(c->cpu_redo_by_status[s])) < 0)
            goto fail;
    }
    if (PyDict_SetItemString(d, "cpu_redo_by_status", by) < 0)
        goto fail;
    Py_DECREF(by);
    return d;
fail:
    Py_XDECREF(d);
    Py_XDECREF(by);
    return NULL;
}

PyDoc_STRVAR(dsa_status_doc,
"dsa_status($module, backend, /)\n--\n\n"
"State of the 'dsa' or 'dsa-model' engine as a dict: backend, tried (an\n"
"enable was attempted), enabled, reason (outcome of the last enable, str),\n"
"and when an engine exists: wq (dict as in dsa_discover), portal\n"
"('movdir64b', 'enqcmd', 'write' or 'model'), min_size (bytes), wait,\n"
"timeout (seconds per descriptor), selfcheck (dict), counters (dict as\n"
"dsa_counters), engine_reason (str). After a descriptor timed out,\n"
"enabled is False and reason starts '<backend> disabled: device stopped\n"
"completing descriptors'.");

static PyObject *kvt_py_dsa_status(PyObject *mod, PyObject *arg)
{
    int w = parse_which_arg(arg);
    if (w < 0)
        return NULL;
    char reason[1200];
    kvt_dsa_global_reason(w, reason, sizeof reason);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    if (dict_set(d, "backend", PyUnicode_FromString(w == KVT_DSA_MODEL ? "dsa-model" : "dsa")) < 0 ||
        dict_set(d, "tried", PyBool_FromLong(kvt_dsa_global_tried(w))) < 0 ||
        dict_set(d, "reason", PyUnicode_FromString(reason)) < 0)
        goto fail;
    kvt_dsa_engine *e = kvt_dsa_acquire(w);
    if (!e)
        return dict_set(d, "enabled", PyBool_FromLong(0)) < 0 ? (Py_DECREF(d), NULL) : d;
    kvt_dsa_wq_info wq;
    kvt_dsa_selfcheck sc;
    kvt_dsa_counters c;
    kvt_dsa_engine_wq(e, &wq);
    kvt_dsa_engine_get_selfcheck(e, &sc);
    kvt_dsa_engine_get_counters(e, &c);
    int enabled = kvt_dsa_engine_enabled(e);
    const char *portal = kvt_dsa_engine_portal_kind(e);
    size_t min_size = kvt_dsa_engine_min_size(e);
    const char *wait = kvt_dsa_wait_name(kvt_dsa_engine_wait_mode(e));
    double timeout_s = (double)kvt_dsa_engine_timeout(e) / 1e9;
    char ereason[400];
    snprintf(ereason, sizeof ereason, "%s", kvt_dsa_engine_reason(e));
    kvt_dsa_release(e);
    PyObject *scd = Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:i,s:i}",
        "ran", sc.ran ? Py_True : Py_False,
        "crcgen_on_device", sc.crcgen_on_device ? Py_True : Py_False,
        "crcgen_match", sc.crcgen_match ? Py_True : Py_False,
        "copy_on_device", sc.copy_on_device ? Py_True : Py_False,
        "copy_match", sc.copy_match ? Py_True : Py_False,
        "crcgen_status", sc.crcgen_status, "copy_status", sc.copy_status);
    if (dict_set(d, "enabled", PyBool_FromLong(enabled)) < 0 ||
        dict_set(d, "engine_reason", PyUnicode_FromString(ereason)) < 0 ||
        dict_set(d, "wq", wq_dict(&wq)) < 0 ||
        dict_set(d, "portal", PyUnicode_FromString(portal)) < 0 ||
        dict_set(d, "min_size", PyLong_FromSize_t(min_size)) < 0 ||
        dict_set(d, "wait", PyUnicode_FromString(wait)) < 0 ||
        dict_set(d, "timeout", PyFloat_FromDouble(timeout_s)) < 0 ||
        dict_set(d, "selfcheck", scd) < 0 ||
        dict_set(d, "counters", counters_dict(&c)) < 0)
        goto fail;
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

PyDoc_STRVAR(dsa_counters_doc,
"dsa_counters($module, backend, /)\n--\n\n"
"Counters of the 'dsa' or 'dsa-model' engine, or None when it has none:\n"
"descriptors_submitted, completed_on_device, page_fault_resumes,\n"
"enqcmd_retries, wait_ns (ns), bytes_on_device (bytes), below_min_size\n"
"(ops the size gate kept on the CPU), submit_failures, cpu_redo_total,\n"
"timeouts (descriptors not completed within the timeout), commit_ops\n"
"(block loads' commit copies done with COPY_CRC), commit_bytes_on_device /\n"
"commit_bytes_cpu (bytes of them the device / the CPU did) and\n"
"cpu_redo_by_status ({DSA_COMP_* name in lower case: count}).");

static PyObject *kvt_py_dsa_counters(PyObject *mod, PyObject *arg)
{
    int w = parse_which_arg(arg);
    if (w < 0)
        return NULL;
    kvt_dsa_engine *e = kvt_dsa_acquire(w);
    if (!e)
        Py_RETURN_NONE;
    kvt_dsa_counters c;
    kvt_dsa_engine_get_counters(e, &c);
    kvt_dsa_release(e);
    return counters_dict(&c);
}

PyDoc_STRVAR(dsa_reset_counters_doc,
"dsa_reset_counters($module, backend, /)\n--\n\nZero the engine's counters (no-op without an engine).");

static PyObject *kvt_py_dsa_reset_counters(PyObject *mod, PyObject *arg)
{
    int w = parse_which_arg(arg);
    if (w < 0)
        return NULL;
    kvt_dsa_engine *e = kvt_dsa_acquire(w);
    if (e) {
        kvt_dsa_engine_reset_counters(e);
        kvt_dsa_release(e);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dsa_configure_doc,
"dsa_configure($module, backend, /, *, min_size=None, wait=None, sleep_ns=None,\n"
"              cache_control=None, timeout=None)\n--\n\n"
"Tune an engine: min_size (bytes; below it the CPU computes, default 16 KiB\n"
"or env KVTIER_DSA_MIN_SIZE), wait ('spin', 'yield' or 'sleep'; default\n"
"'yield' or env KVTIER_DSA_WAIT), sleep_ns (nanosleep per poll in 'sleep'\n"
"mode), cache_control (set CC on COPY_CRC when gen_cap allows), timeout\n"
"(seconds, > 0: how long to wait for one descriptor's completion record\n"
"before quarantining it, redoing the CRC on the CPU and disabling the\n"
"engine; default 1.0 or env KVTIER_DSA_TIMEOUT_MS). Raises LookupError\n"
"when the engine does not exist, ValueError for bad values.");

static PyObject *kvt_py_dsa_configure(PyObject *mod, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"backend", "min_size", "wait", "sleep_ns", "cache_control", "timeout", NULL};
    const char *name, *wait = NULL;
    PyObject *min_size = Py_None, *sleep_ns = Py_None, *cc = Py_None, *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|$OzOOO:dsa_configure", kwlist, &name, &min_size,
                                     &wait, &sleep_ns, &cc, &timeout))
        return NULL;
    uint64_t timeout_ns = 0;
    if (timeout != Py_None) {
        double t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred())
            return NULL;
        if (!(t >= 1e-6 && t <= 86400.0)) {
            PyErr_SetString(PyExc_ValueError, "timeout must be in 1e-6..86400 seconds");
            return NULL;
        }
        timeout_ns = (uint64_t)(t * 1e9);
    }
    int w = dsa_which(name);
    if (w < 0)
        return NULL;
    Py_ssize_t ms = -1;
    long sl = -1;
    int mode = -1;
    if (min_size != Py_None) {
        ms = PyLong_AsSsize_t(min_size);
        if (ms < 0) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_SetString(PyExc_ValueError, "min_size must be an int >= 0 (bytes)");
            }
            return NULL;
        }
    }
    if (wait && (mode = kvt_dsa_wait_from_name(wait)) < 0) {
        PyErr_Format(PyExc_ValueError, "wait must be 'spin', 'yield' or 'sleep', not '%s'", wait);
        return NULL;
    }
    if (sleep_ns != Py_None) {
        sl = PyLong_AsLong(sleep_ns);
        if (sl <= 0 || sl >= 1000000000L) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "sleep_ns must be in 1..999999999");
            return NULL;
        }
    }
    int ccv = -1;
    if (cc != Py_None && (ccv = PyObject_IsTrue(cc)) < 0)
        return NULL;
    kvt_dsa_engine *e = kvt_dsa_acquire(w);
    if (!e) {
        PyErr_Format(PyExc_LookupError, "no %s engine (enable it first)", name);
        return NULL;
    }
    if (ms >= 0)
        kvt_dsa_engine_set_min_size(e, (size_t)ms);
    if (mode >= 0 || sl > 0)
        kvt_dsa_engine_set_wait(e, mode, sl);
    if (ccv >= 0)
        kvt_dsa_engine_set_cache_control(e, ccv);
    if (timeout_ns)
        kvt_dsa_engine_set_timeout(e, timeout_ns);
    kvt_dsa_release(e);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dsa_model_inject_doc,
"dsa_model_inject($module, kind, /, count=1, param=0)\n--\n\n"
"Inject faults into the 'dsa-model' device (tests). kind: 'enqcmd_retry'\n"
"(next `count` ENQCMDs refused), 'page_fault' (next `count` descriptors\n"
"fault at byte `param`), 'bof_flag', 'cc_flag', 'stale_reserved' (next\n"
"`count` descriptors arrive with BOF / CC / a nonzero reserved field),\n"
"'xfer_erange' (device max transfer `param` bytes for `count` descriptors),\n"
"'reject_all' (`count` descriptors complete with status `param`, 0 =\n"
"INVALID_FLAGS), 'hang' (`count` descriptors accepted and never completed;\n"
"param > 0: their completion record is written `param` ns later, no data\n"
"touched). count=-1 means every descriptor. LookupError without a model.");

static PyObject *kvt_py_dsa_model_inject(PyObject *mod, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"kind", "count", "param", NULL};
    const char *kind;
    long long count = 1;
    unsigned long long param = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|LK:dsa_model_inject", kwlist, &kind, &count, &param))
        return NULL;
    int k = kvt_dsa_fault_from_name(kind);
    if (k < 0) {
        PyErr_Format(PyExc_ValueError, "unknown fault kind '%s'", kind);
        return NULL;
    }
    if (count < -1) {
        PyErr_SetString(PyExc_ValueError, "count must be >= 0 or -1 (always)");
        return NULL;
    }
    kvt_dsa_engine *e = kvt_dsa_acquire(KVT_DSA_MODEL);
    kvt_dsa_model *m = e ? kvt_dsa_global_model() : NULL;
    if (!m) {
        kvt_dsa_release(e);
        PyErr_SetString(PyExc_LookupError, "no dsa-model enabled (dsa_model_enable first)");
        return NULL;
    }
    kvt_dsa_model_inject(m, k, count < 0 ? UINT64_MAX : (uint64_t)count, param);
    kvt_dsa_release(e);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dsa_copy_crc_doc,
"dsa_copy_crc($module, backend, dst, src, value=0, /)\n--\n\n"
"Copy src into dst (writable, same length in bytes) and return the CRC32C of\n"
"src chained from value, with one fused COPY_CRC per transfer on the\n"
"'dsa' or 'dsa-model' engine (CPU below the min size or when not enabled).\n"
"ValueError for different lengths or overlapping dst and src (memcpy is\n"
"undefined there, the device answers OVERLAP_BUFFERS); BufferError for\n"
"non-contiguous or read-only dst.");

static PyObject *kvt_py_dsa_copy_crc(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 3 || nargs > 4) {
        PyErr_Format(PyExc_TypeError, "dsa_copy_crc() takes 3 or 4 positional arguments (%zd given)", nargs);
        return NULL;
    }
    int w = parse_which_arg(args[0]);
    if (w < 0)
        return NULL;
    uint32_t crc = 0;
    if (nargs > 3 && parse_crc_value(args[3], &crc) < 0)
        return NULL;
    Py_buffer dv, sv;
    if (get_copy_buffers("dsa_copy_crc", args[1], args[2], &dv, &sv) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    kvt_dsa_engine *e = kvt_dsa_acquire(w);
    if (e) {
        crc = kvt_dsa_copy_crc(e, dv.buf, sv.buf, (size_t)sv.len, crc);
        kvt_dsa_release(e);
    } else {
        memmove(dv.buf, sv.buf, (size_t)sv.len);
        crc = kvt_crc32c_best_cpu()->fn(crc, dv.buf, (size_t)sv.len);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dv);
    PyBuffer_Release(&sv);
    return PyLong_FromUnsignedLong(crc);
}

PyDoc_STRVAR(dsa_model_stats_doc,
"dsa_model_stats($module, /)\n--\n\n"
"Device-side statistics of the 'dsa-model' device, or None without a model:\n"
"executed, dropped (dedicated WQ overflow; must stay 0), enqcmd_rejected,\n"
"faults_injected (page faults reported), faults_resolved (BOF), hung\n"
"(descriptors swallowed by the 'hang' fault); all counts of descriptors.");

static PyObject *kvt_py_dsa_model_stats(PyObject *mod, PyObject *unused)
{
    kvt_dsa_engine *e = kvt_dsa_acquire(KVT_DSA_MODEL);
    kvt_dsa_model *m = e ? kvt_dsa_global_model() : NULL;
    if (!m) {
        kvt_dsa_release(e);
        Py_RETURN_NONE;
    }
    kvt_dsa_model_stats st;
    kvt_dsa_model_get_stats(m, &st);
    kvt_dsa_release(e);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K}", "hung", (unsigned long long)st.hung,
                         "executed", (unsigned long long)st.executed,
                         "dropped", (unsigned long long)st.dropped, "enqcmd_rejected",
                         (unsigned long long)st.enqcmd_rejected, "faults_injected",
                         (unsigned long long)st.faults_injected, "faults_resolved",
                         (unsigned long long)st.faults_resolved);
}

PyDoc_STRVAR(dsa_cpu_doc,
"dsa_cpu_features($module, /)\n--\n\n"
"Dict of the CPU's DSA submission instructions from CPUID leaf 7:\n"
"movdir64b (ECX bit 28), enqcmd (ECX bit 29).");

static PyObject *kvt_py_dsa_cpu_features(PyObject *mod, PyObject *unused)
{
    return Py_BuildValue("{s:O,s:O}", "movdir64b", kvt_dsa_cpu_has_movdir64b() ? Py_True : Py_False,
                         "enqcmd", kvt_dsa_cpu_has_enqcmd() ? Py_True : Py_False);
}
/* --- end DSA bindings --- */

/* ------------------------------------------------------------------ */
/* Module                                                              */
/* ------------------------------------------------------------------ */

static PyMethodDef kvt_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))kvt_py_crc32c, METH_FASTCALL, crc32c_doc},
    {"crc32c_copy", (PyCFunction)(void (*)(void))kvt_py_crc32c_copy, METH_FASTCALL, crc32c_copy_doc},
    {"crc32c_using", (PyCFunction)(void (*)(void))kvt_py_crc32c_using, METH_FASTCALL, crc32c_using_doc},
    {"crc32c_combine", (PyCFunction)(void (*)(void))kvt_py_crc32c_combine, METH_FASTCALL, crc32c_combine_doc},
    {"backends", kvt_py_backends, METH_NOARGS, backends_doc},
    {"active_backend", kvt_py_active_backend, METH_NOARGS, active_backend_doc},
    {"isal_version", kvt_py_isal_version, METH_NOARGS, isal_version_doc},
    {"_crc32c_serial_crc32q", (PyCFunction)(void (*)(void))kvt_py_crc32c_serial_crc32q, METH_FASTCALL, crc32c_serial_crc32q_doc},
    {"_crc32c_bytewise", (PyCFunction)(void (*)(void))kvt_py_crc32c_bytewise, METH_FASTCALL, crc32c_bytewise_doc},
    {"batch_lookup", (PyCFunction)(void (*)(void))kvt_py_batch_lookup, METH_FASTCALL, batch_lookup_doc},
    {"batch_store_block", (PyCFunction)(void (*)(void))kvt_py_batch_store_block, METH_FASTCALL | METH_KEYWORDS, batch_store_block_doc},
    {"batch_load_block", (PyCFunction)(void (*)(void))kvt_py_batch_load_block, METH_FASTCALL | METH_KEYWORDS, batch_load_block_doc},
    {"checksum_stats", kvt_py_checksum_stats, METH_NOARGS, checksum_stats_doc},
    {"policy_info", kvt_py_policy_info, METH_NOARGS, policy_info_doc},
    {"job_state_cas", (PyCFunction)(void (*)(void))kvt_py_job_state_cas, METH_FASTCALL, job_state_cas_doc},
    {"io_engine_status", kvt_py_io_engine_status, METH_NOARGS, io_engine_status_doc},
    {"crc_copy_status", kvt_py_crc_copy_status, METH_NOARGS, crc_copy_status_doc},
    {"dsa_discover", (PyCFunction)(void (*)(void))kvt_py_dsa_discover, METH_VARARGS | METH_KEYWORDS, dsa_discover_doc},
    {"dsa_enable", (PyCFunction)(void (*)(void))kvt_py_dsa_enable, METH_VARARGS | METH_KEYWORDS, dsa_enable_doc},
    {"dsa_model_enable", (PyCFunction)(void (*)(void))kvt_py_dsa_model_enable, METH_VARARGS | METH_KEYWORDS, dsa_model_enable_doc},
    {"dsa_disable", kvt_py_dsa_disable, METH_O, dsa_disable_doc},
    {"dsa_status", kvt_py_dsa_status, METH_O, dsa_status_doc},
    {"dsa_counters", kvt_py_dsa_counters, METH_O, dsa_counters_doc},
    {"dsa_reset_counters", kvt_py_dsa_reset_counters, METH_O, dsa_reset_counters_doc},
    {"dsa_configure", (PyCFunction)(void (*)(void))kvt_py_dsa_configure, METH_VARARGS | METH_KEYWORDS, dsa_configure_doc},
    {"dsa_model_inject", (PyCFunction)(void (*)(void))kvt_py_dsa_model_inject, METH_VARARGS | METH_KEYWORDS, dsa_model_inject_doc},
    {"dsa_copy_crc", (PyCFunction)(void (*)(void))kvt_py_dsa_copy_crc, METH_FASTCALL, dsa_copy_crc_doc},
    {"dsa_model_stats", kvt_py_dsa_model_stats, METH_NOARGS, dsa_model_stats_doc},
    {"dsa_cpu_features", kvt_py_dsa_cpu_features, METH_NOARGS, dsa_cpu_doc},
    {NULL, NULL, 0, NULL},
};

/* Backend chosen once, here: KVTIER_CRC32C_BACKEND or the best available.
 * An unknown or unavailable name fails the import with ValueError. */
static int kvt_exec(PyObject *mod)
{
    kvt_dsa_register_backends();
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
    if (PyModule_AddIntConstant(mod, "JOB_LIVE", KVT_JOB_LIVE) < 0 ||
        PyModule_AddIntConstant(mod, "JOB_COMMITTING", KVT_JOB_COMMITTING) < 0 ||
        PyModule_AddIntConstant(mod, "JOB_EXPIRED", KVT_JOB_EXPIRED) < 0 ||
        PyModule_AddIntConstant(mod, "JOB_DONE", KVT_JOB_DONE) < 0)
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
