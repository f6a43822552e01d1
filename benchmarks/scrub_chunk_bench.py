#!/usr/bin/env python3
"""Read-and-CRC32C rate of one file by chunk size: the basis for ``kvtier.cli.scrub._CHUNK``.

Hashes a FILE_MIB file (default 256 MiB, on /dev/shm so the device is out of the picture)
the way scrub does (os.preadv into one reused buffer, kvtier.crc32c per chunk), and the
way it did before (os.pread allocating a new bytes object per chunk); best of --repeat.

    python benchmarks/scrub_chunk_bench.py [--dir /dev/shm] [--file-mib 256] [--repeat 5]
"""
import argparse
import os
import tempfile
import time

import kvtier

CHUNKS = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--file-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    size = a.file_mib << 20
    fd_w, path = tempfile.mkstemp(dir=a.dir, suffix=".bin")
    try:
        with os.fdopen(fd_w, "wb") as f:
            for _ in range(a.file_mib):
                f.write(os.urandom(1 << 20))
        fd = os.open(path, os.O_RDONLY)
        want = None
        print(f"CRC32C backend {kvtier.crc32c_backend}, {a.file_mib} MiB file in {a.dir}, best of {a.repeat}")
        print(f"{'chunk':>9}  {'preadv reused GB/s':>18}  {'pread new GB/s':>14}  {'ratio':>6}")
        for chunk in CHUNKS:
            buf = bytearray(chunk)
            mv = memoryview(buf)
            res = {}
            for mode in ("preadv", "pread"):
                best = float("inf")
                for _ in range(a.repeat):
                    t = time.perf_counter()
                    off = crc = 0
                    while True:
                        if mode == "preadv":
                            n = os.preadv(fd, [buf], off)
                            b = mv[:n]
                        else:
                            b = os.pread(fd, chunk, off)
                            n = len(b)
                        if not n:
                            break
                        crc = kvtier.crc32c(b, crc)
                        off += n
                    best = min(best, time.perf_counter() - t)
                    assert off == size and (want is None or crc == want)
                    want = crc
                res[mode] = size / best / 1e9
            print(f"{chunk >> 10:>5} KiB  {res['preadv']:>18.2f}  {res['pread']:>14.2f}  "
                  f"{res['preadv'] / res['pread']:>6.2f}")
        os.close(fd)
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
