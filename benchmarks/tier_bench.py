#!/usr/bin/env python3
"""Tier pool benchmark: FileSystemTierManager end to end, checksum off -> on.

For each block size (256 KiB .. 16 MiB) and number of jobs in flight (1, 4, 16, 64):
N jobs of B blocks each are submitted at once to one tier (16 read + 16 write threads
by default) and the wall time until the last job finished is measured, for stores and
then loads, with checksums off and on (runs interleaved, alternating which mode goes first), plus the process CPU time
(user+sys of all threads, ``time.process_time``).  Medians of ``--repeat`` runs.  Every
loaded byte is compared with what was stored.  The table has the layout of the pool
table in vLLM PR #57912 (median e2e ms off -> on, CPU ms), with on/off ratios.

Bytes per cell are capped (``--cap-mib``, default 256 MiB): the blocks per job are
reduced (down to 1) so that jobs x blocks x block size stays under the cap; a cell whose
jobs alone exceed it (16 MiB x 64 jobs = 1 GiB) runs one block per job.

    python benchmarks/tier_bench.py                 # full grid, a few minutes here
    python benchmarks/tier_bench.py --quick         # 256 KiB and 1 MiB, 1/4/16 jobs
    python benchmarks/tier_bench.py --root /mnt/nvme --cap-mib 4096 --repeat 10   # like the PR
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import kvtier
import kvtier.io as kio
from kvtier.manager import FileSystemTierManager, TransferJob, filesystem_type

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    if s and s[-1] in UNITS:
        return int(float(s[:-1]) * UNITS[s[-1]])
    return int(s)


def fmt_size(n: int) -> str:
    for u, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {u}"
    return f"{n} B"


def one_pass(mgr, op, keys, slots, n_jobs, per_job, job_base):
    jobs = [TransferJob(job_base + j, keys[j * per_job:(j + 1) * per_job], slots[j * per_job:(j + 1) * per_job])
            for j in range(n_jobs)]
    submit = mgr.submit_load if op == "load" else mgr.submit_store
    c0, t0 = time.process_time(), time.perf_counter()
    for j in jobs:
        submit(j)
    assert mgr.drain_jobs(timeout=3600)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    res = mgr.get_finished_jobs()
    failed = [r for r in res if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} {op} jobs failed, first: {failed[0].error}")
    return wall, cpu


def run(args) -> dict:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    jobs_list = [int(j) for j in args.jobs.split(",")]
    cap = args.cap_mib << 20
    base = tempfile.mkdtemp(prefix="kvtier-tierbench-", dir=args.root)
    fstype, _ = filesystem_type(base)
    rows = []
    o_direct = None
    mismatched = 0
    cells = [(bs, nj) for bs in sizes for nj in jobs_list]
    try:
        for bs in sizes:
            plan = {nj: max(1, min(args.blocks_per_job, cap // (bs * nj))) for nj in jobs_list}
            nblocks = max(nj * plan[nj] for nj in jobs_list)
            rng = np.random.default_rng(bs)
            src = np.frombuffer(rng.bytes(nblocks * bs), dtype=np.uint8).reshape(nblocks, bs)
            buf = src.copy()
            mgrs = {}
            for ck in (False, True):
                mgrs[ck] = FileSystemTierManager(
                    buf, os.path.join(base, f"{bs}_{int(ck)}"), "bench/tier", block_size=bs,
                    n_read_threads=args.threads, n_write_threads=args.threads, checksum_blocks=ck,
                    use_o_direct=not args.no_o_direct, durable=args.durable)
            o_direct = all(m.use_o_direct for m in mgrs.values())
            job_base = 0
            try:
                for nj in jobs_list:
                    per_job = plan[nj]
                    n = nj * per_job
                    slots = list(range(n))
                    t = {(op, ck): [] for op in ("store", "load") for ck in (False, True)}
                    c = {(op, ck): [] for op in ("store", "load") for ck in (False, True)}
                    for rep in range(args.repeat):
                        keys = [(secrets.token_bytes(16), 0) for _ in range(n)]
                        # interleaved, and alternating which mode goes first
                        order = (False, True) if rep % 2 == 0 else (True, False)
                        for ck in order:
                            buf[:n] = src[:n]
                            w, cpu = one_pass(mgrs[ck], "store", keys, slots, nj, per_job, job_base)
                            job_base += nj
                            t["store", ck].append(w)
                            c["store", ck].append(cpu)
                        for ck in order:
                            buf[:n] = 0
                            w, cpu = one_pass(mgrs[ck], "load", keys, slots, nj, per_job, job_base)
                            job_base += nj
                            t["load", ck].append(w)
                            c["load", ck].append(cpu)
                            if not np.array_equal(buf[:n], src[:n]):
                                mismatched += int(np.count_nonzero(buf[:n] != src[:n]))
                        for ck in (False, True):  # next repeat stores fresh files
                            shutil.rmtree(mgrs[ck].file_mapper.rank_path)
                            os.makedirs(mgrs[ck].file_mapper.rank_path)
                    med = {k: statistics.median(v) for k, v in t.items()}
                    cmed = {k: statistics.median(v) for k, v in c.items()}
                    rows.append({
                        "block_bytes": bs, "jobs": nj, "blocks_per_job": per_job, "cell_bytes": n * bs,
                        "store_ms_off": med["store", False] * 1e3, "store_ms_on": med["store", True] * 1e3,
                        "load_ms_off": med["load", False] * 1e3, "load_ms_on": med["load", True] * 1e3,
                        "store_cpu_ms_off": cmed["store", False] * 1e3, "store_cpu_ms_on": cmed["store", True] * 1e3,
                        "load_cpu_ms_off": cmed["load", False] * 1e3, "load_cpu_ms_on": cmed["load", True] * 1e3,
                    })
                    if not args.json:
                        print(f"  done {fmt_size(bs)} x {nj} jobs", file=sys.stderr, flush=True)
            finally:
                for m in mgrs.values():
                    m.shutdown()
                shutil.rmtree(os.path.join(base, f"{bs}_0"), ignore_errors=True)
                shutil.rmtree(os.path.join(base, f"{bs}_1"), ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"root": args.root or tempfile.gettempdir(), "fstype": fstype, "o_direct": o_direct,
            "threads": args.threads, "repeat": args.repeat, "cap_mib": args.cap_mib,
            "durable": args.durable,
            "io_backend": kio.backend, "crc32c_backend": kvtier.crc32c_backend,
            "cells": len(cells), "rows": rows, "mismatched_bytes": mismatched}


def table(d: dict) -> str:
    out = [f"tier pool benchmark: root {d['root']} ({d['fstype']}, {'O_DIRECT' if d['o_direct'] else 'buffered'}), "
           f"{d['threads']} read + {d['threads']} write threads, I/O {d['io_backend']}, CRC32C "
           f"{d['crc32c_backend']}, median of {d['repeat']}, cell cap {d['cap_mib']} MiB"
           f"{', durable stores (fdatasync + dir fsync)' if d.get('durable') else ''}",
           "e2e = submit all jobs .. last job finished; CPU = process user+sys over store and load",
           ""]
    hdr = (f"{'Block':>8} {'Jobs':>5} {'Blk/job':>7} {'MiB':>6} | {'Store e2e ms off -> on':>24} {'x':>5} | "
           f"{'Load e2e ms off -> on':>23} {'x':>5} | {'CPU ms store+load off -> on':>28} {'x':>5}")
    out += [hdr, "-" * len(hdr)]
    for r in d["rows"]:
        cpu_off = r["store_cpu_ms_off"] + r["load_cpu_ms_off"]
        cpu_on = r["store_cpu_ms_on"] + r["load_cpu_ms_on"]
        out.append(
            f"{fmt_size(r['block_bytes']):>8} {r['jobs']:>5} {r['blocks_per_job']:>7} {r['cell_bytes'] / 2**20:>6.0f} | "
            f"{r['store_ms_off']:>11.1f} -> {r['store_ms_on']:>9.1f} {r['store_ms_on'] / r['store_ms_off']:>5.2f} | "
            f"{r['load_ms_off']:>10.1f} -> {r['load_ms_on']:>9.1f} {r['load_ms_on'] / r['load_ms_off']:>5.2f} | "
            f"{cpu_off:>15.0f} -> {cpu_on:>9.0f} {cpu_on / cpu_off if cpu_off else float('nan'):>5.2f}")
    out.append("")
    out.append(f"verified every loaded byte: {d['mismatched_bytes']} mismatched")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256K,1M,4M,16M", help="block sizes (default 256K,1M,4M,16M)")
    p.add_argument("--jobs", default="1,4,16,64", help="jobs in flight (default 1,4,16,64)")
    p.add_argument("--blocks-per-job", type=int, default=16, help="blocks per job before the cap (default 16, as the PR)")
    p.add_argument("--cap-mib", type=int, default=256, help="max MiB per cell (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="runs per cell, medians reported (default 3)")
    p.add_argument("--threads", type=int, default=16, help="read- and write-priority threads each (default 16)")
    p.add_argument("--root", default=None, help="directory for the temp cache (default $TMPDIR or /tmp)")
    p.add_argument("--no-o-direct", action="store_true")
    p.add_argument("--durable", action="store_true",
                   help="durable stores: fdatasync each temp, fsync its directory (docs/reliability.md)")
    p.add_argument("--quick", action="store_true", help="256K,1M x 1,4,16 jobs, 64 MiB cap, 1 run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.jobs, args.cap_mib, args.repeat = "256K,1M", "1,4,16", 64, 1
    d = run(args)
    print(json.dumps(d, indent=2) if args.json else table(d))
    return 0 if d["mismatched_bytes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
