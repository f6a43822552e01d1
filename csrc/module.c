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
        a->views = PyMem_Calloc(m, sizeof(Py_buffer));
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

/* OSError(errno, strerror, path) (the errno-specific subclass, e.g.
 * FileNotFoundError) with num_succeeded and checksum_failed set. */
static void raise_batch_error(const kvt_batch_result *res, PyObject *path)
{
    errno = res->err;
    PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v != NULL) {
        PyObject *ns = PyLong_FromSize_t(res->index);
        if (ns == NULL || PyObject_SetAttrString(v, "num_succeeded", ns) < 0 ||
            PyObject_SetAttrString(v, "checksum_failed", res->checksum_failed ? Py_True : Py_False) < 0) {
            Py_XDECREF(ns);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
            return;
        }
        Py_DECREF(ns);
    }
    PyErr_Restore(t, v, tb);
}

PyDoc_STRVAR(batch_lookup_doc,
"batch_lookup($module, paths, /)\n--\n\n"
"For each path (str, bytes or os.PathLike) whether it exists (stat(2)\n"
"succeeds). Returns a list of bool of the same length. The GIL is released\n"
"for the whole batch. Raises TypeError for a non-list or a bad path type.");

static PyObject *kvt_py_batch_lookup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "batch_lookup() takes 1 positional argument (%zd given)", nargs);
        return NULL;
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
    kvt_batch_lookup(a.ca, (size_t)n, found);
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
"                  checksum=False)\n--\n\n"
"Store each buffers[i] (C-contiguous, its whole length in bytes) as the file\n"
"dest_paths[i] through the temp tmp_paths[i]: skip if dest exists; create\n"
"the temp with O_CREAT|O_EXCL (missing parents are created), write it (with\n"
"O_DIRECT when use_o_direct and the buffer address and length meet the\n"
"filesystem's alignment, else buffered), with checksum set xattr\n"
"user.vllm.kv_crc32c = CRC32C (RFC 3720) as 4 bytes big-endian on the open\n"
"temp, close, rename onto dest. The GIL is released for the whole batch.\n\n"
"Raises TypeError (non-list, bad path or buffer type), ValueError (unequal\n"
"lengths, NUL in a path), BufferError (non-contiguous buffer) before any\n"
"I/O. The batch stops at the first failing block: OSError with its errno,\n"
"filename = its dest path, num_succeeded = its index, checksum_failed =\n"
"False; its temp is removed, earlier blocks stay stored.");

PyDoc_STRVAR(batch_load_block_doc,
"batch_load_block($module, source_paths, buffers, /, use_o_direct=True,\n"
"                 checksum=False)\n--\n\n"
"Load each file source_paths[i] into buffers[i] (writable, C-contiguous; its\n"
"length in bytes is the block size). O_DIRECT when use_o_direct and the\n"
"buffer address and length meet the filesystem's alignment, else buffered.\n"
"With checksum, verify xattr user.vllm.kv_crc32c (4 bytes big-endian\n"
"CRC32C, RFC 3720) read through the same fd; a block without it (ENODATA,\n"
"legacy) is accepted. The GIL is released for the whole batch.\n\n"
"Raises TypeError / ValueError / BufferError (read-only or non-contiguous\n"
"buffer) before any I/O. The batch stops at the first failing block:\n"
"OSError with filename = its path, num_succeeded = its index and\n"
"  errno EBADMSG, checksum_failed=True: CRC mismatch or record length != 4\n"
"    (file removed);\n"
"  errno EIO: file size != buffer length (file removed);\n"
"  any other errno (ENOENT, ELOOP, EACCES, EIO, EOPNOTSUPP from getxattr,\n"
"    EBADMSG from the filesystem ...): checksum_failed=False, file kept.");

static int parse_io_flags(PyObject *kwnames, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t npos,
                          const char *fname, int *use_o_direct, int *checksum)
{
    *use_o_direct = 1;
    *checksum = 0;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs < npos || nargs > npos + 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes from %zd to %zd positional arguments (%zd given)", fname, npos,
                     npos + 2, nargs);
        return -1;
    }
    PyObject *flag_obj[2] = {NULL, NULL};
    for (Py_ssize_t i = npos; i < nargs; i++)
        flag_obj[i - npos] = args[i];
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int idx;
        if (PyUnicode_CompareWithASCIIString(name, "use_o_direct") == 0)
            idx = 0;
        else if (PyUnicode_CompareWithASCIIString(name, "checksum") == 0)
            idx = 1;
        else {
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
    if (flag_obj[1] && (*checksum = PyObject_IsTrue(flag_obj[1])) < 0)
        return -1;
    return 0;
}

