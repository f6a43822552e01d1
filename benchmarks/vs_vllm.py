#!/usr/bin/env python3
"""kvtier against vLLM 0.33's own C block I/O (`vllm/fs_io_C.abi3.so`) and the floor.

    python benchmarks/vs_vllm.py                       # disk dir under /var/tmp, tmpfs mounted if root
    python benchmarks/vs_vllm.py --dir /mnt/nvme/kvt --calls 60
    python benchmarks/vs_vllm.py --quick

Contenders, timed in the same run, call by call in turn (the order shuffled
every round, seeded, so drift and the page/CPU cache state a predecessor
leaves hit all alike):

  vllm   vLLM 0.33's fs tier I/O (vllm.v1.kv_offload.tiering.fs.io, which calls
         vllm.fs_io_C; no checksum). Its .so names libtorch_cuda, libc10_cuda
         and libnvrtc.so.13: three empty stub libraries are built with the C
         compiler at run time and preloaded with torch CPU's libraries
         (kvtier/cli/peer.py). Without torch or vLLM the column is skipped (the
         header says so).
  off    kvtier.io, checksum off          } both with a job state (the engine's
  on     kvtier.io, checksum on           } deadline, default on: io_timeout_s)
  floor  a minimal C loop of the same syscalls (built with gcc, called through
         ctypes): load = open, pread, close; store = open(O_CREAT|O_EXCL),
         pwrite, close, rename. No checks, no checksum.
  vfloor the verified floor: a minimal C loop of the calls and the one CRC
         pass (ISA-L crc32_iscsi) that a verified block in kvtier's format
         needs, nothing else: load = open, fgetxattr(user.kvtier.id, 12
         bytes), pread into the caller's buffer, close, compare the record
         with the block's identity and CRC; store = open(O_CREAT|O_EXCL) the
         temp, pwrite, fsetxattr user.vllm.kv_crc32c (4 bytes) and
         user.kvtier.id (12 bytes), close, rename. The CRC is taken where it
         is cheapest: buffered, 256 KiB per pread/pwrite, each piece
         checksummed right after the kernel's copy left it in the CPU cache
         (64 KiB-4 MiB pieces and the whole block were measured: 128-256 KiB
         were fastest); O_DIRECT, one pread/pwrite of the block and a pass over
         the caller's buffer (no overlap with the device: one thread, one
         call). The identity is kvtier's own kvt_block_identity (csrc/block/records.c,
         built into the loop). Built with gcc and -lisal (libisal-dev); before timing it passes a
         self-check (kvtier loads what it stores, checksum strict, with the
         same bytes and records; it loads what kvtier stores and refuses a
         flipped byte). Without gcc or ISA-L, or if the check fails, the
         column is skipped and the header says why.

Cells:
  1. one block per call, 256 KiB - 16 MiB, O_DIRECT on disk (--dir), store and load;
  2. the same, buffered, on a tmpfs this script mounts (root only; else skipped),
     and loads of 1 and 4 MiB into the same, cache-hot destination every call
     (what the removed destination-reuse rule and CRC helper were for);
  3. a pool of 16 threads with 16 jobs in flight (each job: 4 blocks of 2 MiB,
     O_DIRECT), loads then stores: throughput;
  4. one call of 10,000 blocks of 4 KiB (buffered, --dir: page cache), store and load;
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
rounds. The CPU line divides (kvtier on - vLLM) CPU per block by it (the
pool cell by the pass of the load cell nearest its 2 MiB blocks): a pass
measured once at start, apart from the contenders, is a denominator the
contenders' noise never touches. The targets section gives, per target, kvtier
checksum on / vLLM (the target), vfloor / vLLM and kvtier / vfloor: a target
the vfloor misses too is below the floor of a verified block on this machine.
The machine may be shared: the header prints the load average at start and end.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import os
import platform
import random
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
from kvtier.cli.peer import load_vllm_io

KiB, MiB, GiB = 1024, 1024**2, 1024**3
VFLOOR_PIECE = 256 * KiB  # vfloor's buffered pread/pwrite size, each piece checksummed right after it

FLOOR_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
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
/* Block i is at base + off[i]; a store's temp is "<dest>.ftmp". piece: unused (vfloor's). */
int floor_load(const char **p, char *base, const uint64_t *off, size_t len, size_t n, int direct, size_t piece) {
    (void)piece;
    for (size_t i = 0; i < n; i++) { int r = rd(p[i], base + off[i], len, direct); if (r) return r; }
    return 0;
}
int floor_store(const char **dest, char *base, const uint64_t *off, size_t len, size_t n, int direct, size_t piece) {
    char tmp[PATH_MAX];
    (void)piece;
    for (size_t i = 0; i < n; i++) {
        if (snprintf(tmp, sizeof tmp, "%s.ftmp", dest[i]) >= (int)sizeof tmp) return -ENAMETOOLONG;
        int r = wr(tmp, dest[i], base + off[i], len, direct);
        if (r) return r;
    }
    return 0;
}
"""

