"""Capacity: a bounded tier root shared by many live writers on many nodes (docs/capacity.md).

One bound per root (``max_bytes``), physical and root-wide:

- **Census**: a scan of the whole root (``os.scandir``, ``st_blocks * 512`` of every regular
  file: blocks, temps, config files, every model and layout under the root) by the one
  evictor of the root, every ``census_interval_s`` (longer when a scan is slow: the evictor
  spends at most :data:`CENSUS_CPU_SHARE` of its time scanning), published atomically (temp
  + rename) to ``<root>/.kvtier/usage.json``.
- **Ledgers**: between censuses each writer process counts the bytes it reserved since the
  latest census's ``scan_started`` (running jobs, and ended ones by age:
  :data:`LEDGER_AGES`) and publishes them in its own file
  ``<root>/.kvtier/writers/<host>-<pid>-<tag>`` (pwrite, no fsync): at each admission when
  another writer of its host has a ledger, else within :data:`LEDGER_PUBLISH_S`.
  Admission: census bytes + what every live writer's ledger adds to that census
  (:func:`ledger_bytes`; this host's through the same mount re-read at each admission, the others' every
  :data:`LEDGER_PUBLISH_S`) + this process's own reservations; a store job that would
  take that above ``max_bytes`` is dropped at once (ENOSPC, counted ``stores_dropped``),
  never queued or blocked.
- **One evictor per root**: the process holding the fcntl lock on
  ``<root>/.kvtier/evictor.lock`` (one fd per process and root, opened here only, never
  closed while the tier lives); every process with a bound tries it each census interval,
  so a killed holder (the kernel drops its lock) is replaced within one interval, and a
  stopped one (its heartbeat, the lock file's content, still for ``takeover_s``) is taken
  over: the lock file replaced under it (:meth:`RootCapacity._watch_holder`).
- **Recency**: the block file's mtime.  Loads and lookup hits refresh it (``os.utime``, at
  most once per block per ``touch_window_s`` per process); a job's blocks are stamped so
  that its head is the newest (``now - i`` µs for position ``i``).  Eviction removes the
  oldest first (:func:`recency_key`) until usage is at the low watermark, each unlink
  after an lstat that finds the same file (dev, ino, mtime) the census saw.

Little runs on a request path: :meth:`RootCapacity.admit` does a ``stat`` of the writers'
directory, one ``pread`` per other writer of this host and, with one, a ``pwrite`` of its
own ledger (page cache only: ~7-28 µs in all with 0-3 such writers,
``benchmarks/capacity_peak.py --admission-cost``), and ``usage.json`` read again only before a drop or when a ledger
counts from a newer census; stamps run on the pool thread after a job's I/O, lookup-hit
touches on the capacity thread.
"""
from __future__ import annotations

import bisect
import collections
import fractions
import errno
import fcntl
import json
import logging
import math
import os
import re
import secrets
import socket
import stat as _stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from kvtier._tier.landing import BOUNDED
from kvtier._tier.mountinfo import mount_of

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- constants

STATE_DIR = ".kvtier"
"""The root's capacity state: ``usage.json``, ``evictor.lock``, ``writers/``, ``evict.request``."""
USAGE_FILE = "usage.json"
LOCK_FILE = "evictor.lock"
TAKEOVER_FILE = "evictor.takeover"
BEAT_RECORD = 256
"""Bytes of the heartbeat record in ``evictor.lock``: JSON padded with spaces, pwritten in place."""
WRITERS_DIR = "writers"
REQUEST_FILE = "evict.request"

DEFAULT_HIGH = 0.95
DEFAULT_LOW = 0.85
DEFAULT_CENSUS_INTERVAL_S = 10.0
DEFAULT_TOUCH_WINDOW_S = 60.0
DEFAULT_TAKEOVER_S = 30.0
"""Seconds an evictor's heartbeat may stay still before another process takes its lock over
(docs/capacity.md, "One evictor per root": why 30)."""
BEAT_S = 1.0
"""The evictor writes its heartbeat at most this often (``takeover_s / 10`` when less)."""
CENSUS_PROGRESS_EVERY = 1024
"""A census calls its ``progress`` callback (the evictor's heartbeat) every this many entries."""
EVICT_BATCH = 16
EVICT_BATCH_S = 0.05
"""A pass checks that it still holds the lock before its first unlink, then every
:data:`EVICT_BATCH` unlinks or :data:`EVICT_BATCH_S` seconds (a stop, a hang: at once after it)."""

LEDGER_PUBLISH_S = 0.05
"""The capacity thread flushes a pending change of this process's ledger within this long
(a writer with a peer on its host and mount writes it at each admission too) and lists the
other writers' ledgers this often (the peers' are re-read at each admission)."""
OTHER_VIEW_S = 2.0
"""Bytes a writer stored up to this long before a census's ``scan_started`` stay in its
ledger when the census was made through another view of the root (another host, or another
mount on this one: :func:`view_of`): the census may not have counted them whole. Clocks of
nodes differ (~1 s is allowed for), and a client's attribute cache shows another client's
file at its size of up to its timeout earlier (1 s by default for GlusterFS's md-cache and
MooseFS's ``mfsattrcacheto``): a census through mount A counted a block that mount B had
just written at the size of its temp's first stat, and with that block's bytes gone from
B's ledger the estimates were short by up to the bound (two MooseFS clients reached
1.97x)."""


def view_of(host: str, boot: str, dev: int) -> List[Any]:
    """A writer's or census's view of the root: ``[hostname, boot id, the root's st_dev]``:
    two processes of one view share one page cache and one attribute cache (their census
    sees what the other wrote, at once)."""
    return [host, boot, dev]


def same_view(d: Dict[str, Any], census_view: Any) -> bool:
    """Whether ledger ``d``'s writer has the census's view (``census_view``: a
    :func:`view_of` list, or a bare hostname from an older kvtier's usage record)."""
    if isinstance(census_view, list) and len(census_view) == 3:
        return [d.get("host"), d.get("boot"), d.get("dev")] == census_view
    return census_view is not None and d.get("host") == census_view


def usage_view(u: Optional[Dict[str, Any]]) -> Any:
    """The view a usage record's census was made through (its ``view``; an older record's:
    its evictor's hostname), None without a record."""
    if not u:
        return None
    v = u.get("view")
    return v if isinstance(v, list) and len(v) == 3 else str(u.get("evictor", "")).rsplit(":", 1)[0]
CENSUS_CPU_SHARE = 0.02
"""The evictor waits at least ``scan seconds / CENSUS_CPU_SHARE`` between censuses."""
TOUCH_LRU = 1 << 16
"""Keys remembered as recently touched (per process and root)."""
ALLOC_UNIT = 4096
"""A block file's bytes are reserved rounded up to this (what ext4/XFS/tmpfs allocate)."""
STATE_BYTES = 8 * ALLOC_UNIT
"""What a root's own files take (``config.json``, ``kvtier.json``, ``.kvtier/``'s ``usage.json``,
``evictor.lock``, ledgers, ``evict.request``: a filesystem block each): a bound must hold one
block more than this, else no store is ever admitted."""
INODE_RESERVE = 8
"""Free inodes the bound leaves free (:func:`fs_room`): the temps of ``usage.json`` and
``evict.request`` (written as temp + rename), and the few shard directories that the
bytes-per-inode average counts as freed when an eviction leaves them (another block in
them) until the next census."""
LEDGER_RECORD = 640
"""Bytes of a ledger file: one JSON object padded with spaces, rewritten in place."""
LEDGER_AGES = (0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
"""A ledger lists its ended jobs' bytes in buckets by age (seconds, one more for the older
ones), each stamped with its newest end: a reader whose census began after a bucket's
stamp counts it as in the census (the writer has not read that census yet)."""
REQUEST_GAP_S = 0.1
"""A writer asks for a pass at most this often."""
FUTURE_USAGE_S = 60.0
"""A ``usage.json`` whose census began more than this far ahead of this clock is not taken."""
USAGE_LIMIT = 1 << 16
"""Bytes of ``usage.json`` read at most (a record is ~600)."""

_BLOCK_RE = re.compile(r"^[0-9a-f]+\.bin\Z")
_SHARD1_RE = re.compile(r"^[0-9a-f]{1,3}\Z")
_SHARD2_RE = re.compile(r"^([0-9a-f]{0,2})_g(\d+)\Z")
_RANK_RE = re.compile(r"^.+_r\d+\Z")

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
MAX_SIZE = (1 << 63) - 1  # the largest size a filesystem (off_t, statvfs) and a metric can count
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGTP]?)(?:I?B)?\s*\Z", re.IGNORECASE)
_PCT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*\Z")

#: Engine counters of capacity (:data:`kvtier._tier.counters.COUNTERS` takes them).  ``gauge:``
#: ones are levels read from the root's capacity at snapshot time.
COUNTER_DOCS: Dict[str, str] = {
    "stores_dropped": "store jobs dropped at once (ENOSPC) because the root's usage estimate plus the job "
                      "would pass max_bytes",
    "evicted_capacity": "blocks evicted by this process's evictor because usage passed the high watermark",
    "evicted_enospc": "blocks evicted by this process's evictor after a store hit ENOSPC",
    "evicted_bytes_capacity": "bytes (allocated) of the blocks in evicted_capacity",
    "evicted_bytes_enospc": "bytes (allocated) of the blocks in evicted_enospc",
    "capacity_used_bytes": "gauge: the root's usage estimate (census + writers' ledgers), bytes",
    "capacity_max_bytes": "gauge: the root's configured bound (max_bytes), bytes",
    "capacity_bound_bytes": "gauge: the bound in force: max_bytes, or less when the filesystem has less room "
                            "(the census's bytes + free space, or + free inodes at a block's bytes per inode), "
                            "bytes",
    "capacity_inodes_free": "gauge: free inodes of the root's filesystem at the latest census (statvfs f_favail); "
                            "-1 when the filesystem has no inode limit (f_files 0); NaN before the first census",
    "capacity_census_age": "gauge: seconds since the latest census of the root started (its staleness); NaN "
                           "before the first census",
    "capacity_evictor_lag": "gauge: seconds the latest eviction pass of the root ended after its census started; "
                            "NaN before the first census",
}
GAUGES = tuple(k for k, d in COUNTER_DOCS.items() if d.startswith("gauge:"))
REASONS = ("capacity", "enospc")
_PRIORITY = {None: 0, "capacity": 1, "drop": 2, "enospc": 3}
"""Requests for a pass, by strength: ``capacity`` (the estimate passed the high
watermark: evict if the census agrees), ``drop`` (a store was dropped: evict down to the
low watermark), ``enospc`` (the filesystem is full: down to ``low`` of the usage)."""


# ---------------------------------------------------------------------- configuration

