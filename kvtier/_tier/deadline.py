"""Calls with a deadline, on threads that may be abandoned in the kernel.

A filesystem that stops answering (a hung NFS server, a FUSE daemon that stalls)
holds the calling thread in the kernel for as long as it likes: no Python code can
interrupt it. So whatever must not wait for the filesystem runs its filesystem
calls on another thread and waits for them only until a deadline; a thread whose
call outlived its deadline is *stuck*: it is abandoned (it ends by itself when the
call returns) and counted, and once a cap of stuck threads is reached calls fail
fast instead of piling more threads onto the hung filesystem.

:class:`OffThread` does this for short calls (the tier's lookups and its startup
probes of the root); the tier engine's job threads use the same rule with
:class:`kvtier.io.JobState` so that a late job writes nothing (docs/tier.md,
"Deadlines").
"""
from __future__ import annotations

import errno
import os
import queue
import threading
import time
from typing import Any, Callable, List

DEFAULT_IO_TIMEOUT_S = 120.0
"""Default deadline of one tier job or startup probe, in seconds (lookups have
:data:`DEFAULT_LOOKUP_TIMEOUT_S`; docs/tier.md, "Deadlines"): far above what a healthy
job takes on a slow shared filesystem (a 64-block job of 16 MiB blocks, 1 GiB, at 10
MB/s is ~100 s), and a job that takes longer is worse than recomputing its KV."""

DEFAULT_LOOKUP_TIMEOUT_S = 2.0
"""Default deadline of one lookup (a batch of stat calls), in seconds, when
``io_timeout_s`` is not shorter or is 0 (docs/tier.md, "Deadlines"). A lookup runs where
waiting is dearest: on the standalone tier it is the caller's (the scheduler's)
thread, and in vLLM the one lookup thread every request's lookups queue behind.
It is one metadata round trip per key, microseconds on a local filesystem and a few
milliseconds on a healthy NFS or Lustre client under load, so 2 s covers hundreds
of keys on a slow share; a server that takes longer is failing over or gone (NFS's
own retransmit timeout is 60 s), and a lookup answered as a miss costs only the
recompute of those blocks."""


def check_timeout(value: Any, name: str = "io_timeout_s") -> float:
    """``value`` as seconds (float >= 0; 0 = no deadline). TypeError for a
    non-number or bool, ValueError for a negative or NaN value or one above
    ``threading.TIMEOUT_MAX`` (~292 years: the longest wait Python's locks take)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds (0 = no deadline), got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond float's range (10**400): as too large as 1e10
        v = float("inf")
    if not 0 <= v <= threading.TIMEOUT_MAX:
        raise ValueError(f"{name} must be >= 0 and at most {threading.TIMEOUT_MAX:.0f} s (threading.TIMEOUT_MAX; "
                         f"0 = no deadline), got {value!r}")
    return v


def timed_out(what: str, timeout: float, path: Any) -> OSError:
    """OSError ETIMEDOUT (TimeoutError) naming ``path``: ``what`` did not answer."""
    return OSError(errno.ETIMEDOUT, f"{what}: no answer within {timeout:g} s ({os.strerror(errno.ETIMEDOUT)})",
                   path)


class _Runner:
    """One daemon thread running the calls handed to it, one at a time."""

    def __init__(self, owner: "OffThread") -> None:
        self.owner = owner
        self.inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self.abandoned = False  # under owner._lock
        self.thread = threading.Thread(target=self._loop, name=owner.name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            fn, args, box, done = item
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()
            if not self.owner._returned(self):
                return


class OffThread:
    """Runs calls on reusable daemon threads, each waited for until a deadline.

    ``call(fn, *args, timeout=..., what=..., path=...)`` returns ``fn(*args)`` or
    raises what it raised; if it has not returned after ``timeout`` seconds the
    caller gets OSError ETIMEDOUT naming ``path`` and the thread is left stuck (it
    exits when the call returns). At most ``max_stuck`` calls are in the filesystem
    at once, stuck ones included, so at most that many threads get stuck: a call
    waits for a free slot within its own deadline, and with ``max_stuck`` threads
    stuck calls fail fast with the same error without starting. ``timeout=0`` runs ``fn`` on the caller's
    thread (no deadline)."""

    def __init__(self, name: str, max_stuck: int) -> None:
        self.name = name
        self.max_stuck = max_stuck
        self._lock = threading.Condition(threading.Lock())
        self._idle: List[_Runner] = []
        self._stuck = 0
        self._busy = 0  # calls in progress, not (yet) stuck: with the stuck ones at most max_stuck
        self._closed = False

    @property
    def stuck(self) -> int:
        """Threads whose call outlived its deadline and has not returned yet."""
        return self._stuck

    def _returned(self, r: _Runner) -> bool:
        """A runner's call returned: back to the idle list (True) or exit (False)."""
        with self._lock:
            if r.abandoned:
                self._stuck -= 1
                self._lock.notify_all()
                return False
            if self._closed:
                return False
            self._idle.append(r)
            return True

    def call(self, fn: Callable, *args: Any, timeout: float, what: str, path: Any) -> Any:
        if not timeout:
            return fn(*args)
        end = time.monotonic() + timeout
        with self._lock:  # a slot, atomically: never more than max_stuck calls in the filesystem
            while True:
                if self._stuck >= self.max_stuck:
                    err = timed_out(f"{what} not started, {self._stuck} earlier call(s) still stuck", timeout,
                                    path)
                    err.started = False  # failed fast: nothing was asked of the filesystem
                    raise err
                if self._stuck + self._busy < self.max_stuck:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    err = timed_out(f"{what} not started, {self._busy} earlier call(s) still running", timeout,
                                    path)
                    err.started = False
                    raise err
                self._lock.wait(left)
            self._busy += 1
            r = self._idle.pop() if self._idle else None
        try:
            if r is None:
                r = _Runner(self)
        except BaseException:
            with self._lock:
                self._busy -= 1
                self._lock.notify_all()
            raise
        box: list = []
        done = threading.Event()
        r.inbox.put((fn, args, box, done))
        finished = done.wait(max(end - time.monotonic(), 0))
        with self._lock:
            self._busy -= 1
            if not finished and not box:  # still in the call: abandon the thread
                r.abandoned = True
                self._stuck += 1
            self._lock.notify_all()
        if r.abandoned:
            raise timed_out(what, timeout, path)
        done.wait()
        ok, value = box[0]
        if ok:
            return value
        raise value

    def close(self) -> None:
        """Idle threads exit; stuck ones exit when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for r in idle:
            r.inbox.put(None)


def run_with_deadline(fn: Callable, *args: Any, timeout: float, what: str, path: Any) -> Any:
    """``fn(*args)`` on a thread of its own, waited for ``timeout`` seconds (0: on the
    caller's thread): its result, what it raised, or OSError ETIMEDOUT naming
    ``path`` (the thread is then left to end when the filesystem answers)."""
    ot = OffThread(what, max_stuck=1)
    try:
        return ot.call(fn, *args, timeout=timeout, what=what, path=path)
    finally:
        ot.close()
