"""Capacity of a bounded root (kvtier/_tier/capacity.py, docs/capacity.md): the size
parser, the census against find(1), eviction order and watermarks, two writer processes
under one bound, evictor failover after SIGKILL, recency across a restart, loads racing
eviction, a full tmpfs that recovers by itself, ``kvtier evict --dry-run``, shard
directories removed under a racing store."""
from __future__ import annotations

import errno
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvtier._tier import capacity as cap
from kvtier.manager import FileSystemTierManager, TransferJob

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 16384  # block bytes: 4 pages on every filesystem here


def _use_backend(monkeypatch, io_backend):
    from kvtier import io as kio

    monkeypatch.setattr(kio, "batch_store_block", io_backend.batch_store_block)
    monkeypatch.setattr(kio, "batch_load_block", io_backend.batch_load_block)


def _tier(root, rows=64, **kw):
    buf = np.zeros((rows, BS), dtype=np.uint8)
    for i in range(rows):
        buf[i] = np.frombuffer(np.random.default_rng(i).bytes(BS), dtype=np.uint8)
    kw.setdefault("use_o_direct", False)
    kw.setdefault("n_read_threads", 2)
    kw.setdefault("n_write_threads", 2)
    return FileSystemTierManager(buf, str(root), "m", block_size=BS, **kw), buf


def _keys(tag: int, n: int):
    return [(bytes([tag]) + i.to_bytes(2, "big") + bytes(13), 0) for i in range(n)]


def _run(t, job):
    (t.submit_load if job.is_promotion else t.submit_store)(job)
    assert t.drain_jobs(30)
    return t.get_finished_jobs()


def _find_bytes(root) -> int:
    """Allocated bytes of every regular file under root, by find(1) (st_blocks * 512)."""
    out = subprocess.run(["find", str(root), "-type", "f", "-printf", r"%b\n"], capture_output=True, text=True,
                         check=True).stdout.split()
    return 512 * sum(int(x) for x in out)


# ---------------------------------------------------------------------- parsing

@pytest.mark.parametrize("value,want", [
    (4096, 4096), ("4096", 4096), ("64M", 64 << 20), ("64m", 64 << 20), ("500G", 500 << 30),
    ("1.5T", int(1.5 * (1 << 40))), ("2GiB", 2 << 30), ("1K", 1024), (" 3 G ", 3 << 30), (None, None),
    ("9007199254740993", 2**53 + 1), ("3.999999999999999999999G", (4 << 30) - 1), ("3.", 3), (".5K", 512),
    ("0.1K", 102), ("1.0000000000000000000000000000001P", 1 << 50),
    ("8191.9999999999999999999999999999P", (8192 << 50) - 1)])  # 8 EiB less a byte: the most there is
def test_parse_max_bytes(value, want):
    assert cap.parse_max_bytes(value) == want


@pytest.mark.parametrize("value,exc,text", [
    ("12X", ValueError, "K, M, G, T, P = powers of 1024"), ("", ValueError, "powers of 1024"), ("-5G", ValueError, "cannot parse"),
    (0, ValueError, ">= 1"), ("0", ValueError, ">= 1"), (1.5, TypeError, "size string"),
    (True, TypeError, "size string"), ("150%", ValueError, "(0, 100]"), ("0%", ValueError, "(0, 100]"),
    ([1], TypeError, "size string"), ("1.5", ValueError, "no whole number of bytes"),
    ("0.5B", ValueError, "no whole number of bytes"), (2**63, ValueError, "8 EiB"), (2**1100, ValueError, "8 EiB"),
    ("99999999999999999999999P", ValueError, "8 EiB"), ("8192P", ValueError, "8 EiB")])
def test_parse_max_bytes_bad_inputs(value, exc, text):
    with pytest.raises(exc) as ei:
        cap.parse_max_bytes(value)
    assert text in str(ei.value) and "max_bytes" in str(ei.value)


def test_a_bound_below_one_block_is_refused_at_start_and_leaves_nothing_running(tmp_path):
    with pytest.raises(ValueError) as ei:
        _tier(tmp_path / "new", max_bytes="1K")
    assert "less than one block" in str(ei.value) and f"({BS} bytes" in str(ei.value) and str(tmp_path) in str(ei.value)
    assert "max_bytes '1K' (1024 bytes)" in str(ei.value)
    assert not (tmp_path / "new").exists()  # refused before any I/O (was: root, config.json, kvtier.json made)
    # exactly one block: the root's own files (config.json, kvtier.json, .kvtier/) leave it no room
    with pytest.raises(ValueError) as ei:
        _tier(tmp_path, max_bytes=BS)
    assert f"plus the root's own files ({cap.STATE_BYTES} bytes)" in str(ei.value)
    assert f"give at least {BS + cap.STATE_BYTES}" in str(ei.value)
    assert cap.root_capacity(str(tmp_path)) is None
    assert list(tmp_path.glob(".kvtier/writers/*")) == []  # no ledger: refused before the capacity started
    t, _ = _tier(tmp_path, max_bytes=4 * BS)  # the root is free for a tier with a bound that fits
    try:
        assert _run(t, TransferJob(1, _keys(1, 2), [0, 1]))[0].success
    finally:
        t.shutdown()


def test_percentage_of_the_filesystem(tmp_path):
    st = os.statvfs(tmp_path)
    assert cap.parse_max_bytes("50%", str(tmp_path)) == int(st.f_blocks * st.f_frsize * 0.5)
    assert cap.parse_max_bytes("100%", str(tmp_path)) == st.f_blocks * st.f_frsize
    assert cap.parse_max_bytes("90%") is None  # syntax only, resolved once the root exists


@pytest.mark.parametrize("kw,text", [
    ({"evict_high": 0.8, "evict_low": 0.9}, "0 < evict_low < evict_high <= 1"),
    ({"evict_high": 1.2}, "0 < evict_low < evict_high <= 1"),
    ({"evict_low": 0}, "0 < evict_low < evict_high <= 1"),
    ({"census_interval_s": 0}, "census_interval_s must be > 0"),
    ({"touch_window_s": -1}, "touch_window_s"),
    ({"evict_high": "x"}, "evict_high must be a number"),
    ({"max_bytes": "lots"}, "max_bytes: cannot parse 'lots'")])
def test_bad_capacity_keys_fail_before_any_io(tmp_path, kw, text):
    root = tmp_path / "root"
    with pytest.raises((TypeError, ValueError)) as ei:
        _tier(root, **{"max_bytes": "1G", **kw})
    assert text in str(ei.value)
    assert not root.exists()  # nothing touched


def test_the_capacity_keys_are_checked_with_the_other_tier_keys():
    # both shells build a TierConfig (kvtier/_tier/config.py): it carries the checked knobs
    from kvtier._tier.config import TierConfig

    assert TierConfig().capacity is None and TierConfig(evict_high=0.9).capacity is None
    c = TierConfig(max_bytes="2G", evict_high=0.9, evict_low=0.5, census_interval_s=3, touch_window_s=0).capacity
    assert c == cap.CapacityConfig("2G", 0.9, 0.5, 3.0, 0.0) and c.bound("/") == 2 << 30
    with pytest.raises(ValueError, match="0 < evict_low < evict_high <= 1"):
        TierConfig(max_bytes="1G", evict_high=0.5, evict_low=0.6)
    with pytest.raises(ValueError, match="evict_low"):  # checked even while off, as the others are
        TierConfig(evict_low=2)


def test_two_tiers_of_one_process_on_one_root_need_the_same_bound_by_value(tmp_path):
    """Same values written differently ("1G", 1073741824, "1024M") are the same bound: the
    second tier shares the root's capacity (ValueError before); another bound or another
    watermark is a ValueError naming the keys."""
    a, _ = _tier(tmp_path, max_bytes="1G")
    try:
        for same in (1 << 30, "1024M", "1 GiB"):
            b, _ = _tier(tmp_path, max_bytes=same)
            assert b.capacity.rc is a.capacity.rc
            b.shutdown()
        for other in ({"max_bytes": "2G"}, {"max_bytes": "1G", "evict_low": 0.5}):
            with pytest.raises(ValueError, match="already bounded in this process"):
                _tier(tmp_path, **other)
    finally:
        a.shutdown()


def test_bad_capacity_keys_fail_the_vllm_tier_before_any_io(tmp_path):
    pytest.importorskip("vllm")
    from vllm_harness import Harness

    root = tmp_path / "kv"
    conf = {"type": "kvtier", "root_dir": str(root), "max_bytes": "1G", "evict_high": 0.5, "evict_low": 0.6}
    with pytest.raises(ValueError, match="0 < evict_low < evict_high <= 1"):
        Harness([conf], block_bytes=8192)
    assert not root.exists()


# ---------------------------------------------------------------------- census

def test_census_counts_every_file_as_find_and_lists_only_blocks(tmp_path, io_backend, monkeypatch):
    _use_backend(monkeypatch, io_backend)
    t, _ = _tier(tmp_path, max_bytes="1G", census_interval_s=3600)
    try:
        assert all(r.success for r in _run(t, TransferJob(1, _keys(1, 10), list(range(10)))))
        rank = t.file_mapper.rank_path
        p0 = t.file_mapper.get_file_name(_keys(1, 1)[0])
        temp = p0 + "_0123456789abcdef.tmp"
        with open(temp, "wb") as f:
            f.write(b"x" * 5000)
        os.makedirs(os.path.join(str(tmp_path), "other_r0", "abc", "de_g0"))  # another layout: counted and evictable
        with open(os.path.join(str(tmp_path), "other_r0", "abc", "de_g0", "abcde0.bin"), "wb") as f:
            f.write(b"y" * 8192)
        for name in ("ffff.bin", "abcdf0.bin", "abd.bin"):  # hex .bin files whose names are not of their shard: counted, never evicted
            with open(os.path.join(str(tmp_path), "other_r0", "abc", "de_g0", name), "wb") as f:
                f.write(b"w" * 4096)
        with open(os.path.join(rank, "abc", "notes.txt"), "wb") if os.path.isdir(os.path.join(rank, "abc")) \
                else open(os.path.join(str(tmp_path), "notes.txt"), "wb") as f:
            f.write(b"z" * 100)
        c = cap.census(str(tmp_path))
        assert c.bytes == _find_bytes(tmp_path) and c.bytes > 10 * BS
        out = subprocess.run(["find", str(tmp_path), "-type", "f"], capture_output=True, text=True).stdout.split()
        assert c.files == len(out)
        paths = sorted(e[4] for e in c.entries)
        want = sorted(t.file_mapper.get_file_names(_keys(1, 10)) +
                      [os.path.join(str(tmp_path), "other_r0", "abc", "de_g0", "abcde0.bin")])
        assert paths == want and c.blocks == 11  # no temp, no config, nothing of .kvtier, no misplaced .bin
        assert all(cap.is_block_path(str(tmp_path), p) for p in paths)
        assert c.block_bytes == sum(os.lstat(p).st_blocks * 512 for p in want)
    finally:
        t.shutdown()


def test_is_block_path():
    r = "/r"
    assert cap.is_block_path(r, "/r/m_0123456789ab_r0/abc/de_g0/abcdef01.bin")
    assert cap.key_of_path("/r/m_0123456789ab_r0/abc/de_g3/abcdef01.bin") == (bytes.fromhex("abcdef01"), 3)
    for p in ["/r/m_0123456789ab_r0/abc/de_g0/abcdef01.bin_0011223344556677.tmp",
              "/r/m_0123456789ab/config.json", "/r/.kvtier/usage.json", "/r/m_0123456789ab_r0/abd/de_g0/abcdef01.bin",
              "/r/m_0123456789ab_r0/abc/df_g0/abcdef01.bin", "/r/m_0123456789ab_r0/abc/abcdef01.bin",
              "/r/x/m_r0/abc/de_g0/abcdef01.bin"]:
        assert not cap.is_block_path(r, p), p


# ---------------------------------------------------------------------- eviction order

def test_eviction_oldest_first_heads_newer_down_to_low(tmp_path, io_backend, monkeypatch):
    _use_backend(monkeypatch, io_backend)
    t, _ = _tier(tmp_path, max_bytes="1G", census_interval_s=3600)
    try:
        for tag in (1, 2, 3):  # three jobs of 8 blocks, in chain order, one after the other
            assert all(r.success for r in _run(t, TransferJob(tag, _keys(tag, 8), list(range(8)))))
            time.sleep(0.01)
        fm = t.file_mapper
        m = [os.lstat(p).st_mtime_ns for p in fm.get_file_names(_keys(1, 8))]
        assert m == sorted(m, reverse=True) and len(set(m)) == 8  # head newest: now - i µs
        base = cap.census(str(tmp_path)).bytes
        block = os.lstat(fm.get_file_name(_keys(1, 1)[0])).st_blocks * 512
        # a bound where the 24 blocks are above high: down to low = base - 10 blocks
        bound = int((base - 10 * block) / 0.85) + 1
        c, r, rec = cap.one_pass(str(tmp_path), bound)
        assert len(r.evicted) == 10 and r.evicted_bytes == 10 * block
        # oldest job first, tail first within it; then job 2's tail
        want = list(reversed(fm.get_file_names(_keys(1, 8)))) + list(reversed(fm.get_file_names(_keys(2, 8))))[:2]
        assert r.evicted == want
        assert r.target == int(0.85 * bound) and cap.census(str(tmp_path)).bytes <= r.target
        left = [os.path.exists(p) for p in fm.get_file_names(_keys(2, 8) + _keys(3, 8))]
        assert left == [True] * 6 + [False] * 2 + [True] * 8
        assert rec["bytes"] == cap.census(str(tmp_path)).bytes
        # emptied shard directories are gone; the rank directory stays
        for p in want:
            assert not os.path.isdir(os.path.dirname(p)) or os.listdir(os.path.dirname(p))
        assert os.path.isdir(fm.rank_path)
    finally:
        t.shutdown()


def test_a_block_changed_since_the_census_is_not_evicted(tmp_path):
    d = tmp_path / "m_r0" / "abc" / "de_g0"
    d.mkdir(parents=True)
    paths = []
    for i in range(4):
        p = d / f"abcde{i}.bin"
        p.write_bytes(b"k" * BS)
        os.utime(p, ns=(10**18 + i, 10**18 + i))
        paths.append(str(p))
    c = cap.census(str(tmp_path))
    os.utime(paths[0], ns=(2 * 10**18, 2 * 10**18))  # refreshed by a hit after the census
    os.unlink(paths[1])
    with open(paths[1], "wb") as f:  # republished by a peer (another inode)
        f.write(b"n" * BS)
    r = cap.evict(c, c.bytes, 0)
    assert r.skipped == 2 and sorted(r.evicted) == sorted(paths[2:])
    assert os.path.exists(paths[0]) and open(paths[1], "rb").read() == b"n" * BS


def _ledger(root, name, d):
    w = os.path.join(root, ".kvtier", "writers")
    os.makedirs(w, exist_ok=True)
    with open(os.path.join(w, name), "w") as f:
        f.write(d if isinstance(d, str) else json.dumps(d))
    return os.path.join(w, name)


def test_a_garbage_ledger_counts_nothing_and_never_stops_the_evictor(tmp_path):
    """A ledger file of the wrong shape (a pid that is no int, a NaN or far-future stamp
    that would never age out, a list) is skipped or dead: read_ledgers never raises (it
    did: int('x') in the pid check stopped every census). A dead one (no live pid here)
    counts, as a writer's that exited, until a census that began after its stamp: then
    the evictor removes it; the far-future one is garbage: never counted, removed."""
    host, boot, ns = cap._host_identity()
    now = time.time()
    me = {"host": host, "boot": boot, "pidns": ns}
    _ledger(tmp_path, "good", {**me, "pid": os.getpid(), "bytes": 12345, "t": now, "since": 7.0})
    dead = [_ledger(tmp_path, "pidstr", {**me, "pid": "x", "bytes": 10**9, "t": now}),
            _ledger(tmp_path, "pidnull", {**me, "pid": None, "bytes": 10**9, "t": now}),
            _ledger(tmp_path, "pid0", {**me, "pid": 0, "bytes": 10**9, "t": now}),
            _ledger(tmp_path, "future", {"host": "elsewhere", "pid": 1, "bytes": 10**9, "t": now + 10**6})]
    skipped = [_ledger(tmp_path, "nan", '{"host": "elsewhere", "pid": 1, "bytes": 1000000000, "t": NaN}'),
               _ledger(tmp_path, "list", [1, 2]), _ledger(tmp_path, "strbytes", {"bytes": "9", "t": now}),
               _ledger(tmp_path, "torn", '{"bytes": 10, "t": 17')]
    assert cap.read_ledgers(str(tmp_path), now=now, max_age=5.0, since=7.0) == (12345 + 3 * 10**9, 1)
    assert cap.read_ledgers(str(tmp_path), now=now, max_age=5.0, remove_dead=True, before=now - 1) \
        == (12345 + 3 * 10**9, 1)  # no census since their stamp: kept, counted (the far-future one removed)
    assert [os.path.exists(p) for p in dead] == [True, True, True, False]
    assert cap.read_ledgers(str(tmp_path), now=now, max_age=5.0, remove_dead=True, before=now + 1) == (12345, 1)
    assert not any(os.path.exists(p) for p in dead) and all(os.path.exists(p) for p in skipped)
    # and a tier on the root censuses and evicts as usual beside them
    _ledger(tmp_path, "pidstr", {**me, "pid": "x", "bytes": 10**9, "t": time.time() + 3600})
    t, _ = _tier(tmp_path, max_bytes=20 * BS + 16384, census_interval_s=0.1)
    try:
        rc = cap.root_capacity(str(tmp_path))
        ok = 0
        for j in range(12):  # 2-block jobs: they fit in the band between the watermarks
            ok += _run(t, TransferJob(j, _keys(j, 2), list(range(2))))[0].success
            assert rc.wait_pass(5, after=rc.passes)
        assert rc.censuses >= 2 and t.metrics.counters.snapshot()["evicted_capacity"] > 0 and ok >= 8
    finally:
        t.shutdown()


