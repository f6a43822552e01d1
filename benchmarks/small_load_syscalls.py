#!/usr/bin/env python3
"""Why kvtier loads 4 KiB blocks with plain syscalls, not io_uring: a verified
4 KiB load (kvtier's calls) in C, with plain syscalls and batched through
io_uring, on the same files, interleaved.

    python benchmarks/small_load_syscalls.py                  # 10,000 files under /var/tmp
    python benchmarks/small_load_syscalls.py --dir /mnt/nvme/kvt --blocks 20000 --rounds 15

The files are stored once by kvtier with checksums on (so each has the
identity record user.kvtier.id, 12 bytes, and user.vllm.kv_crc32c) and are in
the page cache. A C program built here with gcc times one pass over all of
them per variant, the variants in turn (the order rotating every round), into
a cold 512 MiB destination walked block by block, and prints the median and
the minimum per block:

  plain          open, pread 4 KiB into the destination, close  (vLLM's calls;
                 the baseline of the x column)
  +private       open, fgetxattr(user.kvtier.id), pread into a private 8 KiB
                 buffer (the block and the page past its end), close, then the
                 fused copy + CRC into the destination (kvtier's load:
                 kvtier._C.crc32c_copy's kernel is not reachable from C here,
                 so ISA-L's CRC + memcpy stand in)
  uring xN       the +private load through io_uring, N blocks per
                 io_uring_enter: openat to a direct descriptor, fgetxattr,
                 read, close linked per block (IOSQE_IO_HARDLINK), then the
                 CRC + copy of each; liburing only
  uring-noxattr  the same without fgetxattr (what batching open/read/close
                 alone gives)
  syscall        a null syscall (getppid), for scale

What a verified load costs against vLLM itself, in the same run, is
benchmarks/vs_vllm.py's 4 KiB cell: its floor (vLLM's calls in C) and vfloor
(open, fgetxattr, pread into the destination, close and one CRC pass: the
verified floor) columns. This script keeps what that one does not time: the
io_uring batches and kvtier's private-buffer shape they are compared with.

Needs gcc, ISA-L (libisal-dev) and, for the io_uring rows, liburing-dev (the
rows are skipped without it). Prints the load average at start and end: the
machine may be shared.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from kvtier import io as kio

PROBE_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>
#include <isa-l/crc.h>
#ifdef HAVE_URING
#include <liburing.h>
#endif
enum { PLAIN, PRIV, URING8, URING32, URING128, URING_NOX, NULLSC, NV };
static const char *names[NV] = {"plain", "+private", "uring x8", "uring x32", "uring x128",
                                "uring-noxattr x32", "syscall"};
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int cmpd(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }
static char **paths; static int n; static uint8_t *mem, *priv; static size_t pool = 512ul << 20, next;
static uint32_t sink;
static uint8_t *dst(void) { if (next + 4096 > pool) next = 0; uint8_t *d = mem + next; next += 4096; return d; }
static int one(int v, int i)
{
    uint8_t rec[16], *d = dst();
    int fd = open(paths[i], O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return -1;
    if (v != PLAIN && fgetxattr(fd, "user.kvtier.id", rec, sizeof rec) != 12) return -1;
    if (pread(fd, v == PRIV ? priv : d, v == PRIV ? 8192 : 4096, 0) != 4096) return -1;
    close(fd);
    if (v == PRIV) { sink ^= crc32_iscsi(priv, 4096, 0); memcpy(d, priv, 4096); }
    return 0;
}
#ifdef HAVE_URING
static struct io_uring ring; static int ring_ok;
static int batch(int b, int xattr)
{
    static uint8_t rec[128][16];
    for (int i0 = 0; i0 < n; i0 += b) {
        int m = n - i0 < b ? n - i0 : b, ops = 0;
        for (int k = 0; k < m; k++) {
            struct io_uring_sqe *s = io_uring_get_sqe(&ring);
            io_uring_prep_openat_direct(s, AT_FDCWD, paths[i0 + k], O_RDONLY | O_NOFOLLOW | O_NONBLOCK, 0, k);
            s->flags |= IOSQE_IO_HARDLINK; s->user_data = 0; ops++;
            if (xattr) {
                s = io_uring_get_sqe(&ring);
                io_uring_prep_fgetxattr(s, k, "user.kvtier.id", (char *)rec[k], 16);
                s->flags |= IOSQE_FIXED_FILE | IOSQE_IO_HARDLINK; s->user_data = 2; ops++;
            }
            s = io_uring_get_sqe(&ring);
            io_uring_prep_read(s, k, priv + (size_t)k * 8192, 8192, 0);
            s->flags |= IOSQE_FIXED_FILE | IOSQE_IO_HARDLINK; s->user_data = 1; ops++;
            s = io_uring_get_sqe(&ring);
            io_uring_prep_close_direct(s, k); s->user_data = 3; ops++;
        }
        if (io_uring_submit_and_wait(&ring, ops) != ops) return -1;
        for (int c = 0; c < ops; c++) {
            struct io_uring_cqe *q;
            if (io_uring_wait_cqe(&ring, &q)) return -1;
            int kind = (int)q->user_data, r = q->res;
            io_uring_cqe_seen(&ring, q);
            if ((kind == 1 && r != 4096) || (kind == 2 && r != 12) || r < 0) return -1;
        }
        for (int k = 0; k < m; k++) { uint8_t *d = dst(); sink ^= crc32_iscsi(priv + (size_t)k * 8192, 4096, 0); memcpy(d, priv + (size_t)k * 8192, 4096); }
    }
    return 0;
}
#endif
int main(int argc, char **argv)
{
    const char *dir = argv[1]; n = atoi(argv[2]); int rounds = atoi(argv[3]);
    paths = malloc(n * sizeof *paths);
    for (int i = 0; i < n; i++) { paths[i] = malloc(strlen(dir) + 32); sprintf(paths[i], "%s/s%05d.bin", dir, i); }
    mem = mmap(NULL, pool, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); memset(mem, 1, pool);
    priv = aligned_alloc(4096, 128 * 8192); memset(priv, 0, 128 * 8192);
#ifdef HAVE_URING
    ring_ok = io_uring_queue_init(512, &ring, 0) == 0 && io_uring_register_files_sparse(&ring, 128) == 0;
#endif
    double (*t)[256] = calloc(NV, sizeof *t);
    int have[NV] = {1, 1, 0, 0, 0, 0, 1};
#ifdef HAVE_URING
    for (int v = URING8; v <= URING_NOX; v++) have[v] = ring_ok;
#endif
    for (int r = 0; r < rounds && r < 256; r++)
        for (int k = 0; k < NV; k++) {
            int v = (k + r) % NV;
            if (!have[v]) continue;
            double t0 = now();
            int e = 0;
            if (v <= PRIV) { for (int i = 0; i < n && !e; i++) e = one(v, i); }
            else if (v == NULLSC) { for (int i = 0; i < n; i++) syscall(SYS_getppid); }
#ifdef HAVE_URING
            else e = batch(v == URING8 ? 8 : v == URING32 ? 32 : v == URING128 ? 128 : 32, v != URING_NOX);
#endif
            if (e) { fprintf(stderr, "%s failed\n", names[v]); return 1; }
            t[v][r] = (now() - t0) / n * 1e6;
        }
    double base = 0;
    for (int v = 0; v < NV; v++) {
        if (!have[v]) { printf("| %-18s | %8s | %8s | %6s |\n", names[v], "-", "-", "-"); continue; }
        qsort(t[v], rounds, sizeof(double), cmpd);
        double med = t[v][rounds / 2];
        if (v == PLAIN) base = med;
        printf("| %-18s | %8.2f | %8.2f | %6.2f |\n", names[v], med, t[v][0], med / base);
    }
    return sink == 0x12345678;
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="directory for the files (default /var/tmp)")
    ap.add_argument("--blocks", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="kvt-small-load-")
    d = tempfile.mkdtemp(prefix="kvt-small-load-", dir=args.dir)
    try:
        n = args.blocks
        view = np.random.default_rng(0).integers(0, 256, n * 4096, dtype=np.uint8)
        paths = [os.path.join(d, f"s{i:05d}.bin") for i in range(n)]
        kio.batch_store_block(paths, view, [i * 4096 for i in range(n)], 4096, False, True)
        exe = os.path.join(work, "probe")
        cmd = ["gcc", "-O2", "-o", exe, "-x", "c", "-", "-lisal"]
        uring = subprocess.run(["pkg-config", "--exists", "liburing"]).returncode == 0
        if uring:
            cmd[1:1] = ["-DHAVE_URING"]
            cmd.append("-luring")
        subprocess.run(cmd, input=PROBE_C.encode(), check=True)
        print(f"# benchmarks/small_load_syscalls.py {' '.join(argv if argv is not None else sys.argv[1:])}")
        print(f"{n} files of 4 KiB in {d} (page cache); load average at start: {os.getloadavg()}")
        print("us per block: median and minimum of the rounds; x = median / plain's median")
        print(f"| {'variant':<18} | {'median':>8} | {'min':>8} | {'x':>6} |")
        print(f"|{'-' * 20}|{'-' * 10}|{'-' * 10}|{'-' * 8}|")
        sys.stdout.flush()
        subprocess.run([exe, d, str(n), str(args.rounds)], check=True)
        print(f"load average at end: {os.getloadavg()}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