VFLOOR_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/xattr.h>
#include <unistd.h>
#include <isa-l/crc.h>
#include "records.h" /* kvt_block_identity: kvtier's own, csrc/block/records.c built in */
/* The verified floor: the calls and the one CRC pass a verified block in
 * kvtier's on-disk format needs, nothing else. CRC32C standard presentation
 * with ISA-L (~crc32_iscsi(buf, len, ~crc)); records as csrc/block/records.h. */
static uint32_t crc(const char *b, size_t len, uint32_t c)
{
    c = ~c;
    while (len) {
        int k = len > (1u << 30) ? (1 << 30) : (int)len;
        c = crc32_iscsi((unsigned char *)b, k, c);
        b += k;
        len -= (size_t)k;
    }
    return ~c;
}
static void be32(uint8_t *o, uint32_t v) { o[0] = v >> 24; o[1] = v >> 16; o[2] = v >> 8; o[3] = v; }
/* load: open, fgetxattr(user.kvtier.id), pread into the caller's buffer,
 * close, one CRC pass, compare. Buffered: `piece` bytes per pread, each
 * checksummed right after the kernel's copy left it in the CPU cache. */
static int rd(const char *p, char *buf, size_t len, int direct, size_t piece)
{
    uint8_t rec[12], want[12];
    int fd = open(p, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fd < 0) return -errno;
    ssize_t x = fgetxattr(fd, "user.kvtier.id", rec, sizeof rec);
    if (x != 12) { int e = x < 0 ? errno : EBADMSG; close(fd); return -e; }
    if (direct || !piece) piece = len;
    uint32_t c = 0;
    size_t got = 0;
    while (got < len) {
        size_t want_n = len - got < piece ? len - got : piece;
        ssize_t r = pread(fd, buf + got, want_n, (off_t)got);
        if (r <= 0) { int e = r < 0 ? errno : EIO; close(fd); return -e; }
        if (!direct) c = crc(buf + got, (size_t)r, c);
        got += (size_t)r;
    }
    close(fd);
    if (direct) c = crc(buf, len, 0);
    kvt_block_identity(p, len, want);
    be32(want + 8, c);
    return memcmp(rec, want, 12) ? -EBADMSG : 0;
}
/* store: open(O_CREAT|O_EXCL) the temp, pwrite (buffered: `piece` bytes at a
 * time, each checksummed right after the kernel copied it, from the cache),
 * the two records on the fd, close, rename. */
