"""``kvtier evict ROOT --max-bytes SIZE [--evict-high F] [--evict-low F] [--force] [--dry-run] [--json]``:
one capacity pass of a cache root by hand (docs/capacity.md).

A census of the whole root (allocated bytes of every regular file under it) and, when it
passes ``--evict-high`` of the bound, an eviction of the oldest blocks (mtime, chain heads
newest) down to ``--evict-low``: the policy and the evictor lock of the tiers
(:mod:`kvtier._tier.capacity`), so it never runs beside a live evictor of the root.
``--dry-run`` deletes nothing, takes no lock and lists what would go. A real run publishes
its census to ``ROOT/.kvtier/usage.json`` as a tier's evictor does.

Exit status: 0 done; 1 another process holds the evictor lock (it enforces its own bound),
an eviction failed, part of the root could not be read (EACCES, EIO: the census is low by
it; the pass still ran), ``.kvtier/`` cannot be used (the lock opened, the census
published), or the lock was taken over during the pass (this process was stopped longer
than the tiers' ``takeover_s``); 2 bad arguments, among them a ROOT that does not exist,
is no directory or cannot be read, a ROOT that holds no cache (no ``.kvtier/``, no
``<model>_<digest>_r<rank>/``: a mistyped path; a real run refuses it, ``--dry-run``
censuses it; ``kvtier scrub`` says 2 of it too) and a ``--max-bytes`` that holds no block: less than one block plus the root's own files, the
block of the largest size a ``<model>_<digest>/kvtier.json`` of the root records (a tier of
that size refuses such a bound too), 36 KiB where none records one (vLLM's ``"fs"`` tier).
Every failure says why on stderr; with ``--json`` stdout has a JSON object whatever the exit
status: the pass's report with ``"error"`` (None, or why it exits 1) and ``"exit_status"``,
or, when no pass ran, ``{"root", "error", "exit_status"}`` (argparse's own usage errors
excepted: exit 2 before the command runs).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from kvtier._tier import capacity as _cap
from kvtier.cli._text import EXIT_USAGE, dir_error, human_bytes
from kvtier.file_mapper import root_block_sizes


def _looks_like_a_root(root: str) -> bool:
    """``root`` holds ``.kvtier/`` or a rank directory of a cache layout (kvtier's or
    vLLM's ``"fs"`` tier: ``<model>_<digest>_r<rank>``, or a symlink to one).  OSError
    when ``root`` cannot be listed."""
    with os.scandir(root) as it:
        return any((e.name == _cap.STATE_DIR and e.is_dir(follow_symlinks=False))
                   or (_cap._RANK_RE.match(e.name) and e.is_dir()) for e in it)


def cmd_evict(args: argparse.Namespace) -> int:
    """``kvtier evict ROOT --max-bytes SIZE [--dry-run] [--json]``: one census and eviction
    pass by hand, with the tiers' policy and lock.  Without ``--dry-run`` it takes the
    evictor lock (exit 1 when a live process holds it: that one enforces its bound);
    ``--dry-run`` deletes nothing and needs no lock.  Exit 0, 1 (lock held, part of the root
    unreadable), 2 (bad arguments; ROOT missing, no directory, unreadable or no cache root:
    as ``kvtier scrub``)."""
    root = os.path.abspath(args.root)

    def fail(msg: str, rc: int) -> int:
        """The message on stderr; with --json also ``{"root", "error", "exit_status"}`` on
        stdout (a reader of the JSON gets an object whatever happened). Returns ``rc``."""
        print(f"kvtier evict: {msg}", file=sys.stderr)
        if args.json:
            print(json.dumps({"root": root, "error": msg, "exit_status": rc}, indent=2))
        return rc

    try:  # the arguments first: a bad one is exit 2 whatever the root (a percentage needs the root: below)
        cfg = _cap.check_config(args.max_bytes, args.evict_high, args.evict_low)
    except (TypeError, ValueError) as e:
        return fail(str(e), EXIT_USAGE)
    err = dir_error(args.root)
    if err is not None:
        return fail(err, EXIT_USAGE)
    try:
        bound = cfg.bound(root)  # type: ignore[union-attr]
    except (TypeError, ValueError) as e:
        return fail(str(e), EXIT_USAGE)
    try:  # the block size each layout's kvtier.json records (vLLM's "fs" tier records none)
        sizes = root_block_sizes(root)
    except OSError:
        sizes = {}  # unreadable: said below
    if sizes:  # the largest: a bound must hold one block of each layout, as each layout's tier requires
        layout, bs = max(sizes.items(), key=lambda kv: (kv[1], kv[0]))
        least = _cap.least_bound(bs)
    else:
        least = _cap.least_bound(_cap.ALLOC_UNIT)  # what a tier of the smallest block accepts (capacity.attach)
    if bound < least:  # "--max-bytes 500" meant as 500G would evict every block
        if sizes:
            return fail(f"--max-bytes {args.max_bytes} is {bound} bytes: less than one block plus the root's "
                        f"own files: the root's blocks are {bs} bytes ({human_bytes(bs)}, {layout}/kvtier.json), the "
                        f"smallest bound that holds one is {least} bytes ({human_bytes(least)}; a tier of that block "
                        f"size refuses less too): nothing done", EXIT_USAGE)
        return fail(f"--max-bytes {args.max_bytes} is {bound} bytes: less than one block plus the root's "
                    f"own files ({least} bytes at least; a tier refuses such a bound too): nothing done", EXIT_USAGE)
    lock = None
    published = True
    problems = []  # what made a pass that ran exit 1: on stderr, and the JSON's "error"
    try:
        is_root = _looks_like_a_root(root)
    except OSError as e:  # unreadable (EACCES): say so, not "no cache" or "0 bytes"
        return fail(str(e), EXIT_USAGE)
    if not args.dry_run and not is_root:
        return fail(f"{root} is no cache root (no .kvtier/ and no <model>_<digest>_r<rank>/ directory in it): "
                    f"nothing done (a typo would make .kvtier/ there and scan the whole tree)", EXIT_USAGE)
    if not args.dry_run:
        try:
            os.makedirs(os.path.join(_cap.state_dir(root), _cap.WRITERS_DIR), exist_ok=True)
        except OSError as e:
            return fail(str(e), 1)
        if _cap.root_capacity(root) is not None:
            return fail("a tier of this process bounds this root", 1)
        lock = _cap.EvictorLock(root)
        try:
            got = lock.try_acquire()
        except OSError as e:  # .kvtier read-only, evictor.lock not a file ...
            lock.release()
            return fail(f"cannot take the evictor lock of {root}: {e}; nothing done", 1)
        if not got:
            u, hb = _cap.read_usage(root) or {}, _cap.read_heartbeat(root)
            beat = "" if hb is None else f"; heartbeat {time.time() - hb['t']:.0f} s old by {hb['by']}, seq {hb['seq']}"
            holder = _cap.lock_holder(root)
            lock.release()
            return fail(f"another process holds the evictor lock of {root} (pid {holder} by F_GETLK{beat}; latest "
                        f"census by {u.get('evictor', '?')}): it enforces its own bound; nothing done", 1)
    try:
        u = _cap.read_usage(root) or {}
        gen = int(u.get("generation", 0)) + 1
        c, r, rec = _cap.one_pass(root, bound, cfg.evict_high, cfg.evict_low, dry_run=args.dry_run,  # type: ignore
                                  force="drop" if args.force else None, generation=gen,
                                  evictor=f"{socket.gethostname()}:{os.getpid()}", lock=lock,
                                  view=_cap.view_of(*_cap._host_identity()[:2], os.stat(root).st_dev))
        if lock is not None and not lock.still_held():
            problems.append(f"the evictor lock of {root} was taken over during the pass (this process was "
                            f"stopped for more than the tiers' takeover_s?): census not published")
            published = False
        elif not args.dry_run:
            try:
                _cap.publish_usage(root, rec)
            except OSError as e:  # the eviction is done; the tiers census again themselves
                problems.append(f"cannot publish the census: {e}")
                published = False
    finally:
        if lock is not None:
            lock.release()
    room = rec.get("room")
    mx = bound if room is None else min(bound, room)  # the bound in force (one_pass's)
    out = {"root": root, "max_bytes": bound, "bound": mx, "room": room,
           "high_bytes": int(cfg.evict_high * mx),  # type: ignore
           "low_bytes": int(cfg.evict_low * mx), "dry_run": bool(args.dry_run),  # type: ignore
           "census": {"bytes": c.bytes, "files": c.files, "blocks": c.blocks, "block_bytes": c.block_bytes,
                      "dirs": c.dirs, "seconds": round(c.scan_finished - c.scan_started, 6),
                      "cpu_s": round(c.cpu_s, 6)},
           "evicted": len(r.evicted), "evicted_bytes": r.evicted_bytes, "skipped": r.skipped,
           "errors": [f"{p}: {e}" for p, e in r.errors], "dirs_removed": r.dirs_removed,
           "usage_after": r.usage_after, "unreadable": c.unreadable,
           "unreadable_first": f"{c.first_error[0]}: {c.first_error[1]}" if c.first_error else None}
    if r.errors:
        problems.append(f"{len(r.errors)} eviction(s) failed, the first: {out['errors'][0]}")
    if c.unreadable:  # the count is low by what was not read: an error, as du says it
        problems.append(c.error_text())
    rc = 1 if r.errors or c.unreadable or not published else 0
    out["error"] = "; ".join(problems) or None
    out["exit_status"] = rc
    if args.json:
        out["paths"] = r.evicted
        print(json.dumps(out, indent=2))
    else:
        verb = "would evict" if args.dry_run else "evicted"
        less = f" (the filesystem's room: --max-bytes {bound} is more)" if mx < bound else ""
        print(f"{root}: {c.bytes} bytes in {c.files} files ({c.blocks} blocks, {c.block_bytes} bytes); bound "
              f"{mx}{less} (high {out['high_bytes']}, low {out['low_bytes']})")
        print(f"{verb} {len(r.evicted)} blocks, {r.evicted_bytes} bytes; usage after: {r.usage_after} bytes"
              f"{f'; {len(r.errors)} errors' if r.errors else ''}")
    for msg in problems:
        print(f"kvtier evict: {msg}", file=sys.stderr)
    return rc


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``kvtier evict`` on the ``kvtier`` subparsers."""
    from kvtier.cli._text import plain_text

    p = sub.add_parser("evict", help="one capacity census + eviction pass of a cache root (docs/capacity.md)",
                       description=plain_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", metavar="ROOT", help="the tier root (the whole root is counted)")
    p.add_argument("--max-bytes", required=True, metavar="SIZE",
                   help="the bound: bytes, 500G / 1.5T / 64M (powers of 1024), or 90%% of the filesystem")
    p.add_argument("--evict-high", type=float, default=_cap.DEFAULT_HIGH, help="evict above this fraction (0.95)")
    p.add_argument("--evict-low", type=float, default=_cap.DEFAULT_LOW, help="down to this fraction (0.85)")
    p.add_argument("--force", action="store_true", help="evict down to the low watermark even below the high one")
    p.add_argument("--dry-run", action="store_true", help="delete nothing; list what would be evicted")
    p.add_argument("--json", action="store_true", help="print a JSON object (with the paths)")
    p.set_defaults(func=cmd_evict)
    return p
