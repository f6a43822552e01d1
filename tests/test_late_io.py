"""The job state contract of kvtier.io through both backends (module docstring, "Deadlines"): a
:class:`kvtier.io.JobState` shared by the thread doing a batch's I/O and the
one that gives up on it. Once ``expire()`` returned True nothing more is
written into the caller's view and no further block is published. Each test
body runs on the C core and the fallback (``io_backend``); the stalls come
from the FUSE fault filesystem (tests/fusefault: read, write, getxattr, open
and rename held until released, always released at teardown).
"""
from __future__ import annotations

import errno
import glob
import os
import threading
import time

import numpy as np
import pytest

from kvtier import io as kio

BS = 64 * 1024 + 4096  # one FUSE read request or a few


def view_of(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n * BS, dtype=np.uint8)


def offsets(n):
    return [i * BS for i in range(n)]


# ------------------------------------------------------------ the state word


def test_finish_and_expire_exclude_each_other():
    js = kio.JobState()
    assert js.state == kio.LIVE
    assert js.finish() is True and js.state == kio.DONE
    assert js.expire() is False and js.state == kio.DONE  # the result stands
    js = kio.JobState()
    assert js.expire() is True and js.state == kio.EXPIRED
    assert js.finish() is False and js.state == kio.EXPIRED  # the late result is dropped
    assert js.expire() is False  # reported once: a second expire is not a second report
    assert len(js.buffer) * js.buffer.itemsize == 4 and repr(js) == "JobState(EXPIRED)"


def test_the_count_of_loaded_blocks_survives_every_transition():
    """The word is blocks << 2 | phase: expire and finish change the phase only, so the
    count read after expire() is the one the I/O side reached while live."""
    js = kio.JobState()
    assert js._cas(js.buffer, kio.LIVE, (2 << 2) | kio.LIVE)  # two blocks counted by the I/O side
    assert (js.state, js.blocks_done) == (kio.LIVE, 2) and repr(js) == "JobState(LIVE, 2 blocks)"
    assert js.expire() is True and (js.state, js.blocks_done) == (kio.EXPIRED, 2)
    assert js.finish() is False and js.expire() is False and js.blocks_done == 2
    js = kio.JobState()
    assert js._cas(js.buffer, kio.LIVE, (5 << 2) | kio.COMMITTING)
    assert js.expire(wait_commit=False) is True and (js.state, js.blocks_done) == (kio.EXPIRED, 5)
    js = kio.JobState()
    assert js._cas(js.buffer, kio.LIVE, (1 << 2) | kio.LIVE)
    assert js.finish() is True and (js.state, js.blocks_done) == (kio.DONE, 1)


def test_expire_waits_for_a_commit_section_or_takes_it_over():
    """A load's commit (a copy) is waited for; a store's (a rename that may
    hang) is expired at once, and its release swap then fails."""
    js = kio.JobState()
    assert js._cas(js.buffer, kio.LIVE, kio.COMMITTING)
    done = threading.Event()
    t = threading.Thread(target=lambda: (js.expire(), done.set()))
    t.start()
    assert not done.wait(0.2)  # spinning while COMMITTING
    assert js.state == kio.COMMITTING
    assert js._cas(js.buffer, kio.COMMITTING, kio.LIVE)  # the section ends
    assert done.wait(5)
    t.join()
    assert js.state == kio.EXPIRED
    js = kio.JobState()
    assert js._cas(js.buffer, kio.LIVE, kio.COMMITTING)
    assert js.expire(wait_commit=False) is True and js.state == kio.EXPIRED
    assert js._cas(js.buffer, kio.COMMITTING, kio.LIVE) is False  # what the I/O side sees


