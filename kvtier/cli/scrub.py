"""``kvtier scrub ROOT``: verify every block file of a cache against its CRC32C and size.

For each ``*.bin`` under ROOT (the FileMapper layout, see :mod:`kvtier.file_mapper`):

============  ==========================================================================
status        meaning
============  ==========================================================================
ok            CRC32C equals every CRC recorded: xattr ``user.vllm.kv_crc32c`` and the one
              the identity record ``user.kvtier.id`` carries (12 bytes), and the size is
              not known to be wrong (a size that differs only from a guessed size is a
              note, not an error)
corrupt       judged as a load judges it (docs/design.md P10, P11, P22): CRC32C differs
              on two reads (the second after POSIX_FADV_DONTNEED) from the CRC a 12-byte
              identity record of this block carries, else from ``user.vllm.kv_crc32c``, or
              that xattr is not 4 bytes, or the identity record is a well-formed record of
              another block (a block stored under another key's name): a load would fail
              with EBADMSG and remove it.  A damaged identity record (another length, a few
              bits of its identity flipped, or its CRC bytes differing from bytes that
              ``user.vllm.kv_crc32c`` verifies) is no proof: judged by
              ``user.vllm.kv_crc32c``, as a load judges it, noted.  With a good identity
              record, a malformed or disagreeing ``user.vllm.kv_crc32c`` is a note on an
              ``ok`` block (a reader checking that record, as the open upstream vLLM
              checksum PR's would, rejects it; vLLM 0.33 checks no CRC; kvtier's load does
              not read it)
no_checksum   no CRC recorded (stored with checksums off, by vLLM, or copied without
              xattrs), or none usable (no ``user.vllm.kv_crc32c`` and a damaged identity
              record: said so): loads unverified (checksum_blocks=True) or is a miss
              ("strict")
wrong_size    size differs from a known block size (a load would fail with EIO)
error         could not be read (EACCES, ELOOP for a symlink, EIO...), or a directory at a
              block path (every load and store of that key fails EISDIR; not walked):
              kept, reported, never removed
gone          listed, then removed before its check (ENOENT at its open or lstat: on a
              live root, evicted by a bounded root's evictor, condemned by a load, removed
              by another tool): not checked, not an error (a directory removed between its
              listing and its walk, as the evictor removes emptied ones, is skipped)
============  ==========================================================================

Stray temp files (``<dest>_<hex>.tmp`` left by a crashed store, ``.kvtier_probe_*``) are
reported as ``stray_temp``.  A block whose first read does not match its xattr but whose
re-read does is ``ok`` and counted as ``retried``.

Expected block size, per rank directory and KV-cache group (``<hh>_g<group>`` directories;
hybrid models have one block size per group): known from ``block_bytes`` in ``kvtier.json``
beside ``config.json`` (written by :class:`kvtier.manager.FileSystemTierManager`), else from
``--block-size``; otherwise guessed as the strictly most common size among the group's
``.bin`` files.  A guessed size never condemns a block: a block of another size is
``corrupt`` only if its CRC32C does not match.  vLLM's ``config.json`` fields (model,
tokens per block, dtype, layer names) do not give the bytes per block, because head count
and head dimension are not among them.

``--remove`` deletes ``corrupt`` blocks and ``wrong_size`` blocks without a matching CRC32C
(a block of an unexpected size whose bytes verify is reported and kept: a hybrid cache with
one size per KV-cache group, or a wrong ``--block-size``, is not corruption), and only if the name still
points to the file that was read (same st_dev and st_ino: a block republished meanwhile
stays).

``--adopt`` records a checksum for ``no_checksum`` blocks an operator trusts (the migration
path from vLLM's fs tier, or a copy made without xattrs): the CRC32C of the bytes as they
are now and the identity record of its path and size, set on the open file; a block of a
known wrong size is not adopted.  ``--strict`` treats ``no_checksum`` blocks (not adopted)
as findings: exit status 1.

A bounded root (``max_bytes``, docs/capacity.md) has its evictor's latest census in
``ROOT/.kvtier/usage.json``: the report's first line adds it (bytes used of ``max_bytes``, how
old the census is, which process made it). Nothing there is changed; scrub's own byte count
is of the ``.bin`` files it read, the census's of every file the filesystem allocated.

Exit status: 0 clean, 1 if any corrupt or wrong-size block was found (also with
``--remove``), a directory could not be read (its blocks unchecked), or with ``--strict``
any unverified block, 2 for usage errors and a ROOT that cannot be listed.
"""
from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import re
import stat
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import kvtier
from kvtier._blockio import records
from kvtier._blockio.records import ID_XATTR_NAME, XATTR_NAME, unlink_if_same as _unlink_if_same
from kvtier.file_mapper import BLOCK_INFO_FILENAME

