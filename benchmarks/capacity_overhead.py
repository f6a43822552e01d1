#!/usr/bin/env python3
"""What a capacity bound costs the I/O: store and load throughput and CPU with ``max_bytes`` on
(a full root, its evictor evicting during the stores) against the same tier unbounded
(issue 22's target: bound on >= 0.97 x off).

    python benchmarks/capacity_overhead.py                        # /var/tmp, 256 KiB and 2 MiB blocks
    python benchmarks/capacity_overhead.py --root /mnt/nvme --sizes 2M --rounds 20

Two tiers (FileSystemTierManager, checksums on, O_DIRECT where the root allows it, 16 read
+ 16 write threads), each on its own root under ``--root``: ``off`` without a bound, ``on``
with ``max_bytes`` = 20 cells (a cell: ``--jobs`` jobs of ``--blocks-per-job`` blocks; the
band between the high watermark and the bound holds one cell, so no store is dropped) and
a census interval of an hour. Before each round the bounded root is topped up with filler
block files (allocated with posix_fallocate, older mtimes than anything stored, named as
blocks of its layout, so the evictor evicts them first) to the high watermark less half a
cell, and a census is made (its candidates: the filler and the older stores), outside the
timing: no census runs in a timed pass, as on a large root whose census interval is long. So each store pass crosses the high watermark halfway and
the evictor (a thread of the same process) evicts down to the low one while the stores run:
its CPU, its unlinks and its stamps are inside the bounded tier's numbers. Per round, in a
shuffled order (seeded): the tier stores one cell of fresh keys (submit all jobs, drain),
then loads them back into a zeroed buffer; every loaded byte is compared with what was
stored. The unbounded root keeps what it stored (it grows by a cell a round, as an
unbounded cache does; removing its files between rounds would make its stores create the
shard directories the bounded root keeps).
Reported per mode: median wall time and GB/s of the stores and the loads (submit ..
drained), process CPU (all threads: the pool, the evictor; from the submit until the
evictor made no pass for 0.25 s, or 0.25 s after the drain unbounded) per GiB moved, the spread (min-max), on / off ratios,
and what the evictor did (blocks evicted, passes, dropped stores: a dropped store fails
the round's load of its blocks, which is counted, not timed away).
"""
from __future__ import annotations

import argparse
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from kvtier._tier import capacity as cap
from kvtier.manager import FileSystemTierManager, TransferJob, filesystem_type

GiB = 1 << 30


def parse_size(s: str) -> int:
    return cap.parse_size(s, "--sizes")


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def settle(mgr, quiet_s=0.25):
    """Wait (asleep: no CPU of this thread) until a bounded tier's evictor made no pass
    for ``quiet_s`` (the eviction a store pass asked for is done: it must not run into the
    other mode's next pass in this process), or ``quiet_s`` for an unbounded one."""
    rc = cap.root_capacity(mgr.root_dir)
    if rc is None:
        time.sleep(quiet_s)
        return
    end = time.monotonic() + 30
    while time.monotonic() < end:
        n = rc.passes
        time.sleep(quiet_s)
        if rc.passes == n:
            return


