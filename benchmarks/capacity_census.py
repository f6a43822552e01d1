"""Cost of a capacity census and of evictions (docs/capacity.md "Measurements").

    python benchmarks/capacity_census.py DIR [FILES] [EVICT]

Makes FILES (200,000) 1-byte block files in the real layout (random 128-bit hashes:
about one file per shard directory) under DIR/root (give a fresh tmpfs or ext4 mount),
censuses them, sorts the candidates and evicts EVICT (20,000), printing CPU per million
files and per evicted block.  Run under ``strace -f -c`` for the syscall counts.
"""
import os
import resource
import secrets
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvtier._tier import capacity as cap  # noqa: E402


def make(root: str, n: int) -> None:
    base = os.path.join(root, "m_0123456789ab_r0")
    for _ in range(n):
        h = secrets.token_hex(16)
        d = f"{base}/{h[:3]}/{h[3:5]}_g0"
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/{h}.bin", "wb") as f:
            f.write(b"x")


def main() -> None:
    root = os.path.join(sys.argv[1], "root")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 20_000
    if not os.path.isdir(root):
        t = time.perf_counter()
        make(root, n)
        print(f"made {n} files in {time.perf_counter() - t:.1f} s")
    t0, c0 = time.perf_counter(), time.thread_time()
    c = cap.census(root)
    t1, c1 = time.perf_counter(), time.thread_time()
    cands = cap.Candidates(c.entries)
    t2, c2 = time.perf_counter(), time.thread_time()
    u2 = resource.getrusage(resource.RUSAGE_THREAD)
    per = c.block_bytes // max(1, c.blocks)
    r = cands.evict(c.bytes, c.bytes - k * per)
    t3, c3 = time.perf_counter(), time.thread_time()
    u3 = resource.getrusage(resource.RUSAGE_THREAD)
    print(f"census: {c.files} files, {c.dirs} dirs, wall {t1 - t0:.2f} s, cpu {c1 - c0:.2f} s = "
          f"{(c1 - c0) / c.files * 1e6:.1f} s cpu per 1M files")
    print(f"sort: cpu {c2 - c1:.2f} s")
    print(f"evict: {len(r.evicted)} blocks, {r.dirs_removed} dirs removed, cpu {c3 - c2:.3f} s = "
          f"{(c3 - c2) / max(1, len(r.evicted)) * 1e6:.1f} us cpu per evicted block, "
          f"wall {(t3 - t2) / max(1, len(r.evicted)) * 1e6:.1f} us; of the cpu: user (Python) "
          f"{u3.ru_utime - u2.ru_utime:.3f} s, system (kernel: lstat + unlink + rmdir) {u3.ru_stime - u2.ru_stime:.3f} s")


if __name__ == "__main__":
    main()