# Bytes per os.preadv into one reused buffer. Source: measured, no spec sets it.  One buffer
# bounds scrub's memory whatever the block size; per read, one preadv(2) + one kvtier.crc32c call
# cost a few microseconds against ~120 us for the CRC32C of 1 MiB at ~8.5 GB/s (<3%).  `python
# benchmarks/scrub_chunk_bench.py` (256 MiB on /dev/shm, ISA-L backend, 2-core host, best of 5)
# gave GB/s, reused / fresh buffer: 256 KiB 8.84/8.58, 1 MiB 8.54/8.25, 4 MiB 8.12/7.53, 16 MiB
# 7.65/5.06.
_CHUNK = 1 << 20
_TMP_RE = re.compile(r"(\.bin_[0-9a-fA-F]+\.tmp|\.tmp)$")
_RANK_RE = re.compile(r"^(?P<base>.+)_r(?P<rank>\d+)$")
_GROUP_RE = re.compile(r"_g(?P<group>\d+)$")
STATUSES = ("ok", "corrupt", "no_checksum", "wrong_size", "error", "stray_temp", "gone")
_GONE = ("gone while the scrub ran (ENOENT at {op}: evicted by a bounded root's evictor, condemned by a "
         "load or removed by another tool after the listing): not checked")


@dataclass
class Finding:
    """What scrub found for one file.

    ``path``: the file; ``status``: one of :data:`STATUSES`; ``size``: its size in bytes
    (0 if it could not be examined); ``expected_size``: the expected block size in bytes
    for its (rank directory, KV-cache group), or None if unknown; ``size_source``: where that
    came from (``"kvtier.json"``, ``"--block-size"``, ``"guess"`` = most common size in the
    group, or None); ``detail``: human-readable reason or note; ``retried``: the first read
    did not match the xattr and the block was re-read after ``POSIX_FADV_DONTNEED``;
    ``removed``: deleted by ``--remove``.
    """

    path: str
    status: str
    size: int
    expected_size: Optional[int] = None
    size_source: Optional[str] = None
    detail: str = ""
    retried: bool = False
    removed: bool = False
    adopted: bool = False


def _group_of(path: str) -> Optional[int]:
    """KV-cache group index from the parent directory ``<hh>_g<group>``, or None."""
    m = _GROUP_RE.search(os.path.basename(os.path.dirname(path)))
    return int(m.group("group")) if m else None


def _known_size(rankdir: str, block_size: Optional[int]) -> Tuple[Optional[int], Optional[str]]:
    """(bytes, source) from ``kvtier.json`` beside the rank directory, else ``--block-size``."""
    m = _RANK_RE.match(os.path.basename(rankdir))
    if m:
        info = os.path.join(os.path.dirname(rankdir), m.group("base"), BLOCK_INFO_FILENAME)
        try:
            with open(info, encoding="utf-8") as f:
                v = json.load(f).get("block_bytes")
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v, "kvtier.json"
        except (OSError, ValueError, AttributeError):
            pass
    if block_size:
        return block_size, "--block-size"
    return None, None


