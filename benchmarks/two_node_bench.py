#!/usr/bin/env python3
"""Two nodes on one distributed filesystem: kvtier (checksum off, on) and vLLM 0.33's fs tier
I/O (fs_io_C, no checksum) side by side in the two-client mode of ``kvtier bench``
(kvtier/cli/bench_nodes.py): two processes, one per client mount, store and load the same key
set at the same time; GB/s per node and total; every loaded byte verified.

This script adds one thing to ``kvtier bench --root A --node-b B``: ``--start`` brings up
GlusterFS or MooseFS with tests/dfs.py (servers in a network namespace, two FUSE clients
with the recommended options; root only) and tears it down after.

    python benchmarks/two_node_bench.py --start glusterfs
    python benchmarks/two_node_bench.py --start moosefs --repeat 5
    python benchmarks/two_node_bench.py --root /mnt/a/kv --node-b /mnt/b/kv   # your own mounts
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # tests/dfs.py

from kvtier.cli.bench_nodes import engines_for, format_table, run_two_clients  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--start", choices=("glusterfs", "moosefs"), help="start that filesystem with tests/dfs.py")
    g.add_argument("--root", help="node A's mount of the shared directory")
    ap.add_argument("--node-b", help="node B's mount of the same directory (with --root)")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per node per pass (default 64)")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--vllm", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    engines, note = engines_for("both", a.vllm)
    with contextlib.ExitStack() as stack:
        if a.start:
            import dfs

            c = stack.enter_context(dfs.cluster(a.start))
            root, node_b = c.mounts
            where = f"{a.start} started by tests/dfs.py (2 storage servers, clients with {' '.join(dfs.RECOMMENDED[a.start])})"
        else:
            if not a.node_b:
                ap.error("--root needs --node-b")
            root, node_b, where = a.root, a.node_b, "given mounts"
        d = run_two_clients(root, node_b, engines, a.preset, a.tokens, a.blocks, a.jobs, a.threads, True, a.repeat)
    d["where"], d["vllm_note"] = where, note
    d["command"] = "python benchmarks/two_node_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(d, indent=2) if a.json else f"# {d['command']}\n# {where}; {note}\n" + format_table(d))
    return 0 if d["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
