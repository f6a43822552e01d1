"""Issue #24: never delete a good block, never spin on a sick filesystem.

Each test here failed on e37af22 (the commit that carries it says how it was checked)
and passes with its fix. Faults: the LD_PRELOAD shim tests/c/io_fault.c (KVT_FAULT_*,
in a child process) and the FUSE fault filesystem tests/fusefault.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from test_block_io import build_preload, preload

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def io_fault(tmp_path_factory):
    return build_preload(tmp_path_factory, "io_fault")


def block_paths(d, n, group=0):
    return [os.path.join(str(d), "m_0123456789ab_r0", f"{i:03x}"[:3], f"{i % 256:02x}_g{group}", f"{i:016x}.bin")
            for i in range(n)]


def blocks_of(n, bs, seed):
    return np.random.default_rng(seed).integers(0, 256, n * bs, dtype=np.uint8)


# ---------------------------------------------------------------- item 1: transient short reads

_LOAD_EACH = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from kvtier import io
    spec = json.loads(sys.argv[1])
    assert io.backend == spec["backend"]
    bs = spec["bs"]
    out = np.zeros(bs, np.uint8)
    res = []
    for p in spec["paths"]:
        counts = {}
        try:
            io.batch_load_block([p], out, [0], bs, counts=counts, **spec["kw"])
            res.append({"ok": True, "sha": hashlib.sha256(out.tobytes()).hexdigest(), "counts": counts})
        except OSError as e:
            res.append({"ok": False, "errno": e.errno, "condemned": e.condemned, "counts": counts})
    print(json.dumps(res))
""")


