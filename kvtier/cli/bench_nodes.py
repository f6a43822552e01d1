"""Two-client mode of ``kvtier bench`` (``--root A --node-b B``): two processes, one per
mount of the same shared directory (two nodes of a distributed filesystem), store and load
the same key set at the same time.

Each pass starts on both nodes together (a barrier), and each node times its own pass:
GB/s per node = its bytes / its wall time; total = both nodes' bytes / (last end - first
start). Every loaded byte is compared with what was stored. Engines (checksum off, on, or a
vLLM's) take turns within each repeat, first one
alternating, each repeat storing into fresh directories; medians over the repeats.
The engines: kvtier checksum off and on, and vLLM 0.33's own fs tier I/O (fs_io_C, no
checksum, :class:`VllmEngine`) where it loads (``--vllm auto|on|off``, :mod:`kvtier.cli.peer`).
"""
from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Dict, List, Tuple

import numpy as np

SYNC_TIMEOUT_S = 900.0  # a node waiting longer for the other at a barrier gives up


class KvtierEngine:
    """kvtier's tier (FileSystemTierManager), checksums ``checksum``; one job per
    ``1/jobs`` of the keys, all submitted at once."""

    def __init__(self, checksum: bool):
        self.checksum = checksum
        self.name = f"kvtier checksum {'on' if checksum else 'off'}"
        self.slug = f"kvtier-{'on' if checksum else 'off'}"

    def open(self, buf: np.ndarray, root: str, model: str, threads: int, o_direct: bool) -> None:
        from kvtier.manager import FileSystemTierManager

        self.tier = FileSystemTierManager(buf, root, model, n_read_threads=threads, n_write_threads=threads,
                                          checksum_blocks=self.checksum, use_o_direct=o_direct)
        self.o_direct = self.tier.use_o_direct

    def run(self, op: str, keys, jobs: int) -> List[int]:
        """Rows of ``keys`` moved (the others failed)."""
        from kvtier.manager import TransferJob

        parts = np.array_split(np.arange(len(keys)), min(jobs, len(keys)))
        submit = self.tier.submit_load if op == "load" else self.tier.submit_store
        for j, rows in enumerate(parts):
            submit(TransferJob(j, [keys[i] for i in rows], [int(i) for i in rows]))
        if not self.tier.drain_jobs(timeout=SYNC_TIMEOUT_S):
            raise RuntimeError("jobs did not finish")
        ok = []
        by_id = {r.job_id: r for r in self.tier.get_finished_jobs()}
        for j, rows in enumerate(parts):
            ok += [int(i) for i in rows[:len(by_id[j].successful_keys)]]  # a failed job: its first n
        return ok

    def close(self) -> None:
        self.tier.shutdown()


class VllmEngine:
    """vLLM 0.33's fs tier I/O: ``batch_store_block`` / ``batch_load_block`` (fs_io_C) as one
    task per job on vLLM's DualQueueThreadPool, as its fs tier submits them; paths from
    kvtier's FileMapper (vLLM's layout)."""

    name = "vLLM fs_io_C (no checksum)"
    slug = "vllm"

    def open(self, buf: np.ndarray, root: str, model: str, threads: int, o_direct: bool) -> None:
        from kvtier.file_mapper import FileMapper
        from kvtier.cli.peer import load_vllm_io

        self.vio, note = load_vllm_io()
        if self.vio is None:
            raise RuntimeError(f"vLLM fs tier io: {note}")
        from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

        self.fm = FileMapper(root, model)
        os.makedirs(self.fm.rank_path, exist_ok=True)
        self.view = memoryview(buf).cast("B")
        self.bs = buf.shape[1]
        self.o_direct = bool(o_direct and self.vio.probe_o_direct(self.fm.rank_path))
        self.pool = DualQueueThreadPool(threads, threads, thread_name_prefix="bench_vllm")

    def run(self, op: str, keys, jobs: int) -> List[int]:
        import functools

        parts = np.array_split(np.arange(len(keys)), min(jobs, len(keys)))
        fn = self.vio.batch_load_block if op == "load" else self.vio.batch_store_block
        enqueue = self.pool.enqueue_load if op == "load" else self.pool.enqueue_store
        for j, rows in enumerate(parts):
            enqueue(j, 1, [functools.partial(fn, [self.fm.get_file_name(keys[i]) for i in rows], self.view,
                                             [int(i) * self.bs for i in rows], self.bs, self.o_direct)])
        self.pool.wait_idle()
        done = {j: ok for j, ok, _ in self.pool.get_finished()}
        return [int(i) for j, rows in enumerate(parts) if done.get(j) for i in rows]

    def close(self) -> None:
        self.pool.shutdown()
        self.view.release()


