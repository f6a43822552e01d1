"""``kvtier doctor ROOT [--peer OTHER_MOUNT] [--json]``: can kvtier keep a cache in ROOT?

Run it before pointing servers at a mount. Every probe works in a directory
``ROOT/.kvtier_probe_doctor_<hex>`` that it removes at the end, and reports pass, warn or
fail with a one-line fix:

  filesystem     type, source and mount options (/proc/self/mountinfo); for GlusterFS and
                 MooseFS also the client's own options, read from its command line
  writable       a directory and a file can be created in ROOT
  user_xattr     user.vllm.kv_crc32c set, read, kept across rename, removed (checksums)
  o_direct       statx DIO alignment; an aligned and an unaligned O_DIRECT write, each
                 checked through fsync and a read-back
  rename_excl    O_CREAT|O_EXCL has one winner; rename over a name never shows a torn
                 file or no file to a reader
  space          free bytes and inodes (statvfs)
  fsync          fdatasync of a 1 MiB file and fsync of its directory (the cost of durable)

With --peer, a second mount of the same directory (another client, "node B"), the doctor
changes things through ROOT and measures how long the peer takes to see them (bounded by
--wait): a new name, an unlink, a replace by rename, bytes rewritten in place (the page
cache of the peer), and an xattr replaced (the xattr cache of the peer).

It ends with what kvtier will do there (O_DIRECT or buffered, checksums or not, what a load
verifies) and the mount options recommended for the detected filesystem: tested here for
GlusterFS, MooseFS and local filesystems, from their documentation for the others.

Exit status: 0 every check passed; 1 a warning; 2 kvtier cannot run there (a failed check,
or ROOT / --peer unusable).
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import json
import mmap
import os
import secrets
import shutil
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Tuple

from kvtier._blockio.records import XATTR_NAME as XATTR
from kvtier._tier.mountinfo import MountEntry, mount_of
from kvtier.cli._text import EXIT_USAGE, dir_error

PASS, WARN, FAIL = "pass", "warn", "fail"
# csrc/block/block.c opens O_DIRECT only for page-aligned buffers and lengths (a multiple of 4096),
# and on EINVAL retries buffered
KVTIER_DIO_ALIGN = 4096
RENAMES = 150  # rename-over-a-name rounds a reader races (local)
MIN_FREE = 1 << 30  # bytes: less is a warning
MIN_INODES = 10000
FSYNC_PROBE_BYTES = 1 << 20  # the fsync probe's file (as a 1 MiB block)
SLOW_FSYNC_S = 0.05  # median fdatasync+dir fsync above this: durable=True is slow here

#: For a bounded cache (max_bytes), whose evictor unlinks a block file per evicted block.
_NODISCARD = ("for a bounded cache (max_bytes): mount without `discard` and trim periodically (fstrim, e.g. "
              "fstrim.timer); with `discard` each unlink trims at once: on ext4 on a virtio disk that doubled the CPU of an "
              "eviction and made a full root of 256 KiB blocks drop stores (docs/capacity.md)")

#: Mount options per filesystem kind: (advice, "tested" | "documentation").
RECOMMENDED = {
    "glusterfs": ("run the client as `glusterfs --fopen-keep-cache=false --volfile-server=HOST "
                  "--volfile-id=/VOL MNT` (mount.glusterfs mangles fopen-keep-cache=off): otherwise a "
                  "client keeps its page cache across opens and a block changed through another "
                  "client still verifies from the old bytes", "tested"),
    "moosefs": ("mfsmount -o mfsxattrcacheto=0 (default 30 s: an xattr replaced through another client "
                "stays stale here that long)", "tested"),
    "nfs": ("NFS v4.2 (vers=4.2, Linux >= 5.9 client and server) for user xattrs (RFC 8276); NFSv3 and "
            "v4.0/4.1 have none, so checksums are impossible; close-to-open consistency: a block written "
            "and closed on one client is seen at the next open on another; `lookupcache=positive` "
            "shortens the time a new block stays invisible", "documentation"),
    "lustre": ("mount the client with -o user_xattr (user xattrs are refused without it)", "documentation"),
    "cephfs": ("user xattrs work on the kernel client and ceph-fuse without options; client caches are "
               "kept coherent by MDS capabilities", "documentation"),
    "beegfs": ("sysXAttrsEnabled = true in beegfs-client.conf (user xattrs are off by default)",
               "documentation"),
    "fuse": ("depends on the FUSE daemon: run this doctor with --peer through a second client",
             "documentation"),
    "tmpfs": ("nothing to set; user xattrs and O_DIRECT need Linux >= 6.6; a node-local cache only",
              "tested"),
    "ext4": ("user_xattr is the default; a node-local cache only; " + _NODISCARD, "tested"),
    "xfs": ("a node-local cache only; " + _NODISCARD, "tested"),
    "btrfs": ("a node-local cache only; " + _NODISCARD + " (btrfs discard=async batches: fine)", "documentation"),
    "ramfs": ("not usable with checksums: no user xattrs; use tmpfs", "tested"),
}


@dataclass
class Check:
    """One probe: ``status`` pass / warn / fail, ``detail`` what was seen, ``fix`` one
    line (empty on pass), ``data`` measured values (seconds, bytes, counts)."""

    name: str
    status: str
    detail: str
    fix: str = ""
    data: dict = field(default_factory=dict)


class _Unusable(Exception):
    """ROOT or --peer cannot be probed at all (exit 2)."""


# ------------------------------------------------------------------ helpers

def _statx_dio(path: str) -> Optional[Tuple[int, int]]:
    """(memory alignment, offset alignment) for O_DIRECT from statx(2) STATX_DIOALIGN
    (Linux >= 6.1), or None where the kernel or filesystem does not report it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statx is 256 bytes
    AT_FDCWD, STATX_DIOALIGN = -100, 0x2000
    if statx(AT_FDCWD, os.fsencode(path), 0, STATX_DIOALIGN, buf) != 0:
        return None
    mask = int.from_bytes(buf.raw[0:4], "little")
    mem = int.from_bytes(buf.raw[152:156], "little")  # stx_dio_mem_align
    off = int.from_bytes(buf.raw[156:160], "little")  # stx_dio_offset_align
    if not mask & STATX_DIOALIGN:
        return None
    return mem, off