def parse_size(value: Any, name: str = "max_bytes") -> int:
    """Bytes of ``value``: an int, or a size string ``"500G"``, ``"1.5T"``, ``"64M"``,
    ``"4096"`` (K/M/G/T/P are powers of 1024; an optional ``B`` / ``iB`` suffix).
    TypeError for another type, ValueError for a bad string, a value < 1 or a number of
    bytes that is not whole (``"1.5"``; ``"1.5K"`` is 1536, ``"0.1K"`` rounds down to 102)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be an int (bytes) or a size string like '500G', got {type(value).__name__}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(f"{name}: cannot parse {value!r}: give bytes (int), a size like '500G', '1.5T', '64M' "
                             f"(K, M, G, T, P = powers of 1024) or a percentage of the filesystem like '90%'")
        d = fractions.Fraction(m.group(1))  # the decimal digits exactly, however many
        if not m.group(2) and d.denominator != 1:  # "1.5": bytes, not 1.5 of a unit
            raise ValueError(f"{name}: {value!r} is no whole number of bytes: give an integer, or a unit "
                             f"('1.5G', K/M/G/T/P = powers of 1024)")
        n = int(d * _UNITS[m.group(2).upper()])  # exact: no float rounding; a unit's fraction rounds down
    if n < 1:
        raise ValueError(f"{name} must be >= 1 byte, got {value!r}")
    if n > MAX_SIZE:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"{name}: {shown} is more than {MAX_SIZE} bytes (8 EiB, what a filesystem's "
                         f"sizes can count): no bound that large can be reached")
    return n


def parse_max_bytes(value: Any, root: Optional[str] = None, name: str = "max_bytes") -> Optional[int]:
    """The bound in bytes: None (off), an int, a size string (:func:`parse_size`) or a
    percentage of the filesystem holding ``root`` (``"90%"``: of ``f_blocks * f_frsize``
    from statvfs).  With ``root`` None a percentage is only checked (the result is None:
    it is resolved once the root exists)."""
    if value is None:
        return None
    if isinstance(value, str):
        m = _PCT_RE.match(value)
        if m:
            pct = float(m.group(1))
            if not 0 < pct <= 100:
                raise ValueError(f"{name}: a percentage of the filesystem must be in (0, 100], got {value!r}")
            if root is None:
                return None
            st = os.statvfs(root)
            return max(1, int(st.f_blocks * st.f_frsize * pct / 100))
    return parse_size(value, name)


def _check_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class CapacityConfig:
    """A root's capacity knobs, checked (:func:`check_config`).  ``max_bytes`` is the
    value as given (int, size string or percentage); :meth:`bound` resolves it."""

    max_bytes: Any
    evict_high: float = DEFAULT_HIGH
    evict_low: float = DEFAULT_LOW
    census_interval_s: float = DEFAULT_CENSUS_INTERVAL_S
    touch_window_s: float = DEFAULT_TOUCH_WINDOW_S
    takeover_s: float = DEFAULT_TAKEOVER_S

    def bound(self, root: str) -> int:
        return parse_max_bytes(self.max_bytes, root)  # type: ignore[return-value]


#: Tier keys of capacity and their defaults (both shells accept them).
CONFIG_KEYS: Dict[str, Any] = {"max_bytes": None, "evict_high": DEFAULT_HIGH, "evict_low": DEFAULT_LOW,
                               "census_interval_s": DEFAULT_CENSUS_INTERVAL_S,
                               "touch_window_s": DEFAULT_TOUCH_WINDOW_S, "takeover_s": DEFAULT_TAKEOVER_S}


def check_config(max_bytes: Any = None, evict_high: Any = DEFAULT_HIGH, evict_low: Any = DEFAULT_LOW,
                 census_interval_s: Any = DEFAULT_CENSUS_INTERVAL_S,
                 touch_window_s: Any = DEFAULT_TOUCH_WINDOW_S,
                 takeover_s: Any = DEFAULT_TAKEOVER_S) -> Optional[CapacityConfig]:
    """Check the capacity keys before any I/O: None when ``max_bytes`` is None (off).
    TypeError / ValueError naming the key: a bad size, watermarks not ``0 < low < high <= 1``,
    an interval or ``takeover_s`` not > 0, a window < 0."""
    high, low = _check_float("evict_high", evict_high), _check_float("evict_low", evict_low)
    if not 0 < low < high <= 1:
        raise ValueError(f"the watermarks must satisfy 0 < evict_low < evict_high <= 1 (fractions of max_bytes), "
                         f"got evict_low={evict_low!r}, evict_high={evict_high!r}")
    iv = _check_float("census_interval_s", census_interval_s)
    tw = _check_float("touch_window_s", touch_window_s)
    if iv <= 0:
        raise ValueError(f"census_interval_s must be > 0 seconds, got {census_interval_s!r}")
    if tw < 0:
        raise ValueError(f"touch_window_s must be >= 0 seconds, got {touch_window_s!r}")
    to = _check_float("takeover_s", takeover_s)
    if to <= 0:
        raise ValueError(f"takeover_s must be > 0 seconds, got {takeover_s!r}")
    if max_bytes is None:
        return None
    parse_max_bytes(max_bytes)  # syntax (a percentage is resolved against the root later)
    return CapacityConfig(max_bytes, high, low, iv, tw, to)


# ---------------------------------------------------------------------- census

@dataclass
class Census:
    """One scan of a root.  ``bytes``: allocated bytes (st_blocks * 512) of every regular
    file under it (directories not: :func:`census`); ``files``: regular files;
    ``dirs``: directories scanned (the root included); ``blocks`` / ``block_bytes``: those that are
    block files of a cache path (evictable); ``entries``: the block files as
    ``(mtime_ns, nbytes, st_dev, st_ino, path)``; times are ``time.time()`` seconds."""

    root: str
    bytes: int = 0
    files: int = 0
    blocks: int = 0
    block_bytes: int = 0
    block_size_sum: int = 0  # st_size of the block files (their allocation / this: alloc_ratio)
    dirs: int = 0
    scan_started: float = 0.0
    scan_finished: float = 0.0
    cpu_s: float = 0.0
    entries: List[Tuple[int, int, int, int, str]] = field(default_factory=list, repr=False)
    #: directories and files that could not be read (EACCES, EIO...; not ENOENT: gone
    #: meanwhile): their bytes are not counted.  ``first_error``: ``(path, OSError)``
    unreadable: int = 0
    first_error: Optional[Tuple[str, OSError]] = None
    #: one rank directory per filesystem (st_dev) the rank directories are on: a rank
    #: directory moved to another disk and linked back, or a mount point (:func:`root_room`)
    rank_fs: Dict[int, str] = field(default_factory=dict, repr=False)

    def _unreadable(self, path: str, e: OSError) -> None:
        if e.errno != errno.ENOENT:
            self.unreadable += 1
            if self.first_error is None:
                self.first_error = (path, e)

    def error_text(self) -> str:
        """"" when everything was read, else what was not (for a log line or the CLI)."""
        if not self.unreadable:
            return ""
        p, e = self.first_error  # type: ignore[misc]
        return (f"{self.unreadable} directories or files under {self.root} could not be read (first: {p}: "
                f"{e.strerror or e}, errno {e.errno}): their bytes are not counted, the usage is low by them")


def alloc_ratio(c: Census) -> float:
    """Allocated bytes per byte of block file in ``c`` (>= 1; 1 when no block): what a
    store's reservation is multiplied by (MooseFS allocates whole 64 KiB blocks, a
    replicated volume may count each copy)."""
    return max(1.0, c.block_bytes / c.block_size_sum) if c.block_size_sum else 1.0


def bytes_per_inode(c: Census) -> Optional[float]:
    """What a store takes per inode, from census ``c``: the block files' allocated bytes
    per inode they hold, their own and the directories' (a store makes shard directories
    too; every directory of the root counts, a few too many), None when ``c`` found no
    block."""
    return c.block_bytes / (c.blocks + c.dirs) if c.blocks else None


def fs_room(used: int, st: Any, per_inode: Optional[float]) -> int:
    """The room of a root on its filesystem, bytes: what it holds (``used``) plus what the
    filesystem can still take, the free space (statvfs ``f_bavail``) or, when fewer files
    can still be made than that space holds, the free inodes (``f_favail`` less
    :data:`INODE_RESERVE`) at ``per_inode`` bytes each (:func:`bytes_per_inode`): the
    bound's marks, admission and eviction then hold the inodes too.  ``per_inode`` None
    (no block yet): only a full inode table counts.  ``f_files`` 0: the filesystem has no
    inode limit (some FUSE filesystems, btrfs)."""
    free = st.f_bavail * st.f_frsize
    inodes = max(0, st.f_favail - INODE_RESERVE)
    if st.f_files and per_inode is not None:
        free = min(free, int(inodes * per_inode))
    elif st.f_files and not inodes:
        free = 0
    return used + free


def root_room(c: Census, st: Any = None) -> Optional[int]:
    """The room of census ``c``'s root (:func:`fs_room`): its usage plus what the
    tightest of its filesystems can still take, the root's (``st``: its statvfs, when the
    caller has it) and each other one a rank directory is on (a rank directory moved to a
    smaller disk and linked back fills that disk while the root's has room); None when the
    root's statvfs fails.  One statvfs per filesystem."""
    per_inode = bytes_per_inode(c)
    try:
        room = fs_room(c.bytes, st if st is not None else os.statvfs(c.root), per_inode)
        root_dev = os.stat(c.root).st_dev
    except OSError:
        return None
    for dev, d in c.rank_fs.items():
        if dev == root_dev:
            continue
        try:
            room = min(room, fs_room(c.bytes, os.statvfs(d), per_inode))
        except OSError:
            pass  # gone meanwhile: the next census
    return room


def census(root: str, keep_entries: bool = True, progress: Optional[Callable[[], Any]] = None) -> Census:
    """Scan ``root``: every regular file under it counts its ``st_blocks * 512`` (symlinks
    are not followed, except one in ``root`` named as a rank directory that leads to a
    directory: the tier writes its blocks through it; a filesystem mounted under the root
    counts too).  What cannot be read (EACCES, EIO) is counted in ``unreadable``.  Directories are
    not counted: what they report is the filesystem's metadata, not data (4 KiB each on
    ext4, 0 on tmpfs, ~1 MB on MooseFS, which keeps them on its master).
    Files that vanish meanwhile are skipped.  Block files (:func:`is_block_path`) are
    listed in ``entries`` (``keep_entries``).  One lstat per file and directory, one
    scandir per directory; a directory's place in the cache layout is decided once, from
    its name and depth.  ``progress()`` is called every :data:`CENSUS_PROGRESS_EVERY` entries
    (the evictor's heartbeat: a census of a million files takes minutes)."""
    c = Census(root=root, scan_started=time.time())
    cpu0 = time.thread_time()
    entries = c.entries
    # (directory, its place: 0 the root, 1 a rank dir, 2 <h[:3]>, 3 <h[3:5]>_g<group>, -1 none;
    # from 2 on the hash digits its shard directories name: h[:3], h[3:5])
    stack: List[Tuple[str, int, str, str]] = [(root, 0, "", "")]
    followed = set()  # (st_dev, st_ino) of the rank directories scanned: a symlink to one is not counted twice
    rank_re, s1_re, s2_re, block_re = _RANK_RE.match, _SHARD1_RE.match, _SHARD2_RE.match, _BLOCK_RE.match
    S_ISDIR, S_ISREG = _stat.S_ISDIR, _stat.S_ISREG
    total = files = blocks = block_bytes = dirs = size_sum = 0
    seen, every = 0, CENSUS_PROGRESS_EVERY
    while stack:
        d, layout, h3, h5 = stack.pop()
        try:
            it = os.scandir(d)
        except OSError as err:
            c._unreadable(d, err)
            continue
        dirs += 1
        with it:
            for e in it:
                seen += 1
                if progress is not None and seen % every == 0:
                    progress()
                try:
                    st = e.stat(follow_symlinks=False)
                    if layout == 0 and _stat.S_ISLNK(st.st_mode) and rank_re(e.name):
                        # a rank directory moved elsewhere and linked back: the tier
                        # writes through it, so it is counted and evicted through it
                        st = e.stat(follow_symlinks=True)
                except OSError as err:
                    c._unreadable(e.path, err)
                    continue
                mode = st.st_mode
                if S_ISDIR(mode):
                    name = e.name
                    s3, s5 = h3, h5
                    if layout == 0:  # the root
                        sub = 1 if name != STATE_DIR and rank_re(name) else -1
                        if sub == 1:
                            if (st.st_dev, st.st_ino) in followed:
                                continue
                            followed.add((st.st_dev, st.st_ino))
                            c.rank_fs.setdefault(st.st_dev, e.path)
                    elif layout == 1:
                        sub, s3 = 2 if s1_re(name) else -1, name
                    elif layout == 2:
                        m = s2_re(name)
                        sub, s5 = (3, m.group(1)) if m else (-1, "")
                    else:
                        sub = -1
                    stack.append((e.path, sub, s3, s5))
                    continue
                if not S_ISREG(mode):
                    continue
                nb = st.st_blocks * 512
                files += 1
                total += nb
                if layout == 3 and block_re(e.name) and e.name[:3] == h3 and e.name[3:5] == h5:  # is_block_path
                    blocks += 1
                    block_bytes += nb
                    size_sum += st.st_size
                    if keep_entries:
                        entries.append((st.st_mtime_ns, nb, st.st_dev, st.st_ino, e.path))
    c.bytes, c.files, c.blocks, c.block_bytes, c.dirs = total, files, blocks, block_bytes, dirs
    c.block_size_sum = size_sum
    c.scan_finished = time.time()
    c.cpu_s = time.thread_time() - cpu0
    return c


def _is_block_dir(root: str, d: str) -> bool:
    """``d`` is ``<root>/<layout>_r<rank>/<h[:3]>/<h[3:5]>_g<group>``."""
    rel = os.path.relpath(d, root).split(os.sep)
    return (len(rel) == 3 and _RANK_RE.match(rel[0]) is not None and rel[0] != STATE_DIR
            and _SHARD1_RE.match(rel[1]) is not None and _SHARD2_RE.match(rel[2]) is not None)


def is_block_path(root: str, path: str) -> bool:
    """``path`` is a block file of a cache layout under ``root``:
    ``<root>/<model>_<digest>_r<rank>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin`` with ``h`` hex
    whose first five digits name the two shard directories.  Never a temp
    (``<h>.bin_<tag>.tmp``), a config.json / kvtier.json, or anything in ``.kvtier/``."""
    d, name = os.path.split(path)
    if not _BLOCK_RE.match(name) or not _is_block_dir(root, d):
        return False
    h = name[:-4]
    s1, s2 = os.path.basename(os.path.dirname(d)), os.path.basename(d)
    return h[:3] == s1 and h[3:5] == _SHARD2_RE.match(s2).group(1)  # type: ignore[union-attr]


def key_of_path(path: str) -> Tuple[bytes, int]:
    """``(block hash, group)`` of a block path (:func:`is_block_path`)."""
    d, name = os.path.split(path)
    return bytes.fromhex(name[:-4]), int(_SHARD2_RE.match(os.path.basename(d)).group(2))  # type: ignore


def recency_key(entry: Tuple[int, int, int, int, str]) -> int:
    """The eviction order: smallest first.  The block file's mtime in ns (loads and lookup
    hits refresh it; a job's head block is stamped newest)."""
    return entry[0]


# ---------------------------------------------------------------------- eviction

@dataclass
class EvictResult:
    """An eviction pass.  ``evicted``: paths removed (in order), ``evicted_bytes``;
    ``skipped``: blocks changed since the census (refreshed, republished) or gone;
    ``errors``: (path, OSError) of failed unlinks; ``dirs_removed``: empty shard
    directories removed; ``usage_before`` / ``usage_after``: the estimate; ``target``."""

    evicted: List[str] = field(default_factory=list)
    evicted_bytes: int = 0
    skipped: int = 0
    errors: List[Tuple[str, OSError]] = field(default_factory=list)
    dirs_removed: int = 0
    usage_before: int = 0
    usage_after: int = 0
    target: int = 0
    dry_run: bool = False
    cpu_s: float = 0.0


def evict(c: Census, usage: int, target: int, dry_run: bool = False,
          keep_going: Optional[Callable[[], bool]] = None) -> EvictResult:
    """Remove ``c``'s block files, oldest first (:func:`recency_key`), until ``usage``
    (bytes) is at or below ``target``: :meth:`Candidates.evict` over the census."""
    return Candidates(c.entries).evict(usage, target, dry_run, keep_going)


class Candidates:
    """A census's block files in eviction order (oldest first, :func:`recency_key`),
    consumed by successive :meth:`evict` calls: the evictor evicts from it between
    censuses (blocks written since are newer than all of them; blocks refreshed since are
    skipped by the recheck).  ``keep_bytes``: only the oldest entries holding that many
    bytes are kept (memory), None: all.  Sorts ``entries`` in place."""

    def __init__(self, entries: List[Tuple[int, int, int, int, str]], keep_bytes: Optional[int] = None) -> None:
        entries.sort(key=recency_key)
        if keep_bytes is not None:
            n = acc = 0
            for n, e in enumerate(entries, 1):
                acc += e[1]
                if acc >= keep_bytes:
                    break
            del entries[n:]
        self._entries = entries
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries) - self._next

    def evict(self, usage: int, target: int, dry_run: bool = False,
              keep_going: Optional[Callable[[], bool]] = None) -> EvictResult:
        """Remove block files, oldest first, until ``usage`` (bytes) is at or below
        ``target``.  Before each unlink an lstat must find the file the census saw (same
        st_dev, st_ino, mtime): a block refreshed by a hit or republished is skipped.
        Then the shard directories emptied (``<h[3:5]>_g<group>``, then ``<h[:3]>``) are
        removed with rmdir (never the rank or layout directories): a store racing it gets
        ENOENT at its temp's open and makes the parents again (error table P21).
        ``dry_run``: nothing removed or consumed; the result lists what would be.
        ``keep_going()`` (the evictor: still the lock's holder?) is asked before the first
        unlink, then every :data:`EVICT_BATCH` entries or :data:`EVICT_BATCH_S` seconds;
        False ends the pass there."""
        r = EvictResult(usage_before=usage, usage_after=usage, target=target, dry_run=dry_run)
        if usage <= target:
            return r
        cpu0 = time.thread_time()
        dirs = set()
        entries, i, n = self._entries, self._next, len(self._entries)
        lstat, unlink, S_ISREG, mono = os.lstat, os.unlink, _stat.S_ISREG, time.monotonic
        asked_i, asked_t = i, -math.inf  # ask before the first unlink
        while i < n and usage > target:
            if keep_going is not None and (i - asked_i >= EVICT_BATCH or mono() - asked_t >= EVICT_BATCH_S):
                if not keep_going():
                    break
                asked_i, asked_t = i, mono()
            mtime, _, dev, ino, path = entries[i]
            i += 1
            try:
                st = lstat(path)
            except OSError:
                r.skipped += 1
                continue
            if st.st_mtime_ns != mtime or st.st_ino != ino or st.st_dev != dev or not S_ISREG(st.st_mode):
                r.skipped += 1  # refreshed by a hit, or republished, since the census
                continue
            if not dry_run:
                try:
                    unlink(path)
                except FileNotFoundError:
                    r.skipped += 1
                    continue
                except OSError as err:
                    r.errors.append((path, err))
                    continue
                dirs.add(os.path.dirname(path))
            nb = st.st_blocks * 512
            r.evicted.append(path)
            r.evicted_bytes += nb
            usage -= nb
        r.usage_after = usage
        if not dry_run:
            self._next = i
        for d in sorted(dirs):
            for sub in (d, os.path.dirname(d)):
                try:
                    os.rmdir(sub)
                except OSError:  # ENOTEMPTY (a store put a block there meanwhile), ENOENT: leave it
                    break
                r.dirs_removed += 1
        r.cpu_s = time.thread_time() - cpu0
        return r


