"""kvtier pure-Python fallback: the same contracts as the C core (kvtier._C).

CRC32C (numpy) and batched checksummed block I/O, used when the C core is not
built or when forced (KVTIER_IO_BACKEND=python). Two sections, each
starting with a "# --- name ---" line: CRC32C, block I/O.
"""
from __future__ import annotations

# --- CRC32C ---
# crc32c(data, value=0) and crc32c_combine(crc1, crc2, len2): the numpy
# implementation lives in the private kvtier._fallback_crc (see its docstring
# for the method); kvtier itself uses that module for the "numpy" backend.
#
# Warning policy: importing this public module while the C core is importable
# means someone picked the slow path by hand, so the import warns once
# (RuntimeWarning; a module body runs once per process). Imports made by
# kvtier's own modules (e.g. kvtier.io with KVTIER_IO_BACKEND=python, an
# explicit choice already) do not warn: the importer is found by walking out
# of the import machinery's frames.
import sys as _sys
import warnings as _warnings

from kvtier._fallback_crc import POLY, crc32c, crc32c_combine  # noqa: F401


def _imported_by_kvtier() -> bool:
    f = _sys._getframe(2)  # 0: here, 1: this module's body, 2+: the importer
    while f is not None and f.f_code.co_filename.startswith("<frozen importlib"):
        f = f.f_back
    name = f.f_globals.get("__name__", "") if f is not None else ""
    return name == "kvtier" or name.startswith("kvtier.")


def _c_core_importable() -> bool:
    try:
        from kvtier import _C  # noqa: F401
    except ImportError:
        return False
    return True


if _c_core_importable() and not _imported_by_kvtier():
    _warnings.warn(
        "kvtier.fallback imported although the C core (kvtier._C) is available: "
        "the pure-Python CRC32C and block I/O are much slower; use kvtier.crc32c / kvtier.io",
        RuntimeWarning,
        stacklevel=2,
    )

# --- block I/O ---
# Pure-Python twin of csrc/fs_io.c: same protocols, same errors, same on-disk
# bytes (design.md "On-disk contract"). Used when the C core is missing or
# KVTIER_IO_BACKEND=python. Signatures match kvtier._C.

import ctypes as _ctypes
import errno as _errno
import fcntl as _fcntl
import os as _os
import stat as _stat
import struct as _struct
import threading as _threading

import numpy as _np  # already loaded by kvtier._fallback_crc

XATTR_NAME = "user.vllm.kv_crc32c"
"""xattr holding a block's CRC32C (4 bytes big-endian); vLLM FS tier name."""
XATTR_LEN = 4
IO_CHUNK = 256 * 1024
"""Bytes per read/write call; each chunk is checksummed next to its I/O (fs_io.h KVT_IO_CHUNK)."""
DIO_FALLBACK_ALIGN = 4096
"""O_DIRECT alignment assumed when statx STATX_DIOALIGN is not reported (fs_io.h)."""

_STATX_SIZE = 0x200  # linux/stat.h
_STATX_DIOALIGN = 0x2000  # linux/stat.h, Linux >= 6.1
_AT_EMPTY_PATH = 0x1000  # linux/fcntl.h

try:
    _libc = _ctypes.CDLL(None, use_errno=True)
    _statx = _libc.statx
    _statx.argtypes = [_ctypes.c_int, _ctypes.c_char_p, _ctypes.c_int, _ctypes.c_uint, _ctypes.c_void_p]
    _statx.restype = _ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - glibc < 2.28
    _statx = None


def _block_crc_fn():
    """The fastest CRC32C available: the C core's dispatched backend, else the
    numpy fallback of this module (CRC section above)."""
    try:
        from kvtier import _C

        return _C.crc32c
    except ImportError:
        return globals()["crc32c"]


_copy_fn_cache = []
_tls = _threading.local()


def _block_copy_fn():
    """The C core's fused copy + CRC32C (kvtier._C.crc32c_copy) when the C
    core is importable and its copy path is enabled (crc_copy_status(): a
    fused kernel, KVTIER_CRC_COPY not off, the best CPU backend active), else
    None. Checksummed buffered loads then read each chunk into a per-thread
    bounce buffer and move it with it, as the C core does (docs/block_io.md,
    "Fused copy")."""
    if not _copy_fn_cache:
        fn = None
        try:
            from kvtier import _C

            if _C.crc_copy_status()["enabled"]:
                fn = _C.crc32c_copy
        except ImportError:
            pass
        _copy_fn_cache.append(fn)
    return _copy_fn_cache[0]


