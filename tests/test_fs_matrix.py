"""The core block I/O contract on each real filesystem kvtier meets.

Filesystems (each mounted fresh once for this module by tests/mounts.py and
removed after; skipped with mount(8)'s message where mounting is refused):

=============  =========================================================
ext4 (loop)    sparse 64 MiB image; O_DIRECT works, user xattrs in inode
xfs (loop)     sparse 300 MiB image (mkfs.xfs minimum); O_DIRECT works
tmpfs          user xattrs work; O_DIRECT only on Linux >= 6.6
tmpfs-small    tmpfs size=1m: stores hit ENOSPC
ramfs          no user xattrs (EOPNOTSUPP), O_DIRECT refused
=============  =========================================================

Every test body runs against the C core and the pure-Python fallback
(``io_backend`` fixture, tests/conftest.py).
"""
from __future__ import annotations

import errno
import glob
import os
import platform

import numpy as np
import pytest

import kvtier
from kvtier import io as kio
from mounts import mount_loop, mount_ramfs, mount_tmpfs
from corrupt import flip_bit

pytestmark = pytest.mark.mount

XATTR = "user.vllm.kv_crc32c"
FS_KINDS = ["ext4", "xfs", "tmpfs", "ramfs"]
HAS_XATTR = {"ext4": True, "xfs": True, "tmpfs": True, "ramfs": False}


def _kernel_at_least(major, minor):
    try:
        parts = platform.release().split(".")
        return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)
    except (ValueError, IndexError):
        return False


# O_DIRECT as the probe must report it (tmpfs gained O_DIRECT in Linux 6.6).
HAS_O_DIRECT = {"ext4": True, "xfs": True, "tmpfs": _kernel_at_least(6, 6), "ramfs": False}


@pytest.fixture(scope="module", params=FS_KINDS)
def fs(request):
    """(kind, mount point) for each filesystem, mounted once for the module."""
    kind = request.param
    if kind in ("ext4", "xfs"):
        cm = mount_loop(kind, size_mb=64)
    elif kind == "tmpfs":
        cm = mount_tmpfs()
    else:
        cm = mount_ramfs()
    with cm as d:
        yield kind, d


_counter = [0]


def fresh_dir(root):
    _counter[0] += 1
    d = os.path.join(root, f"t{_counter[0]}")
    os.makedirs(d)
    return d


def rand_view(n, bs, seed):
    return np.random.default_rng(seed).integers(0, 256, n * bs, dtype=np.uint8)


def paths_in(d, n):
    # FileMapper-shaped nested paths whose parents do not exist yet
    return [os.path.join(d, "m_0123456789ab_r0", f"{i:03x}", f"{i:02x}_g0", f"{i:016x}.bin") for i in range(n)]


def leftovers(d):
    return glob.glob(os.path.join(d, "**", "*.tmp"), recursive=True)



# ---------------------------------------------------------------- probes


def test_probes_match_the_filesystem(fs):
    kind, d = fs
    assert kio.probe_xattr(d) is HAS_XATTR[kind]
    assert kio.probe_o_direct(d) is HAS_O_DIRECT[kind]
    assert not [n for n in os.listdir(d) if n.startswith(".kvtier_probe")]


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("use_o_direct", [True, False])
@pytest.mark.parametrize("bs", [4096, 1024 * 1024 + 4096 + 17])
def test_round_trip(io_backend, fs, bs, use_o_direct):
    kind, root = fs
    d = fresh_dir(root)
    n = 3
    checksum = HAS_XATTR[kind]
    view = rand_view(n, bs, seed=bs + n)
    paths = paths_in(d, n)
    offs = [i * bs for i in range(n)]
    io_backend.batch_store_block(paths, view, offs, bs, use_o_direct=use_o_direct, checksum=checksum)
    assert io_backend.batch_lookup(paths) == [True] * n
    for i, p in enumerate(paths):
        assert os.path.getsize(p) == bs
        if checksum:
            assert os.getxattr(p, XATTR) == kvtier.crc32c(view[i * bs:(i + 1) * bs]).to_bytes(4, "big")
    out = np.zeros_like(view)
    io_backend.batch_load_block(paths, out, offs, bs, use_o_direct=use_o_direct, checksum=checksum)
    assert np.array_equal(out, view)
    assert leftovers(d) == []


