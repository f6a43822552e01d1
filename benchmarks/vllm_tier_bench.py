#!/usr/bin/env python3
"""vLLM 0.33's own fs tier vs kvtier (checksums off, on), inside vLLM's real tiering code.

One real ``TieringOffloadingManager`` (built from a real ``OffloadingConfig`` through
``OffloadingSpecFactory``, CPU primary tier in /dev/shm, no GPU: tests/vllm_harness.py)
with three secondary tiers on **one root**: vLLM's ``"fs"`` (with its compiled
``fs_io_C``, loaded with stub CUDA libraries as vLLM would use it; ``--vllm-python-io``
for its Python io), ``kvtier`` with ``checksum_blocks=False`` and ``kvtier`` with
``checksum_blocks=True`` (the default).  Each tier gets the jobs the manager would give it:
vLLM ``TransferJob``s through ``submit_store`` / ``submit_load``, results polled with
``get_finished_jobs`` (16 read + 16 write threads, vLLM's default).

Per block size (Llama-3.1-8B geometry: 16 tokens x 32 layers x 8 KV heads x 128 x 2 (K,V)
x 2 bytes = 2 MiB; and 16 MiB): ``--jobs`` jobs in flight (16), ``--total-mib`` per pass,
stores into an empty rank directory then loads of every block back, cells interleaved
(fs, off, on, then the next repeat in another order), the rank directory emptied before
each store pass.  Every loaded byte is compared with what was stored (outside the
timing).  Reported: medians over ``--repeat`` of GB/s (bytes / wall time from the first
submit to the last result) and process CPU seconds (user+sys, all threads) per GiB moved,
and each kvtier cell's ratio to vLLM's fs tier.

    python benchmarks/vllm_tier_bench.py                      # 2 MiB and 16 MiB, ~2 min
    python benchmarks/vllm_tier_bench.py --root /mnt/nvme --total-mib 4096 --repeat 5
    python benchmarks/vllm_tier_bench.py --block-kib 4 --jobs 1 --total-mib 40   # one job of 10,240 small blocks

With ``--jobs 1`` a pass is one job: vLLM runs it as one call on one thread, kvtier splits a
load of >= 1024 blocks over its pool (``load_split_blocks``, docs/tier.md "Split loads").
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # vllm_harness

MIB = 1 << 20
GIB = 1 << 30
CELLS = ("fs", "kvtier-off", "kvtier-on")
SERIAL = "on-serial"  # --serial-cell: kvtier-on with load_split_blocks=0 (every job one call)


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_pass(tier, keys, chunk_ids, jobs: int, is_load: bool, job_ids) -> float:
    """Submit ``jobs`` jobs splitting ``keys``/``chunk_ids``, wait for every result;
    wall seconds.  Raises if a job fails."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    rc = ReqContext(req_id="bench")
    n = len(keys)
    per = max(1, n // jobs)
    batches = [(keys[i:i + per], chunk_ids[i:i + per]) for i in range(0, n, per)]
    want = set()
    t0 = time.perf_counter()
    for ks, cs in batches:
        jid = next(job_ids)
        want.add(jid)
        job = TransferJob(job_id=jid, keys=ks, chunk_ids=np.asarray(cs, dtype=np.int32),
                          is_promotion=is_load, req_context=rc)
        (tier.submit_load if is_load else tier.submit_store)(job)
    while want:
        for r in tier.get_finished_jobs():
            if not r.success:
                raise RuntimeError(f"{tier.tier_type} job {r.job_id} failed")
            want.discard(r.job_id)
        if want:
            time.sleep(0.0005)
    return time.perf_counter() - t0


def bench_block_size(args, block_bytes: int, fs_io) -> dict:
    import itertools

    from vllm_harness import Harness, key

    n = max(args.jobs, (args.total_mib * MIB) // block_bytes)
    root = tempfile.mkdtemp(prefix="kvtier-vllm-bench-", dir=args.root)
    cells = CELLS + ((SERIAL,) if args.serial_cell else ())
    tiers = [{"type": "fs", "root_dir": root},
             {"type": "kvtier", "root_dir": root, "checksum_blocks": False},
             {"type": "kvtier", "root_dir": root, "checksum_blocks": True}]
    if args.serial_cell:
        tiers.append({"type": "kvtier", "root_dir": root, "checksum_blocks": True, "load_split_blocks": 0})
    h = Harness(tiers, block_bytes=block_bytes, num_chunks=2 * n, model="meta-llama/Llama-3.1-8B")
    try:
        rng = np.random.default_rng(block_bytes)
        src = list(range(n))  # stored from chunks [0, n), loaded into [n, 2n)
        dst = list(range(n, 2 * n))
        for c in src:
            h.view[c] = rng.integers(0, 256, block_bytes, dtype=np.uint8)
        ref = h.view[:n].copy()
        keys = [key(i, salt=block_bytes) for i in range(n)]
        rank_dir = os.path.dirname(os.path.dirname(os.path.dirname(h.tiers[0].file_mapper.get_file_name(keys[0]))))
        for t in h.tiers[1:]:
            assert t.file_mapper.get_file_name(keys[0]) == h.tiers[0].file_mapper.get_file_name(keys[0])
        job_ids = itertools.count(1)
        res = {c: {"store_s": [], "load_s": [], "store_cpu": [], "load_cpu": []} for c in cells}
        orders = [cells, cells[::-1], cells[1:] + cells[:1]]
        for rep in range(args.repeat):
            for cell in orders[rep % len(orders)]:
                tier = h.tiers[cells.index(cell)]
                shutil.rmtree(rank_dir, ignore_errors=True)
                os.makedirs(rank_dir)
                os.sync()
                c0 = cpu_s()
                res[cell]["store_s"].append(run_pass(tier, keys, src, args.jobs, False, job_ids))
                res[cell]["store_cpu"].append(cpu_s() - c0)
                os.sync()
                h.view[n:] = 0
                c0 = cpu_s()
                res[cell]["load_s"].append(run_pass(tier, keys, dst, args.jobs, True, job_ids))
                res[cell]["load_cpu"].append(cpu_s() - c0)
                if not np.array_equal(h.view[n:], ref):
                    raise SystemExit(f"{cell}: loaded bytes differ from the stored ones")
        gib = n * block_bytes / GIB
        out = {}
        for cell in cells:
            r = res[cell]
            out[cell] = {
                "store_gbs": n * block_bytes / statistics.median(r["store_s"]) / 1e9,
                "load_gbs": n * block_bytes / statistics.median(r["load_s"]) / 1e9,
                "store_cpu_per_gib": statistics.median(r["store_cpu"]) / gib,
                "load_cpu_per_gib": statistics.median(r["load_cpu"]) / gib,
            }
        return {"blocks": n, "o_direct": [getattr(t, "use_o_direct", getattr(t, "_use_o_direct", None))
                                          for t in h.tiers], "cells": out}
    finally:
        h.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help="directory for the cache (default: the temp dir)")
    ap.add_argument("--block-mib", type=int, nargs="+", default=[2, 16])
    ap.add_argument("--block-kib", type=int, nargs="+", default=None,
                    help="block sizes in KiB instead of --block-mib (e.g. 4 for small blocks)")
    ap.add_argument("--jobs", type=int, default=16, help="jobs in flight per pass")
    ap.add_argument("--total-mib", type=int, default=512, help="MiB per store/load pass")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--serial-cell", action="store_true",
                    help=f"add a cell {SERIAL!r}: kvtier-on with load_split_blocks=0 (no job split over threads)")
    ap.add_argument("--vllm-python-io", action="store_true",
                    help="vLLM's fs tier with its Python io instead of fs_io_C")
    args = ap.parse_args(argv)

    import vllm

    import kvtier
    import kvtier.io as kio
    from vllm_harness import load_fs_io_C, use_vllm_io

    fs_io = "python io"
    if not args.vllm_python_io:
        use_vllm_io(load_fs_io_C())
        fs_io = "fs_io_C"
    print(f"vLLM {vllm.__version__} fs tier ({fs_io}) vs kvtier {kvtier.__version__} "
          f"(io {kio.backend}, CRC32C {kvtier.crc32c_backend}); {args.jobs} jobs in flight, "
          f"{args.total_mib} MiB per pass, median of {args.repeat}, 16+16 threads per tier")
    print(f"root: {args.root or tempfile.gettempdir()}; {os.cpu_count()} CPUs; load average {loadavg()} "
          f"(1/5/15 min: other work on the host slows every cell alike; the ratios are fairer than the GB/s)")
    hdr = (f"{'block':>6} {'tier':<11} {'store GB/s':>10} {'load GB/s':>10} {'store CPU s/GiB':>15} "
           f"{'load CPU s/GiB':>14} {'store x fs':>10} {'load x fs':>9}")
    print(hdr)
    print("-" * len(hdr))
    sizes = [k << 10 for k in args.block_kib] if args.block_kib else [m * MIB for m in args.block_mib]
    for size in sizes:
        label = f"{size >> 20:>4}Mi" if size % MIB == 0 else f"{size >> 10:>4}Ki"
        r = bench_block_size(args, size, fs_io)
        fs = r["cells"]["fs"]
        for cell in r["cells"]:
            c = r["cells"][cell]
            ratio = "" if cell == "fs" else f"{c['store_gbs'] / fs['store_gbs']:>10.2f} {c['load_gbs'] / fs['load_gbs']:>9.2f}"
            print(f"{label} {cell:<11} {c['store_gbs']:>10.2f} {c['load_gbs']:>10.2f} "
                  f"{c['store_cpu_per_gib']:>15.3f} {c['load_cpu_per_gib']:>14.3f} {ratio}")
        print(f"       ({r['blocks']} blocks per pass; O_DIRECT fs/off/on: {r['o_direct']}; "
              f"load average after: {loadavg()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
