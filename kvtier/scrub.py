"""``kvtier scrub ROOT``: verify every block file of a cache against its CRC32C and size.

For each ``*.bin`` under ROOT (the FileMapper layout, see :mod:`kvtier.file_mapper`):

============  ==========================================================================
status        meaning
============  ==========================================================================
ok            size as expected and CRC32C equals xattr ``user.vllm.kv_crc32c``
corrupt       CRC32C differs, or the xattr is not 4 bytes (a load would fail with
              EBADMSG and remove it)
no_checksum   no xattr (stored with checksums off): unverified until rewritten
wrong_size    size differs from the expected block size (a load would fail with EIO)
error         could not be read (EACCES, ELOOP for a symlink, EIO...): kept, reported
============  ==========================================================================

Stray temp files (``<dest>_<hex>.tmp`` left by a crashed store, ``.kvtier_probe_*``) are
reported as ``stray_temp``.

Expected block size: ``block_bytes`` from ``kvtier.json`` beside ``config.json`` (written
by :class:`kvtier.manager.FileSystemTierManager`), else ``--block-size``, else the most
common size among the ``.bin`` files of that rank directory (a size shared by fewer files
is ``wrong_size``; with no majority, sizes are not judged).  vLLM's ``config.json`` fields
(model, tokens per block, dtype, layer names) do not give the bytes per block, because
head count and head dimension are not among them.

``--remove`` deletes ``corrupt`` and ``wrong_size`` blocks only.  Exit status: 0 clean,
1 if any corrupt or wrong-size block was found (also with ``--remove``), 2 for usage errors.
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
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import kvtier
from kvtier.file_mapper import BLOCK_INFO_FILENAME

XATTR_NAME = "user.vllm.kv_crc32c"
_CHUNK = 4 << 20
_TMP_RE = re.compile(r"(\.bin_[0-9a-fA-F]+\.tmp|\.tmp)$")
_RANK_RE = re.compile(r"^(?P<base>.+)_r(?P<rank>\d+)$")
STATUSES = ("ok", "corrupt", "no_checksum", "wrong_size", "error", "stray_temp")


@dataclass
class Finding:
    path: str
    status: str
    size: int
    expected_size: Optional[int] = None
    detail: str = ""
    removed: bool = False


def _expected_sizes(root: str, files_by_rankdir: Dict[str, List[tuple]], block_size: Optional[int]) -> Dict[str, Optional[int]]:
    out = {}
    for rankdir, files in files_by_rankdir.items():
        exp = None
        m = _RANK_RE.match(os.path.basename(rankdir))
        if m:
            info = os.path.join(os.path.dirname(rankdir), m.group("base"), BLOCK_INFO_FILENAME)
            try:
                with open(info, encoding="utf-8") as f:
                    v = json.load(f).get("block_bytes")
                if isinstance(v, int) and v > 0:
                    exp = v
            except (OSError, ValueError):
                pass
        if exp is None and block_size:
            exp = block_size
        if exp is None:
            counts = collections.Counter(size for _, size in files if size is not None)
            if counts:
                (size, n), *rest = counts.most_common(2) + [(None, 0)]
                if n > rest[0][1]:
                    exp = size
        out[rankdir] = exp
    return out


def _rank_dir(root: str, path: str) -> str:
    """The top-level directory under ``root`` holding ``path`` (``<model>_<digest>_r<rank>``)."""
    rel = os.path.relpath(path, root)
    first = rel.split(os.sep, 1)[0]
    return os.path.join(root, first) if os.sep in rel else root


def _verify(path: str, size: Optional[int], expected: Optional[int]) -> Finding:
    if size is None:
        return Finding(path, "error", 0, expected, "not a regular file (symlink?): kept")
    if expected is not None and size != expected:
        return Finding(path, "wrong_size", size, expected, f"{size} bytes, expected {expected}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return Finding(path, "error", size, expected, f"open: {e.strerror} (errno {e.errno})")
    try:
        try:
            rec = os.getxattr(fd, XATTR_NAME)
        except OSError as e:
            if e.errno in (errno.ENODATA, errno.EOPNOTSUPP):
                return Finding(path, "no_checksum", size, expected, "no xattr: unverified")
            return Finding(path, "error", size, expected, f"getxattr: {e.strerror} (errno {e.errno})")
        if len(rec) != 4:
            return Finding(path, "corrupt", size, expected, f"xattr record is {len(rec)} bytes, not 4")
        crc, n = 0, 0
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except OSError as e:
                return Finding(path, "error", size, expected, f"read: {e.strerror} (errno {e.errno})")
            if not chunk:
                break
            crc = kvtier.crc32c(chunk, crc)
            n += len(chunk)
        if n != size:
            return Finding(path, "error", size, expected, f"read {n} bytes of {size}: file changed during scrub")
        want = int.from_bytes(rec, "big")
        if crc != want:
            return Finding(path, "corrupt", size, expected, f"CRC32C 0x{crc:08x}, recorded 0x{want:08x}")
        return Finding(path, "ok", size, expected)
    finally:
        os.close(fd)


def scrub(root: str, block_size: Optional[int] = None, remove: bool = False, progress: bool = True) -> dict:
    """Scrub the cache at ``root``; returns ``{"root", "counts", "findings" (non-ok), "removed"}``.

    Raises NotADirectoryError / FileNotFoundError (OSError) if ``root`` is not a directory,
    ValueError for a non-positive ``block_size``.
    """
    from tqdm import tqdm

    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if not os.path.isdir(root):
        e = errno.ENOTDIR if os.path.exists(root) else errno.ENOENT
        raise OSError(e, os.strerror(e), root)
    blocks: Dict[str, List[tuple]] = collections.defaultdict(list)
    temps: List[Finding] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if name.endswith(".bin"):
                # size None: not a regular file (symlink, fifo...): reported as error
                blocks[_rank_dir(root, p)].append((p, st.st_size if stat.S_ISREG(st.st_mode) else None))
            elif name.startswith(".kvtier_probe_") or _TMP_RE.search(name):
                temps.append(Finding(p, "stray_temp", st.st_size, None, "left by an interrupted store"))
    expected = _expected_sizes(root, blocks, block_size)
    total = sum(size or 0 for files in blocks.values() for _, size in files)
    findings: List[Finding] = []
    counts = collections.Counter({s: 0 for s in STATUSES})
    with tqdm(total=total, unit="B", unit_scale=True, desc="kvtier scrub", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        for rankdir in sorted(blocks):
            for path, size in blocks[rankdir]:
                f = _verify(path, size, expected[rankdir])
                counts[f.status] += 1
                if f.status != "ok":
                    if remove and f.status in ("corrupt", "wrong_size"):
                        try:
                            os.unlink(path)
                            f.removed = True
                        except OSError as e:
                            f.detail += f"; remove failed: {e.strerror}"
                    findings.append(f)
                bar.update(size or 0)
    counts["stray_temp"] = len(temps)
    findings.extend(temps)
    return {
        "root": root,
        "blocks": sum(len(v) for v in blocks.values()),
        "bytes": total,
        "expected_block_bytes": {os.path.relpath(k, root): v for k, v in expected.items()},
        "counts": dict(counts),
        "findings": [asdict(f) for f in findings],
        "removed": [f.path for f in findings if f.removed],
        "clean": counts["corrupt"] == 0 and counts["wrong_size"] == 0,
    }


def format_report(d: dict) -> str:
    c = d["counts"]
    lines = [f"kvtier scrub {d['root']}: {d['blocks']} blocks, {d['bytes']:,} bytes"]
    for rel, exp in sorted(d["expected_block_bytes"].items()):
        lines.append(f"  {rel}: expected block size {exp if exp else 'unknown (sizes not judged)'}")
    lines.append("  " + "  ".join(f"{s} {c.get(s, 0)}" for s in STATUSES))
    for f in d["findings"]:
        tag = " [removed]" if f["removed"] else ""
        lines.append(f"{f['status']:<12} {f['path']}: {f['detail']}{tag}")
    if c.get("no_checksum"):
        lines.append(f"note: {c['no_checksum']} block(s) have no checksum (stored with checksums off); "
                     "they load unverified until rewritten")
    return "\n".join(lines)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("scrub", help="verify every block of a cache against its CRC32C xattr and size",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", metavar="ROOT", help="cache root directory (the tier's root_dir)")
    p.add_argument("--block-size", type=int, default=None,
                   help="expected bytes per block where kvtier.json does not record it")
    p.add_argument("--remove", action="store_true", help="delete corrupt and wrong-size blocks")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_scrub)
    return p


def cmd_scrub(args: argparse.Namespace) -> int:
    try:
        d = scrub(args.root, args.block_size, args.remove, not args.no_progress)
    except (OSError, ValueError) as e:
        print(f"kvtier scrub: {e}", file=sys.stderr)
        return 2
    print(json.dumps(d, indent=2) if args.json else format_report(d))
    return 0 if d["clean"] else 1
