"""Deadlines of the tier (docs/tier.md, "Deadlines"), under a filesystem that
stops answering: the FUSE fault filesystem (tests/fusefault) holds read,
write, getxattr, open, rename or stat of chosen paths until released. Every
stall is released at teardown (the ``area`` fixture), so nothing hangs; each
test has a pytest-timeout bound besides.

What they prove, with ``io_timeout_s`` = 0.3 s: a job past its deadline is
reported failed exactly once (ETIMEDOUT, counted as a timeout of its op) and
from then on writes nothing into the caller's buffer and publishes nothing;
healthy jobs are served while threads hang (they are replaced); at the cap of
stuck threads new jobs fail fast; drain_jobs / shutdown / lookup / the
constructor return within the deadline. Job bodies run on the C core and the
fallback (``io_backend``, swapped into kvtier.io, which the engine calls).
"""
from __future__ import annotations

import errno
import glob
import mmap
import os
import threading
import time

import numpy as np
import pytest

from kvtier import io as kio
from kvtier.manager import FileSystemTierManager, TransferJob

pytestmark = [pytest.mark.mount, pytest.mark.timeout(120)]

BS = 64 * 1024
NB = 16
T = 0.3  # io_timeout_s in these tests
SLACK = 3.0  # generous bound on scheduling noise of a shared, loaded machine


def key(i):
    # a different first-level directory per block: a stalled rename (which holds
    # its directory) does not hold the healthy blocks
    return (bytes([i]) + bytes(15), 0)


def tier_on(root, buf, io_timeout_s=T, **kw):
    """A tier whose jobs and lookups have ``io_timeout_s``. Its startup (some 30
    FUSE round trips, slow on a loaded machine) gets a longer one: that deadline
    has its own test (test_constructor_probe_under_a_stall_names_the_root)."""
    kw.setdefault("checksum_blocks", True)
    kw.setdefault("lookup_timeout_s", io_timeout_s)
    tier = FileSystemTierManager(buf, root, "m", io_timeout_s=max(io_timeout_s, 30), **kw)
    tier._engine.io_timeout_s = io_timeout_s
    return tier


def glob_of(tier, ff, k):
    return "/" + os.path.relpath(tier.file_mapper._file_name(*k), ff.mnt)


def counters(tier):
    return tier.metrics.counters.snapshot()


def serves_again(tier, ff, i, row):
    """The filesystem answers again: the stuck threads come back and block ``i`` loads
    into ``row``."""
    ff.clear()
    wait_until(lambda: counters(tier)["stuck_threads"] == 0)
    tier.submit_load(TransferJob("again", [key(i)], [row]))
    assert tier.drain_jobs(30)
    (r,) = tier.get_finished_jobs()
    assert r.success, r.error


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def filled(seed):
    """NB rows of BS random bytes in a page-aligned buffer (as vLLM's primary, an mmap:
    the stores stay O_DIRECT, and the tier does not warn about it)."""
    a = np.frombuffer(mmap.mmap(-1, NB * BS), np.uint8).reshape(NB, BS)
    a[:] = np.random.default_rng(seed).integers(0, 256, (NB, BS), dtype=np.uint8)
    return a


def store_all(tier, ids):
    """Store blocks ``ids`` from rows ``ids``, without a deadline (setup must not
    race the 0.3 s one on a loaded machine)."""
    ids = list(ids)
    kio.batch_store_block([tier.file_mapper._file_name(*key(i)) for i in ids], tier._view,
                          [i * BS for i in ids], BS, checksum=True)


