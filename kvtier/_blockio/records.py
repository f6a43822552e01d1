"""The on-disk records of a block and their judgement (docs/design.md "On-disk contract").

One place on the Python side for the record names and lengths, the identity hash, and the
rule by which a block's records are judged: :func:`judge` is what the pure-Python load
(kvtier.fallback) and ``kvtier scrub`` both call, so scrub reports what a load would do.
The C core has the same rules in csrc/ (the records parser and the identity hash); tests
keep both equal (tests/test_policy.py, tests/test_block_io.py).
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional, Union

XATTR_NAME = "user.vllm.kv_crc32c"
"""vLLM's CRC record: a block's CRC32C (RFC 3720), 4 bytes big-endian (vLLM FS tier name)."""
XATTR_LEN = 4
"""Bytes of the CRC record."""
ID_XATTR_NAME = "user.kvtier.id"
"""Identity record: binds a block to its name (layout digest, rank, key) and size, and carries
its CRC32C (:func:`identity_record`); vLLM ignores it."""
ID_LEN = 8
"""Bytes of the identity (:func:`block_identity`), the first part of the identity record."""
ID_REC_LEN = 12
"""Bytes of the identity record: identity, then the CRC32C (csrc/ ``KVT_ID_REC_LEN``)."""

_FNV_OFFSET, _FNV_PRIME, _MASK = 1469598103934665603, 1099511628211, (1 << 64) - 1


def _id_scan(parts: "list[bytes]", got: "list[bytes]", skip: int) -> int:
    # Components from the end, lexically: empty and "." skipped, each ".." cancels the
    # nearest real component before it (``skip`` pending); up to four real ones into
    # ``got``, last first (the C core's id_scan).
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
    """The identity of a block stored at ``path`` with ``block_size`` bytes:
    FNV-1a 64 of ``b"kvtier.id.v1\\0" + <last 4 path components> + b"\\0" +
    str(block_size)``, 8 bytes big-endian (the C core's kvt_block_identity). The
    components are those of the path normalised lexically, as :func:`os.path.normpath`
    (empty components and "." dropped, ".." pops the one before it), a relative path
    taken against the working directory (read only when the relative path has fewer
    than four components after normalisation), joined by "/"; fewer than four in all:
    "/" and all of them. So "x.bin", "./x.bin", "d//x.bin", "d/./x.bin" and the
    absolute spelling of one file have one identity; a clean absolute path hashes its
    own bytes after its fourth-last "/". Symbolic links and bind mounts are not
    resolved: load a block through the directory names it was stored under (FileMapper
    does). The last four components of a FileMapper path are
    ``<model>_<digest>_r<rank>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin``: layout digest, rank
    and key."""
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
    return h.to_bytes(ID_LEN, "big")


def identity_record(path: Union[str, bytes, "os.PathLike"], block_size: int, crc: int) -> bytes:
    """The identity record a checksummed store sets in :data:`ID_XATTR_NAME`:
    :func:`block_identity` (8 bytes) then ``crc`` (the block's CRC32C, 4 bytes big-endian,
    the value of user.vllm.kv_crc32c), so that a load of a block kvtier stored reads one
    xattr."""
    return block_identity(path, block_size) + (crc & 0xFFFFFFFF).to_bytes(XATTR_LEN, "big")


ID_DAMAGED_BITS = 4
"""An identity record whose identity differs from the block's in at most this many of its 64
bits is a damaged record, not another block's (csrc/block/records.h ``KVT_ID_DAMAGED_BITS``):
another block's identity, an FNV-1a hash, differs in about 32."""


def identity_kind(id_rec: Optional[bytes], ident: bytes) -> str:
    """What an identity record is for the block of identity ``ident`` (the C core's
    kvt_id_parse): "absent" (None: stored by vLLM), "own" (12 bytes of this identity: it
    carries the CRC a load checks), "other" (12 bytes of another identity, more than
    :data:`ID_DAMAGED_BITS` of its bits differ: a block copied or renamed under this name,
    an identity failure), "damaged" (the record itself: another length, b"" for one longer
    than any record (ERANGE), or an identity within :data:`ID_DAMAGED_BITS` bits of
    ``ident``: no proof against the bytes, issue #24)."""
    if id_rec is None:
        return "absent"
    if len(id_rec) != ID_REC_LEN:
        return "damaged"
    if id_rec[:ID_LEN] != ident:
        bits = bin(int.from_bytes(id_rec[:ID_LEN], "big") ^ int.from_bytes(ident, "big")).count("1")
        return "damaged" if bits <= ID_DAMAGED_BITS else "other"
    return "own"


class Judgement(NamedTuple):
    """What a block's records say (:func:`judge`)."""

    cause: Optional[str]
    """None (the records, and the bytes when given, are fine), "identity" (a well-formed
    identity record of another block) or "checksum" (a malformed CRC record, or bytes whose
    CRC32C is not the recorded one): a load condemns the block (EBADMSG)."""
    want: Optional[int]
    """The CRC32C the block's bytes must have; None: no CRC record (loaded unverified, a miss
    in strict mode), or refused on its records."""
    source: str
    """The record ``want`` came from (:data:`ID_XATTR_NAME` or :data:`XATTR_NAME`), or ""."""
    id_damaged: bool = False
    """The identity record is damaged (:func:`identity_kind` "damaged", or its CRC bytes
    differ from the bytes that user.vllm.kv_crc32c verifies): the block was judged by
    user.vllm.kv_crc32c alone."""


def needs_crc_record(id_rec: Optional[bytes], ident: bytes) -> bool:
    """Whether a load reads user.vllm.kv_crc32c before the bytes: without an identity record
    (a block stored by vLLM) or with a damaged one (:func:`identity_kind`). (After the bytes
    are read it reads it too when their CRC32C differs from the one this block's identity
    record carries: :func:`judge` with ``crc``.) ``id_rec``: the identity record, None when
    absent; ``ident``: the loading block's :func:`block_identity`."""
    return identity_kind(id_rec, ident) in ("absent", "damaged")


def judge(id_rec: Optional[bytes], crc_rec: Optional[bytes], ident: bytes, crc: Optional[int] = None) -> Judgement:
    """Judge a block's records as a load does (docs/design.md P10, P11, P22).

    ``id_rec``: the identity record (None: absent; b"" for one longer than any record,
    ERANGE); ``crc_rec``: user.vllm.kv_crc32c likewise (None when absent or not read:
    :func:`needs_crc_record`); ``ident``: the loading block's :func:`block_identity`;
    ``crc``: the CRC32C of the block's bytes once read (None: the records alone).

    An identity record of this block (12 bytes) carries the CRC a load checks; when the
    bytes differ from it but match a 4-byte ``crc_rec``, the identity record's CRC bytes are
    what is damaged, not the data: fine, ``id_damaged``. A well-formed identity record of
    another block is an identity failure. A damaged identity record (another length, ERANGE,
    a few bits of its identity flipped) is no proof: the block is judged by ``crc_rec`` as if
    it had none (``id_damaged``). Then a 4-byte user.vllm.kv_crc32c gives the CRC, another
    length is a checksum failure, none at all means unverified."""
    kind = identity_kind(id_rec, ident)
    if kind == "other":
        return Judgement("identity", None, "")
    if kind == "own":
        want = int.from_bytes(id_rec[ID_LEN:], "big")
        if crc is None or crc == want:
            return Judgement(None, want, ID_XATTR_NAME)
        if crc_rec is not None and len(crc_rec) == XATTR_LEN and int.from_bytes(crc_rec, "big") == crc:
            return Judgement(None, crc, XATTR_NAME, True)  # the identity record's CRC bytes damaged
        return Judgement("checksum", want, ID_XATTR_NAME)
    damaged = kind == "damaged"
    if crc_rec is None:
        return Judgement(None, None, "", damaged)
    if len(crc_rec) != XATTR_LEN:
        return Judgement("checksum", None, "", damaged)
    want = int.from_bytes(crc_rec, "big")
    if crc is not None and crc != want:
        return Judgement("checksum", want, XATTR_NAME, damaged)
    return Judgement(None, want, XATTR_NAME, damaged)


def unlink_if_same(path, fd: int) -> str:
    """Remove a condemned block ``path`` only if it still names the file open as ``fd``
    (same st_dev, st_ino): a peer that republished a good block under the same name
    meanwhile keeps it (the C core's unlink_if_same). Returns "" when removed, else why
    not."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError as e:
        return f"not removed: stat: {e.strerror} (errno {e.errno})"
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        return "not removed: the name now points to another file (republished during scrub)"
    try:
        os.unlink(path)
    except OSError as e:
        return f"not removed: unlink: {e.strerror} (errno {e.errno})"
    return ""