def test_many_racing_parties_report_exactly_once():
    """finish() against expire() from several threads: one winner per job."""
    for _ in range(200):
        js = kio.JobState()
        wins = []
        barrier = threading.Barrier(4)

        def party(fn):
            barrier.wait()
            if fn():
                wins.append(fn)

        ts = [threading.Thread(target=party, args=(f,)) for f in (js.finish, js.expire, js.expire, js.finish)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(wins) == 1
        assert js.state == (kio.DONE if wins[0].__name__ == "finish" else kio.EXPIRED)


def test_job_state_argument_is_checked(io_backend, tmp_path):
    """A JobState or a bare word (writable, >= 4 bytes, aligned), the same checks on both backends."""
    view = view_of(1, 1)
    p = [str(tmp_path / "x.bin")]
    with pytest.raises(TypeError, match="job_state"):
        io_backend.batch_store_block(p, view, [0], BS, job_state=0)
    with pytest.raises(BufferError, match="job_state"):
        io_backend.batch_store_block(p, view, [0], BS, job_state=b"\0" * 8)
    with pytest.raises(ValueError, match="job_state"):
        io_backend.batch_load_block(p, view, [0], BS, job_state=bytearray(2))
    with pytest.raises(ValueError, match="job_state"):
        io_backend.batch_load_block(p, view, [0], BS, job_state=memoryview(bytearray(16))[1:9])
    assert not os.listdir(tmp_path)
    word = bytearray(8)  # a bare word: the first 4 bytes
    io_backend.batch_store_block(p, view, [0], BS, job_state=word)
    # LIVE still, the block stored counted (blocks << 2 | phase), the other 4 bytes untouched
    assert word == bytearray(b"\x04") + bytearray(7) and os.listdir(tmp_path) == ["x.bin"]


# ------------------------------------------------------------ without stalls


@pytest.mark.parametrize("checksum", [True, False])
def test_live_job_loads_and_stores_the_same_bytes(io_backend, tmp_path, checksum):
    view = view_of(3, 2)
    paths = [str(tmp_path / f"b{i}.bin") for i in range(3)]
    js = kio.JobState()
    io_backend.batch_store_block(paths, view, offsets(3), BS, checksum=checksum, job_state=js)
    assert js.state == kio.LIVE and js.finish()
    assert sorted(os.listdir(tmp_path)) == ["b0.bin", "b1.bin", "b2.bin"]
    out = np.zeros_like(view)
    assert js.blocks_done == 3  # a store counts the blocks it stored (the block in flight, at a deadline)
    js = kio.JobState()
    assert io_backend.batch_load_block(paths, out, offsets(3), BS, checksum=checksum, job_state=js) == 0
    assert (js.state, js.blocks_done) == (kio.LIVE, 3)
    assert np.array_equal(out, view)


def test_expired_job_writes_nothing_and_publishes_nothing(io_backend, tmp_path):
    view = view_of(2, 3)
    paths = [str(tmp_path / f"b{i}.bin") for i in range(2)]
    io_backend.batch_store_block(paths, view, offsets(2), BS, checksum=True)
    js = kio.JobState()
    assert js.expire()
    out = np.full_like(view, 0x5A)
    with pytest.raises(TimeoutError) as ei:
        io_backend.batch_load_block(paths, out, offsets(2), BS, checksum=True, job_state=js)
    e = ei.value
    assert (e.errno, e.num_succeeded, e.checksum_failed, os.fsdecode(e.filename)) == (
        errno.ETIMEDOUT, 0, False, paths[0])
    assert (out == 0x5A).all()
    new = [str(tmp_path / f"n{i}.bin") for i in range(2)]
    with pytest.raises(TimeoutError) as ei:
        io_backend.batch_store_block(new, view, offsets(2), BS, checksum=True, job_state=js)
    assert (ei.value.errno, ei.value.num_succeeded) == (errno.ETIMEDOUT, 0)
    assert sorted(os.listdir(tmp_path)) == ["b0.bin", "b1.bin"]  # no block, no temp


# ------------------------------------------------------------ under FUSE stalls


def rel(ff, path):
    return "/" + os.path.relpath(path, ff.mnt)


class Call(threading.Thread):
    """fn(*args, **kw) on a thread; .error / .result after join()."""

    def __init__(self, fn, *args, **kw):
        super().__init__(daemon=True)
        self.fn, self.args, self.kw = fn, args, kw
        self.error = self.result = None

    def run(self):
        try:
            self.result = self.fn(*self.args, **self.kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def finish(self, timeout=10):
        self.join(timeout)
        assert not self.is_alive(), "the call did not return after the stall was released"
        return self


@pytest.mark.mount
@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["read", "getxattr", "open"])
def test_late_load_never_writes_into_a_reused_row(io_backend, ff, area, op):
    """Block 1's read (or getxattr, or open) stalls; the job is given up and
    its row reused for other bytes; when the filesystem answers, the late
    load stops with ETIMEDOUT and the row keeps the new owner's bytes. Block 0,
    committed before the deadline, holds its data."""
    view = view_of(3, 4)
    paths = [os.path.join(area, f"b{i}.bin") for i in range(3)]
    io_backend.batch_store_block(paths, view, offsets(3), BS, checksum=True)
    ff.stall(op, rel(ff, paths[1]))
    out = np.zeros_like(view)
    js = kio.JobState()
    call = Call(io_backend.batch_load_block, paths, out, offsets(3), BS, checksum=True, job_state=js)
    call.start()
    ff.wait_hits(f"stall_{op}", 1)
    assert js.expire() is True
    assert js.blocks_done == 1 and np.array_equal(out[:BS], view[:BS])  # the partial keep, final now
    out[BS:] = 0xC3  # rows 1 and 2 now belong to someone else
    ff.clear()
    call.finish()
    e = call.error
    assert isinstance(e, TimeoutError), e
    assert (e.errno, e.num_succeeded, os.fsdecode(e.filename)) == (errno.ETIMEDOUT, 1, paths[1])
    assert js.blocks_done == 1
    assert np.array_equal(out[:BS], view[:BS])
    assert (out[BS:] == 0xC3).all()
    assert js.finish() is False
    for p in paths:  # a deadline is not evidence against a block: all kept
        assert os.path.exists(ff.backing_of(p))


@pytest.mark.mount
@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["write", "open"])
def test_late_store_never_publishes(io_backend, ff, area, op):
    """The temp's write (or create) stalls; the job expires; when the
    filesystem answers, the store unlinks its temp instead of renaming it and
    stores nothing after it."""
    view = view_of(2, 5)
    paths = [os.path.join(area, f"s{i}.bin") for i in range(2)]
    ff.stall(op, rel(ff, paths[0]) + "_*.tmp")
    js = kio.JobState()
    call = Call(io_backend.batch_store_block, paths, view, offsets(2), BS, checksum=True, job_state=js)
    call.start()
    ff.wait_hits(f"stall_{op}", 1)
    assert js.expire() is True
    ff.clear()
    call.finish()
    e = call.error
    assert isinstance(e, TimeoutError), e
    assert (e.errno, e.num_succeeded, os.fsdecode(e.filename)) == (errno.ETIMEDOUT, 0, paths[0])
    assert os.listdir(ff.backing_of(area)) == []  # no block, no temp