def client_argv(mount_point: str, programs=("glusterfs", "mfsmount")) -> Optional[List[str]]:
    """Command line of the FUSE client process serving ``mount_point`` (a process named in
    ``programs`` with the mount point among its arguments), or None if none is visible."""
    real = os.path.realpath(mount_point)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        if not argv or os.path.basename(argv[0].split(" ")[0]) not in programs:
            continue
        # mfsmount rewrites its command line to "mfsmount (mounted on: MNT)"
        args = [a[len("(mounted on: "):-1] if a.startswith("(mounted on: ") else a
                for a in (argv[0].split(" ", 1)[1:] if " " in argv[0] else []) + argv[1:]]
        if any(a.startswith("/") and (a == mount_point or os.path.realpath(a) == real) for a in args):
            return argv
    return None


def _client_option(argv: List[str], name: str) -> Optional[str]:
    """Value of ``--name=V`` or ``-o ...,name=V,...`` in a client command line."""
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == "-o" and i + 1 < len(argv) or a.startswith("-o") and len(a) > 2:
            opts = argv[i + 1] if a == "-o" else a[2:]
            for o in opts.split(","):
                k, _, v = o.partition("=")
                if k == name:
                    return v
    return None


def _mfs_param(mount_point: str, name: str) -> Optional[str]:
    """A MooseFS client's effective setting, from the hidden ``.params`` file at its mount
    root ("mfsxattrcacheto: 0.000"), or None."""
    try:
        with open(os.path.join(mount_point, ".params"), encoding="utf-8", errors="replace") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() == name:
                    return v.strip()
    except OSError:
        pass
    return None


def _wait_until(cond: Callable[[], bool], limit: float) -> Optional[float]:
    """Seconds until ``cond()`` was first true (polled every 20 ms), or None after ``limit``."""
    t0 = time.monotonic()
    while True:
        try:
            if cond():
                return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > limit:
            return None
        time.sleep(0.02)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:  # a read error names the file too
        raise OSError(e.errno, e.strerror, path) from None


