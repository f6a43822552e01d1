"""Intel DSA (Data Streaming Accelerator) offload of CRC32C: Python-facing helpers.

The work happens in C (``csrc/dsa/``): work queue (WQ) discovery from sysfs,
descriptor submission (MOVDIR64B / ENQCMD / ``write()``), CRCGEN and COPY_CRC
with page-fault resume and CPU redo, a min-size gate (16 KiB by default) and a
1 MiB enable-time self-check that requires completion *on the device*.

Two CRC32C backends come from it, neither ever auto-selected:

``"dsa"``
    a real WQ, enabled when ``KVTIER_CRC32C_BACKEND=dsa`` (or :func:`enable`)
    finds a usable WQ and its self-check passes.
``"dsa-model"``
    the software model of the device (``csrc/dsa/model.c``), enabled only
    explicitly: ``KVTIER_DSA=model``, ``KVTIER_CRC32C_BACKEND=dsa-model`` or
    :func:`enable_model`. It proves the code path; it is not hardware and its
    timings are not DSA performance.

Environment: ``KVTIER_DSA_SYSFS`` (sysfs root, default ``/sys``),
``KVTIER_DSA_DEV`` (device root, default ``/dev``), ``KVTIER_DSA_WQ`` (use
this WQ, e.g. ``wq0.1``), ``KVTIER_DSA_MIN_SIZE`` (bytes), ``KVTIER_DSA_WAIT``
(``spin`` | ``yield`` | ``sleep``), ``KVTIER_DSA_TIMEOUT_MS`` (per-descriptor
completion deadline in milliseconds, default 1000), ``KVTIER_DSA=off`` (never
probe a device), ``KVTIER_DSA_MODEL_LATENCY_NS`` (per-descriptor delay of the
model when enabled through the environment, nanoseconds, < 10**9).

Timeouts: every wait for a completion record has a deadline. When the device
does not complete a descriptor in time (a WQ the admin disabled, a hung
device), the record, which is engine-owned memory, is quarantined (never
freed or reused: the device may still write it), the CRC is redone on the
CPU, counter ``timeouts`` grows and the engine disables itself;
``status(b)["reason"]`` then starts ``"<b> disabled: device stopped
completing descriptors"`` and every later CRC runs on the CPU. The caller's
buffers stay the caller's: a late device may still read the source, and for
COPY_CRC write the destination with the bytes the CPU already copied there.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

try:
    from kvtier import _C
except ImportError:  # pragma: no cover - the C core is required for DSA
    _C = None

BACKENDS = ("dsa", "dsa-model")

#: Counter names of :func:`counters` (all monotonic except after reset).
COUNTER_NAMES = (
    "descriptors_submitted",
    "completed_on_device",
    "page_fault_resumes",
    "enqcmd_retries",
    "wait_ns",
    "bytes_on_device",
    "below_min_size",
    "submit_failures",
    "cpu_redo_total",
    "timeouts",
    "commit_ops",
    "commit_bytes_on_device",
    "commit_bytes_cpu",
)


def _need_c() -> None:
    if _C is None:
        raise RuntimeError("Intel DSA offload needs the kvtier C core (kvtier._C), which is not built")


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"DSA backend must be 'dsa' or 'dsa-model', not {backend!r}")
    return backend


def discover(sysfs_root: Optional[str] = None, dev_root: Optional[str] = None,
             wq: Optional[str] = None) -> Dict[str, Any]:
    """Scan ``<sysfs_root>/bus/dsa/devices`` for WQs (nothing is opened).

    Returns ``{"devices_dir": str, "devices_dir_present": bool, "wqs": [...],
    "chosen": name or None}``; each WQ dict has name, device, path, state,
    type, mode, size, max_transfer_size (bytes), block_on_fault, gen_cap,
    usable and reason (why it was skipped, "" when usable). Preference among
    usable WQs: shared, then block_on_fault=1, then larger, then by name.
    """
    _need_c()
    return _C.dsa_discover(sysfs_root=sysfs_root, dev_root=dev_root, wq=wq)


def enable(sysfs_root: Optional[str] = None, dev_root: Optional[str] = None,
           wq: Optional[str] = None) -> bool:
    """Try to enable a real DSA WQ for the ``"dsa"`` backend (discovery, open,
    self-check). Returns True when enabled; ``status("dsa")["reason"]`` says why not."""
    _need_c()
    return _C.dsa_enable(sysfs_root=sysfs_root, dev_root=dev_root, wq=wq)


def enable_model(*, shared: bool = False, size: int = 32, max_transfer_size: int = 2 << 20,
                 block_on_fault: bool = False, gen_cap: int = 0x5, latency_ns: int = 0,
                 reject_status: int = 0) -> bool:
    """Enable the software model behind the ``"dsa-model"`` backend.

    shared: shared WQ (ENQCMD) instead of dedicated (MOVDIR64B); size: WQ
    slots; max_transfer_size: bytes; gen_cap: device GENCAP (0x4 cache
    control, 0x1 block on fault); reject_status: a ``DSA_COMP_*`` status
    (linux/idxd.h) the model answers every descriptor with (0 = none).
    Returns True when the 1 MiB self-check passed (the backend is then
    usable through ``kvtier.crc32c_using("dsa-model", ...)``). ValueError
    for out-of-range arguments.
    """
    _need_c()
    return _C.dsa_model_enable(shared=shared, size=size, max_transfer_size=max_transfer_size,
                               block_on_fault=block_on_fault, gen_cap=gen_cap,
                               latency_ns=latency_ns, reject_status=reject_status)


def disable(backend: str) -> None:
    """Disable and release the ``"dsa"`` or ``"dsa-model"`` engine."""
    _need_c()
    _C.dsa_disable(_check_backend(backend))


def inject(kind: str, count: int = 1, param: int = 0) -> None:
    """Inject faults into the model (tests): see ``kvtier._C.dsa_model_inject``.

    kind: ``enqcmd_retry``, ``page_fault`` (param = byte offset),
    ``bof_flag``, ``cc_flag``, ``stale_reserved``, ``xfer_erange`` (param =
    device max transfer in bytes), ``reject_all`` (param = status), ``hang``
    (accepted, never completed; param > 0 = nanoseconds after which the
    model writes the completion record anyway, touching no data);
    count = -1 for every descriptor.
    """
    _need_c()
    _C.dsa_model_inject(kind, count, param)


def configure(backend: str, *, min_size: Optional[int] = None, wait: Optional[str] = None,
              sleep_ns: Optional[int] = None, cache_control: Optional[bool] = None,
              timeout: Optional[float] = None) -> None:
    """Tune an engine: min_size (bytes, CPU below it), wait (spin|yield|sleep),
    sleep_ns (nanoseconds per poll in ``sleep`` mode), cache_control (CC flag on
    COPY_CRC), timeout (seconds to wait for one descriptor's completion record,
    1e-6..86400; default 1.0 or ``KVTIER_DSA_TIMEOUT_MS``). LookupError when the
    engine does not exist; ValueError / TypeError for bad values."""
    _need_c()
    _C.dsa_configure(_check_backend(backend), min_size=min_size, wait=wait,
                     sleep_ns=sleep_ns, cache_control=cache_control, timeout=timeout)


def status(backend: str) -> Dict[str, Any]:
    """State of one engine (see ``kvtier._C.dsa_status``).

    Keys: backend, tried, enabled, reason (str); with an engine also wq, portal,
    min_size (bytes), wait, timeout (seconds per descriptor), selfcheck,
    engine_reason and counters, whose ``wait_ns`` is in nanoseconds and
    ``bytes_on_device`` in bytes (the others are counts of descriptors or ops).
    """
    _need_c()
    return _C.dsa_status(_check_backend(backend))


def _default_backend() -> Optional[str]:
    import kvtier

    if kvtier.crc32c_backend in BACKENDS:
        return kvtier.crc32c_backend
    for b in BACKENDS:
        if _C.dsa_status(b).get("enabled"):
            return b
    return None


def counters(backend: Optional[str] = None) -> Dict[str, Any]:
    """Counters of a DSA engine as a dict (for Prometheus export by the tier).

    backend None: the active CRC backend if it is a DSA one, else the first
    enabled DSA engine; ``{}`` when there is none. Keys: :data:`COUNTER_NAMES`
    (``wait_ns`` in nanoseconds, ``bytes_on_device`` in bytes) plus
    ``cpu_redo_by_status`` = {``DSA_COMP_*`` name in lower case: count}
    and ``backend``.
    """
    if _C is None:
        return {}
    if backend is None:
        backend = _default_backend()
        if backend is None:
            return {}
    c = _C.dsa_counters(_check_backend(backend))
    if c is None:
        return {}
    c["backend"] = backend
    return c


#: Prometheus counters exported by the tier (:func:`prometheus_counters`):
#: metric name -> (key of :func:`counters`, scale, help). Exposed as ``<name>_total``.
PROMETHEUS_COUNTERS = (
    ("kvtier:dsa_descriptors_submitted", "descriptors_submitted", 1,
     "DSA descriptors submitted (CRCGEN / COPY_CRC, one per chunk of at most max_transfer_size)."),
    ("kvtier:dsa_completed_on_device", "completed_on_device", 1,
     "DSA descriptors completed successfully on the device."),
    ("kvtier:dsa_cpu_redo", "cpu_redo_total", 1,
     "DSA descriptors whose CRC was redone on the CPU (any status but success or resumed page fault)."),
    ("kvtier:dsa_page_fault_resumes", "page_fault_resumes", 1,
     "DSA page faults (block_on_fault off) resumed from bytes_completed."),
    ("kvtier:dsa_enqcmd_retries", "enqcmd_retries", 1,
     "ENQCMD submissions retried because the shared WQ was full (ZF=1)."),
    ("kvtier:dsa_wait_seconds", "wait_ns", 1e-9,
     "Seconds spent waiting for DSA completion records."),
    ("kvtier:dsa_bytes_on_device", "bytes_on_device", 1,
     "Bytes whose CRC32C the DSA device computed."),
    ("kvtier:dsa_below_min_size", "below_min_size", 1,
     "CRCs computed on the CPU because the buffer was below the DSA min size."),
    ("kvtier:dsa_submit_failures", "submit_failures", 1,
     "DSA submissions that failed (CRC then computed on the CPU)."),
    ("kvtier:dsa_timeouts", "timeouts", 1,
     "DSA descriptors that did not complete within the timeout (CRC redone on the CPU, engine disabled)."),
    ("kvtier:dsa_commit_bytes_on_device", "commit_bytes_on_device", 1,
     "Bytes of checksummed loads copied into the caller's buffer and checksummed by DSA COPY_CRC."),
    ("kvtier:dsa_commit_bytes_cpu", "commit_bytes_cpu", 1,
     "Bytes of those COPY_CRC commit copies the CPU did instead (refused, failed or timed-out descriptors)."),
)
PROMETHEUS_CPU_REDO_BY_STATUS = "kvtier:dsa_cpu_redo_by_status"


def prometheus_counters(backend: str) -> Dict[str, Any]:
    """The engine's counters as a counter source for
    :meth:`kvtier.metrics.TieringMetricsTracker.add_counter_source`.

    ``{name: (help, value)}`` for each of :data:`PROMETHEUS_COUNTERS` (wait in seconds),
    plus ``kvtier:dsa_cpu_redo_by_status: (help, {status: count}, "status")`` (status =
    ``DSA_COMP_*`` name in lower case, linux/idxd.h). All zero (no by-status samples)
    while ``backend`` ("dsa" or "dsa-model") has no engine, e.g. before its lazy enable
    or in a fork()ed child. Never raises for a valid backend name.
    """
    c = counters(_check_backend(backend))
    out: Dict[str, Any] = {name: (doc, c.get(key, 0) * scale) for name, key, scale, doc in PROMETHEUS_COUNTERS}
    out[PROMETHEUS_CPU_REDO_BY_STATUS] = (
        "DSA descriptors redone on the CPU, by completion status (DSA_COMP_* name in lower case).",
        dict(c.get("cpu_redo_by_status") or {}), "status")
    return out


def reset_counters(backend: str) -> None:
    """Zero an engine's counters."""
    _need_c()
    _C.dsa_reset_counters(_check_backend(backend))