@pytest.mark.parametrize("bad", ["[" * 5000, '{"bytes": 5, "t": 1' + "0" * 400 + "}",
                                 "since", "done"])
def test_a_ledger_too_deep_or_too_large_counts_nothing_and_never_fails_a_store(tmp_path, bad):
    """A ledger nested deeper than the JSON parser's recursion (RecursionError) or with an
    int too large for a float (OverflowError in the finite check: in ``t``, ``since`` or a
    ``done`` bucket) raised out of submit_store and failed every tick (no census ever).
    Now it is no ledger, or its bad field is: the stores are admitted and the evictor
    censuses."""
    now, big = time.time(), 10 ** 400
    host, boot, ns = cap._host_identity()
    me = {"host": host, "boot": boot, "pidns": ns, "pid": os.getpid(), "t": now, "bytes": BS, "inflight": BS,
          "since": 0.0, "done": []}
    if bad == "since":
        bad = dict(me, since=big)
    elif bad == "done":
        bad = dict(me, done=[[big, BS]])
    _ledger(tmp_path, "bad", bad)
    t, _ = _tier(tmp_path, rows=4, max_bytes="1G", census_interval_s=0.1)
    try:
        rc = cap.root_capacity(str(tmp_path))
        res = [_run(t, TransferJob(j, _keys(j, 4), list(range(4))))[0] for j in range(3)]
        assert all(r.success for r in res)
        assert rc.wait_pass(5, after=0) and rc.censuses >= 1 and rc.tick_failures == 0
        assert rc._others() <= BS  # the bad ledger adds its bytes at most
    finally:
        t.shutdown()


FIFO_CHILD = r"""
import os, sys, time, numpy as np
sys.path.insert(0, {repo!r})
from kvtier.manager import FileSystemTierManager, TransferJob
from kvtier._tier import capacity as cap
root = sys.argv[1]
t = FileSystemTierManager(np.ones((2, {bs}), np.uint8), root, "m", block_size={bs}, use_o_direct=False,
                          max_bytes=1 << 30, census_interval_s=0.1)
rc = cap.root_capacity(root)
ok = 0
for j in range(3):
    t.submit_store(TransferJob(j, [(bytes([j]) + bytes(15), 0), (bytes([j, 1]) + bytes(14), 0)], [0, 1]))
    t.drain_jobs(10)
    ok += sum(r.success for r in t.get_finished_jobs())
    time.sleep(0.1)
print(ok, rc.censuses >= 1, flush=True)
t.shutdown()
print("shut down", flush=True)
"""


@pytest.mark.parametrize("where", ["writers/fifo", "usage.json", "evict.request"])
def test_a_fifo_in_the_state_directory_never_hangs_a_tier(tmp_path, where):
    """A FIFO where a ledger, usage.json or evict.request belongs: its open (or read) blocked
    for ever (submit_store in the writers' listing, the capacity thread reading the usage
    or the request, shutdown joining that thread). Now only regular files are read: the
    stores run, the evictor censuses, shutdown returns."""
    os.makedirs(tmp_path / ".kvtier" / "writers")
    os.mkfifo(tmp_path / ".kvtier" / where)
    # (usage.json is read at the capacity thread's first tick, before it takes the lock)
    r = subprocess.run([sys.executable, "-c", FIFO_CHILD.format(repo=REPO, bs=BS), str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["3", "True", "shut", "down"], r.stdout + r.stderr
    assert cap.read_usage(str(tmp_path))["bytes"] > 0  # published (a FIFO usage.json renamed over)
    assert cap.read_ledgers(str(tmp_path)) == (0, 0)  # the child's ledger removed; a FIFO is none


@pytest.mark.parametrize("bad", [
    {"bytes": 5}, {"bytes": 5, "scan_started": "x", "scan_finished": 1.0},
    {"bytes": 5, "scan_started": 1.0, "scan_finished": 1.0, "alloc_ratio": "x"},
    {"bytes": 5, "scan_started": 1.0, "scan_finished": 1.0, "room": "x"},
    {"bytes": True, "scan_started": 1.0, "scan_finished": 1.0}, {"bytes": -5, "scan_started": 1.0, "scan_finished": 1.0},
    {"bytes": 5, "scan_started": 1.0, "scan_finished": 1.0, "alloc_ratio": 1e308},
    '{"bytes": 5, "scan_started": 1' + "0" * 400 + ', "scan_finished": 1.0}', "[" * 5000,
    [5], '{"bytes": 12, "scan_st'])
def test_a_usage_file_of_the_wrong_shape_is_none_and_never_fails_a_store(tmp_path, bad):
    """A usage.json that is valid JSON with a field its readers use of the wrong type (or
    missing) reads as None, as a truncated one does; a writer that is not the evictor
    then admits on its own counts: its store is a JobResult, never an exception out of
    submit_store (KeyError 'scan_started' / ValueError before), and its gauges read."""
    sd = tmp_path / ".kvtier"
    (sd / "writers").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from kvtier._tier import capacity as cap; "
                               f"l = cap.EvictorLock({str(tmp_path)!r}); assert l.try_acquire(); print('held', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().startswith("held")
        (sd / "usage.json").write_text(bad if isinstance(bad, str) else json.dumps(bad))
        assert cap.read_usage(str(tmp_path)) is None
        t, _ = _tier(tmp_path, max_bytes=4 * BS, census_interval_s=0.1)
        try:
            time.sleep(0.15)  # the capacity thread has read the usage file
            res = [_run(t, TransferJob(j, _keys(j, 4), list(range(4))))[0] for j in range(3)]
            assert res[0].success and all(r.error.errno == errno.ENOSPC for r in res[1:])
            snap = t.metrics.counters.snapshot()
            # no census read: no age (NaN), not a fresh 0 that an alert on staleness would miss
            assert math.isnan(snap["capacity_census_age"]) and math.isnan(snap["capacity_evictor_lag"])
            assert math.isnan(snap["capacity_inodes_free"])
            assert snap["stores_dropped"] == 2
        finally:
            t.shutdown()
    finally:
        holder.kill()
        holder.wait()
    good = {"bytes": 5, "scan_started": 1.0, "scan_finished": 2, "room": None, "alloc_ratio": 1.0, "evictor": "h:1"}
    (sd / "usage.json").write_text(json.dumps(good))
    assert cap.read_usage(str(tmp_path)) == good


def test_restart_keeps_recency_order(tmp_path, io_backend, monkeypatch):
    """Recency is the files' mtime: a new tier (a restart) evicts what the old one used least."""
    _use_backend(monkeypatch, io_backend)
    t, _ = _tier(tmp_path, max_bytes="1G", census_interval_s=3600, touch_window_s=0)
    for tag in (1, 2):
        assert all(r.success for r in _run(t, TransferJob(tag, _keys(tag, 4), list(range(4)))))
        time.sleep(0.01)
    time.sleep(0.01)
    r = _run(t, TransferJob(3, _keys(1, 4), list(range(4, 8)), is_promotion=True))  # job 1 used again
    assert r[0].success
    t.shutdown()
    assert cap.root_capacity(str(tmp_path)) is None  # nothing left in memory
    t2, _ = _tier(tmp_path, max_bytes="1G", census_interval_s=3600)
    try:
        fm = t2.file_mapper
        # t2's evictor publishes its first census (.kvtier/usage.json) from its own thread:
        # once that is on disk the root's bytes hold still for the two censuses below
        assert cap.root_capacity(str(tmp_path)).wait_pass(5, after=0)
        base = cap.census(str(tmp_path)).bytes
        block = os.lstat(fm.get_file_name(_keys(2, 1)[0])).st_blocks * 512
        c, ev, _ = cap.one_pass(str(tmp_path), int((base - 4 * block) / 0.85) + 1)
        assert ev.evicted == list(reversed(fm.get_file_names(_keys(2, 4))))
        assert all(os.path.exists(p) for p in fm.get_file_names(_keys(1, 4)))
    finally:
        t2.shutdown()


def test_touch_window_rate_limits_refreshes(tmp_path):
    d = tmp_path / "m_r0" / "abc" / "de_g0"
    d.mkdir(parents=True)
    p = str(d / "abcde0.bin")
    open(p, "wb").write(b"x")
    rc = cap.attach(str(tmp_path), cap.check_config("1G", census_interval_s=3600, touch_window_s=60))
    try:
        rc.rc.stamp([p], force=False)
        m1 = os.lstat(p).st_mtime_ns
        time.sleep(0.01)
        rc.rc.stamp([p], force=False)  # within the window: no second utime
        assert os.lstat(p).st_mtime_ns == m1
        rc.rc.stamp([p], force=True)  # a store always stamps
        assert os.lstat(p).st_mtime_ns > m1
    finally:
        rc.close()


# ---------------------------------------------------------------------- admission

def test_a_store_over_the_bound_is_dropped_at_once_and_counted(tmp_path, io_backend, monkeypatch):
    _use_backend(monkeypatch, io_backend)
    t, _ = _tier(tmp_path, max_bytes=20 * BS + 16384, census_interval_s=3600)
    try:
        assert cap.root_capacity(str(tmp_path)).wait_pass(5, after=0)
        # 4 blocks stay below the high watermark: nothing asks the evictor, so nothing
        # frees room before the next job (a job crossing it may have its room made by an
        # eviction pass in between, which is right, and admits the next job)
        r = _run(t, TransferJob(1, _keys(1, 4), list(range(4))))
        assert r[0].success
        t0 = time.monotonic()
        t.submit_store(TransferJob(2, _keys(2, 17), list(range(17))))  # 4 + 17 blocks > 20
        r = t.get_finished_jobs()  # failed at submit: no queue, no wait
        assert time.monotonic() - t0 < 0.5
        assert len(r) == 1 and not r[0].success and r[0].error.errno == errno.ENOSPC
        assert "max_bytes" in str(r[0].error)
        assert not any(os.path.exists(p) for p in t.file_mapper.get_file_names(_keys(2, 17)))
        snap = t.metrics.counters.snapshot()
        assert snap["stores_dropped"] == 1 and snap["store_failures"] == 1
        assert snap["capacity_max_bytes"] == 20 * BS + 16384
        # tmp_path's filesystem has more room than the bound: the bound in force is max_bytes
        assert snap["capacity_bound_bytes"] == cap.root_capacity(str(tmp_path)).bound() == 20 * BS + 16384
        from prometheus_client import generate_latest

        text = generate_latest(t.metrics.registry).decode()
        assert 'kvtier:kv_offload_tiering_stores_dropped_total{tier="1:kvtier"} 1.0' in text
        assert f'kvtier:kv_offload_tiering_capacity_max_bytes{{tier="1:kvtier"}} {float(20 * BS + 16384)}' in text
        assert 'kvtier:kv_offload_tiering_evictions_total{reason="enospc",tier="1:kvtier"} 0.0' in text
    finally:
        t.shutdown()


@pytest.mark.parametrize("per_job", [4, 8, 16])
def test_jobs_larger_than_the_watermark_bands_are_not_dropped_for_ever(tmp_path, io_backend, monkeypatch, per_job):
    """A store job larger than the band between evict_low and the bound (8 or 16 blocks
    of a 40-block bound: 20%, 40% > 15%) was dropped at every try once the root first
    filled (the pass after a drop stopped at evict_low, where the job still did not fit),
    and one of 4 blocks (10% > the 5% above evict_high) every other try (no pass starts
    below the high mark, where the job does not fit). The marks move down by what the
    largest job needs: never two drops in a row, at most 2 in 30 jobs (11 to 28 before)."""
    _use_backend(monkeypatch, io_backend)
    t, _ = _tier(tmp_path, rows=per_job, max_bytes=40 * BS, census_interval_s=0.1)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0)
        res = ""
        for j in range(30):
            r = _run(t, TransferJob(j, _keys(j, per_job), list(range(per_job))))[0]
            assert r.success or r.error.errno == errno.ENOSPC
            res += "o" if r.success else "x"
            assert rc.wait_pass(5, after=rc.passes)
            end = time.monotonic() + 0.5  # the evictor made room for the next job (or never will)
            while rc.estimate() + per_job * BS > 40 * BS and time.monotonic() < end:
                time.sleep(0.005)
        assert "xx" not in res and res.count("x") <= 2, res
        assert all(os.path.exists(p) for p in t.file_mapper.get_file_names(_keys(29, per_job)))  # the newest job
        assert cap.census(str(tmp_path)).bytes <= 40 * BS
    finally:
        t.shutdown()


BIG_WRITER = r"""
import sys, time, numpy as np
sys.path.insert(0, {repo!r})
from kvtier.manager import FileSystemTierManager, TransferJob
from kvtier._tier import capacity as cap
bs, n = {bs}, 16
t = FileSystemTierManager(np.ones((n, bs), np.uint8), sys.argv[1], "m", block_size=bs, use_o_direct=False,
                          max_bytes=40 * bs, census_interval_s=0.1)
rc = cap.root_capacity(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
res = ""
for j in range(20):
    t.submit_store(TransferJob(j, [(bytes([200, j]) + i.to_bytes(2, "big") + bytes(12), 0) for i in range(n)],
                               list(range(n))))
    t.drain_jobs(30)
    res += "o" if all(r.success for r in t.get_finished_jobs()) else "x"
    end = time.monotonic() + 1.0  # the evictor made room (or never will)
    while rc.estimate() + n * bs > 40 * bs and time.monotonic() < end:
        time.sleep(0.005)
print(res, flush=True)
t.shutdown()
"""


def test_another_processs_large_jobs_move_the_evictors_marks(tmp_path):
    """A writer process whose store jobs (16 blocks: 40% of a 40-block bound) are larger than
    the band between evict_low and the bound, beside an evictor process that stores only
    4-block jobs: the writer's dropped job asks for a pass through ``evict.request`` with
    its size (``need``), and the evictor moves its marks down so that the job fits after
    the pass. Without ``need`` the evictor would stop at evict_low (34 blocks), where a
    16-block job never fits: every one of its jobs dropped once the root is full."""
    t, _ = _tier(tmp_path, rows=4, max_bytes=40 * BS, census_interval_s=0.1)
    p = None
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0) and rc.lock.held
        for j in range(9):  # 36 blocks: no 16-block job fits
            assert _run(t, TransferJob(j, _keys(j, 4), list(range(4))))[0].success
        assert rc._job_max == 4 * BS
        p = subprocess.Popen([sys.executable, "-c", BIG_WRITER.format(repo=REPO, bs=BS), str(tmp_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "ready\n", p.stderr.read()
        out, err = p.communicate("\n", timeout=120)
        res = out.strip()
        assert p.returncode == 0 and len(res) == 20, err
        assert rc._job_max == 16 * BS  # the writer's need, read from evict.request
        assert res.count("o") >= 15 and "xxx" not in res, res
        assert cap.census(str(tmp_path)).bytes <= 40 * BS + 64 * 1024
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        t.shutdown()


LEAVER = r"""
import os, signal, sys, time, numpy as np
sys.path.insert(0, {repo!r})
from kvtier.manager import FileSystemTierManager, TransferJob
bs = {bs}
t = FileSystemTierManager(np.ones((8, bs), np.uint8), sys.argv[1], "m", block_size=bs, use_o_direct=False,
                          max_bytes=1 << 30, census_interval_s=3600)
t.submit_store(TransferJob(1, [(bytes([99, i]) + bytes(14), 0) for i in range(8)], list(range(8))))
t.drain_jobs(30)
assert all(r.success for r in t.get_finished_jobs())
time.sleep(0.3)  # its ledger published
print("stored", flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
t.shutdown()
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_writer_that_leaves_keeps_counting_until_a_census_counts_its_blocks(tmp_path, how):
    """A writer process stores 8 blocks and exits (or is SIGKILLed) before any census saw
    them: its ledger was removed at exit (or counted nothing once its pid was gone), so the
    other writers' estimate lost those 8 blocks and admitted as much again (1.67-1.76x the
    bound in a trial). Now its final ledger counts until a census that began after its last
    write; that census counts the blocks, and the evictor removes the ledger."""
    t, _ = _tier(tmp_path, rows=4, max_bytes="1G", census_interval_s=3600)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0) and rc.lock.held
        base = rc.estimate()
        r = subprocess.run([sys.executable, "-c", LEAVER.format(repo=REPO, bs=BS), str(tmp_path), how],
                           capture_output=True, text=True, timeout=60)
        assert r.stdout.split() == ["stored"] and r.returncode == (-signal.SIGKILL if how == "kill" else 0), r.stderr
        time.sleep(0.3)  # this process has re-read the ledgers
        led = list((tmp_path / ".kvtier" / "writers").iterdir())
        assert len(led) == 2  # this process's, and the one that left
        assert rc.estimate() >= base + 8 * BS and cap.read_ledgers(str(tmp_path), skip=rc.name)[1] == 0
        n = rc.censuses

        def census_now():  # the first counts the blocks, the next removes the ledger
            rc._next_census = 0.0
            rc._wake.set()
            return rc.censuses >= n + 2

        _wait_for(census_now, 10, "no census")
        assert os.listdir(tmp_path / ".kvtier" / "writers") == [os.path.basename(rc.ledger_path)]
        assert rc._usage["bytes"] >= base + 8 * BS and rc.estimate() >= base + 8 * BS  # in the census now
    finally:
        t.shutdown()


def test_a_ledger_removed_under_steady_stores_is_made_again(tmp_path):
    """The check that this process's ledger is still linked ran only when the ledger had
    not been published for half an interval, and a store publishes it at each admission
    (when it has a peer) and the capacity thread within 50 ms of it: under steady stores it
    never ran, so a ledger (or .kvtier/) removed then stayed gone, the writers blind to
    each other. It runs each half interval now, whatever the stores do."""
    t, _ = _tier(tmp_path, rows=2, max_bytes="1G", census_interval_s=0.2)
    stop, n = threading.Event(), [0]

    def store():
        while not stop.is_set():
            _run(t, TransferJob(n[0], _keys(n[0] % 250, 2), [0, 1]))
            n[0] += 1
            time.sleep(0.005)

    th = threading.Thread(target=store)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0)
        th.start()
        _wait_for(lambda: n[0] > 10, 10, "no stores")
        os.unlink(rc.ledger_path)
        _wait_for(lambda: os.path.exists(rc.ledger_path), 3, "the ledger was not made again under stores")
        k = n[0]
        _wait_for(lambda: n[0] > k + 10, 10, "the stores stopped")
        assert json.loads(open(rc.ledger_path).read())["pid"] == os.getpid()
    finally:
        stop.set()
        if th.is_alive():
            th.join(30)
        t.shutdown()


def test_a_ledger_removed_as_dead_is_made_again_and_said_so(tmp_path, caplog):
    """Only this process's ledger gone (an evictor removed it as dead while this process
    was stopped): made again, and the log says that, not that .kvtier/ was removed."""
    t, _ = _tier(tmp_path, rows=4, max_bytes=40 * BS, census_interval_s=0.1)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0)
        with caplog.at_level("WARNING", logger="kvtier._tier.capacity"):
            os.unlink(rc.ledger_path)
            _wait_for(lambda: os.path.exists(rc.ledger_path), 5, "the ledger was not made again")
            _wait_for(lambda: "removed as dead" in caplog.text, 5, "no warning")
        assert f"this process's ledger {rc.ledger_path} was removed as dead" in caplog.text
        assert "removed under the running tier" not in caplog.text
    finally:
        t.shutdown()


def test_the_state_directory_removed_under_a_running_tier_is_made_again(tmp_path, io_backend, monkeypatch, caplog):
    """``rm -rf ROOT/.kvtier`` under a running bounded tier: the ledger, the lock file and
    usage.json come back within an interval, the lock is held on the new file (another
    process is refused it), and stores and eviction go on within the bound. Before, the
    ledger went to an unlinked file, usage.json could never be published again (a warning
    every pass), and the old holder kept a lock on a file no one else could see."""
    import shutil

    _use_backend(monkeypatch, io_backend)
    t, _ = _tier(tmp_path, rows=4, max_bytes=40 * BS, census_interval_s=0.1)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0)
        for j in range(4):
            assert _run(t, TransferJob(j, _keys(j, 4), list(range(4))))[0].success
        caplog.set_level("WARNING", logger="kvtier._tier.capacity")
        shutil.rmtree(tmp_path / ".kvtier")
        end = time.monotonic() + 5
        while not (os.path.exists(rc.ledger_path) and cap.read_usage(str(tmp_path))):
            assert time.monotonic() < end, sorted(os.listdir(tmp_path))
            time.sleep(0.01)
        ok = 0
        for j in range(4, 24):
            ok += _run(t, TransferJob(j, _keys(j, 4), list(range(4))))[0].success
            assert rc.wait_pass(5, after=rc.passes)
        assert ok >= 15 and cap.census(str(tmp_path)).bytes <= 40 * BS
        assert rc.lock.held and os.stat(rc.lock.path).st_ino == os.fstat(rc.lock._fd).st_ino
        r = subprocess.run([sys.executable, "-c", "import sys; from kvtier._tier import capacity as cap; "
                            f"print(cap.EvictorLock({str(tmp_path)!r}).try_acquire())"],
                           capture_output=True, text=True, cwd=REPO)
        assert r.stdout.strip() == "False", r.stderr
        u = cap.read_usage(str(tmp_path))
        assert u["evictor"].endswith(f":{os.getpid()}") and time.time() - u["scan_started"] < 2
        assert f"{tmp_path / '.kvtier'} was removed under the running tier: made again" in caplog.text
    finally:
        t.shutdown()
    assert not os.listdir(tmp_path / ".kvtier" / "writers")


def test_a_dead_writers_state_temps_are_swept_by_the_evictor(tmp_path):
    """A process killed between the open and the rename of usage.json's or evict.request's
    temp leaves ``.kvtier/<name>_<hex>.tmp``: counted by every census, removed by nothing
    before. The evictor's census removes those older than a minute, never a fresh one."""
    sd = tmp_path / ".kvtier"
    sd.mkdir()
    old, fresh = sd / "usage.json_00112233deadbeef.tmp", sd / "evict.request_0011223344556677.tmp"
    for p in (old, fresh):
        p.write_bytes(b"{" * 5000)
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    t, _ = _tier(tmp_path, max_bytes="1G", census_interval_s=3600)
    try:
        assert cap.root_capacity(str(tmp_path)).wait_pass(5, after=0)
        assert not old.exists() and fresh.read_bytes() == b"{" * 5000
    finally:
        t.shutdown()


def test_a_usage_file_that_cannot_be_published_warns_once_a_minute(tmp_path, caplog):
    """usage.json that cannot be replaced (a directory here; EROFS on a read-only .kvtier)
    fails every pass: one warning a minute, not one a pass (16 a second before), and the
    tier goes on storing within its bound."""
    import logging

    t, _ = _tier(tmp_path, rows=4, max_bytes=40 * BS, census_interval_s=0.05)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0)
        os.unlink(tmp_path / ".kvtier" / "usage.json")
        (tmp_path / ".kvtier" / "usage.json").mkdir()
        with caplog.at_level(logging.WARNING, logger="kvtier._tier.capacity"):
            ok = 0
            for j in range(20):
                ok += _run(t, TransferJob(j, _keys(j, 4), list(range(4))))[0].success
                assert rc.wait_pass(5, after=rc.passes)
        warned = [r for r in caplog.records if "cannot publish" in r.getMessage()]
        assert len(warned) == 1, len(warned)
        assert rc.publish_failures >= 10
        assert ok >= 15 and cap.census(str(tmp_path)).bytes <= 40 * BS
    finally:
        t.shutdown()


