"""Stress runs of issue #24's fixes at the issue's fault rates (docs/reliability.md
"Stress runs (issue #24)" records their results). Not collected by pytest.

    python tests/stress_issue24.py short [RUNS]   # item 1: 10 % / 30 % half-then-EOF preads
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


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "short"
    {"short": short}[what](*map(int, sys.argv[2:]))