def load_each_under_shim(io_backend, shim, d, paths, bs, env_extra, **kw):
    spec = {"backend": io_backend.backend, "paths": paths, "bs": bs, "kw": kw}
    env = dict(os.environ, LD_PRELOAD=preload(shim), KVT_FAULT_DIR=str(d), KVTIER_IO_BACKEND=io_backend.backend,
               **env_extra)
    r = subprocess.run([sys.executable, "-c", _LOAD_EACH, json.dumps(spec)], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("pct", [10, 30])
@pytest.mark.parametrize("checksum", [True, False])
def test_transient_short_reads_delete_no_good_block(io_backend, io_fault, tmp_path, pct, checksum):
    """100 good blocks, pct % of the preads return half their bytes and the next one on
    that fd EOF (fstat says the full size throughout): 0 blocks deleted, every load is
    either the block's bytes or a miss (EIO, kept)."""
    import hashlib

    bs, n = 256 * 1024, 100
    paths = block_paths(tmp_path, n)
    view = blocks_of(n, bs, pct)
    io_backend.batch_store_block(paths, view, [i * bs for i in range(n)], bs, checksum=checksum)
    res = load_each_under_shim(io_backend, io_fault, tmp_path, paths, bs,
                               {"KVT_FAULT_HALF_EOF": str(pct), "KVT_FAULT_SEED": "6"},
                               checksum=checksum, use_o_direct=False)
    deleted = [p for p in paths if not os.path.exists(p)]
    assert deleted == [], f"{len(deleted)} good blocks deleted"
    for i, r in enumerate(res):
        if r["ok"]:
            assert r["sha"] == hashlib.sha256(view[i * bs:(i + 1) * bs].tobytes()).hexdigest()
        else:
            assert (r["errno"], r["condemned"]) == (errno.EIO, None), r
    assert sum(r["counts"].get("reread_short", 0) for r in res) > 0  # the faults fired
    assert sum(r["ok"] for r in res) >= n // 2
    for p, i in zip(paths, range(n)):  # the files are intact
        assert Path(p).read_bytes() == view[i * bs:(i + 1) * bs].tobytes()


def test_short_read_on_every_open_is_a_miss_and_kept(io_backend, io_fault, tmp_path):
    """A short read on each of three opens (stat says the block size): EIO, a miss,
    the file kept (design.md P6); on two opens it loads."""
    bs = 3 * 4096
    [p] = block_paths(tmp_path, 1)
    view = blocks_of(1, bs, 1)
    io_backend.batch_store_block([p], view, [0], bs, checksum=True)
    [r] = load_each_under_shim(io_backend, io_fault, tmp_path, [p], bs, {"KVT_FAULT_ERRNO": "pread:0:2"},
                               checksum=True)
    assert r["ok"], r
    assert {k: v for k, v in r["counts"].items() if v} == {"reread_short": 2}
    [r] = load_each_under_shim(io_backend, io_fault, tmp_path, [p], bs, {"KVT_FAULT_ERRNO": "pread:0:-1"},
                               checksum=True)
    assert (r["ok"], r["errno"], r["condemned"]) == (False, errno.EIO, None), r
    assert {k: v for k, v in r["counts"].items() if v} == {"reread_short": 2}
    assert Path(p).read_bytes() == view.tobytes()


# ---------------------------------------------------------------- item 5: EAGAIN, io_uring

def _in_thread(fn, timeout):
    """fn() on a daemon thread; (finished, result or exception, seconds)."""
    import threading
    import time

    out = {}

    def run():
        t0 = time.monotonic()
        try:
            out["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["r"] = e
        out["t"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), out.get("r"), out.get("t")


@pytest.mark.mount
@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_eagain_from_the_filesystem_is_retried_3_times_then_a_miss(io_backend, ff, area, o_direct):
    """A filesystem answering EAGAIN to every read (fusefault): a 2 MiB load (O_DIRECT:
    the C core's io_uring path; buffered: the plain path) follows P2: 3 retries, then
    a miss with EAGAIN in about 7 ms, the file kept; the filesystem saw at most two
    reads per try (the ring's, refused or EAGAIN, then the plain path's), not a loop."""
    bs = 2 << 20
    [p] = block_paths(area, 1)
    view = blocks_of(1, bs, 5)
    io_backend.batch_store_block([p], view, [0], bs, checksum=True, use_o_direct=o_direct)
    ff.add("eagain", "/" + os.path.relpath(p, ff.mnt), count=-1)
    out = np.zeros(bs, np.uint8)
    counts = {}
    done, r, secs = _in_thread(lambda: io_backend.batch_load_block([p], out, [0], bs, checksum=True,
                                                                   use_o_direct=o_direct, counts=counts), 20)
    hits = ff.hits("eagain")
    ff.clear()
    assert done, f"the load is still running after 20 s ({hits} reads answered EAGAIN)"
    assert isinstance(r, OSError) and (r.errno, r.operation, r.condemned) == (errno.EAGAIN, "read", None), r
    assert counts.get("retry_eagain") == 3, counts
    assert 4 <= hits <= 8, hits
    assert secs < 5, secs
    assert Path(ff.backing_of(p)).read_bytes() == view.tobytes()


@pytest.mark.mount
@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_eagain_on_store_writes_is_retried_3_times_then_fails(io_backend, ff, area, o_direct):
    """Every write of the temp answers EAGAIN: a checksummed 2 MiB store (O_DIRECT: the C
    core's io_uring path) follows P3: 3 retries from the start, then EAGAIN; no temp
    left, nothing published; at most two writes reach the filesystem per try."""
    bs = 2 << 20
    [p] = block_paths(area, 1)
    ff.add("eagain", "/" + os.path.relpath(p, ff.mnt) + "_*.tmp", count=-1)
    view = blocks_of(1, bs, 6)
    counts = {}
    done, r, secs = _in_thread(lambda: io_backend.batch_store_block([p], view, [0], bs, checksum=True,
                                                                    use_o_direct=o_direct, counts=counts), 20)
    hits = ff.hits("eagain")
    ff.clear()
    assert done, f"the store is still running after 20 s ({hits} writes answered EAGAIN)"
    assert isinstance(r, OSError) and (r.errno, r.operation) == (errno.EAGAIN, "write"), r
    assert counts.get("retry_eagain") == 3, counts
    assert 4 <= hits <= 8, hits
    assert secs < 5, secs
    assert not os.path.exists(p)
    assert [f for f in os.listdir(os.path.dirname(ff.backing_of(p)))] == []


# ---------------------------------------------------------------- item 2: a damaged identity record

def _flip(b: bytes, bit: int) -> bytes:
    a = bytearray(b)
    a[bit // 8] ^= 1 << (bit % 8)
    return bytes(a)


DAMAGES = {
    "flip_identity_bit": lambda rec: _flip(rec, 13),
    "flip_crc_bit": lambda rec: _flip(rec, 8 * 8 + 3),
    "empty": lambda rec: b"",
    "8_bytes": lambda rec: rec[:8],
    "11_bytes": lambda rec: rec[:11],
    "13_bytes": lambda rec: rec + b"\0",
    "100_bytes": lambda rec: b"x" * 100,
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("checksum", [True, "strict"])
def test_good_block_with_a_damaged_identity_record_is_kept_and_loads(io_backend, tmp_path, damage, checksum):
    """A good block whose identity record alone is damaged (a flipped bit, a record of
    0/8/11/13/100 bytes) while its data and user.vllm.kv_crc32c agree: loads its bytes
    (verified by user.vllm.kv_crc32c, strict mode too), never deleted; scrub calls it ok
    with a note, not corrupt."""
    from kvtier._blockio import records
    from kvtier.cli.scrub import scrub

    bs = 3 * 4096
    [p] = block_paths(tmp_path, 1)
    view = blocks_of(1, bs, 2)
    io_backend.batch_store_block([p], view, [0], bs, checksum=True)
    rec = os.getxattr(p, records.ID_XATTR_NAME)
    assert len(rec) == records.ID_REC_LEN
    os.setxattr(p, records.ID_XATTR_NAME, DAMAGES[damage](rec))
    out = np.zeros(bs, np.uint8)
    counts = {}
    io_backend.batch_load_block([p], out, [0], bs, checksum=checksum, counts=counts)
    assert out.tobytes() == view.tobytes()
    assert {k: v for k, v in counts.items() if v} == {}, counts  # verified, nothing re-read
    assert Path(p).read_bytes() == view.tobytes()
    d = scrub(str(tmp_path), progress=False)
    assert d["counts"]["ok"] == 1 and d["counts"]["corrupt"] == 0, d
    [f] = d["findings"]
    assert "identity record user.kvtier.id is damaged" in f["detail"], f
    # the data changed too: neither record verifies it: condemned as before (P10)
    with open(p, "r+b") as fh:
        fh.seek(5)
        fh.write(bytes([view[5] ^ 0xFF]))
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block([p], out, [0], bs, checksum=checksum)
    assert (ei.value.errno, ei.value.condemned) == (errno.EBADMSG, "checksum")
    assert not os.path.exists(p)


def test_a_misplaced_block_is_still_condemned_for_identity(io_backend, tmp_path):
    """A block copied under another key's name carries a well-formed record of another
    identity (about 32 of 64 bits differ): still EBADMSG, condemned="identity" (P11)."""
    import shutil

    bs = 3 * 4096
    a, b = block_paths(tmp_path, 2)
    view = blocks_of(1, bs, 3)
    io_backend.batch_store_block([a], view, [0], bs, checksum=True)
    os.makedirs(os.path.dirname(b), exist_ok=True)
    shutil.copy2(a, b)
    out = np.zeros(bs, np.uint8)
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block([b], out, [0], bs, checksum=True)
    assert (ei.value.errno, ei.value.condemned) == (errno.EBADMSG, "identity")
    assert not os.path.exists(b) and os.path.exists(a)


# ---------------------------------------------------------------- item 3: two block sizes on one root

@pytest.mark.parametrize("checksum", [True, False])
def test_checksum_off_load_of_another_block_size_keeps_a_file_its_record_verifies(io_backend, tmp_path, checksum):
    """A file of another block size whose own CRC record verifies it (a block of another
    geometry) is kept by a load with checksums off as with them on (P8); one whose record
    does not verify it is condemned for its size (P7)."""
    bs = 64 * 1024
    a, b = block_paths(tmp_path, 2)
    view = blocks_of(2, bs, 4)
    io_backend.batch_store_block([a, b], view, [0, bs], bs, checksum=True)
    with open(b, "r+b") as f:  # b's bytes no longer match its records
        f.write(b"\0" * 10)
    out = np.zeros(bs // 2, np.uint8)
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block([a], out, [0], bs // 2, checksum=checksum)
    assert (ei.value.errno, ei.value.condemned) == (errno.EIO, None)
    assert "its own CRC record verifies all its bytes" in ei.value.strerror
    assert Path(a).read_bytes() == view[:bs].tobytes()
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block([b], out, [0], bs // 2, checksum=checksum)
    assert (ei.value.errno, ei.value.condemned) == (errno.EIO, "size")
    assert not os.path.exists(b)


_TIER_LOOP = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from kvtier.manager import FileSystemTierManager, TransferJob
    root, bs, seconds, go, checksum = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
    n = 32
    buf = np.random.default_rng(bs).integers(0, 256, (n, bs), dtype=np.uint8)
    m = FileSystemTierManager(buf, root, "m", checksum_blocks=checksum == "1", n_read_threads=2, n_write_threads=2)
    keys = [(i.to_bytes(16, "big"), 0) for i in range(n)]
    print("STARTED", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    t_end = time.monotonic() + seconds
    res = {"stored": 0, "loaded": 0, "failed": 0, "errnos": []}
    j = 0
    while time.monotonic() < t_end:
        j += 1
        m.submit_store(TransferJob(("s", j), keys, list(range(n))))
        m.submit_load(TransferJob(("l", j), keys, list(range(n))))
        m.drain_jobs(30)
        for r in m.get_finished_jobs():
            if r.success:
                res["stored" if r.job_id[0] == "s" else "loaded"] += 1
            else:
                res["failed"] += 1
                res["errnos"].append(getattr(r.error, "errno", None))
                res.setdefault("first_error", str(r.error))
    snap = m.metrics.counters.snapshot()
    res["counters"] = {k: v for k, v in snap.items() if k.startswith("condemned") or k in ("geometry_refused",)}
    m.shutdown()
    print("RESULT " + json.dumps(res), flush=True)
""")


def test_two_block_sizes_on_one_root_delete_nothing(tmp_path):
    """Two processes on the same paths, 64 KiB blocks without checksums and 32 KiB blocks
    with: the 64 KiB tier starts (its kvtier.json), kvtier.json is then removed and the 32
    KiB tier starts (writing its own): from its next job on the 64 KiB tier refuses every
    job (EINVAL, counted geometry_refused, nothing read or written) and neither condemns
    any block of the other: 0 deletions (e37af22: each condemned the other's blocks for
    their size)."""
    root = str(tmp_path / "root")
    go = str(tmp_path / "go")
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def start(bs, checksum):
        p = subprocess.Popen([sys.executable, "-c", _TIER_LOOP, root, str(bs), "4", go, checksum], env=env,
                             cwd=str(ROOT),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "STARTED", p.stderr.read()
        return p

    big = start(64 * 1024, "0")
    info = os.path.join(root, [d for d in os.listdir(root) if d.startswith("m_")][0], "kvtier.json")
    assert json.load(open(info)) == {"block_bytes": 64 * 1024}
    os.unlink(info)  # absent: the next tier on this root writes its own
    small = start(32 * 1024, "1")
    assert json.load(open(info)) == {"block_bytes": 32 * 1024}
    Path(go).touch()
    out = {}
    for name, p in (("big", big), ("small", small)):
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        out[name] = json.loads([ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    for name in out:
        assert all(v == 0 for k, v in out[name]["counters"].items() if k.startswith("condemned")), out
    assert out["big"]["counters"]["geometry_refused"] > 0 and out["big"]["stored"] == 0
    assert set(out["big"]["errnos"]) == {errno.EINVAL}, out["big"]
    # at most its first load, which ran beside its first store: ENOENT
    assert set(out["small"]["errnos"]) <= {errno.ENOENT} and out["small"]["loaded"] > 0, out["small"]
    blocks = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".bin")]
    assert len(blocks) == 32 and all(os.path.getsize(b) == 32 * 1024 for b in blocks)


# ---------------------------------------------------------------- item 4: the sweep's clock

def test_sweep_with_the_wall_clock_an_hour_ahead_keeps_a_temp_being_written(tmp_path, monkeypatch):
    """This host's wall clock an hour ahead of the filesystem's (NTP step, a node ahead of
    the shared filesystem's server): a temp just written is not stale by the filesystem's
    clock, so a starting tier's sweep keeps it and the store renames it; a temp that is old
    by the filesystem's clock (mtime two hours back) is removed."""
    import time

    from kvtier.manager import FileSystemTierManager

    root = tmp_path / "root"
    with FileSystemTierManager(np.zeros((1, 4096), np.uint8), str(root), "m", n_read_threads=1,
                               n_write_threads=1) as m:
        rank = m.file_mapper.rank_path
    live = os.path.join(rank, "abc", "de_g0", "abcdef0123456789.bin_00112233aabbccdd.tmp")
    os.makedirs(os.path.dirname(live))
    with open(live, "wb") as f:
        f.write(b"x" * 4096)  # a peer's store in progress: written just now
    old = os.path.join(rank, "abc", "de_g0", "abcdef0123456780.bin_00112233aabbccde.tmp")
    Path(old).write_bytes(b"y")
    t = time.time() - 2 * 3600
    os.utime(old, (t, t))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)  # this host's clock an hour ahead
    with FileSystemTierManager(np.zeros((1, 4096), np.uint8), str(root), "m", n_read_threads=1,
                               n_write_threads=1, sweep_stale_temps_after=600) as m:
        assert m.last_sweep.removed == [old], m.last_sweep
        assert m.last_sweep.kept_recent == 1 and m.last_sweep.errors == []
    assert os.path.exists(live) and not os.path.exists(old)
    os.rename(live, live[:-len("_00112233aabbccdd.tmp")])  # the peer's rename succeeds


def test_sweep_without_a_filesystem_clock_removes_nothing(tmp_path, monkeypatch):
    """No probe file can be made in the directory (read-only, EACCES, full): no clock to
    judge mtimes by: the error is recorded and nothing is removed."""
    import kvtier._tier.sweep as sw

    d = tmp_path / "t"
    d.mkdir()
    p = d / "aa.bin_01.tmp"
    p.write_bytes(b"x")
    os.utime(p, (0, 0))

    def refuse(_):
        raise PermissionError(errno.EACCES, "denied", str(d))
    monkeypatch.setattr(sw, "filesystem_now", refuse)
    res = sw.sweep_stale_temps(str(d), 60.0)
    assert res.removed == [] and [e.errno for _, e in res.errors] == [errno.EACCES]
    assert p.exists()


# ---------------------------------------------------------------- item 6: durable, directory fsync EIO

def test_durable_store_whose_directory_fsync_fails_then_a_later_durable_store_syncs_it(io_backend, io_fault,
                                                                                      tmp_path):
    """A durable store whose directory fsync after the rename fails (EIO): the store
    reports EIO (operation "sync"), the block is published (its data fdatasync'ed before
    the rename; its name maybe not durable: design.md P19). A later durable store of that
    key does not skip it as stored: it fsyncs the file and its directory first (counted
    durable_existing), and only then reports it stored."""
    from test_policy import child

    bs = 3 * 4096
    [p] = block_paths(tmp_path, 1)
    view = blocks_of(1, bs, 8)
    data = view.tobytes()
    r = child(io_backend, io_fault, tmp_path, "store", p, "fsync:5:-1", data=data, n=bs, durable=True)
    assert (r["ok"], r["errno"], r["op"]) == (False, errno.EIO, "sync"), r
    assert Path(p).read_bytes() == data  # published
    log = tmp_path / "fsyncs.log"
    r = child(io_backend, io_fault, tmp_path, "store", p, "fsync:4:1", data=data, n=bs, durable=True, log=log)
    assert r["ok"], r
    assert r["counts"].get("durable_existing") == 1 and r["counts"].get("existing") == 1, r
    synced = {ln.split("\t")[2] for ln in log.read_text().splitlines() if ln.startswith("fsync")}
    assert synced == {p, os.path.dirname(p)}, synced


_DURABLE_TIER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kvtier.manager import FileSystemTierManager, TransferJob
    root = sys.argv[1]
    buf = np.random.default_rng(1).integers(0, 256, (2, 4096), dtype=np.uint8)
    m = FileSystemTierManager(buf, root, "m", durable=True, checksum_blocks=True, n_read_threads=1,
                              n_write_threads=1)
    keys = [(b"\\x01" * 16, 0), (b"\\x01" * 15 + b"\\x02", 0)]  # one directory
    out = {}
    for step in ("first", "second"):
        m.submit_store(TransferJob(step, keys, [0, 1]))
        m.drain_jobs(30)
        [r] = m.get_finished_jobs()
        out[step] = [r.success, getattr(r.error, "errno", None), getattr(r.error, "operation", None),
                     m.lookup(keys)]
    out["durable_existing"] = m.metrics.counters.snapshot().get("durable_existing", 0)
    m.shutdown()
    print("RESULT " + json.dumps(out))
""")


def test_tier_lookup_misses_a_block_whose_durable_store_failed_until_a_store_syncs_it(io_fault, tmp_path):
    """Through the tier (durable=True): a store job whose directory fsync fails (EIO) is a
    failed job, and lookups answer that block as a miss (so the caller stores it again,
    instead of skipping a block not known durable); the next store job syncs it (file and
    directory, durable_existing) and from then on lookups find it."""
    from kvtier.manager import FileSystemTierManager

    root = tmp_path / "root"
    with FileSystemTierManager(np.zeros((2, 4096), np.uint8), str(root), "m", durable=True, checksum_blocks=True,
                               n_read_threads=1, n_write_threads=1) as m:
        rank = m.file_mapper.rank_path
    # faults only under the blocks' directory (<rank>/010/10_g0), not the startup's files:
    # its first fsync fails (EIO), then fsyncs work
    env = dict(os.environ, LD_PRELOAD=preload(io_fault), KVT_FAULT_DIR=os.path.join(rank, "010"),
               KVT_FAULT_DIRSYNC_EIO="1", KVT_FAULT_DIRSYNC_COUNT="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _DURABLE_TIER, str(root)], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert out["first"] == [False, errno.EIO, "sync", [False, False]], out
    assert out["second"] == [True, None, None, [True, True]], out
    assert out["durable_existing"] == 1, out
