"""Stale-temp sweep: remove a tier's leftover store temp files.

A store writes ``<dest>_<hex>.tmp`` next to its destination and renames it
onto ``<dest>`` (design.md, "On-disk contract"); a process killed between the
create and the rename (SIGKILL, OOM, power loss) leaves the temp behind. It
never becomes a block (only the rename publishes one) but it holds space. The
sweep removes such temps when they are older than a threshold, so a temp that a
live peer is still writing (its mtime moves with every write) is left alone.

"Older" is judged by the filesystem's own clock, never this host's: the sweep first
creates a probe file in the directory and takes its mtime as "now" (issue #24: a host
whose wall clock is ahead of the filesystem's, an NTP step, a resumed VM, or a node ahead
of a shared filesystem's server, made every temp look old, and a starting tier removed a
temp a live peer was writing). Where no probe file can be made there, nothing is removed.

The startup probes' ``.kvtier_probe_*`` files, left the same way by a kill
during startup, are swept too.

Used by :class:`kvtier.manager.FileSystemTierManager` at startup when
``sweep_stale_temps_after`` is set (default off). It only ever removes regular
files whose name matches :data:`TEMP_NAME_RE`, under the given directory (the
tier's own ``<model>_<digest>_r<rank>`` directory), not following symlinks;
never a ``.bin`` block, a recent temp, or any other file.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import List, Optional, Union

#: Names of this tier's temp files: a store temp ``<hex block hash>.bin_<hex tag>.tmp``
#: (kvtier.io.tmp_path_for: 16 hex chars of tag; vLLM uses the same shape), or a
#: startup probe ``.kvtier_probe_<tag>`` (kvtier.io.probe_o_direct / probe_xattr and
#: the manager's writability check; a kill during startup leaves one).
TEMP_NAME_RE = re.compile(r"^(?:[0-9a-fA-F]+\.bin_[0-9a-fA-F]+\.tmp|\.kvtier_probe_[A-Za-z0-9_]+)\Z")


@dataclass
class SweepResult:
    """What a sweep did.

    ``removed``: paths of the temps removed. ``kept_recent``: temps younger
    than the threshold (left alone). ``errors``: ``(path, OSError)`` for temps
    that could not be removed (the sweep goes on). ``seconds``: wall time.
    """

    removed: List[str] = field(default_factory=list)
    kept_recent: int = 0
    errors: List[tuple] = field(default_factory=list)
    seconds: float = 0.0


MIN_SWEEP_AFTER_S = 60.0
"""The smallest ``sweep_stale_temps_after`` a tier accepts: a peer starting with a
threshold shorter than one store takes deletes live writers' temps (use minutes)."""


def check_older_than(older_than: float, name: str = "older_than", minimum: float = 0.0) -> float:
    """``older_than`` as a float of seconds. TypeError if it is not a real
    number (bool included), ValueError if below ``minimum`` (0; a tier's
    ``sweep_stale_temps_after`` key: :data:`MIN_SWEEP_AFTER_S`), NaN or
    infinite; both name ``name``."""
    if isinstance(older_than, bool) or not isinstance(older_than, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(older_than).__name__}")
    older_than = float(older_than)
    if not (older_than >= minimum) or older_than == float("inf"):
        why = (" (shorter thresholds delete the temps of stores still being written: use minutes)"
               if minimum > 0 else "")
        raise ValueError(f"{name} must be a finite number of seconds >= {minimum:g}{why}, got {older_than!r}")
    return older_than


def check_sweep_after(value: float) -> float:
    """The ``sweep_stale_temps_after`` key of a tier (manager, vLLM tier)."""
    return check_older_than(value, "sweep_stale_temps_after", MIN_SWEEP_AFTER_S)


def filesystem_now(directory: str) -> float:
    """The filesystem's clock at ``directory``: the mtime of a probe file created there
    (then removed; a kill in between leaves a ``.kvtier_probe_sweep_*``, which a later sweep
    removes). OSError if none can be created (a missing directory: ENOENT)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix=".kvtier_probe_sweep_", dir=directory)
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


def sweep_stale_temps(
    directory: Union[str, "os.PathLike[str]"],
    older_than: float,
    now: Optional[float] = None,
) -> SweepResult:
    """Remove store temps under ``directory`` last modified more than
    ``older_than`` seconds before ``now`` (default: :func:`filesystem_now` of
    ``directory``, the filesystem's clock, not this host's: a probe file that cannot be
    made there is recorded in ``errors`` and nothing is removed).

    Walks ``directory`` recursively without following symlinks. A missing
    ``directory`` is an empty sweep. A temp that vanishes meanwhile (a peer
    renamed or removed it) is skipped silently; any other failure to remove
    one is recorded in ``SweepResult.errors``.

    Raises TypeError if ``older_than`` is not a real number, ValueError if it
    is negative or not finite.
    """
    older_than = check_older_than(older_than)
    t0 = time.monotonic()
    res = SweepResult()
    top = os.fspath(directory)
    if now is None:
        try:
            now = filesystem_now(top)
        except FileNotFoundError:
            return res  # a missing directory: an empty sweep
        except OSError as e:  # read-only, full, EACCES ...: no clock to judge by, nothing removed
            res.errors.append((top, e))
            res.seconds = time.monotonic() - t0
            return res
    cutoff = now - older_than

    def onerror(e: OSError) -> None:
        if e.errno != errno.ENOENT:
            res.errors.append((getattr(e, "filename", top), e))

    for dirpath, _dirnames, filenames in os.walk(top, onerror=onerror, followlinks=False):
        for name in filenames:
            if not TEMP_NAME_RE.match(name):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                res.errors.append((path, e))
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_mtime > cutoff:
                res.kept_recent += 1
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                res.errors.append((path, e))
                continue
            res.removed.append(path)
    res.seconds = time.monotonic() - t0
    return res


__all__ = ["SweepResult", "TEMP_NAME_RE", "check_older_than", "filesystem_now", "sweep_stale_temps"]
