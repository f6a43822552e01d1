"""The startup of a tier, the same for both shells (kvtier.manager, kvtier.vllm).

:func:`start` runs every filesystem touch of a shell's constructor under the startup
deadline (``io_timeout_s``): :func:`prepare_root` (create the root and rank directory,
prove a file can be created, with checksums that user xattrs are kept), the stale-temp
sweep, the shell's config files, the O_DIRECT probe, and the root's identity for
:class:`RootGuard`, which checks before each job that the root is still the one started
on (deleted or replaced: counted as ``root_lost``, then restored), and
:class:`GeometryGuard`, which checks that the root's ``kvtier.json`` still records this
tier's block size (another: every job refused, ``geometry_refused``).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import kvtier.io as _kio
from kvtier._blockio import policy
from kvtier._tier.deadline import run_with_deadline
from kvtier._tier.engine import JobRefused, RateLimitedWarnings

logger = logging.getLogger(__name__)


def filesystem_type(path: "str | os.PathLike") -> Tuple[str, str]:
    """``(fstype, mount_point)`` of the mount holding ``path`` (:func:`kvtier._tier.mountinfo.mount_of`),
    ``("unknown", "")`` if mountinfo is unreadable."""
    from kvtier._tier.mountinfo import mount_of

    m = mount_of(path)
    return ("unknown", "") if m is None else (m.fstype, m.mount_point)


def prepare_root(root: str, rank_path: str, checksum_blocks: bool) -> None:
    """Startup checks of a tier root, before anything else is written into it: create
    ``root`` and ``rank_path`` (the directory of this rank's block files), prove a file
    can be created there, and with ``checksum_blocks`` that the filesystem keeps user
    xattrs.  Raises OSError naming ``root`` (ENOTDIR, ENOENT, EACCES, EROFS...) or
    ValueError naming the filesystem type when it has no user xattrs."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotADirectoryError(errno.ENOTDIR, f"tier root is not a directory: {os.strerror(errno.ENOTDIR)}", root)
    try:
        for tries in range(policy.RETRY_ENOENT_STORE + 1):
            try:
                os.makedirs(root, exist_ok=True)
                os.makedirs(rank_path, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix=".kvtier_probe_", dir=rank_path)
                break
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.EEXIST, errno.ESTALE):
                    raise
                # a directory just made (here or by another node) that a shared filesystem's
                # name cache does not show yet (GlusterFS, ~1 s): ENOENT, ESTALE (a handle of
                # the other node's directory), or EEXIST from a mkdir whose directory the
                # next stat does not see; again after 2, 4 ... 512 ms, as a store's temp open
                # (error table P21)
                if tries == policy.RETRY_ENOENT_STORE:
                    raise
                time.sleep((policy.BACKOFF_US << (tries + 1)) / 1e6)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        what = "cannot be created" if e.errno in (errno.ENOTDIR, errno.ENOENT) else "is not writable"
        raise OSError(e.errno, f"tier root {what}: {e.strerror}"
                      f"{'' if e.filename in (None, root) else f' ({e.filename})'}", root) from e
    if checksum_blocks and not _kio.probe_xattr(rank_path):
        fstype, mnt = filesystem_type(root)
        raise ValueError(
            f"checksum_blocks=True needs extended attributes (user xattr "
            f"'user.vllm.kv_crc32c'), but the tier root {root!r} is on a {fstype} "
            f"filesystem (mounted at {mnt!r}) that does not support them; use another "
            f"filesystem (ext4, xfs, btrfs, tmpfs) or set checksum_blocks=False"
        )


def root_identity(root: str, rank_path: str) -> Optional[Tuple[int, ...]]:
    """(st_dev, st_ino) of the root (symlinks followed) and of the rank directory, then
    the file type of each (a file made where a directory was removed may reuse its inode
    number), or None when either is missing."""
    try:
        a, b = os.stat(root), os.stat(rank_path)
    except OSError:
        return None
    return a.st_dev, a.st_ino, b.st_dev, b.st_ino, stat.S_IFMT(a.st_mode), stat.S_IFMT(b.st_mode)


