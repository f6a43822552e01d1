#!/usr/bin/env python3
"""kvtier against vLLM 0.33's own C block I/O (`vllm/fs_io_C.abi3.so`) and the floor.

    python benchmarks/vs_vllm.py                       # disk dir under /var/tmp, tmpfs mounted if root
    python benchmarks/vs_vllm.py --dir /mnt/nvme/kvt --calls 60
    python benchmarks/vs_vllm.py --quick

Contenders, timed in the same run, call by call in turn (the order rotates
every round, so drift and the page/CPU cache state hit all alike):

  vllm   vLLM 0.33's fs tier I/O (vllm.v1.kv_offload.tiering.fs.io, which calls
         vllm.fs_io_C; no checksum). Its .so names libtorch_cuda, libc10_cuda
         and libnvrtc.so.13: three empty stub libraries are built with the C
         compiler at run time and preloaded with torch CPU's libraries
         (kvtier/peer.py). Without torch or vLLM the column is skipped (the
         header says so).
  off    kvtier.io, checksum off          } both with a job state (the engine's
  on     kvtier.io, checksum on           } deadline, default on: io_timeout_s)
  floor  a minimal C loop of the same syscalls (built with gcc, called through
         ctypes): load = open, pread, close; store = open(O_CREAT|O_EXCL),
         pwrite, close, rename. No checks, no checksum.

Cells:
  1. one block per call, 256 KiB - 16 MiB, O_DIRECT on disk (--dir), store and load;
  2. the same, buffered, on a tmpfs this script mounts (root only; else skipped),
     and loads of 1 and 4 MiB into the same, cache-hot destination every call
     (what the removed destination-reuse rule and CRC helper were for);
  3. one call of 10,000 blocks of 4 KiB (buffered, --dir: page cache), store and load;
  4. a pool of 16 threads with 16 jobs in flight (each job: 4 blocks of 2 MiB,
     O_DIRECT), loads then stores: throughput;
  5. (--only segments) the disk alone: one O_DIRECT pread of a block into
     4 KiB pages, into transparent huge pages, and into the caller pool, to
     show what the engine's huge-page load slots buy (docs/block_io.md).

The CPU-tier buffer is a --pool-mib pool (default 512) walked block by block,
so the caller's memory is cold as in real use. Loads of all contenders read
the same files (stored once with checksums on). Each store goes to a new file,
removed outside the timing.

Per cell: median wall time per block (us) with the interquartile range, the
ratio to vLLM's median, and the process CPU time (all threads) per block. The
O_DIRECT cells have one more contender, crc: a pass of the best CRC32C backend
over the next (cold) block of the pool, timed call by call in the same
rotation. The CPU line divides (kvtier on - vLLM) CPU per block by it (the
pool cell by the pass of the load cell nearest its 2 MiB blocks): a pass
measured once at start, apart from the contenders, is a denominator the
contenders' noise never touches. The machine may be shared: the header
prints the load average at start and end.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import kvtier
from kvtier import _C
from kvtier import io as kio
from kvtier.peer import load_vllm_io

KiB, MiB, GiB = 1024, 1024**2, 1024**3

FLOOR_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#include <errno.h>
#include <stddef.h>
static int rd(const char *p, char *buf, size_t len, int direct) {
    int fd = open(p, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fd < 0) return -errno;
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, buf + got, len - got, (off_t)got);
        if (r <= 0) { int e = r < 0 ? errno : 5; close(fd); return -e; }
        got += (size_t)r;
    }
    close(fd);
    return 0;
}
static int wr(const char *tmp, const char *dest, const char *buf, size_t len, int direct) {
    int fd = open(tmp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
    if (fd < 0) return -errno;
    size_t done = 0;
    while (done < len) {
        ssize_t w = pwrite(fd, buf + done, len - done, (off_t)done);
        if (w <= 0) { int e = w < 0 ? errno : 5; close(fd); unlink(tmp); return -e; }
        done += (size_t)w;
    }
    close(fd);
    if (rename(tmp, dest) != 0) { int e = errno; unlink(tmp); return -e; }
    return 0;
}
int floor_load(const char **p, char **bufs, size_t len, size_t n, int direct) {
    for (size_t i = 0; i < n; i++) { int r = rd(p[i], bufs[i], len, direct); if (r) return r; }
    return 0;
}
int floor_store(const char **tmp, const char **dest, char **bufs, size_t len, size_t n, int direct) {
    for (size_t i = 0; i < n; i++) { int r = wr(tmp[i], dest[i], bufs[i], len, direct); if (r) return r; }
    return 0;
}
"""

