"""One "node" of the two-node tests (tests/test_dfs.py): a kvtier tier in its own process
on one client mount of a distributed filesystem.

    python tests/dfs_node.py store|load ROOT --blocks N --block-bytes B --seed S
        [--checksum 0|1] [--o-direct 0|1] [--go FILE] [--until FILE] [--only I,J,...]

Block ``i`` holds ``blocks(seed, n, bs)[i]`` under key ``key(seed, i)``: both nodes derive
the same bytes and keys from the seed, so node B checks every byte node A stored without
sharing memory. ``--go FILE``: wait (bounded) until FILE exists before the first job, so two
nodes start together. ``--until FILE``: repeat the loads until FILE exists (bounded).
Prints one JSON object: ``passes``, ``loaded`` / ``missed`` (block indices, last pass),
``mismatched_bytes`` (over all passes, of blocks the tier reported loaded),
``checksum_failed`` (jobs), ``errors`` (errno names seen).
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import sys
import time

import numpy as np

MODEL = "kvtier/dfs-test"
WAIT_S = 60.0  # bound on --go / --until


def key(seed: int, i: int):
    return (hashlib.sha256(f"kvtier-dfs-{seed}-{i}".encode()).digest(), 0)


def blocks(seed: int, n: int, bs: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n * bs), dtype=np.uint8).reshape(n, bs)


def tier(buf: np.ndarray, root: str, checksum: bool, o_direct: bool, threads: int = 4, **kw):
    from kvtier.manager import FileSystemTierManager

    return FileSystemTierManager(buf, root, MODEL, n_read_threads=threads, n_write_threads=threads,
                                 checksum_blocks=checksum, use_o_direct=o_direct, **kw)


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"dfs_node: {path} did not appear within {WAIT_S} s")
        time.sleep(0.002)


def main(argv=None) -> int:
    from kvtier.manager import TransferJob

    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=("store", "load"))
    ap.add_argument("root")
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checksum", type=int, default=1)
    ap.add_argument("--o-direct", type=int, default=1)
    ap.add_argument("--go")
    ap.add_argument("--until")
    ap.add_argument("--only", default="")
    a = ap.parse_args(argv)
    src = blocks(a.seed, a.blocks, a.block_bytes)
    only = [int(x) for x in a.only.split(",") if x] or list(range(a.blocks))
    buf = src.copy() if a.op == "store" else np.zeros_like(src)
    t = tier(buf, a.root, bool(a.checksum), bool(a.o_direct))
    out = {"passes": 0, "loaded": [], "missed": [], "mismatched_bytes": 0, "checksum_failed": 0,
           "errors": [], "o_direct": t.use_o_direct}
    try:
        if a.go:
            _wait_for(a.go)
        deadline = time.monotonic() + WAIT_S
        while True:
            # one job per block: a miss in one block leaves the others' outcome visible
            for n, i in enumerate(only):
                job = TransferJob(n, [key(a.seed, i)], [i])
                (t.submit_load if a.op == "load" else t.submit_store)(job)
            if not t.drain_jobs(timeout=WAIT_S):
                raise SystemExit("dfs_node: jobs did not finish")
            res = {r.job_id: r for r in t.get_finished_jobs()}
            out["passes"] += 1
            out["loaded"], out["missed"] = [], []
            for n, i in enumerate(only):
                r = res[n]
                (out["loaded"] if r.success else out["missed"]).append(i)
                out["checksum_failed"] += bool(r.checksum_failed)
                if r.error is not None:
                    e = getattr(r.error, "errno", None)
                    name = errno.errorcode.get(e, str(e)) if e else type(r.error).__name__
                    if name not in out["errors"]:
                        out["errors"].append(name)
                        out.setdefault("messages", []).append(str(r.error))
                if a.op == "load" and r.success:
                    out["mismatched_bytes"] += int(np.count_nonzero(buf[i] != src[i]))
                    buf[i] = 0
            if a.op == "store" or not a.until or os.path.exists(a.until) or time.monotonic() > deadline:
                break
    finally:
        t.shutdown()
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