# ---------------------------------------------------------------------- shared state files

def state_dir(root: str) -> str:
    return os.path.join(root, STATE_DIR)


def _is_num(v: Any) -> bool:
    """A finite int or float (not bool; an int too large for a float is none)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _read_state_file(path: str, limit: int) -> Tuple[bytes, os.stat_result]:
    """Up to ``limit`` bytes of one of ``.kvtier/``'s files, and its fstat: opened
    non-blocking and read only when it is a regular file (a FIFO there would block the open
    or the read for ever: OSError EINVAL instead)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.pread(fd, limit, 0), st
    finally:
        _close(fd)


def _loads(b: bytes) -> Any:
    """json.loads, None for what is no JSON (a nesting deep enough for RecursionError too)."""
    try:
        return json.loads(b)
    except (ValueError, RecursionError):
        return None


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _valid_usage(d: Any) -> bool:
    """``d`` has the fields a reader of ``usage.json`` uses, of the types it uses them as:
    ``bytes`` a count, ``scan_started`` / ``scan_finished`` finite numbers, and where
    present ``evict_finished`` a number, ``room`` a count or None, ``alloc_ratio`` a
    number >= 1, ``generation`` a count, ``evictor`` a string, ``inodes_free`` a count or
    None."""
    if not (isinstance(d, dict) and _is_count(d.get("bytes")) and _is_num(d.get("scan_started"))
            and _is_num(d.get("scan_finished"))):
        return False
    for k, ok in (("evict_finished", _is_num), ("room", lambda v: v is None or _is_count(v)),
                  ("alloc_ratio", lambda v: _is_num(v) and 1 <= v <= 64), ("generation", _is_count),
                  ("evictor", lambda v: isinstance(v, str)), ("max_bytes", lambda v: v is None or _is_count(v)),
                  ("inodes_free", lambda v: v is None or _is_count(v))):
        if k in d and not ok(d[k]):
            return False
    return True


