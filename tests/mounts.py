"""Reusable scratch mounts for tests: tmpfs, ramfs and loop-device ext4/xfs.

Each helper is a context manager that mounts a fresh filesystem on a new
temporary directory, yields that directory (str), and always unmounts and
removes it on exit. Where mounting is not permitted (not root, no loop
devices, missing mkfs, container without CAP_SYS_ADMIN) it calls
``ci.unavailable(reason)`` with mount(8)'s message (a skip; a failure under CI). Fixtures wrapping these live
in tests/conftest.py.

    with mount_tmpfs(size="1m") as d: ...      # size-limited: ENOSPC tests
    with mount_ramfs() as d: ...               # no user xattrs, no O_DIRECT
    with mount_loop("ext4", size_mb=64) as d:  # real block filesystem
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from typing import Iterator, Optional, Sequence

import pytest

from ci import unavailable

_SCRATCH = os.environ.get("KVTIER_TEST_SCRATCH") or None  # parent dir for mount points / images


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _skip_or_fail(what: str, proc: subprocess.CompletedProcess) -> None:
    msg = (proc.stderr or proc.stdout or "").strip() or f"exit status {proc.returncode}"
    unavailable(f"cannot {what}: {msg}")


def _umount(path: str) -> None:
    if _run(["umount", path]).returncode != 0:
        _run(["umount", "-l", path])  # busy (a leaked fd): detach lazily rather than leak the mount


@contextlib.contextmanager
def _mounted(args: Sequence[str], what: str) -> Iterator[str]:
    if shutil.which("mount") is None:
        unavailable("mount(8) not installed")
    mnt = tempfile.mkdtemp(prefix="kvtier-mnt-", dir=_SCRATCH)
    try:
        proc = _run(["mount", *args, mnt])
        if proc.returncode != 0:
            _skip_or_fail(f"mount {what}", proc)
        try:
            yield mnt
        finally:
            _umount(mnt)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


@contextlib.contextmanager
def mount_tmpfs(size: Optional[str] = None, options: Sequence[str] = ()) -> Iterator[str]:
    """A fresh tmpfs; ``size`` like "1m" or "64k" (mount(8) size=) limits it
    so writes hit ENOSPC. User xattrs and O_DIRECT work on Linux >= 6.6."""
    opts = ["mode=0755", *options] + ([f"size={size}"] if size else [])
    with _mounted(["-t", "tmpfs", "-o", ",".join(opts), "tmpfs"], "tmpfs") as d:
        yield d


@contextlib.contextmanager
def mount_ramfs() -> Iterator[str]:
    """A fresh ramfs: no user xattrs (EOPNOTSUPP), O_DIRECT refused (EINVAL)."""
    with _mounted(["-t", "ramfs", "-o", "mode=0755", "ramfs"], "ramfs") as d:
        yield d


@contextlib.contextmanager
def mount_loop(fstype: str = "ext4", size_mb: int = 64, mkfs_args: Sequence[str] = ()) -> Iterator[str]:
    """A fresh ``fstype`` ("ext4" or "xfs") on a sparse image file through a
    loop device. XFS needs size_mb >= 300 (mkfs.xfs minimum)."""
    mkfs = shutil.which(f"mkfs.{fstype}")
    if mkfs is None:
        unavailable(f"mkfs.{fstype} not installed")
    if fstype == "xfs":
        size_mb = max(size_mb, 300)
    imgdir = tempfile.mkdtemp(prefix="kvtier-img-", dir=_SCRATCH)
    img = os.path.join(imgdir, f"{fstype}.img")
    try:
        with open(img, "wb") as f:
            f.truncate(size_mb * 1024 * 1024)
        quiet = ["-q", "-F"] if fstype.startswith("ext") else ["-q", "-f"]
        proc = _run([mkfs, *quiet, *mkfs_args, img])
        if proc.returncode != 0:
            _skip_or_fail(f"mkfs.{fstype}", proc)
        with _mounted(["-t", fstype, "-o", "loop", img], f"{fstype} loop image") as d:
            yield d
    finally:
        shutil.rmtree(imgdir, ignore_errors=True)
