"""Batched, checksummed KV block I/O: the entry points the tier manager calls.

A job's blocks live in one big CPU buffer (``view``: any C-contiguous buffer,
e.g. a numpy array or bytearray, or a contiguous torch CPU tensor of any dtype,
bf16 included, taken as its bytes) at byte ``offsets``, each ``block_size``
bytes. Each block becomes one file (on-disk contract: design.md):

- store: skip an existing destination; write ``<dest>_<random hex>.tmp``
  (O_CREAT|O_EXCL, parents created, O_DIRECT when usable); with ``checksum``
  set xattr ``user.vllm.kv_crc32c`` = CRC32C (RFC 3720) as 4 bytes big-endian
  on the open temp, and the identity record ``user.kvtier.id`` (identity + the
  same CRC, :func:`kvtier._blockio.policy.identity_record`); close; rename onto the
  destination.
- load: open, read, with ``checksum`` verify the CRC through the same fd: the
  one the identity record carries, else (a block stored by vLLM) the one of
  ``user.vllm.kv_crc32c``. A block without either (stored with checksums off)
  is accepted, counted unverified ("strict": a miss).

Errors. Bad arguments raise TypeError / ValueError / BufferError before any
I/O. A batch stops at its first failing block and raises OSError (the errno's
subclass, e.g. FileNotFoundError) with ``errno``, ``filename`` (that block's
path), ``num_succeeded`` (its index: blocks before it are done),
``checksum_failed`` and ``num_retried`` (int: blocks of this batch re-read
after a first checksum mismatch, the failing block included; 0 for stores):

The rules are the error policy of docs/design.md ("Error policy"): in short,
=========================================  =========================  ========
load outcome                               OSError                    file
=========================================  =========================  ========
CRC or identity mismatch, on two reads     EBADMSG, checksum_failed   removed
size != block_size on two opens, no        EIO, condemned="size"      removed
intact record of its own
short read on two opens                    EIO, condemned="short_read" removed
no CRC record, checksum="strict"           ENODATA                    kept
open/read/getxattr error (ENOENT, ELOOP,   that errno (EAGAIN/ESTALE  kept
EACCES, EOPNOTSUPP, EBADMSG from the FS)   retried 3 times first)
=========================================  =========================  ========
Every batch OSError also has ``operation`` (the failing call, one of
:data:`kvtier._blockio.policy.OPERATIONS`) and ``condemned`` (the cause when the file
was removed, else None).
Each call reports its own re-reads (the load's return value, or the OSError's
``num_retried``; a condemned block is the OSError with ``checksum_failed``),
which is what the tier manager counts per tier; :func:`checksum_stats` keeps
process-wide totals as a diagnostic.

Backend: the C core (``kvtier._C``, GIL released for the whole batch) or the
pure-Python fallback (``kvtier.fallback``), same semantics and bytes.
``KVTIER_IO_BACKEND=c|python`` forces one (any other value fails the import
with ValueError); by default the C core when importable. The choice is
``kvtier.io.backend``; :func:`for_backend` gives either explicitly.

Deadlines. With ``job_state`` (a :class:`JobState`), a load reads each block
into private memory and copies it into ``view`` only inside a commit section
(state LIVE -> COMMITTING, copy, -> LIVE), and a store renames each temp only
inside one; whoever gave up on the job calls :meth:`JobState.expire`, after
which nothing more is written into ``view`` and no further block is published.
A call that finds its job expired at a commit point stops with OSError
ETIMEDOUT (``num_succeeded`` = blocks committed; a store unlinks that block's
temp instead of renaming it).
"""
from __future__ import annotations

import array
import errno
import itertools
import mmap
import operator
import os
import secrets
import time
from collections import abc as _abc
from typing import Sequence, Union

# torch CPU tensors are taken as their bytes, the same conversion as the C core
# (module.c torch_bytes_view) and the numpy CRC fallback: one helper, imported.
from kvtier._blockio import policy as _policy
from kvtier._blockio.numpy_crc import _is_torch_tensor, torch_bytes_view

PathT = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

BACKENDS = ("c", "python")
"""Valid values of KVTIER_IO_BACKEND and of :func:`for_backend`."""