def read_usage(root: str) -> Optional[Dict[str, Any]]:
    """The latest published census of ``root`` (``usage.json``), or None (none, unreadable,
    truncated, or a field of the wrong type: :func:`_valid_usage`)."""
    try:
        d = _loads(_read_state_file(os.path.join(state_dir(root), USAGE_FILE), USAGE_LIMIT)[0])
    except OSError:
        return None
    return d if _valid_usage(d) else None


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}_{secrets.token_hex(8)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


STATE_TEMP_AGE_S = 60.0
"""A temp in ``.kvtier/`` (of usage.json or evict.request: temp + rename) older than this
is a dead writer's (SIGKILL between its open and its rename): the evictor removes it."""


def sweep_state_temps(root: str, older_than: float = STATE_TEMP_AGE_S) -> int:
    """Remove ``.kvtier/*.tmp`` files older than ``older_than`` seconds; their number."""
    n, now = 0, time.time()
    try:
        it = os.scandir(state_dir(root))
    except OSError:
        return 0
    with it:
        for e in it:
            try:
                if (e.name.endswith(".tmp") and e.is_file(follow_symlinks=False)
                        and now - e.stat(follow_symlinks=False).st_mtime > older_than):
                    os.unlink(e.path)
                    n += 1
            except OSError:
                continue
    return n


def publish_usage(root: str, d: Dict[str, Any]) -> None:
    """Publish ``d`` as ``usage.json`` (temp + rename: a reader sees the old or the new)."""
    _write_atomic(os.path.join(state_dir(root), USAGE_FILE), json.dumps(d, sort_keys=True).encode())


def _host_identity() -> Tuple[str, str, int]:
    """(hostname, boot id, pid namespace inode): processes that see one another's pids."""
    host = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return host, boot, ns


def _close(fd: int) -> None:
    """Close ``fd``; an error is ignored: the fd is released whatever close answers, and on
    FUSE (GlusterFS) its flush may answer ENOENT for a file another client renamed over."""
    try:
        os.close(fd)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scan_ledgers(root: str, now: Optional[float] = None, max_age: float = 2 * DEFAULT_CENSUS_INTERVAL_S,
                 skip: Optional[str] = None, remove_dead: bool = False,
                 before: Optional[float] = None) -> Dict[str, Dict[str, Any]]:
    """The writers' ledgers of ``root`` (except file ``skip``), by file name.  A ledger is
    dead (``"_dead": True``) when its writer's pid is gone on this host (same boot and pid
    namespace: it exited, or was killed) or it was not republished for ``max_age``
    seconds: it still counts (what its writer stored since its census is on disk) until
    a census that began after its last write (``before``: that census's
    ``scan_started``) counts that; then ``remove_dead`` removes it.  One stamped more than
    ``max_age`` ahead of this clock is garbage (it would never age out): left out, and
    removed with ``remove_dead``.  A file that is no ledger (not a JSON object with a
    finite ``t`` and a count ``bytes``) is left out and alone."""
    now = time.time() if now is None else now
    wdir = os.path.join(state_dir(root), WRITERS_DIR)
    me = _host_identity()
    live: Dict[str, Dict[str, Any]] = {}
    try:
        names = os.listdir(wdir)
    except OSError:
        return live
    for name in names:
        if name == skip or name.endswith(".tmp"):
            continue
        p = os.path.join(wdir, name)
        try:
            d = parse_ledger(_read_state_file(p, LEDGER_RECORD * 2)[0])
        except OSError:
            continue
        if d is None:
            continue  # not a ledger (or torn mid-rewrite)
        pid, t = d.get("pid"), float(d["t"])
        future = now - t < -max_age
        dead = (now - t > max_age or ((d.get("host"), d.get("boot"), d.get("pidns")) == me
                                      and not (_is_count(pid) and pid > 0 and _pid_alive(pid))))
        if future or (dead and before is not None and t < before):
            if remove_dead:
                try:
                    os.unlink(p)
                except OSError:
                    pass
            continue
        if dead:
            d["_dead"] = True
        live[name] = d
    return live


def parse_ledger(b: bytes) -> Optional[Dict[str, Any]]:
    """A ledger record, or None when ``b`` is none (not a JSON object with a finite ``t``
    and a count ``bytes``; torn by a rewrite read halfway)."""
    d = _loads(b)
    if not isinstance(d, dict) or not _is_num(d.get("t")) or not _is_count(d.get("bytes")):
        return None
    return d


def ledger_bytes(d: Dict[str, Any], since: Optional[float] = None, census_view: Any = None) -> int:
    """What ledger ``d`` adds to the census that began at ``since`` (made through
    ``census_view``, :func:`usage_view`): its running jobs' reservations and the bytes of its
    jobs that ended after that began (its buckets, :data:`LEDGER_AGES`; less
    :data:`OTHER_VIEW_S` when the census was made through another view, :func:`same_view`).  All its bytes when it has no buckets (an older kvtier), counts
    from a census newer than ``since`` (its buckets before that are gone), or ``since``
    is None."""
    b = int(d["bytes"])
    done, inflight, own_since = d.get("done"), d.get("inflight"), d.get("since")
    if since is None or not _is_count(inflight) or not isinstance(done, list) or not _is_num(own_since) \
            or own_since > since:
        return b
    cut = since - (0.0 if same_view(d, census_view) else OTHER_VIEW_S)
    n = inflight
    for e in done:
        if not (isinstance(e, list) and len(e) == 2 and _is_num(e[0]) and _is_count(e[1])):
            return b
        if e[0] >= cut:
            n += e[1]
    return min(n, b)


def ledger_buckets(done: Iterable[Tuple[float, int]], now: float) -> List[Tuple[float, int]]:
    """``done`` (ended jobs' ``(end time, bytes)``, oldest first) merged into one entry per
    :data:`LEDGER_AGES` bucket of their age at ``now`` (the entry's time: the newest end in
    it), oldest first."""
    edges = [now - a for a in reversed(LEDGER_AGES)]
    out: List[Tuple[float, int]] = []
    last = -1
    for t, nb in done:
        k = bisect.bisect_right(edges, t)
        if k == last:
            out[-1] = (max(out[-1][0], t), out[-1][1] + nb)
        else:
            out.append((t, nb))
            last = k
    return out


def read_ledgers(root: str, now: Optional[float] = None, max_age: float = 2 * DEFAULT_CENSUS_INTERVAL_S,
                 skip: Optional[str] = None, remove_dead: bool = False, since: Optional[float] = None,
                 census_view: Any = None, before: Optional[float] = None) -> Tuple[int, int]:
    """``(bytes, live writers)``: what the ledgers of ``root`` (:func:`scan_ledgers`, the
    dead that still count included) add to the census that began at ``since``
    (:func:`ledger_bytes`; all their bytes when None), and how many of them are live."""
    led = scan_ledgers(root, now, max_age, skip, remove_dead, before)
    return (sum(ledger_bytes(d, since, census_view) for d in led.values()),
            sum(not d.get("_dead") for d in led.values()))


# ---------------------------------------------------------------------- the lock

class EvictorLock:
    """The root's evictor lock: fcntl (POSIX record) lock on ``<root>/.kvtier/evictor.lock``
    through one fd, held until :meth:`release` (or the process ends: the kernel drops it,
    SIGKILL included).  POSIX locks belong to the process: only one object per process and
    root may exist (:class:`RootCapacity` is that), and no other code may open and close
    that file (a close of any fd of it drops the lock).

    The holder's **heartbeat** is the file's content: ``{"by": "host:pid", "seq": n, "t":
    time.time()}`` padded to :data:`BEAT_RECORD` bytes, pwritten through the locked fd by
    :meth:`beat` (fdatasync'd on NFS, whose client would hold it back for ~30 s).  Another
    process that sees ``seq`` still for ``takeover_s`` by its own clock replaces the file
    (:meth:`take_over`); the holder sees that at its next :meth:`check`."""

    def __init__(self, root: str, beat_s: float = BEAT_S) -> None:
        self.path = os.path.join(state_dir(root), LOCK_FILE)
        self._fd: Optional[int] = None
        self.held = False
        self.by = f"{socket.gethostname()}:{os.getpid()}"
        self.beat_s = beat_s
        self.seq = 0
        self._beat_at = -math.inf
        m = mount_of(root)
        self._sync = m is not None and m.kind == "nfs"

    def try_acquire(self) -> bool:
        if self.held:
            return True
        if self._fd is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)  # .kvtier/ removed under a running tier
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        self.held = True
        if not self.check():  # the file was replaced under this fd (taken over): a lock on it is none
            return False
        self.beat(force=True)
        return True

    def beat(self, force: bool = False) -> None:
        """The holder: write the next heartbeat record, at most every ``beat_s`` (``force``:
        now).  An error is ignored: a missed beat at worst lets another process take over."""
        mono = time.monotonic()
        if not self.held or (not force and mono - self._beat_at < self.beat_s):
            return
        self._beat_at = mono
        self.seq += 1
        b = json.dumps({"by": self.by, "seq": self.seq, "t": time.time()}).encode()
        try:
            os.pwrite(self._fd, b + b" " * max(0, BEAT_RECORD - 1 - len(b)) + b"\n", 0)  # type: ignore[arg-type]
            if self._sync:
                os.fdatasync(self._fd)  # type: ignore[arg-type]
        except OSError:
            pass

    def still_held(self) -> bool:
        """The holder between steps: :meth:`beat`, then :meth:`check`; False when it holds
        no lock (any more)."""
        if not self.held:
            return False
        self.beat()
        return self.check()

    def check(self) -> bool:
        """False (and the lock dropped: the next :meth:`try_acquire` opens the file anew)
        when ``evictor.lock`` is no longer the file this fd locks: removed or replaced
        (taken over from this process while it was stopped, ``rm -rf .kvtier`` under a
        running tier).  Its holder held a lock nobody else could see: another process may
        have made and locked a new file meanwhile."""
        if self._fd is None:
            return True
        try:
            a, b = os.stat(self.path), os.fstat(self._fd)
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                return True
        except FileNotFoundError:
            pass
        except OSError as e:  # a transient error (EIO, ETIMEDOUT on a DFS) says nothing: keep it
            if e.errno != errno.ESTALE:  # (NFSv3: the file this fd had was replaced)
                return True
        self.release()
        return False

    def take_over(self) -> None:
        """Replace ``evictor.lock`` by a new file locked by this process, whatever holds the
        old one (the caller judged its holder stopped, under ``evictor.takeover``): the
        heartbeat written to a temp and the temp locked, then renamed over the old file, so
        a reader finds the old file or the new locked one.  The old holder keeps a lock on a
        file no one opens any more; its next :meth:`check` drops it."""
        tmp = f"{self.path}_{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        old, self._fd, self.held = self._fd, fd, True
        if old is not None:
            _close(old)  # the old file: this process holds no lock on it
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows this file yet
            self.beat(force=True)
            os.replace(tmp, self.path)
        except BaseException:
            self.release()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def release(self) -> None:
        if self._fd is not None:
            _close(self._fd)  # drops the lock
        self._fd, self.held = None, False


def read_heartbeat(root: str) -> Optional[Dict[str, Any]]:
    """The evictor's heartbeat record of ``root`` (:class:`EvictorLock`): ``by``
    ("host:pid"), ``seq``, ``t`` (the holder's ``time.time()``), and ``file`` (st_dev,
    st_ino of ``evictor.lock``: a takeover makes a new one).  None when there is none: no
    file, an empty one (its holder is an older kvtier: it is never taken over), a torn or
    foreign content.  Opens and closes the file: never in a process that holds the lock."""
    try:
        b, st = _read_state_file(os.path.join(state_dir(root), LOCK_FILE), 2 * BEAT_RECORD)
    except OSError:
        return None
    d = _loads(b)
    if not (isinstance(d, dict) and isinstance(d.get("by"), str) and _is_count(d.get("seq"))
            and _is_num(d.get("t"))):
        return None
    return {"by": d["by"], "seq": d["seq"], "t": float(d["t"]), "file": (st.st_dev, st.st_ino)}


def lock_holder(root: str) -> Optional[int]:
    """The pid holding the evictor lock of ``root`` as F_GETLK reports it (this host, or
    a filesystem that reports remote holders), None when free."""
    import struct

    path = os.path.join(state_dir(root), LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # struct flock: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid
        arg = struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0)
        res = fcntl.fcntl(fd, fcntl.F_GETLK, arg)
        l_type, _, _, _, pid = struct.unpack("hhqqi4x", res)
        return None if l_type == fcntl.F_UNLCK else pid
    except OSError:
        return None
    finally:
        _close(fd)  # this process holds no lock on it (a tier's RootCapacity never calls this)


# ---------------------------------------------------------------------- one pass

def one_pass(root: str, max_bytes: int, high: float = DEFAULT_HIGH, low: float = DEFAULT_LOW,
             dry_run: bool = False, force: Optional[str] = None, generation: int = 0, evictor: str = "",
             lock: Optional[EvictorLock] = None, view: Optional[List[Any]] = None
             ) -> Tuple[Census, EvictResult, Dict[str, Any]]:
    """A census of ``root`` and, when it passes ``high * max_bytes``, an eviction down to
    ``low * max_bytes``; ``force="drop"`` (a writer dropped a store): down to ``low *
    max_bytes`` whatever the census; ``force="enospc"`` (the filesystem is full): down to
    ``low`` of the smaller of the bound and the usage.  The decision is the census's alone: the writers' ledgers
    count what may have been written since it began, which the next census sees, so
    adding them would evict twice for the same bytes.  The bound is the one in force, as
    for a tier: ``max_bytes`` or less, when the filesystem has less room (:func:`fs_room`:
    free space or free inodes).  Returns the census, the eviction and the usage record
    (not published here; its ``room`` is that room).  ``lock``, the evictor lock held:
    beaten during the census, checked during the eviction (a pass taken over stops:
    :meth:`EvictorLock.still_held`)."""
    if not dry_run:  # dead writers' ledgers that the last census counted go, as at a tier evictor's census
        u = read_usage(root)
        read_ledgers(root, remove_dead=True, before=float(u["scan_started"]) if u else None)
    c = census(root, progress=None if lock is None else lock.beat)
    usage = c.bytes
    room = root_room(c)
    mx = max_bytes if room is None else min(max_bytes, room)
    if force == "enospc":
        target = int(low * min(mx, usage))
    elif usage > high * mx or force == "drop":
        target = int(low * mx)
    else:
        target = usage
    r = evict(c, usage, target, dry_run=dry_run, keep_going=None if lock is None else lock.still_held)
    rec = {"bytes": c.bytes if dry_run else r.usage_after, "files": c.files - len(r.evicted) * (not dry_run),
           "blocks": c.blocks - len(r.evicted) * (not dry_run), "scan_started": c.scan_started,
           "scan_finished": c.scan_finished, "evict_finished": time.time(), "generation": generation,
           "evictor": evictor, "view": view, "max_bytes": max_bytes, "evicted": 0 if dry_run else len(r.evicted),
           "evicted_bytes": 0 if dry_run else r.evicted_bytes, "census_cpu_s": c.cpu_s, "room": room,
           "alloc_ratio": round(alloc_ratio(c), 4), "unreadable": c.unreadable}
    return c, r, rec


