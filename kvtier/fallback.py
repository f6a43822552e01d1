"""kvtier pure-Python fallback: the same contracts as the C core (kvtier._C).

CRC32C (numpy) and batched checksummed block I/O, used when the C core is not
built or when forced (KVTIER_IO_BACKEND=python). A second, independent
implementation: it borrows nothing from the C core (its CRC is the numpy one, its
copy and its job-state CAS its own), so its tests test it, with the C core built or
not. What both backends share is the contract in kvtier._blockio (records and their
judgement, policy names, argument checks, job state). Two sections, each starting
with a "# --- name ---" line: CRC32C, block I/O.
"""
from __future__ import annotations

# --- CRC32C ---
# crc32c(data, value=0) and crc32c_combine(crc1, crc2, len2): the numpy
# implementation lives in the private kvtier._blockio.numpy_crc (see its docstring
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

from kvtier._blockio.numpy_crc import POLY, crc32c, crc32c_combine  # noqa: F401


def _imported_by_kvtier() -> bool:
    f = _sys._getframe(2)  # 0: here, 1: this module's body, 2+: the importer
    while f is not None and f.f_code.co_filename.startswith("<frozen importlib"):
        f = f.f_back
    name = f.f_globals.get("__name__", "") if f is not None else ""
    return name == "kvtier" or name.startswith("kvtier.")


def _c_core_built() -> bool:
    """Whether the C core is importable (only for the warning below: nothing of it is
    used here). kvtier/__init__.py sets ``kvtier._C = None`` when it is not."""
    try:
        from kvtier import _C
    except ImportError:
        return False
    return _C is not None


if _c_core_built() and not _imported_by_kvtier():
    _warnings.warn(
        "kvtier.fallback imported although the C core (kvtier._C) is available: "
        "the pure-Python CRC32C and block I/O are much slower; use kvtier.crc32c / kvtier.io",
        RuntimeWarning,
        stacklevel=2,
    )

# --- block I/O ---
# Pure-Python twin of csrc/block/block.c: same protocols, same errors, same on-disk
# bytes (design.md "On-disk contract"). Used when the C core is missing or
# KVTIER_IO_BACKEND=python. Signatures match kvtier._C.

import contextlib as _contextlib
import errno as _errno
import fcntl as _fcntl
import mmap as _mmap
import os as _os
import stat as _stat
import threading as _threading
import time as _time

from kvtier._blockio import args as _args
from kvtier._blockio import jobstate as _js
from kvtier._blockio import policy as _policy
from kvtier._blockio import records as _rec
from kvtier._blockio.buffers import buffer_address as _buffer_address
from kvtier._blockio.records import XATTR_LEN, XATTR_NAME  # noqa: F401 (XATTR_NAME: kvtier.fallback's name)

IO_CHUNK = 256 * 1024
"""Bytes per read/write call; each chunk is checksummed next to its I/O (as the C engine's
buffered pieces, csrc/block/engine.h KVT_ENGINE_CHUNK)."""
DIO_ALIGN = 4096
"""The C core's O_DIRECT rule (block.c store_try / load_try): O_DIRECT for a block whose
length is a multiple of this (what every filesystem's O_DIRECT accepts) and, where the I/O
moves the caller's memory itself, whose address is too; not the filesystem's reported
minimum (statx STATX_DIOALIGN, often 512), so both backends pick the same mode and count
the same ``buffered_unaligned``. A filesystem refusing O_DIRECT (EINVAL) is buffered."""


_tls = _threading.local()
_copy_fn_cache = []


def _block_copy_fn():
    """The copy + CRC32C of a checksummed buffered load: each chunk read into a per-thread
    bounce buffer, its CRC32C taken there (numpy) and the chunk copied to the caller's
    buffer, so the bytes checksummed are the bytes copied, as the C core's fused copy
    (docs/block_io.md, "Fused copy"). In a list: tests replace it (a spy, or None for the
    read straight into the caller's buffer)."""
    if not _copy_fn_cache:
        _copy_fn_cache.append(_checksum_then_copy(crc32c))
    return _copy_fn_cache[0]


def _plain_copy(dst, src, value):
    """The copy of a load without CRC record through the bounce buffer."""
    dst[:] = src
    return value


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
    # mmap: page aligned, so O_DIRECT can read and write it whatever the caller's buffer
    return free.pop() if free else memoryview(_mmap.mmap(-1, IO_CHUNK))


def _bounce_give(b):
    _tls.free.append(b)


def _dio_usable(mv, bounce=False):
    """Whether the C core would move mv's bytes O_DIRECT (DIO_ALIGN): its length and
    (unless ``bounce``: a load through this module's page-aligned bounce buffers, as the
    C core's through its private slots; stores never) its address aligned."""
    return len(mv) > 0 and len(mv) % DIO_ALIGN == 0 and (bounce or _buffer_address(mv) % DIO_ALIGN == 0)


def _set_direct(fd, on):
    fl = _fcntl.fcntl(fd, _fcntl.F_GETFL)
    _fcntl.fcntl(fd, _fcntl.F_SETFL, (fl | _os.O_DIRECT) if on else (fl & ~_os.O_DIRECT))


