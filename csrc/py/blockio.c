/* kvtier._C, block I/O area: batch_lookup / batch_store_block /
 * batch_load_block (the arguments gathered under the GIL, the batch run
 * without it, the OSError built after), the job state CAS, the policy
 * vocabulary and the engine's status (csrc/block). */
#include "args.h"

#include <errno.h>
#include <string.h>

#include "crc32c.h"
#include "block.h"
#include "engine.h"
#include "uring.h"

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

/* The list-of-buffers form (one buffer per block). kvtier.io always passes
 * offsets= (gather_at); this form is kept for callers shaped like vLLM's
 * fs_io_C (a list of tensors) and is what the tests' list calls exercise. */
static int gather_buffers(kvt_batch_args *a, PyObject *seq, int writable)
{
    for (Py_ssize_t i = 0; i < a->n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (kvt_py_buffer(item, &a->views[i], writable) < 0) {
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
    if (kvt_py_check_list(offsets, "offsets") < 0)
        return -1;
    if (PySequence_Fast_GET_SIZE(offsets) != a->n) {
        PyErr_Format(PyExc_ValueError, "paths and offsets must have equal lengths (%zd, %zd)", a->n,
                     PySequence_Fast_GET_SIZE(offsets));
        return -1;
    }
    if (kvt_py_buffer(buf_obj, &a->views[0], writable) < 0) {
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
"path type, ValueError for a negative block_size or a path with a NUL or\n"
"ending in '/', '.' or '..'.");

static PyObject *kvt_py_batch_lookup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (kvt_py_nargs("batch_lookup", nargs, 1, 2) < 0)
        return NULL;
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
    if (kvt_py_check_list(args[0], "paths") < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "paths must be a list");
    if (!seq)
        return NULL;
    kvt_batch_args a;
    PyObject *out = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint8_t *found = NULL;
    if (alloc_args(&a, n, 0, 0) < 0 || kvt_py_paths(seq, n, a.paths_a, a.ca, "paths") < 0)
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
"counts: None, or a dict of policy counters (policy_info()['counts']: each\n"
"value an int in 0..2**64-1) that the batch's counters are added to.\n\n"
"Raises TypeError (non-list, bad path, buffer or counts value type),\n"
"ValueError (unequal lengths, NUL in a path, a path ending in '/', '.' or\n"
"'..', a counts value out of range), BufferError (non-contiguous buffer)\n"
"before any I/O. The batch stops at the first failing block: OSError with its errno,\n"
"filename = its dest path, num_succeeded = its index, checksum_failed =\n"
"False, num_retried = 0; its temp is removed, earlier blocks stay stored.\n\n"
"job_state: None, or the job's state word (see job_state_cas): a block\n"
"begins only while it is JOB_LIVE and is renamed in a commit section (LIVE\n"
"-> COMMITTING -> LIVE); a job no longer LIVE stops the batch with\n"
"OSError(ETIMEDOUT), its temp removed, nothing published after that.");

PyDoc_STRVAR(batch_load_block_doc,
"batch_load_block($module, source_paths, buffers, /, use_o_direct=True,\n"
"                 checksum=False, *, job_state=None, counts=None, offsets=None,\n"
"                 block_size=None, landing='bounce')\n--\n\n"
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
"counts: as batch_store_block's.\n\n"
"Raises TypeError / ValueError / BufferError (read-only or non-contiguous\n"
"buffer) before any I/O, for the arguments batch_store_block refuses too. The batch stops at the first failing block:\n"
"OSError with filename = its path, num_succeeded = its index,\n"
"num_retried = blocks of this batch re-read after a first mismatch (int;\n"
"the failing block included, e.g. 1 for a block condemned on its re-read),\n"
"operation and condemned (None, or 'checksum', 'identity', 'size',\n"
"'short_read': the file removed), and (docs/design.md, load outcomes)\n"
"  errno EBADMSG, checksum_failed=True: a CRC or identity mismatch, or a\n"
"    malformed record, on two reads (file removed);\n"
"  errno EIO: a size other than the buffer length, or a short read, on two\n"
"    opens (file removed); a file of another size whose own CRC record\n"
"    verifies it, or that could not be checked, is kept (a miss);\n"
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
"that.\n\n"
"landing: 'bounce' (the default: as above) or 'direct': an O_DIRECT block\n"
"into a page-aligned buffer, and an unchecksummed buffered one, are read\n"
"straight into buffers[i] (checksummed there, no copy), the whole read in\n"
"one commit section: a job expired meanwhile is reported once the read\n"
"returned. Only where the kernel bounds the I/O (a local disk, tmpfs);\n"
"docs/block_io.md \"Load landing\".");

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
"kernel.io_uring_disabled; 0 if it did not), uring_ops (int: load reads\n"
"completed through io_uring), plain_blocks (int: O_DIRECT loads that took\n"
"plain pread because no ring was available). Stores never use the ring (one\n"
"pwrite each) and count in neither. Counters since import.");

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
"(LIVE -> LIVE, blocks + 1), every change keeps the count (csrc/block/job_state.h).\n"
"ValueError for a value outside 0..2**32-1.");