@dataclass
class Started:
    """What :func:`start` found: ``use_o_direct`` (asked for and accepted),
    ``o_direct_refused_on`` (the filesystem type where it was asked for and refused, else
    None), ``last_sweep`` (the startup sweep's :class:`kvtier._tier.sweep.SweepResult`, or
    None) and ``root_id`` (:func:`root_identity`)."""

    use_o_direct: bool
    o_direct_refused_on: Optional[str]
    last_sweep: Any
    root_id: Optional[Tuple[int, ...]]


def start(root: str, rank_path: str, config, write_config: Callable[[], None]) -> Started:
    """The startup of a tier on ``root`` (``config``: its :class:`kvtier._tier.config.TierConfig`),
    every filesystem touch under the deadline ``config.io_timeout_s`` (TimeoutError naming
    the root when the filesystem does not answer): :func:`prepare_root`, the stale-temp
    sweep when ``config.sweep_stale_temps_after`` is set, ``write_config()`` (the shell's
    config.json and kvtier.json), the O_DIRECT probe, the root's identity."""

    def body() -> Started:
        prepare_root(root, rank_path, bool(config.checksum_blocks))
        sweep = None
        if config.sweep_stale_temps_after is not None:
            from kvtier._tier.sweep import sweep_stale_temps

            sweep = sweep_stale_temps(rank_path, config.sweep_stale_temps_after)
        write_config()
        use_o_direct = bool(config.use_o_direct and _kio.probe_o_direct(rank_path))
        refused = filesystem_type(root)[0] if config.use_o_direct and not use_o_direct else None
        return Started(use_o_direct, refused, sweep, root_identity(root, rank_path))

    return run_with_deadline(body, timeout=config.io_timeout_s, path=root,
                             what=f"tier root {root!r}: startup probes (create, write, xattr, O_DIRECT, identity)")