@pytest.mark.parametrize("op", ["read", "getxattr", "open"])
def test_late_load_is_reported_once_and_never_writes_the_reused_row(backend, ff, area, op):
    """Block 1 of 3 stalls: the job is reported at its deadline, once, as a failed load
    keeping block 0 (loaded and verified while live: a partial keep like any failed
    load's), and its late I/O writes nothing into rows 5 and 6, reused meanwhile."""
    buf = filled(1)
    data = buf.copy()
    with tier_on(area, buf, n_read_threads=1, n_write_threads=1) as tier:
        store_all(tier, [0, 1, 2])
        ff.stall(op, glob_of(tier, ff, key(1)))
        buf[:] = 0
        t0 = time.monotonic()
        tier.submit_load(TransferJob("L", [key(0), key(1), key(2)], [4, 5, 6]))
        ff.wait_hits(f"stall_{op}", 1)
        assert tier.drain_jobs(T + SLACK)  # a result for every job, from the deadline
        assert time.monotonic() - t0 < T + SLACK
        (r,) = tier.get_finished_jobs()
        assert (r.job_id, r.success, r.successful_keys, r.transfer_bytes) == ("L", False, (key(0),), BS)
        assert isinstance(r.error, TimeoutError) and r.error.errno == errno.ETIMEDOUT
        # the error names the block that hung, not the job's first
        assert r.error.filename == tier.file_mapper._file_name(*key(1))
        assert "at block 1 of 3, named here" in str(r.error)
        assert np.array_equal(buf[4], data[0]) and (buf[5:7] == 0).all()  # the kept block is whole
        c = counters(tier)
        assert (c["load_timeouts"], c["load_failures"], c["stuck_threads"]) == (1, 1, 1)
        assert c["bytes_read"] == BS and c["read_time"] > 0  # the kept block's bytes, as any partial keep
        reg = tier.metrics.registry
        assert reg.get_sample_value("kvtier:kv_offload_tiering_timeouts_total", {"tier": "1:kvtier", "op": "load"}) == 1
        assert reg.get_sample_value("kvtier:kv_offload_tiering_timeouts_total", {"tier": "1:kvtier", "op": "store"}) == 0
        assert reg.get_sample_value("kvtier:kv_offload_tiering_stuck_threads", {"tier": "1:kvtier"}) == 1
        assert reg.get_sample_value("vllm:kv_offload_tiering_promotion_job_failures_total", {"tier": "1:kvtier"}) == 1
        buf[5:7] = 0xA7  # the caller reuses the rows of the missed blocks for others
        ff.clear()
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)  # the late load returned
        assert (buf[5:7] == 0xA7).all()  # ... and wrote nothing
        assert np.array_equal(buf[4], data[0])
        assert tier.get_finished_jobs() == []  # reported once
        c = counters(tier)
        assert (c["load_jobs"], c["bytes_read"]) == (1, BS)
        # the same blocks load once the filesystem answers: a deadline removes nothing
        ff.clear()
        tier.submit_load(TransferJob("L2", [key(0), key(1), key(2)], [4, 5, 6]))
        assert tier.drain_jobs(30)
        (r,) = tier.get_finished_jobs()
        assert r.success and np.array_equal(buf[4:7], data[0:3])


def test_n_plus_1_stalls_on_n_threads_leave_no_healthy_job_behind(backend, ff, area):
    """4 threads (cap 8), 5 loads stalled in read (N+1), then 6 healthy loads: the
    healthy ones all load (the stuck threads are replaced at the deadline), the
    stalled ones time out, every job gets exactly one result."""
    buf = filled(2)
    data = buf.copy()
    with tier_on(area, buf, n_read_threads=2, n_write_threads=2) as tier:
        assert tier._engine.max_stuck == 8
        store_all(tier, range(11))
        for i in range(5):
            ff.stall("read", glob_of(tier, ff, key(i)))
        buf[:] = 0
        for i in range(5):
            tier.submit_load(TransferJob(f"S{i}", [key(i)], [i]))
        ff.wait_hits("stall_read", 4)  # 4 threads in the stalls; S4 waits for a replacement
        for i in range(5, 11):
            tier.submit_load(TransferJob(f"H{i}", [key(i)], [i]))
        assert tier.drain_jobs(3 * T + SLACK)
        res = {r.job_id: r for r in tier.get_finished_jobs()}
        assert sorted(res) == sorted([f"S{i}" for i in range(5)] + [f"H{i}" for i in range(5, 11)])
        for i in range(5, 11):
            assert res[f"H{i}"].success, res[f"H{i}"].error
            assert np.array_equal(buf[i], data[i])
        for i in range(5):
            assert not res[f"S{i}"].success and res[f"S{i}"].error.errno == errno.ETIMEDOUT
        c = counters(tier)
        assert c["load_timeouts"] == 5 and c["stuck_threads"] == 5 and c["jobs_refused"] == 0
        ff.clear()
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)
        assert (buf[0:5] == 0).all()
        assert tier.get_finished_jobs() == []