def one_pass(mgr, op, keys, per_job, job_base):
    """``(wall, cpu, cpu_settled, blocks failed)``: wall time of the jobs (submit ..
    drained), the process CPU (every thread) over it, and until the tier settled after
    them (:func:`settle`: the eviction the pass asked for is in it)."""
    jobs = [TransferJob(job_base + j, keys[j * per_job:(j + 1) * per_job], list(range(j * per_job, (j + 1) * per_job)))
            for j in range(len(keys) // per_job)]
    submit = mgr.submit_load if op == "load" else mgr.submit_store
    c0, t0 = time.process_time(), time.perf_counter()
    for j in jobs:
        submit(j)
    assert mgr.drain_jobs(timeout=600)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    settle(mgr)
    cpu_settled = time.process_time() - c0
    failed = sum(per_job - len(r.successful_keys) for r in mgr.get_finished_jobs())
    return wall, cpu, cpu_settled, failed


def top_up(mgr, bs: int, target: int) -> int:
    """Filler block files in ``mgr``'s rank directory until its root's usage reaches
    ``target`` bytes, then a census (it has the filler as eviction candidates, oldest
    first); returns the files made.  Their mtimes are an hour old and older."""
    rc = cap.root_capacity(mgr.root_dir)
    n = max(0, (target - rc.estimate()) // bs)
    old = time.time() - 3600
    for i in range(n):
        p = mgr.file_mapper.get_file_name((secrets.token_bytes(16), 0))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.posix_fallocate(fd, 0, bs)
        finally:
            os.close(fd)
        os.utime(p, (old - i, old - i))
    filled = time.time()
    rc._next_census = 0.0  # (private) a census now: the tier's interval is an hour, none runs in the passes
    rc._wake.set()
    end = time.monotonic() + 30
    while rc.last_census is None or rc.last_census.scan_started <= filled or rc.passes == 0:
        assert time.monotonic() < end, "no census after the top-up"
        time.sleep(0.02)
    settle(mgr)
    return n


def run_size(args, base: str, bs: int) -> dict:
    per_job, n_jobs = args.blocks_per_job, args.jobs
    n = per_job * n_jobs
    cell = n * bs
    bound = 20 * cell
    rng = np.random.default_rng(bs)
    src = np.frombuffer(rng.bytes(n * bs), dtype=np.uint8).reshape(n, bs)
    buf = np.zeros_like(src)
    kw = dict(block_size=bs, n_read_threads=args.threads, n_write_threads=args.threads, checksum_blocks=True,
              use_o_direct=not args.no_o_direct)
    mgrs = {"off": FileSystemTierManager(buf, os.path.join(base, f"off_{bs}"), "bench/cap", **kw),
            "on": FileSystemTierManager(buf, os.path.join(base, f"on_{bs}"), "bench/cap", max_bytes=bound,
                                        census_interval_s=3600, **kw)}
    rc = cap.root_capacity(mgrs["on"].root_dir)
    high, low = rc.marks(bound)
    res = {m: {k: [] for k in ("store", "load", "store_cpu", "load_cpu", "store_cpu_settled", "load_cpu_settled")}
           for m in mgrs}
    filler = mism = lost = 0
    evicted = lambda: mgrs["on"].metrics.counters.snapshot().get("evicted_capacity", 0)  # noqa: E731
    ev0, ecpu0, cen0 = evicted(), rc.evictor_cpu_s, rc.censuses
    order_rng = random.Random(args.seed)
    job_base = 0
    try:
        for rnd in range(args.rounds + 1):  # round 0 warms up, not counted
            filler += top_up(mgrs["on"], bs, high - cell // 2)
            if rnd == 1:
                ev0, ecpu0, cen0 = evicted(), rc.evictor_cpu_s, rc.censuses
            modes = list(mgrs)
            order_rng.shuffle(modes)
            for m in modes:
                mgr = mgrs[m]
                keys = [(secrets.token_bytes(16), 0) for _ in range(n)]
                buf[:] = src
                store = one_pass(mgr, "store", keys, per_job, job_base)
                job_base += n_jobs
                buf[:] = 0
                load = one_pass(mgr, "load", keys, per_job, job_base)
                job_base += n_jobs
                if load[3] == 0:
                    mism += int(np.count_nonzero(buf != src))
                lost += store[3] + load[3]
                if rnd:
                    for op, r in (("store", store), ("load", load)):
                        res[m][op].append(r[0])
                        res[m][op + "_cpu"].append(r[1])
                        res[m][op + "_cpu_settled"].append(r[2])
        usage = cap.read_usage(mgrs["on"].root_dir)
        ecpu, cens = rc.evictor_cpu_s - ecpu0, rc.censuses - cen0
    finally:
        for mgr in mgrs.values():
            mgr.shutdown()
    return {"bs": bs, "cell": cell, "bound": bound, "res": res, "mismatched": mism, "failed_blocks": lost,
            "filler": filler, "evicted": evicted() - ev0, "evictor_cpu_s": ecpu, "censuses": cens,
            "usage_end": usage["bytes"] if usage else None, "high": high, "low": low}


def report(d: dict, rounds: int) -> None:
    cell = d["cell"]
    print(f"\n## {fmt_size(d['bs'])} blocks: cell {cell >> 20} MiB, max_bytes {d['bound'] >> 20} MiB "
          f"(high {d['high'] >> 20}, low {d['low'] >> 20} MiB), {rounds} rounds")
    print("| mode | store ms median [min-max] | store GB/s | store CPU s/GiB: pass, settled | "
          "load ms median [min-max] | load GB/s | load CPU s/GiB: pass, settled |")
    print("|---|---|---|---|---|---|---|")
    med = {}
    for m, r in d["res"].items():
        row = [m]
        for op in ("store", "load"):
            ws, cs, ss = r[op], r[op + "_cpu"], r[op + "_cpu_settled"]
            mw, mc, ms = statistics.median(ws), statistics.median(cs), statistics.median(ss)
            med[m, op], med[m, op + "_cpu"], med[m, op + "_cpu_settled"] = mw, mc, ms
            row += [f"{mw * 1e3:.1f} [{min(ws) * 1e3:.1f}-{max(ws) * 1e3:.1f}]", f"{cell / mw / 1e9:.2f}",
                    f"{mc / (cell / GiB):.3f}, {ms / (cell / GiB):.3f}"]
        print("| " + " | ".join(row) + " |")
    on, off = d["res"]["on"], d["res"]["off"]
    paired = {k: statistics.median(b / a for a, b in zip(on[k], off[k])) for k in ("store", "load")}
    print(f"on / off throughput: store {med['off', 'store'] / med['on', 'store']:.3f} (paired median "
          f"{paired['store']:.3f}), load {med['off', 'load'] / med['on', 'load']:.3f} (paired {paired['load']:.3f}); "
          f"CPU per GiB on / off (pass, settled): store {med['on', 'store_cpu'] / med['off', 'store_cpu']:.3f}, "
          f"{med['on', 'store_cpu_settled'] / med['off', 'store_cpu_settled']:.3f}; load "
          f"{med['on', 'load_cpu'] / med['off', 'load_cpu']:.3f}, "
          f"{med['on', 'load_cpu_settled'] / med['off', 'load_cpu_settled']:.3f} (medians; paired: the ratio in each "
          f"round)")
    per = d["evictor_cpu_s"] / d["evicted"] * 1e6 if d["evicted"] else float("nan")
    print(f"evictor: {d['evicted']} blocks evicted ({d['filler']} filler files made), its thread's CPU "
          f"{d['evictor_cpu_s']:.3f} s ({per:.1f} us per evicted block, its {d['censuses']} censuses included), "
          f"usage at the end "
          f"{(d['usage_end'] or 0) >> 20} MiB; blocks not stored or not loaded: {d['failed_blocks']}; "
          f"mismatched bytes: {d['mismatched']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/var/tmp", help="directory for the two roots (default /var/tmp)")
    p.add_argument("--sizes", default="256K,2M", help="block sizes (default 256K,2M)")
    p.add_argument("--jobs", type=int, default=16, help="jobs per pass (default 16)")
    p.add_argument("--blocks-per-job", type=int, default=4, help="blocks per job (default 4)")
    p.add_argument("--threads", type=int, default=16, help="read and write threads each (default 16)")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (default 12)")
    p.add_argument("--no-o-direct", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="kvtier-capoverhead-", dir=args.root)
    fstype, _ = filesystem_type(base)
    print(f"capacity_overhead: {base} ({fstype}), checksums on, {args.threads} + {args.threads} threads, "
          f"{args.jobs} jobs x {args.blocks_per_job} blocks per pass; load average {os.getloadavg()[0]:.1f}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    bad = 0
    try:
        for s in args.sizes.split(","):
            d = run_size(args, base, parse_size(s))
            report(d, args.rounds)
            bad += d["mismatched"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