_KINDS = ((stat.S_ISREG, "regular file"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def not_a_directory(root: str, rank_path: str) -> Optional[Tuple[str, str]]:
    """``(path, kind)`` of the first of ``root`` and the directories from it down to
    ``rank_path`` that exists and is not a directory (symlinks followed; ``kind``: "regular
    file", "FIFO" ...), or None: each is a directory, missing (can be made) or unreadable."""
    paths = [root]
    rel = os.path.relpath(rank_path, root)
    if not rel.startswith(os.pardir):
        for part in rel.split(os.sep):
            paths.append(os.path.join(paths[-1], part))
    for p in paths:
        try:
            mode = os.stat(p).st_mode
        except OSError:
            return None
        if not stat.S_ISDIR(mode):
            return p, next((name for test, name in _KINDS if test(mode)), "file that is not a directory")
    return None


class RootGuard:
    """Before each job (the engine's ``before_job``): the tier root (or its rank directory)
    deleted, or replaced by another directory (a symlink swapped), is reported (an error
    log line, rate-limited, and the ``root_lost`` counter of ``counters``), then restored:
    directories recreated and the config files written again (``write_config``), so the
    blocks stored next land in a root that says what they are.  Replaced by something that
    is not a directory (a regular file at the root or the rank directory), or not
    recreatable (EACCES, EROFS ...), nothing is made: the job is refused
    (:class:`kvtier._tier.engine.JobRefused`, that errno, ENOTDIR for a file; nothing read or
    written) until a directory can be there again, an error line at most once a minute
    (:class:`kvtier._tier.engine.RateLimitedWarnings`, no traceback).  A loss counts once
    in ``root_lost``, however many jobs it refuses.  A store that was writing while the
    root went away removes its temp (both backends unlink the temp on any failure)."""

    def __init__(self, root: str, rank_path: str, root_id, write_config: Callable[[], None], counters,
                 label: str, geometry: "Optional[GeometryGuard]" = None) -> None:
        self.root, self.rank_path, self.root_id = root, rank_path, root_id
        self.write_config, self.counters, self.label = write_config, counters, label
        self.geometry = geometry  # checked after the root (GeometryGuard.check)
        self.warnings = RateLimitedWarnings(log=logger)
        self._lost = False  # a loss found and not yet restored (counted once)
        self._lock = threading.Lock()

    def check(self) -> None:
        self._check_root()
        if self.geometry is not None:
            self.geometry.check()

    def _found_lost(self) -> None:
        if not self._lost:
            self._lost = True
            self.counters.add("root_lost")

    def _check_root(self) -> None:
        now = root_identity(self.root, self.rank_path)
        if now is not None and now == self.root_id:
            return
        with self._lock:
            now = root_identity(self.root, self.rank_path)
            if now is not None and now == self.root_id:
                return
            blocked = not_a_directory(self.root, self.rank_path)
            if blocked is not None:  # nothing can be made there: the jobs fail until it is gone
                self._found_lost()
                path, kind = blocked
                where = "" if path == self.root else f": {path!r}"
                msg = (f"tier root {self.root!r} of the {self.label} tier{where} is a {kind} now, not a directory "
                       f"(replaced while running): nothing recreated, jobs refused until a directory can be "
                       f"there again")
                self.warnings.warn("tier root not a directory", "%s", msg, level=logging.ERROR)
                raise JobRefused(errno.ENOTDIR, f"job refused: {msg}", path)
            try:
                st = os.stat(self.root)
            except OSError:
                st = None
            if self._lost:  # found lost before and not made again then (a file there, EACCES ...)
                what, done = "can be a directory again", "made again with its rank directory and config files"
            elif st is None:
                what, done = "was deleted while running", "made again with its rank directory and config files"
            elif self.root_id is not None and (st.st_dev, st.st_ino) != self.root_id[:2]:
                what = ("was replaced while running (another directory is there now: a symlink swapped, or the "
                        "directory deleted and made again)")
                done = "its rank directory and config files made in it"
            else:
                what = f"lost its rank directory {self.rank_path!r} while running (deleted or replaced)"
                done = "made again, with the config files"
            self._found_lost()
            try:
                real = os.path.realpath(self.root)  # a symlinked root whose target went: recreate that
                prepare_root(real, os.path.join(real, os.path.relpath(self.rank_path, self.root)), False)
                try:
                    self.write_config()
                except ValueError:  # another geometry's kvtier.json there now: GeometryGuard refuses
                    pass
            except OSError as e:
                msg = (f"tier root {self.root!r} of the {self.label} tier {what}, and cannot be made again "
                       f"({e.strerror or e}); jobs refused until it can")
                self.warnings.warn("tier root lost", "%s", msg, level=logging.ERROR)
                raise JobRefused(e.errno or errno.EIO, f"job refused: {msg}", self.root) from None
            self.warnings.warn("tier root lost", "tier root %r of the %s tier %s: %s", self.root, self.label, what,
                               done, level=logging.ERROR)
            self._lost = False
            self.root_id = root_identity(self.root, self.rank_path)


def _json_type(v: Any) -> str:
    """The JSON name of a parsed JSON value's type."""
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {dict: "object", list: "array", str: "string"}.get(type(v), "null")


def recorded_block_bytes(info: Any, info_path: str) -> Optional[int]:
    """The block size a tier root's ``kvtier.json`` (``info_path``) records, from its parsed
    content ``info`` (None: the file is absent, None returned).  ValueError naming the file
    and what is wrong with it when it is not a record of one: not a JSON object, no
    ``block_bytes``, or a ``block_bytes`` that is not a positive integer (a string, a
    fraction, a boolean, 0 or less)."""
    if info is None:
        return None
    fix = 'it records the tier\'s block size, {"block_bytes": N}; remove it to have it written again'
    if not isinstance(info, dict):
        raise ValueError(f"{info_path} holds a JSON {_json_type(info)}, not an object: {fix}")
    if "block_bytes" not in info:
        raise ValueError(f"{info_path} has no block_bytes: {fix}")
    v = info["block_bytes"]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{info_path} records block_bytes={json.dumps(v)} (a JSON {_json_type(v)}), not a "
                         f"positive integer: {fix}")
    return v


def check_block_info(info_path: str, info: Any, block_bytes: int) -> None:
    """ValueError naming ``info_path`` unless its parsed content ``info`` records
    ``block_bytes`` (or is None: absent): not a record of a block size
    (:func:`recorded_block_bytes`), or another one."""
    have = recorded_block_bytes(info, info_path)
    if have is not None and have != block_bytes:
        raise ValueError(f"{info_path} records block_bytes={have}, but this tier uses {block_bytes}-byte blocks; "
                         f"the same FileMapper fields must give the same block size")


def write_block_info(info_path: str, block_bytes: int, write_if_absent: Callable[[], bool],
                     read_info: Callable[[], Any]) -> bool:
    """A shell's ``kvtier.json`` at startup: written by ``write_if_absent()`` (the shell's:
    atomic, only if absent; True if it wrote it), else its content (``read_info()``, the parsed
    JSON; ValueError when not JSON) checked by :func:`check_block_info`.  True if written."""
    if write_if_absent():
        return True
    check_block_info(info_path, read_info(), block_bytes)
    return False


def info_signature(path: str) -> Optional[Tuple[int, int, int, int]]:
    """(st_dev, st_ino, st_mtime_ns, st_size) of a tier's kvtier.json, None when absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class GeometryGuard:
    """Before each job (after :class:`RootGuard`'s root check): the root's ``kvtier.json``
    (``info_path``) still records this tier's ``block_size``, so that two geometries on one
    root never judge each other's blocks (issue #24: a tier of another block size condemned
    the files of this one for their size).  One stat per job; the file is read again only
    when its (st_dev, st_ino, st_mtime_ns, st_size) changed.  Absent (removed while running,
    or the tree removed and made again by an in-flight store under inode numbers the filesystem
    reused, which :class:`RootGuard`'s identity check cannot see): written again with the
    shell's ``config.json`` (``write_info()``, the shell's: atomic, only if absent, ValueError
    when another's appeared meanwhile).  Recording another size, or nothing a block size can
    be read from (``read_info()`` gives its parsed content, ValueError when it is not JSON;
    :func:`recorded_block_bytes`): an error log line once per change, and every job refused (:class:`kvtier._tier.engine.JobRefused`, EINVAL, nothing read or
    written; counted ``geometry_refused``) until it records this size again.  An OSError
    while finding out (EIO, ESTALE ...) refuses nothing."""

    def __init__(self, info_path: str, block_size: int, read_info: Callable[[], Any],
                 write_info: Callable[[], Any], counters, label: str, checked: Any = ()) -> None:
        self.info_path, self.block_size = info_path, block_size
        self.read_info, self.write_info = read_info, write_info
        self.counters, self.label = counters, label
        # checked: the file's signature (info_signature) when the startup wrote or checked it, under
        # its deadline; () is never a real signature: the first job reads the file
        self._sig: Any = checked
        self._refusal: Optional[str] = None
        self._lock = threading.Lock()

    def _signature(self) -> Optional[Tuple[int, int, int, int]]:
        return info_signature(self.info_path)

    def check(self) -> None:
        try:
            sig = self._signature()
        except OSError:
            return  # cannot tell: not a reason to refuse
        if sig is None or sig != self._sig:
            with self._lock:
                refusal = None
                try:
                    if self._signature() is None:
                        logger.warning("%s is missing (removed while the %s tier runs): written again with "
                                       "block_bytes=%d", self.info_path, self.label, self.block_size)
                        self.write_info()
                    else:
                        have = recorded_block_bytes(self.read_info(), self.info_path)  # ValueError: no record
                        if have is not None and have != self.block_size:
                            raise ValueError(f"{self.info_path} records block_bytes={have}, but this tier uses "
                                             f"{self.block_size}-byte blocks: another block geometry on this "
                                             f"tier root")
                    sig_now = self._signature()
                except ValueError as e:  # another geometry's, or no record of one (not JSON, ...)
                    refusal = str(e)
                    sig_now = self._signature()
                except OSError:
                    return
                if refusal and refusal != self._refusal:
                    logger.error("%s; the %s tier refuses its jobs (nothing read or written) until kvtier.json "
                                 "records block_bytes=%d again", refusal, self.label, self.block_size)
                elif not refusal and self._refusal:
                    logger.warning("%s records block_bytes=%d again: the %s tier serves its jobs",
                                   self.info_path, self.block_size, self.label)
                self._refusal = refusal
                self._sig = sig_now  # after the refusal: a job that sees this signature sees it
        refusal = self._refusal
        if refusal:
            self.counters.add("geometry_refused")
            raise JobRefused(errno.EINVAL, f"job refused: {refusal}", self.info_path)