def _checksum_then_copy(crc_fn):
    """The copy of a private re-read: CRC32C of the bounce buffer's chunk
    (crc_fn), then the chunk copied to the caller's buffer."""

    def copy(dst, src, value):
        value = crc_fn(src, value)
        dst[:] = src
        return value

    return copy


def _bounce_take():
    """An IO_CHUNK-byte bounce buffer (memoryview) from this thread's free
    list, or a new one. Python code can run on this thread in the middle of a
    load (a signal handler, a finalizer) and load too: each load holds its own
    buffer until _bounce_give."""
    free = getattr(_tls, "free", None)
    if free is None:
        free = _tls.free = []
    return free.pop() if free else memoryview(bytearray(IO_CHUNK))


def _bounce_give(b):
    _tls.free.append(b)


def _dio_align(fd):
    """(mem_align, offset_align) for O_DIRECT on fd; (0, 0) when the filesystem
    reports no O_DIRECT support (statx STATX_DIOALIGN with zero alignment)."""
    if _statx is not None:
        buf = _ctypes.create_string_buffer(256)  # struct statx is 256 bytes
        if _statx(fd, b"", _AT_EMPTY_PATH, _STATX_SIZE | _STATX_DIOALIGN, buf) == 0:
            mask = _struct.unpack_from("<I", buf, 0)[0]
            if mask & _STATX_DIOALIGN:
                mem, off = _struct.unpack_from("<II", buf, 152)  # stx_dio_mem_align, stx_dio_offset_align
                return (mem, off) if mem and off else (0, 0)
    return DIO_FALLBACK_ALIGN, DIO_FALLBACK_ALIGN


def _buffer_address(mv):
    return _np.frombuffer(mv, dtype=_np.uint8).__array_interface__["data"][0] if len(mv) else 0


def _dio_usable(fd, mv):
    mem, off = _dio_align(fd)
    if not mem or IO_CHUNK % max(mem, off):
        return False
    return len(mv) > 0 and _buffer_address(mv) % mem == 0 and len(mv) % off == 0


def _set_direct(fd, on):
    fl = _fcntl.fcntl(fd, _fcntl.F_GETFL)
    _fcntl.fcntl(fd, _fcntl.F_SETFL, (fl | _os.O_DIRECT) if on else (fl & ~_os.O_DIRECT))


def _try_direct(fd, mv):
    if not _dio_usable(fd, mv):
        return False
    try:
        _set_direct(fd, True)  # EINVAL: the filesystem refuses O_DIRECT
    except OSError:
        return False
    return True


def _batch_error(err, path, index, checksum_failed, num_retried=0):
    exc = OSError(err, _os.strerror(err), path)  # the errno's subclass, e.g. FileNotFoundError
    exc.num_succeeded = index
    exc.checksum_failed = checksum_failed
    exc.num_retried = num_retried  # loads: blocks re-read after a first mismatch, failing one included
    return exc


def _check_list(obj, what):
    if not isinstance(obj, (list, tuple)):
        raise TypeError(f"{what} must be a list, not {type(obj).__name__}")


def _encode_paths(seq, what):
    out = []
    for i, p in enumerate(seq):
        if not isinstance(p, (str, bytes)) and not hasattr(p, "__fspath__"):
            raise TypeError(f"{what}[{i}] must be str, bytes or os.PathLike, not {type(p).__name__}")
        b = _os.fsencode(p)
        if b"\0" in b:
            raise ValueError(f"{what}[{i}]: embedded null byte")
        out.append(b)
    return out


def _views(buffers, writable):
    out = []
    for i, b in enumerate(buffers):
        mv = memoryview(b)  # TypeError for a non-buffer
        if not mv.c_contiguous:
            raise BufferError(f"buffers[{i}]: {type(b).__name__} object is not C-contiguous")
        if writable and mv.readonly:
            raise BufferError(f"buffers[{i}] must be a writable C-contiguous buffer: {type(b).__name__} is read-only")
        out.append(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv)
    return out


