"""FileSystemTierManager on real files in temp dirs (ext4 under /tmp here; tmpfs and ramfs
mounts where a test needs them, from tests/mounts.py and the conftest fixtures, skipped with
a reason where mounting is not permitted)."""
import errno
import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import kvtier
import kvtier.io as kio
from kvtier import metrics as M
from kvtier.manager import FileSystemTierManager, JobResult, TransferJob, filesystem_type
from mounts import mount_loop, mount_tmpfs

BS = 16384  # bytes per block in these tests
NB = 16


def keys_for(n, group=0, salt=0):
    return [((salt * 1000 + i).to_bytes(8, "big") + b"\xab" * 8, group) for i in range(n)]


def rand_buf(nblocks=NB, bs=BS, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (nblocks, bs), dtype=np.uint8)


def mk(buf, root, **kw):
    kw.setdefault("n_read_threads", 2)
    kw.setdefault("n_write_threads", 2)
    return FileSystemTierManager(buf, str(root), "test/model", **kw)


def run(mgr, job, load):
    (mgr.submit_load if load else mgr.submit_store)(job)
    assert mgr.drain_jobs(timeout=30)
    res = mgr.get_finished_jobs()
    assert [r.job_id for r in res] == [job.job_id]
    return res[0]


@pytest.fixture
def tier(tmp_path):
    made = []

    def factory(buf=None, **kw):
        buf = rand_buf() if buf is None else buf
        m = mk(buf, tmp_path / "cache", **kw)
        made.append(m)
        return m, buf

    yield factory
    for m in made:
        m.shutdown()


# ---------------------------------------------------------------- round trip
@pytest.mark.parametrize("checksum", [False, True])
def test_round_trip(tier, checksum):
    m, buf = tier(checksum_blocks=checksum)
    orig = buf.copy()
    keys = keys_for(NB)
    r = run(m, TransferJob(1, keys, list(range(NB))), load=False)
    assert r.success and r.successful_keys == tuple(keys) and r.transfer_bytes == NB * BS
    assert not r.checksum_failed and r.error is None and r.transfer_time > 0
    for i, k in enumerate(keys):
        p = m.file_mapper.get_file_name(k)
        with open(p, "rb") as f:
            assert f.read() == orig[i].tobytes()
        if checksum:
            assert os.getxattr(p, "user.vllm.kv_crc32c") == kvtier.crc32c(orig[i]).to_bytes(4, "big")
        else:
            with pytest.raises(OSError) as ei:
                os.getxattr(p, "user.vllm.kv_crc32c")
            assert ei.value.errno == errno.ENODATA
    buf[:] = 0
    # load into permuted slots, as two jobs
    perm = list(reversed(range(NB)))
    m.submit_load(TransferJob("a", keys[:8], perm[:8], is_promotion=True))
    m.submit_load(TransferJob("b", keys[8:], perm[8:]))
    assert m.drain_jobs(30)
    res = {r.job_id: r for r in m.get_finished_jobs()}
    assert res["a"].success and res["b"].success
    for i in range(NB):
        assert np.array_equal(buf[perm[i]], orig[i])
    assert m.lookup(keys[:3] + keys_for(1, salt=9)) == [True, True, True, False]
    assert m.metrics.value(M.WRITE_BYTES) == NB * BS
    assert m.metrics.value(M.READ_BYTES) == NB * BS
    assert m.metrics.value(M.READ_TIME) > 0 and m.metrics.value(M.WRITE_TIME) > 0
    with open(m.file_mapper.config_path) as f:
        assert json.load(f) == m.file_mapper.fields
    assert m.file_mapper.read_block_info() == {"block_bytes": BS}


@pytest.mark.parametrize("checksum", [False, True])
def test_unaligned_buffer_warns_and_counts_buffered_stores(tmp_path, io_backend, monkeypatch, caplog, checksum):
    """A primary buffer 16 bytes past a page, O_DIRECT on, checksums on or off: the tier
    warns at startup that its stores are buffered and counts each such block
    (kvtier:kv_offload_tiering_buffered_unaligned); a page-aligned buffer neither warns
    nor counts (both backends)."""
    monkeypatch.setattr(kio, "batch_store_block", io_backend.batch_store_block)
    raw = np.zeros(NB * BS + 4096 + 16, np.uint8)
    start = (-raw.ctypes.data) % 4096
    for skew, want in [(16, NB), (0, 0)]:
        buf = raw[start + skew:start + skew + NB * BS].reshape(NB, BS)
        buf[:] = rand_buf()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier._tier.engine"):
            m = mk(buf, tmp_path / f"c{skew}", checksum_blocks=checksum)
        try:
            if not m.use_o_direct:
                pytest.skip(f"{tmp_path} does not accept O_DIRECT")
            warned = [r.getMessage() for r in caplog.records if "buffered_unaligned" in r.getMessage()]
            assert warned == ([f"the primary buffer starts {skew} bytes past a page: stores write straight from it, "
                               "so they are buffered, not O_DIRECT (counted as buffered_unaligned); "
                               "give a page-aligned buffer (an mmap) to keep O_DIRECT"] if skew else [])
            assert run(m, TransferJob(1, keys_for(NB), list(range(NB))), load=False).success
            assert m.metrics.registry.get_sample_value(M.BUFFERED_UNALIGNED + "_total", {"tier": "1:kvtier"}) == want
        finally:
            m.shutdown()


def test_one_dimensional_bytearray_buffer(tmp_path):
    buf = bytearray(os.urandom(4 * 4096))
    orig = bytes(buf)
    with mk(buf, tmp_path, block_size=4096) as m:
        keys = keys_for(4)
        assert run(m, TransferJob(1, keys, [0, 1, 2, 3]), load=False).success
        buf[:] = bytes(len(buf))
        assert run(m, TransferJob(2, keys, [3, 2, 1, 0]), load=True).success
        assert buf[:4096] == orig[3 * 4096:]
        assert buf[3 * 4096:] == orig[:4096]


def test_store_skips_existing_destination(tier):
    m, buf = tier()
    k = keys_for(1)
    assert run(m, TransferJob(1, k, [0]), load=False).success
    r = run(m, TransferJob(2, k, [5]), load=False)  # different bytes, same key
    assert r.success
    with open(m.file_mapper.get_file_name(k[0]), "rb") as f:
        assert f.read() == buf[0].tobytes()


