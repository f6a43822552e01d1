/* kvtier._C, DSA area: discovery, enable/disable, status and counters,
 * tuning, the model's fault injection and stats (tests), dsa_copy_crc
 * (csrc/dsa). */
#include "args.h"

#include <string.h>

#include "crc32c.h"
#include "dsa.h"

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


static PyObject *wq_dict(const kvt_dsa_wq_info *w)
{
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    if (kvt_py_dict_set(d, "name", PyUnicode_FromString(w->name)) < 0 ||
        kvt_py_dict_set(d, "device", PyUnicode_FromString(w->device)) < 0 ||
        kvt_py_dict_set(d, "path", PyUnicode_DecodeFSDefault(w->path)) < 0 ||
        kvt_py_dict_set(d, "state", PyUnicode_FromString(w->state)) < 0 ||
        kvt_py_dict_set(d, "type", PyUnicode_FromString(w->type)) < 0 ||
        kvt_py_dict_set(d, "mode", PyUnicode_FromString(w->mode)) < 0 ||
        kvt_py_dict_set(d, "size", PyLong_FromUnsignedLong(w->size)) < 0 ||
        kvt_py_dict_set(d, "max_transfer_size", PyLong_FromUnsignedLongLong(w->max_transfer_size)) < 0 ||
        kvt_py_dict_set(d, "block_on_fault", PyBool_FromLong(w->block_on_fault)) < 0 ||
        kvt_py_dict_set(d, "gen_cap", PyLong_FromUnsignedLongLong(w->gen_cap)) < 0 ||
        kvt_py_dict_set(d, "usable", PyBool_FromLong(w->usable)) < 0 ||
        kvt_py_dict_set(d, "reason", PyUnicode_FromString(w->reason)) < 0) {
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

/* The (sysfs_root=None, dev_root=None, wq=None) arguments of dsa_discover
 * and dsa_enable; `format` names the function ("|zzz:<name>"). */
static int parse_roots(PyObject *args, PyObject *kw, const char *format, const char **sys, const char **dev,
                       const char **want)
{
    static char *kwlist[] = {"sysfs_root", "dev_root", "wq", NULL};
    *sys = *dev = *want = NULL;
    return PyArg_ParseTupleAndKeywords(args, kw, format, kwlist, sys, dev, want) ? 0 : -1;
}

static PyObject *kvt_py_dsa_discover(PyObject *mod, PyObject *args, PyObject *kw)
{
    const char *sys, *dev, *want;
    if (parse_roots(args, kw, "|zzz:dsa_discover", &sys, &dev, &want) < 0)
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
    if (kvt_py_dict_set(res, "devices_dir", PyUnicode_DecodeFSDefault(d->devices_dir)) < 0 ||
        kvt_py_dict_set(res, "devices_dir_present", PyBool_FromLong(d->devices_dir_present)) < 0)
        goto fail;
    if (PyDict_SetItemString(res, "wqs", lst) < 0)
        goto fail;
    Py_CLEAR(lst);
    if (d->chosen >= 0) {
        if (kvt_py_dict_set(res, "chosen", PyUnicode_FromString(d->wqs[d->chosen].name)) < 0)
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
    const char *sys, *dev, *want;
    if (parse_roots(args, kw, "|zzz:dsa_enable", &sys, &dev, &want) < 0)
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
#define CNT(f) if (kvt_py_dict_set(d, #f, PyLong_FromUnsignedLongLong(c->f)) < 0) goto fail
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
        if (kvt_py_dict_set(by, n, PyLong_FromUnsignedLongLong(c->cpu_redo_by_status[s])) < 0)
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
    if (kvt_py_dict_set(d, "backend", PyUnicode_FromString(w == KVT_DSA_MODEL ? "dsa-model" : "dsa")) < 0 ||
        kvt_py_dict_set(d, "tried", PyBool_FromLong(kvt_dsa_global_tried(w))) < 0 ||
        kvt_py_dict_set(d, "reason", PyUnicode_FromString(reason)) < 0)
        goto fail;
    kvt_dsa_engine *e = kvt_dsa_acquire(w);
    if (!e)
        return kvt_py_dict_set(d, "enabled", PyBool_FromLong(0)) < 0 ? (Py_DECREF(d), NULL) : d;
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
    if (kvt_py_dict_set(d, "enabled", PyBool_FromLong(enabled)) < 0 ||
        kvt_py_dict_set(d, "engine_reason", PyUnicode_FromString(ereason)) < 0 ||
        kvt_py_dict_set(d, "wq", wq_dict(&wq)) < 0 ||
        kvt_py_dict_set(d, "portal", PyUnicode_FromString(portal)) < 0 ||
        kvt_py_dict_set(d, "min_size", PyLong_FromSize_t(min_size)) < 0 ||
        kvt_py_dict_set(d, "wait", PyUnicode_FromString(wait)) < 0 ||
        kvt_py_dict_set(d, "timeout", PyFloat_FromDouble(timeout_s)) < 0 ||
        kvt_py_dict_set(d, "selfcheck", scd) < 0 ||
        kvt_py_dict_set(d, "counters", counters_dict(&c)) < 0)
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
    if (kvt_py_nargs("dsa_copy_crc", nargs, 3, 4) < 0)
        return NULL;
    int w = parse_which_arg(args[0]);
    if (w < 0)
        return NULL;
    uint32_t crc = 0;
    if (nargs > 3 && kvt_py_crc_value(args[3], &crc) < 0)
        return NULL;
    Py_buffer dv, sv;
    if (kvt_py_copy_buffers("dsa_copy_crc", args[1], args[2], &dv, &sv) < 0)
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

#define KWARGS(f) (PyCFunction)(void (*)(void))(f), METH_VARARGS | METH_KEYWORDS

PyMethodDef kvt_py_dsa_methods[] = {
    {"dsa_discover", KWARGS(kvt_py_dsa_discover), dsa_discover_doc},
    {"dsa_enable", KWARGS(kvt_py_dsa_enable), dsa_enable_doc},
    {"dsa_model_enable", KWARGS(kvt_py_dsa_model_enable), dsa_model_enable_doc},
    {"dsa_disable", kvt_py_dsa_disable, METH_O, dsa_disable_doc},
    {"dsa_status", kvt_py_dsa_status, METH_O, dsa_status_doc},
    {"dsa_counters", kvt_py_dsa_counters, METH_O, dsa_counters_doc},
    {"dsa_reset_counters", kvt_py_dsa_reset_counters, METH_O, dsa_reset_counters_doc},
    {"dsa_configure", KWARGS(kvt_py_dsa_configure), dsa_configure_doc},
    {"dsa_model_inject", KWARGS(kvt_py_dsa_model_inject), dsa_model_inject_doc},
    {"dsa_copy_crc", (PyCFunction)(void (*)(void))kvt_py_dsa_copy_crc, METH_FASTCALL, dsa_copy_crc_doc},
    {"dsa_model_stats", kvt_py_dsa_model_stats, METH_NOARGS, dsa_model_stats_doc},
    {"dsa_cpu_features", kvt_py_dsa_cpu_features, METH_NOARGS, dsa_cpu_doc},
    {NULL, NULL, 0, NULL},
};
