"""Shared pytest fixtures: scratch mounts (tests/mounts.py) and the block I/O
backend parametrisation (each test body runs against the C core and the
pure-Python fallback, calling that implementation)."""
from __future__ import annotations

import os
import sys

import pytest

if os.environ.get("KVTIER_TEST_NO_C") == "1":
    # tests/test_fallback_no_c.py runs the fallback's tests so: kvtier._C unimportable, as
    # on a host where it was not built (kvtier/__init__ then sets kvtier._C = None)
    sys.modules["kvtier._C"] = None

from mounts import mount_loop, mount_ramfs, mount_tmpfs

IO_BACKENDS = ["c", "python"]


@pytest.fixture(params=IO_BACKENDS)
def io_backend(request):
    """kvtier.io.BlockIO bound to one backend: ``.batch_*`` take (paths, view,
    offsets, block_size, ...); ``.impl`` is the raw module (kvtier._C or
    kvtier.fallback) with the vLLM-shaped (tmp_paths, dest_paths, buffers)
    calls. Skips "c" when the C core is not built."""
    from kvtier import io

    try:
        return io.for_backend(request.param)
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture
def backend(io_backend, monkeypatch):
    """``io_backend`` bound into kvtier.io, which the tier engine calls (kvtier.io.batch_*):
    a tier's jobs run on the backend under test."""
    from kvtier import io as kio

    monkeypatch.setattr(kio, "batch_load_block", io_backend.batch_load_block)
    monkeypatch.setattr(kio, "batch_store_block", io_backend.batch_store_block)
    monkeypatch.setattr(kio, "batch_lookup", io_backend.batch_lookup)
    return io_backend


@pytest.fixture
def tmpfs_dir():
    """A fresh, unlimited tmpfs mount point (skips where mounting is refused)."""
    with mount_tmpfs() as d:
        yield d


@pytest.fixture
def ramfs_dir():
    """A fresh ramfs mount point: no user xattrs, no O_DIRECT."""
    with mount_ramfs() as d:
        yield d


@pytest.fixture
def ext4_dir():
    """A fresh 64 MiB ext4 on a loop device (real O_DIRECT, xattrs in inode)."""
    with mount_loop("ext4", size_mb=64) as d:
        yield d


@pytest.fixture(scope="session", params=["glusterfs", "moosefs"])
def dfs(request):
    """A running distributed filesystem (tests/dfs.py), one per session and kind: ``.mounts``
    = [node A's mount, node B's mount] of one volume, ``.storage_pids``, ``.kind``."""
    import dfs as _dfs

    with _dfs.cluster(request.param) as c:
        yield c


@pytest.fixture
def dfs_dirs(dfs, request):
    """A fresh directory on the distributed filesystem: (path through node A, same path
    through node B); removed after the test."""
    import shutil
    import uuid

    name = f"t-{request.node.name[:40]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")
    a, b = (os.path.join(m, name) for m in dfs.mounts)
    os.mkdir(a)
    yield a, b
    shutil.rmtree(a, ignore_errors=True)


@pytest.fixture(scope="module")
def ff(tmp_path_factory):
    """The FUSE fault filesystem (tests/fusefault), one mount per test module (needs root,
    /dev/fuse and mount(2); tests/ci.py unavailable() otherwise)."""
    from fusefault.mount import mount_fusefault

    with mount_fusefault(tmp_path_factory.mktemp("fusefault")) as fs:
        yield fs


@pytest.fixture
def area(ff, request):
    """A fresh directory under the fault mount for one test; after it, stalled operations
    are released and the rules cleared."""
    name = request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    d = os.path.join(ff.mnt, name)
    os.makedirs(d)
    yield d
    ff.clear()