# ---------------------------------------------------------------- failures
def corrupt(path, where):
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        pos = {"start": 0, "middle": size // 2, "end": size - 1}[where]
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("bad", [0, 4, 7])  # first, middle, last block of the job
def test_checksum_failure_partial_keep(tier, bad):
    reg = CollectorRegistry()
    m, buf = tier(checksum_blocks=True, registry=reg)
    orig = buf.copy()
    keys = keys_for(8)
    assert run(m, TransferJob(1, keys, list(range(8))), load=False).success
    paths = [m.file_mapper.get_file_name(k) for k in keys]
    corrupt(paths[bad], ["start", "middle", "end"][bad % 3])
    buf[:] = 0
    r = run(m, TransferJob(2, keys, list(range(8))), load=True)
    assert not r.success and r.checksum_failed
    assert r.successful_keys == tuple(keys[:bad])
    assert r.transfer_bytes == bad * BS
    assert isinstance(r.error, OSError) and r.error.errno == errno.EBADMSG
    assert r.error.filename == paths[bad]
    for i in range(bad):
        assert np.array_equal(buf[i], orig[i])
    # the provably bad file is removed, every other file kept
    assert [os.path.exists(p) for p in paths] == [i != bad for i in range(8)]
    assert reg.get_sample_value("vllm:kv_offload_tiering_checksum_failures_total", {"tier": "1:kvtier"}) == 1
    assert reg.get_sample_value("vllm:kv_offload_tiering_promotion_job_failures_total", {"tier": "1:kvtier"}) == 1
    assert reg.get_sample_value("vllm:kv_offload_tiering_read_bytes_total", {"tier": "1:kvtier"}) == bad * BS
    # this tier's own retry-once counts: the bad block was re-read once, then condemned
    assert r.checksum_retries == 1
    assert reg.get_sample_value("kvtier:kv_offload_tiering_checksum_retries_total", {"tier": "1:kvtier"}) == 1
    assert reg.get_sample_value("kvtier:kv_offload_tiering_checksum_condemned_total", {"tier": "1:kvtier"}) == 1
    # a lookup now reports the removed block as a miss
    assert m.lookup(keys) == [i != bad for i in range(8)]


@pytest.mark.parametrize("bad", [0, 3, 7])
def test_missing_file_is_a_miss_and_keeps_others(tier, bad):
    m, _ = tier(checksum_blocks=True)
    keys = keys_for(8)
    assert run(m, TransferJob(1, keys, list(range(8))), load=False).success
    paths = [m.file_mapper.get_file_name(k) for k in keys]
    os.unlink(paths[bad])
    r = run(m, TransferJob(2, keys, list(range(8))), load=True)
    assert not r.success and not r.checksum_failed
    assert r.error.errno == errno.ENOENT and r.successful_keys == tuple(keys[:bad])
    assert [os.path.exists(p) for p in paths] == [i != bad for i in range(8)]
    assert m.metrics.value(M.CHECKSUM_FAILURES) == 0


def test_symlink_loop_is_transient_and_kept(tier):
    m, _ = tier(checksum_blocks=True)
    keys = keys_for(3)
    assert run(m, TransferJob(1, keys[:2], [0, 1]), load=False).success
    p = m.file_mapper.get_file_name(keys[2])
    os.makedirs(os.path.dirname(p), exist_ok=True)
    os.symlink(p, p)  # a link to itself: open() fails with ELOOP
    r = run(m, TransferJob(2, keys, [0, 1, 2]), load=True)
    assert not r.success and not r.checksum_failed
    assert r.error.errno == errno.ELOOP and r.successful_keys == tuple(keys[:2])
    assert os.path.islink(p)  # not removed: not provably bad
    assert m.metrics.value(M.CHECKSUM_FAILURES) == 0


def test_truncated_file_fails_eio_and_is_removed(tier):
    m, _ = tier()
    keys = keys_for(2)
    assert run(m, TransferJob(1, keys, [0, 1]), load=False).success
    p = m.file_mapper.get_file_name(keys[1])
    os.truncate(p, BS - 1)
    r = run(m, TransferJob(2, keys, [0, 1]), load=True)
    assert not r.success and r.error.errno == errno.EIO and r.successful_keys == (keys[0],)
    assert not os.path.exists(p)


def test_fs_ebadmsg_not_counted(tier, monkeypatch):
    m, _ = tier(checksum_blocks=True)
    keys = keys_for(4)
    assert run(m, TransferJob(1, keys, list(range(4))), load=False).success

    def fs_ebadmsg(paths, view, offsets, block_size, use_o_direct=True, checksum=False, **kw):
        e = OSError(errno.EBADMSG, os.strerror(errno.EBADMSG), paths[2])
        e.num_succeeded = 2
        e.checksum_failed = False  # the filesystem said EBADMSG (e.g. ext4 metadata csum)
        raise e

    monkeypatch.setattr(kio, "batch_load_block", fs_ebadmsg)
    r = run(m, TransferJob(2, keys, list(range(4))), load=True)
    assert not r.success and not r.checksum_failed and r.error.errno == errno.EBADMSG
    assert r.successful_keys == tuple(keys[:2])
    assert m.metrics.value(M.CHECKSUM_FAILURES) == 0
    assert m.metrics.value(M.PROMOTION_JOB_FAILURES) == 1
    assert all(os.path.exists(m.file_mapper.get_file_name(k)) for k in keys)


def test_store_failure_counts_cascade_failure(tier):
    m, _ = tier()
    keys = keys_for(3)
    # make block 1's <hhh> directory a regular file: its store fails with ENOTDIR
    p1 = m.file_mapper.get_file_name(keys[1])
    d = os.path.dirname(os.path.dirname(p1))
    os.makedirs(os.path.dirname(d), exist_ok=True)
    if not os.path.exists(d):
        open(d, "w").close()
    # keys[0] shares the <hhh> dir with keys[1] (same leading bytes); use a distinct first key
    k0 = (b"\xff" * 16, 0)
    r = run(m, TransferJob(1, [k0, keys[1], keys[2]], [0, 1, 2]), load=False)
    assert not r.success and r.error.errno == errno.ENOTDIR
    assert r.successful_keys == (k0,)
    assert m.metrics.value(M.CASCADE_JOB_FAILURES) == 1
    assert m.metrics.value(M.WRITE_BYTES) == 0
    assert not [f for f in os.listdir(os.path.dirname(d)) if f.endswith(".tmp")]


def test_checksum_metric_absent_when_off(tier):
    reg = CollectorRegistry()
    m, _ = tier(checksum_blocks=False, registry=reg)
    assert not m.metrics.has(M.CHECKSUM_FAILURES)
    assert reg.get_sample_value("vllm:kv_offload_tiering_checksum_failures_total", {"tier": "1:kvtier"}) is None
    assert reg.get_sample_value("kvtier:kv_offload_tiering_checksum_retries_total", {"tier": "1:kvtier"}) is None
    assert reg.get_sample_value("kvtier:kv_offload_tiering_checksum_condemned_total", {"tier": "1:kvtier"}) is None
    assert reg.get_sample_value("vllm:kv_offload_tiering_read_bytes_total", {"tier": "1:kvtier"}) == 0


# ---------------------------------------------------------------- jobs and threads
class Gate:
    """Replaces kio.batch_load_block: every call blocks until released."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        self.started = []
        self.lock = threading.Lock()
        real = kio.batch_load_block

        def gated(*a, **kw):
            with self.lock:
                self.started.append(threading.current_thread().name)
            assert self.release.wait(30)
            return real(*a, **kw)

        monkeypatch.setattr(kio, "batch_load_block", gated)

    def wait_started(self, n, timeout=10):
        t0 = time.monotonic()
        while len(self.started) < n:
            assert time.monotonic() - t0 < timeout
            time.sleep(0.005)


def test_jobs_tracked_independently(tier):
    m, buf = tier()
    orig = buf.copy()
    ka, kb = keys_for(4, salt=1), keys_for(4, salt=2)
    m.submit_store(TransferJob("sa", ka, [0, 1, 2, 3]))
    m.submit_store(TransferJob("sb", kb, [4, 5, 6, 7]))
    assert m.drain_jobs(30)
    assert sorted(r.job_id for r in m.get_finished_jobs() if r.success) == ["sa", "sb"]
    os.unlink(m.file_mapper.get_file_name(kb[0]))
    buf[:] = 0
    m.submit_load(TransferJob("la", ka, [8, 9, 10, 11]))
    m.submit_load(TransferJob("lb", kb, [12, 13, 14, 15]))
    assert m.drain_jobs(30)
    res = {r.job_id: r for r in m.get_finished_jobs()}
    assert res["la"].success and res["la"].successful_keys == tuple(ka)
    assert not res["lb"].success and res["lb"].successful_keys == ()
    assert np.array_equal(buf[8:12], orig[0:4])
    assert m.get_finished_jobs() == []


def test_job_ids_and_validation(tier, monkeypatch):
    m, _ = tier()
    gate = Gate(monkeypatch)
    k = keys_for(2)
    assert run(m, TransferJob(7, k, [0, 1]), load=False).success
    m.submit_load(TransferJob(7, k, [0, 1]))  # 7 was collected: free again
    with pytest.raises(ValueError, match="already in use"):
        m.submit_store(TransferJob(7, k, [2, 3]))
    gate.release.set()
    assert m.drain_jobs(30)
    assert [r.job_id for r in m.get_finished_jobs()] == [7]
    bad = [
        (TransferJob(1, k, [0]), ValueError),
        (TransferJob(1, k, [0, NB]), ValueError),
        (TransferJob(1, k, [0, -1]), ValueError),
        (TransferJob(1, k, [0, 1.0]), TypeError),
        (TransferJob(1, [b"x", b"y"], [0, 1]), TypeError),
        (TransferJob([1], k, [0, 1]), TypeError),
        (TransferJob(1, k, [0, 1], is_promotion=True), ValueError),  # via submit_store
        ((1, k, [0, 1]), TypeError),
    ]
    for job, exc in bad:
        with pytest.raises(exc):
            m.submit_store(job)
    assert m.drain_jobs(1) and m.get_finished_jobs() == []
    # empty job: finishes at once
    m.submit_load(TransferJob(9, [], []))
    assert m.get_finished_jobs() == [JobResult(9, True, (), 0.0, 0, False, True)]


def test_duplicates_in_a_job_are_a_value_error_before_any_io(tmp_path, io_backend, monkeypatch):
    """Two loads into one row, or one key stored twice, in one job: ValueError naming the
    duplicate, raised by submit before any I/O (no batch call, no file, the row
    untouched) with the job id still free.  A load of one key into two rows and a store
    of one row under two keys are fine (both backends)."""
    calls = []

    def spy(real):
        return lambda *a, **kw: (calls.append(len(a[0])), real(*a, **kw))[1]

    monkeypatch.setattr(kio, "batch_store_block", spy(io_backend.batch_store_block))
    monkeypatch.setattr(kio, "batch_load_block", spy(io_backend.batch_load_block))
    buf = rand_buf()
    data = buf.copy()
    m = mk(buf, tmp_path / "c", checksum_blocks=True)
    try:
        k = keys_for(3)
        with pytest.raises(ValueError, match=r"store job 1: key .*ab.* twice \(blocks 0 and 2, file .*\.bin\)"):
            m.submit_store(TransferJob(1, [k[0], k[1], k[0]], [0, 1, 2]))
        assert calls == [] and not any(f.endswith(".bin") for _, _, fs in os.walk(tmp_path / "c") for f in fs)
        assert run(m, TransferJob(1, k, [0, 1, 2]), load=False).success  # the id is free
        assert calls == [3]
        with pytest.raises(ValueError, match=r"load job 2: blocks 1 and 2 .* both load into row 9 "
                                             r"\(byte offset 147456\): duplicate chunk_id"):
            m.submit_load(TransferJob(2, k, [8, 9, 9]))
        assert calls == [3] and np.array_equal(buf[8:10], data[8:10])
        assert m.drain_jobs(1) and m.get_finished_jobs() == []
        buf[10:12] = 0
        r = run(m, TransferJob(2, [k[1], k[1]], [10, 11]), load=True)  # one key into two rows
        assert r.success and np.array_equal(buf[10], data[1]) and np.array_equal(buf[11], data[1])
        k2 = keys_for(2, salt=4)
        assert run(m, TransferJob(3, k2, [5, 5]), load=False).success  # one row under two keys
        buf[12:14] = 0
        assert run(m, TransferJob(4, k2, [12, 13]), load=True).success
        assert np.array_equal(buf[12], data[5]) and np.array_equal(buf[13], data[5])
        assert calls == [3, 2, 2, 2]
    finally:
        m.shutdown()


def test_read_and_write_threads_steal(tier, monkeypatch):
    m, _ = tier(n_read_threads=1, n_write_threads=1)
    k = keys_for(2)
    assert run(m, TransferJob(0, k, [0, 1]), load=False).success
    gate = Gate(monkeypatch)
    m.submit_load(TransferJob(1, k[:1], [0]))
    m.submit_load(TransferJob(2, k[1:], [1]))
    gate.wait_started(2)  # both loads run at once: the write-priority thread took one
    assert sorted(gate.started) == ["kvtier_fs_r0", "kvtier_fs_w0"]
    gate.release.set()
    assert m.drain_jobs(30)
    assert sorted(r.job_id for r in m.get_finished_jobs() if r.success) == [1, 2]


def test_drain_waits_and_shutdown_discards_and_joins(tmp_path, monkeypatch):
    buf = rand_buf()
    m = mk(buf, tmp_path, n_read_threads=1, n_write_threads=1)
    k = keys_for(4)
    assert run(m, TransferJob(0, k, [0, 1, 2, 3]), load=False).success
    gate = Gate(monkeypatch)
    for j in range(4):
        m.submit_load(TransferJob(j + 1, [k[j]], [j]))
    gate.wait_started(2)
    assert m.drain_jobs(timeout=0.2) is False  # two jobs blocked, two queued
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("d", m.shutdown()))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # shutdown joins the threads, which still run jobs 1 and 2
    gate.release.set()
    t.join(10)
    assert not t.is_alive()
    assert sorted(out["d"]) == [3, 4]
    assert all(not th.is_alive() for th in m._threads)
    assert sorted(r.job_id for r in m.get_finished_jobs()) == [1, 2]
    assert m.drain_jobs(0.1)
    with pytest.raises(RuntimeError):
        m.submit_store(TransferJob(5, [k[0]], [0]))
    assert m.shutdown() == []  # idempotent


# ---------------------------------------------------------------- startup checks
def test_bad_config_raises_before_any_io(tmp_path):
    root = tmp_path / "never"
    buf = rand_buf()
    cases = [
        (dict(n_read_threads=0), ValueError),
        (dict(n_write_threads=-1), ValueError),
        (dict(n_read_threads=2.0), TypeError),
        (dict(block_size=BS * 2), ValueError),
        (dict(checksum_blocks="yes"), ValueError),
        (dict(checksum_blocks=1), TypeError),
        (dict(tp_size=0), ValueError),
    ]
    for kw, exc in cases:
        with pytest.raises(exc):
            FileSystemTierManager(buf, str(root), "m", **kw)
    with pytest.raises(ValueError, match="unknown .*'bogus'"):
        FileSystemTierManager.from_config(buf, {"root_dir": str(root), "model_name": "m", "bogus": 1})
    with pytest.raises(ValueError, match="1-D primary buffer needs block_size"):
        FileSystemTierManager(bytearray(100), str(root), "m")
    with pytest.raises(ValueError, match="whole number"):
        FileSystemTierManager(bytearray(100), str(root), "m", block_size=30)
    with pytest.raises(BufferError):
        FileSystemTierManager(rand_buf()[:, ::2], str(root), "m")
    with pytest.raises(TypeError):
        FileSystemTierManager(object(), str(root), "m")
    with pytest.raises(ValueError, match=r"^model_name must not contain a NUL byte: 'a\\x00b'$"):
        FileSystemTierManager(buf, str(root), "a\0b")
    with pytest.raises(ValueError, match=r"^root_dir must not contain a NUL byte"):
        FileSystemTierManager(buf, str(root) + "\0x", "m")
    assert not root.exists()
    m = FileSystemTierManager.from_config(buf, {"root_dir": str(root), "model_name": "m",
                                                "n_read_threads": 1, "n_write_threads": 1})
    m.shutdown()
    assert root.is_dir()


class _EmptyPath:  # an os.PathLike of ""
    def __fspath__(self) -> str:
        return ""


@pytest.mark.parametrize("root_dir", ["", _EmptyPath()], ids=["str", "pathlike"])
def test_an_empty_root_dir_is_a_value_error_not_the_working_directory(tmp_path, monkeypatch, root_dir):
    """root_dir="" was made absolute first: the tier silently used the working directory
    (config.json, kvtier.json and the rank directory made there). Now a ValueError naming
    root_dir, before any I/O."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^root_dir must not be empty"):
        FileSystemTierManager(rand_buf(), root_dir, "m", use_o_direct=False)
    with pytest.raises(ValueError, match=r"^root_dir must not be empty"):
        FileSystemTierManager.from_config(rand_buf(), {"root_dir": root_dir, "model_name": "m"})
    assert os.listdir(tmp_path) == []


