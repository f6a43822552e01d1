"""A large load runs as parts on several pool threads and is reported as one job
(kvtier/_tier/engine.py ``_Split``, docs/tier.md "Split loads").

The engine's split knobs are set small here (parts of 2-1000 blocks, 3 parts) so that a
few blocks exercise what a job of thousands of 4 KiB blocks does. What is proved: the
bytes land where one serial job would put them; the job is counted and reported once;
the partial keep is the prefix a serial job would keep; a failed part makes the parts no
thread took skip; under a deadline a stalled part is reported at its deadline and its
late I/O writes nothing; shutdown discards a split job that never started and ends one
that did short (ECANCELED), reported once.
"""
from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest

import kvtier.io as kio
from kvtier._tier import engine as E
from kvtier.manager import FileSystemTierManager, TransferJob

BS = 4096


def keys_for(n):
    return [(i.to_bytes(8, "big") + b"\xcd" * 8, 0) for i in range(n)]


def rows(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, BS), dtype=np.uint8)


def split_tier(buf, root, parts=3, split_blocks=2, **kw):
    kw.setdefault("n_read_threads", 3)
    kw.setdefault("n_write_threads", 1)
    kw.setdefault("checksum_blocks", True)
    t = FileSystemTierManager(buf, str(root), "m", **kw)
    t._engine.load_split_blocks = split_blocks
    t._engine._max_parts = parts
    return t


def store(t, keys):
    t.submit_store(TransferJob("s", keys, list(range(len(keys)))))
    assert t.drain_jobs(30)
    (r,) = t.get_finished_jobs()
    assert r.success, r.error


def load(t, keys, first_row, job_id="L"):
    t.submit_load(TransferJob(job_id, keys, list(range(first_row, first_row + len(keys)))))
    assert t.drain_jobs(30)
    res = t.get_finished_jobs()
    assert [r.job_id for r in res] == [job_id]  # one result for the job, not one per part
    return res[0]


class Calls:
    """Wraps kio.batch_load_block: records (thread, first path, blocks) per call; calls
    whose first path is in ``hold`` wait for ``release``."""

    def __init__(self, monkeypatch, hold=(), barrier=None):
        self.real = kio.batch_load_block
        self.calls, self.lock = [], threading.Lock()
        self.hold, self.release, self.barrier = set(hold), threading.Event(), barrier
        monkeypatch.setattr(kio, "batch_load_block", self)

    def __call__(self, paths, *a, **kw):
        with self.lock:
            self.calls.append((threading.current_thread().name, paths[0], len(paths)))
        if self.barrier is not None:
            self.barrier.wait(10)  # every part in its call at once: on as many threads
        if paths[0] in self.hold:
            assert self.release.wait(30)
        return self.real(paths, *a, **kw)


def test_parts_cover_the_job_in_order():
    assert E.split_parts(10000, 512, 2) == 2
    assert E.split_parts(10000, 512, 64) == 19
    assert E.split_parts(1023, 512, 8) == 1  # under twice the part: one job
    assert E.split_parts(10000, 0, 8) == 1  # 0: never split
    job = E.Job("j", tuple(range(10)), [f"p{i}" for i in range(10)], [i * BS for i in range(10)], True, 1.5)
    sp = E._Split(job, 3)
    assert [(p.first, p.keys, p.part, p.submitted_at) for p in sp.parts] == [
        (0, (0, 1, 2), 0, 1.5), (3, (3, 4, 5), 1, 1.5), (6, (6, 7, 8, 9), 2, 1.5)]
    assert [p.paths for p in sp.parts] == [["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6", "p7", "p8", "p9"]]
    assert [p.offsets[0] for p in sp.parts] == [0, 3 * BS, 6 * BS]


