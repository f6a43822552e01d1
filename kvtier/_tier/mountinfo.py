"""The mount holding a path, from ``/proc/self/mountinfo`` (proc(5)).

    m = mount_of("/mnt/cache")
    m.fstype, m.source, m.mount_point, m.options, m.super_options, m.kind

``kind`` names the filesystem kvtier's advice is keyed by: ``"glusterfs"``, ``"moosefs"``,
``"nfs"``, ``"lustre"``, ``"cephfs"``, ``"beegfs"``, ``"fuse"`` (another FUSE daemon), else
the fstype (``"ext4"``, ``"xfs"``, ``"tmpfs"``...). A FUSE mount shows only ``fuse`` or
``fuse.<name>`` as its type; MooseFS's mfsmount shows ``fuse`` with source ``mfs#HOST:PORT``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Tuple


def _unescape(s: str) -> str:
    """mountinfo's octal escapes (``\\040`` space, ``\\043`` '#', ``\\134`` backslash...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo: ``options`` are the per-mount options (field 6),
    ``super_options`` the filesystem's (the last field), both as comma-separated text."""

    mount_id: int
    mount_point: str
    fstype: str
    source: str
    options: str
    super_options: str

    @property
    def kind(self) -> str:
        t = self.fstype
        if t in ("fuse.glusterfs", "glusterfs"):
            return "glusterfs"
        if t in ("fuse.mfs", "fuse.mfsmount") or (t.startswith("fuse") and self.source.startswith("mfs#")):
            return "moosefs"
        if t in ("nfs", "nfs4"):
            return "nfs"
        if t == "lustre":
            return "lustre"
        if t in ("ceph", "fuse.ceph-fuse", "fuse.ceph"):
            return "cephfs"
        if t == "beegfs":
            return "beegfs"
        if t == "fuse" or t.startswith("fuse.") or t == "fuseblk":
            return "fuse"
        return t

    def option(self, name: str) -> Optional[str]:
        """Value of mount or superblock option ``name`` ("" for a flag), None if absent."""
        for part in f"{self.options},{self.super_options}".split(","):
            k, _, v = part.partition("=")
            if k == name:
                return v
        return None


def mount_of(path: "str | os.PathLike") -> Optional[MountEntry]:
    """The mount whose mount point is the longest prefix of ``realpath(path)`` (later
    entries win on ties: over-mounts), or None if mountinfo cannot be read."""
    real = os.path.realpath(os.fspath(path))
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: Tuple[int, Optional[MountEntry]] = (-1, None)
    for line in lines:
        parts = line.split(" ")
        try:
            sep = parts.index("-")
        except ValueError:
            continue
        if len(parts) < sep + 4 or sep < 6:
            continue
        mnt = _unescape(parts[4])
        if mnt == "/" or real == mnt or real.startswith(mnt.rstrip("/") + "/"):
            if len(mnt) >= best[0]:
                best = (len(mnt), MountEntry(int(parts[0]), mnt, parts[sep + 1], _unescape(parts[sep + 2]),
                                             parts[5], parts[sep + 3]))
    return best[1]
