"""``kvtier info ROOT``: what a cache root holds and how it is bounded, without a scan.

Everything here is read from what the root already has: its mount (mountinfo, statvfs;
whether a block can be stored there at all: a read-only mount, or ``access(W_OK)`` refused;
whether it has user xattrs: one getxattr on ROOT),
its rank directories (one listing of ROOT), the latest census its evictor published
(``ROOT/.kvtier/usage.json``), the writers' ledgers (``ROOT/.kvtier/writers/``), the evictor
lock's holder (F_GETLK) and its heartbeat (the lock file's record).  Nothing is created,
changed or counted file by file: a fresh count is ``kvtier evict ROOT --max-bytes SIZE
--dry-run`` (docs/capacity.md).
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

from kvtier._tier import capacity as _cap


def root_info(root: str, now: Optional[float] = None) -> Dict[str, Any]:
    """The root section of ``kvtier info ROOT`` as a dict: ``root`` (absolute path),
    ``filesystem`` (mount point, fstype, kind, size, free bytes and inodes, ``read_only``:
    statvfs ``ST_RDONLY``, ``full``: no free block or inode for this process), ``writable``
    (False on a read-only mount or when ``access(W_OK)`` refuses this process: no block can
    be stored there, no tier starts there) and
    ``not_writable`` (why, else None), ``user_xattrs`` (True, False: no checksummed tier
    starts here, or None: not known; :func:`user_xattrs`, one getxattr) and
    ``user_xattrs_why``, ``load_landing`` (what ``auto`` picks here, and why; ``error``:
    a refused ``KVTIER_LOAD_LANDING``, else None), ``rank_dirs`` (the ``<model>_<digest>_r<rank>``
    directories), ``capacity`` (None for a root no evictor has censused, else the latest
    census: used and max bytes, its age, its evictor, the live writers' ledgers, the
    lock's holder and its heartbeat: ``by``, ``seq``, ``age_s`` by the holder's clock).
    OSError (ENOENT / ENOTDIR with the path) when ``root`` is no directory."""
    import errno

    from kvtier._tier import landing
    from kvtier._tier.mountinfo import mount_of
    from kvtier.cli.scrub import capacity_summary

    root = os.path.abspath(root)
    if not os.path.isdir(root):
        e = errno.ENOENT if not os.path.exists(root) else errno.ENOTDIR
        raise OSError(e, os.strerror(e), root)
    st = os.statvfs(root)
    m = mount_of(root)
    read_only = bool(st.f_flag & os.ST_RDONLY)
    fs = {"mount_point": m.mount_point if m else None, "fstype": m.fstype if m else None,
          "kind": m.kind if m else None, "size_bytes": st.f_blocks * st.f_frsize,
          "free_bytes": st.f_bavail * st.f_frsize, "inodes_free": st.f_favail if st.f_files else None,
          "read_only": read_only}
    if read_only:
        at = f" at {m.mount_point}" if m else ""
        not_writable: Optional[str] = f"the filesystem{at} is mounted read-only (statvfs ST_RDONLY)"
    elif not os.access(root, os.W_OK):
        not_writable = f"this process (uid {os.geteuid()}) may not write to it (access W_OK refused)"
    else:
        not_writable = None
    try:
        mode, why = landing.resolve("auto", root)
        load_landing: Dict[str, Any] = {"auto": mode, "why": why, "error": None}
    except ValueError as e:  # a refused KVTIER_LOAD_LANDING: said (kvtier info exits 2), no traceback
        load_landing = {"auto": None, "why": None, "error": str(e)}
    xattrs, xattrs_why = user_xattrs(root, m.fstype if m else None)
    with os.scandir(root) as it:
        ranks = sorted(e.name for e in it if _cap._RANK_RE.match(e.name) and e.is_dir() and e.name != _cap.STATE_DIR)
    c = capacity_summary(root, now)
    if c is not None:
        u = _cap.read_usage(root)  # what the ledgers add to the census published last
        ledgers, live = _cap.read_ledgers(root, now=now, since=float(u["scan_started"]) if u else None,
                                          census_view=_cap.usage_view(u))
        hb = _cap.read_heartbeat(root)
        beat = None if hb is None else {"by": hb["by"], "seq": hb["seq"],
                                        "age_s": (time.time() if now is None else now) - hb["t"]}
        c.update(writers_live=live, writers_bytes=ledgers, lock_holder=_cap.lock_holder(root), heartbeat=beat)
    fs["full"] = st.f_bavail == 0 or (st.f_files > 0 and st.f_favail == 0)  # no block or no inode left
    return {"root": root, "filesystem": fs, "writable": not_writable is None, "not_writable": not_writable,
            "user_xattrs": xattrs, "user_xattrs_why": xattrs_why,
            "load_landing": load_landing, "rank_dirs": ranks, "capacity": c}


def user_xattrs(root: str, fstype: Optional[str] = None) -> "tuple[Optional[bool], Optional[str]]":
    """Whether the filesystem of ``root`` has user xattrs, by one read-only probe: getxattr
    of ``user.vllm.kv_crc32c`` on the root directory itself (nothing created). ENODATA (or
    the value): ``(True, None)``; EOPNOTSUPP (ramfs, tmpfs before Linux 6.6, an NFS server
    without xattrs, a FUSE daemon without them): ``(False, why)``, and a checksummed tier
    (``checksum_blocks=True``, the default) refuses to start there; another errno:
    ``(None, why)``, not known. A filesystem that reads the namespace but refuses to set it
    is found by ``kvtier doctor ROOT`` and by a tier's startup, which set one on a probe file."""
    import errno

    from kvtier._blockio.records import XATTR_NAME

    try:
        os.getxattr(root, XATTR_NAME)
    except OSError as e:
        if e.errno == errno.ENODATA:
            return True, None
        fs = f"{fstype} at " if fstype else ""
        if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            return False, f"the filesystem ({fs}{root}) has no user xattrs (getxattr: {e.strerror})"
        return None, f"getxattr of {XATTR_NAME} on {root}: {e.strerror}"
    return True, None