def _try_direct(fd, mv, bounce=False):
    if not _dio_usable(mv, bounce):
        return False
    try:
        _set_direct(fd, True)  # EINVAL: the filesystem refuses O_DIRECT
    except OSError:
        return False
    return True


def _condemned_message(err, cause, size_seen, size_expected, size_kept=None):
    """The message of an error, saying why a condemned block was, or why a file
    of another size than the block size was kept (csrc/py/blockio.c
    raise_batch_error)."""
    if size_kept is not None and cause is None:
        head = (f"block size mismatch (kept): the file has {size_seen} bytes, the block size asked for is "
                f"{size_expected}; ")
        if size_kept == "intact":
            return head + "its own CRC record verifies all its bytes (a block of another block size)"
        return head + "not confirmed (its size changed between opens, or its record could not be read)"
    if cause == "size":
        return f"block condemned (size): {size_seen} bytes, expected {size_expected}"
    if cause == "checksum":
        return "block condemned (checksum): CRC32C mismatch (or malformed record) on two reads"
    if cause == "identity":
        return "block condemned (identity): identity record of another block or layout on two reads"
    if cause == "short_read":
        return f"block condemned (short_read): short read of {size_expected} bytes on two opens"
    return _os.strerror(err)


def _batch_error(err, path, index, checksum_failed, num_retried=0, operation="", condemned=None,
                 size_seen=0, size_expected=0, size_kept=None):
    # the errno's subclass, e.g. FileNotFoundError
    exc = OSError(err, _condemned_message(err, condemned, size_seen, size_expected, size_kept), path)
    exc.operation = operation  # the failing call (kvtier._blockio.policy.OPERATIONS)
    exc.condemned = condemned  # kvtier._blockio.policy.CAUSES when the file was removed, else None
    exc.num_succeeded = index
    exc.checksum_failed = checksum_failed
    exc.num_retried = num_retried  # loads: blocks re-read after a first mismatch, failing one included
    return exc


