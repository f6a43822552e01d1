"""The tier engine: the one job engine under every kvtier tier API.

Both :class:`kvtier.manager.FileSystemTierManager` (standalone, tuple keys) and
:class:`kvtier.vllm.KvtierTier` (vLLM 0.33's ``SecondaryTierManager``, bytes keys) are
thin shells over :class:`TierEngine`.  The engine knows nothing of either key type: the
shell gives it a ``path_of(key) -> str`` function and opaque keys, and gets back
:class:`Finished` records carrying the same keys.

Pieces, each in one place:

- **Pool**: two queues (loads, stores) and two groups of threads.  Read-priority threads
  (``n_read_threads``) take a load first and a store when no load is queued;
  write-priority threads (``n_write_threads``) do the reverse, so neither queue starves
  and an idle group helps the busy one.
- **Jobs**: :meth:`TierEngine.submit` checks the job id is not in use, computes the
  paths and queues a :class:`Job`.  :meth:`TierEngine.run_job` runs one job: one call
  into ``kvtier.io.batch_store_block`` / ``batch_load_block`` (the C core runs the whole
  batch without the GIL), timed, its OSError turned into a partial-keep count.
- **Results**: each submitted job yields exactly one :class:`Finished` from
  :meth:`TierEngine.take_finished` (unless :meth:`TierEngine.shutdown` discarded it
  before it ran: then its id is in shutdown's return value instead).
- **Counters**: :class:`Counters`, the tier's totals; :meth:`Counters.count_job` is the
  one place where a finished job is counted, :meth:`Counters.snapshot` is what the
  standalone metrics tracker (:mod:`kvtier.metrics`) and the vLLM adapter read.

Partial keep: a load that fails at block ``n`` (``OSError.num_succeeded == n``) keeps its
first ``n`` keys (``Finished.n_ok``); block ``n`` and the rest are misses.  Files are
removed only by the I/O layer and only when provably bad (docs/design.md, "On-disk
contract"); a transient error keeps the file.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)


def _io():
    # looked up per call: tests replace kvtier.io.batch_load_block to gate jobs
    from kvtier import io as kio

    return kio


# ---------------------------------------------------------------------- counters

#: Counter names of :meth:`Counters.snapshot`, with their meaning.  Bytes in bytes,
#: times in seconds (I/O time: from the start of a job's I/O call to its end).
COUNTERS: Dict[str, str] = {
    "store_jobs": "store (cascade) jobs finished, failed ones included",
    "load_jobs": "load (promotion) jobs finished, failed ones included",
    "store_failures": "store jobs that failed",
    "load_failures": "load jobs that failed (partial keep included)",
    "bytes_written": "bytes of blocks stored by successful store jobs",
    "bytes_read": "bytes of blocks loaded (a failed load counts the blocks it kept)",
    "write_time": "I/O seconds of successful store jobs",
    "read_time": "I/O seconds of load jobs that loaded at least one block",
    "checksum_failures": "load jobs stopped by a block that failed CRC32C verification",
    "checksum_retries": "blocks re-read once after a first CRC32C mismatch",
    "blocks_condemned": "blocks condemned by a second CRC32C mismatch (file removed)",
}


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

    def count_job(self, is_promotion: bool, success: bool, n_keys: int, n_ok: int,
                  block_bytes: int, io_time: Optional[float], checksum_failed: bool = False,
                  checksum_retries: int = 0) -> None:
        """Count one finished job of ``n_keys`` blocks of ``block_bytes`` bytes, ``n_ok``
        of them transferred; ``io_time`` seconds (None: not measured)."""
        v = self._v
        with self._lock:
            v["load_jobs" if is_promotion else "store_jobs"] += 1
            v["checksum_retries"] += checksum_retries
            count = n_keys
            if not success:
                v["load_failures" if is_promotion else "store_failures"] += 1
                if checksum_failed:
                    v["checksum_failures"] += 1
                    v["blocks_condemned"] += 1
                if not (is_promotion and n_ok):
                    return
                count = n_ok
            v["bytes_read" if is_promotion else "bytes_written"] += count * block_bytes
            if io_time is not None:
                v["read_time" if is_promotion else "write_time"] += io_time

    def add(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to counter ``name`` (KeyError for an unknown name)."""
        with self._lock:
            if name not in self._v:
                raise KeyError(name)
            self._v[name] += amount

    def snapshot(self) -> Dict[str, float]:
        """A copy of every counter: ``{name: value}`` (names: :data:`COUNTERS`)."""
        with self._lock:
            return dict(self._v)