def print_root_info(d: Dict[str, Any]) -> None:
    """Print :func:`root_info`'s dict as the text lines of ``kvtier info ROOT``."""
    from kvtier.cli._text import human_bytes
    from kvtier.cli.scrub import census_age_text, usage_text

    fs = d["filesystem"]
    print(f"Root:           {d['root']}")
    where = f"{fs['fstype']} ({fs['kind']}) at {fs['mount_point']}" if fs["fstype"] else "mount unknown"
    inodes = "" if fs["inodes_free"] is None else f", {fs['inodes_free']:,} inodes free"
    print(f"  filesystem:   {where}: {human_bytes(fs['size_bytes'])}, {human_bytes(fs['free_bytes'])} free{inodes}")
    if d["writable"] and fs.get("full"):
        print("  writable:     yes, but the filesystem is full (no free block or inode): every store fails with "
              "ENOSPC until room is made; a tier still starts and loads the blocks it has")
    elif d["writable"]:
        print("  writable:     yes")
    else:
        print(f"  writable:     NO: {d['not_writable']}: no block can be stored here and no tier starts here "
              f"(its startup writes a probe file)")
    x = d["user_xattrs"]
    if x is True:
        print("  user xattrs:  yes")
    elif x is False:
        print(f"  user xattrs:  NO: {d['user_xattrs_why']}: a checksummed tier (checksum_blocks=True, the default) "
              f"cannot start here, only checksum_blocks=False (blocks unverified)")
    else:
        print(f"  user xattrs:  unknown ({d['user_xattrs_why']}); `kvtier doctor ROOT` sets one to see")
    ll = d["load_landing"]
    if ll.get("error"):
        print(f"  load landing: error: {ll['error']}")
    else:
        print(f"  load landing: auto -> {ll['auto']} ({ll['why']})")
    r = d["rank_dirs"]
    print(f"  rank dirs:    {len(r)}" + (f" ({', '.join(r[:4])}{', ...' if len(r) > 4 else ''})" if r else
                                         " (no <model>_<digest>_r<rank> directory: no cache here yet)"))
    c = d["capacity"]
    if c is None:
        print("  capacity:     unbounded (no census in .kvtier/usage.json: no tier with max_bytes has run "
              "here); count it with `kvtier evict ROOT --max-bytes SIZE --dry-run`")
        return
    counts = "".join(f", {c[k]:,} {k}" for k in ("files", "blocks") if isinstance(c.get(k), int))
    print(f"  capacity:     {usage_text(c)}{counts} at the latest census ({census_age_text(c)})")
    holder = "free (no evictor runs now)" if c["lock_holder"] is None else f"held by pid {c['lock_holder']}"
    hb = c["heartbeat"]
    if c["lock_holder"] is not None and hb is not None:
        holder += f" (heartbeat {hb['age_s']:.0f} s old, by {hb['by']})"
    print(f"  writers:      {c['writers_live']} live, {c['writers_bytes']:,} bytes stored since their "
          f"ledgers' census; evictor lock {holder}")