XATTR_NAME = "user.vllm.kv_crc32c"
"""xattr holding a block's CRC32C, 4 bytes big-endian (vLLM FS tier name)."""


def _c_module():
    try:
        from kvtier import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "batch_load_block") else None


def _fallback_module():
    from kvtier import fallback

    return fallback


def tmp_path_for(dest: PathT) -> Union[str, bytes]:
    """Temp file name for storing ``dest``: ``f"{dest}_{16 random hex}.tmp"``
    (design.md), next to it so the final rename stays on one filesystem."""
    return _tmp_with(dest, secrets.token_hex(8))


# The temp tag of a store call: 16 hex digits, a random 64-bit base per
# process (drawn again in a forked child) plus a counter, so two calls of one
# process never share a tag and two processes almost never do (the temp is
# opened O_CREAT|O_EXCL: a clash is an error, never a shared file). ~0.3 us
# against ~2-3 us for secrets.token_hex(8) (a getrandom call per store): a
# few percent of a 256 KiB store on tmpfs (docs/block_io.md).
_tag_base = int.from_bytes(os.urandom(8), "little")
_tag_seq = itertools.count()


def _new_tag_base() -> None:
    global _tag_base, _tag_seq
    _tag_base = int.from_bytes(os.urandom(8), "little")
    _tag_seq = itertools.count()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_tag_base)


def _store_tag() -> str:
    return f"{(_tag_base + next(_tag_seq)) & 0xFFFFFFFFFFFFFFFF:016x}"


def _tmp_with(dest, tag: str):
    d = os.fspath(dest)
    if isinstance(d, bytes):
        return d + b"_" + tag.encode() + b".tmp"
    return f"{d}_{tag}.tmp"


_STR, _INT = {str}, {int}


def _check_paths(paths, what="paths") -> list:
    # a list first: isinstance() against an ABC costs more than the rest of a one-block check
    if type(paths) is not list and (isinstance(paths, (str, bytes)) or not isinstance(paths, _abc.Sequence)):
        raise TypeError(f"{what} must be a sequence of paths, not {type(paths).__name__}")
    paths = list(paths)
    # fast path (the engine's str paths): one scan for NUL and empties, per-path checks only on a hit
    if set(map(type, paths)) == _STR and "\0" not in "".join(paths) and all(paths):
        return paths
    for i, p in enumerate(paths):
        if not isinstance(p, (str, bytes)) and not hasattr(p, "__fspath__"):
            raise TypeError(f"{what}[{i}] must be str, bytes or os.PathLike, not {type(p).__name__}")
        f = os.fspath(p)
        if ("\0" if isinstance(f, str) else b"\0") in f:
            raise ValueError(f"{what}[{i}]: embedded null byte")
        if not f:
            raise ValueError(f"{what}[{i}]: empty path")
    return paths


def _as_int(v, what: str) -> int:
    """v as an int (operator.index: numpy integers too), else TypeError naming `what`."""
    if isinstance(v, bool):
        raise TypeError(f"{what} must be int, not bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be int, not {type(v).__name__}") from None


def _check_blocks(paths, view, offsets, block_size, writable):
    """Validate: returns (paths list, the view as a flat byte memoryview, offsets as a list
    of int, block_size). The backend takes the view and the offsets (``offsets=``,
    ``block_size=``): no per-block memoryview is made."""
    paths = _check_paths(paths)
    block_size = _as_int(block_size, "block_size")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0 bytes, got {block_size}")
    # torch: BufferError if not contiguous; torch's TypeError for a non-CPU tensor
    try:
        mv = memoryview(torch_bytes_view(view) if _is_torch_tensor(view) else view)
    except TypeError:
        raise TypeError(f"view must be a buffer (bytes-like, numpy array, torch CPU tensor), "
                        f"not {type(view).__name__}") from None
    if not mv.c_contiguous:
        raise BufferError(f"view must be C-contiguous ({type(view).__name__} is not)")
    if writable and mv.readonly:
        raise BufferError(f"view must be writable to load into it ({type(view).__name__} is read-only)")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if isinstance(offsets, (str, bytes)) or not hasattr(offsets, "__len__"):
        raise TypeError(f"offsets must be a sequence of ints, not {type(offsets).__name__}")
    if len(offsets) != len(paths):
        raise ValueError(f"paths and offsets must have equal lengths ({len(paths)}, {len(offsets)})")
    limit = mv.nbytes - block_size
    # fast path: plain ints in range (one pass each); the checks below name the first bad one
    if type(offsets) is not list:
        offsets = list(offsets)
    if not offsets or (set(map(type, offsets)) == _INT and min(offsets) >= 0 and max(offsets) <= limit):
        return paths, mv, offsets, block_size
    ints = []
    for i, off in enumerate(offsets):
        off = _as_int(off, f"offsets[{i}]")
        if off < 0 or off > limit:
            raise ValueError(
                f"offsets[{i}] = {off}: block [{off}, {off + block_size}) is outside the view of {mv.nbytes} bytes"
            )
        ints.append(off)
    return paths, mv, ints, block_size


