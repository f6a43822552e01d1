"""The error and verification policy of block I/O, shared by the Python side.

The rules (docs/design.md "Error policy", the table) are implemented once per backend:
csrc/policy.h + csrc/fs_io.c (C core) and kvtier/fallback.py (pure Python), with the
same outcomes. This module holds what both present to Python: the counter names a
batch call's ``counts=`` dict gets, the ``operation`` and ``condemned`` names an
OSError carries, the retry constants, the checksum modes and the identity record.
"""
from __future__ import annotations

import errno
import os
import time
from typing import Union

COUNT_DOCS = {
    "unverified": "blocks loaded without a CRC record on a checksummed tier",
    "unverified_miss": "blocks without a CRC record in strict mode: a miss, file kept",
    "reread_checksum": "blocks re-read after a first CRC mismatch",
    "reread_identity": "blocks re-read after a first identity-record mismatch",
    "reread_short": "blocks reopened after a first short read",
    "restat_size": "blocks reopened after a first wrong size",
    "condemned_checksum": "blocks condemned by a CRC mismatch on two reads (EBADMSG, removed)",
    "condemned_identity": "blocks condemned by an identity mismatch on two reads (EBADMSG, removed)",
    "condemned_size": "blocks condemned by a wrong size on two opens (EIO, removed)",
    "condemned_short": "blocks condemned by a short read on two opens (EIO, removed)",
    "retry_eintr": "EINTR retried in place (what the backend sees; CPython retries some calls itself)",
    "retry_eagain": "EAGAIN/EWOULDBLOCK: the block retried from its open",
    "retry_estale": "ESTALE: the block retried from its open",
    "durable_existing": "durable stores that synced an existing block (file and directory)",
    "replaced": "stores that replaced a symlink, FIFO or file of another size at the block path",
    "existing": "stores skipped: a regular file of the block size was already there (no bytes written)",
    "buffered_unaligned": "stores without checksum written buffered although O_DIRECT was on: the caller's "
                          "buffer is not page aligned (a checksummed store writes from aligned slots)",
}
"""The per-call policy counters and their meaning, in the C core's order (csrc/policy.h)."""
COUNT_NAMES = tuple(COUNT_DOCS)
"""Names of the per-call policy counters, in the C core's order (csrc/policy.h)."""

OPERATIONS = ("open", "stat", "read", "getxattr", "verify", "mkdir", "write", "setxattr", "sync", "close",
              "rename")
"""Values of a batch OSError's ``operation`` (the failing call; "verify": the block's bytes,
size or records were judged)."""

CAUSES = ("checksum", "identity", "size", "short_read")
"""Values of a batch OSError's ``condemned`` (None when the file was kept)."""

RETRY_EINTR_MAX = 100
"""EINTR: a call is retried at once, in place, up to this many times in a row."""
RETRY_TRANSIENT = 3
"""EAGAIN / EWOULDBLOCK / ESTALE: a block is retried from its open this many times."""
BACKOFF_US = 1000
"""Sleep before the first such retry (microseconds), doubled for each next one."""
RETRY_ENOENT_STORE = 9
"""A store's temp open answering ENOENT although its parents were just made (a shared
filesystem's name cache, GlusterFS about 1 s): parents made again and the open retried this
many times, after 2 ms, 4 ms ... 512 ms (csrc/policy.h KVT_RETRY_ENOENT_STORE)."""
TRANSIENT_ERRNOS = {errno.EAGAIN: "retry_eagain", errno.EWOULDBLOCK: "retry_eagain", errno.ESTALE: "retry_estale"}

ID_XATTR_NAME = "user.kvtier.id"
"""Identity record: binds a block to its name (layout digest, rank, key) and size, and carries
its CRC32C (:func:`identity_record`); vLLM ignores it."""
ID_LEN = 8
"""Bytes of the identity (:func:`block_identity`); an identity record of this length (as stored
before the record carried the CRC) is still read, the CRC then in user.vllm.kv_crc32c."""
ID_REC_LEN = 12
"""Bytes of the identity record a store sets: identity, then the CRC32C (csrc/policy.h)."""

CHECKSUM_MODES = (False, True, "strict")
"""``checksum=`` of the batch calls / ``checksum_blocks`` of a tier."""