def test_a_transient_stat_error_of_the_lock_file_keeps_the_lock(tmp_path, monkeypatch):
    """EvictorLock.check drops the lock only when evictor.lock is gone or another file:
    an EIO from its stat (a DFS hiccup) keeps it."""
    (tmp_path / ".kvtier").mkdir()
    lock = cap.EvictorLock(str(tmp_path))
    try:
        assert lock.try_acquire() and lock.check()
        real = os.stat

        def eio(p, *a, **k):
            if str(p) == lock.path:
                raise OSError(errno.EIO, "injected", p)
            return real(p, *a, **k)

        monkeypatch.setattr(cap.os, "stat", eio)
        assert lock.check() and lock.held
        monkeypatch.setattr(cap.os, "stat", real)
        os.unlink(lock.path)
        assert not lock.check() and not lock.held and lock._fd is None
    finally:
        lock.release()


WRITER = r"""
import os, sys, time, numpy as np
sys.path.insert(0, {repo!r})
from kvtier.manager import FileSystemTierManager, TransferJob
root, tag, seconds, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
bs, batch = {bs}, {batch}
buf = np.random.default_rng(tag).integers(0, 255, (batch, bs), dtype=np.uint8)  # _writer_rows
t = FileSystemTierManager(buf, root, "m", block_size=bs, use_o_direct=False, n_read_threads=1, n_write_threads=2,
                          max_bytes={max_bytes}, census_interval_s=interval, takeover_s={takeover_s})
print("ready", os.getpid(), flush=True)
end, j, ok, dropped = time.monotonic() + seconds, 0, 0, 0
while time.monotonic() < end:
    keys = [(tag.to_bytes(2, "big") + j.to_bytes(4, "big") + i.to_bytes(2, "big") + bytes(8), 0) for i in range(batch)]
    t.submit_store(TransferJob(j, keys, list(range(batch))))
    t.drain_jobs()
    for r in t.get_finished_jobs():
        ok += r.success
        dropped += not r.success
    j += 1
    time.sleep({pause})
print("done", ok, dropped, flush=True)
t.shutdown()
"""


def _writer(root, tag, seconds, interval, max_bytes, batch=4, pause=0.002, backend="c", takeover_s=30.0,
            stderr=subprocess.PIPE):
    code = WRITER.format(repo=REPO, bs=BS, batch=batch, max_bytes=max_bytes, pause=pause, takeover_s=takeover_s)
    env = dict(os.environ, KVTIER_IO_BACKEND=backend)
    p = subprocess.Popen([sys.executable, "-c", code, str(root), str(tag), str(seconds), str(interval)],
                         stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    line = p.stdout.readline()
    assert line.startswith("ready"), p.stderr.read() if p.stderr else ""
    return p


def _writer_rows(tag, batch=4):
    """The bytes a WRITER of ``tag`` stores: row i of each job (block key ``..i..``)."""
    return np.random.default_rng(tag).integers(0, 255, (batch, BS), dtype=np.uint8)


def test_a_ledger_counts_only_what_ended_after_the_readers_census(tmp_path):
    """A writer's ledger lists its ended jobs by age (``done`` buckets, each stamped with
    its newest end): a reader whose census began after a bucket's stamp counts it as in
    the census, whatever census the writer last read (it double-counted a writer's bytes
    until that writer read the new census: stores that fit were dropped). Another host's
    buckets (or another mount's) keep OTHER_VIEW_S of margin; a ledger without buckets (an older kvtier), or
    one that counts from a newer census than the reader's, counts all its bytes."""
    host, boot, ns = cap._host_identity()
    now = time.time()
    d = {"host": host, "boot": boot, "pidns": ns, "pid": os.getpid(), "t": now, "since": now - 10.0,
         "bytes": 700, "inflight": 100, "done": [[now - 5.0, 200], [now - 1.1, 300], [now - 0.01, 100]]}
    assert cap.ledger_bytes(d, now - 10.0, host) == 700  # the writer's own census: everything
    assert cap.ledger_bytes(d, now - 3.0, host) == 500  # a newer census: the bucket of -5 s is in it
    assert cap.ledger_bytes(d, now - 1.0, host) == 200  # running 100 + the bucket of -10 ms
    assert cap.ledger_bytes(d, now - 1.0, "node2") == 200 + 300  # another node's census: OTHER_VIEW_S of margin
    dev = os.stat(str(tmp_path)).st_dev
    mine = dict(d, dev=dev)
    assert cap.ledger_bytes(mine, now - 1.0, cap.view_of(host, boot, dev)) == 200  # the census's own view
    # another mount of this host (a second client of one GlusterFS volume): its attribute
    # cache may show this writer's newest blocks short, so they stay counted OTHER_VIEW_S
    assert cap.ledger_bytes(mine, now - 1.0, cap.view_of(host, boot, dev + 1)) == 500
    assert cap.ledger_bytes(mine, now - 3.0, cap.view_of(host, boot, dev + 1)) == 700  # -5 s: in, 2 s margin
    assert cap.ledger_bytes(mine, now + 1.05, cap.view_of(host, boot, dev + 1)) == 200  # -1.1 s: 2.15 s before
    assert cap.ledger_bytes(d, None, host) == 700
    assert cap.ledger_bytes(dict(d, since=now), now - 0.2, host) == 700  # counts from a newer census
    old = {k: v for k, v in d.items() if k not in ("done", "inflight")}
    assert cap.ledger_bytes(old, now - 0.2, host) == 700
    assert cap.ledger_bytes(dict(d, done=[["x", 1]]), now - 0.2, host) == 700  # a bad bucket: all
    # read_ledgers sums them so
    _ledger(tmp_path, "w1", d)
    assert cap.read_ledgers(str(tmp_path), now=now, since=now - 1.0, census_view=host) == (200, 1)
    assert cap.read_ledgers(str(tmp_path), now=now) == (700, 1)
    # the buckets a writer keeps: one per LEDGER_AGES age, stamped with the newest end
    ends = [(now - a, 1) for a in (9.0, 3.0, 1.0, 0.9, 0.3, 0.03, 0.02, 0.001, 0.0)]
    b = cap.ledger_buckets(ends, now)
    assert b == [(now - 3.0, 2), (now - 0.9, 2), (now - 0.3, 1), (now - 0.03, 1), (now - 0.0, 3)]
    assert sum(n for _, n in b) == len(ends) and len(cap.ledger_buckets(sorted(ends * 50), now)) <= len(cap.LEDGER_AGES) + 1


def test_an_older_usage_read_late_is_not_taken(tmp_path):
    """usage.json read twice (the capacity thread, an admission) and the reads finishing out
    of order: the older record is not taken (the process would count from a census older
    than the one it trimmed its ledger to: an estimate too low). Newer: a later census, the
    same census after more eviction, or a later generation (an evictor whose clock is
    behind)."""
    t, _ = _tier(tmp_path, rows=4, max_bytes="1G", census_interval_s=3600)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0)
        with rc._lock:
            u0 = dict(rc._usage)
            u1 = dict(u0, scan_started=u0["scan_started"] + 10, scan_finished=u0["scan_finished"] + 10,
                      evict_finished=u0["scan_finished"] + 10, bytes=5 * BS)
            assert rc._take_usage(u1) and rc._usage is u1
            assert not rc._take_usage(u0) and rc._usage is u1 and rc.estimate() == 5 * BS
            u2 = dict(u1, evict_finished=u1["evict_finished"] + 1, bytes=2 * BS)  # the same census, evicted more
            assert rc._take_usage(u2) and rc.estimate() == 2 * BS
            assert not rc._take_usage(u1) and rc._usage is u2
            u3 = dict(u0, generation=u2.get("generation", 0) + 1, bytes=3 * BS)  # a later generation, clock behind
            assert rc._take_usage(u3) and rc.estimate() == 3 * BS
            # a record of a census "begun" 11 days ahead (garbage, a clock far off) is not taken:
            # else no real census would ever be newer, and the ledger trimmed against it
            fake = dict(u0, scan_started=time.time() + 1e6, scan_finished=time.time() + 1e6, generation=10 ** 12)
            assert not rc._take_usage(fake) and rc._usage is u3
            rc._usage = fake  # (and one held already, from before this check) yields to the next real one
            assert rc._take_usage(u1) and rc._usage is u1
    finally:
        t.shutdown()