LIVE, COMMITTING, EXPIRED, DONE = 0, 1, 2, 3
"""Phases of a job state word (:class:`JobState`): its low 2 bits."""
PHASE = 3
"""Mask of the phase in a job state word; the blocks a load counted are ``word >> 2``."""
_STATE_NAMES = ("LIVE", "COMMITTING", "EXPIRED", "DONE")


_cas_cache: list = []


def _job_state_cas():
    """The compare-and-swap on job state words: the fallback's choice, which is
    the C core's (C11 atomics) when built, else its own (one process-wide
    lock). One per process, chosen at first use, so every party of a job uses
    the same one."""
    if not _cas_cache:
        _cas_cache.append(_fallback_module().job_state_cas)
    return _cas_cache[0]


class JobState:
    """The liveness of one I/O job, shared by the thread doing its I/O and the
    one that may give up on it.

    One 32-bit word in a small writable buffer (``buffer``, 4 bytes, aligned),
    passed to ``batch_load_block`` / ``batch_store_block`` as ``job_state``:
    ``blocks << 2 | phase`` (csrc/job_state.h). ``blocks`` (:attr:`blocks_done`):
    the blocks of a load that are whole in the caller's view and verified,
    counted while the job was live (never changed once it is not). Phases
    (:attr:`state`): ``LIVE`` (0) the job may run; ``COMMITTING`` (1) the I/O thread is
    writing into the caller's memory or renaming a temp onto its destination;
    ``EXPIRED`` (2) given up: the I/O stops at its next commit point (OSError
    ETIMEDOUT) and writes nothing more; ``DONE`` (3) the I/O finished and its
    result stands. Every change is one compare-and-swap
    (``kvtier._C.job_state_cas(buffer, old, new) -> bool``, C11 atomics; the
    fallback's, under a lock, where the C core is not built) that keeps the
    count, so a job is either expired or done, never both, exactly one party
    reports it, and the count read after :meth:`expire` is final.

    The I/O side: LIVE -> COMMITTING before each copy into the caller's view
    (load) or each rename (store), COMMITTING -> LIVE after it, and a load
    counts each block once it is whole and verified (LIVE -> LIVE, blocks + 1);
    a failed swap at any of these points means the job expired: stop with
    ETIMEDOUT (``num_succeeded`` = the blocks counted).
    """

    __slots__ = ("buffer", "_cas")

    def __init__(self) -> None:
        self.buffer = array.array("I", [LIVE])  # 4-byte item, malloc'd: aligned
        self._cas = _job_state_cas()

    @property
    def state(self) -> int:
        """The current phase (LIVE, COMMITTING, EXPIRED or DONE)."""
        return self.buffer[0] & PHASE

    @property
    def blocks_done(self) -> int:
        """Blocks of a load whole in the caller's view and verified while the job was
        live; of a store, the blocks stored (published, or found there) while live. Final
        once :meth:`expire` returned True: a load's partial keep at its deadline, and
        for either the index of the block in flight (the one the deadline error names)."""
        return self.buffer[0] >> 2

    def _step(self, frm: int, to: int) -> bool:
        """Phase ``frm`` -> ``to``, keeping the count: True if the phase was ``frm``."""
        while True:
            w = self.buffer[0]
            if w & PHASE != frm:
                return False
            if self._cas(self.buffer, w, (w & ~PHASE) | to):
                return True

    def expire(self, wait_commit: bool = True) -> bool:
        """Give up on the job: LIVE -> EXPIRED. Returns True if this call
        expired it (from then on nothing more is written into the caller's
        view, no further block is published), False if it was already DONE
        (the result stands) or already EXPIRED.

        While the I/O thread is COMMITTING, ``wait_commit`` (loads: a copy into
        memory, bounded) spins until the section ends and then expires. Without
        it (stores: a rename, which a hung filesystem can hold forever) the
        section itself is expired: COMMITTING -> EXPIRED at once; the rename in
        the kernel may still complete, publishing a complete block whose bytes
        were written and checksummed before the deadline, and the store stops
        there (its release swap fails)."""
        spins = 0
        while True:
            if self._step(LIVE, EXPIRED):
                return True
            s = self.state
            if s == COMMITTING:
                if not wait_commit:
                    if self._step(COMMITTING, EXPIRED):
                        return True
                    continue
                spins += 1
                time.sleep(0 if spins < 100 else 1e-5)
            elif s != LIVE:
                return False

    def cancel(self) -> bool:
        """Give up on the job only if it is not in a commit section: LIVE ->
        EXPIRED. True if this call expired it; False if it was COMMITTING (a
        store renaming its block: it finishes and is reported as what it is),
        DONE or already EXPIRED."""
        return self._step(LIVE, EXPIRED)

    def finish(self) -> bool:
        """The I/O side's end: LIVE -> DONE. True: the result stands (report
        it); False: the job had expired (its result is dropped)."""
        return self._step(LIVE, DONE)

    def __repr__(self) -> str:
        n = self.blocks_done
        return f"JobState({_STATE_NAMES[self.state]}{f', {n} blocks' if n else ''})"


