/* kvtier._C: the helpers the binding's areas share (args.h): buffers
 * (torch CPU tensors too), CRC values, path lists, argument counts. */
#include "args.h"

#include <string.h>

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
int kvt_py_buffer(PyObject *obj, Py_buffer *view, int writable)
{
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (!PyObject_CheckBuffer(obj) && is_torch_tensor(obj)) {
        PyObject *arr = torch_bytes_view(obj);
        if (!arr)
            return -1;
        int rc = kvt_py_buffer(arr, view, writable); /* view->obj keeps arr alive */
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

int kvt_py_crc_value(PyObject *obj, uint32_t *out)
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

/* See args.h: TypeError / BufferError / ValueError. */
int kvt_py_copy_buffers(const char *fname, PyObject *dst_obj, PyObject *src_obj, Py_buffer *dst, Py_buffer *src)
{
    if (kvt_py_buffer(dst_obj, dst, 1) < 0)
        return -1;
    if (kvt_py_buffer(src_obj, src, 0) < 0) {
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

int kvt_py_check_list(PyObject *obj, const char *what)
{
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list, not %.200s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* How the path c (len bytes) names a directory rather than a file: "/" when
 * it ends in a separator, "." or ".." when that is its last component; else
 * NULL (kvtier/_blockio/args.py dir_tail: a store would make that directory,
 * the temp's parent, and fail at the rename, leaving it at the key). */
static const char *dir_tail(const char *c, Py_ssize_t len)
{
    if (len > 0 && c[len - 1] == '/')
        return "/";
    Py_ssize_t start = len;
    while (start > 0 && c[start - 1] != '/')
        start--;
    const char *last = c + start;
    Py_ssize_t n = len - start;
    if (n == 1 && last[0] == '.')
        return ".";
    if (n == 2 && last[0] == '.' && last[1] == '.')
        return "..";
    return NULL;
}

static int check_dir_tail(const char *c, Py_ssize_t len, const char *what, Py_ssize_t i)
{
    const char *tail = dir_tail(c, len);
    if (!tail)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s[%zd]: a block path may not end in '%s' (it would name a directory)", what, i,
                 tail);
    return -1;
}

/* str / bytes / os.PathLike -> owned bytes (os.fsencode); TypeError, or
 * ValueError for an embedded NUL or a path ending in '/', '.' or '..'. */
int kvt_py_paths(PyObject *seq, Py_ssize_t n, PyObject **out, const char **cout, const char *what)
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
            if (check_dir_tail(c, len, what, i) < 0)
                return -1;
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
        if (check_dir_tail(cout[i], PyBytes_GET_SIZE(out[i]), what, i) < 0)
            return -1;
    }
    return 0;
}

int kvt_py_dict_set(PyObject *d, const char *k, PyObject *v)
{
    if (!v)
        return -1;
    int r = PyDict_SetItemString(d, k, v);
    Py_DECREF(v);
    return r;
}

int kvt_py_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t min, Py_ssize_t max)
{
    if (nargs >= min && nargs <= max)
        return 0;
    if (min == max)
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments (%zd given)", fname, min, nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s() takes %zd or %zd positional arguments (%zd given)", fname, min, max,
                     nargs);
    return -1;
}