def test_a_large_load_runs_on_several_threads_and_is_one_job(tmp_path, monkeypatch):
    n = 3000
    buf = rows(2 * n)
    want = buf[:n].copy()
    with split_tier(buf, tmp_path / "c", split_blocks=1000) as t:
        keys = keys_for(n)
        store(t, keys)
        before = t.metrics.counters.snapshot()
        calls = Calls(monkeypatch, barrier=threading.Barrier(3))
        r = load(t, keys, n)
        assert r.success and r.successful_keys == tuple(keys) and r.transfer_bytes == n * BS
        assert np.array_equal(buf[n:], want)
        # three calls of 1000 blocks, in the job's order, on three threads at once
        assert sorted((p, k) for _, p, k in calls.calls) == sorted(
            (t.file_mapper.get_file_name(keys[i]), 1000) for i in (0, 1000, 2000))
        assert len({name for name, _, _ in calls.calls}) == 3
        c = t.metrics.counters.snapshot()
        assert c["load_jobs"] - before["load_jobs"] == 1
        assert c["bytes_read"] - before["bytes_read"] == n * BS
        assert c["load_failures"] == before["load_failures"]


@pytest.mark.parametrize("bad", [(1, ), (4, ), (1, 4), (5, 0)])
def test_the_partial_keep_is_the_prefix_a_serial_job_keeps(tmp_path, bad):
    """Blocks ``bad`` fail (a flipped byte: removed; the first of them only when it fails
    first): the job keeps the blocks before the first bad one, as a serial job would."""
    n = 6
    buf = rows(2 * n, seed=1)
    want = buf[:n].copy()
    with split_tier(buf, tmp_path / "c") as t:  # parts of 2 blocks: [0 1] [2 3] [4 5]
        keys = keys_for(n)
        store(t, keys)
        paths = [t.file_mapper.get_file_name(k) for k in keys]
        for i in bad:
            with open(paths[i], "r+b") as f:
                f.seek(7)
                b = f.read(1)
                f.seek(7)
                f.write(bytes([b[0] ^ 1]))
        first_bad = min(bad)
        r = load(t, keys, n)
        assert (r.success, r.successful_keys, r.checksum_failed) == (False, tuple(keys[:first_bad]), True)
        assert r.error.errno == errno.EBADMSG and r.error.filename == paths[first_bad]
        assert r.error.num_succeeded == first_bad  # the job's count, not its part's
        assert np.array_equal(buf[n:n + first_bad], want[:first_bad])
        assert not os.path.exists(paths[first_bad])  # provably bad: removed
        for i in range(n):
            if i not in bad:
                assert os.path.exists(paths[i])  # a good block is never removed


def test_a_failed_part_makes_the_parts_no_thread_took_skip(tmp_path, monkeypatch):
    """Two threads, three parts: part 0 fails at once (its first file is gone) while part
    1 is held; part 2, still queued, never runs; the job is reported once part 1 returns."""
    n = 6
    buf = rows(2 * n, seed=2)
    with split_tier(buf, tmp_path / "c", n_read_threads=1, n_write_threads=1) as t:
        keys = keys_for(n)
        store(t, keys)
        paths = [t.file_mapper.get_file_name(k) for k in keys]
        os.unlink(paths[0])
        calls = Calls(monkeypatch, hold=[paths[2]], barrier=threading.Barrier(2))  # parts 0 and 1 taken
        t.submit_load(TransferJob("L", keys, list(range(n, 2 * n))))
        end = time.monotonic() + 10
        while len(calls.calls) < 2:
            assert time.monotonic() < end
            time.sleep(0.005)
        time.sleep(0.1)
        assert t.get_finished_jobs() == []  # part 1 still runs: the job waits for it
        calls.release.set()
        assert t.drain_jobs(30)
        (r,) = t.get_finished_jobs()
        assert (r.job_id, r.success, r.successful_keys) == ("L", False, ())
        assert r.error.errno == errno.ENOENT and r.error.filename == paths[0]
        assert sorted(p for _, p, _ in calls.calls) == sorted([paths[0], paths[2]])  # part 2 never ran
        assert t._engine.pending == 0 and not t._engine._load_q


def test_shutdown_discards_a_split_job_that_never_started(tmp_path, monkeypatch):
    n = 6
    buf = rows(2 * n, seed=3)
    t = split_tier(buf, tmp_path / "c", n_read_threads=1, n_write_threads=1)
    keys = keys_for(n)
    store(t, keys)
    paths = [t.file_mapper.get_file_name(k) for k in keys]
    calls = Calls(monkeypatch, hold=[paths[0], paths[1]])  # both threads held
    t.submit_load(TransferJob("busy1", keys[:1], [n]))
    t.submit_load(TransferJob("busy2", keys[1:2], [n + 1]))
    end = time.monotonic() + 10
    while len(calls.calls) < 2:
        assert time.monotonic() < end
        time.sleep(0.005)
    t.submit_load(TransferJob("L", keys, list(range(n, 2 * n))))
    threading.Timer(0.2, calls.release.set).start()
    discarded = t._engine.shutdown(wait=True)
    assert "L" in discarded and discarded.count("L") == 1
    got = {r.job_id for r in t._engine.take_finished()}
    assert got == {"busy1", "busy2"}  # L is never reported
    assert sorted(p for _, p, _ in calls.calls) == sorted(paths[:2])  # no part of L ran
    assert t._engine.pending == 0
    t.shutdown()


