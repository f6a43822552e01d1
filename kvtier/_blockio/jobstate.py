"""The job state word (csrc/job_state.h): phases, :class:`JobState` and its compare-and-swap.

One 32-bit word ``blocks << 2 | phase`` shared by the thread doing a job's I/O and the one
that may give up on it. Every change is one compare-and-swap: the C core's
(``kvtier._C.job_state_cas``, C11 atomics) when it is built, else :func:`lock_cas` (one
process-wide lock). All parties of one word must use the same one: a :class:`JobState`
keeps its CAS (``JobState.cas``), and kvtier.io hands it to the backend with the word. The
C path imports nothing of kvtier.fallback.
"""
from __future__ import annotations

import array
import threading
import time

from kvtier._blockio.buffers import buffer_address

LIVE, COMMITTING, EXPIRED, DONE = 0, 1, 2, 3
"""Phases of a job state word (:class:`JobState`): its low 2 bits."""
PHASE = 3
"""Mask of the phase in a job state word; the blocks a load counted are ``word >> 2``."""
BLOCK = 4
"""One block in a job state word's count (``word >> 2``)."""
_STATE_NAMES = ("LIVE", "COMMITTING", "EXPIRED", "DONE")

_lock = threading.Lock()


def word_view(buf):
    """The job state word of ``buf`` (a writable buffer of >= 4 bytes, 4-byte aligned: its
    first 4 bytes) as a one-item memoryview of format "I", checked as kvtier._C checks it:
    TypeError (not a buffer), BufferError (read-only or not contiguous), ValueError
    (shorter, or misaligned)."""
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"job_state must be a writable buffer, not {type(buf).__name__}") from None
    if mv.readonly or not mv.c_contiguous:
        raise BufferError(f"job_state must be a writable buffer (a {type(buf).__name__} is read-only)"
                          if mv.readonly else "job_state must be a contiguous buffer")
    mv = mv.cast("B")
    if mv.nbytes < 4:
        raise ValueError(f"job_state must be a buffer of >= 4 bytes, got {mv.nbytes}")
    if buffer_address(mv) % 4:
        raise ValueError("job_state must be 4-byte aligned")
    return mv[:4].cast("I")


def lock_cas(buf, old, new, /):
    """kvtier._C.job_state_cas without the C core: if the word in ``buf`` is ``old``, set it
    to ``new`` and return True, else False; under one process-wide lock, which every party
    of that word then uses."""
    w = word_view(buf)
    with _lock:
        if w[0] != old:
            return False
        w[0] = new
        return True


def default_cas():
    """The CAS of a new :class:`JobState`: the C core's (C11 atomics) when it is built, else
    :func:`lock_cas`."""
    from kvtier import _C  # None when kvtier/__init__ found no C core

    return getattr(_C, "job_state_cas", None) or lock_cas


def step(word, frm: int, to: int, add: int = 0, cas=lock_cas) -> bool:
    """Phase ``frm`` -> ``to`` of the job state word ``word`` (an indexable word: a
    :func:`word_view` or a JobState's buffer), the count kept (+ ``add``), by ``cas``: True if
    the phase was ``frm`` (csrc/job_state.h kvt_job_step)."""
    while True:
        w = word[0]
        if w & PHASE != frm:
            return False
        if cas(word, w, ((w & ~PHASE) | to) + add):
            return True


class JobState:
    """The liveness of one I/O job, shared by the thread doing its I/O and the
    one that may give up on it.

    One 32-bit word in a small writable buffer (``buffer``, 4 bytes, aligned),
    passed to ``batch_load_block`` / ``batch_store_block`` as ``job_state``:
    ``blocks << 2 | phase`` (csrc/job_state.h). ``blocks`` (:attr:`blocks_done`):
    the blocks of a load that are whole in the caller's view and verified,
    counted while the job was live (never changed once it is not). Phases
    (:attr:`state`): ``LIVE`` (0) the job may run; ``COMMITTING`` (1) the I/O thread is
    writing into the caller's memory or renaming a temp onto its destination;
    ``EXPIRED`` (2) given up: the I/O stops at its next commit point (OSError
    ETIMEDOUT) and writes nothing more; ``DONE`` (3) the I/O finished and its
    result stands. Every change is one compare-and-swap (``cas``: by default
    :func:`default_cas`) that keeps the count, so a job is either expired or done,
    never both, exactly one party reports it, and the count read after :meth:`expire`
    is final.

    The I/O side: LIVE -> COMMITTING before each copy into the caller's view
    (load) or each rename (store), COMMITTING -> LIVE after it, and a load
    counts each block once it is whole and verified (LIVE -> LIVE, blocks + 1);
    a failed swap at any of these points means the job expired: stop with
    ETIMEDOUT (``num_succeeded`` = the blocks counted).
    """

    __slots__ = ("buffer", "_cas")

    def __init__(self, cas=None) -> None:
        self.buffer = array.array("I", [LIVE])  # 4-byte item, malloc'd: aligned
        self._cas = cas or default_cas()

    @property
    def cas(self):
        """The compare-and-swap every party of this word uses."""
        return self._cas

    @property
    def state(self) -> int:
        """The current phase (LIVE, COMMITTING, EXPIRED or DONE)."""
        return self.buffer[0] & PHASE

    @property
    def blocks_done(self) -> int:
        """Blocks of a load whole in the caller's view and verified while the job was
        live; of a store, the blocks stored (published, or found there) while live. Final
        once :meth:`expire` returned True: a load's partial keep at its deadline, and
        for either the index of the block in flight (the one the deadline error names)."""
        return self.buffer[0] >> 2

    def _step(self, frm: int, to: int) -> bool:
        """Phase ``frm`` -> ``to``, keeping the count: True if the phase was ``frm``."""
        return step(self.buffer, frm, to, 0, self._cas)

    def expire(self, wait_commit: bool = True) -> bool:
        """Give up on the job: LIVE -> EXPIRED. Returns True if this call
        expired it (from then on nothing more is written into the caller's
        view, no further block is published), False if it was already DONE
        (the result stands) or already EXPIRED.

        While the I/O thread is COMMITTING, ``wait_commit`` (loads: a copy into
        memory, bounded) spins until the section ends and then expires. Without
        it (stores: a rename, which a hung filesystem can hold forever) the
        section itself is expired: COMMITTING -> EXPIRED at once; the rename in
        the kernel may still complete, publishing a complete block whose bytes
        were written and checksummed before the deadline, and the store stops
        there (its release swap fails)."""
        spins = 0
        while True:
            if self._step(LIVE, EXPIRED):
                return True
            s = self.state
            if s == COMMITTING:
                if not wait_commit:
                    if self._step(COMMITTING, EXPIRED):
                        return True
                    continue
                spins += 1
                time.sleep(0 if spins < 100 else 1e-5)
            elif s != LIVE:
                return False

    def cancel(self) -> bool:
        """Give up on the job only if it is not in a commit section: LIVE ->
        EXPIRED. True if this call expired it; False if it was COMMITTING (a
        store renaming its block: it finishes and is reported as what it is),
        DONE or already EXPIRED."""
        return self._step(LIVE, EXPIRED)

    def finish(self) -> bool:
        """The I/O side's end: LIVE -> DONE. True: the result stands (report
        it); False: the job had expired (its result is dropped)."""
        return self._step(LIVE, DONE)

    def __repr__(self) -> str:
        n = self.blocks_done
        return f"JobState({_STATE_NAMES[self.state]}{f', {n} blocks' if n else ''})"