@pytest.mark.mount
@pytest.mark.timeout(60)
def test_rename_in_flight_at_the_deadline_publishes_a_complete_block_and_stops(io_backend, ff, area):
    """The rename of block 0 hangs in the filesystem: expire(wait_commit=False)
    does not wait for it. When it completes the block is published (complete
    and checksummed: its bytes were written before the deadline), and the
    store stops there: block 1 is neither published nor left as a temp."""
    view = view_of(2, 6)
    paths = [os.path.join(area, f"r{i}.bin") for i in range(2)]
    ff.stall("rename", rel(ff, paths[0]))
    js = kio.JobState()
    call = Call(io_backend.batch_store_block, paths, view, offsets(2), BS, checksum=True, job_state=js)
    call.start()
    ff.wait_hits("stall_rename", 1)
    assert js.state == kio.COMMITTING
    assert js.expire(wait_commit=False) is True
    ff.clear()
    call.finish()
    e = call.error
    assert isinstance(e, TimeoutError), e
    assert (e.errno, e.num_succeeded) == (errno.ETIMEDOUT, 1)
    assert os.listdir(ff.backing_of(area)) == ["r0.bin"]
    out = np.zeros(BS, dtype=np.uint8)
    io_backend.batch_load_block(paths[:1], out, [0], BS, checksum=True)
    assert np.array_equal(out, view[:BS])
    assert glob.glob(os.path.join(ff.backing_of(area), "*.tmp")) == []


@pytest.fixture
def lock_cas(monkeypatch):
    """A pure-Python install: job state words changed under the lock of
    kvtier._blockio.jobstate (the fallback's own CAS)."""
    from kvtier._blockio import jobstate

    monkeypatch.setattr(jobstate, "default_cas", lambda: jobstate.lock_cas)
    return jobstate.lock_cas