def engines_for(checksum: str = "both", vllm: str = "auto") -> Tuple[list, str]:
    """The engines of a run and a note on the vLLM column: ``checksum`` both/off/on,
    ``vllm`` auto (when it loads) / on (ValueError when it does not) / off."""
    engines: list = [KvtierEngine(c) for c in {"both": (False, True), "off": (False,), "on": (True,)}[checksum]]
    if vllm == "off":
        return engines, "vLLM column: not asked for (--vllm off)"
    from kvtier.cli.peer import load_vllm_io

    vio, note = load_vllm_io()
    if vio is None:
        if vllm == "on":
            raise ValueError(f"--vllm on: {note}")
        return engines, f"vLLM column skipped: {note}"
    return [VllmEngine(), *engines], f"vLLM column: {note}"


def _node(idx, root, engines, cfg, barrier, results):
    """One node: run the schedule, put (idx, passes) or (idx, error text) on ``results``."""
    try:
        from kvtier.cli.presets import PRESETS

        p = PRESETS[cfg["preset"]]
        bs = p.block_bytes(cfg["tokens"])
        rng = np.random.default_rng(cfg["seed"])
        src = np.frombuffer(rng.bytes(cfg["blocks"] * bs), dtype=np.uint8).reshape(cfg["blocks"], bs)
        keys = [(rng.bytes(32), 0) for _ in range(cfg["blocks"])]
        # page-aligned, as vLLM's primary (an mmap in /dev/shm): O_DIRECT straight from it
        buf = np.frombuffer(mmap.mmap(-1, src.nbytes), dtype=np.uint8).reshape(src.shape)
        passes = []
        o_direct = {}
        for r in range(cfg["repeat"]):
            order = engines if r % 2 == 0 else list(reversed(engines))
            for op in ("store", "load"):
                if op == "load":  # let the other client's name cache see the stores (GlusterFS: ~1 s)
                    time.sleep(cfg["settle_s"])
                for e in order:
                    eroot = os.path.join(root, e.slug, f"r{r}")
                    if op == "store":
                        buf[:] = src
                    else:
                        buf.fill(0)
                    e.open(buf, eroot, p.model, cfg["threads"], cfg["o_direct"])
                    o_direct[e.name] = e.o_direct
                    try:
                        barrier.wait(SYNC_TIMEOUT_S)
                        t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for both processes
                        ok = e.run(op, keys, cfg["jobs"])
                        t1 = time.monotonic()
                    finally:
                        e.close()
                    bad = sum(int(np.count_nonzero(buf[i] != src[i])) for i in ok) if op == "load" else 0
                    passes.append({"engine": e.name, "op": op, "repeat": r, "t0": t0, "t1": t1, "blocks": len(ok),
                                   "bytes": len(ok) * bs, "failed_blocks": cfg["blocks"] - len(ok),
                                   "mismatched_bytes": bad})
        results.put((idx, {"passes": passes, "block_bytes": bs, "o_direct": o_direct}))
    except BaseException:
        barrier.abort()
        results.put((idx, traceback.format_exc()))


