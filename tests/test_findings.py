"""Issue 13's findings, each as a test through the tier API (the I/O-level rules are walked
row by row in tests/test_policy.py): unverified loads counted and refused in strict mode,
scrub --strict / --adopt, non-regular files at block paths, several tiers on one
Prometheus registry, condemned blocks and I/O errors counted by cause, the tier root lost
while running, and vLLM's reader on a block with kvtier's identity record."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtier.manager import FileSystemTierManager, TransferJob
from kvtier.metrics import TieringMetricsTracker

ROOT = Path(__file__).resolve().parent.parent
BS = 8192
N = 6


def make_tier(root, checksum=True, registry=None, tier_idx=0, **kw):
    buf = np.zeros((N * 2, BS), dtype=np.uint8)
    t = FileSystemTierManager(buf, str(root), "m", block_size=BS, n_read_threads=1, n_write_threads=1,
                              checksum_blocks=checksum, registry=registry, tier_idx=tier_idx, **kw)
    return t, buf


def keys(n=N, base=0):
    return [((base + i).to_bytes(8, "big"), 0) for i in range(n)]


def run(t, job_id, ks, chunks, load):
    job = TransferJob(job_id, ks, chunks)
    (t.submit_load if load else t.submit_store)(job)
    assert t.drain_jobs(30)
    (r,) = t.get_finished_jobs()
    return r


def fill(buf, seed):
    buf[:N] = np.random.default_rng(seed).integers(0, 256, (N, BS), dtype=np.uint8)
    return buf[:N].copy()


def flip_byte(path, off=100):
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def samples(registry, name):
    """{labels tuple (sorted items without 'tier'): value} per tier of counter ``name``."""
    out = {}
    for fam in registry.collect():
        for s in fam.samples:
            if s.name == name + "_total":
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


# ---------------------------------------------------------------- finding 1

def test_copy_without_xattrs_loads_counted_unverified_strict_refuses_scrub_reports(tmp_path, caplog):
    """A cache copied without xattrs (shutil.copytree with copyfile, like cp -r or tar
    without --xattrs) then corrupted: with checksum_blocks=True the loads succeed but are
    counted as unverified with one warning; with "strict" they are misses and the files
    stay; kvtier scrub --strict exits 1; --adopt records checksums, after which strict
    loads verify."""
    src = tmp_path / "src"
    t, buf = make_tier(src)
    want = fill(buf, 1)
    assert run(t, "s", keys(), list(range(N)), False).success
    t.shutdown()
    copy = tmp_path / "copy"
    shutil.copytree(src, copy, copy_function=shutil.copyfile)  # no xattrs
    blocks = sorted(p for p in copy.rglob("*.bin"))
    assert len(blocks) == N
    with pytest.raises(OSError):
        os.getxattr(blocks[0], "user.vllm.kv_crc32c")
    flip_byte(blocks[0])

    t, buf = make_tier(copy)
    with caplog.at_level(logging.WARNING, logger="kvtier._tier.engine"):
        r1 = run(t, "l1", keys(), list(range(N, 2 * N)), True)
        r2 = run(t, "l2", keys(), list(range(N, 2 * N)), True)
    assert r1.success and r2.success  # unverified: the corruption goes unnoticed ...
    snap = t.metrics.counters.snapshot()
    assert snap["unverified"] == 2 * N  # ... but counted
    assert sum("without a CRC32C record" in r.getMessage() for r in caplog.records) == 1  # rate-limited
    reg = t.metrics.registry
    assert samples(reg, "kvtier:kv_offload_tiering_unverified_blocks")[
        (("outcome", "loaded"), ("tier", "1:kvtier"))] == 2 * N
    t.shutdown()

    t, buf = make_tier(copy, checksum="strict")
    with caplog.at_level(logging.WARNING, logger="kvtier._tier.engine"):
        caplog.clear()
        r = run(t, "l3", keys(), list(range(N, 2 * N)), True)
    assert not r.success and r.error.errno == errno.ENODATA and len(r.successful_keys) == 0
    (line,) = [rec.getMessage() for rec in caplog.records if "job 'l3'" in rec.getMessage()]
    assert f"no checksum record (strict: a miss, the file kept): '{blocks[0]}'" in line, line  # not "No data available"
    assert t.metrics.counters.snapshot()["unverified_miss"] == 1
    assert all(p.exists() for p in blocks)  # a miss keeps the file
    t.shutdown()

    cli = [sys.executable, "-m", "kvtier", "scrub", "--no-progress"]
    assert subprocess.run(cli + [str(copy)], capture_output=True).returncode == 0
    r = subprocess.run(cli + ["--strict", str(copy)], capture_output=True, text=True)
    assert r.returncode == 1 and f"{N} block(s) have no checksum" in r.stdout, r.stdout
    blocks[0].unlink()  # the corrupted one is not trusted: the operator removes it
    r = subprocess.run(cli + ["--adopt", "--strict", str(copy)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    assert f"adopted: {N - 1} block(s)" in r.stdout
    t, buf = make_tier(copy, checksum="strict")
    r = run(t, "l4", keys()[1:], list(range(N + 1, 2 * N)), True)
    assert r.success, r.error
    assert np.array_equal(buf[N + 1:2 * N], want[1:])
    t.shutdown()


# ---------------------------------------------------------------- finding 6

@pytest.mark.parametrize("kind", ["dir", "symlink", "fifo"])
def test_non_regular_file_at_block_path(tmp_path, kind):
    """A directory, symlink or FIFO at a block path: lookup is a miss; a store replaces it
    (symlink, FIFO) or fails (directory), never "stored"; the key is usable again."""
    t, buf = make_tier(tmp_path / "root")
    want = fill(buf, 6)
    (k,) = keys(1)
    p = t.file_mapper.get_file_names([k])[0]
    os.makedirs(os.path.dirname(p), exist_ok=True)
    target = tmp_path / "target.bin"
    target.write_bytes(b"t" * BS)
    {"dir": os.mkdir, "symlink": lambda q: os.symlink(target, q), "fifo": os.mkfifo}[kind](p)
    assert t.lookup([k]) == [False]
    r = run(t, "s", [k], [0], False)
    if kind == "dir":
        assert not r.success and r.error.errno == errno.EISDIR and r.transfer_bytes == 0
        assert t.lookup([k]) == [False] and os.path.isdir(p)
    else:
        assert r.success
        assert t.lookup([k]) == [True] and not os.path.islink(p)
        assert run(t, "l", [k], [N], True).success
        assert np.array_equal(buf[N], want[0])
        assert target.read_bytes() == b"t" * BS
    t.shutdown()


def test_lookup_is_a_miss_for_a_file_of_another_size(tmp_path):
    t, buf = make_tier(tmp_path / "root")
    fill(buf, 7)
    ks = keys(2)
    assert run(t, "s", ks, [0, 1], False).success
    os.truncate(t.file_mapper.get_file_names([ks[1]])[0], BS - 1)
    assert t.lookup(ks) == [True, False]
    t.shutdown()


# ---------------------------------------------------------------- finding 7

def test_two_tiers_share_one_registry(tmp_path):
    """Two tiers on one registry: both register (labels 1:kvtier and 2:kvtier), each counts its own
    traffic; a third with a label already there is refused before its root is created."""
    reg = CollectorRegistry()
    a, abuf = make_tier(tmp_path / "a", registry=reg, tier_idx=0)
    b, bbuf = make_tier(tmp_path / "b", registry=reg, tier_idx=1)
    fill(abuf, 8)
    fill(bbuf, 9)
    assert run(a, "s", keys(), list(range(N)), False).success
    assert run(b, "s", keys(2), [0, 1], False).success
    got = samples(reg, "vllm:kv_offload_tiering_write_bytes")
    assert got == {(("tier", "1:kvtier"),): N * BS, (("tier", "2:kvtier"),): 2 * BS}
    text = generate_latest(reg).decode()
    assert text.count("# TYPE vllm:kv_offload_tiering_write_bytes_total counter") == 1
    with pytest.raises(ValueError, match="already registered"):
        make_tier(tmp_path / "c", registry=reg, tier_idx=1)
    assert not (tmp_path / "c").exists()  # nothing created on disk
    b.shutdown()
    b.metrics.close()
    c, _ = make_tier(tmp_path / "c", registry=reg, tier_idx=1)  # the label is free again
    assert set(samples(reg, "vllm:kv_offload_tiering_write_bytes")) == {(("tier", "1:kvtier"),), (("tier", "2:kvtier"),)}
    a.shutdown()
    c.shutdown()


def test_trackers_on_the_default_registry(tmp_path):
    import prometheus_client

    ts = [TieringMetricsTracker(f"{i}:fs", registry=prometheus_client.REGISTRY) for i in (7, 8, 9)]
    try:
        text = generate_latest(prometheus_client.REGISTRY).decode()
        for i in (7, 8, 9):
            assert f'vllm:kv_offload_tiering_read_bytes_total{{tier="{i}:fs"}} 0.0' in text
    finally:
        for t in ts:
            t.close()
    assert 'tier="7:fs"' not in generate_latest(prometheus_client.REGISTRY).decode()


# ---------------------------------------------------------------- finding 9

def test_condemned_blocks_and_io_errors_by_cause(tmp_path):
    """Each cause lands in its own sample: a flipped byte (checksum), a block copied under
    another key (identity), a truncated file (size); a missing block is an I/O error of
    operation open, errno ENOENT; a directory at a block path one of stat, EISDIR."""
    t, buf = make_tier(tmp_path / "root")
    fill(buf, 10)
    ks = keys(4)
    assert run(t, "s", ks, [0, 1, 2, 3], False).success
    paths = t.file_mapper.get_file_names(ks)
    flip_byte(paths[0])
    os.unlink(paths[1])
    shutil.copy2(paths[3], paths[1])  # key 3's block and records under key 1's name
    os.truncate(paths[2], BS // 2)
    for i, k in enumerate(ks[:3]):
        r = run(t, f"l{i}", [k], [N], True)
        assert not r.success
    assert not any(os.path.exists(p) for p in paths[:3])
    missing = keys(1, base=100)
    assert not run(t, "m", missing, [N], True).success
    d = t.file_mapper.get_file_names(keys(1, base=200))[0]
    os.makedirs(d)
    assert not run(t, "d", keys(1, base=200), [N], True).success
    reg = t.metrics.registry
    cond = samples(reg, "kvtier:kv_offload_tiering_condemned_blocks")
    assert {dict(k)["cause"]: v for k, v in cond.items()} == {"checksum": 1, "identity": 1, "size": 1,
                                                              "short_read": 0}
    rereads = {dict(k)["cause"]: v for k, v in samples(reg, "kvtier:kv_offload_tiering_rereads").items()}
    assert rereads == {"checksum": 1, "identity": 1, "size": 1, "short_read": 0}
    errs = {(dict(k)["operation"], dict(k)["errno"]): v
            for k, v in samples(reg, "kvtier:kv_offload_tiering_io_errors").items()}
    assert errs == {("verify", "EBADMSG"): 2, ("verify", "EIO"): 1, ("open", "ENOENT"): 1,
                    ("stat", "EISDIR"): 1}
    assert samples(reg, "vllm:kv_offload_tiering_checksum_failures") == {(("tier", "1:kvtier"),): 2}
    t.shutdown()


# ---------------------------------------------------------------- store-side policy counters

def test_existing_durable_existing_and_replaced_are_exported(tmp_path):
    """A store of blocks already there counts them in ``existing`` (and, durable, in
    ``durable_existing``), a store over a file of another size in ``replaced``: each its own
    Prometheus family, with the name the vLLM adapter gives the same counter."""
    t, buf = make_tier(tmp_path / "root", durable=True)
    fill(buf, 14)
    ks = keys(4)
    assert run(t, "s1", ks[:3], [0, 1, 2], False).success
    os.truncate(t.file_mapper.get_file_names([ks[2]])[0], BS // 2)
    assert run(t, "s2", ks, [0, 1, 2, 3], False).success  # 2 there, 1 replaced, 1 new
    reg = t.metrics.registry
    tier = (("tier", "1:kvtier"),)
    got = {n: samples(reg, f"kvtier:kv_offload_tiering_{n}") for n in ("existing", "durable_existing", "replaced")}
    assert got == {"existing": {tier: 2}, "durable_existing": {tier: 2}, "replaced": {tier: 1}}
    assert samples(reg, "vllm:kv_offload_tiering_write_bytes") == {tier: 5 * BS}  # 3 + 2 written
    t.shutdown()


# ---------------------------------------------------------------- tier root lost

@pytest.mark.parametrize("how", ["deleted", "symlink_swapped"])
def test_tier_root_lost_while_running(tmp_path, how, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    link = tmp_path / "root"
    link.symlink_to(a)
    t, buf = make_tier(link)
    want = fill(buf, 11)
    assert run(t, "s1", keys(2), [0, 1], False).success
    config = sorted(p.relative_to(a) for p in a.rglob("*.json"))
    assert config  # config.json and kvtier.json
    if how == "deleted":
        shutil.rmtree(a)
        now = a
    else:
        link.unlink()
        link.symlink_to(b)
        now = b
    with caplog.at_level(logging.ERROR, logger="kvtier._tier.startup"):
        r = run(t, "s2", keys(2, base=10), [2, 3], False)
    assert r.success, r.error
    assert any("tier root" in rec.getMessage() and how.split("_")[0] in rec.getMessage()
               for rec in caplog.records), [rec.getMessage() for rec in caplog.records]
    assert sorted(p.relative_to(now) for p in now.rglob("*.json")) == config  # restored
    assert t.metrics.counters.snapshot()["root_lost"] == 1
    assert samples(t.metrics.registry, "kvtier:kv_offload_tiering_root_lost") == {(("tier", "1:kvtier"),): 1}
    assert run(t, "l", keys(2, base=10), [N, N + 1], True).success
    assert np.array_equal(buf[N:N + 2], want[2:4])
    assert list(now.rglob("*.tmp")) == [] and list(tmp_path.rglob("*.tmp")) == []
    assert run(t, "s3", keys(1, base=20), [4], False).success
    assert t.metrics.counters.snapshot()["root_lost"] == 1  # reported once
    t.shutdown()


# ---------------------------------------------------------------- vLLM's reader

@pytest.mark.vllm
def test_vllm_reader_loads_a_kvtier_block_with_both_records(tmp_path):
    """vLLM 0.33's fs tier io (its own C++ fs_io_C) reads a block kvtier stored with
    checksums on (CRC and identity xattrs) byte for byte; and kvtier reads a block vLLM
    stored (no xattrs) as unverified, or a miss in strict mode."""
    from kvtier import io as kio
    from kvtier.cli.peer import load_vllm_io

    from ci import unavailable

    (tmp_path / "stubs").mkdir()
    vio, note = load_vllm_io(str(tmp_path / "stubs"))
    if vio is None:
        unavailable(f"vLLM's fs tier io: {note}")
    bs = 64 * 1024
    src = np.random.default_rng(12).integers(0, 256, 2 * bs, dtype=np.uint8)
    p = str(tmp_path / "m_0123456789ab_r0" / "abc" / "de_g0" / "abcdef.bin")
    kio.batch_store_block([p], src, [0], bs, checksum=True)
    assert len(os.getxattr(p, "user.kvtier.id")) == 12 and len(os.getxattr(p, "user.vllm.kv_crc32c")) == 4
    out = np.zeros(2 * bs, dtype=np.uint8)
    vio.batch_load_block([p], memoryview(out), [0], bs, False)
    assert np.array_equal(out[:bs], src[:bs])
    q = str(tmp_path / "m_0123456789ab_r0" / "abc" / "de_g0" / "fedcba.bin")
    vio.batch_store_block([q], memoryview(src), [bs], bs, False)
    counts = {}
    assert kio.batch_load_block([q], out, [bs], bs, checksum=True, counts=counts) == 0
    assert np.array_equal(out[bs:], src[bs:]) and counts == {"unverified": 1}
    with pytest.raises(OSError) as ei:
        kio.batch_load_block([q], out, [bs], bs, checksum="strict")
    assert ei.value.errno == errno.ENODATA and os.path.exists(q)


def test_scrub_reports_a_block_stored_under_another_keys_name(tmp_path):
    """Finding 8 through scrub: a valid block + both xattrs copied over another key's path
    verifies its CRC; its identity record does not match: corrupt, removed with --remove."""
    t, buf = make_tier(tmp_path / "root")
    fill(buf, 13)
    ks = keys(2)
    assert run(t, "s", ks, [0, 1], False).success
    t.shutdown()
    a, b = t.file_mapper.get_file_names(ks)
    shutil.copy2(a, b)
    cli = [sys.executable, "-m", "kvtier", "scrub", "--no-progress", str(tmp_path / "root")]
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == 1 and "identity record" in r.stdout and b in r.stdout, r.stdout
    assert a not in r.stdout.split("\n", 3)[-1]  # the original is fine
    r = subprocess.run(cli + ["--remove"], capture_output=True, text=True)
    assert not os.path.exists(b) and os.path.exists(a)


def test_a_full_filesystem_logs_one_store_failure_a_minute_with_the_count_held_back(caplog):
    """Every store job fails on a full filesystem: one WARNING per interval (60 s) per tier,
    and the next one says how many were held back; before, one line per failed job (1,220
    lines in 20 s; issue #24 item 14)."""
    from mounts import mount_tmpfs

    with mount_tmpfs(size="256k") as root:
        t, buf = make_tier(root)
        fd = os.open(os.path.join(root, "fill"), os.O_CREAT | os.O_WRONLY)  # the rest of the filesystem
        with pytest.raises(OSError) as ei:
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        assert ei.value.errno == errno.ENOSPC
        fill(buf, 3)
        with caplog.at_level(logging.WARNING, logger="kvtier._tier.engine"):
            for i in range(20):
                r = run(t, f"s{i}", keys(1, base=i), [0], False)
                assert not r.success and r.error.errno == errno.ENOSPC
            lines = [rec.getMessage() for rec in caplog.records if "failed at block" in rec.getMessage()]
            assert len(lines) == 1 and lines[0].startswith("store job 's0' failed at block 0 of 1"), lines
            t._engine.warnings.interval = 0.0  # the interval has passed
            r = run(t, "s20", keys(1, base=20), [0], False)
        lines = [rec.getMessage() for rec in caplog.records if "failed at block" in rec.getMessage()]
        assert len(lines) == 2 and lines[1].startswith("store job 's20' failed at block 0 of 1"), lines
        assert lines[1].endswith("(and 19 more failed store job message(s) in the last %.0f s, not logged)"
                                 % float(lines[1].rsplit(" in the last ", 1)[1].split(" s,")[0])), lines[1]
        assert t.metrics.counters.snapshot()["store_failures"] == 21  # every failure still counted
        for i in range(3):  # held back, then told at shutdown
            assert not run(t, f"h{i}", keys(1, base=30 + i), [0], False).success
        t._engine.warnings.interval = 60.0
        with caplog.at_level(logging.WARNING, logger="kvtier._tier.engine"):
            caplog.clear()
            r = run(t, "h3", keys(1, base=33), [0], False)
            t.shutdown()
        assert [rec.getMessage() for rec in caplog.records] == [
            "1 more failed store job message(s) since the last one logged, not logged"]


def test_the_standalone_tier_with_every_default_refuses_a_flipped_byte(tmp_path):
    """FileSystemTierManager with only its required arguments checksums (as the vLLM tier):
    a block with one flipped byte is a failed load, not wrong bytes (it defaulted to
    checksum_blocks=False: the flipped byte loaded as success; issue #24 item 7)."""
    buf = np.zeros((N * 2, BS), dtype=np.uint8)
    t = FileSystemTierManager(buf, str(tmp_path), "m")
    try:
        assert t.checksum_blocks is True
        want = fill(buf, 5)
        assert run(t, "s", keys(), list(range(N)), False).success
        (bad,) = [p for p in tmp_path.rglob("*.bin") if p.stat().st_size == BS][:1]
        flip_byte(bad)
        r = run(t, "l", keys(), list(range(N, 2 * N)), True)
        assert not r.success and r.error.errno == errno.EBADMSG
        k = len(r.successful_keys)
        assert np.array_equal(buf[N:N + k], want[:k]) and not bad.exists()  # condemned after its re-read
    finally:
        t.shutdown()


def test_a_relative_root_is_resolved_once_a_later_chdir_moves_nothing(tmp_path, monkeypatch):
    """FileSystemTierManager(buf, "kv", ...) then os.chdir elsewhere: the blocks go under, and
    load from, the "kv" of the directory the tier started in (issue #24 item 9)."""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir(), other.mkdir()
    monkeypatch.chdir(first)
    t, buf = make_tier("kv")
    try:
        assert t.root_dir == str(first / "kv")
        monkeypatch.chdir(other)
        want = fill(buf, 6)
        assert run(t, "s", keys(), list(range(N)), False).success
        assert len(list((first / "kv").rglob("*.bin"))) == N and os.listdir(other) == []
        assert run(t, "l", keys(), list(range(N, 2 * N)), True).success
        assert np.array_equal(buf[N:2 * N], want)
        assert t.metrics.counters.snapshot()["root_lost"] == 0
    finally:
        t.shutdown()


def test_config_files_removed_under_a_running_tier_are_both_written_again(tmp_path):
    """config.json and kvtier.json gone while the tier runs, the directories still there (as
    after the tree was removed and made again by an in-flight store on inode numbers ext4
    reused, so the root's (dev, ino) did not change): the next job writes both back, with the
    same contents (issue #24 item 9: they were never written again)."""
    t, buf = make_tier(tmp_path)
    try:
        base = t.file_mapper.base_path
        files = {n: (Path(base) / n).read_bytes() for n in ("config.json", "kvtier.json")}
        for n in files:
            os.unlink(os.path.join(base, n))
        fill(buf, 7)
        assert run(t, "s", keys(), list(range(N)), False).success
        assert {n: (Path(base) / n).read_bytes() for n in files} == files
    finally:
        t.shutdown()
