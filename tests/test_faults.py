"""Storage faults injected by a FUSE filesystem (tests/fusefault): what kvtier
does with each, through kvtier.io (C core and fallback) and the tier manager.

fusefault passes a backing directory through and, per path, fails reads with
EIO or EBADMSG, flips a bit of the data a read returns (always, or only for
the first N reads: a transient corruption), cuts reads short, or fails
getxattr/setxattr. Every file is direct_io, so each read reaches the FS and
sees the fault; the rule counters prove that each fault really fired.
"""
from __future__ import annotations

import errno
import glob
import os

import numpy as np
import pytest

import kvtier
from kvtier import io as kio

pytestmark = pytest.mark.mount

BS = 300 * 1024 + 4096  # several FUSE read requests (128 KiB each) per block
XATTR = "user.vllm.kv_crc32c"


def view_of(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n * BS, dtype=np.uint8)


def paths_in(d, n):
    return [os.path.join(d, "m_0123456789ab_r0", "abc", f"{i:02x}_g0", f"{i:016x}.bin") for i in range(n)]


def rel(ff, path):
    return "/" + os.path.relpath(path, ff.mnt)


def store(io_backend, paths, view, checksum=True):
    io_backend.batch_store_block(paths, view, [i * BS for i in range(len(paths))], BS, checksum=checksum)


def load(io_backend, paths, out, checksum=True):
    return io_backend.batch_load_block(paths, out, [i * BS for i in range(len(paths))], BS, checksum=checksum)


def load_error(io_backend, paths, checksum=True):
    out = np.zeros(len(paths) * BS, dtype=np.uint8)
    with pytest.raises(OSError) as ei:
        load(io_backend, paths, out, checksum)
    return ei.value, out


def stats(io_backend):
    return kio.checksum_stats(io_backend.backend)


def test_passthrough_round_trip_and_xattr(io_backend, ff, area):
    view = view_of(3, 1)
    paths = paths_in(area, 3)
    store(io_backend, paths, view)
    for i, p in enumerate(paths):
        # the block and its record really live in the backing directory
        assert os.getxattr(ff.backing_of(p), XATTR) == kvtier.crc32c(view[i * BS:(i + 1) * BS]).to_bytes(4, "big")
    out = np.zeros_like(view)
    load(io_backend, paths, out)
    assert np.array_equal(out, view)
    assert ff.hits() == 0


