"""Batched, checksummed KV block I/O: the entry points the tier manager calls.

A job's blocks live in one big CPU buffer (``view``: any C-contiguous buffer,
e.g. a numpy array or bytearray, or a contiguous torch CPU tensor of any dtype,
bf16 included, taken as its bytes) at byte ``offsets``, each ``block_size``
bytes. Each block becomes one file (on-disk contract: design.md):

- store: skip an existing destination; write ``<dest>_<random hex>.tmp``
  (O_CREAT|O_EXCL, parents created, O_DIRECT when usable); with ``checksum``
  set xattr ``user.vllm.kv_crc32c`` = CRC32C (RFC 3720) as 4 bytes big-endian
  on the open temp, and the identity record ``user.kvtier.id`` (identity + the
  same CRC, :func:`kvtier._blockio.records.identity_record`); close; rename onto the
  destination.
- load: open, read, with ``checksum`` verify the CRC through the same fd: the
  one the identity record carries, else (a block stored by vLLM) the one of
  ``user.vllm.kv_crc32c``. A block without either (stored with checksums off)
  is accepted, counted unverified ("strict": a miss).

Errors. Bad arguments raise TypeError / ValueError / BufferError before any
I/O (:mod:`kvtier._blockio.args`: a block path ending in ``/``, ``.`` or ``..``, which
names a directory, is a ValueError for stores, loads and lookups alike). A batch stops at its first failing block and raises OSError (the errno's
subclass, e.g. FileNotFoundError) with ``errno``, ``filename`` (that block's
path), ``num_succeeded`` (its index: blocks before it are done),
``checksum_failed`` and ``num_retried`` (int: blocks of this batch re-read
after a first checksum mismatch, the failing block included; 0 for stores).

Which errno a block gets and whether its file is removed is the error policy, one table in
docs/design.md ("Error policy"): in short a block is removed only when provably bad (a CRC
or identity mismatch on two reads: EBADMSG with ``checksum_failed``; a wrong size on two
opens with no intact record of its own: EIO with ``condemned``), and any other error keeps
it (a short read of a file whose size is right is a miss, EIO, kept, after three opens).
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

import errno
import itertools
import os
import secrets
from typing import Sequence, Union

from kvtier._blockio import policy as _policy
from kvtier._blockio.args import as_int as _as_int, check_blocks as _check_blocks, check_bool as _check_bool
from kvtier._blockio.args import check_counts as _check_counts, check_paths as _check_paths
from kvtier._blockio.jobstate import COMMITTING, DONE, EXPIRED, LIVE, PHASE, JobState, lock_cas as _lock_cas
from kvtier._blockio.probes import probe_o_direct, probe_xattr
from kvtier._blockio.records import XATTR_NAME

PathT = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

BACKENDS = ("c", "python")
"""Valid values of KVTIER_IO_BACKEND and of :func:`for_backend`."""


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


def _name_the_temp_suffix(e: OSError, tag: str) -> None:
    """ENAMETOOLONG from a store whose block name fits the filesystem's NAME_MAX but whose
    temp name (the name + ``_<16 hex>.tmp``, 21 bytes more) does not: the message says so
    (it said only "File name too long" of a name that is not)."""
    dest = e.filename
    if dest is None:
        return
    d, name = os.path.split(os.fsencode(dest))
    try:
        name_max = os.pathconf(d or b".", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    extra = len(os.fsencode(_tmp_with("", tag)))
    if len(name) <= name_max < len(name) + extra:
        e.strerror = (f"File name too long: the block's name ({len(name)} bytes) fits NAME_MAX ({name_max}), "
                      f"but its temp name (the name + '_<16 hex>.tmp', {len(name) + extra} bytes) does not; "
                      f"keep block names at most {name_max - extra} bytes")


def _job_state_arg(job_state, backend: str) -> dict:
    """``job_state``: None, a :class:`JobState`, or a bare state word (a writable
    buffer of >= 4 bytes, 4-byte aligned, its first 4 bytes the word), checked by
    the backend (TypeError, BufferError, ValueError). The fallback is told the CAS of a
    JobState, so that both parties of the word use the same one (its own, the lock,
    for a bare word)."""
    if job_state is None:
        return {}
    if not isinstance(job_state, JobState):
        return {"job_state": job_state}
    kw = {"job_state": job_state.buffer}
    if backend == "python" and job_state.cas is not _lock_cas:
        kw["job_state_cas"] = job_state.cas
    return kw


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
        :func:`kvtier._blockio.records.identity_record`).
        ``counts``: a dict the call's policy counters are added to
        (:data:`kvtier._blockio.policy.COUNT_NAMES`; its values ints, not bool,
        in 0..2**64-1, checked before any I/O: TypeError / ValueError). With ``job_state`` (a
        :class:`JobState`, or a bare state word: a writable buffer of >= 4
        bytes, 4-byte aligned) each rename runs in a commit section; an expired
        job stops with OSError ETIMEDOUT and unlinks the temp it did not rename
        (module docstring, "Deadlines"). Errors: module docstring; a store
        OSError names the destination and leaves no temp behind."""
        checksum = _policy.check_mode(checksum)
        _check_bool(use_o_direct, "use_o_direct")
        _check_bool(durable, "durable")
        paths, mv, offsets, block_size = _check_blocks(paths, view, offsets, block_size, writable=False)
        _check_counts(counts)
        tag = _store_tag()  # one per call: the destinations of a batch differ already
        tmps = [_tmp_with(p, tag) for p in paths]
        kw = _job_state_arg(job_state, self.backend)
        if counts is not None:
            kw["counts"] = counts
        try:
            self.impl.batch_store_block(tmps, paths, mv, use_o_direct, checksum, durable=durable, offsets=offsets,
                                        block_size=block_size, **kw)
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                _name_the_temp_suffix(e, tag)
            raise

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
        landing: str = "bounce",
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
        re-reads, condemned blocks by cause, retries by errno; checked as a
        store's). With
        ``job_state`` (see batch_store_block) bytes are read into private
        memory and enter ``view`` only in commit sections; an expired job
        stops with OSError ETIMEDOUT (``num_succeeded`` = blocks fully loaded)
        and writes nothing more (module docstring, "Deadlines").
        ``landing="direct"`` (:mod:`kvtier._tier.landing`): an O_DIRECT block into a
        page-aligned ``view`` slice, and an unchecksummed buffered one, are read
        straight into ``view`` (checksummed there: no copy), the whole read inside
        one commit section, so an expiry meanwhile is reported once the read
        returned: only where the kernel bounds the I/O (a local disk, tmpfs);
        ``"bounce"`` (the default) as above."""
        checksum = _policy.check_mode(checksum)
        _check_bool(use_o_direct, "use_o_direct")
        paths, mv, offsets, block_size = _check_blocks(paths, view, offsets, block_size, writable=True)
        _check_counts(counts)
        kw = _job_state_arg(job_state, self.backend)
        if counts is not None:
            kw["counts"] = counts
        if landing != "bounce":
            if landing != "direct":
                raise ValueError(f"landing must be 'bounce' or 'direct', not {landing!r}")
            kw["landing"] = landing
        return self.impl.batch_load_block(paths, mv, use_o_direct, checksum, offsets=offsets, block_size=block_size,
                                          **kw)

    def batch_lookup(self, paths: Sequence[PathT], block_size: int = 0) -> list:
        """list[bool]: whether each path is a regular file (not a symlink,
        directory or FIFO) of ``block_size`` bytes (any size when 0). The paths are
        checked as a store's (TypeError / ValueError: a NUL, an empty path, one ending in
        ``/``, ``.`` or ``..``)."""
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