# ---------------------------------------------------------------------- per process and root

_roots: Dict[str, "RootCapacity"] = {}
_roots_lock = threading.Lock()


def _forget_roots_in_child() -> None:
    """In a forked child the parent's :class:`RootCapacity` objects are the parent's: their
    thread did not come along, the evictor lock is the parent's (fcntl locks are not
    inherited) and their ledger names the parent.  A tier made in the child attaches a
    new one; closing an inherited one touches nothing of the parent's (:meth:`RootCapacity.close`)."""
    global _roots, _roots_lock
    _roots, _roots_lock = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_roots_in_child)


def attach(root: str, config: CapacityConfig, counters: Any = None,
           on_evicted: Optional[Callable[[List[str]], None]] = None, block_size: int = 0) -> "Handle":
    """The capacity of ``root`` in this process (one :class:`RootCapacity` per real path:
    one lock fd, one ledger, one thread), attached for one tier: ``counters`` (an engine
    Counters) counts the evictions of this process's evictor, ``on_evicted(paths)`` is
    called on the capacity thread with each pass's evicted block paths.  ValueError when
    the bound is less than one block of ``block_size`` bytes plus :data:`STATE_BYTES`
    (nothing could be stored) or
    another tier of this process already bounds the root with other values."""
    real = os.path.realpath(root)
    check_holds_a_block(config, block_size, root, real)  # before anything starts: nothing to undo
    with _roots_lock:
        rc = _roots.get(real)
        if rc is not None and rc.config != config and _resolved(rc.config, real) != _resolved(config, real):
            raise ValueError(f"tier root {root!r} is already bounded in this process with {rc.config}; "
                             f"a second tier on it must use the same capacity keys, got {config}")
        if rc is None:
            rc = _roots[real] = RootCapacity(real, config)
        h = Handle(rc, counters, on_evicted)
        rc._attach(h)
    return h


def least_bound(block_size: int) -> int:
    """The smallest bound that holds one block of ``block_size`` bytes: the block allocated
    (rounded up to :data:`ALLOC_UNIT`) plus the root's own files (:data:`STATE_BYTES`);
    36 KiB for a block of one page (what ``kvtier evict`` takes when the root records no
    block size), 2 MiB + 32 KiB for a 2 MiB block."""
    return _alloc(block_size) + STATE_BYTES


def check_holds_a_block(config: CapacityConfig, block_size: int, root: str, resolve_at: Optional[str] = None) -> None:
    """ValueError naming ``max_bytes``, ``block_size`` and ``root`` when the bound is less
    than :func:`least_bound` of ``block_size``: no store could ever be admitted.
    ``resolve_at``: the path whose filesystem a percentage is of; None (a shell's check
    before any I/O, the root may not exist yet): a percentage is not checked here
    (:func:`attach` checks it)."""
    mx = parse_max_bytes(config.max_bytes, resolve_at)
    least = least_bound(block_size)
    if mx is not None and mx < least:
        raise ValueError(f"max_bytes {config.max_bytes!r} ({mx} bytes) is less than one block ({block_size} "
                         f"bytes, {_alloc(block_size)} allocated) plus the root's own files "
                         f"({STATE_BYTES} bytes): no store could ever be admitted at {root}; give at least {least}")


def _resolved(config: CapacityConfig, root: str) -> Tuple[int, float, float, float, float, float]:
    """The knobs as values: ``"1G"``, ``"1024M"`` and ``1073741824`` are one bound."""
    return (config.bound(root), config.evict_high, config.evict_low, config.census_interval_s,
            config.touch_window_s, config.takeover_s)


