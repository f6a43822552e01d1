"""Stress runs of issue #24's fixes at the issue's fault rates (docs/reliability.md
"Stress runs (issue #24)" records their results). Not collected by pytest.

    python tests/stress_issue24.py short [RUNS]   # item 1: 10 % / 30 % half-then-EOF preads
    python tests/stress_issue24.py eagain [RUNS]  # item 5: every read/write EAGAIN (fusefault)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this tree's kvtier, not an installed one


def shim_path() -> str:
    out = os.path.join(tempfile.gettempdir(), "kvtier-stress-io_fault.so")
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", out, os.path.join(HERE, "c", "io_fault.c"), "-ldl"],
                   check=True)
    return out


def short(runs: int = 10) -> None:
    from test_issue24 import _LOAD_EACH, block_paths, blocks_of

    from kvtier import io as kio
    shim = shim_path()
    for backend in ("c", "python"):
        b = kio.for_backend(backend)
        for pct in (10, 30):
            deleted = misses = 0
            for seed in range(1, runs + 1):
                d = tempfile.mkdtemp(dir="/var/tmp")
                bs, n = 256 * 1024, 100
                paths = block_paths(d, n)
                view = blocks_of(n, bs, seed)
                b.batch_store_block(paths, view, [i * bs for i in range(n)], bs, checksum=True)
                spec = {"backend": backend, "paths": paths, "bs": bs,
                        "kw": {"checksum": True, "use_o_direct": False}}
                env = dict(os.environ, LD_PRELOAD=shim, KVT_FAULT_DIR=d, KVTIER_IO_BACKEND=backend,
                           KVT_FAULT_HALF_EOF=str(pct), KVT_FAULT_SEED=str(seed))
                r = subprocess.run([sys.executable, "-c", _LOAD_EACH, json.dumps(spec)], env=env,
                                   capture_output=True, text=True, check=True)
                misses += sum(not x["ok"] for x in json.loads(r.stdout))
                deleted += sum(not os.path.exists(p) for p in paths)
                shutil.rmtree(d)
            print(f"{backend:6s} {pct}% of preads half-then-EOF: {runs} runs x {n} good blocks: "
                  f"deleted {deleted}, misses {misses}", flush=True)


def eagain(runs: int = 20) -> None:
    import threading
    import time

    import numpy as np
    from fusefault.mount import mount_fusefault

    from kvtier import io as kio
    bs = 2 << 20
    with mount_fusefault(tempfile.mkdtemp(dir="/var/tmp")) as ff:
        for backend in ("c", "python"):
            b = kio.for_backend(backend)
            for o_direct in (True, False):
                calls = fails = 0
                worst = 0.0
                for i in range(runs):
                    p = os.path.join(ff.mnt, f"{backend}{int(o_direct)}", "m_0123456789ab_r0", "abc", "de_g0",
                                     f"{i:016x}.bin")
                    view = np.random.default_rng(i).integers(0, 256, bs, dtype=np.uint8)
                    b.batch_store_block([p], view, [0], bs, checksum=True, use_o_direct=o_direct)
                    ff.add("eagain", "/" + os.path.relpath(p, ff.mnt) + "*", count=-1)
                    out = np.zeros(bs, np.uint8)
                    for job in (lambda: b.batch_load_block([p], out, [0], bs, checksum=True, use_o_direct=o_direct),
                                lambda: b.batch_store_block([p + "x"], view, [0], bs, checksum=True,
                                                            use_o_direct=o_direct)):
                        res = {}

                        def run():
                            t0 = time.monotonic()
                            try:
                                job()
                            except OSError as e:
                                res["e"] = e.errno
                            res["t"] = time.monotonic() - t0
                        t = threading.Thread(target=run, daemon=True)
                        t.start()
                        t.join(30)
                        fails += res.get("e") == 11
                        worst = max(worst, res.get("t", 30.0))
                    calls += ff.hits("eagain")
                    ff.clear()
                print(f"{backend:6s} {'O_DIRECT' if o_direct else 'buffered'}: {runs} loads + {runs} checksummed "
                      f"2 MiB stores, every read/write EAGAIN: {fails} failed with EAGAIN, {calls} filesystem "
                      f"calls in all, slowest {worst * 1000:.1f} ms", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "short"
    {"short": short, "eagain": eagain}[what](*map(int, sys.argv[2:]))