def test_at_the_cap_of_stuck_threads_new_jobs_fail_fast(backend, ff, area):
    """The cap is twice the pool's size (4 here): with 4 threads stuck, a new
    job fails at once (EAGAIN) instead of queueing; when the filesystem answers
    the tier serves again."""
    buf = filled(3)
    with tier_on(area, buf, n_read_threads=1, n_write_threads=1) as tier:
        store_all(tier, range(5))
        for i in range(4):
            ff.stall("read", glob_of(tier, ff, key(i)))
            tier.submit_load(TransferJob(f"S{i}", [key(i)], [i]))
        ff.wait_hits("stall_read", 4)  # 2 at once, 2 more on the replacements
        assert tier.drain_jobs(T + SLACK)
        assert counters(tier)["stuck_threads"] == 4
        assert len(tier.get_finished_jobs()) == 4
        t0 = time.monotonic()
        tier.submit_load(TransferJob("F", [key(4)], [4]))
        tier.submit_store(TransferJob("G", [key(9)], [9]))
        assert tier.drain_jobs(SLACK)
        assert time.monotonic() - t0 < T  # not a deadline: at once
        res = {r.job_id: r for r in tier.get_finished_jobs()}
        assert {j: (r.success, r.error.errno) for j, r in res.items()} == {
            "F": (False, errno.EAGAIN), "G": (False, errno.EAGAIN)}
        assert "stuck" in str(res["F"].error)
        c = counters(tier)
        assert c["jobs_refused"] == 2 and c["load_timeouts"] == 4 and c["store_timeouts"] == 0
        assert tier.metrics.registry.get_sample_value("kvtier:kv_offload_tiering_jobs_refused_total",
                                                      {"tier": "1:kvtier"}) == 2
        serves_again(tier, ff, 4, 4)


@pytest.mark.parametrize("op", ["write", "open"])
def test_late_store_never_publishes(backend, ff, area, op):
    """Block 2 of 3 (key 7) stalls writing its temp: the job is reported at its deadline
    naming that block, and the late store never publishes it."""
    buf = filled(4)
    with tier_on(area, buf) as tier:
        path = tier.file_mapper._file_name(*key(7))
        store_all(tier, [5])  # found there: counted as stored too
        ff.stall(op, glob_of(tier, ff, key(7)) + "_*.tmp")
        tier.submit_store(TransferJob("S", [key(5), key(6), key(7)], [5, 6, 7]))
        ff.wait_hits(f"stall_{op}", 1)
        assert tier.drain_jobs(T + SLACK)
        (r,) = tier.get_finished_jobs()
        assert (r.success, r.error.errno, r.successful_keys) == (False, errno.ETIMEDOUT, ())
        assert r.error.filename == path and "at block 2 of 3, named here" in str(r.error)
        assert counters(tier)["store_timeouts"] == 1
        ff.clear()
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)
        d = os.path.dirname(ff.backing_of(path))
        assert not os.path.exists(ff.backing_of(path))
        assert glob.glob(os.path.join(d, "*.tmp")) == []
        assert tier.lookup([key(7)]) == [False]