def test_only_ledgers_through_the_same_mount_are_re_read_at_each_admission(tmp_path):
    """A ledger of this host is kept open and re-read at each admission only when its writer
    stores through the same mount (the root's st_dev in the ledger: one page cache); one
    through another mount of the volume (two FUSE clients on one host: two caches, a kept
    fd would read stale pages) is re-read by name, as another node's."""
    t, _ = _tier(tmp_path, rows=4, max_bytes="1G", census_interval_s=3600)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0)
        host, boot, ns = cap._host_identity()
        me = {"host": host, "boot": boot, "pidns": ns, "pid": os.getpid(), "t": time.time(), "since": 0.0,
              "inflight": 0, "done": []}
        dev = os.stat(tmp_path).st_dev
        _ledger(tmp_path, "same-mount", {**me, "bytes": 3 * BS, "inflight": 3 * BS, "dev": dev})
        _ledger(tmp_path, "other-mount", {**me, "bytes": 5 * BS, "inflight": 5 * BS, "dev": dev + 1})
        older = {k: v for k, v in me.items() if k not in ("inflight", "done")}
        _ledger(tmp_path, "older-kvtier", {**older, "bytes": 7 * BS})  # no dev, no buckets: all its bytes
        assert rc.admit(BS) is None
        assert sorted(rc._peer_fds) == ["same-mount"]
        assert rc.estimate() == rc._usage["bytes"] + (3 + 5 + 7 + 1) * BS  # all three count
        with open(tmp_path / ".kvtier" / "writers" / "same-mount", "r+") as f:  # rewritten in place
            f.write(json.dumps({**me, "bytes": 9 * BS, "inflight": 9 * BS, "dev": dev, "t": time.time()}) + " " * 40)
        assert rc.admit(BS) is None and rc.estimate() == rc._usage["bytes"] + (9 + 5 + 7 + 2) * BS
        rec = json.loads(open(rc.ledger_path).read())
        assert rec["dev"] == dev and rec["inflight"] == 2 * BS and rec["bytes"] == 2 * BS
    finally:
        t.shutdown()


def test_a_close_that_fails_as_on_fuse_never_fails_the_heartbeat_read(tmp_path, monkeypatch):
    """close(2) on a GlusterFS FUSE client may answer ENOENT (its flush, for a file another
    client renamed over: seen in the two-client takeover test); the fd is released all the
    same. read_heartbeat (every watcher's tick, ``kvtier info``) raised it: it now returns
    the record, and no fd is left open."""
    os.makedirs(tmp_path / cap.STATE_DIR)
    want = {"by": "node2:4242", "seq": 17, "t": time.time()}  # a holder's record (no lock held here)
    (tmp_path / cap.STATE_DIR / cap.LOCK_FILE).write_text(json.dumps(want).ljust(cap.BEAT_RECORD - 1) + "\n")
    real, closed = os.close, []

    def failing_close(fd):
        real(fd)
        closed.append(fd)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(cap.os, "close", failing_close)
    try:
        hb = cap.read_heartbeat(str(tmp_path))
    finally:
        monkeypatch.setattr(cap.os, "close", real)
    assert hb is not None and hb["by"] == want["by"] and hb["seq"] == want["seq"] and len(closed) == 1
    assert len(os.listdir("/proc/self/fd")) == before


PEER = r"""
import sys, time, numpy as np
sys.path.insert(0, {repo!r})
from kvtier.manager import FileSystemTierManager
from kvtier._tier import capacity as cap
t = FileSystemTierManager(np.zeros((1, {bs}), np.uint8), sys.argv[1], "m", block_size={bs}, use_o_direct=False,
                          max_bytes={max_bytes})
rc = cap.root_capacity(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
print(rc.admit(int(sys.argv[2])), flush=True)  # None: admitted, its ledger written before this line
sys.stdin.readline()
t.shutdown()
"""


def test_a_reservation_counts_on_this_host_at_the_next_admission(tmp_path, monkeypatch):
    """Two writer processes of one host: what one admitted counts in the other's very next
    admission (its ledger is written at the admission, the peer's kept open and re-read at
    each), not LEDGER_PUBLISH_S later: two fast writers passed the bound by their stores
    of the last ~100 ms (on tmpfs 1.28-1.34x a 64 MiB bound). Here the periodic re-read is
    off (LEDGER_PUBLISH_S an hour), so only the admission's own reading can see it."""
    mx = 64 * BS
    t, _ = _tier(tmp_path, rows=4, max_bytes=mx)
    p = None
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0)
        p = subprocess.Popen([sys.executable, "-c", PEER.format(repo=REPO, bs=BS, max_bytes=mx), str(tmp_path),
                              str(40 * BS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        assert p.stdout.readline() == "ready\n", p.stderr.read()
        monkeypatch.setattr(cap, "LEDGER_PUBLISH_S", 3600.0)
        time.sleep(0.2)  # this process's thread is in its hour-long wait now
        assert rc.admit(BS) is None  # lists the writers: the peer's ledger (nothing reserved), kept open
        assert len(rc._peer_fds) == 1 and rc.estimate() == rc._usage["bytes"] + cap._alloc(BS)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline() == "None\n", p.stderr.read()  # the peer holds 40 blocks now
        err = rc.admit(30 * BS)  # 40 + 30 + 1 > 64: dropped at once
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC
        assert rc.estimate() >= 41 * BS + rc._usage["bytes"]
        assert rc.admit(16 * BS) is None  # 40 + 16 + 1 (+ the root's own files) fit
    finally:
        if p is not None:
            p.stdin.write("\n")
            p.stdin.close()
            p.wait(30)
        monkeypatch.setattr(cap, "LEDGER_PUBLISH_S", 0.05)
        t.shutdown()


def test_a_writer_takes_its_share_of_the_room_while_another_host_or_mount_writes(tmp_path, monkeypatch):
    """A live ledger of another view (here: another root st_dev, as a second mount of a
    GlusterFS volume) makes 2 views: between two reads of the other views' ledgers a writer
    admits at most half the room it saw at the read (its first job always), since the
    other view sees these admissions only at its next read of this ledger and may fill the
    same room (two GlusterFS clients went 3.2-3.7 batches over a 64 MiB bound). At the next
    read it takes half of what is left; with the other view gone, the whole room."""
    mx = 64 * BS
    t, _ = _tier(tmp_path, rows=4, max_bytes=mx)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert rc.wait_pass(5, after=0)
        monkeypatch.setattr(cap, "LEDGER_PUBLISH_S", 3600.0)  # no periodic re-read: this test reads
        time.sleep(0.2)  # the capacity thread is in its hour-long wait now
        monkeypatch.setattr(rc, "_ask", lambda reason: None)  # and no drop wakes it (a pass re-anchors)
        host, boot, pidns = cap._host_identity()
        other = os.path.join(cap.state_dir(str(tmp_path)), cap.WRITERS_DIR, "node-b")
        with open(other, "w") as f:
            json.dump({"host": host, "boot": boot, "pidns": pidns, "pid": os.getpid(),
                       "dev": os.stat(str(tmp_path)).st_dev + 1, "bytes": 0, "inflight": 0, "done": [],
                       "since": 0.0, "gen": 0, "t": time.time()}, f)
        with rc._lock:
            assert rc._views == 1
        rc._refresh()
        a = cap._alloc(BS)
        with rc._lock:
            assert rc._views == 2
            base = rc.estimate()
        assert base == rc._anchor and base < 4 * a  # the root's own files

        def admitted():
            n = 0
            while (err := rc.admit(BS)) is None:
                n += 1
                assert n <= 64
            assert err.errno == errno.ENOSPC
            return n, str(err)

        n1, why = admitted()
        assert n1 == (mx - base) // 2 // a  # half the room
        assert "this writer's share" in why and "2 hosts or mounts" in why
        rc._refresh()  # the other view read again: half of what is left
        n2, _ = admitted()
        assert n2 == (mx - base - n1 * a) // 2 // a
        os.unlink(other)
        rc._refresh()
        with rc._lock:
            assert rc._views == 1
        n3, why = admitted()  # alone: up to the bound
        assert n3 == (mx - base) // a - n1 - n2 and "this writer's share" not in why
    finally:
        monkeypatch.setattr(cap, "LEDGER_PUBLISH_S", 0.05)
        t.shutdown()


def test_a_lone_writer_on_a_filesystem_other_hosts_mount_counts_one_unseen_joiner(tmp_path, monkeypatch):
    """On a filesystem other hosts may mount (not local: here mount_of says MooseFS), a
    writer that sees no other writer still takes half the room seen at each read of the
    ledgers and fdatasyncs its ledger from its first admission: a writer that joined may be
    unlisted here (a FUSE client lists the writers from a directory cache ~1 s old) while it
    reads this ledger unsynced as 0 bytes; both admitted the whole room and a 64 MiB bound
    went to 1.25-1.97x on two MooseFS clients.  On a local filesystem (the ext4 of /tmp),
    the whole room and no fdatasync."""
    from kvtier._tier.mountinfo import MountEntry

    real = cap.mount_of
    moose = MountEntry(1, str(tmp_path), "fuse", "mfs#master:9421", "rw", "rw")
    assert moose.kind == "moosefs" and real(str(tmp_path)).kind in cap.BOUNDED
    synced = []
    fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), fdatasync(fd))[1])
    mx = 64 * BS
    a = cap._alloc(BS)
    for shared in (True, False):
        root = tmp_path / ("moose" if shared else "local")
        root.mkdir()
        monkeypatch.setattr(cap, "mount_of", (lambda p: moose) if shared else real)
        t, _ = _tier(root, rows=4, max_bytes=mx)
        try:
            rc = cap.root_capacity(str(root))
            assert rc.wait_pass(5, after=0)
            monkeypatch.setattr(cap, "LEDGER_PUBLISH_S", 3600.0)  # no periodic re-read: this test reads
            time.sleep(0.2)
            monkeypatch.setattr(rc, "_ask", lambda reason: None)
            rc._refresh()
            with rc._lock:
                assert rc._views == 1 and rc._unseen == (1 if shared else 0)
                base = rc.estimate()
            del synced[:]
            n = 0
            while (err := rc.admit(BS)) is None:
                n += 1
                assert n <= 64
            assert err.errno == errno.ENOSPC
            deadline = time.monotonic() + 5
            while shared and rc._ledger_fd not in synced and time.monotonic() < deadline:
                time.sleep(0.01)
            if shared:
                assert n == (mx - base) // 2 // a  # half the room
                assert "may have joined unseen" in str(err)
                assert rc._ledger_fd in synced  # the capacity thread published it synced
            else:
                assert n == (mx - base) // a and "share" not in str(err)
                time.sleep(0.2)
                assert rc._ledger_fd not in synced
        finally:
            monkeypatch.setattr(cap, "LEDGER_PUBLISH_S", 0.05)
            t.shutdown()


def test_two_processes_stay_within_the_bound_plus_a_batch_each(tmp_path, io_backend):
    max_bytes, batch = 48 * BS, 4
    ps = [_writer(tmp_path, tag, 4.0, 0.2, max_bytes, batch, backend=io_backend.backend) for tag in (1, 2)]
    peak, samples = 0, 0
    while any(p.poll() is None for p in ps):
        peak = max(peak, cap.census(str(tmp_path), keep_entries=False).bytes)
        samples += 1
        time.sleep(0.01)
    outs = [p.communicate()[0] for p in ps]
    assert all(p.returncode == 0 for p in ps), [p.stderr.read() if p.stderr else "" for p in ps]
    done = [line.split() for o in outs for line in o.splitlines() if line.startswith("done")]
    stored = sum(int(d[1]) for d in done)
    assert stored * batch * BS > 3 * max_bytes  # they wrote three bounds' worth: eviction made room
    # the bound: max_bytes + one batch per writer (on one host each sees what the other
    # admitted at its next admission) + the state files; + what a census walk miscounts
    # (it is no snapshot: blocks stored into directories it has not reached yet count, as
    # do those evicted from directories it passed; 1.4-5.6 batches here). The exact peak,
    # by statvfs of a tmpfs of its own, is benchmarks/capacity_peak.py's.
    allowance = 2 * batch * BS + 50 * batch * BS + 64 * 1024
    assert samples > 50 and peak <= max_bytes + allowance, (peak, max_bytes)
    # a writer that stored since the last census it read leaves its ledger, final (nothing in
    # flight), for the next census to count and an evictor to remove (the one that ran on
    # may have removed the other's already); none is live
    left = [json.loads(open(p).read()) for p in (tmp_path / ".kvtier" / "writers").iterdir()]
    assert len(left) <= 2 and all(d["inflight"] == 0 and d["bytes"] > 0 for d in left)
    assert cap.read_ledgers(str(tmp_path))[1] == 0


def test_sigkill_of_the_evictor_fails_over_within_an_interval(tmp_path):
    interval = 0.3
    a = _writer(tmp_path, 1, 30.0, interval, 1 << 30, pause=0.05)
    try:
        end = time.monotonic() + 10
        while (cap.read_usage(str(tmp_path)) or {}).get("evictor", "").rsplit(":", 1)[-1] != str(a.pid):
            assert time.monotonic() < end, "the first process never published a census"
            time.sleep(0.02)
        b = _writer(tmp_path, 2, 30.0, interval, 1 << 30, pause=0.05)
        try:
            time.sleep(3 * interval)
            assert cap.read_usage(str(tmp_path))["evictor"].endswith(f":{a.pid}")  # a keeps the lock
            gen = cap.read_usage(str(tmp_path))["generation"]
            os.kill(a.pid, signal.SIGKILL)
            a.wait()
            t0 = time.monotonic()
            while not (cap.read_usage(str(tmp_path)) or {}).get("evictor", "").endswith(f":{b.pid}"):
                assert time.monotonic() - t0 < 3 * interval + 2, "no failover"
                time.sleep(0.01)
            u = cap.read_usage(str(tmp_path))
            assert u["generation"] > gen
            # the dead writer's ledger is removed by the new evictor
            end = time.monotonic() + 5
            while len(os.listdir(tmp_path / ".kvtier" / "writers")) != 1:
                assert time.monotonic() < end
                time.sleep(0.05)
        finally:
            b.kill()
            b.wait()
    finally:
        a.kill()
        a.wait()


def _evictor_pid(root):
    """The pid of the evictor that published ``usage.json`` last (0: none yet)."""
    return int((cap.read_usage(str(root)) or {}).get("evictor", ":0").rsplit(":", 1)[-1])


def _wait_for(cond, timeout, what):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def _stop_writers(ps):
    """Kill the writer processes (continued first: a stopped one would not die)."""
    for p in ps:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()


def _assert_took_over(a, b, a_root, b_root, a_err=None):
    """A's log (``a_err``, else its stderr pipe) says it stepped down, and never took over;
    B's that it took the lock from A."""
    a_err, b_err = a.stderr.read() if a_err is None else a_err, b.stderr.read()
    assert f"is no evictor of {a_root} any more" in a_err and "took the evictor lock" not in a_err, a_err
    assert f"took the evictor lock of {b_root} over from " in b_err and f":{a.pid}, whose heartbeat" in b_err, b_err