def copy_crc(dst, src, value: int = 0, backend: Optional[str] = None) -> int:
    """Copy ``src`` into ``dst`` (writable, same length in bytes) and return
    the CRC32C of ``src`` chained from ``value``, using fused COPY_CRC
    descriptors on the DSA engine (default: the active/enabled one; CPU
    when there is none). ValueError for different lengths."""
    _need_c()
    if backend is None:
        backend = _default_backend() or "dsa"
    return _C.dsa_copy_crc(_check_backend(backend), dst, src, value)


def model_stats() -> Optional[Dict[str, int]]:
    """Device-side statistics of the model, or None without one: executed,
    dropped (dedicated WQ overflow, must stay 0), enqcmd_rejected,
    faults_injected, faults_resolved, hung; all counts of descriptors (the
    model keeps no times: waits are in :func:`counters`' ``wait_ns``, ns)."""
    _need_c()
    return _C.dsa_model_stats()


def _fmt_counters(c: Dict[str, Any]) -> str:
    redo = c.get("cpu_redo_by_status") or {}
    redo_s = ", ".join(f"{k}={v}" for k, v in sorted(redo.items()))
    return (f"descriptors={c['descriptors_submitted']} on_device={c['completed_on_device']} "
            f"page_fault_resumes={c['page_fault_resumes']} enqcmd_retries={c['enqcmd_retries']} "
            f"cpu_redo={c['cpu_redo_total']}" + (f" ({redo_s})" if redo_s else "")
            + f" timeouts={c['timeouts']}"
            + f" below_min_size={c['below_min_size']} submit_failures={c['submit_failures']}"
            f" wait={c['wait_ns'] / 1e6:.3f} ms; load commit copies (COPY_CRC): {c['commit_ops']},"
            f" {c['commit_bytes_on_device']} B on the device, {c['commit_bytes_cpu']} B on the CPU")