def _write(path: str, data: bytes, sync: bool = True) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _writable_fix(err: Optional[int]) -> str:
    """The fix of a failed ``writable`` probe, by its errno."""
    if err in (errno.ENOSPC, errno.EDQUOT):
        return ("free space or inodes on ROOT's filesystem (df -h ROOT; df -i ROOT), or raise the servers' user's "
                "quota (EDQUOT)")
    if err == errno.EROFS:
        return "ROOT's filesystem is mounted read-only: mount it read-write"
    if err in (errno.EACCES, errno.EPERM):
        return "give the servers' user write access to ROOT (ownership, mode or ACL of the directory)"
    return "fix the filesystem error above (see the client's log), then run kvtier doctor again"


def _err(e: OSError) -> str:
    return f"{errno.errorcode.get(e.errno, e.errno)} ({e.strerror})"


# ------------------------------------------------------------------ probes

def check_filesystem(m: Optional[MountEntry]) -> Check:
    if m is None:
        return Check("filesystem", WARN, "/proc/self/mountinfo is unreadable: filesystem unknown",
                     "run on Linux with /proc mounted")
    d = {"fstype": m.fstype, "kind": m.kind, "source": m.source, "mount_point": m.mount_point,
         "options": m.options, "super_options": m.super_options}
    detail = f"{m.fstype} ({m.kind}) from {m.source} at {m.mount_point}, options {m.options}; {m.super_options}"
    if "ro" in m.options.split(","):
        return Check("filesystem", FAIL, detail + ": mounted read-only", "mount it read-write", d)
    status, fix = PASS, ""
    if m.kind == "tmpfs" and m.mount_point == "/dev/shm":
        status, fix = WARN, ("use a tmpfs of its own with a size (mount -t tmpfs -o size=64g tmpfs /mnt/kv) or a "
                             "disk: /dev/shm is the RAM vLLM's CPU tier maps its blocks from (SharedOffloadRegion), "
                             "so a cache here competes with that tier and the machine for memory")
        detail += "; /dev/shm: RAM shared with vLLM's CPU tier"
    if m.kind in ("ext4", "xfs", "btrfs") and m.option("discard") in ("", "sync"):  # btrfs discard=async: batched
        d["discard"] = True  # advice for a bounded cache, not a warning: an unbounded one never unlinks in bulk
        detail += ("; mounted discard: an evicted block costs ~2x the CPU (a bounded cache: see the recommended "
                   "options)")
    if m.kind == "nfs":
        vers = m.option("vers") or "?"
        d["nfs_version"] = vers
        if vers not in ("4.2",):
            status, fix = WARN, "mount with vers=4.2 (user xattrs need NFS v4.2: RFC 8276)"
    if m.kind == "lustre" and m.option("user_xattr") is None:
        status, fix = WARN, "mount with -o user_xattr"
    if m.kind in ("glusterfs", "moosefs"):
        argv = client_argv(m.mount_point)
        d["client_argv"] = argv
        d["client_options_from"] = "command line" if argv else None
        if m.kind == "moosefs" and _mfs_param(m.mount_point, "mfsxattrcacheto"):
            d["client_options_from"] = ".params"  # mfsmount's effective settings, at its mount root
            argv = argv or []
        if argv is None:
            detail += "; client process not visible here (another PID namespace?): its options unknown"
        elif m.kind == "glusterfs":
            v = _client_option(argv, "fopen-keep-cache")
            if v is None or v.lower() not in ("false", "off", "no", "0"):
                status, fix = WARN, ("remount with glusterfs --fopen-keep-cache=false: the client keeps its page "
                                     "cache across opens (a block changed elsewhere verifies from old bytes)")
            detail += f"; client fopen-keep-cache={v if v is not None else 'default (on)'}"
        else:
            v = _mfs_param(m.mount_point, "mfsxattrcacheto") or _client_option(argv, "mfsxattrcacheto")
            try:
                ok = v is not None and float(v) == 0.0
            except ValueError:
                ok = False
            if not ok:
                status, fix = WARN, "remount with mfsmount -o mfsxattrcacheto=0 (xattrs are cached 30 s by default)"
            detail += f"; client mfsxattrcacheto={v if v is not None else 'default (30 s)'}"
    return Check("filesystem", status, detail, fix, d)


