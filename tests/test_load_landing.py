"""The load landing (kvtier/_tier/landing.py, docs/block_io.md "Load landing"): landing="direct"
reads a block straight into the caller's row inside one commit section; the tier chooses
it per mount class (a local filesystem: direct; FUSE and other network/user-space ones:
bounce) with the tier key ``load_landing`` and ``KVTIER_LOAD_LANDING`` to override."""
from __future__ import annotations

import errno
import mmap
import os
import threading

import numpy as np
import pytest

from kvtier import io as kio
from kvtier._tier import landing

BS = 1 << 20


def aligned(n):
    """A page-aligned buffer of n bytes (as vLLM's primary: an mmap)."""
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


def stored(io, d, n, seed=1, checksum=True):
    data = aligned(n * BS)
    data[:] = np.random.default_rng(seed).integers(0, 256, n * BS, dtype=np.uint8)
    paths = [os.path.join(d, f"b{i}.bin") for i in range(n)]
    io.batch_store_block(paths, data, [i * BS for i in range(n)], BS, checksum=checksum)
    return data, paths


@pytest.mark.parametrize("use_o_direct", [True, False])
@pytest.mark.parametrize("checksum", [True, False])
def test_direct_landing_loads_the_right_bytes_and_counts_them(io_backend, tmp_path, use_o_direct, checksum):
    data, paths = stored(io_backend, str(tmp_path), 3, checksum=checksum)
    # block 1 at an odd offset: O_DIRECT into an unaligned row goes through the slots
    out = aligned(4 * BS)
    out[:] = 0x5A
    offs = [0, BS + 3, 3 * BS]
    js = kio.JobState()
    assert io_backend.batch_load_block(paths, out, offs, BS, use_o_direct=use_o_direct, checksum=checksum,
                                       job_state=js, landing="direct") == 0
    assert js.blocks_done == 3 and js.state == kio.LIVE
    for i, o in enumerate(offs):
        assert np.array_equal(out[o:o + BS], data[i * BS:(i + 1) * BS])
    assert (out[BS:BS + 3] == 0x5A).all() and (out[2 * BS + 3:3 * BS] == 0x5A).all()
    # without a job state too
    out2 = aligned(3 * BS)
    io_backend.batch_load_block(paths, out2, [i * BS for i in range(3)], BS, use_o_direct=use_o_direct,
                                checksum=checksum, landing="direct")
    assert np.array_equal(out2, data)