def test_lock_cas_is_a_compare_and_swap(lock_cas):
    js = kio.JobState()
    assert js._cas is lock_cas
    assert lock_cas(js.buffer, kio.LIVE, kio.COMMITTING) and js.state == kio.COMMITTING
    assert not lock_cas(js.buffer, kio.LIVE, kio.EXPIRED) and js.state == kio.COMMITTING
    assert js.expire(wait_commit=False) and js.state == kio.EXPIRED
    with pytest.raises(BufferError):
        lock_cas(bytes(4), 0, 1)
    with pytest.raises(TypeError):
        lock_cas(5, 0, 1)


@pytest.mark.mount
@pytest.mark.timeout(60)
def test_late_load_with_the_lock_cas(lock_cas, ff, area):
    """The same late-load guarantee where the C core is absent (the fallback
    and JobState share the lock-based CAS)."""
    io = kio.for_backend("python")
    view = view_of(2, 7)
    paths = [os.path.join(area, f"b{i}.bin") for i in range(2)]
    io.batch_store_block(paths, view, offsets(2), BS, checksum=True)
    ff.stall("read", rel(ff, paths[1]))
    out = np.zeros_like(view)
    js = kio.JobState()
    call = Call(io.batch_load_block, paths, out, offsets(2), BS, checksum=True, job_state=js)
    call.start()
    ff.wait_hits("stall_read", 1)
    assert js.expire() is True
    out[BS:] = 0x3C
    ff.clear()
    call.finish()
    assert isinstance(call.error, TimeoutError) and call.error.num_succeeded == 1 == js.blocks_done
    assert np.array_equal(out[:BS], view[:BS]) and (out[BS:] == 0x3C).all()


def expire_at_random(io_backend, tmp_path, use_o_direct, n=48, tries=24, alloc=np.zeros, **load_kw):
    """Load ``n`` blocks of 256 KiB ``tries`` times (buffers from ``alloc(nbytes, dtype)``,
    ``load_kw`` to batch_load_block), each expired from another thread at a random moment or
    once a random count of blocks is done: the count read right after expire() is the call's
    own num_succeeded, those blocks are whole, nothing is written after expire() returned,
    and no block after the failing one is touched. At least one try ends mid-batch."""
    bs = 256 << 10
    data = alloc(n * bs, np.uint8)
    data[:] = np.random.default_rng(8).integers(0, 256, n * bs, dtype=np.uint8)
    paths = [str(tmp_path / f"b{i}.bin") for i in range(n)]
    io_backend.batch_store_block(paths, data, [i * bs for i in range(n)], bs, checksum=True)
    rng = np.random.default_rng(9)
    seen = set()
    for i in range(tries):
        js = kio.JobState()
        out = alloc(n * bs, np.uint8)
        snap = []

        def expire(at=int(rng.integers(0, n)), delay=float(rng.uniform(0, 0.01)), by_count=bool(i % 2)):
            if by_count:  # as soon as `at` blocks are counted: a loaded host's late wake-up cannot miss it
                while js.blocks_done < at:
                    time.sleep(0)  # lets the GIL go: the pure-Python loader needs it to progress
            else:  # at a random moment, inside a block's pieces too
                time.sleep(delay)
            assert js.expire()
            snap.append((js.blocks_done, out.copy()))

        t = threading.Thread(target=expire)
        t.start()
        try:
            io_backend.batch_load_block(paths, out, [i * bs for i in range(n)], bs, use_o_direct=use_o_direct,
                                        checksum=True, job_state=js, **load_kw)
        except TimeoutError as e:
            t.join()
            k, at_expiry = snap[0]
            assert e.num_succeeded == k == js.blocks_done
            assert np.array_equal(out, at_expiry)  # nothing after expire() returned
            assert np.array_equal(out[:k * bs], data[:k * bs])
            assert not out[(k + 1) * bs:].any()
            seen.add(k)
        else:
            t.join()
            assert not snap or snap[0][0] == n  # expired after the last block: all counted
    assert seen, f"no load was expired mid-batch in {tries} tries"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_o_direct", [True, False])
def test_blocks_counted_at_expiry_are_exactly_the_whole_ones(io_backend, tmp_path, use_o_direct):
    """A load expired at a random moment from another thread (:func:`expire_at_random`; the
    C core commits a block in pieces, the fallback in one copy)."""
    expire_at_random(io_backend, tmp_path, use_o_direct)