def check_xattr(work: str) -> Check:
    p = os.path.join(work, "xattr")
    q = os.path.join(work, "xattr-renamed")
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    try:
        v = secrets.token_bytes(4)
        try:
            os.setxattr(fd, XATTR, v)
        except OSError as e:
            return Check("user_xattr", FAIL, f"setxattr {XATTR}: {_err(e)}: kvtier cannot store checksums here",
                         "use a filesystem with user xattrs (see the recommended options), or run the tier "
                         "with checksum_blocks=False (no verification)", {"errno": e.errno})
        got = os.getxattr(fd, XATTR)
    finally:
        os.close(fd)
    if got != v:
        return Check("user_xattr", FAIL, f"getxattr returned {got.hex()} after setting {v.hex()}",
                     "do not use this filesystem for a checksummed cache")
    os.rename(p, q)
    after = os.getxattr(q, XATTR) if XATTR in os.listxattr(q) else None
    if after != v:
        return Check("user_xattr", FAIL, f"xattr lost across rename (got {after!r})",
                     "do not use this filesystem for a checksummed cache (stores rename a temp onto the block)")
    os.removexattr(q, XATTR)
    try:
        os.getxattr(q, XATTR)
        return Check("user_xattr", FAIL, "xattr still readable after removexattr", "do not use this filesystem")
    except OSError as e:
        if e.errno != errno.ENODATA:
            return Check("user_xattr", FAIL, f"getxattr after removexattr: {_err(e)}, expected ENODATA",
                         "do not use this filesystem (a block without xattr must read as ENODATA)")
    os.unlink(q)
    return Check("user_xattr", PASS, "set, get, kept across rename, removed (ENODATA after)")


def _dio_write(path: str, data: memoryview) -> Tuple[str, str]:
    """O_DIRECT write of ``data`` at offset 0 to a new ``path``, then fsync, then a
    buffered read-back. Returns (outcome, text): "refused" (EINVAL at open or write),
    "ok", or "lost" (fsync failed or the read-back differs)."""
    try:  # O_DIRECT at open, as kvtier opens (a refusing filesystem may leave the file: rmtree'd)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return "refused", f"O_DIRECT refused at open: {_err(e)}"
    try:
        try:
            n = os.pwrite(fd, data, 0)
        except OSError as e:
            if e.errno != errno.EINVAL:  # ENOSPC, EIO...: a failed check naming it, not a refusal
                e.filename = e.filename or path
                raise
            return "refused", f"write: {_err(e)}"
        try:
            os.fsync(fd)
        except OSError as e:
            return "lost", f"write returned {n}, then fsync: {_err(e)}"
    finally:
        os.close(fd)
    back = _read(path)
    if back != bytes(data):
        return "lost", f"write and fsync succeeded, but the file reads back {len(back)} bytes, not the {len(data)} written"
    return "ok", "written, fsynced, read back equal"


