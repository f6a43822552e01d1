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
def mount_loop(fstype: str = "ext4", size_mb: int = 64, mkfs_args: Sequence[str] = (),
               options: str = "") -> Iterator[str]:
    """A fresh ``fstype`` ("ext4" or "xfs") on a sparse image file through a
    loop device, mounted with ``options`` (e.g. "discard") besides loop. XFS needs
    size_mb >= 300 (mkfs.xfs minimum)."""
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
        with _mounted(["-t", fstype, "-o", ",".join(["loop"] + ([options] if options else [])), img],
                      f"{fstype} loop image") as d:
            yield d
    finally:
        shutil.rmtree(imgdir, ignore_errors=True)


# ---------------------------------------------------------------- power loss

_WB_KNOBS = ("/proc/sys/vm/dirty_writeback_centisecs", "/proc/sys/vm/dirty_expire_centisecs")
_WB_HELD = {_WB_KNOBS[0]: "0", _WB_KNOBS[1]: "360000"}  # no periodic flush; dirty data never "old"
_WB_DIR = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
_WB_LOCK = os.path.join(_WB_DIR, "kvtier-test-writeback.lock")
_WB_STATE = os.path.join(_WB_DIR, "kvtier-test-writeback.json")  # the values to restore


def _wb_restore_from_state() -> None:
    import json

    with contextlib.suppress(FileNotFoundError):
        with open(_WB_STATE) as f:
            saved = json.load(f)
        for knob, value in saved.items():
            with open(knob, "w") as f:
                f.write(value)
        os.unlink(_WB_STATE)


@contextlib.contextmanager
def writeback_held(timeout: float = 120.0) -> Iterator[None]:
    """Hold the kernel's periodic writeback (vm.dirty_writeback_centisecs=0,
    vm.dirty_expire_centisecs=360000) so that dirty page-cache data reaches a device only
    when something flushes it (fsync, a journal commit, sync(2)). These knobs are
    system-wide: the previous values are written to a state file first and restored on
    exit, under an exclusive lock, so concurrent test runs take turns and a run killed
    while holding them is undone by the next one (which finds the state file)."""
    import fcntl
    import json
    import time

    if not all(os.access(k, os.W_OK) for k in _WB_KNOBS):
        unavailable(f"cannot set {', '.join(_WB_KNOBS)} (needs root)")
    lock = open(_WB_LOCK, "a")
    try:
        end = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    pytest.fail(f"{_WB_LOCK} held by another run for {timeout:.0f} s")
                time.sleep(0.1)
        _wb_restore_from_state()  # a previous holder died before restoring
        saved = {}
        for knob in _WB_KNOBS:
            with open(knob) as f:
                saved[knob] = f.read().strip()
        with open(_WB_STATE + ".new", "w") as f:
            json.dump(saved, f)
        os.replace(_WB_STATE + ".new", _WB_STATE)
        try:
            for knob, value in _WB_HELD.items():
                with open(knob, "w") as f:
                    f.write(value)
            yield
        finally:
            _wb_restore_from_state()
    finally:
        lock.close()  # releases the lock


class PowerLossFS:
    """A filesystem on a loop device over an image file (see :func:`power_loss_fs`)."""

    def __init__(self, fstype: str, workdir: str, image: str, device: str, mnt: str) -> None:
        self.fstype, self.workdir, self.image, self.device, self.mnt = fstype, workdir, image, device, mnt
        self.mounted = True

    def jbd2_commits(self) -> int:
        """ext4: journal transactions committed so far (/proc/fs/jbd2/<dev>-8/info)."""
        info = f"/proc/fs/jbd2/{os.path.basename(self.device)}-8/info"
        with open(info) as f:
            return int(f.readline().split()[0])

    def power_off(self) -> str:
        """Lose power now: copy the image as the loop device has received it (the page cache
        above the device is lost; a device without volatile write cache keeps every write it
        received), then take the original down. Returns the copy's path."""
        crashed = self.image + ".crashed"
        _check(["cp", "--sparse=always", self.image, crashed], "copy the image")
        self.unmount()
        return crashed

    def unmount(self) -> None:
        if self.mounted:
            self.mounted = False
            _umount(self.mnt)
            _run_t(["losetup", "-d", self.device])

    @contextlib.contextmanager
    def after_crash(self) -> Iterator[str]:
        """power_off(), then mount the copy (its journal replayed, as at the next boot):
        yields that mount point."""
        crashed = self.power_off()
        with _mounted(["-t", self.fstype, "-o", "loop,noatime", crashed], f"{self.fstype} image after a crash") as d:
            yield d


def _run_t(cmd: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f} s")


def _check(cmd: Sequence[str], what: str) -> str:
    proc = _run_t(cmd)
    if proc.returncode != 0:
        pytest.fail(f"cannot {what}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip()


@contextlib.contextmanager
def power_loss_fs(fstype: str = "ext4", options: str = "noatime", size_mb: int = 64) -> Iterator[PowerLossFS]:
    """A fresh ``fstype`` on a buffered loop device over an image file, mounted with
    ``options``, for a power-loss simulation (``.after_crash()``). Writes reach the image
    file's page cache when the filesystem submits them to the device, so a copy of the image
    is what a device holds when the power goes; what the filesystem still keeps in its own
    page cache (and its uncommitted journal) is lost. No device-mapper needed. Loop device,
    mounts and image are removed on exit, also on failure."""
    mkfs = shutil.which(f"mkfs.{fstype}")
    if mkfs is None or shutil.which("losetup") is None:
        unavailable(f"mkfs.{fstype} or losetup not installed")
    if fstype == "xfs":
        size_mb = max(size_mb, 300)
    work = tempfile.mkdtemp(prefix="kvtier-pl-", dir=_SCRATCH)
    try:
        img = os.path.join(work, f"{fstype}.img")
        with open(img, "wb") as f:
            f.truncate(size_mb * 1024 * 1024)
        # ext4: inode tables and journal zeroed now, not by a background thread later
        args = ["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"] if fstype == "ext4" else ["-q", "-f"]
        proc = _run_t([mkfs, *args, img])
        if proc.returncode != 0:
            _skip_or_fail(f"mkfs.{fstype}", proc)
        proc = _run_t(["losetup", "--find", "--show", img])
        if proc.returncode != 0:
            _skip_or_fail("attach a loop device", proc)
        dev = proc.stdout.strip()
        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        fs = PowerLossFS(fstype, work, img, dev, mnt)
        try:
            proc = _run_t(["mount", "-t", fstype, "-o", options, dev, mnt])
            if proc.returncode != 0:
                fs.mounted = False
                _run_t(["losetup", "-d", dev])
                _skip_or_fail(f"mount {fstype} -o {options}", proc)
            yield fs
        finally:
            fs.unmount()
    finally:
        shutil.rmtree(work, ignore_errors=True)