# ---------------------------------------------------------------------- jobs

@dataclass
class Job:
    """A queued job: ``keys[i]`` (opaque to the engine) <-> file ``paths[i]`` <-> bytes
    ``[offsets[i], offsets[i] + block_size)`` of the engine's view."""

    job_id: Hashable
    keys: Tuple[Any, ...]
    paths: List[str]
    offsets: List[int]
    is_promotion: bool
    submitted_at: float = 0.0


@dataclass(frozen=True)
class Finished:
    """The outcome of one job, produced once by :meth:`TierEngine.run_job`.

    ``keys``: all the job's keys, in order; ``n_ok``: how many were transferred (all on
    success; on failure the blocks before the failing one: for a load the partial keep,
    for a store the blocks already stored).  ``io_time``: seconds of the I/O call; ``elapsed``: seconds from
    submission to completion (queueing + I/O).  ``error``: the exception that failed
    the job, None on success.  ``checksum_failed``: the job stopped at a block that
    failed CRC32C verification (file removed).  ``checksum_retries``: blocks re-read
    once after a first mismatch.
    """

    job_id: Hashable
    is_promotion: bool
    keys: Tuple[Any, ...]
    n_ok: int
    io_time: float
    elapsed: float
    error: Optional[BaseException] = field(default=None, compare=False)
    checksum_failed: bool = False
    checksum_retries: int = 0

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def successful_keys(self) -> Tuple[Any, ...]:
        return self.keys[: self.n_ok]


