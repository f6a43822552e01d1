#!/usr/bin/env python3
"""Where should kvtier._C.crc32c release the GIL? (KVT_GIL_RELEASE_MIN)

Measures, in one run:
1. the cost of one Py_BEGIN/END_ALLOW_THREADS pair, uncontended: the same
   trivial C function (libc labs) called through ctypes.PyDLL (keeps the GIL)
   and ctypes.CDLL (releases and re-acquires it around the call); the
   difference is the release+re-acquire cost;
2. the same with a second Python thread spinning (contended): the releasing
   caller has to get the GIL back from a CPU-bound thread, which can take up
   to sys.getswitchinterval();
3. the CRC time by size for every C backend (through crc32c_using; sizes
   below the current threshold run with the GIL held).

Rule used for KVT_GIL_RELEASE_MIN (csrc/py/args.h): release once the CRC on
the fastest backend takes at least 20x the uncontended release cost (the
release then costs <= 5 % of the call); holding the GIL below that blocks
other threads for at most a few microseconds.

    python benchmarks/gil_threshold.py [--quick]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time

import numpy as np

import kvtier
from kvtier import _C


def _per_call(fn, arg, min_time):
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(100):
            fn(arg)
        n += 100
        dt = time.perf_counter() - t0
        if dt >= min_time:
            return dt / n


def _best(fn, arg, min_time, reps=5):
    return min(_per_call(fn, arg, min_time) for _ in range(reps))


def gil_cost(min_time):
    libc_hold = ctypes.PyDLL(None).labs
    libc_free = ctypes.CDLL(None).labs
    for f in (libc_hold, libc_free):
        f.argtypes = [ctypes.c_long]
        f.restype = ctypes.c_long
    hold = _best(libc_hold, 1, min_time)
    free = _best(libc_free, 1, min_time)
    return hold, free


def contended(min_time):
    stop = threading.Event()

    def spin():
        x = 0
        while not stop.is_set():
            x += 1

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        return gil_cost(min_time)
    finally:
        stop.set()
        th.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter timings")
    args = ap.parse_args()
    mt = 0.02 if args.quick else 0.1

    hold, free = gil_cost(mt)
    cost = free - hold
    print(f"ctypes labs(), GIL kept:      {hold * 1e9:8.1f} ns/call")
    print(f"ctypes labs(), GIL released:  {free * 1e9:8.1f} ns/call")
    print(f"=> release + re-acquire (uncontended): {cost * 1e9:.1f} ns")
    c_hold, c_free = contended(mt * 5)
    print(f"with a CPU-bound Python thread: kept {c_hold * 1e6:.2f} us/call, released {c_free * 1e6:.2f} us/call "
          f"(switch interval {sys.getswitchinterval() * 1e3:.1f} ms)")
    print()

    backends = [b for b in kvtier.crc32c_backends() if b != "numpy"]
    sizes = [1 << k for k in range(8, 21)]
    buf = np.random.default_rng(0).integers(0, 256, sizes[-1], dtype=np.uint8)
    print(f"current KVT_GIL_RELEASE_MIN = {_C.GIL_RELEASE_MIN} bytes")
    print("CRC time per call (us) and release cost as % of it:")
    print(f"{'size':>9} " + " ".join(f"{b:>17}" for b in backends))
    first_ok = {}
    for n in sizes:
        mv = memoryview(buf)[:n]
        row = []
        for b in backends:
            t = _best(lambda d, b=b: kvtier.crc32c_using(b, d), mv, mt, reps=3)
            pct = 100 * cost / t
            row.append(f"{t * 1e6:8.2f} us {pct:5.1f}%")
            if pct <= 5 and b not in first_ok:
                first_ok[b] = n
        print(f"{n:>9} " + " ".join(f"{r:>17}" for r in row))
    print()
    for b in backends:
        print(f"{b:>8}: release cost <= 5% of the CRC from {first_ok.get(b, 'never in range')} bytes")


if __name__ == "__main__":
    main()