def _retry_io(op, fd, mv, off, direct):
    """op(fd, mv, off) -> bytes moved, with the retry rule of fs_io.c retry_io:
    EINTR is retried by Python itself (PEP 475); EINVAL under O_DIRECT (the
    filesystem refusing it, or an unaligned offset after a short I/O) drops
    O_DIRECT for the rest of the file and retries buffered. Returns
    (bytes moved, direct)."""
    while True:
        try:
            return op(fd, mv, off), direct
        except OSError as e:
            if e.errno != _errno.EINVAL or not direct:
                raise
            _set_direct(fd, False)
            direct = False


def _preadv_into(fd, mv, off):
    return _os.preadv(fd, [mv], off)


def _write_full(fd, mv, off, direct):
    """pwrite all of mv at file offset off (_retry_io). Returns direct."""
    done = 0
    n = len(mv)
    while done < n:
        w, direct = _retry_io(_os.pwrite, fd, mv[done:], off + done, direct)
        if w == 0:
            raise OSError(_errno.EIO, _os.strerror(_errno.EIO))
        done += w
    return direct


def _read_full(fd, mv, off, direct):
    """preadv into mv at file offset off until full or EOF (_retry_io).
    Returns (got, direct)."""
    got = 0
    n = len(mv)
    while got < n:
        r, direct = _retry_io(_preadv_into, fd, mv[got:], off + got, direct)
        if r == 0:
            break
        got += r
    return got, direct


def _retry_eintr(fn, *args):
    """fn(*args), retried on InterruptedError. CPython retries EINTR itself
    (PEP 475) for os.open, os.pwrite, os.preadv, os.fsync, os.fdatasync, but
    not for os.setxattr, os.getxattr or os.rename, which raise it."""
    while True:
        try:
            return fn(*args)
        except InterruptedError:
            continue


def _close(fd):
    """os.close, with EINTR counted as success: Linux releases the descriptor
    even then (close(2) NOTES), and CPython's os.close does not retry it
    (a retry could close a descriptor another thread just got)."""
    try:
        _os.close(fd)
    except InterruptedError:
        pass


def _fsync_dir(path):
    """fsync the directory holding ``path`` (makes its rename
    durable); EINVAL (not supported by the filesystem) counts as done."""
    d = _os.path.dirname(path) or (b"." if isinstance(path, bytes) else ".")
    fd = _os.open(d, _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC)
    try:
        _os.fsync(fd)
    except OSError as e:
        if e.errno != _errno.EINVAL:
            raise
    finally:
        _close(fd)