def _expected_sizes(files_by_group: Dict[tuple, List[tuple]], block_size: Optional[int]) -> Dict[tuple, tuple]:
    """``{(rankdir, group): (bytes or None, source or None)}``.

    A known size (kvtier.json, --block-size) applies to every group of a rank directory.
    Otherwise the size is guessed per group (hybrid models have one block size per KV-cache
    group): the strictly most common size among that group's files, else None.
    """
    out = {}
    for (rankdir, group), files in files_by_group.items():
        exp, src = _known_size(rankdir, block_size)
        if exp is None:
            counts = collections.Counter(size for _, size in files if size is not None)
            if counts:
                (size, n), *rest = counts.most_common(2) + [(None, 0)]
                if n > rest[0][1]:
                    exp, src = size, "guess"
        out[(rankdir, group)] = (exp, src)
    return out


def _rank_dir(root: str, path: str) -> str:
    """The top-level directory under ``root`` holding ``path`` (``<model>_<digest>_r<rank>``)."""
    rel = os.path.relpath(path, root)
    first = rel.split(os.sep, 1)[0]
    return os.path.join(root, first) if os.sep in rel else root


def _crc_of(fd: int, buf: bytearray) -> Tuple[int, int]:
    """(CRC32C, bytes read) of the file open as ``fd``, read from offset 0 in chunks."""
    mv = memoryview(buf)
    crc, off = 0, 0
    while True:
        n = os.preadv(fd, [buf], off)
        if n == 0:
            return crc, off
        crc = kvtier.crc32c(mv[:n], crc)
        off += n


def _remove_if(remove: bool, f, path: str, fd: int):
    """With ``remove``, unlink a condemned ``path`` if it is still the file ``fd`` (the
    reason it was not, appended to ``f.detail``); returns ``f``."""
    if remove:
        why = _unlink_if_same(path, fd)
        f.removed = not why
        if why:
            f.detail += "; " + why
    return f


def _matches(verdict, wants: dict, crc: int, ident, rec, own: bytes) -> bool:
    """Whether bytes of CRC32C ``crc`` pass: the load's judgement (records.judge, which asks
    user.vllm.kv_crc32c when the identity record's CRC differs) where the records are this
    block's, else (a well-formed identity record of another block) every CRC recorded."""
    if verdict.cause == "identity":
        return all(crc == w for w in wants.values())
    return records.judge(ident, rec, own, crc).cause is None


def _damaged_note(ident: bytes, crc_differs: bool, too_long: bool = False, no_crc_record: bool = False) -> str:
    """The note on a block whose identity record is damaged (records.identity_kind, or its
    CRC bytes alone differing: ``crc_differs``): ``too_long`` when getxattr said ERANGE (the
    value is longer than the kernel returns), else its length (0 bytes included); judged by
    user.vllm.kv_crc32c, or, with ``no_crc_record`` (that xattr absent too), by nothing: a
    load takes the block unverified, as one without records."""
    if too_long:
        what = "longer than any record"
    elif len(ident) != records.ID_REC_LEN:
        what = f"{len(ident)} bytes, not {records.ID_REC_LEN}"
    elif crc_differs:
        what = f"{records.ID_REC_LEN} bytes"
    else:
        what = f"{records.ID_REC_LEN} bytes, its identity within {records.ID_DAMAGED_BITS} bits of this block's"
    return (f"identity record user.kvtier.id is damaged ({what}"
            + (", its CRC differs from the bytes" if crc_differs else "")
            + "): no proof against the bytes (a well-formed record of another block would differ in "
              "about 32 bits of its identity); "
            + ("with no user.vllm.kv_crc32c either, nothing verifies the bytes: a load takes it unverified "
               "(a miss with checksum_blocks='strict')" if no_crc_record
               else "judged by user.vllm.kv_crc32c, as a load judges it"))


def _adopt(fd: int, path: str, size: int, buf: bytearray) -> str:
    """Record the CRC32C of the open file's bytes and its identity record. Returns "" or
    why not."""
    try:
        crc, n = _crc_of(fd, buf)
        if n != size:
            return f"not adopted: read {n} bytes of {size}: file changed during scrub"
        os.setxattr(fd, XATTR_NAME, crc.to_bytes(4, "big"))
        os.setxattr(fd, ID_XATTR_NAME, records.identity_record(path, size, crc))
    except OSError as e:
        return f"not adopted: {e.strerror} (errno {e.errno})"
    return ""