def test_store_with_a_hung_rename_is_reported_at_its_deadline(backend, ff, area):
    """The rename cannot be taken back: the job is reported failed at the
    deadline without waiting for it; the rename, when it completes, publishes
    the complete block (written and checksummed before the deadline)."""
    buf = filled(5)
    with tier_on(area, buf) as tier:
        ff.stall("rename", glob_of(tier, ff, key(8)))
        tier.submit_store(TransferJob("S", [key(8)], [8]))
        ff.wait_hits("stall_rename", 1)
        assert tier.drain_jobs(T + SLACK)
        (r,) = tier.get_finished_jobs()
        assert (r.success, r.error.errno) == (False, errno.ETIMEDOUT)
        ff.clear()
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)
        out = np.zeros_like(buf)
        kio.batch_load_block([tier.file_mapper._file_name(*key(8))], out, [0], BS, checksum=True)
        assert np.array_equal(out[0], buf[8])


def test_shutdown_does_not_wait_beyond_the_deadline(backend, ff, area):
    buf = filled(6)
    tier = tier_on(area, buf)
    store_all(tier, [0])
    ff.stall("read", glob_of(tier, ff, key(0)))
    tier.submit_load(TransferJob("L", [key(0)], [3]))
    ff.wait_hits("stall_read", 1)
    t0 = time.monotonic()
    tier.shutdown()
    assert time.monotonic() - t0 < T + SLACK
    (r,) = tier.get_finished_jobs()
    assert r.error.errno == errno.ETIMEDOUT
    buf[3] = 0x11
    ff.clear()
    wait_until(lambda: counters(tier)["stuck_threads"] == 0)
    assert (buf[3] == 0x11).all()


def test_lookup_under_a_stall_is_a_miss_after_its_deadline(backend, ff, area):
    buf = filled(7)
    with tier_on(area, buf) as tier:
        store_all(tier, [0, 1])
        ff.stall("getattr", glob_of(tier, ff, key(1)))
        t0 = time.monotonic()
        assert tier.lookup([key(0), key(1)]) == [False, False]
        assert T <= time.monotonic() - t0 < T + SLACK
        c = counters(tier)
        assert c["lookup_timeouts"] == 1 and c["stuck_threads"] == 1
        ff.clear()
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)
        assert tier.lookup([key(0), key(1)]) == [True, True]


def test_a_stuck_lookup_makes_later_lookups_misses_at_once(backend, ff, area):
    """The lookup deadline is the lookup's own (2 s by default, not io_timeout_s):
    the first lookup of a stalled path answers misses after it; while that call is
    stuck in the filesystem, every later lookup (healthy paths too) answers misses at
    once, each counted as a lookup timeout, and no second thread is left in the
    filesystem; once it returns, lookups answer again."""
    buf = filled(11)
    with FileSystemTierManager(buf, area, "m", checksum_blocks=True, io_timeout_s=30) as tier:
        assert (tier._engine.io_timeout_s, tier._engine.lookup_timeout_s) == (30, 2.0)
        store_all(tier, [0, 1, 2])
        ff.stall("getattr", glob_of(tier, ff, key(1)))
        t0 = time.monotonic()
        assert tier.lookup([key(0), key(1)]) == [False, False]
        assert 2.0 <= time.monotonic() - t0 < 2.0 + SLACK  # its deadline, not io_timeout_s
        lookup_threads = [t for t in threading.enumerate() if t.name == "kvtier_fs_lookup"]
        assert len(lookup_threads) == 1
        for _ in range(5):
            t0 = time.monotonic()
            assert tier.lookup([key(0), key(2)]) == [False, False]
            assert time.monotonic() - t0 < 0.5  # at once: nothing asked of the filesystem
        assert ff.hits("stall_getattr") == 1  # and nothing more queued on it
        assert [t for t in threading.enumerate() if t.name == "kvtier_fs_lookup"] == lookup_threads
        c = counters(tier)
        assert (c["lookup_timeouts"], c["stuck_threads"]) == (6, 1)
        reg = tier.metrics.registry
        assert reg.get_sample_value("kvtier:kv_offload_tiering_timeouts_total", {"tier": "1:kvtier", "op": "lookup"}) == 6
        ff.clear()
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)
        assert tier.lookup([key(0), key(1), key(2), key(3)]) == [True, True, True, False]
        assert counters(tier)["lookup_timeouts"] == 6