def run_two_clients(root: str, node_b: str, engines=None, preset: str = "llama-3.1-8b", tokens: int = 16,
                    blocks: int = 64, jobs: int = 16, threads: int = 16, o_direct: bool = True, repeat: int = 3,
                    seed: int = 0, visible_timeout: float = 30.0, settle_s: float = 2.0) -> dict:
    """Run the two-client benchmark; returns a dict with ``rows`` (per engine and op: GB/s
    of node A, node B, total; medians) and ``ok`` (no failed block, no mismatched byte).

    ``root`` and ``node_b``: the same directory through two mounts. Raises ValueError
    if a directory made under ``root`` does not appear under ``node_b`` within
    ``visible_timeout`` s, or for bad sizes; RuntimeError if a node fails. ``settle_s``:
    pause (untimed) between the store passes and the load passes of a repeat."""
    from kvtier.cli.presets import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}")
    for name, v in (("tokens", tokens), ("blocks", blocks), ("jobs", jobs), ("threads", threads), ("repeat", repeat)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    engines = engines or [KvtierEngine(False), KvtierEngine(True)]
    base = tempfile.mkdtemp(prefix="kvtier-bench2-", dir=root)
    base_b = os.path.join(node_b, os.path.basename(base))
    try:
        t0 = time.monotonic()
        while not os.path.isdir(base_b):
            if time.monotonic() - t0 > visible_timeout:
                raise ValueError(f"--node-b {node_b!r} does not show {os.path.basename(base)} made under "
                                 f"--root {root!r} within {visible_timeout:g} s: not the same directory")
            time.sleep(0.05)
        cfg = {"preset": preset, "tokens": tokens, "blocks": blocks, "jobs": jobs, "threads": threads,
               "o_direct": o_direct, "repeat": repeat, "seed": seed, "settle_s": settle_s}
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_node, args=(i, d, engines, cfg, barrier, results), daemon=True)
                 for i, d in enumerate((base, base_b))]
        for pr in procs:
            pr.start()
        out: Dict[int, object] = {}
        deadline = time.monotonic() + SYNC_TIMEOUT_S * (2 * len(engines) * repeat + 1)
        while len(out) < 2:
            try:
                i, v = results.get(timeout=5)
                out[i] = v
            except Exception:  # queue.Empty: check the nodes are alive
                dead = [pr for pr in procs if pr.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"a node died (exit {[pr.exitcode for pr in procs]})") from None
        for pr in procs:
            pr.join(60)
        errs = [v for v in out.values() if isinstance(v, str)]
        if errs:
            raise RuntimeError("a node failed:\n" + "\n".join(errs))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    a, b = out[0], out[1]
    rows = []
    for e in engines:
        for op in ("store", "load"):
            per = {"a": [], "b": [], "total": []}
            fails = bad = 0
            for r in range(repeat):
                pa = next(x for x in a["passes"] if (x["engine"], x["op"], x["repeat"]) == (e.name, op, r))
                pb = next(x for x in b["passes"] if (x["engine"], x["op"], x["repeat"]) == (e.name, op, r))
                per["a"].append(pa["bytes"] / (pa["t1"] - pa["t0"]) / 1e9)
                per["b"].append(pb["bytes"] / (pb["t1"] - pb["t0"]) / 1e9)
                per["total"].append((pa["bytes"] + pb["bytes"]) / (max(pa["t1"], pb["t1"]) - min(pa["t0"], pb["t0"])) / 1e9)
                fails += pa["failed_blocks"] + pb["failed_blocks"]
                bad += pa["mismatched_bytes"] + pb["mismatched_bytes"]
            rows.append({"engine": e.name, "op": op, "gbps_a": statistics.median(per["a"]),
                         "gbps_b": statistics.median(per["b"]), "gbps_total": statistics.median(per["total"]),
                         "failed_blocks": fails, "mismatched_bytes": bad, "o_direct": a["o_direct"][e.name]})
    from kvtier.manager import filesystem_type

    return {"root": root, "node_b": node_b, "fstype": filesystem_type(root)[0], "preset": preset,
            "block_bytes": a["block_bytes"], "blocks": blocks, "jobs": jobs, "threads": threads, "repeat": repeat,
            "settle_s": settle_s, "rows": rows, "ok": all(r["failed_blocks"] == 0 and r["mismatched_bytes"] == 0 for r in rows)}


def format_table(d: dict) -> str:
    from kvtier.cli._text import human_bytes

    lines = [f"kvtier bench, two clients: node A {d['root']}, node B {d['node_b']} ({d['fstype']}); "
             f"{d['preset']}, {d['blocks']} blocks of {human_bytes(d['block_bytes'], 2)} = "
             f"{human_bytes(d['blocks'] * d['block_bytes'], 2)} per node per pass, same keys on both; "
             f"{d['jobs']} jobs, {d['threads']}+{d['threads']} threads per node; median of {d['repeat']}; "
             f"{d['settle_s']:g} s pause before the loads", ""]
    hdr = f"{'engine':<28}{'op':<7}{'I/O':<9}| {'A GB/s':>7}{'B GB/s':>8}{'total':>8} | {'failed':>6}{'wrong B':>8}"
    lines += [hdr, "-" * len(hdr)]
    for r in d["rows"]:
        lines.append(f"{r['engine']:<28}{r['op']:<7}{'O_DIRECT' if r['o_direct'] else 'buffered':<9}| "
                     f"{r['gbps_a']:7.2f}{r['gbps_b']:8.2f}{r['gbps_total']:8.2f} | "
                     f"{r['failed_blocks']:6d}{r['mismatched_bytes']:8d}")
    lines += ["", "OK: every block moved, every loaded byte verified" if d["ok"] else
              "FAILED: failed blocks or mismatched bytes"]
    return "\n".join(lines)


def cmd_two_clients(args) -> int:
    """``kvtier bench --root A --node-b B``: exit 0 ok, 1 failed blocks or wrong bytes, 2 bad setup."""
    import json

    if args.root is None:  # "" is refused as a path below
        print("kvtier bench: --node-b needs --root (node A's mount of the same directory)", file=sys.stderr)
        return 2
    from kvtier.cli._text import EXIT_USAGE, dir_error

    for opt, path in (("--root", args.root), ("--node-b", args.node_b)):
        err = dir_error(path)
        if err is not None:  # else the error names a temp under it
            print(f"kvtier bench: {opt} {err}", file=sys.stderr)
            return EXIT_USAGE
    try:
        jobs = max(int(x) for x in args.jobs.split(",") if x.strip())
        engines, note = engines_for(args.checksum, args.vllm)
        d = run_two_clients(args.root, args.node_b, engines, args.preset, args.tokens, args.blocks, jobs,
                            args.threads, not args.no_o_direct, args.repeat, args.seed)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"kvtier bench: {e}", file=sys.stderr)
        return 2
    d["vllm_note"] = note
    print(json.dumps(d, indent=2) if args.json else format_table(d) + f"\n{note}")
    return 0 if d["ok"] else 1
