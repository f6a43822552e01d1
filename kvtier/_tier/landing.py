"""Where a load's bytes land (``kvtier.io.batch_load_block(landing=)``), chosen per tier root.

    from kvtier._tier.landing import resolve
    mode, why = resolve("auto", "/mnt/cache")   # ("direct", "ext4: a local filesystem ...")

Two modes, both keeping the deadline guarantee (no byte enters a caller's row after its
job was reported, docs/tier.md), at different prices (docs/block_io.md "Load landing"):

- ``"bounce"``: every load under a deadline is read into private memory and copied into the
  row in commit sections. A read that hangs forever (a FUSE daemon, an NFS server gone)
  only ever writes private memory: the job is reported at its deadline. Costs one copy of
  every byte loaded (the fused copy + CRC: with checksums the copy is the verify pass).
- ``"direct"``: an O_DIRECT block (page-aligned row) and an unchecksummed buffered one
  are read straight into the row, checksummed there, the read inside one commit section:
  a job expired meanwhile is reported only once its read returned (``JobState.expire``
  waits for a load's section). No copy; but a read that never returns would hold the
  report, so only where the kernel bounds the I/O: a local disk or memory.

``auto`` (the default) takes ``direct`` for the filesystems in :data:`BOUNDED` and
``bounce`` for everything else (FUSE, NFS, GlusterFS, MooseFS, Lustre, CephFS, BeeGFS,
SMB, unknown). The tier key ``load_landing`` (``auto``, ``direct``, ``bounce``) decides;
when it is ``auto``, the environment variable ``KVTIER_LOAD_LANDING`` (same words) may
force a mode for every tier of the process.
"""
from __future__ import annotations

import os
from typing import Tuple

MODES = ("auto", "direct", "bounce")
ENV = "KVTIER_LOAD_LANDING"

BOUNDED = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs", "tmpfs", "ramfs"})
"""Local filesystems on a block device (or memory): the kernel's block layer bounds a
read's time (device timeouts, then an error), so waiting for it cannot hang a report."""


def check_mode(value, what: str = "load_landing") -> str:
    """``value`` if it is one of :data:`MODES`, else ValueError naming ``what``."""
    if value not in MODES:
        raise ValueError(f"{what} must be one of {', '.join(MODES)}, not {value!r}")
    return value


def env_mode() -> str:
    """``KVTIER_LOAD_LANDING`` as a mode (case and spaces ignored; ``""`` when unset or
    empty). ValueError naming it for a value not in :data:`MODES`: a shell checks it with
    its keys, before any filesystem access (:class:`kvtier._tier.config.TierConfig`)."""
    env = os.environ.get(ENV, "").strip().lower()
    return check_mode(env, ENV) if env else ""


def resolve(setting: str, root: "str | os.PathLike") -> Tuple[str, str]:
    """``(mode, why)``: ``"direct"`` or ``"bounce"`` for loads of the tier at ``root``,
    from the tier key ``setting`` (``auto``, ``direct``, ``bounce``), then
    ``KVTIER_LOAD_LANDING`` when the key is ``auto``, then the mount's class.
    ValueError for a value not in :data:`MODES`."""
    check_mode(setting)
    if setting != "auto":
        return setting, f"load_landing={setting}"
    env = env_mode()
    if env and env != "auto":
        return env, f"{ENV}={env}"
    from kvtier._tier.mountinfo import mount_of

    m = mount_of(root)
    if m is None:
        return "bounce", "mount unknown (mountinfo unreadable)"
    if m.kind in BOUNDED:
        return "direct", f"{m.fstype}: a local filesystem, the kernel bounds its reads"
    return "bounce", f"{m.fstype} ({m.kind}): a read may hang, loads land in private memory first"