def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def gcc_shared(src: str, out: str, soname: "str | None" = None) -> None:
    cmd = ["gcc", "-O2", "-shared", "-fPIC", "-o", out, "-x", "c", "-"]
    if soname:
        cmd.insert(-3, f"-Wl,-soname,{soname}")
    subprocess.run(cmd, input=src.encode(), check=True, capture_output=True)


class Floor:
    def __init__(self, workdir: str, pool):
        self.base = pool.a.ctypes.data
        so = os.path.join(workdir, "floor.so")
        gcc_shared(FLOOR_C, so)
        self.lib = ctypes.CDLL(so)
        P = ctypes.POINTER(ctypes.c_char_p)
        self.lib.floor_load.argtypes = [P, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t,
                                        ctypes.c_int]
        self.lib.floor_store.argtypes = [P, P, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t,
                                         ctypes.c_int]

    _paths_cache: dict = {}

    def _args(self, paths, view, offsets):
        """ctypes arrays of the paths (cached per path list: the marshalling is not the
        syscalls this column stands for) and of the buffer addresses."""
        base = self.base  # view is the pool's memoryview
        key = (id(paths), len(paths), paths[0] if paths else None)
        ps = self._paths_cache.get(key)
        if ps is None:
            ps = (ctypes.c_char_p * len(paths))(*[os.fsencode(p) for p in paths])
            if len(self._paths_cache) < 64:
                self._paths_cache[key] = ps
        bs = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
        return ps, bs

    def load(self, paths, view, offsets, bs, direct):
        ps, bufs = self._args(paths, view, offsets)
        r = self.lib.floor_load(ps, bufs, bs, len(paths), int(direct))
        if r:
            raise OSError(-r, os.strerror(-r), paths[0])

    def store(self, paths, view, offsets, bs, direct):
        ps, bufs = self._args(paths, view, offsets)
        tmps = (ctypes.c_char_p * len(paths))(*[os.fsencode(p) + b".ftmp" for p in paths])
        r = self.lib.floor_store(tmps, ps, bufs, bs, len(paths), int(direct))
        if r:
            raise OSError(-r, os.strerror(-r), paths[0])


def aligned_pool(nbytes: int) -> np.ndarray:
    import mmap

    m = mmap.mmap(-1, nbytes)
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    return a


class Pool:
    """Walks a large buffer block by block (cold caller memory)."""

    def __init__(self, nbytes):
        self.a = aligned_pool(nbytes)
        self.mv = memoryview(self.a)  # what every contender gets (vLLM's io takes a memoryview)
        self.next = 0

    def offsets(self, bs, n=1):
        out = []
        for _ in range(n):
            if self.next + bs > len(self.a):
                self.next = 0
            out.append(self.next)
            self.next += bs
        return out


def make_contenders(vio, floor):
    """name -> (load(paths, view, offsets, bs, direct), store(...))."""
    c = {}
    if vio is not None:
        c["vllm"] = (lambda p, v, o, bs, d: vio.batch_load_block(p, v, o, bs, d),
                     lambda p, v, o, bs, d: vio.batch_store_block(p, v, o, bs, d))
    for name, ck in (("off", False), ("on", True)):
        def ld(p, v, o, bs, d, ck=ck):
            return kio.batch_load_block(p, v, o, bs, d, ck, job_state=bytearray(8))

        def st(p, v, o, bs, d, ck=ck):
            return kio.batch_store_block(p, v, o, bs, d, ck, job_state=bytearray(8))

        c[name] = (ld, st)
    c["floor"] = (floor.load, floor.store)
    return c