def test_no_io_deadline_keeps_the_lookup_deadline(backend, ff, area):
    """io_timeout_s=0 (no job deadline) does not turn off the lookup's: a lookup of a
    stalled path answers misses after the default 2 s instead of hanging."""
    buf = filled(13)
    with FileSystemTierManager(buf, area, "m", checksum_blocks=True, io_timeout_s=0) as tier:
        assert (tier._engine.io_timeout_s, tier._engine.lookup_timeout_s) == (0, 2.0)
        store_all(tier, [0, 1])
        ff.stall("getattr", glob_of(tier, ff, key(1)))
        t0 = time.monotonic()
        assert tier.lookup([key(0), key(1)]) == [False, False]
        assert 2.0 <= time.monotonic() - t0 < 2.0 + SLACK
        assert counters(tier)["lookup_timeouts"] == 1
        ff.clear()
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)
        assert tier.lookup([key(0), key(1)]) == [True, True]


def test_lookup_timeout_s_default_bounds_and_checks(tmp_path):
    buf = filled(12)
    for io, lk, want in ((120, None, 2.0), (0.5, None, 0.5), (0, None, 2.0), (0, 0.5, 0.5), (0, 0, 0), (120, 0.25, 0.25), (1, 5, 5.0),
                         (120, 0, 0)):
        # io_timeout_s=0 (no job deadline) leaves the lookup's 2 s default
        with FileSystemTierManager(buf, tmp_path / f"t{io}_{lk}", "m", io_timeout_s=io,
                                   lookup_timeout_s=lk) as tier:
            assert tier._engine.lookup_timeout_s == want
    root = tmp_path / "never"
    for bad, exc in ((-1, ValueError), (float("nan"), ValueError), (1e10, ValueError), (10**400, ValueError),
                     ("1", TypeError),
                     (False, TypeError)):
        with pytest.raises(exc, match="lookup_timeout_s"):
            FileSystemTierManager(buf, root, "m", lookup_timeout_s=bad)
    assert not root.exists()


def test_constructor_probe_under_a_stall_names_the_root(ff, area):
    ff.stall("open", "*/.kvtier_probe_*")
    buf = filled(8)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        FileSystemTierManager(buf, area, "m", io_timeout_s=T)
    assert time.monotonic() - t0 < T + SLACK
    assert ei.value.errno == errno.ETIMEDOUT and ei.value.filename == area
    assert area in str(ei.value) or "tier root" in str(ei.value)


def test_shutdown_without_waiting_expires_running_jobs_at_once(backend, ff, area, caplog):
    """shutdown(wait=False) returns at once and the stalled load is expired
    by it (reported ECANCELED): the caller may reuse its rows right away. Its
    late outcome is logged at debug, not as a second failure."""
    caplog.set_level("DEBUG", logger="kvtier._tier.engine")
    buf = filled(9)
    tier = tier_on(area, buf, io_timeout_s=60)  # the deadline plays no part here
    store_all(tier, [0])
    ff.stall("read", glob_of(tier, ff, key(0)))
    tier.submit_load(TransferJob("L", [key(0)], [3]))
    ff.wait_hits("stall_read", 1)
    t0 = time.monotonic()
    assert tier.shutdown(wait=False) == []
    assert time.monotonic() - t0 < SLACK
    (r,) = tier.get_finished_jobs()
    assert (r.job_id, r.success, r.error.errno) == ("L", False, errno.ECANCELED)
    buf[3] = 0x22
    ff.clear()
    wait_until(lambda: counters(tier)["stuck_threads"] == 0)
    assert (buf[3] == 0x22).all()
    assert counters(tier)["load_timeouts"] == 0 and counters(tier)["load_failures"] == 1
    failures = [r for r in caplog.records if r.name == "kvtier._tier.engine" and r.levelname == "WARNING"]
    assert len(failures) == 1 and "cancelled by shutdown" in failures[0].getMessage()  # reported once
    late = [r for r in caplog.records if r.name == "kvtier._tier.engine" and "ended late" in r.getMessage()]
    assert [r.levelname for r in late] == ["DEBUG"]