static int wr(const char *tmp, const char *dest, const char *buf, size_t len, int direct, size_t piece)
{
    uint8_t id[12], crcbe[4];
    int fd = open(tmp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
    if (fd < 0) return -errno;
    if (direct || !piece) piece = len;
    uint32_t c = 0;
    size_t done = 0;
    while (done < len) {
        size_t n = len - done < piece ? len - done : piece;
        ssize_t w = pwrite(fd, buf + done, n, (off_t)done);
        if (w <= 0) { int e = w < 0 ? errno : EIO; close(fd); unlink(tmp); return -e; }
        c = crc(buf + done, (size_t)w, c);
        done += (size_t)w;
    }
    be32(crcbe, c);
    kvt_block_identity(dest, len, id);
    be32(id + 8, c);
    if (fsetxattr(fd, "user.vllm.kv_crc32c", crcbe, 4, 0) || fsetxattr(fd, "user.kvtier.id", id, 12, 0)) {
        int e = errno; close(fd); unlink(tmp); return -e;
    }
    if (close(fd)) { int e = errno; unlink(tmp); return -e; }
    if (rename(tmp, dest) != 0) { int e = errno; unlink(tmp); return -e; }
    return 0;
}
/* Block i is at base + off[i]; a store's temp is "<dest>.ftmp". */
int vfloor_load(const char **p, char *base, const uint64_t *off, size_t len, size_t n, int direct, size_t piece) {
    for (size_t i = 0; i < n; i++) { int r = rd(p[i], base + off[i], len, direct, piece); if (r) return r; }
    return 0;
}
int vfloor_store(const char **dest, char *base, const uint64_t *off, size_t len, size_t n, int direct, size_t piece) {
    char tmp[PATH_MAX];
    for (size_t i = 0; i < n; i++) {
        if (snprintf(tmp, sizeof tmp, "%s.ftmp", dest[i]) >= (int)sizeof tmp) return -ENAMETOOLONG;
        int r = wr(tmp, dest[i], base + off[i], len, direct, piece);
        if (r) return r;
    }
    return 0;
}
"""

def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


VFLOOR_LIBS = (os.path.join(CSRC, "block", "records.c"), "-lisal")
"""What vfloor is built with: kvtier's kvt_block_identity and ISA-L's CRC32C."""


def gcc_shared(src: str, out: str, libs=()) -> None:
    """Build `src` (with kvtier's csrc/ on the include path, and `libs`: more
    sources or -l flags) into the shared library `out`; CalledProcessError (with
    gcc's stderr) or FileNotFoundError (no gcc) when it cannot be built."""
    cmd = ["gcc", "-O2", "-shared", "-fPIC", f"-I{CSRC}", f"-I{CSRC}/block", "-o", out, "-x", "c", "-", *libs]
    subprocess.run(cmd, input=src.encode(), check=True, capture_output=True)


class CLoop:
    """A gcc-built C loop called through ctypes (ctypes releases the GIL):
    `floor` (FLOOR_C) or `vfloor` (VFLOOR_C, linked with ISA-L), with the
    contenders' load/store signature; blocks in the pool only (self.base).
    piece: the bytes per buffered pread/pwrite (vfloor's CRC follows each)."""

    def __init__(self, name: str, src: str, workdir: str, pool, libs=(), piece: int = 0):
        self.base, self.piece = pool.a.ctypes.data, piece
        so = os.path.join(workdir, f"{name}.so")
        gcc_shared(src, so, libs=libs)
        self.lib = ctypes.CDLL(so)
        # Called without argtypes, with the arguments already ctypes objects (sizes
        # cached): argtypes conversion of the 7 arguments cost ~0.8 us a call.
        self._load, self._store = getattr(self.lib, f"{name}_load"), getattr(self.lib, f"{name}_store")
        self._cbase, self._sizes = ctypes.c_void_p(self.base), {}
        self._paths_cache: dict = {}
        self._one = threading.local()

    def _size(self, n: int):
        z = self._sizes.get(n)
        if z is None:
            z = self._sizes[n] = ctypes.c_size_t(n)
        return z

    def _args(self, paths, offsets):
        """ctypes array of the paths (cached per path list: the marshalling is not the
        syscalls this column stands for) and of the offsets. The Python side of a call
        is kept near vLLM's (~1.5 us): a numpy array's .ctypes cost 2 us a call, a
        ctypes array of 10,000 addresses 0.45 us per block."""
        key = (id(paths), len(paths), paths[0] if paths else None)
        ps = self._paths_cache.get(key)
        if ps is None:
            ps = (ctypes.c_char_p * len(paths))(*[os.fsencode(p) for p in paths])
            if len(self._paths_cache) < 64:
                self._paths_cache[key] = ps
        if len(offsets) == 1:  # one block per call: a per-thread array, set in place
            one = getattr(self._one, "a", None)
            if one is None:
                one = self._one.a = (ctypes.c_uint64 * 1)()
            one[0] = offsets[0]
            return ps, one
        if len(offsets) < 256:
            return ps, (ctypes.c_uint64 * len(offsets))(*offsets)
        return ps, np.array(offsets, dtype=np.uint64).ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))

    def load(self, paths, view, offsets, bs, direct):
        ps, offs = self._args(paths, offsets)
        r = self._load(ps, self._cbase, offs, self._size(bs), self._size(len(paths)), int(direct),
                       self._size(self.piece))
        if r:
            raise OSError(-r, os.strerror(-r), paths[0])

    def store(self, paths, view, offsets, bs, direct):
        ps, offs = self._args(paths, offsets)
        r = self._store(ps, self._cbase, offs, self._size(bs), self._size(len(paths)), int(direct),
                        self._size(self.piece))
        if r:
            raise OSError(-r, os.strerror(-r), paths[0])