static PyObject *kvt_py_job_state_cas(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (kvt_py_nargs("job_state_cas", nargs, 3, 3) < 0)
        return NULL;
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

/* counts= before any I/O (kvtier/_blockio/args.py check_counts, the same
 * rules): a dict whose values are ints (not bool) in 0..2**64-1, which
 * add_counts adds to; TypeError / ValueError. */
static int check_counts(const char *fname, PyObject *c)
{
    if (!PyDict_Check(c)) {
        PyErr_Format(PyExc_TypeError, "%s(): counts must be a dict or None, not %.100s", fname, Py_TYPE(c)->tp_name);
        return -1;
    }
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(c, &pos, &k, &v)) {
        if (!PyLong_Check(v) || PyBool_Check(v)) {
            const char *tn = Py_TYPE(v)->tp_name, *dot = strrchr(tn, '.');  /* its __name__, as Python's */
            PyErr_Format(PyExc_TypeError, "%s(): counts[%R] must be int, not %.100s", fname, k, dot ? dot + 1 : tn);
            return -1;
        }
        if (PyLong_AsUnsignedLongLong(v) == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s(): counts[%R] = %R: a counter is an int in 0..2**64-1", fname, k, v);
            return -1;
        }
    }
    return 0;
}

/* The flags after the `npos` positional arguments of a batch call, by
 * position or keyword; durable == NULL: the call has no `durable` flag
 * (loads). */
static int parse_io_flags(PyObject *kwnames, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t npos,
                          const char *fname, int *use_o_direct, int *checksum, int *durable, PyObject **job_state,
                          PyObject **counts, PyObject **offsets, PyObject **block_size, int *landing)
{
    *job_state = NULL;
    if (landing)
        *landing = KVT_LAND_BOUNCE;
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
        } else if (landing && PyUnicode_CompareWithASCIIString(name, "landing") == 0) {
            PyObject *v = args[nargs + k];
            if (PyUnicode_Check(v) && PyUnicode_CompareWithASCIIString(v, "bounce") == 0)
                *landing = KVT_LAND_BOUNCE;
            else if (PyUnicode_Check(v) && PyUnicode_CompareWithASCIIString(v, "direct") == 0)
                *landing = KVT_LAND_DIRECT;
            else {
                PyErr_Format(PyExc_ValueError, "%s(): landing must be 'bounce' or 'direct', not %R", fname, v);
                return -1;
            }
            continue;
        } else if (PyUnicode_CompareWithASCIIString(name, "counts") == 0) {
            PyObject *c = args[nargs + k];
            if (c != Py_None && check_counts(fname, c) < 0)
                return -1;
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
                       &counts, &offsets, &bs_obj, NULL) < 0)
        return NULL;
    if (kvt_py_check_list(args[0], "tmp_paths") < 0 || kvt_py_check_list(args[1], "dest_paths") < 0 ||
        (offsets ? kvt_py_check_list(offsets, "offsets") : kvt_py_check_list(args[2], "buffers")) < 0)
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
    if (alloc_args(&a, n, 1, offsets ? 2 : 1) < 0 || kvt_py_paths(s0, n, a.paths_a, a.ca, "tmp_paths") < 0 ||
        kvt_py_paths(s1, n, a.paths_b, a.cb, "dest_paths") < 0 ||
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
    int use_o_direct, checksum, landing;
    PyObject *js_obj, *counts, *offsets, *bs_obj;
    if (parse_io_flags(kwnames, args, nargs, 2, "batch_load_block", &use_o_direct, &checksum, NULL, &js_obj,
                       &counts, &offsets, &bs_obj, &landing) < 0)
        return NULL;
    if (kvt_py_check_list(args[0], "source_paths") < 0 ||
        (offsets ? kvt_py_check_list(offsets, "offsets") : kvt_py_check_list(args[1], "buffers")) < 0)
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
    if (alloc_args(&a, n, 0, offsets ? 2 : 1) < 0 || kvt_py_paths(s0, n, a.paths_a, a.ca, "source_paths") < 0 ||
        (offsets ? gather_at(&a, args[1], s1, bs_obj, 1) : gather_buffers(&a, s1, 1)) < 0)
        goto done;
    kvt_batch_result res;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvt_batch_load(a.ca, a.bufs, a.lens, (size_t)n, use_o_direct, checksum, js, landing, &res);
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

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL

PyMethodDef kvt_py_blockio_methods[] = {
    {"batch_lookup", FASTCALL(kvt_py_batch_lookup), batch_lookup_doc},
    {"batch_store_block", (PyCFunction)(void (*)(void))kvt_py_batch_store_block, METH_FASTCALL | METH_KEYWORDS,
     batch_store_block_doc},
    {"batch_load_block", (PyCFunction)(void (*)(void))kvt_py_batch_load_block, METH_FASTCALL | METH_KEYWORDS,
     batch_load_block_doc},
    {"checksum_stats", kvt_py_checksum_stats, METH_NOARGS, checksum_stats_doc},
    {"policy_info", kvt_py_policy_info, METH_NOARGS, policy_info_doc},
    {"job_state_cas", FASTCALL(kvt_py_job_state_cas), job_state_cas_doc},
    {"io_engine_status", kvt_py_io_engine_status, METH_NOARGS, io_engine_status_doc},
    {"crc_copy_status", kvt_py_crc_copy_status, METH_NOARGS, crc_copy_status_doc},
    {NULL, NULL, 0, NULL},
};

int kvt_py_blockio_constants(PyObject *mod)
{
    if (PyModule_AddStringConstant(mod, "XATTR_NAME", KVT_XATTR_NAME) < 0 ||
        PyModule_AddIntConstant(mod, "JOB_LIVE", KVT_JOB_LIVE) < 0 ||
        PyModule_AddIntConstant(mod, "JOB_COMMITTING", KVT_JOB_COMMITTING) < 0 ||
        PyModule_AddIntConstant(mod, "JOB_EXPIRED", KVT_JOB_EXPIRED) < 0 ||
        PyModule_AddIntConstant(mod, "JOB_DONE", KVT_JOB_DONE) < 0)
        return -1;
    return 0;
}