def test_a_stopped_evictor_is_taken_over_and_steps_down_when_it_runs_again(tmp_path, io_backend):
    """Issue #22: the evictor A is SIGSTOPped (a stopped process keeps its fcntl lock): B sees
    A's heartbeat still for takeover_s and takes the lock over (a new evictor.lock), censuses
    and evicts the root back under its bound. A, continued, finds its lock file replaced,
    steps down and publishes nothing; every block left loads with the bytes its writer
    stored (nothing wrong was removed)."""
    root, max_bytes, interval, takeover = str(tmp_path), 48 * BS, 0.2, 1.0
    ps = []
    try:
        a = _writer(tmp_path, 1, 60.0, interval, max_bytes, pause=0.01, backend=io_backend.backend,
                    takeover_s=takeover)
        ps.append(a)
        _wait_for(lambda: _evictor_pid(root) == a.pid, 10, "A never published a census")
        b = _writer(tmp_path, 2, 60.0, interval, max_bytes, pause=0.01, backend=io_backend.backend,
                    takeover_s=takeover)
        ps.append(b)
        seq = cap.read_heartbeat(root)["seq"]
        time.sleep(3 * interval)
        hb = cap.read_heartbeat(root)  # A beats (every takeover_s / 10) and B leaves it the lock
        assert hb["by"].endswith(f":{a.pid}") and hb["seq"] > seq and cap.lock_holder(root) == a.pid
        os.kill(a.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _wait_for(lambda: cap.lock_holder(root) == b.pid, takeover + 2 * interval + 3, "no takeover")
        took = time.monotonic() - t0
        # not before A's heartbeat was still for takeover_s (A's last beat <= takeover_s / 10 before its stop)
        assert took >= 0.9 * takeover - 0.05, took
        assert cap.read_heartbeat(root)["by"].endswith(f":{b.pid}")
        _wait_for(lambda: _evictor_pid(root) == b.pid, 5, "B published no census")
        _wait_for(lambda: cap.census(root, keep_entries=False).bytes <= max_bytes, 5, "the bound is not met again")
        gen = cap.read_usage(root)["generation"]
        os.kill(a.pid, signal.SIGCONT)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # A runs again: B stays the evictor, A censuses nothing
            u = cap.read_usage(root) or {}
            assert cap.lock_holder(root) == b.pid
            if u.get("evictor", "").endswith(f":{a.pid}"):
                # only the record A was stopped in the middle of publishing (its rename
                # pending): older than B's censuses, so no writer that read one takes it
                assert u["generation"] < gen, (u, gen)
            else:
                assert _evictor_pid(root) in (b.pid, 0)
            time.sleep(0.02)
        assert cap.read_usage(root)["generation"] > gen  # B went on censusing
    finally:
        _stop_writers(ps)
    _assert_took_over(a, b, root, root)
    # nothing wrong was removed: the layout's files are there, every block left loads whole with its bytes
    layout = next(d for d in os.listdir(root) if d.endswith("_r0"))[:-3]
    assert {"config.json", "kvtier.json"} <= set(os.listdir(tmp_path / layout))
    blocks = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if cap.is_block_path(root, os.path.join(d, f))]
    assert len(blocks) >= 8
    t, buf = _tier(tmp_path, rows=4)
    try:
        rows = {tag: _writer_rows(tag) for tag in (1, 2)}
        for j, p in enumerate(blocks):
            key = cap.key_of_path(p)
            assert _run(t, TransferJob(j, [key], [0], is_promotion=True))[0].success, p
            assert np.array_equal(buf[0], rows[int.from_bytes(key[0][:2], "big")][int.from_bytes(key[0][6:8], "big")])
    finally:
        t.shutdown()


WATCHER = r"""
import sys, time
sys.path.insert(0, {repo!r})
from kvtier._tier import capacity as cap
h = cap.attach(sys.argv[1], cap.check_config("1G", census_interval_s=0.1, takeover_s=0.5))  # 1G: evicts nothing here
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
print(h.rc.takeovers, h.rc.lock.held, flush=True)
h.close()
"""


@pytest.mark.parametrize("beats", [True, False])
def test_an_evictor_beats_during_a_long_census_and_is_not_taken_over(tmp_path, monkeypatch, beats):
    """The evictor's census calls its heartbeat (``progress``) as it goes: a census five
    times takeover_s long is not taken over by a watching process. The control (``beats``
    False: the same census, the heartbeat not called) is taken over, and the holder, its
    census done, steps down without counting or publishing it."""
    root = str(tmp_path)
    t, _ = _tier(tmp_path, rows=4, max_bytes="1G", census_interval_s=0.2, takeover_s=0.5)
    w = None
    try:
        rc = cap.root_capacity(root)
        assert rc.wait_pass(5, after=0) and rc.lock.held
        w = _watcher(root, 4)
        real, calls, first = cap.census, [], {}

        def slow_census(root, keep_entries=True, progress=None):
            def step():  # one entry: the first 25 take 0.1 s each
                if not calls:  # a census already running when the patch went in is done now
                    first.update(n=rc.censuses, seq=rc.lock.seq, published=cap.read_usage(root)["scan_started"])
                calls.append(1)
                if len(calls) <= 25:
                    time.sleep(0.1)
                if beats and progress is not None:
                    progress()
            return real(root, keep_entries, step)

        os.makedirs(tmp_path / "other")
        for i in range(30):
            (tmp_path / "other" / str(i)).write_bytes(b"x")
        monkeypatch.setattr(cap, "CENSUS_PROGRESS_EVERY", 1)
        monkeypatch.setattr(cap, "census", slow_census)
        _wait_for(lambda: len(calls) > 25 and (rc.censuses > first["n"] or rc.stepped_down), 15, "no slow census")
        n, seq, published = first["n"], first["seq"], first["published"]
        if beats:
            assert rc.lock.seq - seq >= 15 and rc.stepped_down == 0 and rc.lock.held and rc.lock.check()
            _wait_for(lambda: cap.read_usage(root)["scan_started"] > published, 5, "its census not published")
        else:
            assert rc.stepped_down == 1 and rc.censuses == n and not rc.lock.held
            # the watcher's census is the one published (checked while it runs: once it
            # exits, this process takes the free lock again and publishes its own)
            _wait_for(lambda: cap.read_usage(root)["evictor"].endswith(f":{w.pid}"), 5, "the watcher published nothing")
        out, err = w.communicate(timeout=30)
        assert out.split() == (["0", "False"] if beats else ["1", "True"]), err
        if not beats:
            assert f"over from {rc.lock.by}, whose heartbeat" in err
    finally:
        if w is not None and w.poll() is None:
            w.kill()
            w.wait()
        t.shutdown()