class Handle:
    """One tier's attachment to its root's :class:`RootCapacity` (what the engine calls)."""

    def __init__(self, rc: "RootCapacity", counters: Any, on_evicted: Optional[Callable[[List[str]], None]]) -> None:
        self.rc = rc
        self.counters = counters
        self.on_evicted = on_evicted
        self.closed = False

    # the engine's hooks ------------------------------------------------------
    def admit(self, n_blocks: int, block_size: int) -> Tuple[Optional[OSError], int]:
        """Reserve a store job's bytes (:meth:`RootCapacity.reserve_of` per block):
        ``(None, bytes reserved)`` if admitted, else ``(the ENOSPC to fail it with, 0)``
        (counted ``stores_dropped``).  No I/O."""
        nbytes = n_blocks * self.rc.reserve_of(block_size)
        err = self.rc.admit(nbytes)
        if err is not None:
            if self.counters is not None:
                self.counters.add("stores_dropped")
            return err, 0
        return None, nbytes

    def unrun(self, reserved: int) -> None:
        """An admitted store job that never ran (discarded by shutdown, refused): its
        reservation is released."""
        self.rc.finish(reserved, 0)

    def after_job(self, is_promotion: bool, paths: Sequence[str], n_ok: int, reserved: int,
                  error: Optional[BaseException], policy_counts: Dict[str, int]) -> None:
        """On the pool thread after a job's I/O: release a store's unused reservation,
        stamp its blocks (head newest), touch a load's blocks; ENOSPC asks for an
        eviction now."""
        rc = self.rc
        if not is_promotion:
            written = n_ok - min(n_ok, int(policy_counts.get("existing", 0)))
            rc.finish(reserved, reserved * written // max(1, len(paths)))
            if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
                rc.request_evict("enospc")
            rc.stamp(paths[:n_ok], force=True)
        else:
            rc.stamp(paths[:n_ok], force=False)

    def touch_later(self, paths: Iterable[str]) -> None:
        """Lookup hits: refreshed on the capacity thread (rate-limited)."""
        self.rc.touch_later(paths)

    def touch_keys_later(self, path_of: Callable[[Any], str], keys: Callable[[], Sequence[Any]]) -> None:
        """A finished request's blocks (``keys()`` in prefix order), refreshed on the capacity
        thread (rate-limited): :meth:`RootCapacity.touch_keys_later`."""
        self.rc.touch_keys_later(path_of, keys)

    def gauges(self) -> Dict[str, float]:
        return self.rc.gauges()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.rc._detach(self)


def _local_fs(root: str) -> bool:
    """Whether ``root`` is on a local filesystem (:data:`kvtier._tier.landing.BOUNDED`: one
    host mounts it); an unknown mount is taken as one other hosts may mount."""
    m = mount_of(root)
    return m is not None and m.kind in BOUNDED


def _alloc(n: int) -> int:
    return -(-n // ALLOC_UNIT) * ALLOC_UNIT


class RootCapacity:
    """A bounded root as seen by this process: the ledger, the lock, the capacity thread
    (census + eviction while it holds the lock; ledger publishing, reading the others'
    and the usage, lookup-hit touches always)."""

    def __init__(self, root: str, config: CapacityConfig) -> None:
        self.root = root
        self.config = config
        os.makedirs(os.path.join(state_dir(root), WRITERS_DIR), exist_ok=True)
        self.max_bytes = config.bound(root)
        self.high, self.low = config.evict_high, config.evict_low
        self.interval = config.census_interval_s
        self.host = socket.gethostname()
        self.ident = _host_identity()
        self.pid = os.getpid()
        self.name = f"{self.host}-{self.pid}-{secrets.token_hex(4)}"
        self.ledger_path = os.path.join(state_dir(root), WRITERS_DIR, self.name)
        self._wdir = os.path.dirname(self.ledger_path)
        # the root's st_dev: writers of one host through one mount share its page cache (two
        # mounts of one GlusterFS or NFS volume do not: those re-read by name, as other nodes)
        self._peer_id = (self.ident[0], self.ident[1], os.stat(root).st_dev)
        self.view = view_of(*self._peer_id)
        self._ledger_head = json.dumps({"host": self.ident[0], "boot": self.ident[1], "pidns": self.ident[2],
                                        "pid": self.pid, "dev": self._peer_id[2]})[:-1]  # without "}"
        self._lock = threading.Lock()
        self._handles: List[Handle] = []
        # this process's ledger: bytes of admitted store jobs still running, and of those
        # that ended, (time.time() at the end, bytes written) since the latest census
        self._inflight = 0
        self._done: "collections.deque[Tuple[float, int]]" = collections.deque()
        self._own = 0  # _inflight + the bytes of _done
        self._warned_drop = -1e9
        self._publish_warned = -1e9
        self._census_warned = -1e9
        self._unevictable_warned = -1e9
        self._kept_over_low = False  # the latest census: files no pass removes hold usage above the low mark
        self._tick_warned = -1e9
        self.tick_failures = 0  # ticks of the capacity thread that raised
        self.publish_failures = 0  # usage.json publications that failed
        # the other writers' ledgers as last read, by file name; this host's are kept open
        # and re-read at each admission (one page cache: what a peer admitted a moment ago
        # counts), the others' re-read every LEDGER_PUBLISH_S by name (a reopen: NFS's
        # close-to-open)
        self._ledgers: Dict[str, Dict[str, Any]] = {}
        self._peer_fds: Dict[str, int] = {}
        self._peer_raw: Dict[str, bytes] = {}  # the record last parsed of each
        self._wdir_mtime: Optional[int] = None
        self._others_at = 0.0
        # the room seen from this view is shared with the other views (hosts, mounts) that write
        # the root: they see this process's admissions only once they read its ledger again
        # (up to ~2 LEDGER_PUBLISH_S), so between two of its reads of theirs (an anchor) this
        # view takes 1/views of the room it saw then (after its first job): two nodes that see
        # the same freed room never both fill it (docs/capacity.md, "Admission")
        self._views = 1  # distinct (host, boot id, root st_dev) of the live writers, this one's included
        # on a filesystem other hosts may mount (not a local one, landing.BOUNDED), one view
        # more than seen: a writer that joined may be unlisted here for ~1 s (a FUSE client's
        # directory cache) while it reads this ledger as unsynced (0 bytes), and both would
        # fill the same room (MooseFS: 1.25-1.97x the bound, docs/capacity.md)
        self._unseen = 0 if _local_fs(root) else 1
        self._anchor: Optional[int] = None  # the estimate at the last read of the other views' ledgers
        self._anchor_own = 0  # bytes this process admitted since
        self._usage_read = 0.0  # time.monotonic() when usage.json was last read
        self._since_missed = 0.0  # a census a ledger counts from that usage.json did not have
        self._cands: Optional[Candidates] = None
        self._room: Optional[int] = None  # the evictor's: census bytes + free space (statvfs)
        self._usage: Optional[Dict[str, Any]] = None
        self._dirty = True
        self._sync_due = False  # an admission asks the capacity thread to publish the ledger synced
        self._published_at = 0.0
        self._checked_at = 0.0
        self._listed_at = 0.0  # time.monotonic() of the last listing of the writers at an admission  # time.monotonic() of the last _check_state (ledger and lock file there)
        self._touched: "collections.OrderedDict[str, float]" = collections.OrderedDict()
        # paths, or (path_of, keys) mapped on the capacity thread (a request's keys: touch_keys_later)
        self._touch_q: "collections.deque[Any]" = collections.deque(maxlen=TOUCH_LRU)
        self._request: Optional[str] = None
        self._request_seen = 0.0
        self._job_max = 0  # bytes of the largest store job (<= the bound) seen: room a pass leaves
        self._asked_at = 0.0
        self._wake = threading.Event()
        self._stop = False
        self.takeover_s = config.takeover_s
        self.lock = EvictorLock(root, beat_s=min(BEAT_S, self.takeover_s / 10))
        # the holder's heartbeat as this process last saw it change: (file, by, seq), and when
        # (time.monotonic(): another node's clock never counts)
        self._beat_seen: Optional[Tuple[Any, str, int]] = None
        self._beat_moved = 0.0
        self.takeovers = 0  # times this process took the lock over from a still holder
        self.stepped_down = 0  # times this process found its lock taken over (or its file gone)
        # the lock file must open (a read-only or non-file evictor.lock would fail every
        # tick: no census, no eviction, every store dropped once full): OSError with the
        # path now.  This process holds no lock of it yet, so this close drops none.
        _close(os.open(self.lock.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
        self.generation = 0
        self.last_pass: Optional[EvictResult] = None
        self.last_census: Optional[Census] = None
        self.passes = 0  # censuses + eviction steps of this process's evictor
        self.censuses = 0
        self.evictor_cpu_s = 0.0
        self._next_census = 0.0
        self._ledger_fd = os.open(self.ledger_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._publish_ledger()
        self._thread = threading.Thread(target=self._run, name="kvtier_capacity", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ attach
    def _attach(self, h: Handle) -> None:
        self._handles.append(h)

    def _detach(self, h: Handle) -> None:
        with _roots_lock:
            if h in self._handles:
                self._handles.remove(h)
            if self._handles:
                return
            if _roots.get(self.root) is self:
                del _roots[self.root]
        self.close()

    def close(self) -> None:
        """Stop the thread, drop the lock; remove this process's ledger when the latest
        census it read counts all it stored, else leave it, final, to count that until a
        census does (the evictor removes it then: :func:`scan_ledgers`; gone at once, the
        other writers would admit those bytes again).  In a forked child (another pid)
        nothing: the thread, the lock and the ledger are the parent's."""
        if os.getpid() != self.pid:
            return
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.lock.release()
        with self._lock:
            for fd in self._peer_fds.values():
                _close(fd)
            self._peer_fds.clear()
            counted = not self._done and self._inflight <= 0
            if not counted:
                self._write_ledger(self._ledger_record())
        _close(self._ledger_fd)
        if counted:
            try:
                os.unlink(self.ledger_path)
            except OSError:
                pass

    # ------------------------------------------------------------------ admission
    def reserve_of(self, block_size: int) -> int:
        """Bytes a block of ``block_size`` bytes is reserved for: rounded up to
        :data:`ALLOC_UNIT`, times the latest census's ``alloc_ratio``.  Fixed per job:
        the engine keeps what a job reserved and gives that back."""
        ratio = float((self._usage or {}).get("alloc_ratio", 1.0) or 1.0)
        return int(_alloc(block_size) * max(1.0, ratio))

    def bound(self) -> int:
        """The bound in force: ``max_bytes``, or less when the filesystem has less room
        (:func:`fs_room` at the latest census: the root's usage + the free space, or + the
        free inodes at a block's bytes per inode when fewer; or the usage at which a store
        met ENOSPC since, whichever of the two ran out)."""
        room = self._room if self.lock.held else (self._usage or {}).get("room")
        return self.max_bytes if not room else min(self.max_bytes, int(room))

    def marks(self, mx: int) -> Tuple[int, int]:
        """``(high, low)`` in bytes for the bound ``mx``: ``evict_high`` and ``evict_low``
        of it, both moved down (the band kept) when the largest store job seen
        (:attr:`_job_max`) does not fit between the high mark and the bound: a job
        larger than ``(1 - evict_high) * max_bytes`` would otherwise be dropped at every
        usage between ``max_bytes - job`` and the high mark, where no pass starts."""
        high, low = int(self.high * mx), int(self.low * mx)
        job = self._job_max
        if 0 < job <= mx and mx - job < high:
            low = max(0, low - (high - (mx - job)))
            high = mx - job
        return high, low

    def estimate(self) -> int:
        """Usage estimate, bytes: latest census (after its eviction) + what the other
        writers' ledgers (as last read) add to it + this process's reservations."""
        u = self._usage
        return (u["bytes"] if u else 0) + self._others() + self._own

    def _others(self) -> int:
        """What the other writers' ledgers (as last read) add to the latest census
        (:func:`ledger_bytes`)."""
        u = self._usage
        since = float(u["scan_started"]) if u else None
        by = usage_view(u)
        return sum(ledger_bytes(d, since, by) for d in list(self._ledgers.values()))

    def _merge_ledgers(self, mtime: Optional[int], led: Dict[str, Dict[str, Any]]) -> None:
        """(lock held) The ledgers of a listing of the writers' directory (made when it had
        ``mtime``): kept, and an fd opened on each of this host's through the same mount
        (same boot id and root ``st_dev``: one page cache; closed when it is gone, reopened
        when its file was replaced)."""
        self._wdir_mtime, self._ledgers = mtime, led
        self._peer_raw.clear()  # (re-read at the next admission)
        views = {(d.get("host"), d.get("boot"), d.get("dev")) for d in led.values() if not d.get("_dead")}
        views.discard(self._peer_id)
        self._views = 1 + len(views)
        fds = self._peer_fds
        for name in list(fds):
            gone = name not in led
            if not gone:
                try:
                    gone = os.fstat(fds[name]).st_nlink == 0
                except OSError:
                    gone = True
            if gone:
                _close(fds.pop(name))
        for name, d in led.items():
            if name not in fds and (d.get("host"), d.get("boot"), d.get("dev")) == self._peer_id:
                try:
                    fds[name] = os.open(os.path.join(self._wdir, name), os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    pass

    def _wdir_stamp(self) -> Optional[int]:
        """The writers' directory's mtime (ns), taken before a listing; None (list again at
        the next admission) when it cannot be read or is under 20 ms old: a writer that
        came in the same clock tick as the listing leaves the mtime as it was.  (A stamp
        ahead of this clock, an NFS server's, is taken as it is: else every admission
        would list the directory.)"""
        try:
            m = os.stat(self._wdir).st_mtime_ns
        except OSError:
            return None
        return None if 0 <= time.time_ns() - m < 20_000_000 else m

    def _read_peers(self) -> None:
        """(lock held; at an admission) This host's other writers, re-read now: a listing when
        the writers' directory changed (a writer came or went), then one pread each (a
        record torn by its rewrite keeps the value read before)."""
        mtime = self._wdir_stamp()
        mono = time.monotonic()
        if (mtime is None or mtime != self._wdir_mtime) and mono - self._listed_at >= LEDGER_PUBLISH_S / 10:
            # (at most every 5 ms: a directory that keeps changing costs a listing per 5 ms,
            # not one per admission; the capacity thread lists it every LEDGER_PUBLISH_S)
            self._listed_at = mono
            self._merge_ledgers(mtime, scan_ledgers(self.root, max_age=2 * self.interval + 1.0, skip=self.name))
        raw = self._peer_raw
        for name, fd in self._peer_fds.items():
            try:
                b = os.pread(fd, LEDGER_RECORD * 2, 0)
            except OSError:
                continue
            if raw.get(name) != b:
                d = parse_ledger(b)
                if d is not None:
                    self._ledgers[name], raw[name] = d, b
        # a writer counts from a census newer than this process's: it has dropped what that
        # census counts, which the usage read before it does not (an estimate too low)
        # (the evictor publishes a census before it counts from it: one read finds it; a
        # ledger that names a census usage.json does not have is read for again only after
        # LEDGER_PUBLISH_S)
        u = self._usage
        mine = float(u["scan_started"]) if u else 0.0
        newer = max((float(d["since"]) for d in self._ledgers.values() if _is_num(d.get("since"))), default=0.0)
        if newer > mine:
            self._reread_usage(0.0 if newer != self._since_missed else LEDGER_PUBLISH_S)
            if self._usage is None or float(self._usage["scan_started"]) < newer:
                self._since_missed = newer

    def _reread_usage(self, min_gap: float) -> bool:
        """(lock held; not the evictor, which has its own) ``usage.json`` read again now,
        unless it was read less than ``min_gap`` seconds ago; True when that took a newer
        record (:meth:`_take_usage`)."""
        if self.lock.held or time.monotonic() - self._usage_read < min_gap:
            return False
        u = read_usage(self.root)
        self._usage_read = time.monotonic()
        return u is not None and self._take_usage(u)

    def admit(self, nbytes: int) -> Optional[OSError]:
        with self._lock:
            self._read_peers()
            est = self.estimate()
            bound = self.bound()
            # about to drop on a usage read up to LEDGER_PUBLISH_S ago: the evictor may have
            # made room since (it publishes after each pass)
            if est + nbytes > bound and self._reread_usage(LEDGER_PUBLISH_S / 10):
                est, bound = self.estimate(), self.bound()
            if nbytes <= bound and nbytes > self._job_max:  # a pass leaves room for it
                self._job_max = nbytes
            share = None
            views = self._views + self._unseen
            if views > 1 and self._anchor is not None and self._anchor_own:
                # this view's share of the room seen at the anchor (its first job since: always)
                share = self._anchor + max(0, bound - self._anchor) // views
            if est + nbytes > bound or (share is not None and est + nbytes > share):
                if nbytes > self.max_bytes - STATE_BYTES:  # no pass makes room for it
                    return OSError(errno.ENOSPC, f"store dropped by kvtier capacity: this job's {nbytes} bytes "
                                                 f"are more than max_bytes {self.max_bytes} holds beside the "
                                                 f"root's own files ({STATE_BYTES} bytes): no job of this size "
                                                 f"is ever stored at this bound; raise max_bytes or store fewer "
                                                 f"blocks per job", self.root)
                self._ask("drop")
                u = self._usage
                age = f"{time.time() - u['scan_started']:.1f} s old" if u else "none yet"
                if time.monotonic() - self._warned_drop >= 60.0:
                    self._warned_drop = time.monotonic()
                    logger.warning("kvtier capacity: store jobs are dropped at %s: usage estimate %d + %d bytes "
                                   "> the bound %d (max_bytes %d, or the room on the filesystem; counted "
                                   "stores_dropped; this warning at most once a minute)",
                                   self.root, est, nbytes, bound, self.max_bytes)
                room = "" if bound == self.max_bytes else f" (the filesystem has room for {bound})"
                if est + nbytes <= bound:  # the share rule
                    room += (f", or this writer's share {share} of the room it saw with {self._views} hosts or "
                             f"mounts writing the root" + (" and one that may have joined unseen" if self._unseen
                                                           else ""))
                return OSError(errno.ENOSPC, f"store dropped by kvtier capacity: the root's usage estimate "
                                             f"{est} bytes + this job's {nbytes} would pass max_bytes "
                                             f"{self.max_bytes}{room} (census {age}, evictor "
                                             f"{u.get('evictor') if u else '?'}); eviction runs, the block is "
                                             f"recomputed next time", self.root)
            self._inflight += nbytes
            self._own += nbytes
            self._anchor_own += nbytes
            self._dirty = True
            if self._peer_fds:
                # published before the job's I/O starts: this host's other writers read it at
                # their next admission (two that admit at once see each other a job late at
                # most).  Without one, the capacity thread publishes it (a writer that comes
                # meanwhile reads it up to LEDGER_PUBLISH_S old at its first admissions)
                self._write_ledger(self._ledger_record())
            if views > 1:  # the other views: the capacity thread publishes it now, synced
                self._sync_due = True
                self._wake.set()
            if est + nbytes > self.marks(bound)[0]:
                self._ask("capacity")
        return None

    def _ask(self, reason: str) -> None:
        """Request a pass (lock held); at most one request a :data:`REQUEST_GAP_S`."""
        if _PRIORITY[reason] > _PRIORITY[self._request]:
            self._request = reason
        if time.monotonic() - self._asked_at >= REQUEST_GAP_S:
            self._asked_at = time.monotonic()
            self._wake.set()

    def finish(self, reserved: int, written: int) -> None:
        """A store job that reserved ``reserved`` bytes ended having written ``written``:
        those stay in the ledger (stamped now) until a census that started after now."""
        with self._lock:
            self._inflight -= reserved
            self._own -= reserved
            if written > 0:
                # kept merged by age (LEDGER_AGES: at most one entry each): a ledger
                # record costs the same at any job rate
                now = time.time()
                self._done.append((now, written))
                self._done = collections.deque(ledger_buckets(self._done, now))
                self._own += written
            self._dirty = True

    def _trim(self, since: float, same: bool) -> None:
        """Drop ended jobs' bytes that a census started at ``since`` has counted: the job
        ended before the scan began (less :data:`OTHER_VIEW_S` when the census was made
        through another view).  Jobs still running are never dropped (lock held)."""
        cut = since - (0.0 if same else OTHER_VIEW_S)
        while self._done and self._done[0][0] < cut:
            self._own -= self._done.popleft()[1]
            self._dirty = True

    # ------------------------------------------------------------------ recency
    def stamp(self, paths: Sequence[str], force: bool) -> None:
        """Set each block's mtime: ``now - i`` µs for position ``i`` (the head newest).  A
        load (``force`` False) skips blocks touched by this process in the last
        ``touch_window_s``; a store always stamps (its files are new)."""
        if not paths:
            return
        now_ns, mono = time.time_ns(), time.monotonic()
        window = self.config.touch_window_s
        touched = self._touched
        for i, p in enumerate(paths):
            if not force:
                t = touched.get(p)
                if t is not None and mono - t < window:
                    continue
            ns = now_ns - i * 1000
            try:
                os.utime(p, ns=(ns, ns))
            except OSError:  # not on disk (evicted, condemned, never stored): nothing to refresh,
                pass  # and not tried again within the window (a request's keys: touch_keys_later)
            with self._lock:
                touched[p] = mono
                touched.move_to_end(p)
                while len(touched) > TOUCH_LRU:
                    touched.popitem(last=False)

    def touch_keys_later(self, path_of: Callable[[Any], str], keys: Callable[[], Sequence[Any]]) -> None:
        """A finished request's blocks refreshed on the capacity thread: ``keys()`` gives them
        in prefix order and ``path_of`` maps each, both called there, off the caller's (vLLM's
        scheduler) thread; rate-limited as :meth:`touch_later`."""
        self._touch_q.append((path_of, keys))
        self._wake.set()

    def touch_later(self, paths: Iterable[str]) -> None:
        mono, window = time.monotonic(), self.config.touch_window_s
        for p in paths:
            t = self._touched.get(p)
            if t is None or mono - t >= window:
                self._touch_q.append(p)

    # ------------------------------------------------------------------ eviction requests
    def request_evict(self, reason: str) -> None:
        """Ask for a census + eviction now (this process's thread if it holds the lock,
        else the holder's, through ``evict.request``)."""
        with self._lock:
            if _PRIORITY[reason] > _PRIORITY[self._request]:
                self._request = reason
        self._wake.set()

    # ------------------------------------------------------------------ gauges
    def gauges(self) -> Dict[str, float]:
        u = self._usage
        now = time.time()
        nan = float("nan")  # no census yet: no age (an alert on a stale census must not read 0 as fresh)
        return {"capacity_used_bytes": float(self.estimate()), "capacity_max_bytes": float(self.max_bytes),
                "capacity_bound_bytes": float(self.bound()),
                "capacity_inodes_free": nan if u is None else -1.0 if u.get("inodes_free") is None
                else float(u["inodes_free"]),
                "capacity_census_age": (now - u["scan_started"]) if u else nan,
                "capacity_evictor_lag": (u.get("evict_finished", u["scan_finished"]) - u["scan_started"]) if u else nan}

    # ------------------------------------------------------------------ the thread
    def _ledger_record(self) -> bytes:
        """(lock held) This process's ledger, one JSON object: its bytes since the census
        it read last (``since``), as the running jobs' reservations (``inflight``) and the
        ended jobs' buckets (``done``: ``[newest end rounded up to the ms, bytes]``, oldest
        first: :func:`ledger_buckets`).  Formatted by hand: it is written at each admission."""
        u, now = self._usage, time.time()
        done = ",".join(f"[{math.ceil(t * 1000) / 1000!r},{b}]" for t, b in self._done)
        since, gen = (float(u["scan_started"]), int(u.get("generation", 0))) if u else (0.0, 0)
        self._dirty = False
        b = (f'{self._ledger_head},"bytes":{self._own},"inflight":{self._inflight},"done":[{done}],'
             f'"since":{since!r},"gen":{gen},"t":{now!r}}}').encode()
        return b + b" " * max(0, LEDGER_RECORD - 1 - len(b)) + b"\n"

    def _write_ledger(self, b: bytes, sync: bool = False) -> None:
        """``b`` written over this process's ledger; ``sync``: then fdatasync'd (other hosts
        and mounts read it by name: a FUSE client (GlusterFS, MooseFS) or an NFS client shows
        a rewrite in place to the others only once it is flushed, up to 0.1-0.5 s later
        without, ~1 ms after an fdatasync)."""
        try:
            os.pwrite(self._ledger_fd, b, 0)
            if sync:
                os.fdatasync(self._ledger_fd)
        except OSError as e:
            if time.monotonic() - self._publish_warned >= 60.0:
                self._publish_warned = time.monotonic()
                logger.warning("kvtier capacity: cannot publish the ledger %s: %s (this warning at most once a "
                               "minute)", self.ledger_path, e)
        self._published_at = time.monotonic()

    def _publish_ledger(self) -> None:
        with self._lock:
            b = self._ledger_record()
            sync, self._sync_due = self._views + self._unseen > 1, False
        self._write_ledger(b, sync)

    def _check_state(self) -> None:
        """Make ``.kvtier/``, this process's ledger and the lock file again when they were
        removed under the running tier (an operator's ``rm -rf ROOT/.kvtier``): else the
        ledger is written to an unlinked file nobody reads, the usage cannot be published,
        the other writers read no census again (their own bytes never trimmed: they drop
        every store) and the old lock holder holds a lock no other process sees."""
        try:
            gone = os.fstat(self._ledger_fd).st_nlink == 0
        except OSError:  # (fstat of an open fd: EIO at most) a transient error says nothing
            gone = False
        if gone:
            whole = not os.path.isdir(os.path.join(state_dir(self.root), WRITERS_DIR))  # rm -rf .kvtier, or ...
            try:
                os.makedirs(os.path.join(state_dir(self.root), WRITERS_DIR), exist_ok=True)
                fd = os.open(self.ledger_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                logger.warning("kvtier capacity: the ledger %s was removed and cannot be made again: %s",
                               self.ledger_path, e)
                return
            _close(self._ledger_fd)
            self._ledger_fd, self._dirty = fd, True
            if whole:
                logger.warning("kvtier capacity: %s was removed under the running tier: made again",
                               state_dir(self.root))
            else:  # ... only this ledger: the evictor found it stale (this process was stopped or starved)
                logger.warning("kvtier capacity: this process's ledger %s was removed as dead (not republished "
                               "for %.0f s: the process was stopped or starved): made again", self.ledger_path,
                               2 * self.interval + 1.0)
        if not (self._still_evictor() if self.lock.held else self.lock.check()):
            self._next_census = 0.0  # try the new lock file at once

    def _take_usage(self, u: Dict[str, Any]) -> bool:
        """(lock held) The usage as read from ``usage.json``: ended jobs it counts leave
        this process's ledger.  One older than the one held is not taken (two reads, by
        the capacity thread and an admission, finishing out of order: this process would
        count from a census older than the one it trimmed its ledger to); newer is a later
        census, or the same one after more eviction, or a later generation (an evictor
        whose clock is behind)."""
        self._usage_read = time.monotonic()
        ahead = time.time() + FUTURE_USAGE_S
        if float(u["scan_started"]) > ahead:
            return False  # no census begins there: garbage (or a clock far off), never trimmed against
        cur = self._usage
        if cur is not None and float(cur["scan_started"]) <= ahead:
            def key(d: Dict[str, Any]) -> Tuple[float, float]:
                return float(d["scan_started"]), float(d.get("evict_finished", d["scan_finished"]))
            if key(u) < key(cur) and int(u.get("generation", 0)) <= int(cur.get("generation", 0)):
                return False
        changed = cur is None or any(u.get(k) != cur.get(k) for k in ("scan_started", "evict_finished", "generation"))
        self._usage = u
        mine = {"host": self.view[0], "boot": self.view[1], "dev": self.view[2]}  # as a ledger of this view
        self._trim(float(u["scan_started"]), same_view(mine, usage_view(u)))
        if changed:  # a census or a pass: room the other views see too
            self._re_anchor()
        return True

    def _re_anchor(self) -> None:
        """(lock held) The room this view shares with the others is counted from now."""
        self._anchor, self._anchor_own = self.estimate(), 0

    def _refresh(self) -> None:
        """Re-read the usage and the other writers' ledgers."""
        u = read_usage(self.root) if not self.lock.held else None  # the evictor has its own, newer
        with self._lock:
            if u is not None:
                self._take_usage(u)
        mtime = self._wdir_stamp()
        led = scan_ledgers(self.root, max_age=2 * self.interval + 1.0, skip=self.name)
        with self._lock:
            self._merge_ledgers(mtime, led)
            self._re_anchor()  # the other views' ledgers as of now: a new share of the room
        self._others_at = time.monotonic()

    def _run(self) -> None:
        while not self._stop:
            try:
                self._tick()
            except Exception:  # the thread must live: log (at most once a minute) and go on
                self.tick_failures += 1
                if time.monotonic() - self._tick_warned >= 60.0:
                    self._tick_warned = time.monotonic()
                    logger.exception("kvtier capacity thread of %s (%d failed ticks so far; logged at most once "
                                     "a minute)", self.root, self.tick_failures)
                time.sleep(LEDGER_PUBLISH_S)
            self._wake.wait(LEDGER_PUBLISH_S)
            self._wake.clear()
        # close() removes the ledger file: this process reserves nothing any more

    def _tick(self) -> None:
        mono = time.monotonic()
        if mono - self._others_at >= LEDGER_PUBLISH_S:
            self._refresh()
        if mono - self._checked_at >= self.interval / 2:
            self._checked_at = mono
            self._check_state()
        if self._dirty or self._sync_due or mono - self._published_at >= self.interval / 2:
            self._publish_ledger()
        while self._touch_q:
            batch = []
            while self._touch_q and len(batch) < 256:
                item = self._touch_q.popleft()
                if isinstance(item, str):
                    batch.append(item)
                else:  # a request's keys, in prefix order: the head stamped newest
                    path_of, keys = item
                    batch.extend(path_of(k) for k in keys())
            self.stamp(batch, force=False)
            self.lock.beat()
        req = self._request
        if not self.lock.held and (mono >= self._next_census or req):
            self.lock.try_acquire()
            if not self.lock.held:
                self._watch_holder()
            if not self.lock.held:
                self._next_census = mono + self.interval
                if req:  # ask the holder
                    with self._lock:
                        self._request, need = None, self._job_max
                    try:
                        _write_atomic(os.path.join(state_dir(self.root), REQUEST_FILE),
                                      json.dumps({"reason": req, "need": need, "by": self.name,
                                                  "t": time.time()}).encode())
                    except OSError:
                        pass
                return
            self._next_census = 0.0  # just took over: a census now
        if not self.lock.held:
            return
        self.lock.beat()
        self._read_request_file()
        req = self._request
        cands = self._cands
        due = mono >= self._next_census or cands is None
        if not due and req and not len(cands):  # type: ignore[arg-type]
            due = mono >= self._early_census_at()  # asked to evict with no candidate left
        with self._lock:
            self._request = None
        if due:
            self._census_pass(req)
        else:
            self._evict_more(req)
            if not len(self._cands) and time.monotonic() >= self._next_census:
                self._census_pass(req)  # the candidates ran out short of the target, and a census may run

    def _watch_holder(self) -> None:
        """Not the evictor: note when the holder's heartbeat last changed, by this clock; when
        it has been still for ``takeover_s`` (the holder is stopped: SIGSTOP, a paused VM, its
        evictor stuck on a hung file), take the lock over.  Under ``evictor.takeover``
        (non-blocking: one taker at a time; after ``2 × takeover_s`` without it: its holder is
        a taker stopped in the middle) the lock is tried once more and the heartbeat read
        again: a holder that died or moved meanwhile is not taken over."""
        hb = read_heartbeat(self.root)
        if hb is None:
            return  # no heartbeat (an older kvtier holds it): never taken over
        seen, mono = (hb["file"], hb["by"], hb["seq"]), time.monotonic()
        if seen != self._beat_seen:
            self._beat_seen, self._beat_moved = seen, mono
            return
        still = mono - self._beat_moved
        if still < self.takeover_s:
            return
        try:
            fd = os.open(os.path.join(state_dir(self.root), TAKEOVER_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o644)
        except OSError:
            return
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                if still < 2 * self.takeover_s:
                    return  # another process is taking over now
            if self.lock.try_acquire():
                return  # freed meanwhile: taken the plain way
            hb = read_heartbeat(self.root)
            if hb is None or (hb["file"], hb["by"], hb["seq"]) != seen:
                return  # it moved (or another process took over): watch it again
            self.lock.take_over()
        except OSError:
            return  # the takeover failed (the temp could not be made, ...): try again later
        finally:
            _close(fd)
        self.takeovers += 1
        self._beat_seen = None
        logger.warning("kvtier capacity: took the evictor lock of %s over from %s, whose heartbeat (seq %d) had not "
                       "changed for %.1f s (takeover_s %s: stopped or hung); this process (%s) evicts now",
                       self.root, hb["by"], hb["seq"], still, self.takeover_s, self.lock.by)

    def _still_evictor(self) -> bool:
        """The evictor, between steps: beat, and check that ``evictor.lock`` is still the
        file this process locks.  False, with a warning, when it is not (taken over while
        this process was stopped, or ``.kvtier/`` removed): then it evicts and publishes
        nothing more until it holds the lock again."""
        if not self.lock.held:
            return False
        if self.lock.still_held():
            return True
        self.stepped_down += 1
        self._next_census = 0.0  # try the new lock file at once
        logger.warning("kvtier capacity: %s is no longer the file this process (%s) locks (taken over, or "
                       ".kvtier/ removed): it is no evictor of %s any more", self.lock.path, self.lock.by, self.root)
        return False

    def _read_request_file(self) -> None:
        """The evictor: a request file newer than the last one seen is a request."""
        path = os.path.join(state_dir(self.root), REQUEST_FILE)
        try:
            rq = os.stat(path)
            if rq.st_mtime <= self._request_seen:
                return
            self._request_seen = rq.st_mtime
            rq = _loads(_read_state_file(path, 4096)[0])
            r2, need = rq.get("reason", "capacity"), rq.get("need", 0)
        except (OSError, ValueError, AttributeError):
            return
        with self._lock:
            r2 = r2 if isinstance(r2, str) and r2 in _PRIORITY else "capacity"
            if _is_count(need):
                self._job_max = max(self._job_max, need)
            if _PRIORITY[r2] > _PRIORITY[self._request]:
                self._request = r2

    def _census_pass(self, why: Optional[str]) -> None:
        """A census (recalibrates the usage, rebuilds the candidates), then evict if due."""
        cpu0 = time.thread_time()
        read_ledgers(self.root, max_age=2 * self.interval + 1.0, skip=self.name, remove_dead=True,
                     before=float(self._usage["scan_started"]) if self._usage else None)
        sweep_state_temps(self.root)
        self.generation = max(self.generation, int((self._usage or {}).get("generation", 0))) + 1
        c = census(self.root, progress=self.lock.beat)
        if c.unreadable and time.monotonic() - self._census_warned >= 60.0:
            self._census_warned = time.monotonic()
            logger.warning("kvtier capacity: %s (this warning at most once a minute)", c.error_text())
        if not self._still_evictor():
            return  # taken over during the census: the new evictor counts and publishes
        # the room on the filesystems: what the root holds + what is still free, bytes or inodes
        try:
            st = os.statvfs(self.root)
            inodes_free = st.f_favail if st.f_files else None
        except OSError:
            st = inodes_free = None
        self._room = root_room(c, st) if st is not None else None
        # keep the oldest blocks that hold what must go now plus half a bound (or four of
        # the largest job): what the evictor may remove before the next census (it
        # censuses early when they run out)
        bound = self.bound()
        need = max(0, c.bytes - self.marks(bound)[1])
        kept = c.bytes - c.block_bytes  # what no pass removes: temps, config files, other files
        self._kept_over_low = kept > self.marks(bound)[1]
        if self._kept_over_low and time.monotonic() - self._unevictable_warned >= 60.0:
            self._unevictable_warned = time.monotonic()
            logger.warning("kvtier capacity: %d bytes under %s are not block files (temps, config files, other "
                           "files: never evicted), above the low watermark %d of the bound %d: stores are dropped "
                           "until they are removed or the bound is raised (this warning at most once a minute)",
                           kept, self.root, self.marks(bound)[1], bound)
        self._cands = Candidates(c.entries, keep_bytes=need + max(bound // 2, 4 * self._job_max))
        c.entries = []
        rec = {"bytes": c.bytes, "files": c.files, "blocks": c.blocks, "scan_started": c.scan_started,
               "scan_finished": c.scan_finished, "evict_finished": c.scan_finished, "generation": self.generation,
               "evictor": f"{self.host}:{self.pid}", "view": self.view, "max_bytes": self.max_bytes, "evicted": 0,
               "evicted_bytes": 0, "census_cpu_s": c.cpu_s, "room": self._room, "inodes_free": inodes_free,
               "alloc_ratio": round(alloc_ratio(c), 4), "unreadable": c.unreadable}
        # published before this process counts from it: a writer that reads this process's
        # ledger counting from this census (what ended before it dropped) finds it in usage.json
        self._publish(rec)
        with self._lock:
            self._usage = rec
            self._trim(c.scan_started, True)
            self._re_anchor()  # the other views count from this census too
        self.last_census = c
        scan = c.scan_finished - c.scan_started
        self._next_census = time.monotonic() + max(self.interval, scan / CENSUS_CPU_SHARE)
        self.evictor_cpu_s += time.thread_time() - cpu0
        # the decision right after a census is the census's alone (the ledgers still count
        # bytes it has seen); a writer's request is honoured
        self._evict_more(why, census_only=True)
        self.censuses += 1
        self.passes += 1

    def _evict_more(self, why: Optional[str], census_only: bool = False) -> None:
        """Evict from the candidates when the estimate passes the high watermark (or a
        request says so), down to the low one, or lower: down to the bound less the
        largest store job seen (this process's, or a requester's ``need``), so that a job
        larger than the band between the watermarks fits after a pass instead of being
        dropped for ever; publish the usage when anything changed."""
        cpu0 = time.thread_time()
        u = self._usage
        if u is None or self._cands is None:
            return
        with self._lock:
            ledgers = 0 if census_only else self._others() + self._own
        est = u["bytes"] + ledgers
        if why == "enospc":  # the filesystem is full at this usage (of bytes or of inodes): the room now
            self._room = min(self._room or est, est)
        mx = self.bound()
        if why == "enospc":
            target = int(self.low * mx)
        elif est > self.marks(mx)[0] or why == "drop":
            target = self.marks(mx)[1]
        else:
            return
        r = self._cands.evict(est, target, keep_going=self._still_evictor)
        freed = r.evicted_bytes
        rec = dict(u, room=self._room, bytes=u["bytes"] - freed, files=u["files"] - len(r.evicted), blocks=u["blocks"] - len(r.evicted),
                   evict_finished=time.time(), evicted=u.get("evicted", 0) + len(r.evicted),
                   evicted_bytes=u.get("evicted_bytes", 0) + r.evicted_bytes)
        with self._lock:
            self._usage = rec
            if r.evicted:
                self._re_anchor()  # the room it freed is the other views' too
        self._publish(rec)
        self.last_pass = r
        self.passes += 1
        self.evictor_cpu_s += time.thread_time() - cpu0
        reason = "enospc" if why == "enospc" else "capacity"
        if r.evicted:
            logger.info("kvtier capacity: evicted %d blocks (%d bytes, %s) of %s: usage %d -> %d bytes, bound %d",
                        len(r.evicted), r.evicted_bytes, why or "high watermark", self.root, r.usage_before,
                        r.usage_after, mx)
            for h in list(self._handles):
                if h.counters is not None:
                    try:
                        h.counters.add(f"evicted_{reason}", len(r.evicted))
                        h.counters.add(f"evicted_bytes_{reason}", r.evicted_bytes)
                    except Exception:
                        logger.exception("counting an eviction failed")
                if h.on_evicted is not None:
                    try:
                        h.on_evicted(list(r.evicted))
                    except Exception:
                        logger.exception("an eviction listener failed")
        if r.usage_after > target and not len(self._cands):
            # no candidate left: a census next, at once, unless what no pass removes holds the
            # usage above the low mark (every pass runs out then): at most CENSUS_CPU_SHARE
            self._next_census = self._early_census_at() if self._kept_over_low else 0.0
            self._request = self._request or "capacity"
        if r.errors:
            logger.warning("kvtier capacity: %d blocks could not be evicted from %s (first: %s: %s)",
                           len(r.errors), self.root, r.errors[0][0], r.errors[0][1])

    def _early_census_at(self) -> float:
        """When a census wanted before its interval may run, by the monotonic clock:
        :data:`CENSUS_CPU_SHARE` of the time at most.  For a writer's request with no
        candidate left, and when the candidates ran out short of the target while files no
        pass removes hold the usage above the low mark (every pass runs out then: censused
        at every 50 ms tick, its evictor took ~65% of a core); else a census follows at once
        (a full filesystem recovering needs it)."""
        last = self.last_census
        if last is None:
            return 0.0
        gap = min((last.scan_finished - last.scan_started) / CENSUS_CPU_SHARE, self.interval)
        return time.monotonic() + max(0.0, gap - (time.time() - last.scan_finished))

    def _publish(self, rec: Dict[str, Any]) -> None:
        """Publish the usage; a failure is a warning at most once a minute (a read-only or
        full ``.kvtier/`` fails every pass: tens a second), with the count since the last.
        Nothing when this process is no longer the evictor (:meth:`_still_evictor`)."""
        if not self._still_evictor():
            return
        try:
            publish_usage(self.root, rec)
        except OSError as e:
            self.publish_failures += 1
            if time.monotonic() - self._publish_warned >= 60.0:
                self._publish_warned = time.monotonic()
                logger.warning("kvtier capacity: cannot publish %s: %s (%d failures so far; this warning at most "
                               "once a minute)", os.path.join(state_dir(self.root), USAGE_FILE), e,
                               self.publish_failures)

    # ------------------------------------------------------------------ tests / tools
    def wait_pass(self, timeout: float = 10.0, after: Optional[int] = None) -> bool:
        """Wait until this process's evictor finished a pass after ``after`` (default: now)."""
        n = self.passes if after is None else after
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.passes > n:
                return True
            time.sleep(0.01)
        return False


def root_capacity(root: str) -> Optional[RootCapacity]:
    """This process's :class:`RootCapacity` of ``root``, if a tier bounds it."""
    with _roots_lock:
        return _roots.get(os.path.realpath(root))