def _wq_s(w: Dict[str, Any]) -> str:
    return (f"{w['name']} {w['mode']} size {w['size']} max_transfer_size {w['max_transfer_size']}"
            f" block_on_fault {int(w['block_on_fault'])}")


def describe() -> str:
    """One plain line per DSA engine for ``kvtier info``.

    - ``no DSA devices found (/sys/bus/dsa/devices absent)``
    - ``WQ found but not usable: wq0.0: state=disabled; ...``
    - ``enabled: dsa (wq0.1 shared size 128 ..., enqcmd); counters: ...``
    - ``enabled: dsa-model (software model, not hardware); counters: ...``
    """
    if _C is None:
        return "DSA: unavailable (the kvtier C core is not built)"
    lines = []
    dev = _C.dsa_status("dsa")
    if dev.get("enabled"):
        lines.append(f"enabled: dsa ({_wq_s(dev['wq'])}, {dev['portal']}, min_size {dev['min_size']} B);"
                     f" counters: {_fmt_counters(dev['counters'])}")
    else:
        d = _C.dsa_discover()
        if not d["devices_dir_present"]:
            lines.append(f"no DSA devices found ({d['devices_dir']} absent)")
        elif not d["wqs"]:
            lines.append(f"no DSA devices found (no WQs under {d['devices_dir']})")
        elif dev.get("tried") and dev.get("reason"):
            lines.append(dev["reason"])
        elif d["chosen"] is None:
            why = "; ".join(f"{w['name']}: {w['reason']}" for w in d["wqs"])
            lines.append(f"WQ found but not usable: {why}")
        else:
            lines.append(f"WQ usable: {d['chosen']} (not enabled; set KVTIER_CRC32C_BACKEND=dsa)")
    model = _C.dsa_status("dsa-model")
    if model.get("enabled"):
        lines.append(f"enabled: dsa-model (software model, not hardware; {_wq_s(model['wq'])});"
                     f" counters: {_fmt_counters(model['counters'])}")
    elif model.get("tried") and model.get("reason"):
        lines.append(model["reason"])
    return "\n".join(lines)


__all__ = [
    "BACKENDS", "COUNTER_NAMES", "discover", "enable", "enable_model", "disable", "inject",
    "configure", "status", "counters", "reset_counters", "copy_crc", "model_stats", "describe",
    "PROMETHEUS_COUNTERS", "PROMETHEUS_CPU_REDO_BY_STATUS", "prometheus_counters",
]