def _store_one(tmp, dest, mv, use_o_direct, checksum, crc_fn, durable=False):
    if _os.path.exists(dest):
        return
    flags = _os.O_CREAT | _os.O_EXCL | _os.O_WRONLY | _os.O_CLOEXEC
    try:
        fd = _os.open(tmp, flags, 0o644)
    except FileNotFoundError:
        parent = _os.path.dirname(tmp)
        if parent:
            _os.makedirs(parent, mode=0o755, exist_ok=True)
        fd = _os.open(tmp, flags, 0o644)
    try:
        try:
            direct = use_o_direct and _try_direct(fd, mv)
            crc = 0
            for off in range(0, len(mv), IO_CHUNK):
                chunk = mv[off : off + IO_CHUNK]
                if checksum:
                    crc = crc_fn(chunk, crc)
                direct = _write_full(fd, chunk, off, direct)
            if checksum:
                _retry_eintr(_os.setxattr, fd, XATTR_NAME, crc.to_bytes(XATTR_LEN, "big"))
            if durable:  # data before the name
                _os.fdatasync(fd)
                mine = _os.fstat(fd)  # to tell our published file from a peer's later
        finally:
            _close(fd)
        _retry_eintr(_os.rename, tmp, dest)
    except BaseException:
        try:
            _os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        try:
            _fsync_dir(dest)
        except BaseException:
            # Published but not durable: a failed store leaves nothing. Only our
            # own file, though: a peer that renamed its block onto dest after
            # our rename (its exists() ran before it) keeps its block.
            try:
                now = _os.stat(dest)
                if (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
                    _os.unlink(dest)
            except OSError:
                pass
            raise


_stats_lock = _threading.Lock()
_stats = {"checksum_retries": 0, "checksum_condemned": 0}


def _count(key):
    with _stats_lock:
        _stats[key] += 1


def checksum_stats():
    """Process-wide counters of batch_load_block, like kvtier._C.checksum_stats():
    checksum_retries (first mismatches, re-read once), checksum_condemned."""
    with _stats_lock:
        return dict(_stats)


def _whole_file_verifies(fd, size, crc_fn):
    """True if the open file's xattr record is a 4-byte CRC32C matching all ``size`` bytes."""
    try:
        rec = _os.getxattr(fd, XATTR_NAME)
    except OSError:
        return False
    if len(rec) != 4:
        return False
    crc, off = 0, 0
    while off < size:
        chunk = _os.pread(fd, min(IO_CHUNK, size - off), off)
        if not chunk:
            return False
        crc = crc_fn(chunk, crc)
        off += len(chunk)
    return crc == _struct.unpack(">I", rec)[0]


def _read_verify(fd, mv, use_o_direct, checksum, crc_fn, reread=False):
    """Record then data. Returns (mismatch, short): mismatch for a CRC
    mismatch or malformed record; short for a short read. OSErrors from
    getxattr other than ENODATA, or from read, propagate (file kept).
    ``reread`` (after a mismatch): buffered, each chunk checksummed in a
    private bounce buffer and then copied, so the block is judged on bytes no
    other thread of the caller can write (as the C core does)."""
    want = None
    if checksum:
        try:
            rec = _retry_eintr(_os.getxattr, fd, XATTR_NAME)
        except OSError as e:
            if e.errno == _errno.ERANGE:
                return True, False
            if e.errno != _errno.ENODATA:
                raise  # EOPNOTSUPP, EIO ...: not the block's fault, keep it
            rec = None  # legacy block stored without checksum
        if rec is not None:
            if len(rec) != XATTR_LEN:
                return True, False
            want = int.from_bytes(rec, "big")
    private = reread and want is not None
    direct = not private and use_o_direct and _try_direct(fd, mv)
    if not direct and _fcntl.fcntl(fd, _fcntl.F_GETFL) & _os.O_DIRECT:
        _set_direct(fd, False)
    crc = 0
    copy_fn = _block_copy_fn() if not direct else None
    # A checksummed buffered load goes through the fused copy; a re-read always goes through
    # a bounce buffer, checksummed there.
    if private:
        copy_fn = _checksum_then_copy(crc_fn)
    elif want is None:
        copy_fn = None
    if copy_fn is not None:  # read into a bounce buffer, then one pass of copy + CRC
        bounce = _bounce_take()
        try:
            for off in range(0, len(mv), IO_CHUNK):
                n = min(IO_CHUNK, len(mv) - off)
                b = bounce if n == IO_CHUNK else bounce[:n]
                got = _os.preadv(fd, [b], off)  # buffered: only EINTR to retry, which os.preadv does (PEP 475)
                if got < n:  # short read: finish it the general way
                    more, direct = _read_full(fd, b[got:], off + got, direct)
                    if got + more < n:
                        return False, True
                crc = copy_fn(mv[off : off + n], b, crc)
        finally:
            _bounce_give(bounce)
        return crc != want, False
    for off in range(0, len(mv), IO_CHUNK):
        chunk = mv[off : off + IO_CHUNK]
        got, direct = _read_full(fd, chunk, off, direct)
        if got < len(chunk):
            return False, True
        if want is not None:
            crc = crc_fn(chunk, crc)
    return want is not None and crc != want, False


def _load_one(src, mv, use_o_direct, checksum, crc_fn, retried_out):
    """Returns (None, retried) or ((errno, checksum_failed), retried) after
    removing the file when the table in design.md says so. A first mismatch is
    retried once (page cache dropped); a second condemns the block. Other
    OSErrors propagate (file kept). ``retried_out[0]`` is set True when the
    block is re-read, so a caller sees it even when the re-read raises."""
    # O_NOFOLLOW: a block is never a symlink (ELOOP, kept). O_NONBLOCK: a FIFO or
    # device at a block path must not block the batch; a regular file ignores it.
    fd = _os.open(src, _os.O_RDONLY | _os.O_CLOEXEC | _os.O_NOFOLLOW | _os.O_NONBLOCK)
    remove = False
    retried = False
    try:
        n = len(mv)
        st = _os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):  # not ours to judge or remove: kept
            e = _errno.EISDIR if _stat.S_ISDIR(st.st_mode) else _errno.EINVAL
            raise OSError(e, _os.strerror(e), src)
        if st.st_size != n:  # truncated, empty or longer: corrupt, unless its own record
            # proves its bytes intact (the caller asked for another block size): then kept
            remove = not (checksum and _whole_file_verifies(fd, st.st_size, crc_fn))
            return (_errno.EIO, False), retried
        for attempt in range(2):
            mismatch, short = _read_verify(fd, mv, use_o_direct, checksum, crc_fn, attempt > 0)
            if short:
                remove = True
                return (_errno.EIO, False), retried
            if not mismatch:
                return None, retried
            if attempt == 0:
                _count("checksum_retries")
                retried = retried_out[0] = True
                _os.posix_fadvise(fd, 0, n, _os.POSIX_FADV_DONTNEED)  # re-read from the device
        _count("checksum_condemned")
        remove = True
        return (_errno.EBADMSG, True), retried
    finally:
        try:
            if remove:
                _unlink_if_same(src, fd)
        finally:
            _close(fd)