def _verify(path: str, lsize: Optional[int], expected: Optional[int], source: Optional[str],
            remove: bool, buf: bytearray, adopt: bool = False) -> Finding:
    """Check one block file; with ``remove``, unlink it (fd still open) if provably bad.

    Provably bad: a size differing from a known size (kvtier.json / --block-size), a
    malformed xattr record, or a CRC32C that differs from the xattr on two reads (the second
    after ``POSIX_FADV_DONTNEED``, as the load path does).  A size that differs only from a
    guessed size condemns nothing: a block whose CRC32C matches is ok (with a note).
    """
    f = Finding(path, "error", lsize or 0, expected, source)
    if lsize is None:
        try:
            mode = os.lstat(path).st_mode
        except OSError as e:
            if e.errno == errno.ENOENT:
                f.status, f.detail = "gone", _GONE.format(op="lstat")
                return f
            f.detail = f"lstat: {e.strerror} (errno {e.errno})"
            return f
        if stat.S_ISDIR(mode):  # never removed by scrub, not even an empty one
            f.detail = ("a directory at a block path: every load (EISDIR) and store (EISDIR) of "
                        "this key fails; kept: not scrub's to remove")
        else:
            f.detail = "not a regular file (symlink?): kept"
        return f
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENOENT:  # listed, then removed: not an error of the cache
            f.status, f.detail = "gone", _GONE.format(op="open")
            return f
        f.detail = f"open: {e.strerror} (errno {e.errno})"
        return f
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            f.detail = "not a regular file: kept"
            return f
        size = f.size = st.st_size
        known = source in ("kvtier.json", "--block-size")
        odd = expected is not None and size != expected
        guess_note = (f"{size} bytes, the most common size in this group is {expected} "
                      "(a guess: no kvtier.json or --block-size)") if odd and not known else ""
        size_note = f"{size} bytes, expected {expected} ({source})" if odd and known else ""
        # The CRC32C is checked whatever the size: a block whose bytes verify is never removed
        # for its size alone (a hybrid cache or a wrong --block-size is not corruption).
        # The records are judged as a load judges them (kvtier._blockio.records.judge,
        # design.md P10, P11, P22): a 12-byte identity record of this block carries the CRC a
        # load checks, and then only that one; user.vllm.kv_crc32c (which the open upstream
        # vLLM checksum PR's reader would check; vLLM 0.33 checks none) is then noted when it
        # disagrees, never condemning.
        rec = ident = None
        too_long = False  # user.kvtier.id longer than getxattr returns (ERANGE): ident b"", damaged
        no_rec_errno = errno.ENODATA
        try:
            rec = os.getxattr(fd, XATTR_NAME)
        except OSError as e:
            if e.errno not in (errno.ENODATA, errno.EOPNOTSUPP):
                f.detail = f"getxattr: {e.strerror} (errno {e.errno})"
                return f
            no_rec_errno = e.errno
        try:
            ident = os.getxattr(fd, ID_XATTR_NAME)
        except OSError as e:
            ident = b"" if e.errno == errno.ERANGE else None  # none (written by vLLM), or unreadable
            too_long = e.errno == errno.ERANGE
        own = records.block_identity(path, size)
        verdict = records.judge(ident, rec, own)
        if verdict.cause == "identity":
            # a load refuses it on its records; its bytes are checked against every CRC
            # recorded all the same, for the report (a truncated copy is wrong_size)
            wants = {}
            if rec is not None and len(rec) == records.XATTR_LEN:
                wants[XATTR_NAME] = int.from_bytes(rec, "big")
            if ident is not None and len(ident) == records.ID_REC_LEN:
                wants[ID_XATTR_NAME] = int.from_bytes(ident[records.ID_LEN:], "big")
        else:
            wants = {} if verdict.want is None else {verdict.source: verdict.want}
        vllm_note = ""
        if verdict.source == ID_XATTR_NAME and rec is not None and (
                len(rec) != records.XATTR_LEN or int.from_bytes(rec, "big") != verdict.want):
            vllm_note = (f"user.vllm.kv_crc32c is {len(rec)} bytes, not 4" if len(rec) != records.XATTR_LEN else
                         f"user.vllm.kv_crc32c 0x{int.from_bytes(rec, 'big'):08x} differs from the identity record's")
            vllm_note += (": kvtier loads it by its identity record's CRC32C; a reader checking "
                          "user.vllm.kv_crc32c (the open upstream vLLM checksum PR's; vLLM 0.33 "
                          "checks no CRC) would reject it; kept")
        if verdict.cause is None and verdict.want is None:
            f.status = "no_checksum"
            f.detail = "; ".join(filter(None, [
                ("no user.vllm.kv_crc32c and no usable identity record: unverified" if verdict.id_damaged
                 else "no xattr: unverified"),
                _damaged_note(ident, False, too_long, no_crc_record=True) if verdict.id_damaged else "",
                                               guess_note]))
            if size_note:  # unverifiable and of the wrong size: a load would fail (EIO)
                f.status, f.detail = "wrong_size", size_note + "; no xattr"
                _remove_if(remove, f, path, fd)
            elif adopt and no_rec_errno == errno.ENODATA:
                why = _adopt(fd, path, size, buf)
                f.adopted = not why
                f.detail += "; " + (why or "adopted: CRC32C and identity recorded")
            return f
        if verdict.cause == "checksum":  # a malformed user.vllm.kv_crc32c, no (good) identity record
            f.status = "corrupt"
            f.detail = "; ".join(filter(None, [f"xattr record is {len(rec)} bytes, not 4",
                                               _damaged_note(ident, False, too_long) if verdict.id_damaged else ""]))
        else:
            for attempt in range(2):
                try:
                    crc, n = _crc_of(fd, buf)
                except OSError as e:
                    f.detail = f"read: {e.strerror} (errno {e.errno})"
                    return f
                if n != size:
                    f.detail = f"read {n} bytes of {size}: file changed during scrub"
                    return f
                if _matches(verdict, wants, crc, ident, rec, own):
                    break
                if attempt == 0:  # maybe a stale page-cache copy: re-read from the device
                    f.retried = True
                    try:
                        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
                    except OSError:
                        pass  # advice only: the re-read still happens
            matches = _matches(verdict, wants, crc, ident, rec, own)
            # the identity record's CRC bytes damaged: the bytes verify by user.vllm.kv_crc32c
            crc_damaged = matches and not verdict.id_damaged and records.judge(ident, rec, own, crc).id_damaged
            if matches and size_note:
                f.status = "wrong_size"
                f.detail = size_note + "; CRC32C matches: kept (a layout or --block-size mismatch, not corruption)"
                return f
            if matches:
                if verdict.cause == "identity":
                    f.status = "corrupt"
                    f.detail = ("identity record user.kvtier.id is not this block's: its bytes verify, "
                                "but it was stored under another key's name or layout")
                    return _remove_if(remove, f, path, fd)
                f.status = "ok"
                notes = []
                if f.retried:
                    notes.append("first read did not match the xattr; re-read after "
                                 "POSIX_FADV_DONTNEED matched")
                if guess_note:
                    notes.append(guess_note + "; CRC32C matches: kept")
                if vllm_note and not crc_damaged:
                    notes.append(vllm_note)
                if verdict.id_damaged or crc_damaged:
                    notes.append(_damaged_note(ident, crc_damaged, too_long))
                f.detail = "; ".join(notes)
                return f
            if len(set(wants.values())) == 1:
                recorded = f"0x{next(iter(wants.values())):08x}"
            else:  # the records disagree (not as a store sets them): name each
                recorded = ", ".join(f"0x{w:08x} in {k}" for k, w in wants.items())
            f.status = "wrong_size" if size_note else "corrupt"  # both removable
            f.detail = "; ".join(filter(None, [
                f"CRC32C 0x{crc:08x}, recorded {recorded}"
                + (" (twice: re-read after POSIX_FADV_DONTNEED)" if f.retried else ""),
                _damaged_note(ident, False, too_long) if verdict.id_damaged else "", guess_note, size_note]))
        return _remove_if(remove, f, path, fd)
    finally:
        os.close(fd)