def test_shutdown_ends_a_started_split_job_short_and_reports_it_once(tmp_path, monkeypatch):
    """Part 0 runs (held), parts 1 and 2 queued behind it on one thread: shutdown(wait=True)
    lets part 0 finish and reports the job with part 0's blocks, ECANCELED for the rest."""
    n = 6
    buf = rows(2 * n, seed=4)
    want = buf[:n].copy()
    t = split_tier(buf, tmp_path / "c", n_read_threads=1, n_write_threads=1)
    keys = keys_for(n)
    store(t, keys)
    paths = [t.file_mapper.get_file_name(k) for k in keys]
    calls = Calls(monkeypatch, hold=[paths[0], paths[2]])
    # one thread may take a part: the other is busy with a held job
    t.submit_load(TransferJob("busy", keys[2:3], [0]))
    end = time.monotonic() + 10
    while len(calls.calls) < 1:
        assert time.monotonic() < end
        time.sleep(0.005)
    t.submit_load(TransferJob("L", keys, list(range(n, 2 * n))))
    while len(calls.calls) < 2:
        assert time.monotonic() < end
        time.sleep(0.005)
    threading.Timer(0.2, calls.release.set).start()
    discarded = t._engine.shutdown(wait=True)
    assert discarded == []
    res = {r.job_id: r for r in t._engine.take_finished()}
    r = res["L"]
    assert (r.success, r.successful_keys) == (False, tuple(keys[:2]))
    assert r.error.errno == errno.ECANCELED and r.error.filename == paths[2]
    assert "at block 2 of 6" in str(r.error)
    assert np.array_equal(buf[n:n + 2], want[:2])
    assert sorted(p for _, p, _ in calls.calls) == sorted([paths[2], paths[0]])  # parts 1 and 2 never ran
    assert t._engine.pending == 0
    t.shutdown()


@pytest.mark.mount
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stalls", [(3,), (3, 5)])
def test_a_stalled_part_is_reported_at_its_deadline_and_writes_nothing_late(backend, ff, area, stalls):
    """Block 3 (part 1's second; and block 5, part 2's second) stalls in read on the FUSE
    fault filesystem: the job is reported at the deadline, once, one timeout, keeping
    blocks 0-2 (part 0 whole, part 1's first); once the reads return, rows 3-5 of the job,
    reused by the caller, stay as the caller left them."""
    T, n = 0.3, 6
    buf = rows(2 * n, seed=5)
    want = buf[:n].copy()
    t = split_tier(buf, area, io_timeout_s=30, lookup_timeout_s=T)
    t._engine.io_timeout_s = T
    try:
        keys = keys_for(n)
        kio.batch_store_block([t.file_mapper.get_file_name(k) for k in keys], t._view,
                              [i * BS for i in range(n)], BS, checksum=True)
        stalled = t.file_mapper.get_file_name(keys[3])
        for i in stalls:
            ff.stall("read", "/" + os.path.relpath(t.file_mapper.get_file_name(keys[i]), ff.mnt))
        buf[n:] = 0
        t0 = time.monotonic()
        t.submit_load(TransferJob("L", keys, list(range(n, 2 * n))))
        assert t.drain_jobs(T + 5)
        assert time.monotonic() - t0 < T + 5
        (r,) = t.get_finished_jobs()
        assert (r.success, r.successful_keys) == (False, tuple(keys[:3]))
        assert isinstance(r.error, TimeoutError) and r.error.filename == stalled
        assert "at block 3 of 6, named here" in str(r.error)
        assert np.array_equal(buf[n:n + 3], want[:3])
        c = t.metrics.counters.snapshot()
        assert (c["load_jobs"], c["load_failures"], c["load_timeouts"], c["bytes_read"]) == (1, 1, 1, 3 * BS)
        assert c["stuck_threads"] == len(stalls)  # each stalled part holds its thread
        buf[n + 3:] = 0xA7  # the caller reuses the rows the job did not keep
        ff.clear()
        end = time.monotonic() + 10
        while t.metrics.counters.snapshot()["stuck_threads"]:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert (buf[n + 3:] == 0xA7).all()  # the late read wrote nothing
        assert t.get_finished_jobs() == []  # reported once
        r = load(t, keys, n, "again")  # a deadline removes nothing
        assert r.success and np.array_equal(buf[n:], want)
    finally:
        ff.clear()
        t.shutdown()