def check_o_direct(work: str) -> Check:
    probe = os.path.join(work, "dio-statx")
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644))
    dio = _statx_dio(probe)  # reported for regular files only
    os.unlink(probe)
    size = max(max(dio) if dio else 0, KVTIER_DIO_ALIGN)
    buf = mmap.mmap(-1, 2 * size + 4096)  # page aligned
    buf.write(secrets.token_bytes(len(buf)))
    try:
        with memoryview(buf) as mv, mv[:size] as al, mv[1:1001] as un:  # released before buf.close()
            aligned, at = _dio_write(os.path.join(work, "dio-aligned"), al)
            unaligned, ut = _dio_write(os.path.join(work, "dio-unaligned"), un)
    finally:
        buf.close()
    where = (f"statx DIO alignment: memory {dio[0]}, offset {dio[1]}" if dio else
             "statx reports no DIO alignment")
    d = {"statx_dio_align": list(dio) if dio else None, "aligned": aligned, "unaligned": unaligned}
    text = f"{where}; aligned {size}-byte write: {at}; unaligned 1000-byte write: {ut}"
    if aligned == "lost":
        return Check("o_direct", FAIL, text + ": an aligned O_DIRECT store would lose data",
                     "run the tier with use_o_direct=False here", d)
    if aligned == "refused":
        return Check("o_direct", PASS, text + ": kvtier uses buffered I/O here", "", d)
    if unaligned == "lost":
        text += (f" (kvtier is not affected: it uses O_DIRECT only for {KVTIER_DIO_ALIGN}-byte aligned "
                 f"buffers and lengths, anything else buffered)")
    return Check("o_direct", PASS, text, "", d)


def check_rename_excl(work: str, reader_dir: Optional[str] = None, rounds: int = RENAMES,
                      name: str = "rename_excl") -> Check:
    """O_EXCL twice on one name; then a writer renames fresh files over one name while a
    reader (through ``reader_dir``: the same directory, or through the peer) opens it."""
    p = os.path.join(work, "excl")
    os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644))
    try:
        os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644))
        return Check(name, FAIL, "O_CREAT|O_EXCL succeeded on an existing file",
                     "do not use this filesystem: two nodes could both claim one temp")
    except FileExistsError:
        pass
    os.unlink(p)
    size = 64 * 1024
    target = os.path.join(work, "renamed")
    _write(target, bytes([0]) * size, sync=False)
    seen = os.path.join(reader_dir or work, "renamed")
    stop = threading.Event()
    stats = {"reads": 0, "torn": 0, "enoent": 0, "other_errors": {}}

    def reader():
        while not stop.is_set():
            try:
                b = _read(seen)
            except FileNotFoundError:
                stats["enoent"] += 1
                continue
            except OSError as e:  # ESTALE on some FUSE filesystems: the name moved under the open
                k = errno.errorcode.get(e.errno, str(e.errno))
                stats["other_errors"][k] = stats["other_errors"].get(k, 0) + 1
                continue
            stats["reads"] += 1
            if len(b) != size or b.count(b[:1]) != size:
                stats["torn"] += 1

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        for k in range(1, rounds + 1):
            tmp = os.path.join(work, f"renamed.{k}.tmp")
            _write(tmp, bytes([k % 256]) * size, sync=False)
            os.rename(tmp, target)
    finally:
        stop.set()
        t.join(10)
    os.unlink(target)
    d = {"renames": rounds, **stats}
    others = ", ".join(f"{n} {k}" for k, n in sorted(stats["other_errors"].items()))
    text = (f"O_EXCL: one winner; {rounds} renames over one name, reader: {stats['reads']} reads, "
            f"{stats['torn']} torn, {stats['enoent']} ENOENT" + (f", {others}" if others else ""))
    if stats["torn"]:
        return Check(name, FAIL, text, "do not use this filesystem: rename is not atomic", d)
    if stats["enoent"] and reader_dir is None:  # GlusterFS's distribute volumes do this
        return Check(name, WARN, text + ": the name was missing during a rename; kvtier stays correct (a load "
                     "racing a store of the same block is a miss, the bytes are never torn)",
                     "none on the mount: expect misses when two nodes store one block at once", d)
    if stats["reads"] == 0:
        return Check(name, WARN, text + ": no read completed, atomicity not shown",
                     "run the doctor again on a less loaded machine", d)
    if others or stats["enoent"]:
        text += " (a load racing a store of that block is a miss; the file is kept)"
    return Check(name, PASS, text, "", d)