class TierEngine:
    """Runs store and load jobs between ``view`` and files, on a pool of threads.

    Args:
        view: flat (1-D, format ``"B"``) C-contiguous memoryview of the primary buffer.
        block_size: bytes per block.
        path_of: ``key -> str`` file path of a block (called in :meth:`submit`).
        n_read_threads / n_write_threads: read- and write-priority threads, >= 1.
        checksum / use_o_direct / durable: passed to every ``kvtier.io`` batch call.
        counters: where finished jobs are counted (default a new :class:`Counters`).
        thread_name: thread name prefix (threads are ``<prefix>_r<i>`` / ``_w<i>``).

    Thread-safety: every method may be called from any thread.  Methods never block on
    I/O except :meth:`drain` and :meth:`shutdown` (``wait=True``).
    """

    def __init__(self, view: memoryview, block_size: int, path_of: Callable[[Any], str], *,
                 n_read_threads: int = 16, n_write_threads: int = 16, checksum: bool = False,
                 use_o_direct: bool = True, durable: bool = False,
                 counters: Optional[Counters] = None, thread_name: str = "kvtier_fs") -> None:
        self.view = view
        self.block_size = block_size
        self.path_of = path_of
        self.checksum = checksum
        self.use_o_direct = use_o_direct
        self.durable = durable
        self.counters = counters if counters is not None else Counters()
        self._cond = threading.Condition(threading.Lock())
        self._load_q: "collections.deque[Job]" = collections.deque()
        self._store_q: "collections.deque[Job]" = collections.deque()
        self._finished: "collections.deque[Finished]" = collections.deque()
        self._live: set = set()  # submitted, not yet returned by take_finished
        self._inflight = 0  # queued or running
        self._stop = False
        self.threads: List[threading.Thread] = []
        for i in range(n_read_threads):
            self._start_thread(f"{thread_name}_r{i}", True)
        for i in range(n_write_threads):
            self._start_thread(f"{thread_name}_w{i}", False)

    # ------------------------------------------------------------------ submit / collect
    def submit(self, job_id: Hashable, keys: Sequence[Any], offsets: Sequence[int],
               is_promotion: bool) -> None:
        """Queue a job (non-blocking).  ``offsets``: byte offsets into the view, already
        checked by the caller.  A job without keys finishes at once.  Raises ValueError
        for a job id not yet collected, RuntimeError after :meth:`shutdown`, and whatever
        ``path_of`` raises (nothing queued)."""
        keys = tuple(keys)
        paths = [self.path_of(k) for k in keys]
        job = Job(job_id, keys, paths, list(offsets), is_promotion)
        with self._cond:
            if self._stop:
                raise RuntimeError("the tier is shut down")
            if job_id in self._live:
                raise ValueError(f"job id {job_id!r} is already in use by a job not yet collected")
            self._live.add(job_id)
            job.submitted_at = time.monotonic()
            if not keys:
                self._finished.append(Finished(job_id, is_promotion, (), 0, 0.0, 0.0))
                return
            self._inflight += 1
            (self._load_q if is_promotion else self._store_q).append(job)
            self._cond.notify()

    def take_finished(self) -> List[Finished]:
        """The jobs finished since the last call, in completion order; their ids become
        free for reuse."""
        out = []
        with self._cond:
            while self._finished:
                r = self._finished.popleft()
                self._live.discard(r.job_id)
                out.append(r)
        return out

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        return self._inflight

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Block until no job is queued or running (their results stay available from
        :meth:`take_finished`).  False if ``timeout`` (seconds) expired first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout)

    def shutdown(self, wait: bool = True) -> List[Hashable]:
        """Stop: queued jobs are discarded (never run, never reported), running jobs
        finish, threads are joined (``wait``).  Returns the discarded job ids.
        Idempotent; later submits raise RuntimeError."""
        with self._cond:
            discarded = [j.job_id for j in list(self._load_q) + list(self._store_q)]
            self._inflight -= len(discarded)
            for jid in discarded:
                self._live.discard(jid)
            self._load_q.clear()
            self._store_q.clear()
            self._stop = True
            self._cond.notify_all()
        if wait:
            for t in self.threads:
                if t is not threading.current_thread():
                    t.join()
        return discarded

    @property
    def is_shut_down(self) -> bool:
        return self._stop

    # ------------------------------------------------------------------ pool
    def _start_thread(self, name: str, load_priority: bool) -> None:
        t = threading.Thread(target=self._worker, args=(load_priority,), name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def _worker(self, load_priority: bool) -> None:
        first, second = (self._load_q, self._store_q) if load_priority else (self._store_q, self._load_q)
        while True:
            with self._cond:
                while not (self._stop or first or second):
                    self._cond.wait()
                if self._stop:
                    return
                job = first.popleft() if first else second.popleft()
            result = self.run_job(job)
            with self._cond:
                self._finished.append(result)
                self._inflight -= 1
                self._cond.notify_all()

    # ------------------------------------------------------------------ the job
    def run_job(self, job: Job) -> Finished:
        """Run one job: one batch call into ``kvtier.io``, then count it.  Never raises:
        an error becomes ``Finished.error`` (an OSError's ``num_succeeded`` gives the
        partial keep)."""
        kio = _io()
        n = len(job.keys)
        err: Optional[BaseException] = None
        n_ok, checksum_failed, retries = n, False, 0
        t0 = time.monotonic()
        try:
            if job.is_promotion:
                ret = kio.batch_load_block(job.paths, self.view, job.offsets, self.block_size,
                                           use_o_direct=self.use_o_direct, checksum=self.checksum)
                retries = int(ret or 0)
            else:
                extra = {"durable": True} if self.durable else {}
                kio.batch_store_block(job.paths, self.view, job.offsets, self.block_size,
                                      use_o_direct=self.use_o_direct, checksum=self.checksum, **extra)
        except OSError as e:
            err = e
            n_ok = max(0, min(int(getattr(e, "num_succeeded", 0) or 0), n))
            checksum_failed = bool(getattr(e, "checksum_failed", False))
            retries = int(getattr(e, "num_retried", 0) or 0)
        except Exception as e:  # BufferError/ValueError from the I/O layer: nothing moved
            err = e
            n_ok = 0
        t1 = time.monotonic()
        if err is not None:
            logger.warning("%s job %r failed at block %d of %d: %s",
                           "load" if job.is_promotion else "store", job.job_id, n_ok, n, err)
        result = Finished(job.job_id, job.is_promotion, job.keys, n_ok, t1 - t0,
                          t1 - job.submitted_at, err, checksum_failed, retries)
        try:
            self.counters.count_job(job.is_promotion, err is None, n, n_ok, self.block_size,
                                    result.io_time, checksum_failed, retries)
        except Exception:  # counting must never break the data path
            logger.exception("counting a finished job failed")
        return result