def _watcher(root, seconds):
    w = subprocess.Popen([sys.executable, "-c", WATCHER.format(repo=REPO), str(root), str(seconds)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert w.stdout.readline() == "ready\n", w.stderr.read()
    return w


@pytest.mark.parametrize("taker_stopped", [False, True])
def test_an_evictor_stalled_before_a_pass_is_taken_over_and_removes_nothing(tmp_path, monkeypatch, taker_stopped):
    """The evictor's thread stalls (a hung file, a stop) on its way into an eviction pass
    for longer than takeover_s: a watching process takes the lock over. The stalled pass,
    when it runs, finds the lock file replaced before its first unlink: it removes nothing,
    publishes nothing, and the process steps down. ``taker_stopped``: evictor.takeover is
    held (by this process here, as by a taker stopped in the middle): the watcher takes
    over all the same, after 2 x takeover_s."""
    import fcntl

    root = str(tmp_path)
    t, _ = _tier(tmp_path, rows=8, max_bytes=40 * BS, evict_high=0.7, evict_low=0.5, census_interval_s=0.2,
                 takeover_s=0.5)
    w = fd = None
    gate, stalled = threading.Event(), threading.Event()
    try:
        rc = cap.root_capacity(root)
        assert rc.wait_pass(5, after=0) and rc.lock.held
        w = _watcher(root, 30)
        real = cap.Candidates.evict

        def stalling(self, *a, **k):
            stalled.set()
            assert gate.wait(20)
            return real(self, *a, **k)

        monkeypatch.setattr(cap.Candidates, "evict", stalling)
        for j in range(4):  # 32 blocks: past the high watermark (28)
            assert _run(t, TransferJob(j, _keys(j, 8), list(range(8))))[0].success
        if taker_stopped:
            fd = os.open(tmp_path / ".kvtier" / "evictor.takeover", os.O_RDWR | os.O_CREAT)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert stalled.wait(10)
        t0 = time.monotonic()
        # (never lock_holder / read_heartbeat here: their close would drop this process's lock)
        _wait_for(lambda: _evictor_pid(root) == w.pid, 10, "no takeover")
        assert time.monotonic() - t0 >= (2 * 0.5 if taker_stopped else 0.5) - 0.1
        n = rc.passes
        gate.set()
        _wait_for(lambda: rc.passes > n, 5, "the stalled pass did not end")
        assert rc.last_pass.evicted == [] and rc.stepped_down == 1 and not rc.lock.held
        assert cap.census(root).blocks == 32 and _evictor_pid(root) == w.pid
        time.sleep(0.5)
        assert _evictor_pid(root) == w.pid and cap.lock_holder(root) == w.pid
    finally:
        gate.set()
        if w is not None and w.poll() is None:
            w.kill()
            w.wait()
        if fd is not None:
            os.close(fd)
        t.shutdown()


def test_an_eviction_pass_asks_to_keep_going_before_each_batch(tmp_path, monkeypatch):
    """Candidates.evict asks ``keep_going`` before its first unlink and then every
    EVICT_BATCH unlinks; False ends the pass: an evictor that lost its lock removes no
    more."""
    t, _ = _tier(tmp_path, rows=40)
    try:
        assert _run(t, TransferJob(1, _keys(1, 40), list(range(40))))[0].success
    finally:
        t.shutdown()
    monkeypatch.setattr(cap, "EVICT_BATCH_S", 1e9)  # by count only here
    c = cap.census(str(tmp_path))
    answers = [True, True, False]
    r = cap.Candidates(c.entries).evict(c.bytes, 0, keep_going=lambda: answers.pop(0))
    assert not answers and len(r.evicted) == 2 * cap.EVICT_BATCH
    assert sum(os.path.exists(p) for p in t.file_mapper.get_file_names(_keys(1, 40))) == 40 - 2 * cap.EVICT_BATCH
    r = cap.Candidates(cap.census(str(tmp_path)).entries).evict(c.bytes, 0, keep_going=lambda: False)
    assert r.evicted == [] and cap.census(str(tmp_path)).blocks == 40 - 2 * cap.EVICT_BATCH


# ---------------------------------------------------------------------- integrity under eviction

def test_a_load_racing_eviction_is_whole_and_verified_or_a_miss(tmp_path, io_backend):
    root = str(tmp_path)
    n = 64
    names = [f"{i:05x}ab" for i in range(n)]
    paths = [os.path.join(root, "m_r0", h[:3], h[3:5] + "_g0", h + ".bin") for h in names]
    rng = np.random.default_rng(7)
    src = np.frombuffer(rng.bytes(n * BS), dtype=np.uint8).copy()
    offs = [i * BS for i in range(n)]
    stop = threading.Event()
    errors, loaded, misses, passes = [], [0], [0], [0]

    def evictor():
        while not stop.is_set():
            c = cap.census(root)
            cap.evict(c, c.bytes, 0)
            passes[0] += 1
            try:
                io_backend.batch_store_block(paths, memoryview(src), offs, BS, use_o_direct=False, checksum=True)
            except OSError:
                pass

    def loader(seed):
        r = np.random.default_rng(seed)
        dst = np.zeros(BS, dtype=np.uint8)
        while not stop.is_set():
            i = int(r.integers(n))
            dst[:] = 0
            try:
                io_backend.batch_load_block([paths[i]], memoryview(dst), [0], BS, use_o_direct=False, checksum=True)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    errors.append(e)
                misses[0] += 1
                time.sleep(0.0005)  # let the evictor's thread run (the pure-Python backend holds the GIL)
                continue
            if not np.array_equal(dst, src[i * BS:(i + 1) * BS]):
                errors.append(f"block {i}: wrong bytes")
            loaded[0] += 1

    io_backend.batch_store_block(paths, memoryview(src), offs, BS, use_o_direct=False, checksum=True)
    ts = [threading.Thread(target=evictor)] + [threading.Thread(target=loader, args=(s,)) for s in range(3)]
    for t in ts:
        t.start()
    end = time.monotonic() + 20
    while (passes[0] < 5 or loaded[0] < 100) and time.monotonic() < end:
        time.sleep(0.05)
    stop.set()
    for t in ts:
        t.join()
    assert not errors, errors[:3]
    assert loaded[0] > 50 and misses[0] > 0 and passes[0] >= 3, (loaded, misses, passes)


def test_shard_directories_removed_under_a_racing_store(tmp_path, io_backend):
    """rmdir of an emptied shard directory while a store creates a block in it: the store
    makes the parents again (P21) and succeeds; the block is whole."""
    root = str(tmp_path)
    stop = threading.Event()
    removed = [0]

    def remover():
        while not stop.is_set():
            c = cap.census(root)
            removed[0] += cap.evict(c, c.bytes, 0).dirs_removed

    src = np.frombuffer(np.random.default_rng(3).bytes(BS), dtype=np.uint8).copy()
    th = threading.Thread(target=remover)
    th.start()
    deadline = time.monotonic() + 30
    try:  # 300 stores at least, and on until the remover has removed a directory (the C core's
        # stores can outrun its first census on a busy host)
        for i in itertools.count():
            if (i >= 300 and removed[0] > 0) or time.monotonic() > deadline:
                break
            p = os.path.join(root, "m_r0", "abc", "de_g0", f"abcde{i:05x}.bin")
            io_backend.batch_store_block([p], memoryview(src), [0], BS, use_o_direct=False, checksum=False)
            try:
                with open(p, "rb") as f:
                    assert f.read() == src.tobytes()
            except FileNotFoundError:
                pass  # evicted already
    finally:
        stop.set()
        th.join()
    assert removed[0] > 0


def test_a_rank_directory_linked_to_a_smaller_disk_bounds_the_room_by_that_disk(tmp_path, io_backend, monkeypatch):
    """A rank directory moved to another (smaller) filesystem and linked back: the room is
    the tightest filesystem's, so eviction keeps stores working there instead of each
    store meeting ENOSPC after every census resets the room from the root's large disk."""
    from mounts import mount_tmpfs

    _use_backend(monkeypatch, io_backend)
    root = str(tmp_path / "root")
    t, _ = _tier(root, rows=8)  # makes the rank directory
    rank = os.path.dirname(os.path.dirname(os.path.dirname(t.file_mapper.get_file_names(_keys(0, 1))[0])))
    t.shutdown()
    with mount_tmpfs(size="4m") as d:
        moved = os.path.join(d, os.path.basename(rank))
        os.rename(rank, moved) if os.stat(d).st_dev == os.stat(root).st_dev else (
            subprocess.run(["cp", "-a", rank, moved], check=True), subprocess.run(["rm", "-rf", rank], check=True))
        os.symlink(moved, rank)
        t, _ = _tier(root, rows=8, max_bytes="1G", census_interval_s=0.2)
        try:
            rc = cap.root_capacity(root)
            assert rc.wait_pass(5, after=0)
            assert rc.bound() <= (4 << 20) + (64 << 10)  # the tmpfs's room (+ the root's own files), not the root disk's
            enospc = stored = 0
            for j in range(120):  # 120 jobs x 2 x 16 KiB = 3.75 MiB x ~1.0: more than the tmpfs holds
                r = _run(t, TransferJob(j, _keys(j % 250, 2), list(range(2))))[0]
                if r.success:
                    stored += 1
                elif "dropped by kvtier capacity" not in str(r.error):
                    assert r.error.errno == errno.ENOSPC, r.error
                    enospc += 1
            st = os.statvfs(d)
            assert enospc <= 1 and stored >= 60, (enospc, stored)
            assert st.f_bavail > 0  # the tmpfs never filled up again
            newest = t.file_mapper.get_file_names(_keys(119 % 250, 2))
            assert all(os.path.realpath(p).startswith(d) for p in newest) or not stored
        finally:
            t.shutdown()


def test_a_root_held_above_the_low_mark_by_other_files_is_not_censused_at_every_tick(tmp_path, caplog):
    """Files that are not blocks (never evicted) above the low watermark: every pass runs out
    of candidates; the early census that asks for still runs at most CENSUS_CPU_SHARE of the
    time (it ran at every 50 ms tick), and a warning says why stores are dropped."""
    root = tmp_path / "root"
    t, _ = _tier(root, rows=8, max_bytes="1M", census_interval_s=3600)
    try:
        rc = cap.root_capacity(str(root))
        assert rc.wait_pass(5, after=0)
        with open(os.path.join(str(root), "notes.bin.bak"), "wb") as f:  # not a block: kept, counted
            f.write(b"n" * (960 << 10))
        os.makedirs(os.path.join(str(root), "other"))
        for i in range(3000):  # a census that takes a while
            open(os.path.join(str(root), "other", f"f{i}"), "wb").close()
        caplog.set_level("WARNING", logger="kvtier")
        with rc._lock:
            rc._request = "capacity"
        rc._next_census = 0.0
        rc._wake.set()
        n0 = rc.censuses
        deadline = time.monotonic() + 5
        while rc.censuses == n0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rc.censuses > n0
        scan = rc.last_census.scan_finished - rc.last_census.scan_started
        n1, cpu1 = rc.censuses, rc.evictor_cpu_s
        stored = 0
        end = time.monotonic() + 2.0
        j = 0
        while time.monotonic() < end:  # stores keep asking for passes
            j += 1
            r = _run(t, TransferJob(j, _keys(j % 250, 1), [0]))[0]
            stored += r.success
            time.sleep(0.02)
        # at most one census per scan / CENSUS_CPU_SHARE (was one per tick: ~40 in 2 s)
        assert rc.censuses - n1 <= 2.0 / (scan / cap.CENSUS_CPU_SHARE) + 2, (rc.censuses - n1, scan)
        assert rc.evictor_cpu_s - cpu1 < 0.5  # not a core's worth
        assert os.path.exists(os.path.join(str(root), "notes.bin.bak"))
        assert any("not block files" in m and "never evicted" in m for m in caplog.messages), caplog.messages
    finally:
        t.shutdown()


def test_a_store_job_larger_than_the_bound_is_dropped_saying_it_never_fits(tmp_path):
    root = tmp_path / "root"
    t, _ = _tier(root, rows=16, max_bytes=cap.least_bound(BS) + 2 * BS)  # holds ~3 blocks, not 16
    try:
        r = _run(t, TransferJob(1, _keys(1, 16), list(range(16))))[0]
        assert not r.success and r.error.errno == errno.ENOSPC
        assert "no job of this size is ever stored at this bound" in str(r.error)
        assert t.metrics.counters.snapshot()["stores_dropped"] == 1
        assert not any(os.path.exists(p) for p in t.file_mapper.get_file_names(_keys(1, 16)))
        r = _run(t, TransferJob(2, _keys(2, 1), [0]))[0]  # a job that fits is stored
        assert r.success and os.path.exists(t.file_mapper.get_file_names(_keys(2, 1))[0])
    finally:
        t.shutdown()


def test_a_tier_made_in_a_forked_child_has_its_own_capacity(tmp_path):
    """The parent bounds the root, then forks: the child's tier attaches a RootCapacity of
    its own (its thread runs, its ledger names the child), and closing the parent's
    inherited one in the child touches nothing of the parent's."""
    root = str(tmp_path / "root")
    t, _ = _tier(root, rows=8, max_bytes="64M")
    try:
        parent_rc = cap.root_capacity(root)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                os.close(r)
                assert cap.root_capacity(root) is None
                parent_rc.close()  # inherited: a no-op in the child
                assert os.path.exists(parent_rc.ledger_path)
                t2, _ = _tier(root, rows=8, max_bytes="64M")
                rc = cap.root_capacity(root)
                res = _run(t2, TransferJob(7, _keys(7, 2), [0, 1]))[0]
                os.write(w, json.dumps({"same": rc is parent_rc, "alive": rc._thread.is_alive(),
                                        "pid_in_ledger": str(os.getpid()) in os.path.basename(rc.ledger_path),
                                        "stored": res.success}).encode())
                t2.shutdown()
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        got = json.loads(os.read(r, 4096).decode())
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert got == {"same": False, "alive": True, "pid_in_ledger": True, "stored": True}
        assert os.path.exists(parent_rc.ledger_path) and parent_rc._thread.is_alive()
        assert _run(t, TransferJob(8, _keys(8, 1), [0]))[0].success  # the parent's tier goes on
    finally:
        t.shutdown()


def test_a_full_tmpfs_with_the_bound_set_recovers_by_itself(io_backend, monkeypatch):
    from mounts import mount_tmpfs

    _use_backend(monkeypatch, io_backend)
    with mount_tmpfs(size="4m") as d:
        root = os.path.join(d, "root")
        t, _ = _tier(root, rows=8, max_bytes="1G", census_interval_s=3600)
        try:
            rc = cap.root_capacity(root)
            assert rc.wait_pass(5, after=0)
            assert rc.bound() <= 4 << 20  # the room on the filesystem, not the 1 GiB asked
            g = t.metrics.counters.snapshot()
            assert g["capacity_bound_bytes"] == rc.bound() and g["capacity_max_bytes"] == 1 << 30
            # something else fills the filesystem behind the evictor's back (its next
            # census is an hour away): only ENOSPC can tell it
            st = os.statvfs(d)
            filler = os.path.join(d, "filler")
            with open(filler, "wb") as f:
                f.write(b"f" * (st.f_bavail * st.f_frsize - (1 << 20)))
            enospc, ok_after, dropped = 0, 0, 0
            for j in range(150):  # jobs of 2 blocks: the watermarks' band (10% of ~1 MiB) holds 3
                n = rc.passes
                r = _run(t, TransferJob(j, _keys(j % 250, 2), list(range(2))))[0]
                if r.success:
                    ok_after += bool(enospc)
                    last_ok = j
                    continue
                assert r.error.errno == errno.ENOSPC, r.error
                if "dropped by kvtier capacity" in str(r.error):
                    dropped += 1
                else:
                    enospc += 1
                    first = j
                assert rc.wait_pass(5, after=n)  # the evictor acts at once (within a tick)
            # one ENOSPC: then the evictor knows the room and keeps usage under it
            # (drops: the evictor works at its next tick, 50 ms, while this loop stores on)
            assert enospc == 1 and ok_after >= 0.75 * (149 - first), (enospc, first, ok_after, dropped)
            snap = t.metrics.counters.snapshot()
            assert snap["evicted_enospc"] > 0 and snap["evicted_bytes_enospc"] > 0
            assert all(os.path.exists(p) for p in t.file_mapper.get_file_names(_keys(last_ok, 2)))  # the newest
            assert os.path.getsize(filler) == st.f_bavail * st.f_frsize - (1 << 20)  # never evicted
        finally:
            t.shutdown()


def test_the_room_counts_free_inodes_at_a_blocks_bytes_per_inode():
    """fs_room with a fake statvfs: bytes free, or the free inodes (less the reserve) at
    the census's bytes per inode when they hold less; f_files 0: no inode limit."""
    c = cap.Census(root="/r", bytes=1 << 20, files=14, blocks=10, block_bytes=10 * BS, dirs=10)
    per = cap.bytes_per_inode(c)
    assert per == BS / 2  # 10 block files and 10 directories hold 10 blocks
    assert cap.bytes_per_inode(cap.Census(root="/r", files=3, dirs=2)) is None  # no block: unknown

    def st(bavail, files, favail):
        return type("statvfs", (), {"f_bavail": bavail, "f_frsize": 4096, "f_files": files, "f_favail": favail})

    R = cap.INODE_RESERVE
    assert cap.fs_room(c.bytes, st(1000, 0, 0), per) == c.bytes + 1000 * 4096  # no inode limit (btrfs, FUSE)
    assert cap.fs_room(c.bytes, st(1000, 10 ** 6, 10 ** 6), per) == c.bytes + 1000 * 4096  # bytes run out first
    assert cap.fs_room(c.bytes, st(1000, 120, R + 30), per) == c.bytes + 30 * BS // 2  # inodes first
    assert cap.fs_room(c.bytes, st(1000, 120, R), per) == c.bytes  # no inode left: no room
    assert cap.fs_room(c.bytes, st(1000, 120, R + 30), None) == c.bytes + 1000 * 4096  # no block seen yet
    assert cap.fs_room(c.bytes, st(1000, 120, 3), None) == c.bytes  # ... but a full inode table is full


def test_kvtier_evicts_for_inodes_when_the_filesystem_has_few_left(tmp_path, monkeypatch):
    """one_pass (kvtier evict, a tier's census) on a filesystem whose statvfs says bytes
    are free and inodes are not: the room is the inodes', the pass evicts down to the low
    mark of it, and the room it reports is what the blocks left behind hold."""
    t, _ = _tier(tmp_path, max_bytes="1G", census_interval_s=3600)
    try:
        assert all(r.success for r in _run(t, TransferJob(1, _keys(1, 20), list(range(20)))))
    finally:
        t.shutdown()
    real = os.statvfs

    def statvfs(path, favail=cap.INODE_RESERVE):  # every inode taken, 1 TiB free
        s = real(path)
        return type("statvfs", (), {"f_bavail": (1 << 40) // s.f_frsize, "f_frsize": s.f_frsize,
                                    "f_files": 10 ** 6, "f_favail": favail})

    monkeypatch.setattr(cap.os, "statvfs", statvfs)
    c, ev, rec = cap.one_pass(str(tmp_path), 1 << 40, dry_run=True)
    assert rec["room"] == c.bytes and len(ev.evicted) > 0  # full: down to 0.85 of what it holds
    assert c.bytes - ev.evicted_bytes <= int(0.85 * c.bytes) < c.bytes - ev.evicted_bytes + BS
    monkeypatch.setattr(cap.os, "statvfs", lambda p: statvfs(p, favail=cap.INODE_RESERVE + 100))
    c, ev, rec = cap.one_pass(str(tmp_path), 1 << 40)
    assert rec["room"] == c.bytes + int(100 * cap.bytes_per_inode(c)) and not ev.evicted  # room left


def test_a_tmpfs_out_of_inodes_with_bytes_free_recovers_by_itself(io_backend, monkeypatch):
    """A 64 MiB tmpfs with nr_inodes=400 under a 1 GiB bound: inodes run out long before
    bytes (a job of 2 blocks takes 4 inodes: 2 files and their 2 shard directories).
    The census's room counts the free inodes at a block's bytes per inode, so the
    evictor keeps inodes free: no ENOSPC (at most one, before a census has seen a
    block), stores succeed (300 of 300 here), the newest blocks load whole. Before, the
    census reset the room from free bytes only: an ENOSPC every few censuses, for ever
    (11 of 300 jobs; docs/capacity.md, "Inodes")."""
    from mounts import mount_tmpfs

    def keys(j):  # a job's 2 blocks share 2 shard directories of their own: <j%256, j//256>/<..>_g0
        return [(bytes([j % 256, j // 256, i]) + bytes(13), 0) for i in range(2)]

    _use_backend(monkeypatch, io_backend)
    with mount_tmpfs(size="64m", options=["nr_inodes=400"]) as d:
        root = os.path.join(d, "root")
        t, buf = _tier(root, rows=4, max_bytes="1G", census_interval_s=0.2)
        try:
            rc = cap.root_capacity(root)
            assert rc.wait_pass(5, after=0)
            res, free = "", []
            for j in range(300):  # 1,200 inodes stored, ~4 s: 20 censuses
                r = _run(t, TransferJob(j, keys(j), [0, 1]))[0]
                if r.success:
                    last_ok = j
                else:
                    assert r.error.errno == errno.ENOSPC, r.error
                res += "o" if r.success else "d" if "dropped by kvtier capacity" in str(r.error) else "x"
                free.append(os.statvfs(d).f_ffree)
                time.sleep(0.01)  # stores at ~75 jobs/s: the evictor ticks every 50 ms
            st = os.statvfs(d)
            print(f"\nnr_inodes=400, {st.f_bavail * st.f_frsize} bytes free; "
                  + "; ".join(f"jobs {a}-{a + 99}: {res[a:a + 100].count('o')} ok, {res[a:a + 100].count('d')} "
                              f"dropped, {res[a:a + 100].count('x')} ENOSPC" for a in (0, 100, 200))
                  + f"; fewest free inodes after job 100: {min(free[100:])}")
            assert st.f_bavail * st.f_frsize > 32 << 20  # bytes were never short
            assert res.count("x") <= 1 and res[100:].count("o") >= 150, res
            assert min(free[100:]) >= cap.INODE_RESERVE // 2  # the evictor kept inodes free
            snap = t.metrics.counters.snapshot()
            assert snap["evicted_capacity"] > 100 and snap["capacity_inodes_free"] == rc._usage["inodes_free"] > 0
            assert rc.bound() < 400 * BS  # the bound in force is the inodes' room, not 1 GiB or 64 MiB
            on_disk = sum(1 + len(fs) for _, _, fs in os.walk(root))
            assert on_disk < 400 - cap.INODE_RESERVE // 2, on_disk
            r = _run(t, TransferJob("load", keys(last_ok), [2, 3], is_promotion=True))[0]  # the newest job
            assert r.success and (buf[2:4] == buf[0:2]).all()
        finally:
            t.shutdown()

# ---------------------------------------------------------------------- kvtier evict

def test_kvtier_evict_dry_run_deletes_nothing_and_the_real_run_evicts(tmp_path, io_backend, monkeypatch):
    _use_backend(monkeypatch, io_backend)
    t, _ = _tier(tmp_path, max_bytes="1G", census_interval_s=3600)
    try:
        assert all(r.success for r in _run(t, TransferJob(1, _keys(1, 12), list(range(12)))))
    finally:
        t.shutdown()
    host, boot, ns = cap._host_identity()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = _ledger(tmp_path, "dead", {"host": host, "boot": boot, "pidns": ns, "pid": int(gone.stdout),
                                      "bytes": 10**6, "t": time.time() - 3600})  # died an hour ago
    before = sorted((dp, f, os.lstat(os.path.join(dp, f)).st_mtime_ns) for dp, _, fs in os.walk(tmp_path) for f in fs
                    if not f.startswith("usage.json"))
    cmd = [sys.executable, "-m", "kvtier", "evict", str(tmp_path), "--max-bytes", str(6 * BS), "--json"]
    r = subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dry_run"] and out["evicted"] > 0 and len(out["paths"]) == out["evicted"]
    after = sorted((dp, f, os.lstat(os.path.join(dp, f)).st_mtime_ns) for dp, _, fs in os.walk(tmp_path) for f in fs
                   if not f.startswith("usage.json"))
    assert after == before  # nothing deleted, nothing touched
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    real = json.loads(r.stdout)
    # the same oldest blocks; the real pass removed the dead ledger first: its census is a page
    # smaller, which may spare the dry run's last block (the lock file's heartbeat is a page too)
    n = len(real["paths"])
    assert real["paths"] == out["paths"][:n] and len(out["paths"]) - n <= 1
    assert not any(os.path.exists(p) for p in real["paths"])
    assert cap.census(str(tmp_path)).bytes <= int(0.85 * 6 * BS)
    assert not os.path.exists(dead)  # removed by the real pass, as a tier's evictor does (the dry run left it)
    u = cap.read_usage(str(tmp_path))
    assert u["bytes"] == real["usage_after"] and u["alloc_ratio"] >= 1.0
    r = subprocess.run(cmd[:6] + ["12X"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "powers of 1024" in r.stderr


def test_kvtier_evict_uses_the_bound_in_force_on_a_filesystem_smaller_than_max_bytes():
    """``kvtier evict --max-bytes 1T`` on a 4 MiB tmpfs filled behind the root's back: the
    bound in force is the room (census bytes + free space), as a tier's evictor has it,
    so the pass evicts down to its low mark; before, the CLI compared with 1 TiB and
    evicted nothing from a full filesystem. The filler is never touched."""
    from mounts import mount_tmpfs

    with mount_tmpfs(size="4m") as d:
        root = os.path.join(d, "root")
        t, _ = _tier(root, rows=12)
        try:
            assert all(r.success for r in _run(t, TransferJob(1, _keys(1, 12), list(range(12)))))
        finally:
            t.shutdown()
        st = os.statvfs(d)
        filler = os.path.join(d, "filler")
        with open(filler, "wb") as f:
            f.write(b"f" * (st.f_bavail * st.f_frsize - 4096))
        used = cap.census(root).bytes
        cmd = [sys.executable, "-m", "kvtier", "evict", root, "--max-bytes", "1T", "--json"]
        r = subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["evicted"] > 0 and all(os.path.exists(p) for p in out["paths"])  # nothing deleted yet
        assert out["max_bytes"] == 1 << 40 and out["bound"] == out["room"] == used + 4096
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        real = json.loads(r.stdout)
        assert r.returncode == 0 and real["paths"] == out["paths"]
        assert not any(os.path.exists(p) for p in real["paths"])
        # the real run's lock file (its heartbeat: one page) took the last free page: the same room
        assert real["bound"] == used + 4096 and real["usage_after"] <= int(0.85 * real["bound"])
        # + usage.json, published after its census
        assert cap.census(root).bytes <= real["usage_after"] + 4096 and os.path.getsize(filler) > 0
        text = subprocess.run([sys.executable, "-m", "kvtier", "info", root], capture_output=True, text=True,
                              cwd=REPO).stdout
        u = cap.read_usage(root)
        assert (f"{u['bytes']:,} bytes used of max_bytes {1 << 40:,} (0%), of the bound in force {u['room']:,} "
                f"(the filesystem's room) ({100 * u['bytes'] / u['room']:.0f}%)") in text, text


def test_kvtier_evict_with_unusable_state_files_says_so_and_exits_1(tmp_path):
    """``.kvtier/evictor.lock`` that cannot be opened (a directory here; EROFS on a
    read-only .kvtier) is exit 1 with a message and nothing evicted, not a traceback; a
    usage.json that cannot be replaced after the eviction is exit 1 with a message."""
    t, _ = _tier(tmp_path, rows=12)
    try:
        assert all(r.success for r in _run(t, TransferJob(1, _keys(1, 12), list(range(12)))))
    finally:
        t.shutdown()
    paths = t.file_mapper.get_file_names(_keys(1, 12))
    (tmp_path / ".kvtier" / "evictor.lock").mkdir(parents=True)
    cmd = [sys.executable, "-m", "kvtier", "evict", str(tmp_path), "--max-bytes", str(6 * BS)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "cannot take the evictor lock" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert all(os.path.exists(p) for p in paths)
    (tmp_path / ".kvtier" / "evictor.lock").rmdir()
    (tmp_path / ".kvtier" / "usage.json").mkdir()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "cannot publish the census" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "evicted" in r.stdout and sum(os.path.exists(p) for p in paths) < 12


@pytest.mark.parametrize("size", ["1", "500", "1K", "36863"])
def test_kvtier_evict_refuses_a_bound_that_holds_no_block(tmp_path, size):
    """``kvtier evict ROOT --max-bytes 500`` (500G meant) evicted every block, exit 0: a
    trial's typo emptied the cache. A bound below one block plus the root's own files, which
    a tier refuses too, is refused: exit 2, every block still there."""
    t, _ = _tier(tmp_path, max_bytes="1G", census_interval_s=3600)
    try:
        assert all(r.success for r in _run(t, TransferJob(1, _keys(1, 6), list(range(6)))))
    finally:
        t.shutdown()
    blocks = sorted(p for p in tmp_path.rglob("*.bin"))
    r = subprocess.run([sys.executable, "-m", "kvtier", "evict", str(tmp_path), "--max-bytes", size],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and "less than one block plus the root's own files" in r.stderr, r.stderr
    assert sorted(p for p in tmp_path.rglob("*.bin")) == blocks and len(blocks) == 6


def test_kvtier_evict_refuses_a_bound_below_the_block_size_the_root_records(tmp_path):
    """A root of 2 MiB blocks (kvtier.json records block_bytes) and ``--max-bytes 1M``: above
    the 36 KiB floor, below one block. Before, accepted and every block evicted (exit 0);
    now exit 2 naming the block size and the smallest bound that holds one block, every
    block and the root's files untouched. That bound itself is accepted."""
    bs = 2 << 20
    buf = np.frombuffer(np.random.default_rng(7).bytes(3 * bs), dtype=np.uint8).reshape(3, bs).copy()
    t = FileSystemTierManager(buf, str(tmp_path), "m", block_size=bs, use_o_direct=False,
                              n_read_threads=1, n_write_threads=1)
    try:
        assert all(r.success for r in _run(t, TransferJob(1, _keys(1, 3), [0, 1, 2])))
    finally:
        t.shutdown()
    layout = os.path.basename(t.file_mapper.base_path)
    before = {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in tmp_path.rglob("*") if p.is_file()}
    assert sum(p.endswith(".bin") for p in before) == 3
    least = bs + cap.STATE_BYTES
    for argv in (["--max-bytes", "1M"], ["--max-bytes", str(least - 1), "--dry-run"]):
        r = subprocess.run([sys.executable, "-m", "kvtier", "evict", str(tmp_path), *argv],
                           capture_output=True, text=True, cwd=REPO, timeout=60)
        assert r.returncode == 2, (argv, r.returncode, r.stderr)
        assert "less than one block plus the root's own files" in r.stderr, r.stderr
        assert f"the root's blocks are {bs} bytes (2.0 MiB, {layout}/kvtier.json)" in r.stderr, r.stderr
        assert f"the smallest bound that holds one is {least} bytes" in r.stderr, r.stderr
        assert r.stdout == "" and "Traceback" not in r.stderr
        assert {str(p): (p.stat().st_mtime_ns, p.stat().st_size)
                for p in tmp_path.rglob("*") if p.is_file()} == before
    r = subprocess.run([sys.executable, "-m", "kvtier", "evict", str(tmp_path), "--max-bytes", str(least),
                        "--dry-run", "--json"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["max_bytes"] == least


def test_kvtier_evict_refuses_a_directory_that_is_no_cache_root(tmp_path):
    """A real run on a directory with no .kvtier/ and no rank directory (a typo, $HOME)
    is exit 2, as ``kvtier scrub`` says of it (a mistyped path: bad arguments; was 1), and
    leaves it as it was (before: .kvtier/ made there, usage.json written); --dry-run
    censuses it (0 blocks); a missing root or a file is exit 2."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_bytes(b"x" * 5000)
    cmd = [sys.executable, "-m", "kvtier", "evict", "--max-bytes", "64K"]
    r = subprocess.run(cmd + [str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "no cache root" in r.stderr, (r.returncode, r.stderr)
    assert r.stdout == ""
    assert sorted(os.listdir(tmp_path)) == ["notes"] and os.listdir(tmp_path / "notes") == ["a.txt"]
    r = subprocess.run(cmd + ["--dry-run", "--json", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["census"]["blocks"] == 0 and out["census"]["files"] == 1 and out["evicted"] == 0
    assert sorted(os.listdir(tmp_path)) == ["notes"]
    r = subprocess.run(cmd + [str(tmp_path / "missing")], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and f"{tmp_path / 'missing'}: No such file or directory" in r.stderr
    r = subprocess.run(cmd + [str(tmp_path / "notes" / "a.txt")], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and f"{tmp_path / 'notes' / 'a.txt'}: Not a directory" in r.stderr


def test_kvtier_scrub_reports_what_it_cannot_read(tmp_path):
    """An unreadable shard directory: its blocks unchecked, so an ``error`` finding with the
    path and errno and exit 1, never "clean"; an unreadable ROOT: its EACCES, exit 2, not
    "no cache found". Root runs the CLI without capabilities (setpriv)."""
    t, _ = _tier(tmp_path)
    try:
        assert _run(t, TransferJob(1, _keys(1, 3), list(range(3))))[0].success
        rank = t.file_mapper.rank_path
    finally:
        t.shutdown()
    shard = os.path.join(rank, sorted(os.listdir(rank))[0])
    nocaps = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
    cmd = nocaps + [sys.executable, "-m", "kvtier", "scrub", "--no-progress", "--json", str(tmp_path)]
    os.chmod(shard, 0)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        d = json.loads(r.stdout)
        assert r.returncode == 1 and d["clean"] is False and d["counts"]["error"] == 1, (r.stdout, r.stderr)
        f = [f for f in d["findings"] if f["status"] == "error"]
        assert f[0]["path"] == shard and "errno 13" in f[0]["detail"] and d["blocks"] < 3
        os.chmod(tmp_path, 0)
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2 and "Permission denied" in r.stderr and str(tmp_path) in r.stderr
        assert "no kvtier or vLLM cache" not in r.stderr
    finally:
        os.chmod(tmp_path, 0o755)
        os.chmod(shard, 0o755)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and json.loads(r.stdout)["counts"]["ok"] == 3


def test_kvtier_scrub_shows_a_bounded_roots_last_census(tmp_path):
    """`kvtier scrub`'s first line (and --json "capacity") carries .kvtier/usage.json: the
    bytes used of max_bytes at the evictor's latest census, its age and its maker; an
    unbounded root shows none."""
    bounded, plain = tmp_path / "bounded", tmp_path / "plain"
    for root, kw in ((bounded, {"max_bytes": 40 * BS, "census_interval_s": 0.2}), (plain, {})):
        t, _ = _tier(root, **kw)
        try:
            assert all(r.success for r in _run(t, TransferJob(1, _keys(1, 12), list(range(12)))))
            if kw:  # a census that began after the 12 blocks were stored:
                rc = cap.root_capacity(str(root))
                assert rc.wait_pass(10, after=rc.passes + 1)  # the second of two passes began after
        finally:
            t.shutdown()
    u = cap.read_usage(str(bounded))
    assert u is not None and u["blocks"] == 12 and u["max_bytes"] == 40 * BS and u["evicted"] == 0
    assert cap.read_usage(str(plain)) is None
    cmd = [sys.executable, "-m", "kvtier", "scrub", "--no-progress"]
    r = subprocess.run(cmd + [str(bounded)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[0]
    share = f"{100 * u['bytes'] / (40 * BS):.0f}%"
    assert head.startswith(f"kvtier scrub {bounded}: 12 blocks, {12 * BS:,} bytes; bounded root: "
                           f"{u['bytes']:,} bytes used of max_bytes {40 * BS:,} ({share}) at its last census ("), head
    assert f"s old, by {u['evictor']})" in head and u["evictor"].endswith(f":{os.getpid()}")
    r = subprocess.run(cmd + ["--json", str(bounded)], capture_output=True, text=True, cwd=REPO)
    c = json.loads(r.stdout)["capacity"]
    assert (c["used_bytes"], c["max_bytes"], c["blocks"], c["evictor"]) == (u["bytes"], 40 * BS, 12, u["evictor"])
    assert 0 <= c["census_age_s"] <= time.time() - u["scan_started"] + 1
    r = subprocess.run(cmd + [str(plain)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "bounded root" not in r.stdout and "12 blocks" in r.stdout
    r = subprocess.run(cmd + ["--json", str(plain)], capture_output=True, text=True, cwd=REPO)
    assert json.loads(r.stdout)["capacity"] is None


def test_kvtier_evict_refuses_while_a_live_evictor_holds_the_lock(tmp_path):
    a = _writer(tmp_path, 1, 30.0, 0.2, 1 << 30, pause=0.05)
    try:
        end = time.monotonic() + 10
        while not (cap.read_usage(str(tmp_path)) or {}).get("evictor", "").endswith(f":{a.pid}"):
            assert time.monotonic() < end
            time.sleep(0.02)
        r = subprocess.run([sys.executable, "-m", "kvtier", "evict", str(tmp_path), "--max-bytes", "64K"],
                           capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 1 and "holds the evictor lock" in r.stderr and str(a.pid) in r.stderr
        assert re.search(rf"; heartbeat \d+ s old by [^ ]+:{a.pid}, seq \d+;", r.stderr), r.stderr
    finally:
        a.kill()
        a.wait()


# ---------------------------------------------------------------------- vLLM

def _vllm_harness():
    """tests/vllm_harness's ``(Harness, key)`` with kvtier registered as a vLLM tier, or the
    test skips (fails under CI) saying why."""
    from ci import unavailable

    try:
        from vllm.plugins import load_general_plugins
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as e:
        unavailable(f"vLLM 0.33 is not importable ({e})")
    load_general_plugins()
    if "kvtier" not in SecondaryTierFactory._registry:
        unavailable("kvtier's vllm.general_plugins entry point is not installed (pip install -e .)")
    from vllm_harness import Harness, key

    return Harness, key


@pytest.mark.vllm
def test_vllm_tier_with_a_bound_emits_removed_events_and_misses(tmp_path):
    Harness, key = _vllm_harness()

    bs = 8192
    root = str(tmp_path / "kv")
    conf = {"type": "kvtier", "root_dir": root, "n_read_threads": 2, "n_write_threads": 2, "enable_kv_events": True,
            "max_bytes": "1G", "census_interval_s": 3600, "use_o_direct": False}
    h = Harness([conf], block_bytes=bs, events=True)
    try:
        tier = h.tiers[0]
        rng = np.random.default_rng(5)
        a = [key(i, salt=1) for i in range(6)]
        b = [key(i, salt=2) for i in range(6)]
        da = [rng.integers(0, 256, bs, dtype=np.uint8).tobytes() for _ in a]
        db = [rng.integers(0, 256, bs, dtype=np.uint8).tobytes() for _ in b]
        h.store(a, da)
        h.wait_tiers()
        time.sleep(0.01)
        h.store(b, db)
        h.wait_tiers()
        h.reset()  # the CPU tier forgets them: lookups go to the files
        stored = [e for e in h.manager.take_events() if e.medium.name == "STORAGE"]
        assert sorted(k for e in stored for k in e.keys) == sorted(a + b) and not any(e.removed for e in stored)
        rc = cap.root_capacity(root)
        base = cap.census(root).bytes
        rc.max_bytes = int((base - 6 * bs) / 0.85) + 1  # room for b only, below the low watermark
        rc._job_max = 0  # (a bound this small has no room for b and another 6-block job: the marks would move down)
        n = rc.passes
        rc.request_evict("capacity")
        assert rc.wait_pass(10, after=n) and len(rc.last_pass.evicted) == 6
        ev = [e for e in h.manager.take_events() if e.medium.name == "STORAGE"]
        assert [(sorted(e.keys), e.removed) for e in ev] == [(sorted(a), True)]
        assert not any(os.path.exists(tier.file_mapper.get_file_name(k)) for k in a)
        r = h.ctx()
        assert all(s[-1] == "MISS" for s in h.lookup_all(a, r).values())
        assert all(s[-1] == "HIT" for s in h.lookup_all(b, r).values())
        assert h.load(b, r) == db
        h.finish(r)
        snap = tier.counters()
        assert snap["evicted_capacity"] == 6 and snap["evicted_bytes_capacity"] == 6 * bs
        defs = type(tier).build_metric_definitions(conf)
        assert "kvtier:kv_offload_tiering_evictions" in defs and "kvtier:kv_offload_tiering_capacity_used_bytes" in defs
        assert "kvtier:kv_offload_tiering_capacity_used_bytes" not in type(tier).build_metric_definitions(
            {k: v for k, v in conf.items() if k != "max_bytes"})
    finally:
        h.close()


@pytest.mark.vllm
def test_vllm_tier_refreshes_a_finished_requests_blocks_the_cpu_tier_served(tmp_path):
    """vLLM asks a secondary tier only about the CPU tier's misses: a bounded kvtier tier
    refreshes on disk every block of a finished request (its keys in prefix order, from
    vLLM's request context), so the disk copies of a prefix the CPU tier keeps serving do
    not age as unused and are not evicted first; rate-limited (one touch per window per
    process); a key with no file costs nothing more."""
    Harness, key = _vllm_harness()

    bs = 8192
    root = str(tmp_path / "kv")
    conf = {"type": "kvtier", "root_dir": root, "n_read_threads": 2, "n_write_threads": 2,
            "max_bytes": "1G", "census_interval_s": 3600, "touch_window_s": 30, "use_o_direct": False}
    h = Harness([conf], block_bytes=bs)
    try:
        tier = h.tiers[0]
        rng = np.random.default_rng(9)
        a = [key(i, salt=3) for i in range(4)]  # the prefix the CPU tier keeps serving
        b = [key(i, salt=4) for i in range(4)]  # another request's blocks, stored later
        h.store(a, [rng.integers(0, 256, bs, dtype=np.uint8).tobytes() for _ in a])
        h.wait_tiers()
        h.store(b, [rng.integers(0, 256, bs, dtype=np.uint8).tobytes() for _ in b])
        h.wait_tiers()
        pa = [tier.file_mapper.get_file_name(k) for k in a]
        pb = [tier.file_mapper.get_file_name(k) for k in b]
        old = time.time_ns() - 3600 * 10**9
        for p in pa:
            os.utime(p, ns=(old, old))  # a's disk copies look an hour unused
        rc = cap.root_capacity(root)
        rc._touched.clear()  # (the stores' stamps: outside any window now)
        r = h.ctx()
        missing = key(99, salt=3)  # a key of the request with no file (never cascaded)
        for pos, k in enumerate(a + [missing], 1):
            r.set_offload_key_position(k, pos * 16)
        t0 = time.time_ns()
        h.finish(r)  # the CPU tier served the request: the disk tier was asked nothing
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.stat(p).st_mtime_ns < t0 for p in pa):
            time.sleep(0.01)
        m = [os.stat(p).st_mtime_ns for p in pa]
        assert all(x >= t0 for x in m), (m, t0)
        assert m == sorted(m, reverse=True)  # the head newest
        assert min(m) > max(os.stat(p).st_mtime_ns for p in pb)  # a is now newer than b: b goes first
        assert not os.path.exists(tier.file_mapper.get_file_name(missing))
        # rate-limited: a second finish within the window writes no mtime
        for p in pa:
            os.utime(p, ns=(old, old))
        r2 = h.ctx()
        for pos, k in enumerate(a, 1):
            r2.set_offload_key_position(k, pos * 16)
        h.finish(r2)
        time.sleep(0.3)
        assert all(os.stat(p).st_mtime_ns == old for p in pa)
        # an eviction now takes b (older) and keeps a
        base = cap.census(root).bytes
        for p in pa:
            os.utime(p, ns=(t0, t0))
        rc.max_bytes = int((base - 4 * bs) / 0.85) + 1
        rc._job_max = 0
        n = rc.passes
        rc.request_evict("capacity")
        assert rc.wait_pass(10, after=n)
        assert all(os.path.exists(p) for p in pa) and not any(os.path.exists(p) for p in pb)
    finally:
        h.close()


# ---------------------------------------------------------------------- two DFS clients

LOCK_HOLDER = r"""
import sys, time
sys.path.insert(0, {repo!r})
from kvtier._tier.capacity import EvictorLock
lock = EvictorLock(sys.argv[1])
print("held" if lock.try_acquire() else "refused", flush=True)
time.sleep(120)
"""


@pytest.mark.dfs
def test_the_evictor_lock_excludes_across_two_dfs_clients_and_fails_over(dfs, dfs_dirs):
    """The fcntl lock of ``.kvtier/evictor.lock`` taken through node A's mount refuses a
    second process through node B's (two FUSE clients of one volume), and is free for B
    once A's holder is SIGKILLed."""
    a, b = dfs_dirs
    os.makedirs(os.path.join(a, cap.STATE_DIR, cap.WRITERS_DIR))
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER.format(repo=REPO), a], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        end = time.monotonic() + 15  # node B's view of the new directory (GlusterFS name cache)
        while not os.path.isdir(os.path.join(b, cap.STATE_DIR)):
            assert time.monotonic() < end
            time.sleep(0.1)
        lock = cap.EvictorLock(b)
        try:
            assert not lock.try_acquire(), f"{dfs.kind}: a second client took a held lock"
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()
            t0 = time.monotonic()
            while not lock.try_acquire():
                assert time.monotonic() - t0 < 30, f"{dfs.kind}: the lock of a killed holder was never released"
                time.sleep(0.1)
            print(f"{dfs.kind}: lock free for node B {time.monotonic() - t0:.2f} s after the SIGKILL")
        finally:
            lock.release()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.dfs
def test_two_dfs_clients_stay_within_the_bound_plus_a_batch_each(dfs, dfs_dirs):
    """As the two-process test, each writer on its own FUSE client (node A, node B)."""
    a, b = dfs_dirs
    max_bytes, batch = 48 * BS, 4
    ps = [_writer(root, tag, 6.0, 0.3, max_bytes, batch) for tag, root in ((1, a), (2, b))]
    peak, samples = 0, 0
    while any(p.poll() is None for p in ps):
        peak = max(peak, cap.census(a, keep_entries=False).bytes)
        samples += 1
        time.sleep(0.02)
    outs = [p.communicate()[0] for p in ps]
    assert all(p.returncode == 0 for p in ps)
    done = [line.split() for o in outs for line in o.splitlines() if line.startswith("done")]
    stored = [int(d[1]) for d in done]
    print(f"{dfs.kind}: peak {peak} bytes for a bound of {max_bytes}, {samples} samples, jobs stored {stored}, "
          f"dropped {[int(d[2]) for d in done]}")
    assert min(stored) > 0 and sum(stored) * batch * BS > 2 * max_bytes
    allowance = 2 * batch * BS + 50 * batch * BS + 256 * 1024
    assert samples > 20 and peak <= max_bytes + allowance, (peak, max_bytes)


def _dfs_usage(root):
    """:func:`cap.read_usage` through a FUSE client: a read that meets the rename of a new
    usage.json (ENOENT, ESTALE: None) is read again, for up to 2 s."""
    end = time.monotonic() + 2.0
    while True:
        u = cap.read_usage(root)
        if u is not None or time.monotonic() > end:
            return u or {}
        time.sleep(0.01)


def _dfs_evictor_pid(root):
    """:func:`_evictor_pid` through a FUSE client (:func:`_dfs_usage`)."""
    return int(_dfs_usage(root).get("evictor", ":0").rsplit(":", 1)[-1])


@pytest.mark.dfs
def test_a_stopped_evictor_on_one_dfs_client_is_taken_over_through_the_other(dfs, dfs_dirs, tmp_path):
    """Issue #22's takeover across two FUSE clients of one volume (GlusterFS, MooseFS): the
    evictor A, storing through node A's mount, is SIGSTOPped (it keeps its fcntl lock); B,
    through node B's, sees A's heartbeat still for takeover_s, takes the lock over (a new
    evictor.lock, renamed over the old one through B's mount) and censuses; A, continued,
    finds through its own mount that its lock file was replaced, steps down and publishes
    nothing more. The root is back under its bound."""
    a_root, b_root = dfs_dirs
    max_bytes, interval, takeover = 48 * BS, 0.3, 1.5
    ps = []
    try:
        a_log = open(os.path.join(str(tmp_path), "a.stderr"), "w+")  # read while A runs
        a = _writer(a_root, 1, 60.0, interval, max_bytes, pause=0.02, takeover_s=takeover, stderr=a_log)
        ps.append(a)
        _wait_for(lambda: _dfs_evictor_pid(b_root) == a.pid, 20, "A never published a census")
        b = _writer(b_root, 2, 60.0, interval, max_bytes, pause=0.02, takeover_s=takeover)
        ps.append(b)
        time.sleep(4 * interval)
        hb = cap.read_heartbeat(b_root)
        assert hb is not None and hb["by"].endswith(f":{a.pid}") and _dfs_evictor_pid(b_root) == a.pid  # B waits
        os.kill(a.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _wait_for(lambda: (cap.read_heartbeat(b_root) or {}).get("by", "").endswith(f":{b.pid}"),
                  takeover + 4 * interval + 10, "no takeover")
        assert time.monotonic() - t0 >= 0.9 * takeover - 0.05
        _wait_for(lambda: _dfs_evictor_pid(a_root) == b.pid, 10, "B published no census (seen through A's mount)")
        _wait_for(lambda: cap.census(b_root, keep_entries=False).bytes <= max_bytes + 256 * 1024, 10,
                  "the bound is not met again")
        gen = _dfs_usage(b_root)["generation"]
        os.kill(a.pid, signal.SIGCONT)
        # A runs again: B stays the evictor, seen through either mount; A publishes nothing
        # and steps down once its stat of the lock file finds the new one (0.1-0.5 s here;
        # once 25 s on MooseFS, its client blocked meanwhile: it published nothing)
        resumed = time.monotonic()
        end, stepped = resumed + 90.0, 0.0
        # Until A has stepped down, and until B's next census after that, A's record may
        # show: through A's mount while A's client still has the old usage.json cached,
        # and through both when A was stopped inside a publication (its lock checked, the
        # rename pending: a check-then-rename nothing on POSIX can fence), which completes
        # when A runs again and stands until B publishes again (B's census interval on a
        # DFS: a scan's time / CENSUS_CPU_SHARE, seconds). Once B's record is back through
        # both mounts after A stepped down, never again.
        stale, settled, back = 0, 0, 0.0
        while time.monotonic() < end:
            now = time.monotonic()
            pids = (_dfs_evictor_pid(b_root), _dfs_evictor_pid(a_root))
            if not stepped and "is no evictor of" in open(a_log.name).read():
                stepped = now
            if back:
                assert pids == (b.pid, b.pid), (pids, a.pid, b.pid)
                settled += 1
                if now > back + 3 * interval + 1.0:
                    break
            elif stepped and now > stepped + 1.5 and pids == (b.pid, b.pid):
                back = now  # (past the FUSE clients' ~1 s entry and attribute caches)
            else:
                assert set(pids) <= {a.pid, b.pid}, (pids, a.pid, b.pid)
                stale += 1
            time.sleep(0.05)
        assert stepped, "A never stepped down"
        assert back and back - stepped <= 15.0, (stepped, back)  # B's next census at the latest
        assert settled >= 10, settled
        print(f"{dfs.kind}: A stepped down {stepped - resumed:.1f} s after it was continued; its stale "
              f"record seen through its mount {stale} times")
        assert _dfs_usage(b_root)["generation"] > gen  # B went on censusing
    finally:
        _stop_writers(ps)
    _assert_took_over(a, b, a_root, b_root, a_err=open(a_log.name).read())


# ---------------------------------------------------------------------- kvtier info ROOT

def _info_root(root, rc=0):
    r = subprocess.run([sys.executable, "-m", "kvtier", "info", str(root), "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == rc, r.stderr
    return json.loads(r.stdout)["root"] if rc == 0 else r


def test_kvtier_info_root_shows_the_census_the_writers_and_the_lock(tmp_path):
    """``kvtier info ROOT`` reads a bounded root's usage from what its evictor published
    (used and max bytes, files, blocks), the live writers' ledgers, and the lock's holder
    (this process while its tier runs, nobody after), and creates nothing."""
    t, _ = _tier(tmp_path, max_bytes="64M", census_interval_s=0.2)
    try:
        rc = cap.root_capacity(str(tmp_path))
        assert _run(t, TransferJob(1, _keys(1, 6), list(range(6))))[0].success
        assert rc.wait_pass(10, after=rc.passes + 1)  # a census begun after the store: it counts the 6 blocks
        u = cap.read_usage(str(tmp_path))
        d = _info_root(tmp_path)
        assert d["root"] == str(tmp_path) and d["rank_dirs"] == [os.path.basename(t.file_mapper.base_path) + "_r0"]
        c = d["capacity"]
        assert c["max_bytes"] == 64 << 20 and c["used_bytes"] == u["bytes"]
        assert 6 * BS <= c["used_bytes"] <= _find_bytes(tmp_path) + 16384  # the whole root, .kvtier/ included
        assert c["blocks"] == 6 and c["lock_holder"] == os.getpid() and c["writers_live"] == 1
        hb = c["heartbeat"]  # the holder (this process) beats every second
        assert hb["by"] == rc.lock.by and 1 <= hb["seq"] <= rc.lock.seq and -1 < hb["age_s"] < 5
        assert d["filesystem"]["free_bytes"] > 0 and d["load_landing"]["auto"] in ("direct", "bounce")
    finally:
        t.shutdown()
    before = sorted(p for p, _, _ in os.walk(tmp_path))
    d = _info_root(tmp_path)
    assert d["capacity"]["lock_holder"] is None and d["capacity"]["blocks"] == 6
    assert sorted(p for p, _, _ in os.walk(tmp_path)) == before  # read only: nothing made
    text = subprocess.run([sys.executable, "-m", "kvtier", "info", str(tmp_path)], capture_output=True, text=True,
                          timeout=120).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("  capacity:     "))
    assert line.startswith(f"  capacity:     {u['bytes']:,} bytes used of max_bytes 67,108,864 (") and \
        f", {u['files']:,} files, 6 blocks at the latest census (" in line and f"s old, by {u['evictor']})" in line
    assert "evictor lock free" in text


def test_kvtier_info_root_unbounded_and_missing(tmp_path):
    d = _info_root(tmp_path)
    assert d["capacity"] is None and d["rank_dirs"] == [] and not (tmp_path / ".kvtier").exists()
    r = _info_root(tmp_path / "nope", rc=2)
    assert "No such file or directory" in r.stderr and str(tmp_path / "nope") in r.stderr and r.stdout == ""


def test_kvtier_evict_judges_its_arguments_before_the_root(tmp_path):
    """A bad ``--max-bytes`` is a usage error (exit 2, the parser's message) even when ROOT
    is missing too; a good one on a missing ROOT is exit 2 with the path (as every
    subcommand: tests/test_cli.py); nothing is made."""
    missing = tmp_path / "nope"
    r = subprocess.run([sys.executable, "-m", "kvtier", "evict", str(missing), "--max-bytes", "abc"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot parse 'abc'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvtier", "evict", str(missing), "--max-bytes", "90%"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"{missing}: No such file or directory" in r.stderr
    assert not missing.exists()


# ---------------------------------------------------------------------- what the census cannot read

def test_a_symlinked_rank_directory_is_counted_and_evicted_through_its_link(tmp_path, io_backend, monkeypatch):
    """A rank directory moved to another disk and linked back: the tier writes through
    the link, so the census follows it (before, the link was skipped: the gauge read
    16 KiB while 9 MB were stored and nothing was evicted), and twice-linked counts once."""
    _use_backend(monkeypatch, io_backend)
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    t, _ = _tier(root)
    rank = t.file_mapper.rank_path
    t.shutdown()
    os.rename(rank, elsewhere / os.path.basename(rank))
    os.symlink(elsewhere / os.path.basename(rank), rank)
    t, _ = _tier(root, max_bytes=24 * BS, census_interval_s=0.05)
    try:
        for j in range(6):  # 48 blocks through the link, twice the bound
            _run(t, TransferJob(j, _keys(j, 8), list(range(8))))
            assert cap.root_capacity(str(root)).wait_pass(10)
        rc = cap.root_capacity(str(root))
        assert rc.wait_pass(10, after=rc.passes + 1)
        real_bins = [f for _, _, fs in os.walk(elsewhere) for f in fs if f.endswith(".bin")]
        c = cap.census(str(root))
        assert 0 < c.blocks == len(real_bins) and c.block_bytes == len(real_bins) * BS <= 24 * BS
        assert t.metrics.counters.snapshot()["evicted_capacity"] >= 48 - 24
        os.symlink(elsewhere / os.path.basename(rank), root / "again_r1")  # a second link to the same directory
        assert cap.census(str(root)).blocks == c.blocks
        d = _info_root(root)
        assert os.path.basename(rank) in d["rank_dirs"]
    finally:
        t.shutdown()


def test_a_census_that_cannot_read_part_of_the_root_says_so_and_evict_exits_1(tmp_path):
    """An unreadable directory under the root: its bytes cannot be counted, and the census
    says how many entries it could not read and the first with its errno, the tier logs
    it, and ``kvtier evict`` exits 1 (as du does); an unreadable root is EACCES with exit 2
    (as ``kvtier scrub``; was 1), not "no cache root" or 0 bytes.  Root runs the CLI without
    capabilities (setpriv)."""
    t, _ = _tier(tmp_path)
    try:
        assert _run(t, TransferJob(1, _keys(1, 4), list(range(4))))[0].success
    finally:
        t.shutdown()
    other = tmp_path / "other"
    other.mkdir()
    (other / "big").write_bytes(b"x" * (1 << 20))
    os.chmod(other, 0)
    nocaps = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
    cmd = nocaps + [sys.executable, "-m", "kvtier", "evict", "--max-bytes", "1G", "--json"]
    try:
        r = subprocess.run(cmd + [str(tmp_path)], capture_output=True, text=True, cwd=REPO)
        out = json.loads(r.stdout)
        assert r.returncode == 1 and out["unreadable"] == 1 and out["census"]["blocks"] == 4
        assert out["unreadable_first"].startswith(f"{other}: [Errno 13]")
        assert f"1 directories or files under {tmp_path} could not be read (first: {other}: Permission denied, " \
               f"errno 13)" in r.stderr
        assert out["census"]["bytes"] < 1 << 20  # the unreadable MiB is not in it
        os.chmod(tmp_path, 0)
        for dry in (["--dry-run"], []):
            r = subprocess.run(cmd + dry + [str(tmp_path)], capture_output=True, text=True, cwd=REPO)
            assert r.returncode == 2, (dry, r.returncode, r.stderr)
            assert json.loads(r.stdout) == {"root": str(tmp_path), "error": f"[Errno 13] Permission denied: "
                                            f"'{tmp_path}'", "exit_status": 2}  # --json: the failure too
            assert r.stderr == f"kvtier evict: [Errno 13] Permission denied: '{tmp_path}'\n", (dry, r.stderr)
    finally:
        os.chmod(tmp_path, 0o755)
        os.chmod(other, 0o755)
    c = cap.census(str(tmp_path))  # readable again: everything counted
    assert c.unreadable == 0 and c.first_error is None and c.bytes >= 1 << 20


@pytest.mark.parametrize("kind", ["directory", "read-only"])
def test_an_evictor_lock_that_cannot_be_opened_fails_the_tier_at_start(tmp_path, kind):
    """``.kvtier/evictor.lock`` a directory or read-only (to a process without
    CAP_DAC_OVERRIDE): the capacity thread failed every tick (a traceback each 100 ms, no
    census, every store dropped once full); now the tier does not start, with the path."""
    lock = tmp_path / ".kvtier" / "evictor.lock"
    lock.parent.mkdir()
    if kind == "directory":
        lock.mkdir()
        with pytest.raises(OSError) as ei:
            _tier(tmp_path, max_bytes="1G")
        assert ei.value.errno == errno.EISDIR and ei.value.filename == str(lock)
        assert cap.root_capacity(str(tmp_path)) is None
        return
    lock.touch(mode=0o444)
    script = (f"import sys; sys.path.insert(0, {os.path.join(REPO, 'tests')!r}); import test_capacity as tc\n"
              f"try:\n    tc._tier({str(tmp_path)!r}, max_bytes='1G')\nexcept OSError as e:\n"
              f"    print(e.errno, e.filename)\n")
    nocaps = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
    r = subprocess.run(nocaps + [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.stdout.split() == [str(errno.EACCES), str(lock)], (r.stdout, r.stderr[-2000:])