PRIMARY_MODES = ("shm", "anon", "huge")


def aligned_pool(nbytes: int, mode: str = "shm") -> "tuple[np.ndarray, str]":
    """The caller's buffer and a note on what it is. shm (the default): as vLLM 0.33's
    SharedOffloadRegion allocates its CPU tier (vllm/v1/kv_offload/cpu/
    shared_offload_region.py): a /dev/shm file opened O_CREAT|O_EXCL|O_RDWR 0600,
    ftruncate'd, mmap'ed MAP_SHARED read/write, unlinked (vLLM unlinks once every
    worker mapped it), pre-faulted with MADV_POPULATE_WRITE; its pages are the shmem
    mount's (4 KiB unless /sys/kernel/mm/transparent_hugepage/shmem_enabled gives huge
    ones). anon: anonymous MAP_PRIVATE memory with MADV_NOHUGEPAGE (4 KiB pages).
    huge: anonymous memory, 2 MiB aligned, MADV_HUGEPAGE (transparent huge pages; not
    MAP_HUGETLB, which needs a reserved pool); the note says how much THP gave."""
    import mmap

    if mode == "shm":
        path = f"/dev/shm/kvt_vs_vllm_{os.getpid()}.mmap"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
            os.unlink(path)
        m.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), 0, nbytes)
        a = np.frombuffer(m, dtype=np.uint8)
        try:
            with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
                thp = f.read().split("[")[1].split("]")[0]
        except (OSError, IndexError):
            thp = "?"
        note = f"shm: MAP_SHARED /dev/shm file as vLLM's SharedOffloadRegion, shmem THP [{thp}]"
    elif mode == "anon":
        m = mmap.mmap(-1, nbytes)
        m.madvise(mmap.MADV_NOHUGEPAGE)
        a = np.frombuffer(m, dtype=np.uint8)
        note = "anon: anonymous MAP_PRIVATE, MADV_NOHUGEPAGE (4 KiB pages)"
    elif mode == "huge":
        m = mmap.mmap(-1, nbytes + 2 * MiB)
        whole = np.frombuffer(m, dtype=np.uint8)
        off = (-whole.ctypes.data) % (2 * MiB)
        m.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
        a = whole[off:off + nbytes]
        note = "huge: anonymous, 2 MiB aligned, MADV_HUGEPAGE (THP)"
    else:
        raise ValueError(f"--primary must be one of {', '.join(PRIMARY_MODES)}, not {mode!r}")
    a[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    if mode == "huge":
        try:
            with open("/proc/self/smaps_rollup") as f:
                thp_kb = next(int(ln.split()[1]) for ln in f if ln.startswith("AnonHugePages:"))
            note += f": AnonHugePages of the process now {thp_kb // 1024} MiB of {nbytes // MiB} MiB asked"
        except (OSError, StopIteration, ValueError):
            pass
    return a, note


class Pool:
    """Walks a large buffer block by block (cold caller memory)."""

    def __init__(self, nbytes, mode: str = "shm"):
        self.a, self.note = aligned_pool(nbytes, mode)
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


def make_contenders(vio, floor, vfloor=None):
    """name -> (load(paths, view, offsets, bs, direct), store(...))."""
    c = {}
    if vio is not None:
        c["vllm"] = (lambda p, v, o, bs, d: vio.batch_load_block(p, v, o, bs, d),
                     lambda p, v, o, bs, d: vio.batch_store_block(p, v, o, bs, d))
    # off/on: the bounce (private memory, then the commit copy); off.d/on.d: the direct
    # landing (straight into the row, the read in one commit section: what the tier
    # chooses on a local filesystem, kvtier/_tier/landing.py). Stores do not depend on it.
    for name, ck, land in (("off", False, "bounce"), ("on", True, "bounce"), ("off.d", False, "direct"),
                           ("on.d", True, "direct")):
        def ld(p, v, o, bs, d, ck=ck, land=land):
            return kio.batch_load_block(p, v, o, bs, d, ck, job_state=bytearray(8), landing=land)

        def st(p, v, o, bs, d, ck=ck):
            return kio.batch_store_block(p, v, o, bs, d, ck, job_state=bytearray(8))

        c[name] = (ld, st)
    c["floor"] = (floor.load, floor.store)
    if vfloor is not None:
        c["vfloor"] = (vfloor.load, vfloor.store)
    return c


def build_vfloor(workdir: str, checkdir: str, pool) -> "tuple[CLoop | None, str]":
    """(the vfloor contender, a note) once it is built and has passed
    check_vfloor() in checkdir (the disk dir: O_DIRECT too); (None, why) when
    gcc or ISA-L (libisal-dev) is missing or the check fails."""
    try:
        vf = CLoop("vfloor", VFLOOR_C, workdir, pool, libs=VFLOOR_LIBS, piece=VFLOOR_PIECE)
    except FileNotFoundError:
        return None, "no gcc"
    except subprocess.CalledProcessError as e:
        lines = e.stderr.decode(errors="replace").strip().splitlines() or ["?"]
        why = next((ln for ln in lines if "error" in ln), lines[-1])
        return None, f"gcc could not build it with ISA-L (libisal-dev): {why}"
    try:
        check_vfloor(vf, checkdir, pool)
    except (OSError, AssertionError) as e:
        return None, f"its self-check failed: {e!r}"
    return vf, (f"vfloor: buffered pieces of {fmt_size(VFLOOR_PIECE)}, each checksummed after its "
                "pread/pwrite; self-check passed (kvtier loads what it stores, its records are kvtier's, "
                "it loads what kvtier stores and refuses a flipped byte)")


def check_vfloor(vf: CLoop, d: str, pool, bs: int = 64 * KiB) -> None:
    """What vfloor stores, kvtier loads (checksum strict: records required) with
    the same bytes, and its two records are those kvtier writes; what kvtier
    stores, vfloor loads with the same bytes, and a flipped byte is EBADMSG.
    AssertionError or OSError otherwise."""
    from kvtier._blockio import records

    top = os.path.join(d, "vfloor-check")
    d = os.path.join(top, "m_0123456789ab_r0", "abc", "de_g0")  # a FileMapper-shaped path
    os.makedirs(d)
    try:
        mine, theirs = os.path.join(d, "abcdef01.bin"), os.path.join(d, "abcdef02.bin")
        src, dst = pool.mv[0:bs], pool.mv[bs:2 * bs]
        crc = _C.crc32c(src)
        for direct in (False, True):
            vf.store([mine], pool.mv, [0], bs, direct)
            got = bytearray(bs)
            kio.batch_load_block([mine], memoryview(got), [0], bs, False, "strict")
            assert got == src, "kvtier loaded other bytes than vfloor stored"
            assert os.getxattr(mine, "user.vllm.kv_crc32c") == crc.to_bytes(4, "big"), "vfloor's user.vllm.kv_crc32c"
            assert os.getxattr(mine, records.ID_XATTR_NAME) == records.identity_record(mine, bs, crc), \
                "vfloor's user.kvtier.id"
            os.unlink(mine)
        kio.batch_store_block([theirs], pool.mv, [0], bs, False, True)
        pool.a[bs:2 * bs] = 0
        vf.load([theirs], pool.mv, [bs], bs, False)
        assert dst == src, "vfloor loaded other bytes than kvtier stored"
        with open(theirs, "r+b") as f:
            f.seek(bs // 2)
            b = f.read(1)
            f.seek(bs // 2)
            f.write(bytes([b[0] ^ 1]))
        try:
            vf.load([theirs], pool.mv, [bs], bs, False)
        except OSError as e:
            assert e.errno == errno.EBADMSG, e
        else:
            raise AssertionError("vfloor loaded a block with a flipped byte")
    finally:
        shutil.rmtree(top, ignore_errors=True)


def interleaved(names, rounds, call, warm=3, seed=0):
    """{name: [(wall_s, cpu_s), ...]}: call(name) for every name in turn,
    `rounds` times, after `warm` untimed rounds, in a new order every round
    (shuffled, seeded: the same run to run). A cyclic rotation gave each
    contender the same predecessor nearly every round, and a predecessor's
    cache footprint is part of the next call's time: loads of 1 MiB into a
    hot destination measured the floor 1.93x vLLM after kvtier's
    non-temporal copy, 1.00x shuffled (the same calls)."""
    out = {n: [] for n in names}
    rng = random.Random(seed)
    for r in range(-warm, rounds):
        order = list(names)
        rng.shuffle(order)
        for n in order:
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
                      "cpu_gib": statistics.mean(c for _, c in v) / (total / GiB),
                      "cpu_rounds": [c / (total / GiB) for _, c in v]}  # round by round, for paired differences
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
    """The mount's type; ext4 says whether it has a journal (without one, a
    file created soon after mass deletes scans past the freed inodes)."""
    from kvtier._tier.mountinfo import mount_of

    m = mount_of(path)
    if m is None:
        return "?"
    if m.fstype == "ext4":
        try:
            with open(f"/sys/fs/ext4/{os.path.basename(m.source)}/journal_task") as f:
                if f.read().strip() == "<none>":
                    return "ext4, no journal"
        except OSError:
            pass
    return m.fstype


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
    ap.add_argument("--primary", default="shm", choices=PRIMARY_MODES,
                    help="the caller's buffer: shm (default: a MAP_SHARED /dev/shm file, as vLLM's CPU tier), "
                         "anon (anonymous 4 KiB pages), huge (anonymous, transparent huge pages)")
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
    pool = Pool(args.pool_mib * MiB, args.primary)
    floor = CLoop("floor", FLOOR_C, work, pool)
    vfloor, vfnote = build_vfloor(work, disk, pool)
    contenders = make_contenders(vio, floor, vfloor)
    print("# kvtier vs vLLM fs_io_C: benchmarks/vs_vllm.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"machine: {machine()}")
    print(f"kvtier {kvtier.__version__}: io backend {kio.backend}, CRC32C {_C.active_backend()}, "
          f"fused copy {_C.crc_copy_status()['kernel']}, engine: {engine_info()}; kvtier with a job state")
    print(f"caller's buffer (--primary): {pool.note}")
    print(f"peer: {vnote}")
    print(f"verified floor: {vfnote}" if vfloor else f"verified floor: vfloor column skipped: {vfnote}")
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
        # The pool before the 4 KiB cell: that cell removes ~90,000 files, and an ext4
        # without a journal (this VM's) makes every file created in the next 1-6 minutes
        # scan past the inodes freed there (recently_deleted()): sys CPU that swamped
        # the pool's CPU line (docs/vs_vllm.md, "What the numbers say").
        if "pool" in only:
            results["pool"] = pool_cells(contenders, disk, pool, 16, 16, 4, 2 * MiB, 3 if args.quick else 16, True)
        if "small" in only:
            results["small"] = small_batch_cells(contenders, disk, pool, args.small_blocks,
                                                 3 if args.quick else 9)
        if "segments" in only:
            segments_cell(disk, pool, sizes, calls)
    finally:
        if tmpfs:
            subprocess.run(["umount", tmpfs])
            os.rmdir(tmpfs)
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print_targets(results)
    print(f"\nload average at end: {os.getloadavg()}")
    return 0


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _verdict(on_x, vf_x, limit, higher_is_better=False, serial=False) -> str:
    """met / NOT met, and whether the verified floor misses the limit too
    (`serial`: O_DIRECT, where vfloor runs its CRC after the I/O and the
    engine overlaps them: then it is no floor, only a reference)."""
    ok = (lambda x: x >= limit) if higher_is_better else (lambda x: x <= limit)
    if ok(on_x):
        return "met"
    if vf_x is None:
        return "NOT met"
    if ok(vf_x):
        return f"NOT met (vfloor meets it: {vf_x:.2f}x)"
    return "NOT met (serial vfloor misses it too)" if serial else "NOT met (vfloor misses it too)"


def print_targets(results):
    print("\n## targets (kvtier checksum on, with a job state, against vLLM fs_io_C)")
    print("on/vLLM: the target's ratio; vfloor/vLLM: the verified floor's (the calls and the one CRC pass a "
          "verified block in this format needs, nothing else); on/vfloor: kvtier against that floor")

    def wall(v, n):
        return v[n]["wall"] if n in v else None

    def worst(cells, limit, what, serial=False):
        if not cells:
            return
        rows = {k: v for k, v in cells.items() if "vllm" in v}
        if not rows:
            print(f"- {what}: no vLLM column")
            return
        k, v = max(rows.items(), key=lambda kv: kv[1]["on"]["wall"] / kv[1]["vllm"]["wall"])
        on_x, vf = v["on"]["wall"] / v["vllm"]["wall"], wall(v, "vfloor")
        vf_x = vf / v["vllm"]["wall"] if vf else None
        print(f"- {what} <= {limit:.2f}x: worst {on_x:.2f}x ({k[0]} {fmt_size(k[1])}): "
              f"{_verdict(on_x, vf_x, limit, serial=serial)}")
        print(f"  | {'cell':<13} | on/vLLM | vfloor/vLLM | on/vfloor | {'':<39} |")
        print(f"  |{'-' * 15}|---------|-------------|-----------|{'-' * 41}|")
        for (op, bs), v in rows.items():
            on, vl, vf = v["on"]["wall"], v["vllm"]["wall"], wall(v, "vfloor")
            verdict = _verdict(on / vl, vf / vl if vf else None, limit, serial=serial)
            print(f"  | {op + ' ' + fmt_size(bs):<13} | {on / vl:7.2f} | {_ratio(vf, vl):>11} | "
                  f"{_ratio(on, vf):>9} | {verdict:<39} |")

    worst(results.get("direct"), 1.00, "O_DIRECT 256 KiB-16 MiB wall", serial=True)
    worst(results.get("tmpfs"), 1.05, "buffered (tmpfs) wall")
    sm = results.get("small")
    if sm and "vllm" in sm["load"]:
        for op in ("load", "store"):
            on, vl, vf = sm[op]["on"]["wall"], sm[op]["vllm"]["wall"], wall(sm[op], "vfloor")
            print(f"- 4 KiB batch {op} <= 1.10x: {on / vl:.2f}x: {_verdict(on / vl, vf / vl if vf else None, 1.10)}"
                  f"; vfloor/vLLM {_ratio(vf, vl)}, on/vfloor {_ratio(on, vf)}")
    d = results.get("direct")
    crc_gib = None  # the crc contender's CPU s per GiB (the pool cell's unit)
    if d and any("vllm" in v for v in d.values()):
        rows = []
        for (op, bs), v in d.items():
            def extra(n, v=v):
                if n not in v:
                    return None
                return ((v[n]["cpu"] - v["vllm"]["cpu"]) / v["crc"]["cpu"],
                        (v[n]["cpu_med"] - v["vllm"]["cpu_med"]) / v["crc"]["cpu_med"])
            rows.append((extra("on"), extra("vfloor"), op, bs))
        # the pool's unit: the CRC pass of the load cell nearest its 2 MiB blocks
        bs = min((b for o, b in d if o == "load"), key=lambda b: abs(b - 2 * MiB))
        crc_gib = d[("load", bs)]["crc"]["cpu"] * 1e-6 / (bs / GiB)
        (x, _), _, op, bs = max(rows, key=lambda r: r[0][0])
        print(f"- CPU (on - vLLM) per block / a CRC pass over it (same rounds), O_DIRECT <= 1.2: worst {x:.2f} "
              f"({op} {fmt_size(bs)}): {'met' if x <= 1.2 else 'NOT met'}")
        print(f"  | {'cell':<13} | (on - vLLM)/crc mean (median) | (vfloor - vLLM)/crc mean (median) |")
        print(f"  |{'-' * 15}|-------------------------------|-----------------------------------|")
        for on, vf, op, bs in rows:
            vfs = f"{vf[0]:.2f} ({vf[1]:.2f})" if vf else "-"
            print(f"  | {op + ' ' + fmt_size(bs):<13} | {f'{on[0]:.2f} ({on[1]:.2f})':>29} | {vfs:>33} |")
    p = results.get("pool")
    if p and "vllm" in p["load"]:
        for op in ("load", "store"):
            on, vl = p[op]["on"]["gbs"], p[op]["vllm"]["gbs"]
            vf = p[op]["vfloor"]["gbs"] if "vfloor" in p[op] else None
            line = (f"- pool {op}: throughput >= 1.00x: {on / vl:.2f}x: "
                    f"{_verdict(on / vl, vf / vl if vf else None, 1.0, higher_is_better=True)}; "
                    f"vfloor/vLLM {_ratio(vf, vl)}, on/vfloor {_ratio(on, vf)}; ")
            if crc_gib is None:
                line += "CPU: no CRC pass measured (run the direct cells too)"
            else:
                def extra(n):  # mean, and median of the differences round by round (same round, paired)
                    mean = (p[op][n]["cpu_gib"] - p[op]["vllm"]["cpu_gib"]) / crc_gib
                    pairs = zip(p[op][n]["cpu_rounds"], p[op]["vllm"]["cpu_rounds"])
                    return mean, statistics.median(a - b for a, b in pairs) / crc_gib

                x, xm = extra("on")
                line += (f"CPU (on - vLLM)/GiB / a CRC pass per GiB <= 1.2: {x:.2f} (paired median {xm:.2f}): "
                         f"{'met' if x <= 1.2 else 'NOT met'}")
                if vf:
                    line += " (vfloor {:.2f} ({:.2f}))".format(*extra("vfloor"))
            print(line)


if __name__ == "__main__":
    sys.exit(main())