@pytest.mark.parametrize("fs", [k for k in FS_KINDS if not HAS_XATTR[k]], indirect=True)  # ramfs
def test_checksum_store_without_xattrs_fails_cleanly(io_backend, fs):
    kind, root = fs
    d = fresh_dir(root)
    bs = 8192
    view = rand_view(2, bs, seed=1)
    paths = paths_in(d, 2)
    with pytest.raises(OSError) as ei:
        io_backend.batch_store_block(paths, view, [0, bs], bs, checksum=True)
    e = ei.value
    assert (e.errno, e.num_succeeded, e.checksum_failed) == (errno.EOPNOTSUPP, 0, False)
    assert not os.path.exists(paths[0]) and leftovers(d) == []
    # and a block stored without checksums there loads with checksums on: the
    # getxattr fails with EOPNOTSUPP, which is the filesystem's, not the block's
    io_backend.batch_store_block(paths[:1], view, [0], bs, checksum=False)
    out = np.zeros(bs, dtype=np.uint8)
    io_backend.batch_load_block(paths[:1], out, [0], bs, checksum=False)
    assert np.array_equal(out, view[:bs])
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block(paths[:1], out, [0], bs, checksum=True)
    assert (ei.value.errno, ei.value.checksum_failed) == (errno.EOPNOTSUPP, False)
    assert os.path.exists(paths[0])  # kept: not provably bad


# ---------------------------------------------------------------- corruption


@pytest.mark.parametrize("fs", [k for k in FS_KINDS if HAS_XATTR[k]], indirect=True)  # a checksum to verify
@pytest.mark.parametrize("where", ["first", "last"])
def test_same_size_corruption_is_ebadmsg_and_removed(io_backend, fs, where):
    kind, root = fs
    d = fresh_dir(root)
    bs = 256 * 1024 + 512
    n = 3
    view = rand_view(n, bs, seed=7)
    paths = paths_in(d, n)
    offs = [i * bs for i in range(n)]
    io_backend.batch_store_block(paths, view, offs, bs, checksum=True)
    flip_bit(paths[1], 0 if where == "first" else bs - 1)
    out = np.zeros_like(view)
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block(paths, out, offs, bs, checksum=True)
    e = ei.value
    assert (e.errno, e.checksum_failed, e.num_succeeded) == (errno.EBADMSG, True, 1)
    assert os.fsdecode(e.filename) == paths[1]
    assert not os.path.exists(paths[1])
    assert os.path.exists(paths[0]) and os.path.exists(paths[2])
    assert np.array_equal(out[:bs], view[:bs])


def test_truncated_block_is_eio_and_removed(io_backend, fs):
    kind, root = fs
    d = fresh_dir(root)
    bs = 64 * 1024
    view = rand_view(1, bs, seed=3)
    p = paths_in(d, 1)
    io_backend.batch_store_block(p, view, [0], bs, checksum=HAS_XATTR[kind])
    os.truncate(p[0], bs - 4096)
    out = np.zeros(bs, dtype=np.uint8)
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block(p, out, [0], bs, checksum=HAS_XATTR[kind])
    assert (ei.value.errno, ei.value.checksum_failed, ei.value.num_succeeded) == (errno.EIO, False, 0)
    assert not os.path.exists(p[0])


def test_missing_block_is_enoent(io_backend, fs):
    kind, root = fs
    d = fresh_dir(root)
    out = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(FileNotFoundError) as ei:
        io_backend.batch_load_block(paths_in(d, 1), out, [0], 4096, checksum=HAS_XATTR[kind])
    assert ei.value.errno == errno.ENOENT and ei.value.checksum_failed is False


# ---------------------------------------------------------------- ENOSPC


def test_enospc_on_small_tmpfs(io_backend):
    """Fill a 1 MiB tmpfs block by block: the store that does not fit fails
    with ENOSPC, leaves no temp and no destination, and every block stored
    before it still loads and verifies."""
    with mount_tmpfs(size="1m") as d:
        bs = 96 * 1024
        n = 16  # 1.5 MiB: cannot all fit
        view = rand_view(n, bs, seed=11)
        paths = paths_in(d, n)
        with pytest.raises(OSError) as ei:
            for i in range(n):
                io_backend.batch_store_block([paths[i]], view, [i * bs], bs, checksum=True)
        e = ei.value
        assert (e.errno, e.num_succeeded, e.checksum_failed) == (errno.ENOSPC, 0, False)
        failed = paths.index(os.fsdecode(e.filename))
        assert 1 <= failed < n
        assert not os.path.exists(paths[failed])
        assert leftovers(d) == []
        out = np.zeros(failed * bs, dtype=np.uint8)
        io_backend.batch_load_block(paths[:failed], out, [i * bs for i in range(failed)], bs, checksum=True)
        assert np.array_equal(out, view[: failed * bs])
        # the same batch as one call stops at the same kind of failure
        with pytest.raises(OSError) as ei2:
            io_backend.batch_store_block(paths, view, [i * bs for i in range(n)], bs, checksum=True)
        assert ei2.value.errno == errno.ENOSPC and ei2.value.num_succeeded >= failed
        assert leftovers(d) == []