static PyObject *kvt_py_batch_store_block(PyObject *mod, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames)
{
    int use_o_direct, checksum;
    if (parse_io_flags(kwnames, args, nargs, 3, "batch_store_block", &use_o_direct, &checksum) < 0)
        return NULL;
    if (check_list(args[0], "tmp_paths") < 0 || check_list(args[1], "dest_paths") < 0 ||
        check_list(args[2], "buffers") < 0)
        return NULL;
    Py_ssize_t n = PySequence_Size(args[0]);
    if (PySequence_Size(args[1]) != n || PySequence_Size(args[2]) != n) {
        PyErr_Format(PyExc_ValueError, "tmp_paths, dest_paths and buffers must have equal lengths (%zd, %zd, %zd)",
                     n, PySequence_Size(args[1]), PySequence_Size(args[2]));
        return NULL;
    }
    /* Own references to the lists' items: the lists themselves may change
     * in another thread while the GIL is released. */
    PyObject *s0 = PySequence_Fast(args[0], ""), *s1 = PySequence_Fast(args[1], ""),
             *s2 = PySequence_Fast(args[2], "");
    PyObject *ret = NULL;
    kvt_batch_args a;
    memset(&a, 0, sizeof a);
    if (!s0 || !s1 || !s2)
        goto done;
    if (alloc_args(&a, n, 1, 1) < 0 || convert_paths(s0, n, a.paths_a, a.ca, "tmp_paths") < 0 ||
        convert_paths(s1, n, a.paths_b, a.cb, "dest_paths") < 0 || gather_buffers(&a, s2, 0) < 0)
        goto done;
    kvt_batch_result res;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvt_batch_store(a.ca, a.cb, (const void *const *)a.bufs, a.lens, (size_t)n, use_o_direct,
                         checksum, &res);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        raise_batch_error(&res, PySequence_Fast_GET_ITEM(s1, (Py_ssize_t)res.index));
        goto done;
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
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
    if (parse_io_flags(kwnames, args, nargs, 2, "batch_load_block", &use_o_direct, &checksum) < 0)
        return NULL;
    if (check_list(args[0], "source_paths") < 0 || check_list(args[1], "buffers") < 0)
        return NULL;
    Py_ssize_t n = PySequence_Size(args[0]);
    if (PySequence_Size(args[1]) != n) {
        PyErr_Format(PyExc_ValueError, "source_paths and buffers must have equal lengths (%zd, %zd)", n,
                     PySequence_Size(args[1]));
        return NULL;
    }
    PyObject *s0 = PySequence_Fast(args[0], ""), *s1 = PySequence_Fast(args[1], "");
    PyObject *ret = NULL;
    kvt_batch_args a;
    memset(&a, 0, sizeof a);
    if (!s0 || !s1)
        goto done;
    if (alloc_args(&a, n, 0, 1) < 0 || convert_paths(s0, n, a.paths_a, a.ca, "source_paths") < 0 ||
        gather_buffers(&a, s1, 1) < 0)
        goto done;
    kvt_batch_result res;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvt_batch_load(a.ca, a.bufs, a.lens, (size_t)n, use_o_direct, checksum, &res);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        raise_batch_error(&res, PySequence_Fast_GET_ITEM(s0, (Py_ssize_t)res.index));
        goto done;
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    batch_args_free(&a);
    Py_XDECREF(s0);
    Py_XDECREF(s1);
    return ret;
}

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
    {"batch_lookup", (PyCFunction)(void (*)(void))kvt_py_batch_lookup, METH_FASTCALL, batch_lookup_doc},
    {"batch_store_block", (PyCFunction)(void (*)(void))kvt_py_batch_store_block, METH_FASTCALL | METH_KEYWORDS, batch_store_block_doc},
    {"batch_load_block", (PyCFunction)(void (*)(void))kvt_py_batch_load_block, METH_FASTCALL | METH_KEYWORDS, batch_load_block_doc},
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
