#!/usr/bin/env python3
"""How far above its bound a shared root goes: several writer processes store into one
bounded root as fast as their pools run, and the root's real usage is sampled all along
(issue 22's target: usage never above ``max_bytes`` + one store batch per writer).

    python benchmarks/capacity_peak.py --tmpfs          # root: a tmpfs of its own (needs root): exact
    python benchmarks/capacity_peak.py --root /mnt/nvme/kv --writers 2 --threads 16
    python benchmarks/capacity_peak.py --admission-cost   # µs per admission, 0/1/3 other writers
    python benchmarks/capacity_peak.py --dfs glusterfs    # two clients ("nodes") of one volume (tests/dfs.py)

A run: ``--writers`` processes (FileSystemTierManager, checksums on, buffered I/O,
``--threads`` write threads, ``max_bytes`` = ``--max-bytes``), each keeping ``--threads``
store jobs of ``--batch`` fresh blocks of ``--block`` bytes in flight for ``--seconds``, and
logging its usage estimate every 20 ms. This process samples the real usage every ~5 ms:
``statvfs`` of the filesystem when the root has it to itself (``--tmpfs``, or
``--exclusive``: exact, atomic), else a census of the root (no snapshot: it miscounts what
changes while it walks). Reported per run: the peak usage as a multiple of the bound and
in store batches above it, the share of samples above the bound, store jobs admitted and
dropped per writer (most are dropped where the evictor cannot unlink as fast as the stores
come), and each writer's estimate / the real usage (p10/p50/p90) when above 30% of the bound.

``--dfs glusterfs|moosefs``: a real distributed filesystem with two client mounts on this
machine (tests/dfs.py: servers and clients in network namespaces of their own), writer k
storing through mount k % 2, as two nodes do. Its servers keep their data on a tmpfs of the
benchmark's own. GlusterFS (a distribute volume: each file once, on one brick) is sampled by
that tmpfs's ``statvfs``, less what it held just before the writers started: exact. MooseFS
keeps each chunk twice (goal 2) with a header and frees removed ones in the background, so
it is sampled by its master's own count of the root (``mfsdirinfo``'s ``length``, the files'
bytes, one copy: what the tiers' census counts, from the metadata server, ~5 ms a sample).
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def parse_size(s: str) -> int:
    from kvtier._tier.capacity import parse_size as ps

    return ps(s, "size")


def worker(a: argparse.Namespace) -> None:
    """One writer process: stores for ``--seconds``, prints its estimate log and counts."""

    import numpy as np

    from kvtier._tier import capacity as cap
    from kvtier.manager import FileSystemTierManager, TransferJob

    buf = np.random.default_rng(a.tag).integers(0, 255, (a.batch, a.block), dtype=np.uint8)
    t = FileSystemTierManager(buf, a.root, "m", block_size=a.block, use_o_direct=False, n_read_threads=1,
                              n_write_threads=a.threads, max_bytes=a.max_bytes)
    rc = cap.root_capacity(a.root)
    log, stop = [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with rc._lock:  # the estimate and its parts (--why)
                u = rc._usage
                log.append((time.time(), rc.estimate(), u["bytes"] if u else -1,
                            f"{u['scan_started']:.3f}" if u else "-", rc._others(), rc._own, f"{rc._views}+{rc._unseen}"))
            time.sleep(0.02)

    th = threading.Thread(target=sample)
    th.start()
    print("ready", flush=True)
    sys.stdin.readline()
    end, j, ok, dropped, inflight = time.monotonic() + a.seconds, 0, 0, 0, 0
    while time.monotonic() < end:
        while inflight < a.threads:
            keys = [(a.tag.to_bytes(2, "big") + j.to_bytes(6, "big") + i.to_bytes(2, "big") + bytes(6), 0)
                    for i in range(a.batch)]
            t.submit_store(TransferJob(j, keys, list(range(a.batch))))
            j, inflight = j + 1, inflight + 1
        time.sleep(0.001)
        for r in t.get_finished_jobs():
            ok += r.success
            dropped += not r.success
            inflight -= 1
    t.drain_jobs(60)
    for r in t.get_finished_jobs():
        ok += r.success
        dropped += not r.success
    stop.set()
    th.join()
    t.shutdown()
    print("counts", ok, dropped)
    for ts, *rest in log:
        print("est", f"{ts:.4f}", *rest)


def admission_cost(a: argparse.Namespace, base: str) -> None:
    """µs per admission + end of a store job (``RootCapacity.admit`` + ``finish``, no I/O,
    a bound far above) with 0, 1 and 3 other writer processes on the root (peers on this
    host: their ledgers re-read at each admission)."""
    import numpy as np

    from kvtier._tier import capacity as cap
    from kvtier.manager import FileSystemTierManager

    peer = (f"import sys, time, numpy as np; sys.path.insert(0, {REPO!r}); "
            f"from kvtier.manager import FileSystemTierManager as F; "
            f"t = F(np.zeros((1, 4096), np.uint8), sys.argv[1], 'm', block_size=4096, use_o_direct=False, "
            f"max_bytes=1 << 40); print('ready', flush=True); sys.stdin.readline(); t.shutdown()")
    print("| other writers on the host | µs per admit + finish |\n|---|---|")
    for n in (0, 1, 3):
        root = os.path.join(base, f"admit{n}")
        os.makedirs(root)
        t = FileSystemTierManager(np.zeros((1, 4096), np.uint8), root, "m", block_size=4096, use_o_direct=False,
                                  max_bytes=1 << 40)
        ps = [subprocess.Popen([sys.executable, "-c", peer, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True) for _ in range(n)]
        try:
            assert all(p.stdout.readline() == "ready\n" for p in ps), "a peer did not start"
            rc = cap.root_capacity(root)
            time.sleep(0.3)
            k = 20000
            t0 = time.perf_counter()
            for _ in range(k):
                assert rc.admit(8192) is None
                rc.finish(8192, 8192)
            print(f"| {n} | {(time.perf_counter() - t0) / k * 1e6:.1f} |", flush=True)
        finally:
            for p in ps:
                p.communicate("\n", timeout=30)
            t.shutdown()
            shutil.rmtree(root, ignore_errors=True)


def quantiles(xs: list) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return " / ".join(f"{xs[min(len(xs) - 1, int(q * len(xs)))]:.2f}" for q in (0.1, 0.5, 0.9))


def used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def one_run(a: argparse.Namespace, roots: list, exact: "str | None", sample=None) -> dict:
    """One run: writer k stores into ``roots[k % len(roots)]`` (one directory, or its paths
    through several mounts); the real usage is ``sample()``, else ``statvfs`` of ``exact``
    less what it held before the writers started, else (None) a census of ``roots[0]``."""
    from kvtier._tier import capacity as cap

    root = roots[0]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    base = used(exact) if exact else 0  # before the writers make the root's own files (they count)
    args = [sys.executable, os.path.abspath(__file__), "--worker", "--seconds", str(a.seconds),
            "--threads", str(a.threads), "--batch", str(a.batch), "--block", str(a.block),
            "--max-bytes", str(a.max_bytes)]
    ps = [subprocess.Popen(args + ["--root", roots[k % len(roots)], "--tag", str(k + 1)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True) for k in range(a.writers)]
    for p in ps:
        assert p.stdout.readline() == "ready\n", "a writer did not start"
    outs = [""] * len(ps)

    def drain(k: int) -> None:  # read as it comes: a writer's log fills a pipe's buffer
        outs[k] = ps[k].stdout.read()

    readers = [threading.Thread(target=drain, args=(k,)) for k in range(len(ps))]
    for p, th in zip(ps, readers):
        th.start()
        p.stdin.write("\n")
        p.stdin.flush()
    real = []
    while any(p.poll() is None for p in ps):
        if sample is not None:
            b = sample()
        else:
            b = used(exact) - base if exact else cap.census(root, keep_entries=False).bytes
        real.append((time.time(), b))
        time.sleep(0.005)
    for p, th in zip(ps, readers):
        p.wait()
        th.join()
    mx, batch_bytes = a.max_bytes, a.batch * a.block
    ts = [t for t, _ in real]
    writers = []
    for out in outs:
        lines = [ln.split() for ln in out.splitlines()]
        ok, dropped = next((int(x[1]), int(x[2])) for x in lines if x[0] == "counts")
        ratios = []
        for x in lines:
            if x[0] == "est":
                i = bisect.bisect(ts, float(x[1])) - 1
                if i >= 0 and real[i][1] > 0.3 * mx:
                    ratios.append(int(x[2]) / real[i][1])
        writers.append({"ok": ok, "dropped": dropped, "est_real": quantiles(ratios)})
    peak = max(b for _, b in real)
    if a.why:  # each writer's estimate and its parts around the peak sample
        tp = next(t for t, b in real if b == peak)
        print(f"# peak {peak} bytes at {tp:.3f}; per writer: time - peak, estimate, census bytes, census "
              f"scan_started - peak, others' ledgers, own, views (seen + unseen)")
        for k, out in enumerate(outs):
            for x in (ln.split() for ln in out.splitlines()):
                if x[0] == "est" and -0.4 <= float(x[1]) - tp <= 0.1:
                    st = f"{float(x[4]) - tp:+.3f}" if x[4] != "-" else "-"
                    print(f"#   w{k + 1} {float(x[1]) - tp:+.3f} est {x[2]} census {x[3]} at {st} others {x[5]} "
                          f"own {x[6]} views {x[7]}")
    return {"peak": peak / mx, "over_batches": (peak - mx) / batch_bytes,
            "over_share": sum(b > mx for _, b in real) / len(real), "samples": len(real), "writers": writers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", help="an empty directory to use (default: a temporary one, or the tmpfs)")
    ap.add_argument("--tmpfs", action="store_true", help="mount a tmpfs of its own for the root (root user)")
    ap.add_argument("--exclusive", action="store_true", help="the root's filesystem holds nothing else: statvfs")
    ap.add_argument("--dfs", choices=("glusterfs", "moosefs"),
                    help="a distributed filesystem with two client mounts (tests/dfs.py; root user), writer k on mount k %% 2")
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=16, help="write threads and jobs in flight per writer")
    ap.add_argument("--max-bytes", type=parse_size, default=parse_size("64M"))
    ap.add_argument("--block", type=parse_size, default=parse_size("256K"))
    ap.add_argument("--batch", type=int, default=8, help="blocks per store job")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--admission-cost", action="store_true",
                    help="only time an admission (admit + finish) with 0, 1 and 3 other writers on the root")
    ap.add_argument("--why", action="store_true",
                    help="print each writer's estimate and its parts around each run's peak sample")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tag", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.admission_cost:
        base = tempfile.mkdtemp(prefix="kvtier-admit-", dir=a.root)
        try:
            return admission_cost(a, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    mnt, sample = None, None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill unmounts and stops the servers too
    with contextlib.ExitStack() as stack:
        if a.tmpfs or a.dfs:
            mnt = tempfile.mkdtemp(prefix="kvtier-peak-")
            size = 4 * a.max_bytes + 2 * a.writers * a.threads * a.batch * a.block
            if a.dfs:  # MooseFS: 2 copies of each chunk (goal 2), removed chunks freed in the background,
                size = max(size, 4 << 30)  # and each chunkserver keeps 256 MiB free (tmpfs: memory only as used)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt], check=True)

            def unmount() -> None:
                subprocess.run(["umount", mnt], check=False)
                os.rmdir(mnt)

            stack.callback(unmount)
        if a.dfs:
            sys.path.insert(0, os.path.join(REPO, "tests"))
            from dfs import cluster

            c = stack.enter_context(cluster(a.dfs, workdir=mnt))
            roots = [os.path.join(m, "root") for m in c.mounts]
            exact = mnt if a.dfs == "glusterfs" else None
            if a.dfs == "moosefs":
                def sample(c=c, root=roots[0]) -> int:
                    out = c.client_tool("mfsdirinfo", root)
                    return int(next(ln.split()[1] for ln in out.splitlines() if ln.strip().startswith("length:")))
            how = ("statvfs of the bricks' tmpfs, less its use before the run" if exact else
                   "the MooseFS master's count of the root (mfsdirinfo length)")
            where = f"{a.dfs}, writer k through mount k % 2: {', '.join(roots)}"
        elif a.tmpfs:
            roots, exact, how = [os.path.join(mnt, "root")], mnt, "statvfs (exact)"
            where = roots[0]
        else:
            roots = [a.root or tempfile.mkdtemp(prefix="kvtier-peak-", dir="/var/tmp")]
            exact = roots[0] if a.exclusive else None
            how, where = ("statvfs (exact)" if exact else "census (walks: not a snapshot)"), roots[0]
        print(f"# {a.writers} writers x {a.threads} threads, jobs of {a.batch} x {a.block >> 10} KiB "
              f"({a.batch * a.block >> 10} KiB), max_bytes {a.max_bytes >> 20} MiB, {a.seconds:g} s per run; "
              f"usage by {how} of {where}")
        print(f"# target: peak <= max_bytes + one batch per writer ({a.writers} batches)")
        print("| run | peak / bound | above, batches | samples above | " +
              " | ".join(f"w{k + 1} stored / dropped | w{k + 1} est/real p10/p50/p90" for k in range(a.writers)) + " |")
        print("|---" * (4 + 2 * a.writers) + "|")
        for r in range(a.runs):
            d = one_run(a, roots, exact, sample)
            cells = " | ".join(f"{w['ok']} / {w['dropped']} | {w['est_real']}" for w in d["writers"])
            print(f"| {r + 1} | {d['peak']:.3f} | {max(0.0, d['over_batches']):.2f} | "
                  f"{100 * d['over_share']:.1f}% of {d['samples']} | {cells} |", flush=True)
        shutil.rmtree(roots[0], ignore_errors=True)


if __name__ == "__main__":
    main()
