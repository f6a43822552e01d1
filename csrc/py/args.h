/* kvtier._C: what the binding's areas share (args.c) and the per-area
 * method tables module.c joins. csrc/py/ is the only folder that includes
 * Python.h; the work is done in plain C under csrc/block, csrc/crc32c and
 * csrc/dsa. */
#ifndef KVTIER_PY_ARGS_H
#define KVTIER_PY_ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* Below this many bytes the CRC runs with the GIL held. Measured with
 * `python benchmarks/gil_threshold.py` (docs/crc32c.md): one uncontended
 * release + re-acquire costs 18-44 ns (two runs); on the fastest backend
 * (isal, ~25-60 GB/s) that is <= 5 % of the CRC from 32 KiB (0.6-1.3 us) in
 * both runs, sse42 reaches it at 8 KiB and table at 0.5-2 KiB. Below
 * 32 KiB a call holds the GIL for at most ~20 us (table backend), far under
 * the 5 ms switch interval.
 * (CPython's zlib.crc32 uses 5 KiB, ICRAR crc32c 32 KiB.) */
#define KVT_GIL_RELEASE_MIN (32 * 1024)

/* A C-contiguous buffer of `obj` (writable when asked) in *view; torch CPU
 * tensors through a uint8 ndarray sharing their memory. 0, or -1 with
 * BufferError (strided / non-contiguous / read-only) or TypeError. */
int kvt_py_buffer(PyObject *obj, Py_buffer *view, int writable);
/* A CRC value argument: int in 0..0xFFFFFFFF. 0, or -1 (TypeError / ValueError). */
int kvt_py_crc_value(PyObject *obj, uint32_t *out);
/* The two buffers of a copy: dst writable, both C-contiguous, the same
 * length, not overlapping. 0, or -1 with an exception naming `fname` and
 * nothing held. */
int kvt_py_copy_buffers(const char *fname, PyObject *dst_obj, PyObject *src_obj, Py_buffer *dst, Py_buffer *src);
/* TypeError "<what> must be a list" unless obj is a list or tuple. */
int kvt_py_check_list(PyObject *obj, const char *what);
/* Items of the fast sequence `seq` (str / bytes / os.PathLike) -> owned
 * objects out[i] whose bytes cout[i] points at (os.fsencode). 0, or -1 with
 * TypeError naming what[i], or ValueError for an embedded NUL. */
int kvt_py_paths(PyObject *seq, Py_ssize_t n, PyObject **out, const char **cout, const char *what);
/* TypeError "<fname>() takes <min> [or <max>] positional arguments (<n> given)". */
int kvt_py_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t min, Py_ssize_t max);
/* d[k] = v, stealing v; -1 when v is NULL (its error set) or the set fails. */
int kvt_py_dict_set(PyObject *d, const char *k, PyObject *v);

/* Per-area method tables (crc.c, blockio.c, dsa.c) and their constants. */
extern PyMethodDef kvt_py_crc_methods[];
extern PyMethodDef kvt_py_blockio_methods[];
extern PyMethodDef kvt_py_dsa_methods[];
int kvt_py_blockio_constants(PyObject *mod);
/* The backend `name` if compiled in and available here; else NULL with a
 * ValueError naming the available ones (crc.c). */
struct kvt_crc32c_backend;
const struct kvt_crc32c_backend *kvt_py_crc_backend(const char *name);

#endif