def test_io_timeout_s_checked_before_any_io_and_zero_means_none(tmp_path):
    buf = filled(10)
    root = tmp_path / "never"
    for bad, exc in ((-1, ValueError), (float("inf"), ValueError), (1e10, ValueError), (10**400, ValueError),
                     (-10**400, ValueError), ("5", TypeError),
                     (True, TypeError)):
        with pytest.raises(exc, match="io_timeout_s"):
            FileSystemTierManager(buf, root, "m", io_timeout_s=bad)
    assert not root.exists()
    with FileSystemTierManager(buf, tmp_path / "t", "m", io_timeout_s=0) as tier:
        assert tier._engine._watchdog is None and tier.io_timeout_s == 0
        tier.submit_store(TransferJob("s", [key(1)], [1]))
        assert tier.drain_jobs(30)
        assert tier.get_finished_jobs()[0].success
        assert tier.lookup([key(1), key(2)]) == [True, False]
        out = buf.copy()
        buf[1] = 0
        tier.submit_load(TransferJob("l", [key(1)], [1]))
        assert tier.drain_jobs(30) and tier.get_finished_jobs()[0].success
        assert np.array_equal(buf[1], out[1])


@pytest.mark.parametrize("o_direct", ["accepted", "refused"])
def test_constructor_touches_the_root_only_under_its_deadline(ff, area, monkeypatch, o_direct):
    """The root stops answering stat right after the startup probes (O_DIRECT accepted:
    the root's identity is the next touch; refused: the filesystem type, a realpath):
    the constructor raises TimeoutError naming the root at its deadline."""
    real = kio.probe_o_direct
    timeout = 2.0

    def probe_then_stall(path):
        ok = real(path)
        ff.stall("getattr", "/" + os.path.basename(area))
        return ok and o_direct == "accepted"

    monkeypatch.setattr(kio, "probe_o_direct", probe_then_stall)
    release = threading.Timer(timeout + SLACK + 2, ff.clear)  # bounds the test where the stall holds the caller
    release.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as ei:
            FileSystemTierManager(filled(13), area, "m", io_timeout_s=timeout)
    finally:
        release.cancel()
    assert time.monotonic() - t0 < timeout + SLACK
    assert ff.hits("stall_getattr") >= 1
    assert ei.value.errno == errno.ETIMEDOUT and ei.value.filename == area


@pytest.mark.parametrize("op", ["write", "rename"])
def test_shutdown_without_waiting_cancels_a_store_unless_it_is_renaming(backend, ff, area, op):
    """shutdown(wait=False) with a store stalled in its write: the store is cancelled
    (ECANCELED) and, released, unlinks its temp: nothing is published. Stalled in its
    rename (its commit section): it is not reported cancelled; released, it finishes
    and is reported as what it is, a stored block."""
    buf = filled(14)
    tier = tier_on(area, buf, io_timeout_s=60)  # the deadline plays no part here
    path = tier.file_mapper._file_name(*key(7))
    ff.stall(op, glob_of(tier, ff, key(7)) + ("_*.tmp" if op == "write" else ""))
    tier.submit_store(TransferJob("S", [key(7)], [7]))
    ff.wait_hits(f"stall_{op}", 1)
    assert tier.shutdown(wait=False) == []
    got = tier.get_finished_jobs()
    if op == "write":
        assert [(r.job_id, r.success, r.error.errno) for r in got] == [("S", False, errno.ECANCELED)]
    else:
        assert got == []  # not cancelled: it is renaming
    ff.clear()
    wait_until(lambda: counters(tier)["stuck_threads"] == 0 and tier._engine.pending == 0)
    d = os.path.dirname(ff.backing_of(path))
    assert glob.glob(os.path.join(d, "*.tmp")) == []
    if op == "write":
        assert not os.path.exists(ff.backing_of(path)) and tier.get_finished_jobs() == []
    else:
        (r,) = tier.get_finished_jobs()
        assert (r.job_id, r.success, r.successful_keys) == ("S", True, (key(7),))
        out = np.zeros_like(buf)
        kio.batch_load_block([path], out, [0], BS, checksum=True)
        assert np.array_equal(out[0], buf[7])