def test_the_merge_takes_the_failed_parts_flags_and_only_the_io_that_ran():
    job = E.Job("j", tuple(range(6)), [f"p{i}" for i in range(6)], [i * BS for i in range(6)], True, 0.0)
    sp = E._Split(job, 3)
    e0 = OSError(errno.ENOENT, "gone", "p0")
    sp.results = [E.Finished("j", True, (0, 1), 0, 1.0, 1.95, e0, False, 0, {"a": 1}),  # ran 0.95-1.95 s
                  E.Finished("j", True, (2, 3), 1, 0.5, 1.5, OSError(errno.EBADMSG, "bad"), True, 1, {"a": 2}),
                  E.Finished("j", True, (4, 5), 0, 0.0, 2.0, OSError(errno.ECANCELED, "shut down"))]  # never ran
    assert sp.chosen() == 0
    r = sp.merged()
    assert (r.n_ok, r.error, r.checksum_failed) == (0, e0, False)  # part 0's failure, not part 1's
    assert e0.num_succeeded == 0
    assert (r.checksum_retries, r.policy_counts) == (1, {"a": 3})  # what every part did, happened
    assert r.io_time == pytest.approx(1.0) and r.elapsed == pytest.approx(2.0)  # 0.95 s .. 1.95 s of I/O


def test_a_split_job_is_refused_once_by_the_geometry_check(tmp_path):
    n = 6
    buf = rows(2 * n, seed=6)
    with split_tier(buf, tmp_path / "c") as t:
        keys = keys_for(n)
        store(t, keys)
        info = os.path.join(t.file_mapper.base_path, "kvtier.json")
        assert os.path.exists(info)
        with open(info, "w") as f:  # another geometry's now
            f.write('{"block_bytes": 8192}')
        before = t.metrics.counters.snapshot()
        r = load(t, keys, n)
        assert (r.success, r.successful_keys, r.error.errno) == (False, (), errno.EINVAL)
        c = t.metrics.counters.snapshot()
        assert c["geometry_refused"] - before.get("geometry_refused", 0) == 1  # one job, one refusal
        assert c["load_failures"] - before["load_failures"] == 1
        assert all(os.path.exists(t.file_mapper.get_file_name(k)) for k in keys)  # nothing touched


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_a_timeout_counts_when_a_later_part_failed_first(backend, ff, area):
    """Part 0 stalls (block 0), part 1 fails at once (block 2 is gone): the job's error is
    part 0's timeout, counted once as a timeout, logged once."""
    T, n = 0.3, 6
    buf = rows(2 * n, seed=7)
    t = split_tier(buf, area, io_timeout_s=30, lookup_timeout_s=T)
    t._engine.io_timeout_s = T
    try:
        keys = keys_for(n)
        paths = [t.file_mapper.get_file_name(k) for k in keys]
        kio.batch_store_block(paths, t._view, [i * BS for i in range(n)], BS, checksum=True)
        os.unlink(paths[2])
        ff.stall("read", "/" + os.path.relpath(paths[0], ff.mnt))
        t.submit_load(TransferJob("L", keys, list(range(n, 2 * n))))
        assert t.drain_jobs(T + 5)
        (r,) = t.get_finished_jobs()
        assert (r.success, r.successful_keys) == (False, ())
        assert isinstance(r.error, TimeoutError) and r.error.filename == paths[0]
        c = t.metrics.counters.snapshot()
        assert (c["load_jobs"], c["load_failures"], c["load_timeouts"]) == (1, 1, 1)
    finally:
        ff.clear()
        t.shutdown()