def _unlink_if_same(path, fd):
    """Remove ``path`` only if it is still the file open as ``fd``: a peer that
    republished a good block under the same name meanwhile keeps it."""
    try:
        a, b = _os.fstat(fd), _os.stat(path)
        if (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev):
            _os.unlink(path)
    except OSError:
        pass


def batch_lookup(paths, /):
    """For each path (str, bytes or os.PathLike) whether it exists (stat(2)).
    Returns list[bool]. TypeError for a non-list or a bad path type."""
    _check_list(paths, "paths")
    return [_os.path.exists(p) for p in _encode_paths(paths, "paths")]


def batch_store_block(tmp_paths, dest_paths, buffers, /, use_o_direct=True, checksum=False, durable=False):
    """Pure-Python kvtier._C.batch_store_block: same arguments, protocol and
    errors (OSError with errno, filename = dest path, num_succeeded,
    checksum_failed=False, num_retried=0; the failing block's temp is removed). With
    ``durable``: os.fdatasync of the temp before the rename, os.fsync of the
    directory after."""
    for obj, what in ((tmp_paths, "tmp_paths"), (dest_paths, "dest_paths"), (buffers, "buffers")):
        _check_list(obj, what)
    if not len(tmp_paths) == len(dest_paths) == len(buffers):
        raise ValueError(
            "tmp_paths, dest_paths and buffers must have equal lengths "
            f"({len(tmp_paths)}, {len(dest_paths)}, {len(buffers)})"
        )
    tmps = _encode_paths(tmp_paths, "tmp_paths")
    dests = _encode_paths(dest_paths, "dest_paths")
    views = _views(buffers, writable=False)
    crc_fn = _block_crc_fn() if checksum else None
    for i, (tmp, dest, mv) in enumerate(zip(tmps, dests, views)):
        try:
            _store_one(tmp, dest, mv, bool(use_o_direct), bool(checksum), crc_fn, bool(durable))
        except OSError as e:
            raise _batch_error(e.errno or _errno.EIO, dest_paths[i], i, False) from None


def batch_load_block(source_paths, buffers, /, use_o_direct=True, checksum=False):
    """Pure-Python kvtier._C.batch_load_block: same arguments, protocol,
    return value (blocks re-read once after a first mismatch, int) and errors
    (design.md table: EBADMSG + checksum_failed and EIO remove the file; any
    other errno keeps it). The OSError's ``num_retried`` (int) counts the
    blocks of the batch re-read after a first mismatch, the failing block
    included (1 for a block condemned on its re-read)."""
    _check_list(source_paths, "source_paths")
    _check_list(buffers, "buffers")
    if len(source_paths) != len(buffers):
        raise ValueError(f"source_paths and buffers must have equal lengths ({len(source_paths)}, {len(buffers)})")
    srcs = _encode_paths(source_paths, "source_paths")
    views = _views(buffers, writable=True)
    crc_fn = _block_crc_fn() if checksum else None
    retried_total = 0
    for i, (src, mv) in enumerate(zip(srcs, views)):
        retried_out = [False]
        try:
            failed, retried = _load_one(src, mv, bool(use_o_direct), bool(checksum), crc_fn, retried_out)
        except OSError as e:
            raise _batch_error(e.errno or _errno.EIO, source_paths[i], i, False,
                               retried_total + retried_out[0]) from None
        retried_total += retried
        if failed is not None:
            raise _batch_error(failed[0], source_paths[i], i, failed[1], retried_total)
    return retried_total