def test_more_stalls_than_the_cap_leave_at_most_the_cap_stuck(backend, ff, area):
    """1+1 threads (cap 4) and 7 loads stalled in read: at most 4 threads are ever
    stuck (a job starts only while fewer than the cap are in the filesystem); the
    4 that started time out, the other 3 fail fast (EAGAIN), each job once."""
    buf = filled(15)
    with tier_on(area, buf, n_read_threads=1, n_write_threads=1) as tier:
        store_all(tier, range(7))
        ff.stall("read", "*")
        for i in range(7):
            tier.submit_load(TransferJob(f"S{i}", [key(i)], [i]))
        assert tier.drain_jobs(3 * T + SLACK)
        res = {r.job_id: r.error.errno for r in tier.get_finished_jobs()}
        assert sorted(res) == [f"S{i}" for i in range(7)]
        assert sorted(res.values()) == [errno.EAGAIN] * 3 + [errno.ETIMEDOUT] * 4
        time.sleep(2 * T)  # a replacement that started a job would be stuck by now
        c = counters(tier)
        assert (c["stuck_threads"], c["load_timeouts"], c["jobs_refused"]) == (4, 4, 3)
        assert ff.hits("stall_read") == 4
        serves_again(tier, ff, 0, 8)


def test_concurrent_lookups_on_a_stalled_root_leave_one_thread_stuck(backend, ff, area):
    """6 lookups at once from 6 threads on a root that does not answer: one lookup
    thread is stuck (the documented cap), the 6 answers are misses."""
    buf = filled(16)
    with tier_on(area, buf) as tier:
        store_all(tier, [0])
        ff.stall("getattr", glob_of(tier, ff, key(0)))
        answers = []
        ts = [threading.Thread(target=lambda: answers.append(tier.lookup([key(0)]))) for _ in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(T + SLACK)
        assert answers == [[False]] * 6
        assert ff.hits("stall_getattr") == 1
        assert counters(tier)["stuck_threads"] == 1
        assert len([t for t in threading.enumerate() if t.name == "kvtier_fs_lookup"]) == 1
        ff.clear()
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)
        assert tier.lookup([key(0)]) == [True]