def _check_bool(v, name: str) -> None:
    """A flag is True or False: "no" or 0 would pass through bool() as something else."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {'None' if v is None else f'{v!r} ({type(v).__name__})'}")


def _job_state_arg(job_state) -> dict:
    """``job_state``: None, a :class:`JobState`, or a bare state word (a writable
    buffer of >= 4 bytes, 4-byte aligned, its first 4 bytes the word), checked by
    the backend (TypeError, BufferError, ValueError)."""
    if job_state is None:
        return {}
    return {"job_state": job_state.buffer if isinstance(job_state, JobState) else job_state}


class BlockIO:
    """The batch_* entry points bound to one backend ("c" or "python")."""

    def __init__(self, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"unknown block I/O backend {backend!r}; valid: {', '.join(BACKENDS)}")
        if backend == "c":
            impl = _c_module()
            if impl is None:
                raise ImportError("block I/O backend 'c' requested but kvtier._C (with batch_load_block) is not importable")
        else:
            impl = _fallback_module()
        self.backend = backend
        self.impl = impl

    def __repr__(self):
        return f"BlockIO({self.backend!r})"

    def batch_store_block(
        self,
        paths: Sequence[PathT],
        view,
        offsets: Sequence[int],
        block_size: int,
        use_o_direct: bool = True,
        checksum: "bool | str" = False,
        durable: bool = False,
        job_state: "JobState | None" = None,
        *,
        counts: "dict | None" = None,
    ) -> None:
        """Store ``view[offsets[i] : offsets[i] + block_size]`` as file
        ``paths[i]`` for each i (bytes; ``view`` any C-contiguous buffer or a
        contiguous torch CPU tensor, as its bytes).
        Existing destinations are skipped. With ``checksum`` the CRC32C is
        recorded in xattr user.vllm.kv_crc32c. With ``durable`` each temp is
        fdatasync'ed before its rename and the directory fsync'ed after, so a
        stored block survives power loss (one device flush per block; cost:
        docs/reliability.md); a durable store of an existing block syncs that
        block and its directory before it returns. A regular file of
        ``block_size`` bytes at a path counts as stored; a directory there
        fails the block (EISDIR); anything else (symlink, FIFO, file of another
        size) is replaced. With ``checksum`` (True or "strict") the identity
        record ``user.kvtier.id`` is set too (identity + CRC32C,
        :func:`kvtier._blockio.policy.identity_record`).
        ``counts``: a dict the call's policy counters are added to
        (:data:`kvtier._blockio.policy.COUNT_NAMES`). With ``job_state`` (a
        :class:`JobState`, or a bare state word: a writable buffer of >= 4
        bytes, 4-byte aligned) each rename runs in a commit section; an expired
        job stops with OSError ETIMEDOUT and unlinks the temp it did not rename
        (module docstring, "Deadlines"). Errors: module docstring; a store
        OSError names the destination and leaves no temp behind."""
        checksum = _policy.check_mode(checksum)
        _check_bool(use_o_direct, "use_o_direct")
        _check_bool(durable, "durable")
        paths, mv, offsets, block_size = _check_blocks(paths, view, offsets, block_size, writable=False)
        tag = _store_tag()  # one per call: the destinations of a batch differ already
        tmps = [_tmp_with(p, tag) for p in paths]
        kw = _job_state_arg(job_state)
        if counts is not None:
            kw["counts"] = counts
        self.impl.batch_store_block(tmps, paths, mv, use_o_direct, checksum, durable=durable, offsets=offsets,
                                    block_size=block_size, **kw)

    def batch_load_block(
        self,
        paths: Sequence[PathT],
        view,
        offsets: Sequence[int],
        block_size: int,
        use_o_direct: bool = True,
        checksum: "bool | str" = False,
        job_state: "JobState | None" = None,
        *,
        counts: "dict | None" = None,
    ) -> int:
        """Load file ``paths[i]`` into ``view[offsets[i] : offsets[i] +
        block_size]`` for each i (``view`` writable, C-contiguous; a torch CPU
        tensor is written through its bytes). With
        ``checksum`` verify the recorded CRC32C; a first mismatch is retried
        once (page cache dropped, record and data re-read), a second condemns
        the block. Returns the number of blocks that needed that re-read and
        then verified (int). On failure the OSError's ``num_retried`` (int)
        counts the blocks re-read before it stopped, the failing block
        included (a condemned block was re-read once). After a failure the
        blocks before the failing one hold their data, the blocks after it are
        untouched, and the failing block's slice is not to be used: a block
        condemned on its data (EBADMSG, ``condemned="checksum"`` after the data
        was read: a CRC mismatch) leaves the bytes its re-read got, the
        file's, corrupt; one refused on its records (identity of another
        block, a malformed CRC record: nothing read) leaves it untouched; any
        other failure (wrong size, short read, I/O error, deadline) may leave
        part of what was read. The same bytes from both backends, with and
        without ``job_state``, O_DIRECT or buffered (the C core's copy + CRC
        writes the slice before the CRC is known; nothing is spent on the
        success path to undo it). Errors
        and which files are removed: module docstring. ``checksum="strict"``:
        a block without CRC record is ENODATA (a miss, kept) instead of an
        unverified load. ``counts``: a dict the call's policy counters are
        added to (:data:`kvtier._blockio.policy.COUNT_NAMES`: unverified loads,
        re-reads, condemned blocks by cause, retries by errno). With
        ``job_state`` (see batch_store_block) bytes are read into private
        memory and enter ``view`` only in commit sections; an expired job
        stops with OSError ETIMEDOUT (``num_succeeded`` = blocks fully loaded)
        and writes nothing more (module docstring, "Deadlines")."""
        checksum = _policy.check_mode(checksum)
        _check_bool(use_o_direct, "use_o_direct")
        paths, mv, offsets, block_size = _check_blocks(paths, view, offsets, block_size, writable=True)
        kw = _job_state_arg(job_state)
        if counts is not None:
            kw["counts"] = counts
        return self.impl.batch_load_block(paths, mv, use_o_direct, checksum, offsets=offsets, block_size=block_size,
                                          **kw)

    def batch_lookup(self, paths: Sequence[PathT], block_size: int = 0) -> list:
        """list[bool]: whether each path is a regular file (not a symlink,
        directory or FIFO) of ``block_size`` bytes (any size when 0)."""
        return self.impl.batch_lookup(_check_paths(paths), _as_int(block_size, "block_size"))

    def policy_info(self) -> dict:
        """This backend's error-policy names, constants and process-wide
        counter totals (``kvtier._C.policy_info``)."""
        return self.impl.policy_info()

    def checksum_stats(self) -> dict:
        """This backend's process-wide load counters (a diagnostic summed over
        every caller in the process; per-call counts are the load's return
        value / ``num_retried``): ``checksum_retries`` (first mismatches,
        re-read once) and ``checksum_condemned`` (mismatched again: EBADMSG,
        removed)."""
        return self.impl.checksum_stats()


_io_by_backend: dict = {}


def checksum_stats(backend_name: "str | None" = None) -> dict:
    """Load counters of ``backend_name`` ("c" or "python"; default: the
    active backend): {"checksum_retries": int, "checksum_condemned": int}."""
    return for_backend(backend_name or backend).checksum_stats()


def for_backend(name: str) -> BlockIO:
    """The :class:`BlockIO` of backend ``name`` ("c" or "python"), cached.
    ValueError for another name, ImportError if "c" is not built."""
    io = _io_by_backend.get(name)
    if io is None:
        io = _io_by_backend[name] = BlockIO(name)
    return io


def _choose_backend() -> str:
    forced = os.environ.get("KVTIER_IO_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"KVTIER_IO_BACKEND={forced!r} is not valid; valid values: {', '.join(BACKENDS)}")
        return forced
    # Without the C core, `import kvtier` has already warned (RuntimeWarning).
    return "c" if _c_module() is not None else "python"


from kvtier._blockio.env import check_io_env as _check_io_env  # noqa: E402

_check_io_env()  # a KVTIER_CRC_COPY / KVTIER_IO_URING the C core would read leniently: ValueError
_default = for_backend(_choose_backend())
backend: str = _default.backend
"""Active backend: "c" (kvtier._C) or "python" (kvtier.fallback)."""
batch_store_block = _default.batch_store_block
batch_load_block = _default.batch_load_block
batch_lookup = _default.batch_lookup


# ------------------------------------------------------------------ probes

_PROBE_SIZE = 4096  # one page: aligned for every O_DIRECT alignment in use


def _probe_file(directory: PathT):
    d = os.fspath(directory)
    name = os.path.join(d, (b".kvtier_probe_" if isinstance(d, bytes) else ".kvtier_probe_") + (
        secrets.token_hex(8).encode() if isinstance(d, bytes) else secrets.token_hex(8)))
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    return name, fd


def probe_o_direct(directory: PathT) -> bool:
    """Whether files in ``directory`` accept O_DIRECT: a page-aligned 4 KiB
    write and read back with O_DIRECT succeed on a temp file (removed).
    Raises OSError if the directory cannot hold a temp file (ENOENT, EACCES)."""
    import fcntl

    name, fd = _probe_file(directory)
    buf = mmap.mmap(-1, _PROBE_SIZE)  # page-aligned anonymous memory
    try:
        buf.write(b"\xa5" * _PROBE_SIZE)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            if os.pwrite(fd, buf, 0) != _PROBE_SIZE:
                return False
            back = mmap.mmap(-1, _PROBE_SIZE)
            try:
                return os.preadv(fd, [back], 0) == _PROBE_SIZE and back[:] == buf[:]
            finally:
                back.close()
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            raise
    finally:
        buf.close()
        os.close(fd)
        os.unlink(name)


def probe_xattr(directory: PathT) -> bool:
    """Whether files in ``directory`` hold user xattrs: sets and reads back
    ``user.vllm.kv_crc32c`` on a temp file (removed). False when the
    filesystem says EOPNOTSUPP (e.g. ramfs) or EPERM; other OSErrors (ENOENT,
    EACCES, ENOSPC ...) are raised."""
    name, fd = _probe_file(directory)
    try:
        value = b"\x12\x34\x56\x78"
        try:
            os.setxattr(fd, XATTR_NAME, value)
            return os.getxattr(fd, XATTR_NAME) == value
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EPERM):
                return False
            raise
    finally:
        os.close(fd)
        os.unlink(name)


__all__ = [
    "BACKENDS",
    "BlockIO",
    "COMMITTING",
    "DONE",
    "EXPIRED",
    "JobState",
    "LIVE",
    "PHASE",
    "XATTR_NAME",
    "backend",
    "batch_load_block",
    "batch_lookup",
    "batch_store_block",
    "checksum_stats",
    "for_backend",
    "probe_o_direct",
    "probe_xattr",
    "tmp_path_for",
]