def _retry_io(op, fd, mv, off, direct):
    """op(fd, mv, off) -> bytes moved, with the retry rule of block.c retry_io:
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
    """fn(*args), retried on InterruptedError up to kvtier._blockio.policy.RETRY_EINTR_MAX
    times in a row (then raised). CPython retries EINTR itself
    (PEP 475) for os.open, os.pwrite, os.preadv, os.fsync, os.fdatasync, but
    not for os.setxattr, os.getxattr or os.rename, which raise it."""
    for n in range(_policy.RETRY_EINTR_MAX + 1):
        try:
            return fn(*args)
        except InterruptedError:
            if n == _policy.RETRY_EINTR_MAX:
                raise
            counts = getattr(_tls, "counts", None)
            if counts is not None:
                _count_into(counts, "retry_eintr")
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


def _op(name, fn, *args):
    """fn(*args); an OSError it raises gets ``kvt_op = name`` (the batch error's
    ``operation``) unless an inner call already named it."""
    try:
        return fn(*args)
    except OSError as e:
        if getattr(e, "kvt_op", None) is None:
            e.kvt_op = name
        raise


def _open_tmp(tmp, flags):
    """Create a store's temp; on ENOENT make its parents and open again, and while ENOENT
    persists once they were made, or making them fails with ENOENT or EEXIST (a shared
    filesystem's name cache), again after 2, 4 ... 512 ms (policy.RETRY_ENOENT_STORE, as
    csrc/block/block.c open_tmp)."""
    parent = _os.path.dirname(tmp)
    for tries in range(_policy.RETRY_ENOENT_STORE + 2):
        try:
            return _op("open", _os.open, tmp, flags, 0o644)
        except FileNotFoundError:
            if not parent or tries > _policy.RETRY_ENOENT_STORE:
                raise
        try:
            _op("mkdir", _os.makedirs, parent, 0o755, True)
        except (FileNotFoundError, FileExistsError):
            pass  # a parent just made (here or by another node) not shown yet: again after the pause
        if tries > 0:
            _time.sleep((1000 << tries) / 1e6)


def _count_into(counts, name, n=1):
    counts[name] = counts.get(name, 0) + n


def _sync_existing(dest, counts):
    """A durable store of a block already there: fsync it and its directory
    (another job's block may not be durable yet). OSError names the call."""
    fd = _op("open", _os.open, dest, _os.O_RDONLY | _os.O_CLOEXEC | _os.O_NOFOLLOW | _os.O_NONBLOCK)
    try:
        _op("sync", _os.fsync, fd)
    finally:
        _close_quiet(fd)
    _op("sync", _fsync_dir, dest)
    _count_into(counts, "durable_existing")


def _lacks_crc_record(dest):
    """Whether the block file at ``dest`` has no CRC record (ENODATA for
    user.vllm.kv_crc32c, and its identity record absent or without CRC): a load
    reads it unverified, or in strict mode never (P17). Any other answer (a
    record, EOPNOTSUPP, EIO) says no: the block is left as it is
    (csrc/block/block.c lacks_crc_record)."""
    try:
        if len(_retry_eintr(lambda: _os.getxattr(dest, _rec.ID_XATTR_NAME, follow_symlinks=False))) == _rec.ID_REC_LEN:
            return False
    except OSError:
        pass
    try:
        _retry_eintr(lambda: _os.getxattr(dest, XATTR_NAME, follow_symlinks=False))
    except OSError as e:
        return e.errno == _errno.ENODATA
    return False


class _Late(Exception):
    """A store's block was renamed, but its job expired during the rename."""


class _Expired(Exception):
    """A load's job was not live at its commit section (or expired during it)."""


class _Section:
    """The commit section of the direct landing around the bytes that enter the caller's
    row (csrc/block/block.c read_verify: after the open, the records and the fstat, so a
    stalled one holds no section and the job is reported at its deadline); _Expired when
    the job is not live at its start, or was expired during it."""

    __slots__ = ("word",)

    def __init__(self, word):
        self.word = word

    def __enter__(self):
        if not self.word.step(_js.LIVE, _js.COMMITTING):
            raise _Expired

    def __exit__(self, typ, exc, tb):
        if not self.word.step(_js.COMMITTING, _js.LIVE) and typ is None:
            raise _Expired


_NO_SECTION = _contextlib.nullcontext()


def _store_try(tmp, dest, mv, use_o_direct, checksum, crc_fn, durable, counts, word=None):
    try:
        st = _os.lstat(dest)
    except OSError:  # absent, or not known (EIO ...): stored anew, as the C core
        st = None
    keep = st is not None and _stat.S_ISREG(st.st_mode) and st.st_size == len(mv)  # stored (by us or a peer)
    if keep and checksum and _lacks_crc_record(dest):
        keep = False  # unverifiable (strict: a miss for ever): replaced by the verified copy of mv
    if keep:
        try:
            if durable:
                _sync_existing(dest, counts)
            _count_into(counts, "existing")
            return
        except FileNotFoundError as e:
            if getattr(e, "kvt_op", None) != "open":
                raise
            # gone since the lstat (a peer, a condemnation): stored anew below
    elif st is not None:
        if _stat.S_ISDIR(st.st_mode):  # not ours to remove; never "stored"
            e = OSError(_errno.EISDIR, _os.strerror(_errno.EISDIR), dest)
            e.kvt_op = "rename"
            raise e
        _count_into(counts, "replaced")  # symlink, FIFO, file of another size, no CRC record: the rename replaces it
    flags = _os.O_CREAT | _os.O_EXCL | _os.O_WRONLY | _os.O_CLOEXEC
    fd = _open_tmp(tmp, flags)
    try:
        try:
            # O_DIRECT only when mv's address is page aligned: every store writes straight from
            # mv (as csrc/block/engine.c); an unaligned one is buffered, counted once by
            # _store_one when stored (as block.c)
            direct = use_o_direct and _try_direct(fd, mv)
            unaligned = use_o_direct and _dio_usable(mv, bounce=True) and not _dio_usable(mv)
            crc = 0
            if direct or not checksum:  # one write of the whole block, then one CRC pass over it
                direct = _op("write", _write_full, fd, mv, 0, direct)
                if checksum:
                    crc = crc_fn(mv, 0)
            else:  # buffered with checksum: each chunk checksummed right after its write
                for off in range(0, len(mv), IO_CHUNK):
                    chunk = mv[off : off + IO_CHUNK]
                    direct = _op("write", _write_full, fd, chunk, off, direct)
                    crc = crc_fn(chunk, crc)
            if checksum:
                # vLLM's record, and kvtier's identity record carrying the same CRC (what a
                # load reads: one xattr)
                _op("setxattr", _retry_eintr, _os.setxattr, fd, XATTR_NAME, crc.to_bytes(XATTR_LEN, "big"))
                _op("setxattr", _retry_eintr, _os.setxattr, fd, _rec.ID_XATTR_NAME,
                    _rec.identity_record(dest, len(mv), crc))
            if durable:  # data before the name
                _op("sync", _os.fdatasync, fd)
        finally:
            _op("close", _close, fd)
        if word is None:
            _op("rename", _retry_eintr, _os.rename, tmp, dest)
        else:  # commit section: the rename only while the job is live
            if not word.step(_js.LIVE, _js.COMMITTING):
                raise OSError(_errno.ETIMEDOUT, _os.strerror(_errno.ETIMEDOUT))  # temp unlinked below
            try:
                _op("rename", _retry_eintr, _os.rename, tmp, dest)
            finally:
                late = not word.step(_js.COMMITTING, _js.LIVE)
            if late:
                raise _Late()
    except BaseException as e:
        if isinstance(e, _Late):
            raise
        try:
            _os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        # Published. A failed directory fsync fails the store (not known durable) but
        # leaves the block: a good block, which another durable job may have found,
        # synced and reported stored.
        _op("sync", _fsync_dir, dest)
    return unaligned  # written buffered because of mv's address (block.c store_try's *unaligned)


def _store_one(tmp, dest, mv, use_o_direct, checksum, crc_fn, durable, counts, word=None):
    """One block under the error policy: EAGAIN/ESTALE retried from the start."""
    attempt = 0
    while True:
        try:
            if _store_try(tmp, dest, mv, use_o_direct, checksum, crc_fn, durable, counts, word):
                _count_into(counts, "buffered_unaligned")  # once per block stored buffered for its address
            return
        except OSError as e:
            if not _policy.retry_transient(e.errno, attempt, counts):
                raise
            attempt += 1


_stats_lock = _threading.Lock()
_totals: dict = {}


def _add_totals(counts):
    with _stats_lock:
        for k, v in counts.items():
            _totals[k] = _totals.get(k, 0) + v


def checksum_stats():
    """Process-wide counters of batch_load_block, like kvtier._C.checksum_stats():
    checksum_retries (first CRC or identity mismatches, re-read once),
    checksum_condemned (mismatched again)."""
    with _stats_lock:
        t = dict(_totals)
    return {"checksum_retries": t.get("reread_checksum", 0) + t.get("reread_identity", 0),
            "checksum_condemned": t.get("condemned_checksum", 0) + t.get("condemned_identity", 0)}


def policy_info():
    """Like kvtier._C.policy_info(): the policy's names, constants and this backend's
    process-wide totals."""
    with _stats_lock:
        t = dict(_totals)
    return {"counts": _policy.COUNT_NAMES, "operations": _policy.OPERATIONS, "causes": _policy.CAUSES,
            "totals": {k: t.get(k, 0) for k in _policy.COUNT_NAMES},
            "retry_eintr_max": _policy.RETRY_EINTR_MAX, "retry_transient": _policy.RETRY_TRANSIENT, "backoff_us": _policy.BACKOFF_US,
            "id_xattr": _rec.ID_XATTR_NAME}


def _whole_file_verifies(fd, size, crc_fn):
    """Whether one of the open file's CRC records matches all ``size`` bytes: True, False
    (no record, a malformed one, a mismatch) or None (an error, or the size
    changed while read: unknown, the file is kept)."""
    # The CRC its identity record carries (12 bytes; the identity is of its own size, not
    # the caller's: not compared), and its CRC record: either verifying all its bytes proves
    # them intact (csrc/block/block.c whole_file_verifies). Asked with checksums off too (issue
    # #24); no xattrs on the filesystem (EOPNOTSUPP): no record.
    wants, unknown = [], False
    for name, length, at in ((_rec.ID_XATTR_NAME, _rec.ID_REC_LEN, _rec.ID_LEN), (XATTR_NAME, XATTR_LEN, 0)):
        try:
            rec = _retry_eintr(_os.getxattr, fd, name)
        except OSError as e:
            unknown |= e.errno not in (_errno.ENODATA, _errno.ERANGE, _errno.EOPNOTSUPP)
            continue
        if len(rec) == length:
            wants.append(int.from_bytes(rec[at:], "big"))
    if not wants:
        return None if unknown else False
    crc, off = 0, 0
    try:
        while off < size:
            chunk = _os.pread(fd, min(IO_CHUNK, size - off), off)
            if not chunk:
                return None
            crc = crc_fn(chunk, crc)
            off += len(chunk)
    except OSError:
        return None
    return True if crc in wants else (None if unknown else False)


def _get_record(fd, name):
    """A record of the open block: its bytes, None when absent (ENODATA, except in
    strict mode's CRC record read: the caller asks), b"" when longer than any record
    (ERANGE: malformed). Another OSError (EOPNOTSUPP, EIO ...) propagates with
    ``kvt_op``: not the block's fault, it is kept."""
    try:
        return _op("getxattr", _retry_eintr, _os.getxattr, fd, name)
    except OSError as e:
        if e.errno == _errno.ERANGE:
            return b""
        if e.errno == _errno.ENODATA and name == _rec.ID_XATTR_NAME:
            return None
        raise


def _read_verify(fd, mv, use_o_direct, checksum, crc_fn, ident, counts, reread=False, data_out=None,
                 section=_NO_SECTION):
    """Records then data. Returns (mismatch, short, unverified): mismatch "checksum"
    for a CRC mismatch or malformed record, "identity" for a well-formed identity record
    of another block than ``ident``'s (a damaged one is judged by user.vllm.kv_crc32c),
    else None; short for a short read; unverified when read without
    a CRC record (counted by the caller once the block is loaded). OSErrors (getxattr other
    than ENODATA, read) propagate with ``kvt_op`` (file kept); ENODATA in
    strict mode too (a miss). ``reread`` (after a mismatch): buffered, each
    chunk checksummed in a private bounce buffer and then copied, so the block
    is judged on bytes no other thread of the caller can write (as the C core
    does). ``data_out[0]`` is set True once every byte of the block was read
    into ``mv`` (a mismatch of the data, not of a record). ``section``: the direct
    landing's commit section, held around each write into ``mv`` (the read into it, or
    a bounce buffer's copy) and nothing else."""
    want = verdict = idrec = crcrec = None
    unverified = False
    if checksum:
        # The identity record first: written by kvtier it carries the CRC too (one xattr per
        # load); user.vllm.kv_crc32c only without it (stored by vLLM) or with a damaged one
        # (P11), and when the bytes differ from the CRC it carries (P10, _judged). Judged by
        # kvtier._blockio.records.judge, as kvtier scrub judges them.
        idrec = _get_record(fd, _rec.ID_XATTR_NAME)
        if _rec.needs_crc_record(idrec, ident):
            try:
                crcrec = _get_record(fd, XATTR_NAME)
            except OSError as e:
                if e.errno != _errno.ENODATA:
                    raise  # EOPNOTSUPP, EIO ...: not the block's fault, keep it
                if checksum == "strict":
                    _count_into(counts, "unverified_miss")
                    raise  # a miss, kept
        verdict = _rec.judge(idrec, crcrec, ident)
        if verdict.cause is not None:
            return verdict.cause, False, unverified
        want = verdict.want
        unverified = want is None  # stored without checksum (vLLM, a copy without xattrs)
    private = reread and want is not None
    direct = not private and use_o_direct and _try_direct(fd, mv)
    # O_DIRECT into an unaligned mv: through the page-aligned bounce buffer (as the C
    # engine's private slots), so the caller's alignment never turns O_DIRECT off
    via_bounce = not direct and not private and use_o_direct and _try_direct(fd, mv, bounce=True)
    direct = direct or via_bounce
    if not direct and _fcntl.fcntl(fd, _fcntl.F_GETFL) & _os.O_DIRECT:
        _set_direct(fd, False)
    crc = 0
    copy_fn = _block_copy_fn() if not direct or via_bounce else None
    # A checksummed buffered load goes through the copy + CRC; a re-read always goes through
    # a bounce buffer, checksummed there.
    if private or (via_bounce and want is not None and copy_fn is None):
        copy_fn = _checksum_then_copy(crc_fn)
    elif want is None:
        copy_fn = _plain_copy if via_bounce else None
    if copy_fn is not None:  # read into a bounce buffer, then one pass of copy + CRC
        bounce = _bounce_take()
        try:
            for off in range(0, len(mv), IO_CHUNK):
                n = min(IO_CHUNK, len(mv) - off)
                b = bounce if n == IO_CHUNK else bounce[:n]
                # EINTR retried by os.preadv (PEP 475); EINVAL under O_DIRECT: buffered (_retry_io)
                got, direct = _op("read", _retry_io, _preadv_into, fd, b, off, direct)
                if got == 0:  # end of file: a short read (as block.c read_full)
                    return None, True, unverified
                if got < n:  # a partial read: finish it the general way
                    more, direct = _op("read", _read_full, fd, b[got:], off + got, direct)
                    if got + more < n:
                        return None, True, unverified
                with section:
                    crc = copy_fn(mv[off : off + n], b, crc)
        finally:
            _bounce_give(bounce)
        if data_out is not None:
            data_out[0] = True
        return _judged(fd, verdict, idrec, crcrec, ident, crc), False, unverified
    with section:
        for off in range(0, len(mv), IO_CHUNK):
            chunk = mv[off : off + IO_CHUNK]
            got, direct = _op("read", _read_full, fd, chunk, off, direct)
            if got < len(chunk):
                return None, True, unverified
            if want is not None:
                crc = crc_fn(chunk, crc)
    if data_out is not None:
        data_out[0] = True
    return _judged(fd, verdict, idrec, crcrec, ident, crc), False, unverified


def _judged(fd, verdict, idrec, crcrec, ident, crc):
    """The mismatch ("checksum" or None) of a block read whole with CRC32C ``crc``, its
    records judged before the read as ``verdict`` (None: checksums off). A CRC from the
    identity record that differs from the bytes is asked of user.vllm.kv_crc32c too (the C
    core's vllm_record_is): the identity record's CRC bytes alone damaged are no proof
    against the bytes (P10, issue #24); bytes that changed match neither record."""
    if verdict is None or verdict.want is None or crc == verdict.want:
        return None
    if verdict.source == _rec.ID_XATTR_NAME and crcrec is None:
        try:
            crcrec = _retry_eintr(_os.getxattr, fd, XATTR_NAME)
        except OSError:  # none, or unreadable: nothing tells a damaged record from changed data
            crcrec = None
    return _rec.judge(idrec, crcrec, ident, crc).cause


_LT_OK, _LT_ERR, _LT_SHORT, _LT_SIZE = range(4)


class _Verdict(Exception):
    """A judged block: errno, operation, cause (None: kept)."""

    def __init__(self, err, op, cause=None, size=0, size_kept=None, data_read=False):
        super().__init__(err)
        self.data_read = data_read  # a data mismatch: the block's bytes (as re-read) are in its buffer
        self.err, self.op, self.cause, self.size = err, op, cause, size  # size: the file's, when not the block's
        self.size_kept = size_kept  # a file of another size kept: "intact" (P8) or "unsure" (P9, unconfirmed)


def _load_try(src, mv, use_o_direct, checksum, crc_fn, ident, seen, counts, retried_out, size_out,
              section=_NO_SECTION):
    """One open of a block (csrc/block/block.c load_try). Returns _LT_OK, or _LT_SHORT /
    _LT_SIZE for a first sighting (``size_out[0]``: the file's size); raises
    _Verdict (judged: condemned or kept) or OSError with ``kvt_op`` (kept)."""
    # O_NOFOLLOW: a block is never a symlink (ELOOP, kept). O_NONBLOCK: a FIFO or
    # device at a block path must not block the batch; a regular file ignores it.
    fd = _op("open", _os.open, src, _os.O_RDONLY | _os.O_CLOEXEC | _os.O_NOFOLLOW | _os.O_NONBLOCK)
    remove = False
    try:
        n = len(mv)
        st = _op("stat", _os.fstat, fd)
        if not _stat.S_ISREG(st.st_mode):  # not ours to judge or remove: kept
            e = _errno.EISDIR if _stat.S_ISDIR(st.st_mode) else _errno.EINVAL
            raise _Verdict(e, "stat")
        if st.st_size != n:  # truncated, empty or longer: corrupt once seen on two opens,
            size_out[0] = st.st_size
            if seen != _LT_SIZE:
                return _LT_SIZE
            # unless its own record proves its bytes intact (the caller asked for another
            # block size: kept); an error while finding out keeps it too
            v = _whole_file_verifies(fd, st.st_size, crc_fn)  # checksums off too (issue #24)
            remove = v is False
            if remove:
                _count_into(counts, "condemned_size")
            raise _Verdict(_errno.EIO, "verify", "size" if remove else None, st.st_size,
                           None if remove else "intact" if v else "unsure")
        data_read = [False]
        for attempt in range(2):
            data_read[0] = False
            mismatch, short, unverified = _read_verify(fd, mv, use_o_direct, checksum, crc_fn, ident, counts,
                                                       attempt > 0, data_read, section)
            if short:  # fstat said the block size: never condemned for it (P6), reopened
                return _LT_SHORT
            if mismatch is None:
                if unverified:  # once per block loaded, however often it was opened
                    _count_into(counts, "unverified")
                return _LT_OK
            if attempt == 0:
                _count_into(counts, "reread_" + mismatch)
                retried_out[0] = True
                _os.posix_fadvise(fd, 0, n, _os.POSIX_FADV_DONTNEED)  # re-read from the device
        _count_into(counts, "condemned_" + mismatch)
        remove = True
        raise _Verdict(_errno.EBADMSG, "verify", mismatch, data_read=data_read[0])
    finally:
        try:
            if remove:
                _rec.unlink_if_same(src, fd)
        finally:
            _close_quiet(fd)  # read-only: an error here (after a good read too) changes nothing


def _load_one(src, mv, use_o_direct, checksum, crc_fn, counts, retried_out, section=_NO_SECTION):
    """Load one block under the error policy (docs/design.md "Error policy").
    Returns None, or raises _Verdict / OSError (with ``kvt_op``) / _Expired (``section``)."""
    ident = _rec.block_identity(src, len(mv)) if checksum else None
    seen, sightings, transient = _LT_OK, 0, 0
    size_out = [0]
    while True:
        try:
            kind = _load_try(src, mv, use_o_direct, checksum, crc_fn, ident, seen, counts, retried_out, size_out,
                             section)
        except OSError as e:
            if _policy.retry_transient(e.errno, transient, counts):
                transient += 1
                continue
            raise
        if kind == _LT_OK:
            return None
        if sightings < 2:  # a first short read / wrong size: reopen and look again
            sightings += 1
            _count_into(counts, "reread_short" if kind == _LT_SHORT else "restat_size")
            seen = kind
            continue
        # short on three opens, or short / wrong size in turn: a miss, kept (P6)
        raise _Verdict(_errno.EIO, "verify", size=size_out[0],
                       size_kept="unsure" if kind == _LT_SIZE else None)


def _close_quiet(fd):
    try:
        _os.close(fd)
    except OSError:
        pass


class _Word:
    """A job state word as this backend changes it: its view (kvtier._blockio.jobstate
    word_view) and the CAS every party of it uses (the caller's JobState's, else the
    lock of kvtier._blockio.jobstate)."""

    __slots__ = ("buf", "view", "cas")

    def __init__(self, buf, cas):
        self.buf, self.view, self.cas = buf, _js.word_view(buf), cas or _js.lock_cas

    def live(self):
        return self.view[0] & _js.PHASE == _js.LIVE

    def step(self, frm, to, add=0):
        """Phase ``frm`` -> ``to``, the count kept (+ ``add``): True if the phase was ``frm``."""
        while True:
            w = self.view[0]
            if w & _js.PHASE != frm:
                return False
            if self.cas(self.buf, w, ((w & ~_js.PHASE) | to) + add):
                return True


def _expired(path, index, num_retried=0):
    return _batch_error(_errno.ETIMEDOUT, path, index, False, num_retried)


def batch_lookup(paths, block_size=0, /):
    """For each path (str, bytes or os.PathLike) whether it is a regular file
    (lstat: a symlink, directory or FIFO is not) of ``block_size`` bytes (any
    size when 0). Returns list[bool]. TypeError for a non-list or a bad path
    type, ValueError for a negative block_size or a path with a NUL or ending in
    '/', '.' or '..'."""
    _args.check_list(paths, "paths")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be int, not {type(block_size).__name__}")
    if block_size < 0:
        raise ValueError("block_size must be >= 0")
    out = []
    for p in _args.encode_paths(paths, "paths"):
        try:
            st = _os.lstat(p)
        except OSError:
            out.append(False)
            continue
        out.append(_stat.S_ISREG(st.st_mode) and (block_size == 0 or st.st_size == block_size))
    return out


def _merge_counts(counts, mine):
    _tls.counts = None
    _add_totals(mine)
    if counts is not None:
        for k, v in mine.items():
            counts[k] = counts.get(k, 0) + v


def batch_store_block(tmp_paths, dest_paths, buffers, /, use_o_direct=True, checksum=False, durable=False, *,
                      offsets=None, block_size=None,
                      counts=None, job_state=None, job_state_cas=None):
    """Pure-Python kvtier._C.batch_store_block: same arguments, protocol and
    errors (OSError with errno, filename = dest path, num_succeeded,
    checksum_failed=False, num_retried=0, operation, condemned=None; the
    failing block's temp is removed). ``counts``: a dict the policy counters
    of this call are added to. With ``job_state`` (a job state word,
    kvtier.io.JobState): a block is started only while the job is LIVE and
    renamed only in a commit section (LIVE -> COMMITTING, rename, -> LIVE); an
    expired job stops with OSError ETIMEDOUT (num_succeeded = blocks
    published, the unrenamed temp unlinked). With ``offsets`` and ``block_size``,
    ``buffers`` is one buffer and block i its slice at ``offsets[i]``."""
    for obj, what in ((tmp_paths, "tmp_paths"), (dest_paths, "dest_paths")) + (
            ((buffers, "buffers"),) if offsets is None else ()):
        _args.check_list(obj, what)
    if offsets is None and not len(tmp_paths) == len(dest_paths) == len(buffers):
        raise ValueError(
            "tmp_paths, dest_paths and buffers must have equal lengths "
            f"({len(tmp_paths)}, {len(dest_paths)}, {len(buffers)})"
        )
    if offsets is not None and len(tmp_paths) != len(dest_paths):
        raise ValueError(f"tmp_paths, dest_paths must have equal lengths ({len(tmp_paths)}, {len(dest_paths)})")
    _args.check_counts(counts)
    checksum = _args.c_mode(checksum)
    tmps = _args.encode_paths(tmp_paths, "tmp_paths")
    dests = _args.encode_paths(dest_paths, "dest_paths")
    views = (_args.views(buffers, writable=False) if offsets is None
             else _args.views_at(buffers, offsets, block_size, len(dest_paths), writable=False))
    word = None if job_state is None else _Word(job_state, job_state_cas)
    crc_fn = crc32c if checksum else None
    mine: dict = {}
    _tls.counts = mine  # _retry_eintr counts into it
    try:
        for i, (tmp, dest, mv) in enumerate(zip(tmps, dests, views)):
            if word is not None and not word.live():
                raise _expired(dest_paths[i], i)
            try:
                _store_one(tmp, dest, mv, bool(use_o_direct), bool(checksum), crc_fn, bool(durable), mine, word)
            except _Late:  # block i published as the job expired: stopped before block i + 1
                raise _expired(dest_paths[min(i + 1, len(dest_paths) - 1)], i + 1) from None
            except OSError as e:
                raise _batch_error(e.errno or _errno.EIO, dest_paths[i], i, False, 0,
                                   getattr(e, "kvt_op", None) or "") from None
            if word is not None:  # counted (JobState.blocks_done): names the block in flight
                word.step(_js.LIVE, _js.LIVE, _js.BLOCK)
    finally:
        _merge_counts(counts, mine)


def batch_load_block(source_paths, buffers, /, use_o_direct=True, checksum=False, *, counts=None, job_state=None,
                     offsets=None, block_size=None, job_state_cas=None, landing="bounce"):
    """Pure-Python kvtier._C.batch_load_block: same arguments, protocol,
    return value (blocks re-read once after a first mismatch, int) and errors
    (docs/design.md "Error policy": EBADMSG + checksum_failed and EIO with
    ``condemned`` set remove the file; any other errno keeps it). The
    OSError's ``num_retried`` (int) counts the blocks of the batch re-read
    after a first mismatch, the failing block included (1 for a block
    condemned on its re-read). ``counts``: a dict the policy counters of this
    call are added to. With ``job_state`` (a job state word,
    kvtier.io.JobState): each block is loaded and verified in private
    page-aligned memory and copied into its buffer in a commit section (LIVE
    -> COMMITTING, copy, -> LIVE with the word's block count + 1); an expired
    job stops with OSError ETIMEDOUT (num_succeeded = blocks counted) and
    writes nothing more. A block condemned on its data leaves the bytes its
    re-read got in its buffer, with a job state too (copied in a commit
    section, not counted), as the C core does. With ``offsets`` and
    ``block_size``, ``buffers`` is one buffer and block i its slice at
    ``offsets[i]``. ``landing="direct"`` (as the C core's): an O_DIRECT block
    into a page-aligned buffer, and an unchecksummed buffered one, are loaded
    straight into its buffer, the read inside one commit section (the open, the records
    and the fstat before it, as the C core's)."""
    if landing not in ("bounce", "direct"):
        raise ValueError(f"batch_load_block(): landing must be 'bounce' or 'direct', not {landing!r}")
    _args.check_list(source_paths, "source_paths")
    if offsets is None:
        _args.check_list(buffers, "buffers")
    if offsets is None and len(source_paths) != len(buffers):
        raise ValueError(f"source_paths and buffers must have equal lengths ({len(source_paths)}, {len(buffers)})")
    _args.check_counts(counts)
    checksum = _args.c_mode(checksum)
    srcs = _args.encode_paths(source_paths, "source_paths")
    views = (_args.views(buffers, writable=True) if offsets is None
             else _args.views_at(buffers, offsets, block_size, len(source_paths), writable=True))
    word = None if job_state is None else _Word(job_state, job_state_cas)
    crc_fn = crc32c  # checksums off too: a file of another size is judged by its records (P8)
    private = None
    if word is not None:
        # page-aligned, so O_DIRECT stays usable; unmapped when the last view of
        # it (an exception's traceback may hold one) is gone
        private = memoryview(_mmap.mmap(-1, max(max((len(mv) for mv in views), default=0), 1)))
    return _load_batch(source_paths, srcs, views, use_o_direct, checksum, crc_fn, word, private, counts,
                       landing == "direct")


def _commit_copy(word, mv, src, add):
    """Copy ``src`` into the caller's ``mv`` in a commit section (LIVE -> COMMITTING,
    copy, -> LIVE with ``add`` added to the block count): the caller's memory is
    written only while the job is live. False when it was not live (nothing written)
    or expired during the copy (expire(wait_commit=False): nothing counted)."""
    if not word.step(_js.LIVE, _js.COMMITTING):
        return False
    try:
        mv[:] = src
    finally:
        done = word.step(_js.COMMITTING, _js.LIVE, add)
    return done


def _lands_direct(mv, use_o_direct, checksum):
    """The direct landing applies to this block: O_DIRECT into a page-aligned
    buffer, or buffered without checksum (as the C core's read_verify)."""
    if use_o_direct and _dio_usable(mv):
        return True
    return not checksum


def _load_batch(source_paths, srcs, views, use_o_direct, checksum, crc_fn, word, private, counts, direct=False):
    retried_total = 0
    mine: dict = {}
    _tls.counts = mine  # _retry_eintr counts into it
    try:
        for i, (src, mv) in enumerate(zip(srcs, views)):
            retried_out = [False]
            if word is not None and not word.live():
                raise _expired(source_paths[i], i, retried_total)
            in_place = word is not None and direct and _lands_direct(mv, use_o_direct, checksum)
            dst = mv if word is None or in_place else private[: len(mv)]
            try:
                _load_one(src, dst, bool(use_o_direct), checksum, crc_fn, mine, retried_out,
                          _Section(word) if in_place else _NO_SECTION)
            except _Expired:
                raise _expired(source_paths[i], i, retried_total + retried_out[0]) from None
            except _Verdict as v:
                # A block condemned on its data leaves the bytes read (its re-read) in its
                # buffer, as the C core's copy + CRC does (it writes the buffer before the CRC
                # is known): copied in a commit section, not counted; once the job is no
                # longer live, nothing is written and it is the deadline's error.
                if v.data_read and word is not None and dst is not mv and not _commit_copy(word, mv, dst, 0):
                    raise _expired(source_paths[i], i, retried_total + retried_out[0]) from None
                raise _batch_error(v.err, source_paths[i], i, v.cause in ("checksum", "identity"),
                                   retried_total + retried_out[0], v.op, v.cause, v.size, len(mv),
                                   v.size_kept) from None
            except OSError as e:
                raise _batch_error(e.errno or _errno.EIO, source_paths[i], i, False,
                                   retried_total + retried_out[0], getattr(e, "kvt_op", None) or "") from None
            retried_total += retried_out[0]
            if word is None:
                continue
            if in_place:  # read into the row in its section, then verified: counted while live (block.c)
                counted = word.step(_js.LIVE, _js.LIVE, _js.BLOCK)
            else:  # the section's end counts the block (verified before the copy)
                counted = _commit_copy(word, mv, dst, _js.BLOCK)
            if not counted:
                raise _expired(source_paths[i], i, retried_total)
    finally:
        _merge_counts(counts, mine)
    return retried_total


__all__ = ["POLY", "XATTR_NAME", "batch_load_block", "batch_lookup", "batch_store_block", "checksum_stats",
           "crc32c", "crc32c_combine", "policy_info"]