@pytest.mark.parametrize("landing_mode", ["bounce", "direct"])
def test_a_stalled_read_is_named_and_only_the_blocks_before_it_are_kept(backend, ff, area, landing_mode):
    """8 blocks into page-aligned rows, the read of block 3 stalls. Either landing, the
    deadline error names block 3 (filename, "at block 3 of 8"), keeps blocks 0-2 and
    carries that count (num_succeeded). With "direct" the read lands in the row inside its
    commit section, so the report waits for it to return; the block it finishes after the
    deadline does not count, nor do the blocks the late I/O goes on with before the expiry
    wins (it named block 4, or 7 on the fallback, and kept as many)."""
    n = 8
    buf = np.frombuffer(mmap.mmap(-1, 2 * n * BS), dtype=np.uint8).reshape(2 * n, BS)
    buf[:n] = filled(12)[:n]
    data = buf[:n].copy()
    with tier_on(area, buf, n_read_threads=1, n_write_threads=1, load_landing=landing_mode) as tier:
        assert tier.use_o_direct and tier.load_landing == landing_mode
        store_all(tier, range(n))
        ff.stall("read", glob_of(tier, ff, key(3)))
        buf[n:] = 0
        tier.submit_load(TransferJob("L", [key(i) for i in range(n)], list(range(n, 2 * n))))
        ff.wait_hits("stall_read", 1)
        if landing_mode == "bounce":  # reported at its deadline, the read still stalled
            assert tier.drain_jobs(T + SLACK)
        else:  # held by the read in its commit section until it returns
            time.sleep(T + 0.5)
            assert tier.get_finished_jobs() == []
        ff.clear()
        assert tier.drain_jobs(30)
        (r,) = tier.get_finished_jobs()
        assert (r.success, r.successful_keys, r.transfer_bytes) == (False, tuple(key(i) for i in range(3)), 3 * BS)
        assert isinstance(r.error, TimeoutError) and r.error.errno == errno.ETIMEDOUT
        assert r.error.filename == tier.file_mapper._file_name(*key(3))
        assert "at block 3 of 8, named here" in str(r.error)
        assert r.error.num_succeeded == 3
        assert np.array_equal(buf[n:n + 3], data[:3])
        c = counters(tier)
        assert (c["load_timeouts"], c["load_failures"], c["bytes_read"]) == (1, 1, 3 * BS)
        snap = buf[n + 3:].copy()
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)
        assert np.array_equal(buf[n + 3:], snap)  # nothing written after the report
        assert tier.get_finished_jobs() == []


@pytest.mark.parametrize("op", ["open", "getxattr"])
def test_direct_landing_with_a_stalled_open_or_getxattr_is_reported_at_its_deadline(backend, ff, area, op):
    """8 blocks, landing "direct", the open (or the identity record's getxattr) of block 3
    stalls for STALL s. The commit section holds only the read into the row (as the C
    core's read_verify), so the stalled call holds none: the job is reported at its
    deadline, well before the stall ends, keeping blocks 0-2 and naming block 3, and once
    the stall is released the late I/O writes nothing into the rows."""
    n, k, stall_s = 8, 3, 10.0
    buf = np.frombuffer(mmap.mmap(-1, 2 * n * BS), dtype=np.uint8).reshape(2 * n, BS)
    buf[:n] = filled(13)[:n]
    data = buf[:n].copy()
    with tier_on(area, buf, n_read_threads=1, n_write_threads=1, load_landing="direct") as tier:
        assert tier.use_o_direct and tier.load_landing == "direct"
        store_all(tier, range(n))
        ff.stall(op, glob_of(tier, ff, key(k)), ms=int(stall_s * 1000))
        buf[n:] = 0
        t0 = time.monotonic()
        tier.submit_load(TransferJob("L", [key(i) for i in range(n)], list(range(n, 2 * n))))
        ff.wait_hits(f"stall_{op}", 1)
        assert tier.drain_jobs(stall_s + SLACK)
        took = time.monotonic() - t0
        assert took < T + SLACK, f"reported {took:.2f} s after submit (deadline {T} s, stall {stall_s} s)"
        (r,) = tier.get_finished_jobs()
        assert (r.success, r.successful_keys, r.transfer_bytes) == (False, tuple(key(i) for i in range(k)), k * BS)
        assert isinstance(r.error, TimeoutError) and r.error.errno == errno.ETIMEDOUT
        assert r.error.filename == tier.file_mapper._file_name(*key(k))
        assert f"at block {k} of {n}, named here" in str(r.error)
        assert r.error.num_succeeded == k
        assert np.array_equal(buf[n:n + k], data[:k]) and (buf[n + k:] == 0).all()
        snap = buf[n:].copy()
        ff.clear()  # the stalled call returns: the late load goes on, and writes nothing
        wait_until(lambda: counters(tier)["stuck_threads"] == 0)
        assert np.array_equal(buf[n:], snap)
        assert tier.get_finished_jobs() == []
        c = counters(tier)
        assert (c["load_timeouts"], c["load_failures"], c["bytes_read"]) == (1, 1, k * BS)