def test_block_size_recorded_mismatch(tmp_path):
    with mk(rand_buf(), tmp_path):
        pass
    with pytest.raises(ValueError, match="block_bytes"):
        mk(rand_buf(bs=BS * 2), tmp_path)


def test_root_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(OSError) as ei:
        mk(rand_buf(), f / "sub")
    assert ei.value.errno == errno.ENOTDIR and ei.value.filename == str(f / "sub")


def test_read_only_root():
    with mount_tmpfs(size="1m", options=["ro"]) as target:
        with pytest.raises(OSError) as ei:
            mk(rand_buf(), target)
        assert ei.value.errno == errno.EROFS and ei.value.filename == str(target)
        assert str(target) in str(ei.value)


def test_full_root_at_startup_names_the_config_file():
    """A full disk passes the empty probe file but not config.json: one OSError
    ENOSPC naming that file (no chained write/close errors), no temp left."""
    with mount_tmpfs(size="64k") as target:
        fd = os.open(os.path.join(target, "fill"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with pytest.raises(OSError) as full:
                while True:
                    os.write(fd, b"\0" * 4096)
            assert full.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
        with pytest.raises(OSError) as ei:
            mk(rand_buf(), os.path.join(target, "kv"))
        e = ei.value
        assert e.errno == errno.ENOSPC and os.path.basename(e.filename) == "config.json"
        assert e.__suppress_context__ and e.__cause__ is None
        files = [f for d, _, fs in os.walk(os.path.join(target, "kv")) for f in fs]
        assert files == []


def test_xattr_less_root_with_checksums(ramfs_dir):
    target = ramfs_dir
    with pytest.raises(ValueError) as ei:
        mk(rand_buf(), target, checksum_blocks=True)
    msg = str(ei.value)
    assert "extended attributes" in msg and str(target) in msg and "ramfs" in msg
    # refused before anything was written into the root (no config.json, kvtier.json, probes)
    files = [os.path.join(d, f) for d, _, fs in os.walk(target) for f in fs]
    assert files == []


def test_root_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError) as ei:
        mk(rand_buf(), f)
    assert ei.value.errno == errno.ENOTDIR and ei.value.filename == str(f)
    assert f.read_bytes() == b"x"


def test_xattr_probe_false_message_names_fs_type(tmp_path, monkeypatch):
    monkeypatch.setattr(kio, "probe_xattr", lambda d: False)
    with pytest.raises(ValueError) as ei:
        mk(rand_buf(), tmp_path, checksum_blocks=True)
    fstype, _ = filesystem_type(tmp_path)
    assert "extended attributes" in str(ei.value) and fstype in str(ei.value) and str(tmp_path) in str(ei.value)


def test_o_direct_refused_falls_back_with_warning(ramfs_dir, caplog):
    # ramfs refuses O_DIRECT (tmpfs accepts it since Linux 6.6)
    target = ramfs_dir
    with caplog.at_level(logging.WARNING, logger="kvtier.manager"):
        m = mk(rand_buf(), target, checksum_blocks=False)  # ramfs: no user xattrs
    try:
        assert m.use_o_direct is False
        # the standalone manager's tier is kvtier's, not vLLM's "fs" tier
        msgs = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
        assert len(msgs) == 1 and msgs[0].endswith("using buffered I/O for the 1:kvtier tier"), msgs
        buf = m._primary
        orig = buf.copy()
        k = keys_for(4)
        assert run(m, TransferJob(1, k, [0, 1, 2, 3]), load=False).success
        buf[:4] = 0
        assert run(m, TransferJob(2, k, [0, 1, 2, 3]), load=True).success
        assert np.array_equal(buf[:4], orig[:4])
    finally:
        m.shutdown()


def test_bytes_written_counts_only_blocks_written(tmp_path):
    """Two tiers storing the same keys in one root: the second finds the files there
    and writes nothing; its bytes_written stays 0 and it counts the blocks as existing."""
    k = keys_for(4)
    with mk(rand_buf(), tmp_path) as a, mk(rand_buf(seed=1), tmp_path) as b:
        assert run(a, TransferJob(1, k, [0, 1, 2, 3]), load=False).success
        assert run(b, TransferJob(1, k + keys_for(1, salt=9), [0, 1, 2, 3, 4]), load=False).success
        sa, sb = a.metrics.counters.snapshot(), b.metrics.counters.snapshot()
    assert (sa["bytes_written"], sa["existing"]) == (4 * BS, 0)
    assert (sb["bytes_written"], sb["existing"]) == (1 * BS, 4)
    assert sb["store_jobs"] == 1 and sb["store_failures"] == 0


def test_filesystem_type_of_proc():
    assert filesystem_type("/proc/self") == ("proc", "/proc")


def test_torch_tensor_buffer(tmp_path):
    torch = pytest.importorskip("torch")
    t = torch.randn(4, 1024, dtype=torch.bfloat16)
    orig = t.clone()
    with mk(t, tmp_path) as m:
        assert m.block_size == 2048
        k = keys_for(4)
        assert run(m, TransferJob(1, k, [0, 1, 2, 3]), load=False).success
        t.zero_()
        assert run(m, TransferJob(2, k, [0, 1, 2, 3]), load=True).success
        assert torch.equal(t, orig)
    # same conversion as kvtier.io (kvtier._blockio.buffers.torch_bytes_view): row stride = block
    with pytest.raises(BufferError, match="C-contiguous"):
        mk(torch.zeros(1024, 4, dtype=torch.bfloat16).t(), tmp_path / "nc")
    with pytest.raises(ValueError, match="does not match"):
        mk(torch.zeros(4, 1024, dtype=torch.bfloat16), tmp_path / "bs", block_size=4096)
    with pytest.raises(ValueError, match="needs block_size"):
        mk(torch.zeros(4096, dtype=torch.bfloat16), tmp_path / "1d")
    with mk(torch.zeros(4096, dtype=torch.bfloat16), tmp_path / "1d", block_size=2048) as m:
        assert (m.block_size, m.num_blocks) == (2048, 4)


# ---------------------------------------------------------------- DSA counters (issue 5 item 5)
DSA_SAMPLES = {
    "kvtier:dsa_descriptors_submitted_total",
    "kvtier:dsa_completed_on_device_total",
    "kvtier:dsa_cpu_redo_total",
    "kvtier:dsa_cpu_redo_by_status_total",
    "kvtier:dsa_page_fault_resumes_total",
    "kvtier:dsa_enqcmd_retries_total",
    "kvtier:dsa_wait_seconds_total",
    "kvtier:dsa_bytes_on_device_total",
    "kvtier:dsa_commit_bytes_on_device_total",
    "kvtier:dsa_commit_bytes_cpu_total",
    "kvtier:dsa_below_min_size_total",
    "kvtier:dsa_submit_failures_total",
    "kvtier:dsa_timeouts_total",
}

_DSA_ROUND_TRIP = r"""
import json, sys
import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
import kvtier, kvtier.dsa as dsa
from kvtier.manager import FileSystemTierManager, TransferJob

bs, n = 64 * 1024, 4  # above the 16 KiB DSA min size: CRCs go to the engine
buf = np.random.default_rng(7).integers(0, 256, (n, bs), dtype=np.uint8)
orig = buf.copy()
keys = [(bytes([i]) * 16, 0) for i in range(n)]
out = {"backend": kvtier.crc32c_backend}
with FileSystemTierManager(buf, sys.argv[1], "test/model", n_read_threads=1, n_write_threads=1,
                           checksum_blocks=True) as m:
    m.submit_store(TransferJob("s", keys, list(range(n))))
    assert m.drain_jobs(30)
    out["store_ok"] = [r.success for r in m.get_finished_jobs()]
    dsa.inject("stale_reserved", count=1)  # one descriptor refused (NOZERO_RESERVE): redone on the CPU
    buf[:] = 0
    m.submit_load(TransferJob("l", keys, list(range(n))))
    assert m.drain_jobs(30)
    out["load_ok"] = [r.success for r in m.get_finished_jobs()]
    out["bytes_equal"] = bool((buf == orig).all())
    text = generate_latest(m.metrics.registry).decode()
    c = dsa.counters()
out["counters"] = c
out["samples"] = [[s.name, s.labels, s.value] for fam in text_string_to_metric_families(text)
                  for s in fam.samples if s.name.startswith("kvtier:dsa_")]
print(json.dumps(out))
"""


def test_dsa_model_counters_exported_by_the_tier(tmp_path):
    if kvtier._C is None:
        pytest.skip("the DSA path needs the C core")
    env = dict(os.environ, KVTIER_CRC32C_BACKEND="dsa-model")
    env.pop("KVTIER_DSA", None)
    p = subprocess.run([sys.executable, "-c", _DSA_ROUND_TRIP, str(tmp_path / "cache")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["backend"] == "dsa-model"
    assert out["store_ok"] == [True] and out["load_ok"] == [True] and out["bytes_equal"]
    c = out["counters"]
    samples = {}
    for name, labels, value in out["samples"]:
        samples.setdefault(name, []).append((labels, value))
    assert set(samples) == DSA_SAMPLES
    for name, rows in samples.items():  # the model is never reported as "dsa"
        assert all(lb["backend"] == "dsa-model" and lb["tier"] == "1:kvtier" for lb, _ in rows), name

    def one(name):
        (row,) = samples[name]
        assert set(row[0]) == {"backend", "tier"}
        return row[1]

    assert one("kvtier:dsa_completed_on_device_total") > 0
    assert one("kvtier:dsa_completed_on_device_total") == c["completed_on_device"]
    assert one("kvtier:dsa_descriptors_submitted_total") == c["descriptors_submitted"]
    assert one("kvtier:dsa_cpu_redo_total") == c["cpu_redo_total"] == 1
    assert one("kvtier:dsa_timeouts_total") == c["timeouts"] == 0  # no stalled descriptor here
    assert one("kvtier:dsa_page_fault_resumes_total") == c["page_fault_resumes"]
    assert one("kvtier:dsa_enqcmd_retries_total") == c["enqcmd_retries"]
    assert one("kvtier:dsa_bytes_on_device_total") == c["bytes_on_device"] > 0
    # the load's commit copies were COPY_CRC ops, the refused one counted as CPU bytes, not offloaded
    assert one("kvtier:dsa_commit_bytes_on_device_total") == c["commit_bytes_on_device"] == 3 * 64 * 1024
    assert one("kvtier:dsa_commit_bytes_cpu_total") == c["commit_bytes_cpu"] == 64 * 1024
    assert one("kvtier:dsa_wait_seconds_total") == pytest.approx(c["wait_ns"] / 1e9)
    assert samples["kvtier:dsa_cpu_redo_by_status_total"] == [
        ({"backend": "dsa-model", "tier": "1:kvtier", "status": "nozero_reserve"}, 1.0)]
    assert c["cpu_redo_by_status"] == {"nozero_reserve": 1}


def test_no_dsa_metrics_with_the_default_backend(tier):
    if kvtier.crc32c_backend in ("dsa", "dsa-model"):
        pytest.skip("this process runs a DSA CRC backend")
    reg = CollectorRegistry()
    m, _ = tier(checksum_blocks=True, registry=reg)
    keys = keys_for(2)
    assert run(m, TransferJob(1, keys, [0, 1]), load=False).success
    assert run(m, TransferJob(2, keys, [0, 1]), load=True).success
    names = {mf.name for mf in reg.collect()}
    assert "vllm:kv_offload_tiering_read_bytes" in names  # the scrape itself works
    assert not [n for n in names if n.startswith("kvtier:dsa_")]


def test_bool_chunk_id_is_refused(tier):
    """chunk_ids are ints, as kvtier.io's offsets: True is a TypeError, nothing queued."""
    m, _ = tier()
    with pytest.raises(TypeError, match="^chunk_ids must be ints, got bool$"):
        m.submit_store(TransferJob(1, [(b"\x01" * 32, 0)], [True]))
    assert m.drain_jobs(5) and m.get_finished_jobs() == []


def test_root_under_a_regular_file_is_not_a_directory_error(tmp_path):
    """A root below a regular file: NotADirectoryError naming the root, 'cannot be
    created' (not 'not writable'); nothing created."""
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError) as ei:
        FileSystemTierManager(rand_buf(), str(f / "sub"), "m")
    assert ei.value.errno == errno.ENOTDIR and ei.value.filename == str(f / "sub")
    assert "tier root cannot be created: Not a directory" in str(ei.value)
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_prepare_root_retries_enoent_of_a_name_cache(tmp_path, monkeypatch):
    """A directory just made that the filesystem answers ENOENT for (GlusterFS's name cache,
    seen on a second node) is retried after 2, 4 ... ms; persistent ENOENT fails naming the root."""
    import tempfile as tf
    from kvtier._blockio import policy
    from kvtier._tier import startup

    real, calls = tf.mkstemp, []

    def flaky(*a, **kw):
        calls.append(kw.get("dir"))
        if len(calls) <= 2:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", kw.get("dir"))
        return real(*a, **kw)

    monkeypatch.setattr(startup.tempfile, "mkstemp", flaky)
    root = str(tmp_path / "root")
    startup.prepare_root(root, os.path.join(root, "r0"), False)
    assert len(calls) == 3 and os.listdir(os.path.join(root, "r0")) == []  # the probe removed

    calls.clear()
    monkeypatch.setattr(startup.tempfile, "mkstemp",
                        lambda *a, **kw: calls.append(1) or (_ for _ in ()).throw(
                            FileNotFoundError(errno.ENOENT, "No such file or directory", kw.get("dir"))))
    monkeypatch.setattr(startup.time, "sleep", lambda s: None)
    with pytest.raises(OSError) as ei:
        startup.prepare_root(root, os.path.join(root, "r0"), False)
    assert ei.value.errno == errno.ENOENT and ei.value.filename == root
    assert len(calls) == policy.RETRY_ENOENT_STORE + 1


@pytest.mark.parametrize("err", [errno.EEXIST, errno.ESTALE])
def test_prepare_root_retries_eexist_of_a_directory_not_shown_yet(tmp_path, monkeypatch, err):
    """Two nodes making the rank directory at once: this node's mkdir answers EEXIST but
    its stat does not show the directory yet (GlusterFS), so os.makedirs raises
    FileExistsError: retried as ENOENT is, and the root is prepared."""
    from kvtier._tier import startup

    real, calls = os.makedirs, []

    def racing(path, *a, **kw):
        calls.append(path)
        if path.endswith("r0") and calls.count(path) == 1:
            raise OSError(err, os.strerror(err), path)
        return real(path, *a, **kw)

    monkeypatch.setattr(startup.os, "makedirs", racing)
    root = str(tmp_path / "root")
    startup.prepare_root(root, os.path.join(root, "r0"), False)
    assert calls.count(os.path.join(root, "r0")) == 2 and os.listdir(os.path.join(root, "r0")) == []


def test_drain_jobs_timeout_is_checked(tmp_path):
    """A timeout that is not a number of seconds is a clear TypeError / ValueError
    (not one from deep inside threading)."""
    with FileSystemTierManager(bytearray(4 * 4096), tmp_path, "m", block_size=4096) as m:
        for bad, exc in (("a", TypeError), (True, TypeError), (-1, ValueError), (float("nan"), ValueError)):
            with pytest.raises(exc, match="timeout"):
                m.drain_jobs(bad)
        assert m.drain_jobs(0) and m.drain_jobs(None) and m.drain_jobs(1)


# ---------------------------------------------------------------- shutdown frees the tier
def test_shutdown_frees_buffer_and_metrics_label(tmp_path, io_backend, monkeypatch):
    """After shutdown() the caller's mmap can be closed (no export left by the tier, its
    engine, a finished job's error or the registry) and the tier label is free again on
    the registry: a new tier with the same tier_idx registers; data stored survive."""
    import gc
    import mmap

    monkeypatch.setattr(kio, "batch_store_block", io_backend.batch_store_block)
    monkeypatch.setattr(kio, "batch_load_block", io_backend.batch_load_block)
    reg = CollectorRegistry()
    mm = mmap.mmap(-1, NB * BS)
    mm[:] = rand_buf().tobytes()
    keys = keys_for(4)
    t = FileSystemTierManager(memoryview(mm), str(tmp_path / "c"), "test/model", block_size=BS,
                              n_read_threads=2, n_write_threads=2, checksum_blocks=True,
                              registry=reg, io_timeout_s=0)
    assert run(t, TransferJob(1, keys, [0, 1, 2, 3]), load=False).success
    bad = run(t, TransferJob(2, keys_for(1, salt=9), [5]), load=True)  # a miss: an error held
    assert bad.error is not None and bad.error.errno == errno.ENOENT
    t.submit_store(TransferJob(3, keys_for(2, salt=5), [6, 7]))
    t.shutdown()
    assert reg.get_sample_value(M.WRITE_BYTES + "_total", {"tier": "1:kvtier"}) is None
    with pytest.raises(RuntimeError):
        t.submit_load(TransferJob(4, keys, [0, 1, 2, 3]))
    del t
    gc.collect()
    mm.close()  # BufferError while anything still exports the mmap
    buf = np.zeros((NB, BS), dtype=np.uint8)
    t2 = FileSystemTierManager(buf, str(tmp_path / "c"), "test/model", n_read_threads=2,
                               n_write_threads=2, checksum_blocks=True, registry=reg, io_timeout_s=0)
    try:
        assert run(t2, TransferJob(1, keys, [0, 1, 2, 3]), load=True).success
        assert buf[:4].tobytes() == rand_buf()[:4].tobytes()
        assert reg.get_sample_value(M.READ_BYTES + "_total", {"tier": "1:kvtier"}) == 4 * BS
    finally:
        t2.shutdown()


def test_shutdown_nowait_keeps_buffer_while_io_runs(tmp_path, monkeypatch):
    """shutdown(wait=False) while a store's I/O call is still running (as if stuck in its
    write syscall): the buffer stays exported (mmap.close() refused) until that call
    returns; then it is freed and the block stored."""
    import gc
    import mmap

    real = kio.batch_store_block
    entered, go = threading.Event(), threading.Event()

    def gated(*a, **kw):
        entered.set()
        assert go.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(kio, "batch_store_block", gated)
    mm = mmap.mmap(-1, NB * BS)
    mm[:] = rand_buf().tobytes()
    t = FileSystemTierManager(memoryview(mm), str(tmp_path / "c"), "test/model", block_size=BS,
                              n_read_threads=1, n_write_threads=1, io_timeout_s=0)
    keys = keys_for(2)
    t.submit_store(TransferJob(1, keys, [0, 1]))
    assert entered.wait(30)
    threads = list(t._engine.threads)
    t.shutdown(wait=False)
    del t
    gc.collect()
    with pytest.raises(BufferError):
        mm.close()  # the running call still reads the buffer
    go.set()
    for th in threads:
        th.join(30)
        assert not th.is_alive()
    gc.collect()
    mm.close()
    p = FileSystemTierManager(np.zeros((NB, BS), np.uint8), str(tmp_path / "c"), "test/model",
                              n_read_threads=1, n_write_threads=1)
    try:
        assert all(p.lookup(keys))
    finally:
        p.shutdown()


def test_a_tier_used_in_a_forked_child_fails_fast(tmp_path):
    """A tier's threads stay in the parent across fork(): in the child, submit_store /
    submit_load / drain_jobs / lookup raise RuntimeError naming the parent's process at
    once (a queued job would never run, a drain would wait for nothing); the parent's tier
    is unaffected. The child reports what it saw in its exit status (a bit per call)."""
    buf = rand_buf(4)
    m = mk(buf, tmp_path / "cache")
    keys = keys_for(2)
    assert run(m, TransferJob("s", keys, [0, 1]), load=False).success
    want = f"created in process {os.getpid()}; a tier does not survive fork()"
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only os._exit
        code = 0
        try:
            calls = (lambda: m.submit_load(TransferJob("l", keys, [2, 3])),
                     lambda: m.submit_store(TransferJob("t", keys_for(1, salt=5), [0])),
                     lambda: m.drain_jobs(timeout=5), lambda: m.lookup(keys))
            for bit, call in enumerate(calls):
                t0 = time.monotonic()
                try:
                    call()
                except RuntimeError as e:
                    if want in str(e) and time.monotonic() - t0 < 1:
                        code |= 1 << bit
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0b1111
    # the parent's tier still works
    assert m.lookup(keys) == [True, True]
    r = run(m, TransferJob("l", keys, [2, 3]), load=True)
    assert r.success and np.array_equal(buf[2:4], buf[0:2])
    m.shutdown()


def test_every_failed_jobs_error_carries_its_keep(tmp_path):
    """error.num_succeeded is the kept prefix (len(successful_keys)) on every failed job, not
    only on the batch call's OSError: a load missing its block 2 keeps 2; a job refused while
    kvtier.json records another block size, and a store a bounded root drops at once, keep
    0 (their errors had no num_succeeded; a deadline's: tests/test_deadlines.py)."""
    buf = rand_buf()
    ks = keys_for(4)
    # the bound on its own root: with 4 blocks' bound, a census between the store of 3 and
    # their load would rightly evict them (the marks make room for the largest job seen)
    with mk(buf, tmp_path / "bounded", max_bytes=4 * BS) as m:
        r = run(m, TransferJob("big", keys_for(8, salt=1), list(range(8))), load=False)  # over the bound
        assert (r.success, r.successful_keys, r.error.errno, r.error.num_succeeded) == (False, (), errno.ENOSPC, 0)
    with mk(buf, tmp_path / "a") as m:
        assert run(m, TransferJob("s", ks[:2] + ks[3:], [0, 1, 3]), load=False).success
        r = run(m, TransferJob("l", ks, [8, 9, 10, 11]), load=True)  # block 2 was never stored
        assert (r.success, len(r.successful_keys), r.error.errno, r.error.num_succeeded) == (False, 2, errno.ENOENT, 2)
        info = os.path.join(m.file_mapper.base_path, "kvtier.json")
        with open(info, "w") as f:
            json.dump({"block_bytes": 2 * BS}, f)
        r = run(m, TransferJob("refused", ks[:2], [8, 9]), load=True)
        assert (r.success, r.successful_keys, r.error.errno, r.error.num_succeeded) == (False, (), errno.EINVAL, 0)


def test_a_bad_load_landing_environment_is_refused_before_any_io(tmp_path, monkeypatch):
    """KVTIER_LOAD_LANDING (read when load_landing is "auto") is checked with the arguments:
    a ValueError naming it, and nothing made (the root, config.json, kvtier.json and the
    rank directory were made first). The tier key, when not "auto", decides alone."""
    root = tmp_path / "never"
    monkeypatch.setenv("KVTIER_LOAD_LANDING", "junk")
    with pytest.raises(ValueError, match=r"^KVTIER_LOAD_LANDING must be one of auto, direct, bounce, not 'junk'$"):
        mk(rand_buf(), root)
    with pytest.raises(ValueError, match=r"^KVTIER_LOAD_LANDING must be one of"):
        FileSystemTierManager.from_config(rand_buf(), {"root_dir": str(root), "model_name": "m"})
    assert not root.exists()
    with mk(rand_buf(), root, load_landing="bounce") as m:
        assert m.load_landing == "bounce"
    monkeypatch.setenv("KVTIER_LOAD_LANDING", " Bounce ")
    with mk(rand_buf(), root) as m:
        assert (m.load_landing, m.load_landing_why) == ("bounce", "KVTIER_LOAD_LANDING=bounce")


@pytest.mark.parametrize("content, what", [
    (b"[1, 2]", "holds a JSON array, not an object"),
    (b'"16384"', "holds a JSON string, not an object"),
    (b"{}", "has no block_bytes"),
    (b'{"block_bytes": "16384"}', 'records block_bytes="16384" (a JSON string), not a positive integer'),
    (b'{"block_bytes": 16384.0}', "records block_bytes=16384.0 (a JSON number), not a positive integer"),
    (b'{"block_bytes": true}', "records block_bytes=true (a JSON boolean), not a positive integer"),
    (b'{"block_bytes": -1}', "records block_bytes=-1 (a JSON number), not a positive integer"),
], ids=["array", "string", "empty", "str", "float", "bool", "negative"])
def test_a_kvtier_json_without_a_block_size_names_the_file_and_what_is_wrong(tmp_path, caplog, content, what):
    """A kvtier.json that is JSON but no record of a block size: at startup a ValueError naming
    the file and its fault (was: AttributeError "'list' object has no attribute 'get'", or
    "records block_bytes=16384, but this tier uses 16384-byte blocks" for the string); written
    while a tier runs, its jobs are refused (EINVAL) with that message and one error line, no
    traceback (the list escaped the check: a traceback per job, and the job ran)."""
    buf = rand_buf()
    with mk(buf, tmp_path) as m:
        info = os.path.join(m.file_mapper.base_path, "kvtier.json")
        assert run(m, TransferJob("s", keys_for(1), [0]), load=False).success
        with open(info, "wb") as f:
            f.write(content)
        with caplog.at_level(logging.ERROR):
            for j in range(3):
                r = run(m, TransferJob(j, keys_for(1), [1]), load=True)
                assert (r.success, r.error.errno, r.error.filename) == (False, errno.EINVAL, info)
                assert str(r.error).startswith(f"[Errno 22] job refused: {info} {what}: ")
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is None and what in errors[0].getMessage()
        assert m.metrics.counters.snapshot()["geometry_refused"] == 3
    with pytest.raises(ValueError) as ei:
        mk(buf, tmp_path)
    assert str(ei.value) == (f'{info} {what}: it records the tier\'s block size, {{"block_bytes": N}}; remove it '
                             f"to have it written again")


@pytest.mark.parametrize("where", ["root", "rank directory"])
def test_a_root_replaced_by_a_file_refuses_jobs_with_one_true_error_line(tmp_path, caplog, where):
    """The tier root (or its rank directory) replaced by a regular file while running: every
    job fails ENOTDIR, refused before any I/O, naming the file; the log has one error line
    saying so, no traceback, and the count is one loss (was: an ERROR and a traceback per job,
    242 lines for 20 jobs, saying 'a symlink swapped: another directory is there now ...
    recreating it' while a file was there and nothing was recreated). Once the file is gone
    the tier makes the root again and serves."""
    root = tmp_path / "cache"
    buf = rand_buf()
    with mk(buf, root) as m:
        assert run(m, TransferJob("s", keys_for(1), [0]), load=False).success
        if where == "root":
            shutil.rmtree(root)
            blocker = str(root)
        else:
            blocker = m.file_mapper.rank_path
            shutil.rmtree(blocker)
        with open(blocker, "w") as f:
            f.write("x")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            for j in range(20):
                r = run(m, TransferJob(j, keys_for(1, salt=j + 1), [1]), load=bool(j % 2))
                assert (r.success, r.error.errno, r.error.filename, r.error.num_succeeded) == (
                    False, errno.ENOTDIR, blocker, 0)
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is None, [rec.getMessage() for rec in caplog.records]
        msg = errors[0].getMessage()
        named = "" if where == "root" else f": {blocker!r}"
        assert msg == (f"tier root {str(root)!r} of the 1:kvtier tier{named} is a regular file now, not a directory "
                       f"(replaced while running): nothing recreated, jobs refused until a directory can be there "
                       f"again"), msg
        assert not any("Traceback" in rec.getMessage() or rec.exc_info for rec in caplog.records)
        assert len(caplog.records) == 3  # and one rate-limited line of each kind of failed job (load, store)
        with open(blocker) as f:
            assert f.read() == "x"  # nothing done to it
        assert m.metrics.counters.snapshot()["root_lost"] == 1
        os.unlink(blocker)
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert run(m, TransferJob("again", keys_for(1, salt=99), [2]), load=False).success
        assert [rec.getMessage() for rec in caplog.records] == [
            f"tier root {str(root)!r} of the 1:kvtier tier can be a directory again: made again with its rank "
            f"directory and config files"]
        assert os.path.isfile(os.path.join(m.file_mapper.base_path, "kvtier.json"))
        assert run(m, TransferJob("back", keys_for(1, salt=99), [3]), load=True).success
        assert np.array_equal(buf[3], buf[2])
        assert m.metrics.counters.snapshot()["root_lost"] == 1  # one loss


@pytest.mark.mount
@pytest.mark.parametrize("checksum", [True, False])
def test_a_tier_restarts_on_its_full_disk_and_serves_its_blocks(tmp_path, checksum):
    """A full filesystem (an ext4 loop image filled to ENOSPC) under a root that holds a
    tier's blocks: a new tier on it starts (the O_DIRECT probe's write answers ENOSPC:
    O_DIRECT is kept, the kernel took it for the file) and loads the blocks byte for byte,
    O_DIRECT; its stores fail with ENOSPC, counted, leaving no temp; `kvtier info ROOT`
    says the filesystem is full. (The constructor used to raise the probe's ENOSPC, without
    a path: a full cache never restarted; and info said only "writable: yes".)"""
    raw = mmap.mmap(-1, NB * BS)
    buf = np.frombuffer(raw, np.uint8).reshape(NB, BS)
    buf[:] = rand_buf()
    with mount_loop("ext4", size_mb=16) as d:
        root = os.path.join(d, "kv")
        with mk(buf, root, checksum_blocks=checksum) as m:
            assert m.use_o_direct
            assert run(m, TransferJob("s", keys_for(4), [0, 1, 2, 3]), load=False).success
        fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with pytest.raises(OSError) as full:
                while True:
                    os.write(fd, b"\0" * (1 << 20))
            assert full.value.errno == errno.ENOSPC
            while True:  # the last partial megabyte's worth, to the last block
                try:
                    os.write(fd, b"\0" * 4096)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break
        finally:
            os.close(fd)
        info = subprocess.run([sys.executable, "-m", "kvtier", "info", root], capture_output=True, text=True)
        assert info.returncode == 0, info.stderr
        assert ("  writable:     yes, but the filesystem is full (no free block or inode): every store fails with "
                "ENOSPC until room is made; a tier still starts and loads the blocks it has\n") in info.stdout
        d = json.loads(subprocess.run([sys.executable, "-m", "kvtier", "info", root, "--json"], capture_output=True,
                                      text=True, check=True).stdout)["root"]
        assert (d["writable"], d["filesystem"]["full"], d["filesystem"]["free_bytes"]) == (True, True, 0)
        out = np.frombuffer(mmap.mmap(-1, NB * BS), np.uint8).reshape(NB, BS)
        with mk(out, root, checksum_blocks=checksum) as m:
            assert m.use_o_direct
            r = run(m, TransferJob("l", keys_for(4), [4, 5, 6, 7]), load=True)
            assert r.success and np.array_equal(out[4:8], buf[0:4])
            r = run(m, TransferJob("s2", keys_for(2, salt=9), [0, 1]), load=False)
            assert (r.success, r.error.errno) == (False, errno.ENOSPC)
        left = [n for _, _, fs in os.walk(root) for n in fs if n.endswith(".tmp") or n.startswith(".kvtier_probe_")]
        assert left == []
