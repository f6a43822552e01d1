#!/usr/bin/env python3
"""Intel DSA offload of CRC32C vs the CPU backends, by size (4 KiB .. 16 MiB).

With a usable DSA work queue (the "dsa" backend enables and passes its
self-check) it prints, per size, GB/s and CPU seconds per GB of
  - CRC:       each CPU backend vs DSA CRCGEN
  - copy+CRC:  memcpy + CPU CRC vs one fused DSA COPY_CRC
with the ratio against the best CPU backend in the same run, to locate the
break-even that the min-size gate (KVTIER_DSA_MIN_SIZE, default 16 KiB)
should sit at. The DSA engine runs with min_size=0 here so small sizes are
really offloaded, and with wait=sleep so the CPU column shows what the
waiting thread costs (use --wait to change).

Without DSA it says so and exits 0. `--model` then runs the same table on the
software model ("dsa-model") as a FUNCTION check: its numbers are a thread
running table-driven CRC, not DSA performance.

    python benchmarks/dsa_bench.py [--quick] [--model] [--wait spin|yield|sleep]
"""
import argparse
import sys
import time

import kvtier
from kvtier import _C, dsa

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def measure(fn, nbytes, min_time):
    """Run fn until min_time wall seconds; returns (GB/s, CPU s per GB)."""
    fn()  # warm
    n = 0
    w0, c0 = time.perf_counter(), time.process_time()
    while True:
        fn()
        n += 1
        w = time.perf_counter() - w0
        if w >= min_time:
            break
    c = time.process_time() - c0
    gb = n * nbytes / 1e9
    return gb / w, c / gb


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes, shorter runs")
    ap.add_argument("--model", action="store_true",
                    help="without DSA: run the software model as a function check (not performance)")
    ap.add_argument("--wait", default="sleep", choices=["spin", "yield", "sleep"])
    args = ap.parse_args(argv)

    have_dsa = _C is not None and dsa.enable()
    if have_dsa:
        backend = "dsa"
    else:
        print(f"no usable DSA device: {dsa.describe().splitlines()[0] if _C is not None else 'C core not built'}")
        if not args.model:
            print("nothing to measure; run with --model for a function check on the software model")
            return 0
        if not dsa.enable_model():
            print("dsa-model failed its self-check:", dsa.status("dsa-model")["reason"])
            return 1
        backend = "dsa-model"
        print("*** dsa-model: SOFTWARE MODEL — function check only, NOT a performance number ***")
    dsa.configure(backend, min_size=0, wait=args.wait)

    sizes = SIZES[::2] if args.quick else SIZES
    min_time = 0.05 if args.quick else 0.3
    import numpy as np

    cpu_backends = [b for b in kvtier.crc32c_backends() if b not in ("dsa", "dsa-model", "numpy")]
    print(f"# {backend} (wait={args.wait}) vs CPU backends {cpu_backends}; "
          f"GB/s and CPU s/GB; ratio = GB/s vs best CPU in this run")
    print(f"{'op':9} {'size':>8} {'backend':>10} {'GB/s':>8} {'cpu s/GB':>9} {'ratio':>6}")
    failures = 0
    for size in sizes:
        src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        dst = np.empty_like(src)
        ref = kvtier.crc32c_using(cpu_backends[0], src)
        # CRC
        rows = [(b, *measure(lambda b=b: kvtier.crc32c_using(b, src), size, min_time)) for b in cpu_backends]
        best = max(r[1] for r in rows)
        dsa.reset_counters(backend)
        got = kvtier.crc32c_using(backend, src)
        rows.append((backend, *measure(lambda: kvtier.crc32c_using(backend, src), size, min_time)))
        c = dsa.counters(backend)
        if got != ref or c["cpu_redo_total"]:
            failures += 1
            print(f"!! {backend} CRC mismatch or CPU redo at {size} B: {c}")
        for b, gbs, cpu in rows:
            print(f"{'crc':9} {size:>8} {b:>10} {gbs:8.2f} {cpu:9.3f} {gbs / best:6.2f}")
        # copy + CRC
        best_cpu = cpu_backends[0]

        def cpu_copy_crc():
            np.copyto(dst, src)
            return kvtier.crc32c_using(best_cpu, dst)

        r_cpu = measure(cpu_copy_crc, size, min_time)
        dst[:] = 0
        got = dsa.copy_crc(dst, src, 0, backend=backend)
        if got != ref or not np.array_equal(dst, src):
            failures += 1
            print(f"!! {backend} COPY_CRC mismatch at {size} B")
        r_dsa = measure(lambda: dsa.copy_crc(dst, src, 0, backend=backend), size, min_time)
        print(f"{'copy+crc':9} {size:>8} {'memcpy+' + best_cpu:>10} {r_cpu[0]:8.2f} {r_cpu[1]:9.3f} {1.0:6.2f}")
        print(f"{'copy+crc':9} {size:>8} {backend:>10} {r_dsa[0]:8.2f} {r_dsa[1]:9.3f} {r_dsa[0] / r_cpu[0]:6.2f}")
    print("counters:", dsa.counters(backend))
    if backend == "dsa-model":
        print("*** dsa-model numbers above are NOT DSA performance ***")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