def scrub(root: str, block_size: Optional[int] = None, remove: bool = False, progress: bool = True,
          adopt: bool = False, strict: bool = False) -> dict:
    """Scrub the cache at ``root`` (a directory path).

    ``block_size``: expected bytes per block where ``kvtier.json`` does not record it.
    ``remove``: delete provably bad blocks (``corrupt``, and ``wrong_size`` without a matching
    CRC32C).  ``progress``: tqdm bar on stderr.

    Returns a dict: ``root``; ``blocks`` (count) and ``bytes`` scanned; ``expected_block_bytes``
    ``{"<rank dir>/g<group>": {"bytes": int or None, "source": str or None}}``; ``counts``
    (per status in :data:`STATUSES`; ``gone``: files removed between the listing and their
    check, not errors); ``retried`` (blocks whose first read did not match and
    whose re-read did: status ok); ``findings`` (:class:`Finding` as dicts: every non-ok file
    and every ok block with a note; a directory the walk could not list is an ``error``
    finding); ``removed`` (paths); ``clean`` (no corrupt or wrong-size block, no unreadable
    directory: its blocks were not checked); ``capacity``: :func:`capacity_summary` of a bounded root, else None.

    Raises OSError (ENOENT, ENOTDIR, EACCES, with filename) if ``root`` is not a directory
    or cannot be listed, ValueError for a non-positive ``block_size``.
    """
    from tqdm import tqdm

    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if not os.path.isdir(root):
        e = errno.ENOTDIR if os.path.exists(root) else errno.ENOENT
        raise OSError(e, os.strerror(e), root)
    os.scandir(root).close()  # an unreadable root: its EACCES, not "no cache found"
    blocks: Dict[tuple, List[tuple]] = collections.defaultdict(list)
    temps: List[Finding] = []
    unreadable: List[Finding] = []  # directories the walk could not list: their blocks unseen

    def walk_error(e: OSError) -> None:
        if e.errno == errno.ENOENT:  # listed, then removed (the evictor removes emptied shard directories)
            return
        unreadable.append(Finding(e.filename, "error", 0, None, None,
                                  f"directory not readable ({e.strerror}, errno {e.errno}): its blocks not checked"))

    for dirpath, dirnames, filenames in os.walk(root, onerror=walk_error):
        dirnames.sort()
        for name in [n for n in dirnames if n.endswith(".bin")]:  # at a block path: reported, not walked
            dirnames.remove(name)
            p = os.path.join(dirpath, name)
            blocks[(_rank_dir(root, p), _group_of(p))].append((p, None))
        for name in sorted(filenames):
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if name.endswith(".bin"):
                # size None: not a regular file (symlink, fifo...): reported as error
                blocks[(_rank_dir(root, p), _group_of(p))].append(
                    (p, st.st_size if stat.S_ISREG(st.st_mode) else None))
            elif name.startswith(".kvtier_probe_") or _TMP_RE.search(name):
                temps.append(Finding(p, "stray_temp", st.st_size, None, None, "left by an interrupted store"))
    expected = _expected_sizes(blocks, block_size)
    total = sum(size or 0 for files in blocks.values() for _, size in files)
    findings: List[Finding] = []
    counts = collections.Counter({s: 0 for s in STATUSES})
    retried = 0
    buf = bytearray(_CHUNK)
    order = sorted(blocks, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    with tqdm(total=total, unit="B", unit_scale=True, desc="kvtier scrub", file=sys.stderr,
              disable=None if progress else True, leave=False) as bar:  # None: only on a terminal
        for key in order:
            exp, src = expected[key]
            for path, size in blocks[key]:
                f = _verify(path, size, exp, src, remove, buf, adopt)
                counts[f.status] += 1
                retried += f.retried and f.status == "ok"
                if f.status != "ok" or f.detail:
                    findings.append(f)
                bar.update(size or 0)
    counts["stray_temp"] = len(temps)
    counts["error"] += len(unreadable)
    findings.extend(temps + unreadable)

    def label(key):
        rel = os.path.relpath(key[0], root)
        return rel if key[1] is None else f"{rel}/g{key[1]}"

    return {
        "root": root,
        "blocks": sum(len(v) for v in blocks.values()),
        "bytes": total,
        "expected_block_bytes": {label(k): {"bytes": expected[k][0], "source": expected[k][1]} for k in order},
        "counts": dict(counts),
        "retried": retried,
        "findings": [asdict(f) for f in findings],
        "removed": [f.path for f in findings if f.removed],
        "adopted": [f.path for f in findings if f.adopted],
        "unverified": sum(1 for f in findings if f.status == "no_checksum" and not f.adopted),
        "capacity": capacity_summary(root),
        "clean": counts["corrupt"] == 0 and counts["wrong_size"] == 0 and not unreadable and not (
            strict and any(f.status == "no_checksum" and not f.adopted for f in findings)),
    }


def capacity_summary(root: str, now: Optional[float] = None) -> Optional[dict]:
    """The latest census of a bounded root (``ROOT/.kvtier/usage.json``, published by its
    evictor: :mod:`kvtier._tier.capacity`), or None when there is none (an unbounded root):
    ``used_bytes`` (the census after its evictions), ``max_bytes``, ``census_age_s``
    (seconds since the census began, at ``now``, default the clock), ``evictor``
    (``host:pid``), ``files``, ``blocks``, ``evicted`` (blocks evicted after that census),
    ``room`` (what the filesystem held for the root at the census: its bytes + the free
    space; the bound in force is the smaller of it and ``max_bytes``)."""
    from kvtier._tier import capacity as _cap

    u = _cap.read_usage(root)
    if u is None:
        return None
    started = u.get("scan_started")
    age = None
    if isinstance(started, (int, float)) and not isinstance(started, bool):
        age = round(max(0.0, (time.time() if now is None else now) - float(started)), 1)
    return {"used_bytes": u["bytes"], "max_bytes": u.get("max_bytes"), "census_age_s": age,
            "evictor": u.get("evictor"), "files": u.get("files"), "blocks": u.get("blocks"),
            "evicted": u.get("evicted"), "room": u.get("room")}


def usage_text(c: dict) -> str:
    """``"N bytes used of max_bytes M (P%)"`` for a :func:`capacity_summary` dict, the words
    ``kvtier scrub`` and ``kvtier info ROOT`` both print (the bound and share only when the
    census recorded one), and the bound in force when the filesystem's room is smaller."""
    mx, room, used = c.get("max_bytes"), c.get("room"), c["used_bytes"]
    share = f" ({100 * used / mx:.0f}%)" if isinstance(mx, int) and mx > 0 else ""
    of = f" of max_bytes {mx:,}" if isinstance(mx, int) else ""
    if isinstance(room, int) and room > 0 and (not isinstance(mx, int) or room < mx):
        of += f"{share}, of the bound in force {room:,} (the filesystem's room)"
        share = f" ({100 * used / room:.0f}%)"
    return f"{used:,} bytes used{of}{share}"


def census_age_text(c: dict) -> str:
    """The census's age and evictor, e.g. ``"12 s old, by host:pid"``."""
    age = "age unknown" if c.get("census_age_s") is None else f"{c['census_age_s']:.0f} s old"
    return age + (f", by {c['evictor']}" if c.get("evictor") else "")


def _capacity_text(c: dict) -> str:
    return f"; bounded root: {usage_text(c)} at its last census ({census_age_text(c)})"


def format_report(d: dict) -> str:
    """The text report for a :func:`scrub` result ``d``: header, expected size per
    (rank directory, group) with its source, counts per status, one line per finding."""
    c = d["counts"]
    lines = [f"kvtier scrub {d['root']}: {d['blocks']} blocks, {d['bytes']:,} bytes"
             + (_capacity_text(d["capacity"]) if d.get("capacity") else "")]
    for label, e in d["expected_block_bytes"].items():
        if e["bytes"] is None:
            what = "unknown (no most common size: sizes not judged)"
        elif e["source"] == "guess":
            what = f"{e['bytes']} (guess: most common size; judged by CRC32C only)"
        else:
            what = f"{e['bytes']} ({e['source']})"
        lines.append(f"  {label}: expected block size {what}")
    lines.append("  " + "  ".join(f"{s} {c.get(s, 0)}" for s in STATUSES) + f"  retried {d['retried']}")
    for f in d["findings"]:
        tag = " [removed]" if f["removed"] else ""
        lines.append(f"{f['status']:<12} {f['path']}: {f['detail']}{tag}")
    if d.get("adopted"):
        lines.append(f"adopted: {len(d['adopted'])} block(s) without checksum now have one")
    if d.get("unverified"):
        lines.append(f"note: {d['unverified']} block(s) have no checksum (stored with checksums off, by "
                     "vLLM, or copied without xattrs): they load unverified (a miss with "
                     "checksum_blocks='strict'); --adopt records checksums for them")
    return "\n".join(lines)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``scrub`` subcommand to ``sub`` (an argparse subparsers object); returns it."""
    from kvtier.cli._text import plain_text

    p = sub.add_parser("scrub", help="verify every block of a cache against its CRC32C xattr and size",
                       description=plain_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", metavar="ROOT", help="cache root directory (the tier's root_dir)")
    p.add_argument("--block-size", type=int, default=None,
                   help="expected bytes per block where kvtier.json does not record it")
    p.add_argument("--remove", action="store_true", help="delete corrupt and wrong-size blocks")
    p.add_argument("--strict", action="store_true",
                   help="blocks without checksum are findings: exit status 1")
    p.add_argument("--adopt", action="store_true",
                   help="record a checksum (and identity) for blocks that have none")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_scrub)
    return p


def _has_cache_marker(root: str) -> bool:
    """Whether ``root`` or a directory just below it holds a tier's config.json / kvtier.json."""
    names = ("config.json", "kvtier.json")
    try:
        subdirs = [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return False
    return any(os.path.isfile(os.path.join(d, n)) for d in [root, *subdirs] for n in names)


def cmd_scrub(args: argparse.Namespace) -> int:
    """Run ``kvtier scrub`` for parsed ``args`` (root, block_size, remove, json, no_progress).

    Prints the report (text or JSON) on stdout.  Returns the exit status: 0 clean, 1 if a
    corrupt or wrong-size block was found (also when it was removed) or a directory could not
    be read, 2 if ROOT is not a directory or cannot be listed, holds no cache (no block and no config.json / kvtier.json in ROOT or one
    level below: a mistyped path) or ``--block-size`` is not positive (message on stderr).
    """
    from kvtier.cli._text import EXIT_USAGE, dir_error

    err = dir_error(args.root)
    if err is not None:  # as every subcommand words it (the OSError below: "[Errno 2] ...: 'ROOT'")
        print(f"kvtier scrub: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        d = scrub(args.root, args.block_size, args.remove, not args.no_progress,
                  adopt=getattr(args, "adopt", False), strict=getattr(args, "strict", False))
    except (OSError, ValueError) as e:
        print(f"kvtier scrub: {e}", file=sys.stderr)
        return 2
    if d["blocks"] == 0 and not _has_cache_marker(args.root):
        print(f"kvtier scrub: no kvtier or vLLM cache found in {args.root!r} (no .bin block, no "
              "config.json or kvtier.json in it or one level below): is ROOT the tier's root_dir?",
              file=sys.stderr)
        return 2
    print(json.dumps(d, indent=2) if args.json else format_report(d))
    return 0 if d["clean"] else 1