def interleaved(names, rounds, call, warm=3):
    """{name: [(wall_s, cpu_s), ...]}: call(name) for every name in turn,
    `rounds` times (order rotating), after `warm` untimed rounds."""
    out = {n: [] for n in names}
    for r in range(-warm, rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            c0, t0 = time.process_time(), time.perf_counter()
            post = call(n)
            t1, c1 = time.perf_counter(), time.process_time()
            if post:
                post()
            if r >= 0:
                out[n].append((t1 - t0, c1 - c0))
    return out


def summarize(samples, per):
    w = sorted(s[0] / per for s in samples)
    c = [s[1] / per for s in samples]
    q = statistics.quantiles(w, n=4) if len(w) >= 4 else [w[0], statistics.median(w), w[-1]]
    return {"wall": statistics.median(w), "q1": q[0], "q3": q[2], "cpu": statistics.mean(c),
            "cpu_med": statistics.median(c)}


class Table:
    def __init__(self, title, names):
        self.title, self.names, self.rows = title, names, []

    def add(self, label, res):
        self.rows.append((label, res))

    def print(self):
        print(f"\n## {self.title}")
        print("per contender: wall us/block median [interquartile range], x = wall / vLLM's median wall, "
              "cpu = process CPU us/block (mean, all threads)")
        head = f"| {'cell':<18} |" + "".join(f" {n + ' wall':>24} | {'x':>5} | {'cpu':>7} |" for n in self.names)
        print(head)
        print("|" + "-" * 20 + "|" + "".join("-" * 26 + "|" + "-" * 7 + "|" + "-" * 9 + "|" for _ in self.names))
        for label, res in self.rows:
            base = res.get("vllm", {}).get("wall")
            line = f"| {label:<18} |"
            for n in self.names:
                r = res.get(n)
                if r is None:
                    line += f" {'-':>24} | {'-':>5} | {'-':>7} |"
                    continue
                x = f"{r['wall'] / base:.2f}" if base else "-"
                w = f"{r['wall']:.1f} [{r['q1']:.1f}-{r['q3']:.1f}]"
                line += f" {w:>24} | {x:>5} | {r['cpu']:7.1f} |"
            print(line)
        sys.stdout.flush()


def crc_pass(p, v, offsets, bs, d):
    """The crc contender: one CRC32C pass (the active backend) over each block."""
    for o in offsets:
        _C.crc32c(v[o:o + bs])


def single_block_cells(contenders, d, pool, sizes, calls, direct, title, hot=False, ops=("load", "store")):
    """hot: every call uses the same destination/source (offset 0 of the pool:
    cache-hot), else the next block of the pool (cold). O_DIRECT cells time the
    crc contender too (the CPU line's unit)."""
    if direct:
        contenders = contenders | {"crc": (crc_pass, crc_pass)}
    names = list(contenders)
    offsets = (lambda bs: [0]) if hot else pool.offsets
    t = Table(title, names)
    results = {}
    for bs in sizes:
        src = os.path.join(d, f"src_{bs}.bin")
        kio.batch_store_block([src], pool.mv, [0], bs, direct, True)
        res_l = interleaved(names, calls, lambda n: contenders[n][0]([src], pool.mv, offsets(bs), bs, direct))
        seq = [0]

        def store(n):
            seq[0] += 1
            p = os.path.join(d, f"st_{n}_{seq[0]}.bin")
            contenders[n][1]([p], pool.mv, offsets(bs), bs, direct)
            return (lambda: os.unlink(p)) if n != "crc" else None

        res_s = interleaved(names, calls, store) if "store" in ops else None
        os.unlink(src)
        for op, res in (("load", res_l), ("store", res_s)):
            if res is None:
                continue
            s = {n: summarize(v, 1) | {"raw": v} for n, v in res.items()}
            for n in s:
                for k in ("wall", "q1", "q3", "cpu", "cpu_med"):
                    s[n][k] *= 1e6
            t.add(f"{op} {fmt_size(bs)}", s)
            results[(op, bs)] = s
    t.print()
    return results


def small_batch_cells(contenders, d, pool, n_blocks, rounds):
    names = list(contenders)
    bs = 4 * KiB
    t = Table(f"{n_blocks} x 4 KiB in one call, buffered (page cache), {d}", names)
    sub = os.path.join(d, "small")
    os.makedirs(sub, exist_ok=True)
    srcs = [os.path.join(sub, f"s{i:05d}.bin") for i in range(n_blocks)]
    kio.batch_store_block(srcs, pool.mv, pool.offsets(bs, n_blocks), bs, False, True)
    res_l = interleaved(names, rounds, lambda n: contenders[n][0](srcs, pool.mv, pool.offsets(bs, n_blocks), bs,
                                                                   False), warm=1)
    seq = [0]

    def store(n):
        seq[0] += 1
        dd = os.path.join(sub, f"st{seq[0]}")
        os.makedirs(dd)
        ps = [os.path.join(dd, f"{i:05d}.bin") for i in range(n_blocks)]
        contenders[n][1](ps, pool.mv, pool.offsets(bs, n_blocks), bs, False)
        return lambda: shutil.rmtree(dd)

    res_s = interleaved(names, rounds, store, warm=1)
    shutil.rmtree(sub)
    out = {}
    for op, res in (("load", res_l), ("store", res_s)):
        s = {n: summarize(v, n_blocks) for n, v in res.items()}
        for n in s:
            for k in ("wall", "q1", "q3", "cpu"):
                s[n][k] *= 1e6
        t.add(f"{op} 4 KiB x {n_blocks}", s)
        out[op] = s
    t.print()
    return out


def pool_cells(contenders, d, pool, threads, jobs, blocks_per_job, bs, rounds, direct):
    """Throughput of `threads` workers with `jobs` jobs in flight."""
    names = list(contenders)
    sub = os.path.join(d, "pool")
    os.makedirs(sub, exist_ok=True)
    n_files = jobs * blocks_per_job
    srcs = [os.path.join(sub, f"p{i:04d}.bin") for i in range(n_files)]
    kio.batch_store_block(srcs, pool.mv, pool.offsets(bs, n_files), bs, direct, True)
    ex = ThreadPoolExecutor(threads)
    seq = [0]

    def run(n, op):
        offs = pool.offsets(bs, n_files)
        if op == "load":
            paths = srcs
        else:
            seq[0] += 1
            paths = [os.path.join(sub, f"w{seq[0]}_{i:04d}.bin") for i in range(n_files)]
        fn = contenders[n][0 if op == "load" else 1]
        futs = [ex.submit(fn, paths[j * blocks_per_job:(j + 1) * blocks_per_job], pool.mv,
                          offs[j * blocks_per_job:(j + 1) * blocks_per_job], bs, direct) for j in range(jobs)]
        for f in futs:
            f.result()
        if op == "store":
            return lambda: [os.unlink(p) for p in paths]
        return None

    out = {}
    print(f"\n## pool: {threads} threads, {jobs} jobs in flight x {blocks_per_job} blocks of {fmt_size(bs)}, "
          f"{'O_DIRECT' if direct else 'buffered'}, {d}")
    print("GB/s (per round: total bytes / wall) median [IQR]; x = ratio to vLLM; cpu = process CPU s per GiB")
    for op in ("load", "store"):
        res = interleaved(names, rounds, lambda n: run(n, op), warm=1)
        total = n_files * bs
        row = {}
        for n, v in res.items():
            gbs = sorted(total / w / 1e9 for w, _ in v)
            q = statistics.quantiles(gbs, n=4) if len(gbs) >= 4 else [gbs[0], 0, gbs[-1]]
            row[n] = {"gbs": statistics.median(gbs), "q1": q[0], "q3": q[2],
                      "cpu_gib": statistics.mean(c for _, c in v) / (total / GiB)}
        base = row.get("vllm", {}).get("gbs")
        if op == "load":
            print(f"| {'op':<6} |" + "".join(f" {n + ' GB/s':>20} | {'x':>5} | {'cpu s/GiB':>9} |" for n in names))
        line = f"| {op:<6} |"
        for n in names:
            r = row[n]
            x = f"{r['gbs'] / base:.2f}" if base else "-"
            g = f"{r['gbs']:.2f} [{r['q1']:.2f}-{r['q3']:.2f}]"
            line += f" {g:>20} | {x:>5} | {r['cpu_gib']:9.3f} |"
        print(line)
        out[op] = row
    ex.shutdown()
    shutil.rmtree(sub)
    return out


def segments_cell(d, pool, sizes, calls):
    """One O_DIRECT pread per call of a whole block into 4 KiB pages
    (MADV_NOHUGEPAGE), into transparent huge pages (MADV_HUGEPAGE, 2 MiB
    aligned) and into the walked caller pool, and one pwrite of a new file
    from each: what the memory costs the device."""
    import mmap

    span = max(sizes) + 2 * MiB
    bufs = {}
    for name, adv in (("4k", getattr(mmap, "MADV_NOHUGEPAGE", None)), ("huge", getattr(mmap, "MADV_HUGEPAGE", None))):
        m = mmap.mmap(-1, span)
        a = np.frombuffer(m, dtype=np.uint8)
        off = (-a.ctypes.data) % (2 * MiB)
        if adv is not None:
            m.madvise(adv, off, span - off)
        a[off:] = 1
        bufs[name] = memoryview(m)[off:]
    print(f"\n## the disk alone: one O_DIRECT pread (pwrite of a new file) per block into (from) the caller pool, "
          f"4 KiB pages, huge pages, {d}")
    print("wall us/block median [IQR]; x = ratio to the pool (what vLLM reads into)")
    for bs in sizes:
        src = os.path.join(d, f"seg_{bs}.bin")
        kio.batch_store_block([src], pool.mv, [0], bs, True, False)

        def buf_of(n):
            if n == "pool":
                o = pool.offsets(bs)[0]
                return pool.mv[o:o + bs]
            return bufs[n][:bs]

        def rd(n):
            fd = os.open(src, os.O_RDONLY | os.O_DIRECT)
            try:
                os.preadv(fd, [buf_of(n)], 0)
            finally:
                os.close(fd)

        seq = [0]

        def wr(n):
            seq[0] += 1
            p = os.path.join(d, f"segw_{seq[0]}.bin")
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
            try:
                os.pwritev(fd, [buf_of(n)], 0)
            finally:
                os.close(fd)
            return lambda: os.unlink(p)

        for op, fn in (("read", rd), ("write", wr)):
            res = interleaved(["pool", "4k", "huge"], calls, fn)
            s = {n: summarize(v, 1) for n, v in res.items()}
            base = s["pool"]["wall"]
            print(f"| {op} {fmt_size(bs):<8} |" + "".join(
                f" {n} {r['wall'] * 1e6:8.1f} [{r['q1'] * 1e6:.1f}-{r['q3'] * 1e6:.1f}] x {r['wall'] / base:.2f} |"
                for n, r in s.items()))
        os.unlink(src)
    sys.stdout.flush()


def mount_tmpfs(path) -> "str | None":
    if os.geteuid() != 0:
        return None
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g", "kvtier-vs-vllm", path], capture_output=True)
    return path if r.returncode == 0 else None


def fs_type(path: str) -> str:
    r = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return f"{cpu}, {os.cpu_count()} CPUs, {mem:.0f} GiB, Linux {platform.release()}"


def engine_info() -> str:
    info = getattr(_C, "io_engine_status", None)
    return ", ".join(f"{k}={v}" for k, v in info().items()) if info else "plain syscalls"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk for the O_DIRECT cells (default: a temp "
                    "dir under /var/tmp)")
    ap.add_argument("--calls", type=int, default=40, help="timed calls per contender and cell (default 40)")
    ap.add_argument("--pool-mib", type=int, default=512, help="caller buffer walked block by block (MiB)")
    ap.add_argument("--small-blocks", type=int, default=10000, help="blocks of 4 KiB in the batch cell")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and calls (a smoke run)")
    ap.add_argument("--only", default="direct,tmpfs,hot,small,pool",
                    help="cells to run, comma separated (hot needs tmpfs; segments is not in the default)")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    sizes = [256 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 16 * MiB]
    calls = args.calls
    if args.quick:
        sizes, calls = [256 * KiB, 4 * MiB], 8
    work = tempfile.mkdtemp(prefix="kvt-vs-vllm-")
    base = args.dir or "/var/tmp"
    disk = tempfile.mkdtemp(prefix="kvt-vs-vllm-", dir=base)
    vio, vnote = load_vllm_io(work)
    if vio is None:
        vnote = f"{vnote}: vLLM column skipped"
    pool = Pool(args.pool_mib * MiB)
    floor = Floor(work, pool)
    contenders = make_contenders(vio, floor)
    print("# kvtier vs vLLM fs_io_C: benchmarks/vs_vllm.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"machine: {machine()}")
    print(f"kvtier {kvtier.__version__}: io backend {kio.backend}, CRC32C {_C.active_backend()}, "
          f"fused copy {_C.crc_copy_status()['kernel']}, engine: {engine_info()}; kvtier with a job state")
    print(f"peer: {vnote}")
    print(f"disk dir: {disk} ({fs_type(disk)}); load average at start: {os.getloadavg()}")
    results = {}
    tmpfs = None
    try:
        if "direct" in only:
            results["direct"] = single_block_cells(contenders, disk, pool, sizes, calls, True,
                                                   f"one block per call, O_DIRECT, {fs_type(disk)}")
        if "tmpfs" in only:
            mnt = tempfile.mkdtemp(prefix="kvt-vs-vllm-tmpfs-")
            tmpfs = mount_tmpfs(mnt)
            if tmpfs is None:
                print("\n## buffered on tmpfs: skipped (mounting tmpfs needs root)")
                os.rmdir(mnt)
            else:
                results["tmpfs"] = single_block_cells(contenders, tmpfs, pool, sizes, calls, False,
                                                      "one block per call, buffered, tmpfs")
                if "hot" in only:
                    results["hot"] = single_block_cells(
                        contenders, tmpfs, pool, [1 * MiB, 4 * MiB], calls, False,
                        "buffered loads into the same (cache-hot) destination every call, tmpfs", hot=True,
                        ops=("load",))
        if "small" in only:
            results["small"] = small_batch_cells(contenders, disk, pool, args.small_blocks,
                                                 3 if args.quick else 9)
        if "segments" in only:
            segments_cell(disk, pool, sizes, calls)
        if "pool" in only:
            results["pool"] = pool_cells(contenders, disk, pool, 16, 16, 4, 2 * MiB, 3 if args.quick else 9, True)
    finally:
        if tmpfs:
            subprocess.run(["umount", tmpfs])
            os.rmdir(tmpfs)
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print_targets(results)
    print(f"\nload average at end: {os.getloadavg()}")
    return 0


def print_targets(results):
    print("\n## targets (kvtier checksum on, with a job state, against vLLM fs_io_C)")

    def worst(cells, limit, what):
        if not cells:
            return
        ratios = {k: v["on"]["wall"] / v["vllm"]["wall"] for k, v in cells.items() if "vllm" in v}
        if not ratios:
            print(f"- {what}: no vLLM column")
            return
        k, r = max(ratios.items(), key=lambda kv: kv[1])
        ok = "met" if r <= limit else "NOT met"
        print(f"- {what}: worst {r:.2f}x ({k[0]} {fmt_size(k[1])}) <= {limit:.2f}x: {ok}; all: "
              + ", ".join(f"{a} {fmt_size(b)} {x:.2f}" for (a, b), x in ratios.items()))

    worst(results.get("direct"), 1.00, "O_DIRECT 256 KiB-16 MiB wall")
    worst(results.get("tmpfs"), 1.05, "buffered (tmpfs) wall")
    sm = results.get("small")
    if sm and "vllm" in sm["load"]:
        for op in ("load", "store"):
            r = sm[op]["on"]["wall"] / sm[op]["vllm"]["wall"]
            print(f"- 4 KiB batch {op}: {r:.2f}x <= 1.10x: {'met' if r <= 1.10 else 'NOT met'}")
    d = results.get("direct")
    crc_gib = None  # the crc contender's CPU s per GiB (the pool cell's unit)
    if d and any("vllm" in v for v in d.values()):
        worst_cpu = []
        for (op, bs), v in d.items():
            mean = (v["on"]["cpu"] - v["vllm"]["cpu"]) / v["crc"]["cpu"]
            med = (v["on"]["cpu_med"] - v["vllm"]["cpu_med"]) / v["crc"]["cpu_med"]
            worst_cpu.append((mean, med, op, bs))
        # the pool's unit: the CRC pass of the load cell nearest its 2 MiB blocks
        bs = min((b for o, b in d if o == "load"), key=lambda b: abs(b - 2 * MiB))
        crc_gib = d[("load", bs)]["crc"]["cpu"] * 1e-6 / (bs / GiB)
        x, _, op, bs = max(worst_cpu)
        print(f"- CPU (on - vLLM) per block / a CRC pass over it (same rotation; mean, median), O_DIRECT: worst "
              f"{x:.2f} ({op} {fmt_size(bs)}) <= 1.2: {'met' if x <= 1.2 else 'NOT met'}; all: "
              + ", ".join(f"{o} {fmt_size(b)} {y:.2f} ({z:.2f})" for y, z, o, b in worst_cpu))
    p = results.get("pool")
    if p and "vllm" in p["load"]:
        for op in ("load", "store"):
            r = p[op]["on"]["gbs"] / p[op]["vllm"]["gbs"]
            line = f"- pool {op}: throughput {r:.2f}x >= 1.00x: {'met' if r >= 1.0 else 'NOT met'}; "
            if crc_gib is None:
                line += "CPU: no CRC pass measured (run the direct cells too)"
            else:
                extra = (p[op]["on"]["cpu_gib"] - p[op]["vllm"]["cpu_gib"]) / crc_gib
                line += (f"CPU (on - vLLM)/GiB / a CRC pass per GiB {extra:.2f} <= 1.2: "
                         f"{'met' if extra <= 1.2 else 'NOT met'}")
            print(line)

if __name__ == "__main__":
    sys.exit(main())