def check_mode(value, what: str = "checksum") -> Union[bool, str]:
    """``value`` if it is a checksum mode (False, True, "strict"), else TypeError/ValueError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value == "strict":
            return value
        raise ValueError(f"{what} must be True, False or 'strict', not {value!r}")
    raise TypeError(f"{what} must be a bool or 'strict', got {type(value).__name__}")


def retry_transient(err: int, attempt: int, counts: dict) -> bool:
    """True (counted, after the backoff) if ``err`` is retried from the block's open at
    0-based ``attempt`` (csrc/policy.c kvt_policy_retry)."""
    name = TRANSIENT_ERRNOS.get(err)
    if name is None or attempt >= RETRY_TRANSIENT:
        return False
    counts[name] = counts.get(name, 0) + 1
    time.sleep(BACKOFF_US * (1 << attempt) / 1e6)
    return True


_FNV_OFFSET, _FNV_PRIME, _MASK = 1469598103934665603, 1099511628211, (1 << 64) - 1


def _id_scan(parts: "list[bytes]", got: "list[bytes]", skip: int) -> int:
    # Components from the end, lexically: empty and "." skipped, each ".." cancels the
    # nearest real component before it (``skip`` pending); up to four real ones into
    # ``got``, last first (csrc/policy.c id_scan).
    for c in reversed(parts):
        if len(got) == 4:
            break
        if c in (b"", b"."):
            continue
        if c == b"..":
            skip += 1
        elif skip:
            skip -= 1
        else:
            got.append(c)
    return skip


def block_identity(path: Union[str, bytes, "os.PathLike"], block_size: int) -> bytes:
    """The identity record of a block stored at ``path`` with ``block_size`` bytes:
    FNV-1a 64 of ``b"kvtier.id.v1\\0" + <last 4 path components> + b"\\0" +
    str(block_size)``, 8 bytes big-endian (csrc/policy.c kvt_block_identity). The
    components are those of the path normalised lexically, as :func:`os.path.normpath`
    (empty components and "." dropped, ".." pops the one before it), a relative path
    taken against the working directory (read only when the relative path has fewer
    than four components after normalisation), joined by "/"; fewer than four in all:
    "/" and all of them. So "x.bin", "./x.bin", "d//x.bin", "d/./x.bin" and the
    absolute spelling of one file have one identity; a clean absolute path hashes its
    own bytes after its fourth-last "/" (as before normalisation existed). Symbolic
    links and bind mounts are not resolved: load a block through the directory names it
    was stored under (FileMapper does). The last four components of a FileMapper path
    are ``<model>_<digest>_r<rank>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin``: layout digest,
    rank and key."""
    p = os.fsencode(path)
    got: "list[bytes]" = []
    skip = _id_scan(p.split(b"/"), got, 0)
    if len(got) < 4 and not p.startswith(b"/"):
        try:
            _id_scan(os.getcwdb().split(b"/"), got, skip)
        except OSError:  # the working directory removed: as if at "/"
            pass
    got.reverse()
    tail = b"/".join(got) if len(got) == 4 else b"/" + b"/".join(got)
    h = _FNV_OFFSET
    for b in b"kvtier.id.v1\0" + tail + b"\0" + str(int(block_size)).encode():
        h = ((h ^ b) * _FNV_PRIME) & _MASK
    return h.to_bytes(8, "big")


def identity_record(path: Union[str, bytes, "os.PathLike"], block_size: int, crc: int) -> bytes:
    """The identity record a checksummed store sets in :data:`ID_XATTR_NAME`:
    :func:`block_identity` (8 bytes) then ``crc`` (the block's CRC32C, 4 bytes big-endian,
    the value of user.vllm.kv_crc32c), so that a load of a block kvtier stored reads one
    xattr (csrc/fs_io.c read_verify)."""
    return block_identity(path, block_size) + (crc & 0xFFFFFFFF).to_bytes(4, "big")


def parse_identity(rec: "bytes | None", ident: bytes) -> "tuple[str, int | None]":
    """Judge an identity record (``None``: absent) against ``ident`` (the loading block's
    :func:`block_identity`), as csrc/xattr_record.c kvt_id_parse: ("crc", crc) for 12
    bytes of this identity, ("only", None) for 8 bytes of it (the CRC is in
    user.vllm.kv_crc32c), ("absent", None), ("mismatch", None) for another identity or
    another length."""
    if rec is None:
        return "absent", None
    if len(rec) not in (ID_LEN, ID_REC_LEN) or rec[:ID_LEN] != ident:
        return "mismatch", None
    if len(rec) == ID_LEN:
        return "only", None
    return "crc", int.from_bytes(rec[ID_LEN:], "big")