@pytest.mark.parametrize("offset", [0, BS // 2 + 1, BS - 1])
def test_persistent_bit_flip_is_condemned(io_backend, ff, area, offset):
    """Every read of the byte returns it flipped: the first mismatch is
    retried once, the second condemns the block: EBADMSG, checksum_failed,
    file removed, one retry and one condemnation counted."""
    view = view_of(3, 2)
    paths = paths_in(area, 3)
    store(io_backend, paths, view)
    ff.add("flip", rel(ff, paths[1]), arg=offset, count=-1)
    before = stats(io_backend)
    err, out = load_error(io_backend, paths)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (errno.EBADMSG, True, 1)
    assert err.num_retried == 1  # this call's own count: the condemned block was re-read once
    assert os.fsdecode(err.filename) == paths[1]
    assert ff.hits("flip") == 2  # the first read and exactly one re-read
    assert not os.path.exists(ff.backing_of(paths[1]))  # condemned: removed
    assert os.path.exists(ff.backing_of(paths[0])) and os.path.exists(ff.backing_of(paths[2]))
    assert np.array_equal(out[:BS], view[:BS])
    after = stats(io_backend)
    assert after["checksum_retries"] - before["checksum_retries"] == 1
    assert after["checksum_condemned"] - before["checksum_condemned"] == 1


@pytest.mark.parametrize("offset", [0, BS - 1])
def test_transient_bit_flip_is_retried_once_and_loads(io_backend, ff, area, offset):
    """The byte is flipped on the first read only (bus/cable/controller
    glitch): the retry reads good data, the block loads, stays on disk, and a
    retry (not a condemnation) is counted."""
    view = view_of(2, 3)
    paths = paths_in(area, 2)
    store(io_backend, paths, view)
    ff.add("flip", rel(ff, paths[0]), arg=offset, count=1)
    before = stats(io_backend)
    out = np.zeros_like(view)
    retried = load(io_backend, paths, out)
    assert retried == 1  # blocks of this batch re-read after a mismatch
    assert np.array_equal(out, view)
    assert ff.rules()[0]["hits"] == 1 and ff.rules()[0]["left"] == 0
    assert os.path.exists(ff.backing_of(paths[0]))
    after = stats(io_backend)
    assert after["checksum_retries"] - before["checksum_retries"] == 1
    assert after["checksum_condemned"] == before["checksum_condemned"]
    # a clean load afterwards retries nothing
    assert load(io_backend, paths, out) == 0


def test_flip_without_checksums_goes_unnoticed(io_backend, ff, area):
    """Why checksums exist: with them off, the flipped byte is loaded."""
    view = view_of(1, 4)
    paths = paths_in(area, 1)
    store(io_backend, paths, view, checksum=False)
    ff.add("flip", rel(ff, paths[0]), arg=77, count=-1)
    out = np.zeros_like(view)
    load(io_backend, paths, out, checksum=False)
    assert ff.hits("flip") == 1
    assert out[77] == view[77] ^ 1
    assert np.array_equal(np.delete(out, 77), np.delete(view, 77))


@pytest.mark.parametrize("checksum", [True, False])
def test_read_eio_keeps_the_file(io_backend, ff, area, checksum):
    view = view_of(2, 5)
    paths = paths_in(area, 2)
    store(io_backend, paths, view, checksum=checksum)
    ff.add("eio", rel(ff, paths[1]), count=-1)
    before = stats(io_backend)
    err, out = load_error(io_backend, paths, checksum=checksum)
    assert (err.errno, err.checksum_failed, err.num_succeeded, err.num_retried) == (errno.EIO, False, 1, 0)
    assert ff.hits("eio") >= 1
    assert os.path.exists(ff.backing_of(paths[1]))  # an I/O error is not proof of a bad block
    assert stats(io_backend) == before  # neither retried nor condemned
    assert np.array_equal(out[:BS], view[:BS])
    ff.clear()  # the device recovers: the same file loads and verifies
    out2 = np.zeros_like(view)
    load(io_backend, paths, out2, checksum=checksum)
    assert np.array_equal(out2, view)


def test_filesystem_ebadmsg_keeps_file_and_is_not_a_checksum_failure(io_backend, ff, area):
    view = view_of(1, 6)
    paths = paths_in(area, 1)
    store(io_backend, paths, view)
    ff.add("ebadmsg", rel(ff, paths[0]), count=-1)
    before = stats(io_backend)
    err, _ = load_error(io_backend, paths)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (errno.EBADMSG, False, 0)
    assert ff.hits("ebadmsg") >= 1
    assert os.path.exists(ff.backing_of(paths[0]))
    assert stats(io_backend) == before


def test_short_read_is_eio_and_kept(io_backend, ff, area):
    """stat says block_size, the reads end at half: EIO, a miss; the file is kept, since
    its size is right (issue #24: a short read alone is no proof, design.md P6)."""
    view = view_of(1, 7)
    paths = paths_in(area, 1)
    store(io_backend, paths, view)
    ff.add("short", rel(ff, paths[0]), count=-1)
    err, _ = load_error(io_backend, paths)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (errno.EIO, False, 0)
    assert ff.hits("short") >= 1
    assert os.path.getsize(ff.backing_of(paths[0])) == BS  # design.md P6: short read -> kept


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
def test_getxattr_failure_keeps_the_file(io_backend, ff, area, code):
    view = view_of(1, 8)
    paths = paths_in(area, 1)
    store(io_backend, paths, view)
    ff.add("getxattr", rel(ff, paths[0]), arg=code, count=-1)
    err, _ = load_error(io_backend, paths)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (code, False, 0)
    assert ff.hits("getxattr") >= 1
    assert os.path.exists(ff.backing_of(paths[0]))
    # with checksums off the record is not read at all: the block loads
    out = np.zeros_like(view)
    load(io_backend, paths, out, checksum=False)
    assert np.array_equal(out, view)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_setxattr_failure_fails_store_and_leaves_nothing(io_backend, ff, area, code):
    view = view_of(3, 9)
    paths = paths_in(area, 3)
    ff.add("setxattr", rel(ff, paths[1]) + "_*.tmp", arg=code, count=-1)
    with pytest.raises(OSError) as ei:
        store(io_backend, paths, view)
    e = ei.value
    assert (e.errno, e.num_succeeded, e.checksum_failed, e.num_retried) == (code, 1, False, 0)
    assert os.fsdecode(e.filename) == paths[1]
    assert ff.hits("setxattr") == 1
    assert os.path.exists(ff.backing_of(paths[0]))
    assert not os.path.exists(ff.backing_of(paths[1]))
    assert glob.glob(os.path.join(ff.backing, "**", "*.tmp"), recursive=True) == []


def test_num_retried_counts_every_reread_block_of_a_failed_batch(io_backend, ff, area):
    """Block 0 flipped once (re-read, loads), block 1 flipped always (re-read,
    condemned): the OSError carries this call's count, 2, from C and Python."""
    view = view_of(3, 11)
    paths = paths_in(area, 3)
    store(io_backend, paths, view)
    ff.add("flip", rel(ff, paths[0]), arg=3, count=1)
    ff.add("flip", rel(ff, paths[1]), arg=9, count=-1)
    err, out = load_error(io_backend, paths)
    assert (err.errno, err.checksum_failed, err.num_succeeded, err.num_retried) == (errno.EBADMSG, True, 1, 2)
    assert type(err.num_retried) is int
    assert np.array_equal(out[:BS], view[:BS])
    assert os.path.exists(ff.backing_of(paths[0])) and not os.path.exists(ff.backing_of(paths[1]))


# ---------------------------------------------------------------- through the tier manager


def test_manager_counts_condemned_and_retried_blocks(ff, area):
    from prometheus_client import CollectorRegistry

    from kvtier.manager import FileSystemTierManager, TransferJob

    bs = 64 * 1024
    n = 4
    buf = np.random.default_rng(10).integers(0, 256, (n, bs), dtype=np.uint8)
    orig = buf.copy()
    reg = CollectorRegistry()
    keys = [(bytes([i]) * 16, 0) for i in range(n)]
    with FileSystemTierManager(buf, area, "test/model", n_read_threads=1, n_write_threads=1,
                               checksum_blocks=True, registry=reg) as m:
        def run(job, load):
            (m.submit_load if load else m.submit_store)(job)
            assert m.drain_jobs(timeout=30)
            (r,) = m.get_finished_jobs()
            return r

        assert run(TransferJob("s", keys, list(range(n))), load=False).success
        paths = m.file_mapper.get_file_names(keys)
        assert all(os.path.exists(ff.backing_of(p)) for p in paths)
        label = {"tier": "1:kvtier"}

        def metric(name):
            return reg.get_sample_value(name + "_total", label) or 0.0

        # 1. filesystem EBADMSG on block 0: a failed job, not a checksum failure
        ff.add("ebadmsg", "*/" + os.path.basename(paths[0]), count=-1)
        buf[:] = 0
        r = run(TransferJob("l1", keys, list(range(n))), load=True)
        assert not r.success and r.checksum_failed is False and r.successful_keys == ()
        assert r.checksum_retries == 0
        assert metric("vllm:kv_offload_tiering_checksum_failures") == 0
        assert metric("kvtier:kv_offload_tiering_checksum_retries") == 0
        assert metric("kvtier:kv_offload_tiering_checksum_condemned") == 0
        ff.clear()

        # 2. transient flip on block 1: loads, one retry exported, nothing condemned
        ff.add("flip", "*/" + os.path.basename(paths[1]), arg=5, count=1)
        buf[:] = 0
        r = run(TransferJob("l2", keys, list(range(n))), load=True)
        assert r.success and np.array_equal(buf, orig) and r.checksum_retries == 1
        assert metric("kvtier:kv_offload_tiering_checksum_retries") == 1
        assert metric("kvtier:kv_offload_tiering_checksum_condemned") == 0
        assert metric("vllm:kv_offload_tiering_checksum_failures") == 0
        ff.clear()

        # 3. persistent flip on block 2: partial keep of blocks 0-1, counted once
        ff.add("flip", "*/" + os.path.basename(paths[2]), arg=5, count=-1)
        buf[:] = 0
        r = run(TransferJob("l3", keys, list(range(n))), load=True)
        assert not r.success and r.checksum_failed is True
        assert list(r.successful_keys) == keys[:2]
        assert np.array_equal(buf[:2], orig[:2])
        assert r.checksum_retries == 1 and r.error.num_retried == 1  # re-read once, then condemned
        assert metric("vllm:kv_offload_tiering_checksum_failures") == 1
        assert metric("kvtier:kv_offload_tiering_checksum_retries") == 2
        assert metric("kvtier:kv_offload_tiering_checksum_condemned") == 1
        assert not os.path.exists(ff.backing_of(paths[2]))
        assert m.lookup(keys) == [True, True, False, True]


def test_checksum_counters_are_per_tier(ff, area):
    """Two tiers in one process: a transient flip in tier "1:kvtier" and a persistent
    one in tier "2:kvtier" are each counted by their own tier only (the process-wide
    kvtier.io.checksum_stats() would give both tiers the same numbers)."""
    from prometheus_client import CollectorRegistry

    from kvtier.manager import FileSystemTierManager, TransferJob

    bs = 64 * 1024
    n = 3
    keys = [(bytes([i]) * 16, 0) for i in range(n)]
    tiers = {}
    try:
        for idx in (0, 1):
            buf = np.random.default_rng(20 + idx).integers(0, 256, (n, bs), dtype=np.uint8)
            reg = CollectorRegistry()
            m = FileSystemTierManager(buf, os.path.join(area, f"t{idx}"), "test/model", n_read_threads=1,
                                      n_write_threads=1, checksum_blocks=True, registry=reg, tier_idx=idx)
            tiers[idx] = (m, buf, buf.copy(), reg)

        def run(m, job, load):
            (m.submit_load if load else m.submit_store)(job)
            assert m.drain_jobs(timeout=30)
            (r,) = m.get_finished_jobs()
            return r

        def metric(idx, name):
            _, _, _, reg = tiers[idx]
            return reg.get_sample_value(name + "_total", {"tier": f"{idx + 1}:kvtier"})

        for idx, (m, buf, orig, _) in tiers.items():
            assert run(m, TransferJob("s", keys, list(range(n))), load=False).success
        m0, buf0, orig0, _ = tiers[0]
        m1, buf1, orig1, _ = tiers[1]
        ff.add("flip", rel(ff, m0.file_mapper.get_file_name(keys[1])), arg=7, count=1)  # tier 1:kvtier, transient
        ff.add("flip", rel(ff, m1.file_mapper.get_file_name(keys[0])), arg=7, count=-1)  # tier 2:kvtier, persistent
        buf0[:] = 0
        buf1[:] = 0
        r0 = run(m0, TransferJob("l", keys, list(range(n))), load=True)
        r1 = run(m1, TransferJob("l", keys, list(range(n))), load=True)
        assert r0.success and np.array_equal(buf0, orig0) and r0.checksum_retries == 1
        assert not r1.success and r1.checksum_failed and r1.successful_keys == ()
        retries = "kvtier:kv_offload_tiering_checksum_retries"
        condemned = "kvtier:kv_offload_tiering_checksum_condemned"
        assert (metric(0, retries), metric(0, condemned)) == (1.0, 0.0)
        assert (metric(1, retries), metric(1, condemned)) == (1.0, 1.0)
        assert metric(0, "vllm:kv_offload_tiering_checksum_failures") == 0.0
        assert metric(1, "vllm:kv_offload_tiering_checksum_failures") == 1.0
        # a second transient flip, in tier 1:fs only: tier 2:fs does not move
        ff.clear()
        ff.add("flip", rel(ff, m0.file_mapper.get_file_name(keys[2])), arg=1, count=1)
        assert run(m0, TransferJob("l2", keys, list(range(n))), load=True).success
        assert metric(0, retries) == 2.0 and metric(1, retries) == 1.0
    finally:
        for m, *_ in tiers.values():
            m.shutdown()
