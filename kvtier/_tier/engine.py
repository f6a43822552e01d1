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
- **Deadlines** (``io_timeout_s`` > 0): each running job has a deadline and a
  :class:`kvtier.io.JobState`; a watchdog thread reports a job past its deadline as failed
  (ETIMEDOUT) through ``JobState.expire()``, so the late I/O writes nothing more, and
  replaces the thread stuck in it (up to ``max_stuck`` stuck threads, twice the pool: N+1
  stalls on N threads leave N-1 serving; at the cap new jobs fail fast with EAGAIN).
  Lookups run off-thread under a deadline of their own
  (``lookup_timeout_s``, short: a lookup's caller is waiting) and never pile up on a
  hung filesystem: while one is stuck, the next answer misses at once
  (:mod:`kvtier._tier.deadline`).  docs/tier.md, "Deadlines".
- **Counters**: :class:`kvtier._tier.counters.Counters`, the tier's totals; :meth:`Counters.count_job` is the
  one place where a finished job is counted, :meth:`Counters.snapshot` is what the
  standalone metrics tracker (:mod:`kvtier.metrics`) and the vLLM adapter read.

Partial keep: a load that fails at block ``n`` (``OSError.num_succeeded == n``) keeps its
first ``n`` keys (``Finished.n_ok``); block ``n`` and the rest are misses.  Every failed job's
error carries its ``num_succeeded`` (``Finished`` sets it: a deadline, a refusal, a dropped
store too).  A load reported at its deadline (or cancelled by ``shutdown(wait=False)``) is a
failed load like any other: it keeps the blocks its job state had counted when the deadline
(the cancel) came (``JobState.blocks_done``, read before ``expire()``: each block whole in
the caller's view and verified by then), and its late I/O writes nothing more once
``expire()`` won, so those rows stay exactly as reported.  A block that ends while
``expire()`` waits for its commit section (the direct landing's read, which may have hung
for as long as the filesystem liked) does not count, nor does any block after it: the
error names the block in flight at the deadline.  A job the watchdog took at its deadline
is reported by it, failed, even when its I/O returns while ``expire()`` waits.  Files are
removed only by the I/O layer and only when provably bad (docs/design.md, "On-disk
contract"); a transient error keeps the file.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import kvtier.io as _kio
from kvtier._blockio.jobstate import COMMITTING, EXPIRED, LIVE, JobState
from kvtier._tier.counters import Counters
from kvtier._tier.deadline import DEFAULT_IO_TIMEOUT_S, DEFAULT_LOOKUP_TIMEOUT_S, OffThread, check_timeout, timed_out

logger = logging.getLogger(__name__)

#: At most one warning per this many seconds about unverified loads (and about lookups
#: answered as misses at once), per tier.
WARN_INTERVAL = 60.0


class RateLimitedWarnings:
    """At most one WARNING (or ``level``) per ``interval`` seconds for each kind of message of
    a tier; the messages held back meanwhile are counted, and the next one logged says how
    many (so a full filesystem failing every store job logs one line a minute, not one a
    job).  ``log``: the logger (default this module's)."""

    def __init__(self, interval: float = WARN_INTERVAL, log: Optional[logging.Logger] = None) -> None:
        self.interval = interval
        self.log = log or logger
        self._lock = threading.Lock()  # pool threads log concurrently
        self._last: Dict[str, float] = {}
        self._held: Dict[str, int] = {}

    def warn(self, kind: str, msg: str, *args: Any, level: int = logging.WARNING, exc_info: bool = False) -> bool:
        """Log ``msg % args`` at ``level`` (with the exception being handled: ``exc_info``)
        unless a ``kind`` message was logged less than ``interval`` ago (then counted); True
        if logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            msg += " (and %d more %s message(s) in the last %.0f s, not logged)"
            args += (held, kind, now - last)
        self.log.log(level, msg, *args, exc_info=exc_info or None)
        return True

    def flush(self) -> None:
        """Log the count of every kind held back since its last message (at shutdown: else
        the log of a tier that stops would show one failure of many)."""
        with self._lock:
            held, self._held = self._held, {}
        for kind, n in held.items():
            self.log.warning("%d more %s message(s) since the last one logged, not logged", n, kind)



# ---------------------------------------------------------------------- jobs

def check_no_duplicates(job_id: Hashable, keys: Sequence[Any], paths: Sequence[str], offsets: Sequence[int],
                        is_promotion: bool, block_size: int) -> None:
    """ValueError naming the first duplicate of a job, if any: a load with two blocks
    into one row of the buffer (the same offset twice: which block would the row hold?),
    or a store with one key twice (the same file twice: stored twice, counted twice).  A
    load of one key into two rows, or a store of one row under two keys, is allowed."""
    seen: Dict[Any, int] = {}
    items = offsets if is_promotion else paths
    if len(set(items)) == len(items):  # the common case: one C-level pass
        return
    for i, x in enumerate(items):
        j = seen.setdefault(x, i)
        if j == i:
            continue
        if is_promotion:
            raise ValueError(f"load job {job_id!r}: blocks {j} and {i} ({keys[j]!r} and {keys[i]!r}) both load "
                             f"into row {x // block_size} (byte offset {x}): duplicate chunk_id; nothing done")
        raise ValueError(f"store job {job_id!r}: key {keys[i]!r} twice (blocks {j} and {i}, file {x}): "
                         f"duplicate key; nothing done")


class JobRefused(OSError):
    """Raised by a ``before_job`` check to fail the job before any I/O (the OSError is the
    job's error; nothing read or written): e.g. the tier root records another block size."""


@dataclass(eq=False)  # identity: a running job is a member of the engine's set
class Job:
    """A queued job: ``keys[i]`` (opaque to the engine) <-> file ``paths[i]`` <-> bytes
    ``[offsets[i], offsets[i] + block_size)`` of the engine's view."""

    job_id: Hashable
    keys: Tuple[Any, ...]
    paths: List[str]
    offsets: List[int]
    is_promotion: bool
    submitted_at: float = 0.0
    state: Any = None  # kvtier.io.JobState while it runs under a deadline
    deadline: float = 0.0  # time.monotonic() seconds
    worker: Any = None  # the _Worker running it
    started_at: float = 0.0
    returned: bool = False  # its I/O call returned (set under the engine's lock)
    view: Any = None  # the engine's view, taken with the job and dropped when its I/O call returns
    reserved: int = 0  # bytes a bounded root's capacity reserved for this store at admission
    past_deadline: bool = False  # the watchdog took it at its deadline: reported by it, never by its worker
    split: Any = None  # the _Split this job is a part of (a large load run on several threads), or None
    part: int = 0  # its index among the split's parts
    first: int = 0  # the index of its first block in the job the caller submitted


@dataclass(frozen=True)
class Finished:
    """The outcome of one job, produced once by :meth:`TierEngine.run_job`.

    ``keys``: all the job's keys, in order; ``n_ok``: how many were transferred (all on
    success; on failure the blocks before the failing one: for a load the partial keep,
    the blocks loaded and verified while it was live when it failed at its deadline; for a
    store the blocks already stored, none when it failed at its deadline).  ``io_time``: seconds of the I/O call; ``elapsed``: seconds from
    submission to completion (queueing + I/O).  ``error``: the exception that failed
    the job, None on success.  ``checksum_failed``: the job stopped at a block that
    failed CRC32C verification (file removed).  ``checksum_retries``: blocks re-read
    once after a first mismatch.

    Made with an ``error``, it sets ``error.num_succeeded = n_ok``: every failed job's
    error carries its keep, as a batch call's OSError does (a deadline's TimeoutError, a
    refused or dropped job's error, a split job's merged one).
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
    policy_counts: Dict[str, int] = field(default_factory=dict, compare=False)  # the call's counts=

    def __post_init__(self) -> None:
        if self.error is not None:
            try:
                self.error.num_succeeded = self.n_ok
            except AttributeError:  # an exception type with __slots__: nothing to carry it
                pass

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def successful_keys(self) -> Tuple[Any, ...]:
        return self.keys[: self.n_ok]


_forks = 0
"""fork() calls that made this process (a child counts its parent's plus one): a tier
compares it with the value at its creation (:meth:`TierEngine._check_process`)."""


def _after_fork_in_child() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


SPLIT_LOAD_BLOCKS = 512
"""A load of at least twice this many blocks runs as parts of at least this many, one per
pool thread, up to the CPUs this process may use (``load_split_blocks``; 0: never split).
A job of many small blocks is bound by its per-block system calls on one thread (~2-3 µs
a 4 KiB block); parts on idle threads divide its wall time, at the cost of the parts'
own calls (a few µs each). docs/tier.md, "Split loads"."""


def split_parts(n_blocks: int, split_blocks: int, max_parts: int) -> int:
    """How many parts a load of ``n_blocks`` runs as (1: not split)."""
    if split_blocks <= 0:
        return 1
    return max(1, min(max_parts, n_blocks // split_blocks))


class _Split:
    """A load job run as parts (each a :class:`Job` of consecutive blocks, queued and run,
    deadline included, as any job), reported once, as one job, when every part has its
    result: the partial keep is the prefix of whole parts and the first failed part's own
    keep; a failed part makes the parts after it that have not started skip (their blocks
    could not be kept). Under the engine's lock."""

    __slots__ = ("job", "parts", "results", "left", "taken", "skipped", "failed", "expired", "check_lock",
                 "checked", "refused")

    def __init__(self, job: Job, n: int) -> None:
        self.job = job
        bounds = [len(job.keys) * i // n for i in range(n + 1)]
        self.parts = [Job(job.job_id, job.keys[a:b], job.paths[a:b], job.offsets[a:b], True,
                          job.submitted_at, split=self, part=i, first=a)
                      for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        self.results: List[Optional[Finished]] = [None] * n  # None: not reported, or skipped
        self.left = n  # parts not yet reported or skipped
        self.taken: set = set()  # parts a thread took
        self.skipped: set = set()  # parts never to run: a part before them failed
        self.failed = False  # a part has failed
        self.expired: set = set()  # parts reported at their deadline (ETIMEDOUT)
        # the shell's check before a job (before_job) runs once for the job, by its first part
        self.check_lock = threading.Lock()
        self.checked = False
        self.refused: Optional[BaseException] = None

    def chosen(self) -> int:
        """The index of the part whose error is the job's (the first that failed), or -1."""
        for i, r in enumerate(self.results):
            if r is None:  # skipped: only ever after a failed part
                break
            if r.error is not None:
                return i
        return -1

    def merged(self) -> Finished:
        """The job's one result from its parts': the keep and the error (its
        ``checksum_failed`` too) of the prefix up to the first failed part, as one call
        would have them; the retries and policy counts of every part that ran (parts after
        the failed one may have run meanwhile: what they did happened, a provably bad block
        they met is removed and counted, as a later job's would be)."""
        job, ran = self.job, [r for r in self.results if r is not None]
        i = self.chosen()  # -1: none failed, so none skipped
        n_ok = sum(r.n_ok for r in (self.results[:i + 1] if i >= 0 else self.results))
        err, ck = (self.results[i].error, self.results[i].checksum_failed) if i >= 0 else (None, False)
        counts: Dict[str, int] = {}
        for r in ran:
            for k, v in r.policy_counts.items():
                counts[k] = counts.get(k, 0) + v
        # each part's I/O ran from submitted + elapsed - io_time to submitted + elapsed (a
        # part cancelled before it started has no I/O: io_time 0)
        io = [r for r in ran if r.io_time > 0]
        end = max((r.elapsed for r in ran), default=0.0)
        span = max((r.elapsed for r in io), default=0.0) - min((r.elapsed - r.io_time for r in io), default=0.0)
        return Finished(job.job_id, True, job.keys, n_ok, span, end, err, ck,
                        sum(r.checksum_retries for r in ran), counts)


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
        io_timeout_s: deadline of a job, counted from the start of its I/O (seconds,
            > 0), or 0 for none (docs/tier.md, "Deadlines").
        load_split_blocks: a load of at least twice this many blocks runs as parts on
            several threads (:data:`SPLIT_LOAD_BLOCKS`; 0: never).
        lookup_timeout_s: deadline of a :meth:`lookup` (seconds, > 0, or 0 for none);
            None: :data:`kvtier._tier.deadline.DEFAULT_LOOKUP_TIMEOUT_S` (2 s), or
            ``io_timeout_s`` when that is shorter and not 0 (``io_timeout_s=0`` leaves the
            lookup's 2 s).
        root: the tier root, named by the errors of lookups and refused jobs.
        before_job: called on the job's thread before each job's I/O (the shell's check
            that its tier root is still there, :class:`kvtier._tier.startup.RootGuard`);
            an exception from it is logged, never raised.
        io: the block I/O the jobs call (``batch_load_block``, ``batch_store_block``,
            ``batch_lookup`` of the ``kvtier.io`` shape); default the :mod:`kvtier.io`
            module, whose functions are the active backend's (attributes read per call).

    Thread-safety: every method may be called from any thread.  Methods never block on
    I/O except :meth:`lookup` (at most ``lookup_timeout_s``), :meth:`drain` and
    :meth:`shutdown` (``wait=True``), and with a deadline those return once every job
    has a result, at most ``io_timeout_s`` after the last job started.
    """

    def __init__(self, view: memoryview, block_size: int, path_of: Callable[[Any], str], *,
                 n_read_threads: int = 16, n_write_threads: int = 16, checksum: bool = False,
                 use_o_direct: bool = True, durable: bool = False,
                 counters: Optional[Counters] = None, thread_name: str = "kvtier_fs",
                 io_timeout_s: float = DEFAULT_IO_TIMEOUT_S, root: str = "",
                 before_job: Optional[Callable[[], None]] = None,
                 lookup_timeout_s: Optional[float] = None, io: Any = None, landing: str = "bounce",
                 capacity: Any = None, load_split_blocks: int = SPLIT_LOAD_BLOCKS) -> None:
        self.io_timeout_s = check_timeout(io_timeout_s)
        self.io = _kio if io is None else io
        self.capacity = capacity  # kvtier._tier.capacity.Handle of a bounded root, or None
        self._forks, self._pid = _forks, os.getpid()
        if lookup_timeout_s is not None:
            self.lookup_timeout_s = check_timeout(lookup_timeout_s, "lookup_timeout_s")
        elif self.io_timeout_s > 0:  # a shorter job deadline shortens the lookup's
            self.lookup_timeout_s = min(self.io_timeout_s, DEFAULT_LOOKUP_TIMEOUT_S)
        else:  # io_timeout_s=0: no job deadline, but a lookup's caller still waits at most 2 s
            self.lookup_timeout_s = DEFAULT_LOOKUP_TIMEOUT_S
        self.warnings = RateLimitedWarnings()  # job failures, lookups answered at once, unverified loads
        self.root = root
        self.before_job = before_job
        self.view = view
        self.block_size = block_size
        self.path_of = path_of
        self.checksum = checksum
        self.use_o_direct = use_o_direct
        self.landing = landing  # where loads land: kvtier/_tier/landing.py
        self.load_split_blocks = load_split_blocks
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        self._max_parts = max(1, min(cpus, n_read_threads + n_write_threads))
        self.durable = durable
        # durable: paths whose durable store failed at a sync (P19: maybe published, not known
        # durable); lookups answer them as misses until a durable store of them succeeds,
        # which syncs the block there (P15), so the caller stores them again
        self._not_durable: set = set()
        self._not_durable_lock = threading.Lock()
        self.counters = counters if counters is not None else Counters()
        self.counters.stuck_gauge = lambda: self.stuck_threads
        if use_o_direct and block_size % 4096 == 0 and len(view):
            import numpy as np

            address = np.frombuffer(view, dtype=np.uint8).ctypes.data
            if address % 4096:
                logger.warning("the primary buffer starts %d bytes past a page: stores write straight from it, "
                               "so they are buffered, not O_DIRECT (counted as "
                               "buffered_unaligned); give a page-aligned buffer (an mmap) to keep O_DIRECT",
                               address % 4096)
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._watch = threading.Condition(lock)  # the watchdog's wake-ups
        self._load_q: "collections.deque[Job]" = collections.deque()
        self._store_q: "collections.deque[Job]" = collections.deque()
        self._finished: "collections.deque[Finished]" = collections.deque()
        self._live: set = set()  # submitted, not yet returned by take_finished
        self._inflight = 0  # queued or running
        self._stop = False
        self.threads: List[threading.Thread] = []
        self._thread_name = thread_name
        self._n_started = {True: 0, False: 0}  # threads started per group, for their names
        # deadlines: jobs running under a JobState, healthy threads per group (True:
        # read-priority) and their targets, threads stuck past a deadline, and the cap
        self._running: set = set()
        self._target = {True: n_read_threads, False: n_write_threads}
        self._healthy = {True: 0, False: 0}
        self._stuck = 0
        self._in_io = 0  # job threads in an I/O call under a deadline, stuck ones included
        # the cap of threads in a filesystem call (stuck ones included): twice the pool, so
        # the pool keeps all its threads serving while up to its size are stuck, and
        # some beyond (N+1 stalls on N threads leave N-1); at the cap jobs fail fast
        self.max_stuck = 2 * (n_read_threads + n_write_threads)
        # one stuck lookup is the cap: while the filesystem holds it, lookups answer
        # misses at once instead of queueing more threads (and callers) behind it
        self._lookups = OffThread(f"{thread_name}_lookup", max_stuck=1)
        self._workers: List[_Worker] = []
        for i in range(n_read_threads):
            self._start_thread(True)
        for i in range(n_write_threads):
            self._start_thread(False)
        self._watchdog: Optional[threading.Thread] = None
        if self.io_timeout_s:
            self._watchdog = threading.Thread(target=self._watch_deadlines, name=f"{thread_name}_watchdog",
                                              daemon=True)
            self._watchdog.start()

    @property
    def stuck_threads(self) -> int:
        """Threads still in a filesystem call that outlived its deadline (jobs and lookups)."""
        return self._stuck + self._lookups.stuck
    # ------------------------------------------------------------------ submit / collect
    def _check_process(self) -> None:
        """RuntimeError in a process forked after this tier was created: its pool,
        watchdog and lookup threads exist only in the parent, so a job queued here would
        never run and a drain would wait for nothing (docs/tier.md, "fork()")."""
        if self._forks != _forks:
            raise RuntimeError(f"this kvtier tier was created in process {self._pid}; a tier does not survive "
                               f"fork() (its threads stay in the parent): create it in the child "
                               f"(process {os.getpid()})")

    def submit(self, job_id: Hashable, keys: Sequence[Any], offsets: Sequence[int],
               is_promotion: bool) -> None:
        """Queue a job (non-blocking).  ``offsets``: byte offsets into the view, already
        checked by the caller.  A job without keys finishes at once.  Raises ValueError
        for a job id not yet collected, for a load with two blocks into one row (the same
        offset twice) or a store with one key twice (the same path twice), naming the
        duplicate (:func:`check_no_duplicates`); RuntimeError after :meth:`shutdown`, and
        whatever ``path_of`` raises.  An error leaves nothing queued, no byte moved and the
        job id free."""
        self._check_process()
        keys = tuple(keys)
        paths = [self.path_of(k) for k in keys]
        offsets = list(offsets)
        check_no_duplicates(job_id, keys, paths, offsets, is_promotion, self.block_size)
        job = Job(job_id, keys, paths, offsets, is_promotion)
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
            if self._stuck >= self.max_stuck:  # the filesystem holds the cap of threads
                result = self._refused(job)
                self._count(job, result)
                self._finished.append(result)
                return
            if self.capacity is not None and not is_promotion:  # a bounded root: dropped, never queued
                err, job.reserved = self.capacity.admit(len(keys), self.block_size)
                if err is not None:
                    result = Finished(job_id, False, keys, 0, 0.0, 0.0, err)
                    self._count(job, result)
                    self._finished.append(result)
                    return
            self._inflight += 1
            n = split_parts(len(keys), self.load_split_blocks, self._max_parts) if is_promotion else 1
            if n > 1:  # a large load: its parts on as many threads, reported as one job (_report)
                self._load_q.extend(_Split(job, n).parts)
                self._cond.notify(n)
            else:
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
        :meth:`take_finished`).  False if ``timeout`` (seconds) expired first.
        TypeError for a ``timeout`` that is not None or a number, ValueError for a
        negative or NaN one."""
        self._check_process()
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be None or a number of seconds, got {type(timeout).__name__}")
            if not timeout >= 0:
                raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout)

    def shutdown(self, wait: bool = True) -> List[Hashable]:
        """Stop: queued jobs are discarded (never run, never reported), running jobs
        finish or reach their deadline, threads are joined (``wait``) except those
        stuck in the filesystem past a deadline (left to end by themselves).  With a
        deadline, ``wait=True`` returns at most ``io_timeout_s`` after the last running
        job started, and ``wait=False`` expires the running jobs at once (reported
        failed, ECANCELED): once it returns, no job writes into the view or publishes a
        block, except a store already inside the rename of a block: that one is not
        cancelled, it finishes (or reaches its deadline) and is reported as what it is.
        Without a deadline nothing can be cancelled: running jobs go on (a load writes
        into its rows) until they end and are reported then.  Returns the discarded job
        ids.  Idempotent; later submits raise
        RuntimeError.

        The engine drops its reference to the view here; a job already running keeps its
        own until its I/O call returns (a thread stuck in a store's write syscall may still
        read the buffer, so the buffer's export lives as long as such a thread).  So once
        ``shutdown(wait=True)`` has returned with no thread stuck, or after
        ``shutdown(wait=False)`` once the last running I/O call has returned, nothing of
        the engine holds the buffer (its exporter, e.g. an mmap, can be closed)."""
        with self._cond:
            self._unreserve(self._store_q)
            queued = list(self._load_q) + list(self._store_q)
            self._load_q.clear()
            self._store_q.clear()
            discarded = []
            for j in queued:
                sp = j.split
                if sp is None or not (sp.taken or any(sp.results)):  # never ran: discarded
                    if sp is None or j.part == 0:  # a split job once (its part 0 is queued still)
                        discarded.append(j.job_id)
                elif j.part not in sp.skipped and sp.results[j.part] is None:  # not reached: the job ends short
                    err = OSError(errno.ECANCELED, f"load job {j.job_id!r} (at block {j.first} of "
                                  f"{len(sp.job.keys)}, named here) not started: shut down "
                                  f"({os.strerror(errno.ECANCELED)})", j.paths[0])
                    self._report(j, Finished(j.job_id, True, j.keys, 0, 0.0, time.monotonic() - j.submitted_at, err),
                                 queued=False)
            self._inflight -= len(discarded)
            for jid in discarded:
                self._live.discard(jid)
            self._stop = True
            # the engine's reference to the buffer: no job starts any more; a running one
            # (even stuck in a syscall) holds its own until its I/O call returns
            self.view = None
            self._cond.notify_all()
            self._watch.notify_all()
            running = [] if wait else list(self._running)
            self._running.difference_update(running)
        self._lookups.close()
        self._expire(running, errno.ECANCELED, "cancelled by shutdown(wait=False)")
        self.warnings.flush()
        if wait:
            with self._cond:  # every running job reported: finished, or expired by the watchdog
                self._cond.wait_for(lambda: self._inflight == 0)
                threads = [w.thread for w in self._workers if not w.stuck]
            if self._watchdog is not None:
                threads.append(self._watchdog)
            for t in threads:
                if t is not threading.current_thread():
                    t.join()
        return discarded

    @property
    def is_shut_down(self) -> bool:
        return self._stop

    # ------------------------------------------------------------------ pool
    def _start_thread(self, load_priority: bool) -> None:
        """A new healthy thread of group ``load_priority`` (caller holds the lock, or
        is the constructor)."""
        name = f"{self._thread_name}_{'r' if load_priority else 'w'}{self._n_started[load_priority]}"
        self._n_started[load_priority] += 1  # replacements continue the numbering
        w = _Worker(load_priority)
        w.thread = threading.Thread(target=self._worker, args=(w,), name=name, daemon=True)
        self._healthy[load_priority] += 1
        self._workers.append(w)
        w.thread.start()
        self.threads.append(w.thread)

    def _worker(self, w: "_Worker") -> None:
        first, second = (self._load_q, self._store_q) if w.load_priority else (self._store_q, self._load_q)
        while True:
            with self._cond:
                while True:
                    if self._stop:
                        self._healthy[w.load_priority] -= 1
                        return
                    if first or second:
                        if not self.io_timeout_s:
                            break
                        if self._stuck >= self.max_stuck:  # the cap: fail fast
                            self._fail_queued()
                            continue
                        # a slot, atomically: at most max_stuck threads in the filesystem
                        # (stuck ones included), so at most that many can get stuck
                        if self._in_io < self.max_stuck:
                            break
                    self._cond.wait()
                job = first.popleft() if first else second.popleft()
                if job.split is not None:
                    job.split.taken.add(job.part)
                job.view = self.view  # the thread's own reference: shutdown() drops the engine's
                if self.io_timeout_s:
                    self._in_io += 1
                    job.state, job.worker = JobState(), w
                    job.started_at = time.monotonic()
                    job.deadline = job.started_at + self.io_timeout_s
                    self._running.add(job)
                    self._watch.notify()
            result = self.run_job(job)
            with self._cond:
                job.returned = True
                if job.state is not None:
                    self._in_io -= 1
                self._running.discard(job)
                # else the watchdog reports it: it expired it, or took it at its deadline and
                # its expire() wins now that the I/O returned
                if job.state is None or (not job.past_deadline and job.state.finish()):
                    self._report(job, result)
                if w.stuck:  # back from a call that outlived its deadline
                    w.stuck = False
                    self._stuck -= 1
                    if self._healthy[w.load_priority] >= self._target[w.load_priority] or self._stop:
                        self._cond.notify_all()
                        return  # replaced meanwhile
                    self._healthy[w.load_priority] += 1
                self._cond.notify_all()
                if self._stop:
                    self._watch.notify()  # it ends once every job has a result

    # ------------------------------------------------------------------ deadlines
    def _watch_deadlines(self) -> None:
        """The watchdog: reports each running job past its deadline (once, through
        JobState.expire) and replaces the thread stuck in it."""
        lock = self._cond
        with lock:
            while not (self._stop and self._inflight == 0):
                now = time.monotonic()
                due = [j for j in self._running if j.deadline <= now]
                if not due:
                    nxt = min((j.deadline for j in self._running), default=None)
                    self._watch.wait(None if nxt is None else max(nxt - now, 0.001))
                    continue
                for j in due:
                    self._running.discard(j)
                    j.past_deadline = True  # its worker no longer reports it (_worker)
                lock.release()
                try:
                    self._expire(due, errno.ETIMEDOUT, "past its deadline (io_timeout_s)")
                finally:
                    lock.acquire()

    def _expire(self, jobs: List[Job], err_no: int, why: str) -> None:
        """Expire running ``jobs`` (taken out of ``_running``; lock not held: a load's
        expire() waits for its commit section, a copy) and report each that this call
        expired (the others finished first: their workers report them).  A cancel
        (ECANCELED, shutdown) never expires a store inside its rename: that job runs on
        (under its deadline) and its worker reports it as what it is."""
        if not jobs:
            return
        expired, renaming = [], []
        for j in jobs:
            # the count when the deadline (the cancel) came: the block in flight then is the
            # one the error names, and no block that ends later counts (a load's expire()
            # waits for its commit section, the direct landing's whole read)
            seen = j.state.blocks_done
            if err_no != errno.ECANCELED or j.is_promotion:
                if j.state.expire(wait_commit=j.is_promotion):
                    expired.append((j, seen))
                continue
            while True:  # a cancelled store: expired unless it is renaming a block
                if j.state.cancel():
                    expired.append((j, seen))
                elif j.state.state == COMMITTING:
                    renaming.append(j)
                elif j.state.state != LIVE:  # DONE: its worker reports it
                    break
                else:
                    continue  # the rename ended meanwhile: cancel again
                break
        with self._cond:
            for j, seen in expired:
                self._expired(j, err_no, why, seen)
            for j in renaming:  # runs on, watched by its deadline; its worker reports it
                if not j.returned:
                    self._running.add(j)
            self._watch.notify()
            self._cond.notify_all()

    def _expired(self, job: Job, err_no: int, why: str, seen: int) -> None:
        """Report ``job`` failed (``err_no``: ETIMEDOUT at its deadline, ECANCELED by
        shutdown; ``seen``: its job state's count read before expire()); its thread, if
        still in the I/O call, is stuck (lock held)."""
        now = time.monotonic()
        op = "load" if job.is_promotion else "store"
        # the block in flight when the deadline came: the job state counts the blocks a load
        # loaded / a store stored, and a batch goes block after block
        done = min(seen, job.state.blocks_done)
        at = max(0, min(done, len(job.keys) - 1))
        total = len(job.split.job.keys) if job.split is not None else len(job.keys)
        what = f"{op} job {job.job_id!r} (at block {job.first + at} of {total}, named here) {why}"
        if err_no == errno.ETIMEDOUT:
            err = timed_out(what, self.io_timeout_s, job.paths[at])
        else:
            err = OSError(err_no, f"{what} ({os.strerror(err_no)})", job.paths[at])
        if job.split is None:
            if err_no == errno.ETIMEDOUT:
                self.counters.add(f"{op}_timeouts")
            logger.warning("%s", err)
        elif err_no == errno.ETIMEDOUT:  # counted and logged once, if it is the job's error (_report)
            job.split.expired.add(job.part)
        # the partial keep: the blocks whole and verified when the deadline came (their rows
        # stay as they are now that expire() won; a store keeps none: its count only names
        # the block)
        n_ok = min(done, len(job.keys)) if job.is_promotion else 0
        result = Finished(job.job_id, job.is_promotion, job.keys, n_ok, now - job.started_at,
                          now - job.submitted_at, err)
        self._report(job, result)
        w = job.worker
        if not job.returned:  # the worker is still in the I/O call; it drops the result on return
            w.stuck = True
            self._stuck += 1
            self._healthy[w.load_priority] -= 1
            if self._stuck < self.max_stuck and not self._stop:
                self._start_thread(w.load_priority)
            if self._stuck >= self.max_stuck or self._healthy[True] + self._healthy[False] == 0:
                self._fail_queued()

    def _report(self, job: Job, result: Finished, queued: bool = True) -> None:
        """``job`` has its result (lock held): counted and made available; for a part of a
        split load, kept until every part has one, then the job's one result
        (:meth:`_Split.merged`). A failed part makes the parts after it that no thread took
        skip (taken out of the queue when ``queued``)."""
        sp = job.split
        if sp is None:
            self._count(job, result)
            self._finished.append(result)
            self._inflight -= 1
            return
        sp.results[job.part] = result
        sp.left -= 1
        if result.error is not None:
            sp.failed = True
            for p in sp.parts[job.part + 1:]:
                if p.part in sp.taken or p.part in sp.skipped or sp.results[p.part] is not None:
                    continue  # a thread runs it and reports it, or it is done with
                if queued:
                    self._load_q.remove(p)
                sp.skipped.add(p.part)  # never run, never reported
                sp.left -= 1
        if sp.left == 0:
            merged = sp.merged()
            chosen = sp.chosen()
            if chosen in sp.expired:
                self.counters.add("load_timeouts")
                logger.warning("%s", merged.error)
            elif merged.error is not None:  # the job's failure, once (a part's is logged at debug)
                self.warnings.warn("failed load job", "load job %r failed at block %d of %d (%s): %s", sp.job.job_id,
                                   merged.n_ok, len(sp.job.keys), getattr(merged.error, "operation", "") or "-",
                                   merged.error)
            self._count(sp.job, merged)
            self._finished.append(merged)
            self._inflight -= 1

    def _refused(self, job: Job) -> Finished:
        """The result of ``job`` failed at once, the cap of stuck threads reached (lock
        held; counted as refused; the caller reports it)."""
        self._unreserve([job])
        err = OSError(errno.EAGAIN, f"{self._stuck} threads of this tier are stuck in the filesystem past "
                      f"their deadline (cap {self.max_stuck}): job not started", self.root or job.paths[0])
        self.counters.add("jobs_refused")  # a split job once: its first refused part skips the rest
        self._cond.notify_all()
        return Finished(job.job_id, job.is_promotion, job.keys, 0, 0.0, time.monotonic() - job.submitted_at, err)

    def _fail_queued(self) -> None:
        """No healthy thread left: the queued jobs are refused (lock held)."""
        for q in (self._load_q, self._store_q):
            while q:
                job = q.popleft()
                self._report(job, self._refused(job))

    def _unreserve(self, jobs: Sequence[Job]) -> None:
        """Admitted stores that will never run give their reservation back."""
        for j in jobs:
            if j.reserved and self.capacity is not None:
                self.capacity.unrun(j.reserved)
                j.reserved = 0

    def lookup(self, paths: Sequence[str], block_size: int = 0) -> List[bool]:
        """Whether each path is a regular file (of ``block_size`` bytes when not 0; one
        ``kvtier.io.batch_lookup`` call).  With ``lookup_timeout_s`` the call runs on
        another thread and the caller waits at most that long: then every path is
        answered as a miss (False) and the thread left stuck in the filesystem; while it
        is stuck, later lookups answer misses at once without asking the filesystem.
        Each such answer counts one ``lookup_timeouts``."""
        self._check_process()
        try:
            found = self._lookups.call(self.io.batch_lookup, list(paths), block_size, timeout=self.lookup_timeout_s,
                                       what="lookup", path=self.root or (paths[0] if paths else ""))
        except TimeoutError as e:
            self.counters.add("lookup_timeouts")
            if getattr(e, "started", True):
                logger.warning("%s; lookups answer misses until it returns", e)
            else:
                self.warnings.warn("lookup", "%s: answered as misses at once", e)
            return [False] * len(paths)
        found = [bool(x) for x in found]
        if self._not_durable:
            with self._not_durable_lock:
                found = [f and p not in self._not_durable for f, p in zip(found, paths)]
        if self.capacity is not None:  # hits refresh recency, on the capacity thread
            self.capacity.touch_later([p for p, f in zip(paths, found) if f])
        return found

    # ------------------------------------------------------------------ the job
    def run_job(self, job: Job) -> Finished:
        """Run one job: one batch call into ``kvtier.io`` (with the job's JobState under
        a deadline).  Never raises: an error becomes ``Finished.error`` (an OSError's
        ``num_succeeded`` gives the partial keep).  Counted by the caller, once the
        job's result is known to stand (:meth:`_count`)."""
        kio = self.io
        js = {} if job.state is None else {"job_state": job.state}
        n = len(job.keys)
        err: Optional[BaseException] = None
        n_ok, checksum_failed, retries = n, False, 0
        refused: Optional[BaseException] = None
        if self.before_job is not None:
            sp = job.split
            if sp is None:
                refused = self._check_before_job()
            else:
                with sp.check_lock:  # once for the whole job (its counters and log lines once)
                    if not sp.checked:
                        sp.refused, sp.checked = self._check_before_job(), True
                    refused = sp.refused
        counts: Dict[str, int] = {}
        view = job.view if job.view is not None else self.view
        if view is None:
            raise RuntimeError("the tier is shut down")
        t0 = time.monotonic()
        try:
            if refused is not None:
                raise refused
            if job.is_promotion:
                ret = kio.batch_load_block(job.paths, view, job.offsets, self.block_size,
                                           use_o_direct=self.use_o_direct, checksum=self.checksum,
                                           counts=counts, landing=self.landing, **js)
                retries = int(ret or 0)
            else:
                extra = {"durable": True} if self.durable else {}
                kio.batch_store_block(job.paths, view, job.offsets, self.block_size,
                                      use_o_direct=self.use_o_direct, checksum=self.checksum,
                                      counts=counts, **extra, **js)
        except OSError as e:
            err = e
            n_ok = max(0, min(int(getattr(e, "num_succeeded", 0) or 0), n))
            checksum_failed = bool(getattr(e, "checksum_failed", False))
            retries = int(getattr(e, "num_retried", 0) or 0)
        except Exception as e:  # BufferError/ValueError from the I/O layer: nothing moved
            err = e
            n_ok = 0
        finally:  # the buffer is released with the call: nothing of the job keeps it
            view = job.view = None
        if self.capacity is not None:  # a bounded root: ledger, recency stamps, ENOSPC -> evict now
            try:
                reserved, job.reserved = job.reserved, 0
                self.capacity.after_job(job.is_promotion, job.paths, n_ok, reserved, err, counts)
            except Exception:
                logger.exception("capacity bookkeeping after a job failed")
        e, seen = err, set()
        while e is not None and id(e) not in seen:  # a traceback's frames (the fallback's) hold the buffer
            seen.add(id(e))
            e.__traceback__ = None
            e = e.__cause__ or e.__context__
        t1 = time.monotonic()
        if self.durable and not job.is_promotion:
            with self._not_durable_lock:
                self._not_durable.difference_update(job.paths[:n_ok])  # synced now (P15)
                if err is not None and getattr(err, "operation", "") == "sync" and n_ok < n:
                    self._not_durable.add(job.paths[n_ok])  # P19: maybe published, not known durable
        if err is not None:
            op = "load" if job.is_promotion else "store"
            at, total = job.first + n_ok, (len(job.split.job.keys) if job.split is not None else n)
            why = err
            if job.is_promotion and self.checksum == "strict" and getattr(err, "errno", None) == errno.ENODATA:
                why = f"no checksum record (strict: a miss, the file kept): {getattr(err, 'filename', '')!r}"
            if job.split is not None:  # a part: the job's failure is logged once, at its merge (_report)
                logger.debug("%s job %r, part %d, failed at block %d of %d (%s): %s", op, job.job_id, job.part, at,
                             total, getattr(err, "operation", "") or "-", why)
            elif job.state is not None and (job.past_deadline or job.state.state == EXPIRED):  # reported already
                logger.debug("%s job %r (already reported failed) ended late at block %d of %d (%s): %s",
                             op, job.job_id, at, total, getattr(err, "operation", "") or "-", why)
            else:  # rate-limited per kind: a full or sick filesystem fails every job
                self.warnings.warn(f"failed {op} job", "%s job %r failed at block %d of %d (%s): %s", op,
                                   job.job_id, at, total, getattr(err, "operation", "") or "-", why)
        if counts.get("unverified"):
            self.warnings.warn("unverified load", "loaded %d block(s) without a CRC32C record (stored by vLLM "
                               "or with checksums off, or copied without xattrs): unverified; counted as "
                               "'unverified'; checksum_blocks='strict' makes them misses, 'kvtier scrub "
                               "--adopt' records checksums for them", counts["unverified"])
        return Finished(job.job_id, job.is_promotion, job.keys, n_ok, t1 - t0,
                        t1 - job.submitted_at, err, checksum_failed, retries, counts)

    def _check_before_job(self) -> Optional[BaseException]:
        """The shell's check before a job: the JobRefused it raised (the job fails, nothing
        touched), or None (passed, or failed itself: a check must never break the data path)."""
        try:
            self.before_job()
        except JobRefused as e:
            return e
        except Exception:  # once a minute: a broken check would else log a traceback per job
            self.warnings.warn("failed check before a job", "the check before a job failed", level=logging.ERROR,
                               exc_info=True)
        return None

    def _count(self, job: Job, r: Finished) -> None:
        try:
            self.counters.count_job(job.is_promotion, r.success, len(job.keys), r.n_ok, self.block_size,
                                    r.io_time, r.checksum_failed, r.checksum_retries, r.policy_counts,
                                    r.error)
        except Exception:  # counting must never break the data path
            logger.exception("counting a finished job failed")


class _Worker:
    """A pool thread: its group (``load_priority``) and whether it is stuck in a call
    that outlived its deadline."""

    __slots__ = ("load_priority", "stuck", "thread")

    def __init__(self, load_priority: bool) -> None:
        self.load_priority = load_priority
        self.stuck = False
        self.thread: Optional[threading.Thread] = None
