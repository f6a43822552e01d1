"""A tier's counters: their names and meanings (:data:`COUNTERS`), the counting rules of a
finished job (:meth:`Counters.count_job`) and the keys of failed I/O calls
(:func:`io_error_key`). The engine counts into them; the standalone metrics tracker
(:mod:`kvtier.metrics`) and the vLLM shell read them. No I/O, no threads but a lock.
"""
from __future__ import annotations

import errno
import threading
from typing import Callable, Dict, Mapping, Optional, Tuple

from kvtier._blockio import policy as _policy
from kvtier._tier import capacity as _capacity

#: Counter names of :meth:`Counters.snapshot`, with their meaning.  Bytes in bytes,
#: times in seconds (I/O time: from the start of a job's I/O call to its end).
COUNTERS: Dict[str, str] = {
    "store_jobs": "store (cascade) jobs finished, failed ones included",
    "load_jobs": "load (promotion) jobs finished, failed ones included",
    "store_failures": "store jobs that failed",
    "load_failures": "load jobs that failed (partial keep included)",
    "bytes_written": "bytes of blocks written by successful store jobs (blocks already there, "
                     "counted in existing, write none)",
    "bytes_read": "bytes of blocks loaded (a failed load counts the blocks it kept)",
    "write_time": "I/O seconds of successful store jobs",
    "read_time": "I/O seconds of load jobs that loaded at least one block",
    "checksum_failures": "load jobs stopped by a block that failed CRC32C verification",
    "checksum_retries": "blocks re-read once after a first CRC32C mismatch",
    "blocks_condemned": "blocks condemned by a second CRC32C mismatch (file removed)",
    "load_timeouts": "load jobs reported failed at their deadline (io_timeout_s)",
    "store_timeouts": "store jobs reported failed at their deadline (io_timeout_s)",
    "jobs_refused": "jobs failed at once (EAGAIN) because the cap of stuck threads was reached",
    "lookup_timeouts": "lookups answered as misses at their deadline (lookup_timeout_s), or at once while an "
                       "earlier lookup is still stuck",
    "stuck_threads": "gauge: threads still in a filesystem call that outlived its deadline",
    "root_lost": "times the tier root was found deleted or replaced while running (restored)",
    "geometry_refused": "jobs refused because the root's kvtier.json records another block size (another "
                        "geometry on this root: nothing read or written)",
}
COUNTERS.update(_policy.COUNT_DOCS)  # the error policy's counters (kvtier._blockio.policy)
COUNTERS.update(_capacity.COUNTER_DOCS)  # a bounded root's (kvtier._tier.capacity, docs/capacity.md)

#: Prefix of the snapshot keys of failed I/O calls: ``io_error:<operation>:<ERRNO>``
#: (operation: kvtier._blockio.policy.OPERATIONS, or "none" for an error of no call, e.g. a
#: deadline's ETIMEDOUT; ERRNO: the errno's name).
IO_ERROR_PREFIX = "io_error:"

def io_error_key(exc: BaseException) -> str:
    """The snapshot key counting ``exc`` (an OSError of a batch call)."""
    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, str(code)) if code is not None else "unknown"
    return f"{IO_ERROR_PREFIX}{getattr(exc, 'operation', '') or 'none'}:{name}"


class Counters:
    """A tier's counters (names: :data:`COUNTERS`), thread-safe.

    :meth:`count_job` holds the counting rules (those of vLLM's
    ``TieringMetricsTracker`` for bytes, time and failures): a failed job counts one
    failure; a failed load that kept ``n`` blocks still counts their bytes and its
    time; a failed store counts no bytes.  A checksum failure counts once per job and
    one condemned block; an EBADMSG from the filesystem itself
    (``checksum_failed=False``) is not a checksum failure.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._v: Dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.stuck_gauge: Optional[Callable[[], int]] = None  # set by the engine: its stuck threads
        self.capacity_gauges: Optional[Callable[[], Dict[str, float]]] = None  # a bounded root's levels

    def count_job(self, is_promotion: bool, success: bool, n_keys: int, n_ok: int,
                  block_bytes: int, io_time: Optional[float], checksum_failed: bool = False,
                  checksum_retries: int = 0, policy_counts: Optional[Mapping[str, int]] = None,
                  error: Optional[BaseException] = None) -> None:
        """Count one finished job of ``n_keys`` blocks of ``block_bytes`` bytes, ``n_ok``
        of them transferred; ``io_time`` seconds (None: not measured).  ``policy_counts``:
        the batch call's ``counts=`` dict (:data:`kvtier._blockio.policy.COUNT_NAMES`); ``error``:
        the OSError that stopped it (counted under :func:`io_error_key`)."""
        v = self._v
        with self._lock:
            v["load_jobs" if is_promotion else "store_jobs"] += 1
            v["checksum_retries"] += checksum_retries
            for k, n in (policy_counts or {}).items():
                if k in v:
                    v[k] += n
            if isinstance(error, OSError):
                key = io_error_key(error)
                v[key] = v.get(key, 0) + 1
            count = n_keys
            if not success:
                v["load_failures" if is_promotion else "store_failures"] += 1
                if checksum_failed:
                    v["checksum_failures"] += 1
                    v["blocks_condemned"] += 1
                if not (is_promotion and n_ok):
                    return
                count = n_ok
            if not is_promotion:  # a block already on disk was skipped: no bytes written
                count -= min(count, int((policy_counts or {}).get("existing", 0)))
            v["bytes_read" if is_promotion else "bytes_written"] += count * block_bytes
            if io_time is not None:
                v["read_time" if is_promotion else "write_time"] += io_time

    def add(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to counter ``name`` (KeyError for an unknown name)."""
        with self._lock:
            if name not in self._v:
                raise KeyError(name)
            self._v[name] += amount

    def io_errors(self) -> Dict[Tuple[str, str], float]:
        """``{(operation, ERRNO name): count}`` of the failed I/O calls counted so far."""
        with self._lock:
            return {tuple(k[len(IO_ERROR_PREFIX):].split(":", 1)): n for k, n in self._v.items()
                    if k.startswith(IO_ERROR_PREFIX)}

    def snapshot(self) -> Dict[str, float]:
        """A copy of every counter: ``{name: value}`` (names: :data:`COUNTERS`, plus one
        ``io_error:<operation>:<ERRNO>`` key per kind of failed I/O call seen;
        ``stuck_threads`` is a gauge, read from the engine feeding these counters; the
        ``capacity_*`` gauges are read from a bounded root's capacity, 0 without one)."""
        with self._lock:
            snap = dict(self._v)
        gauge = self.stuck_gauge
        snap["stuck_threads"] = gauge() if gauge is not None else 0
        if self.capacity_gauges is not None:  # capacity_* levels (kvtier._tier.capacity.Handle.gauges)
            snap.update(self.capacity_gauges())
        return snap