@pytest.mark.parametrize("use_o_direct", [True, False])
def test_direct_landing_checksum_failure_as_documented(io_backend, tmp_path, use_o_direct):
    """A flipped byte: EBADMSG, checksum_failed, the file removed, and the row holds the bytes
    its re-read got (the file's, corrupt), as with the bounce; the block before it whole."""
    data, paths = stored(io_backend, str(tmp_path), 2)
    with open(paths[1], "r+b") as f:
        f.seek(BS // 3)
        b = f.read(1)
        f.seek(BS // 3)
        f.write(bytes([b[0] ^ 0x10]))
    corrupt = data[BS:].copy()
    corrupt[BS // 3] ^= 0x10
    out = aligned(2 * BS)
    js = kio.JobState()
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block(paths, out, [0, BS], BS, use_o_direct=use_o_direct, checksum=True,
                                    job_state=js, landing="direct")
    e = ei.value
    assert e.errno == errno.EBADMSG and e.checksum_failed and e.num_succeeded == 1 and e.num_retried == 1
    assert not os.path.exists(paths[1]) and js.blocks_done == 1
    assert np.array_equal(out[:BS], data[:BS]) and np.array_equal(out[BS:], corrupt)


def test_landing_argument_is_checked(io_backend, tmp_path):
    data, paths = stored(io_backend, str(tmp_path), 1)
    out = aligned(BS)
    for bad in ("Direct", "", None, 1):
        with pytest.raises(ValueError, match="landing"):
            io_backend.batch_load_block(paths, out, [0], BS, landing=bad)
    assert not out.any()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_o_direct", [True, False])
def test_direct_landing_expired_at_random_writes_nothing_after_expire(io_backend, tmp_path, use_o_direct):
    """As test_late_io's random expiry, landing direct: once expire() returned, the row is
    what it was then; the count is num_succeeded; those blocks whole, the ones after the
    failing one untouched (expire waited for the block's read)."""
    from test_late_io import expire_at_random

    expire_at_random(io_backend, tmp_path, use_o_direct, n=32, tries=16, alloc=lambda n, dt: aligned(n),
                     landing="direct")


# ------------------------------------------------------------ the choice per mount


def test_mode_by_mount_class(tmpfs_dir, ext4_dir, monkeypatch):
    monkeypatch.delenv(landing.ENV, raising=False)
    assert landing.resolve("auto", tmpfs_dir)[0] == "direct"
    mode, why = landing.resolve("auto", ext4_dir)
    assert mode == "direct" and why.startswith("ext4")


def test_fuse_mount_bounces_by_default_and_the_late_load_writes_nothing(io_backend, ff, area, monkeypatch):
    """FUSE -> bounce; with the mode the tier chooses there, a load stalled in its read and
    expired leaves the row as it was at expire() (the read returns after)."""
    monkeypatch.delenv(landing.ENV, raising=False)
    mode, why = landing.resolve("auto", area)
    assert mode == "bounce" and "fuse" in why
    bs = 64 * 1024 + 4096
    view = np.random.default_rng(7).integers(0, 256, 2 * bs, dtype=np.uint8)
    paths = [os.path.join(area, f"b{i}.bin") for i in range(2)]
    io_backend.batch_store_block(paths, view, [0, bs], bs, checksum=True)
    ff.stall("read", "/" + os.path.relpath(paths[1], ff.mnt))
    out = np.zeros_like(view)
    js = kio.JobState()
    err = []

    def run():
        try:
            io_backend.batch_load_block(paths, out, [0, bs], bs, checksum=True, job_state=js, landing=mode)
        except OSError as e:
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    ff.wait_hits("stall_read", 1)
    assert js.expire() is True
    out[bs:] = 0x3C
    ff.clear()
    t.join(30)
    assert not t.is_alive() and isinstance(err[0], TimeoutError) and err[0].num_succeeded == 1
    assert np.array_equal(out[:bs], view[:bs]) and (out[bs:] == 0x3C).all()


def test_override_by_tier_key_and_environment(tmpfs_dir, monkeypatch):
    monkeypatch.delenv(landing.ENV, raising=False)
    assert landing.resolve("bounce", tmpfs_dir) == ("bounce", "load_landing=bounce")
    monkeypatch.setenv(landing.ENV, "bounce")
    assert landing.resolve("auto", tmpfs_dir) == ("bounce", "KVTIER_LOAD_LANDING=bounce")
    assert landing.resolve("direct", tmpfs_dir)[0] == "direct"  # the tier key wins
    monkeypatch.setenv(landing.ENV, "sometimes")
    with pytest.raises(ValueError, match="KVTIER_LOAD_LANDING must be one of auto, direct, bounce"):
        landing.resolve("auto", tmpfs_dir)
    with pytest.raises(ValueError, match="load_landing must be one of"):
        landing.resolve("fast", tmpfs_dir)


def test_the_tier_uses_the_mode_of_its_root(tmpfs_dir, monkeypatch):
    from kvtier.manager import FileSystemTierManager

    monkeypatch.delenv(landing.ENV, raising=False)
    primary = aligned(4 * BS)
    for key, want in (("auto", "direct"), ("bounce", "bounce")):
        m = FileSystemTierManager(primary, os.path.join(tmpfs_dir, key), "m", block_size=BS, load_landing=key,
                                  n_read_threads=1, n_write_threads=1)
        try:
            assert m.load_landing == want and m._engine.landing == want
        finally:
            m.shutdown()
    with pytest.raises(ValueError, match="load_landing"):
        FileSystemTierManager(primary, os.path.join(tmpfs_dir, "x"), "m", block_size=BS, load_landing="yes")


@pytest.mark.parametrize("use_o_direct", [True, False])
def test_direct_landing_judges_a_damaged_identity_record_by_the_crc_record(io_backend, tmp_path, use_o_direct):
    """Issue #24 item 2 on the direct landing: an identity record whose CRC bytes alone are
    damaged (user.vllm.kv_crc32c verifies the bytes) loads, nothing re-read, the file kept;
    a record of another length likewise; with the data changed too, condemned (checksum)."""
    from kvtier._blockio import records

    data, paths = stored(io_backend, str(tmp_path), 1)
    rec = os.getxattr(paths[0], records.ID_XATTR_NAME)
    for bad in (rec[:11] + bytes([rec[11] ^ 1]), rec[:8]):
        os.setxattr(paths[0], records.ID_XATTR_NAME, bad)
        out = aligned(BS)
        js = kio.JobState()
        counts = {}
        assert io_backend.batch_load_block(paths, out, [0], BS, use_o_direct=use_o_direct, checksum=True,
                                           job_state=js, landing="direct", counts=counts) == 0
        assert np.array_equal(out, data) and js.blocks_done == 1
        assert {k: v for k, v in counts.items() if v} == {}, counts
    os.setxattr(paths[0], records.ID_XATTR_NAME, rec[:11] + bytes([rec[11] ^ 1]))
    with open(paths[0], "r+b") as f:
        f.seek(7)
        f.write(bytes([data[7] ^ 0x20]))
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block(paths, aligned(BS), [0], BS, use_o_direct=use_o_direct, checksum=True,
                                    job_state=kio.JobState(), landing="direct")
    assert (ei.value.errno, ei.value.condemned) == (errno.EBADMSG, "checksum")
    assert not os.path.exists(paths[0])