def check_space(root: str) -> Check:
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    d = {"free_bytes": free, "total_bytes": st.f_blocks * st.f_frsize, "free_inodes": st.f_favail,
         "total_inodes": st.f_files}
    from kvtier.cli._text import human_bytes

    text = (f"{human_bytes(free)} free of {human_bytes(st.f_blocks * st.f_frsize)}, {st.f_favail} of "
            f"{st.f_files} inodes free")
    if st.f_blocks == 0:
        return Check("space", WARN, "no size reported (ramfs-like): the cache can fill the machine's RAM",
                     "use a filesystem with a size limit (tmpfs size=, a disk)", d)
    if free == 0:
        return Check("space", FAIL, text, "free space on the filesystem", d)
    if st.f_files and st.f_favail == 0:
        return Check("space", FAIL, text, "free inodes (every block is a file)", d)
    if free < MIN_FREE or (st.f_files and st.f_favail < MIN_INODES):
        return Check("space", WARN, text, "give the cache more room: every block is one file", d)
    return Check("space", PASS, text, "", d)


def check_fsync(work: str, rounds: int = 5) -> Check:
    data = secrets.token_bytes(FSYNC_PROBE_BYTES)
    times = []
    dfd = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i in range(rounds):
            path = os.path.join(work, f"fsync.{i}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                t0 = time.perf_counter()
                os.fdatasync(fd)
                try:
                    os.fsync(dfd)
                except OSError as e:  # some filesystems refuse fsync on a directory
                    if e.errno not in (errno.EINVAL, errno.EBADF):
                        raise
                times.append(time.perf_counter() - t0)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                return Check("fsync", WARN, f"not measured: no room for its {FSYNC_PROBE_BYTES >> 20} MiB probe file "
                             f"({_err(e)} on {path})", _writable_fix(e.errno), {"errno": e.errno})
            finally:
                os.close(fd)
                os.unlink(path)  # one probe file at a time: needs 1 MiB free, not 5
    finally:
        os.close(dfd)
    med = statistics.median(times)
    d = {"median_s": med, "max_s": max(times), "rounds": rounds}
    text = f"fdatasync of 1 MiB + directory fsync: median {med * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms"
    if med > SLOW_FSYNC_S:
        return Check("fsync", WARN, text + ": durable=True adds this to every stored block",
                     "keep durable=False (a crash may lose recent blocks, never publish a torn one)", d)
    return Check("fsync", PASS, text + " (the cost of durable=True per stored block)", "", d)


def check_peer(work: str, peer_work: str, wait: float) -> List[Check]:
    """Change files through ``work`` (this client) and time how long the peer's view
    (``peer_work``, the same directory through another client) takes to follow."""
    out = []
    lag = _wait_until(lambda: os.path.isdir(peer_work), wait)
    if lag is None:
        raise _Unusable(f"--peer: {peer_work} did not appear within {wait:g} s: the peer is not a mount of the "
                        f"same directory as ROOT")
    # names: new, unlinked, replaced by rename
    a, pa = os.path.join(work, "name"), os.path.join(peer_work, "name")
    _write(a, b"1" * 4096)
    new = _wait_until(lambda: _read(pa) == b"1" * 4096, wait)  # the peer has read it
    tmp = os.path.join(work, "name.tmp")
    _write(tmp, b"2" * 4096)
    os.rename(tmp, a)
    replaced = _wait_until(lambda: _read(pa) == b"2" * 4096, wait)
    os.unlink(a)
    gone = _wait_until(lambda: not os.path.exists(pa), wait)
    d = {"new_s": new, "replace_s": replaced, "unlink_s": gone}
    fmt = lambda v: f"{v * 1e3:.0f} ms" if v is not None else f"not within {wait:g} s"  # noqa: E731
    text = f"peer sees a new name after {fmt(new)}, a replace after {fmt(replaced)}, an unlink after {fmt(gone)}"
    if None in (new, replaced, gone):
        out.append(Check("peer_names", WARN, text, "shorten the client's entry/attribute cache timeouts "
                         "(a block stays invisible, or a removed one visible, that long)", d))
    else:
        out.append(Check("peer_names", PASS, text + " (a lag is a miss or an older copy of the same block)", "", d))
    # rename over a name while the peer reads it
    out.append(check_rename_excl(work, peer_work, rounds=RENAMES // 3, name="peer_rename"))
    # data rewritten in place: the peer's page cache
    b, pb = os.path.join(work, "data"), os.path.join(peer_work, "data")
    old = secrets.token_bytes(256 * 1024)
    _write(b, old)
    _wait_until(lambda: _read(pb) == old, wait)  # the peer has read it: its cache is warm
    new_bytes = bytearray(old)
    new_bytes[1000] ^= 0xFF
    fd = os.open(b, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.pwrite(fd, bytes(new_bytes[1000:1001]), 1000)
        os.fsync(fd)
    finally:
        os.close(fd)
    first_stale = _read(pb) != bytes(new_bytes)  # the peer's first open after the change
    seen = _wait_until(lambda: _read(pb) == bytes(new_bytes), wait)
    d = {"data_s": seen, "first_read_stale": first_stale}
    if first_stale:
        out.append(Check("peer_data", WARN, f"a byte rewritten through ROOT was read old through the peer at its next "
                         f"open (fresh after {fmt(seen)}): the peer keeps its page cache across opens, so a block "
                         f"corrupted elsewhere can verify there from the old bytes",
                         "GlusterFS: glusterfs --fopen-keep-cache=false; other FUSE clients: a mount option that "
                         "drops the page cache on open (direct_io)", d))
    else:
        out.append(Check("peer_data", PASS, "a byte rewritten in place is read through the peer at its next open", "", d))
    # xattr replaced: the peer's xattr cache
    v1, v2 = secrets.token_bytes(4), secrets.token_bytes(4)
    os.setxattr(b, XATTR, v1)
    _wait_until(lambda: os.getxattr(pb, XATTR) == v1, wait)
    os.setxattr(b, XATTR, v2)
    try:
        x_stale = os.getxattr(pb, XATTR) != v2
    except OSError:
        x_stale = True
    xs = _wait_until(lambda: os.getxattr(pb, XATTR) == v2, wait)
    d = {"xattr_s": xs, "first_read_stale": x_stale}
    if x_stale:
        out.append(Check("peer_xattr", WARN, f"an xattr replaced through ROOT was read old through the peer (fresh "
                         f"after {fmt(xs)}: xattr cache): a checksum rewritten elsewhere is not seen there",
                         "MooseFS: mfsmount -o mfsxattrcacheto=0", d))
    else:
        out.append(Check("peer_xattr", PASS, "a replaced xattr is read through the peer at once", "", d))
    return out


# ------------------------------------------------------------------ run

def run_doctor(root: str, peer: Optional[str] = None, wait: float = 5.0) -> dict:
    """Probe ``root`` (and ``peer``, the same directory through another client);
    returns the report dict (``checks``, ``kvtier``, ``recommended``, ``status``,
    ``exit``). Leaves no file behind."""
    err = dir_error(root)
    if err is not None:
        raise _Unusable(err)
    err = None if peer is None else dir_error(peer)
    if err is not None:
        raise _Unusable(f"--peer {err}")
    m = mount_of(root)
    checks = [check_filesystem(m)]
    name = f".kvtier_probe_doctor_{secrets.token_hex(6)}"
    work = os.path.join(root, name)
    kv = {"o_direct": None, "checksums": None}
    try:
        os.mkdir(work)
        fd = os.open(os.path.join(work, "w"), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
        os.close(fd)
    except OSError as e:
        checks.append(Check("writable", FAIL, f"cannot create a file in {root}: {_err(e)}", _writable_fix(e.errno)))
        if os.path.isdir(work):
            shutil.rmtree(work, ignore_errors=True)
        return _finish(root, peer, m, checks, kv)
    def probe(check_name, fn, *a):
        try:
            r = fn(*a)
        except OSError as e:  # an error the probe did not expect: kvtier would meet it too
            r = Check(check_name, FAIL, f"{_err(e)} on {e.filename or a[0]}", _writable_fix(e.errno),
                      {"errno": e.errno})
        checks.extend(r if isinstance(r, list) else [r])

    try:
        checks.append(Check("writable", PASS, "a directory and a file were created"))
        probe("user_xattr", check_xattr, work)
        probe("o_direct", check_o_direct, work)
        probe("rename_excl", check_rename_excl, work)
        probe("space", check_space, root)
        probe("fsync", check_fsync, work)
        if peer is not None:
            probe("peer", check_peer, work, os.path.join(peer, name), wait)
        from kvtier import io as kio

        try:
            kv["o_direct"] = bool(kio.probe_o_direct(work))
            kv["checksums"] = bool(kio.probe_xattr(work))
        except OSError as e:  # e.g. ENOSPC on a full filesystem: a failed check, not a traceback
            checks.append(Check("kvtier_probe", FAIL, f"kvtier's own I/O probe failed: {_err(e)} on "
                                f"{e.filename or work}", _writable_fix(e.errno), {"errno": e.errno}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _finish(root, peer, m, checks, kv)


def _finish(root, peer, m, checks, kv) -> dict:
    status = FAIL if any(c.status == FAIL for c in checks) else WARN if any(c.status == WARN for c in checks) else PASS
    by = {c.name: c for c in checks}
    verify = None
    if kv["checksums"]:
        verify = "every load checks the block's CRC32C against its xattr; a mismatch is a miss and removes the file"
        if "peer_data" in by and by["peer_data"].status == WARN:
            verify += ("; but this mount's clients keep stale page caches: a block changed through another client "
                       "can verify from the old, correct bytes here until the cache drops (no wrong data, found "
                       "later)")
    kind = m.kind if m else "unknown"
    rec = RECOMMENDED.get(kind)
    return {
        "root": root, "peer": peer, "filesystem": asdict(m) if m else None, "kind": kind,
        "checks": [asdict(c) for c in checks],
        "kvtier": {
            "io": None if kv["o_direct"] is None else ("O_DIRECT" if kv["o_direct"] else "buffered"),
            "checksums": kv["checksums"],
            "verify": verify,
            "runs": status != FAIL,
        },
        "recommended": {"kind": kind, "options": rec[0], "source": rec[1]} if rec else None,
        "status": status,
        "exit": {PASS: 0, WARN: 1, FAIL: 2}[status],
    }


def format_report(d: dict) -> str:
    lines = [f"kvtier doctor: {d['root']}" + (f" (peer {d['peer']})" if d["peer"] else "")]
    for c in d["checks"]:
        lines.append(f"  [{c['status'].upper():<4}] {c['name']:<12} {c['detail']}")
        if c["fix"]:
            lines.append(f"         {'':<12} fix: {c['fix']}")
    k = d["kvtier"]
    lines.append("")
    if k["runs"]:
        lines.append(f"kvtier here: {k['io']} I/O; checksums {'on (user xattrs work)' if k['checksums'] else 'impossible'}")
        if k["verify"]:
            lines.append(f"  verification: {k['verify']}")
    else:
        lines.append("kvtier cannot keep a checksummed cache here (see the failed checks)")
    r = d["recommended"]
    if r:
        src = "tested with kvtier" if r["source"] == "tested" else "from the filesystem's documentation, not tested here"
        lines.append(f"recommended for {r['kind']} ({src}): {r['options']}")
    lines.append(f"result: {d['status']} (exit {d['exit']})")
    return "\n".join(lines)


def add_parser(sub) -> argparse.ArgumentParser:
    from kvtier.cli._text import plain_text

    p = sub.add_parser("doctor", help="check a mount before using it as a cache root (xattrs, O_DIRECT, caches)",
                       description=plain_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", metavar="ROOT", help="the cache root (a directory)")
    p.add_argument("--peer", metavar="OTHER_MOUNT",
                   help="the same directory through another client (another node's mount)")
    p.add_argument("--wait", type=float, default=5.0,
                   help="seconds to wait for the peer to see a change (default 5)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=cmd_doctor)
    return p


def cmd_doctor(args: argparse.Namespace) -> int:
    if not (args.wait > 0):
        print("kvtier doctor: --wait must be > 0", file=sys.stderr)
        return 2
    try:
        d = run_doctor(args.root, args.peer, args.wait)
    except _Unusable as e:
        print(f"kvtier doctor: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(d, indent=2) if args.json else format_report(d))
    return d["exit"]
