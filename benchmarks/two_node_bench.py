#!/usr/bin/env python3
"""Two nodes on one distributed filesystem: kvtier (checksum off, on) and vLLM 0.33's fs tier
I/O side by side, in the two-client mode of ``kvtier bench`` (kvtier/bench_nodes.py): two
processes, one per client mount, store and load the same key set at the same time; GB/s per
node and total; every loaded byte verified.

The peer ("vLLM fs_io_C") is vLLM's own block I/O (``vllm.v1.kv_offload.tiering.fs.io``
with its C core, loaded as benchmarks/vs_vllm.py does: torch CPU libraries preloaded and
three empty stub libraries built with gcc) driven by vLLM's DualQueueThreadPool the way
its fs tier submits jobs (one task per job); vLLM 0.33 has no checksum.

    python benchmarks/two_node_bench.py --start glusterfs     # starts it (tests/dfs.py), root only
    python benchmarks/two_node_bench.py --start moosefs
    python benchmarks/two_node_bench.py --root /mnt/a/kv --peer-root /mnt/b/kv   # your own mounts
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # tests/dfs.py for --start

from kvtier.bench_nodes import KvtierEngine, format_table, run_two_clients  # noqa: E402

STUB_LIBS = ("libtorch_cuda.so", "libc10_cuda.so", "libnvrtc.so.13")


def load_vllm_io(workdir: str):
    """vLLM's fs tier io module with its C core loaded, or raise RuntimeError(reason)."""
    ts, vs = importlib.util.find_spec("torch"), importlib.util.find_spec("vllm")
    if ts is None or vs is None:
        raise RuntimeError("torch or vLLM not installed")
    tlib = os.path.join(ts.submodule_search_locations[0], "lib")
    for name in ("libc10.so", "libtorch_cpu.so", "libtorch.so"):
        ctypes.CDLL(os.path.join(tlib, name), mode=ctypes.RTLD_GLOBAL)
    for name in STUB_LIBS:
        out = os.path.join(workdir, name)
        if not os.path.exists(out):
            subprocess.run(["gcc", "-O2", "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o", out, "-x", "c", "-"],
                           input=b"", check=True, capture_output=True)
        ctypes.CDLL(out, mode=ctypes.RTLD_GLOBAL)
    import vllm.v1.kv_offload.tiering.fs.io as vio

    if not vio._HAS_FSIO_C:
        raise RuntimeError("vllm.fs_io_C did not load")
    return vio


class VllmEngine:
    """vLLM 0.33's fs tier I/O: batch_store_block / batch_load_block (fs_io_C) as one task
    per job on its DualQueueThreadPool; paths from kvtier's FileMapper (vLLM's layout)."""

    name = "vLLM fs_io_C (no checksum)"
    slug = "vllm"

    def open(self, buf, root, model, threads, o_direct):
        from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

        from kvtier.file_mapper import FileMapper

        self.vio = load_vllm_io(tempfile.gettempdir())
        self.fm = FileMapper(root, model)
        os.makedirs(self.fm.rank_path, exist_ok=True)
        self.view = memoryview(buf).cast("B")
        self.bs = buf.shape[1]
        self.o_direct = bool(o_direct and self.vio.probe_o_direct(self.fm.rank_path))
        self.pool = DualQueueThreadPool(threads, threads, thread_name_prefix="bench_vllm")

    def run(self, op, keys, jobs):
        import functools

        import numpy as np

        parts = np.array_split(np.arange(len(keys)), min(jobs, len(keys)))
        fn = self.vio.batch_load_block if op == "load" else self.vio.batch_store_block
        enqueue = self.pool.enqueue_load if op == "load" else self.pool.enqueue_store
        for j, rows in enumerate(parts):
            task = functools.partial(fn, [self.fm.get_file_name(keys[i]) for i in rows], self.view,
                                     [int(i) * self.bs for i in rows], self.bs, self.o_direct)
            enqueue(j, 1, [task])
        self.pool.wait_idle()
        done = {j: ok for j, ok, _ in self.pool.get_finished()}
        return [int(i) for j, rows in enumerate(parts) if done.get(j) for i in rows]

    def close(self):
        self.pool.shutdown()
        self.view.release()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--start", choices=("glusterfs", "moosefs"), help="start that filesystem with tests/dfs.py")
    g.add_argument("--root", help="node A's mount of the shared directory")
    ap.add_argument("--peer-root", help="node B's mount of the same directory (with --root)")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per node per pass (default 64)")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-vllm", action="store_true", help="kvtier only")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    engines = [KvtierEngine(False), KvtierEngine(True)]
    peer_note = "vLLM column skipped (--no-vllm)"
    if not a.no_vllm:
        try:
            load_vllm_io(tempfile.gettempdir())
            import vllm

            engines.insert(0, VllmEngine())
            peer_note = f"peer: vLLM {vllm.__version__} fs_io_C (torch CPU libs preloaded, stub {', '.join(STUB_LIBS)})"
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            peer_note = f"vLLM column skipped: {e}"
    with contextlib.ExitStack() as stack:
        if a.start:
            import dfs

            c = stack.enter_context(dfs.cluster(a.start))
            root, peer = c.mounts
            opts = " ".join(dfs.RECOMMENDED[a.start])
            where = f"{a.start} started by tests/dfs.py (2 storage servers, clients with {opts})"
        else:
            if not a.peer_root:
                ap.error("--root needs --peer-root")
            root, peer, where = a.root, a.peer_root, "given mounts"
        d = run_two_clients(root, peer, engines, a.preset, a.tokens, a.blocks, a.jobs, a.threads, True,
                            a.repeat)
    d["where"], d["peer_note"] = where, peer_note
    d["command"] = "python benchmarks/two_node_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.json:
        print(json.dumps(d, indent=2))
    else:
        print(f"# {d['command']}\n# {where}; {peer_note}\n" + format_table(d))
    return 0 if d["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
