"""``kvtier bench``: store and load real-model-sized KV blocks through the tier manager.

It fills a primary buffer (numpy) with random bytes, stores N blocks through
:class:`kvtier.manager.FileSystemTierManager` into a temp directory (or ``--root``),
loads them back with 1, 4 and 16 jobs in flight, with checksums off and on, and, when
vLLM 0.33 is installed, with vLLM's own fs tier I/O (its C++ fs_io_C, no checksums, the
same jobs on a pool of the same size); verifies every byte loaded, and prints GB/s with
its spread over the repeats, p50/p99 job latency and process CPU seconds per GiB moved
(not per pass: a load pass runs as many rounds as fit its time, so passes of different
modes move different amounts), with the on/off and on/vLLM ratios.  Exit status 1 if any byte differs or a job fails.

Fair by construction: every mode loads the same files (stored with checksums on; a
mode without checksums ignores the record), the modes take turns pass by pass (the
order alternating between repeats), and a load pass repeats its jobs until it has
run at least ``--min-pass-s`` seconds, so a pass is not one burst of a few ms. A round
is one job set moving every block once; a store pass is one round (a fresh copy of
the blocks), a load pass one or more rounds.
Every store pass (vLLM's too) starts from an empty root directory and creates the
blocks' directories (the same two-level layout, :mod:`kvtier.file_mapper`'s) while timed.

Block geometry (bytes per block) = 2 (K and V) x layers x KV heads x head dim x dtype
bytes x tokens per block: one file holds every layer's K and V for ``--tokens`` tokens,
as in vLLM's FS offload tier.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import numpy as np

from kvtier.cli._text import EXIT_USAGE, dir_error, human_bytes
from kvtier.cli.presets import DEFAULT_PRESET, PRESETS

DEFAULT_TOKENS = 16
DEFAULT_BLOCKS = 192
DEFAULT_JOBS = (1, 4, 16)
DEFAULT_REPEAT = 3
DEFAULT_MIN_PASS_S = 1.0


@dataclass
class Row:
    """One table cell: ``op`` over ``jobs`` jobs in flight, in ``mode`` "off" / "on"
    (kvtier, checksums ``checksum``) or "vllm" (vLLM's own fs tier I/O).

    ``blocks`` and ``bytes``: moved per round; a load pass runs ``rounds`` rounds (median
    over the repeats), a store pass one.  ``gbps_min`` / ``gbps_max``: the spread of GB/s over the repeats.
    Medians over ``--repeat`` passes:
    ``wall_s`` (seconds, first submit to last job done), ``cpu_s`` (seconds of process CPU
    time, user+sys of all threads, ``time.process_time``, per pass), ``cpu_s_per_gib`` (the
    pass's CPU seconds / the GiB it moved, ``bytes x rounds / 2**30``: comparable between
    modes whose passes ran different numbers of rounds), ``gbps`` (``bytes / wall_s / 1e9``,
    decimal GB/s).  ``p50_ms`` / ``p99_ms``: percentiles of job latency (submit to done,
    milliseconds) over all passes.  Sums over all passes: ``failed_jobs`` (JobResult.success
    false), ``checksum_failures`` (jobs with a condemned block), ``mismatched_bytes`` (loaded
    bytes that differ from what was stored; loads only, 0 for stores).
    """

    op: str  # "store" or "load"
    jobs: int
    checksum: bool
    mode: str  # "off", "on", "vllm"
    blocks: int
    bytes: int
    wall_s: float
    cpu_s: float
    gbps: float
    p50_ms: float
    p99_ms: float
    failed_jobs: int
    checksum_failures: int
    mismatched_bytes: int  # loads only
    gbps_min: float
    gbps_max: float
    rounds: int
    cpu_s_per_gib: float


def _percentile(xs: List[float], q: float) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def _split(n: int, parts: int) -> List[range]:
    q, r = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = q + (1 if i < r else 0)
        if size:
            out.append(range(start, start + size))
        start += size
    return out


def _mismatched_bytes(a: np.ndarray, b: np.ndarray, rows) -> int:
    """Number of differing bytes between rows ``rows`` of two equal-shape uint8 arrays
    (one block per row; row by row, low memory)."""
    n = 0
    for i in rows:
        if not np.array_equal(a[i], b[i]):
            n += int(np.count_nonzero(a[i] != b[i]))
    return n


class _PeerResult:
    """A JobResult-shaped outcome of a vLLM peer job."""

    def __init__(self, keys, ok, transfer_time):
        self.success = ok
        self.successful_keys = keys if ok else ()
        self.checksum_failed = False
        self.transfer_time = transfer_time


def _rounds(run_round, op: str, min_s: float):
    """Call ``run_round()`` (one round of jobs, returns their results) once; for loads,
    again until ``min_s`` seconds have passed.  Returns (wall s, cpu s, latencies s,
    results of the last round, rounds, failed jobs of all rounds)."""
    lat, failed, rounds = [], 0, 0
    c0, t0 = time.process_time(), time.perf_counter()
    while True:
        results = run_round()
        rounds += 1
        lat += [r.transfer_time for r in results]
        failed += sum(not r.success for r in results)
        if op != "load" or time.perf_counter() - t0 >= min_s:
            break
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, lat, results, rounds, failed


def _pass(mgr, op: str, keys, n_jobs: int, job_base: int, min_s: float = 0.0):
    """Submit all jobs of a round at once, wait (see :func:`_rounds`)."""
    from kvtier.manager import TransferJob

    submit = mgr.submit_load if op == "load" else mgr.submit_store
    base = [job_base]

    def run_round():
        jobs = [TransferJob(base[0] + j, [keys[i] for i in rng], list(rng), op == "load")
                for j, rng in enumerate(_split(len(keys), n_jobs))]
        base[0] += len(jobs)
        for j in jobs:
            submit(j)
        if not mgr.drain_jobs(timeout=3600):
            raise RuntimeError("bench pass did not finish in an hour")
        return mgr.get_finished_jobs()

    return _rounds(run_round, op, min_s)


def _peer_pass(vio, pool, op: str, keys, paths, view, bs: int, n_jobs: int, use_o_direct: bool, min_s: float):
    """The same pass through vLLM's fs tier io on ``pool`` (a ThreadPoolExecutor of the
    tier's size): each job one batch_store_block / batch_load_block call."""
    fn = vio.batch_load_block if op == "load" else vio.batch_store_block

    def job(rng):
        t = time.perf_counter()
        try:
            fn([paths[i] for i in rng], view, [i * bs for i in rng], bs, use_o_direct)
            ok = True
        except OSError:
            ok = False
        return _PeerResult([keys[i] for i in rng], ok, time.perf_counter() - t)

    return _rounds(lambda: list(pool.map(job, _split(len(keys), n_jobs))), op, min_s)


def run_bench(preset: str = DEFAULT_PRESET, tokens: int = DEFAULT_TOKENS, blocks: int = DEFAULT_BLOCKS,
              jobs=DEFAULT_JOBS, root: Optional[str] = None, checksums=(False, True),
              threads: int = 16, use_o_direct: bool = True, repeat: int = 1, seed: int = 0,
              progress: bool = True, keep: bool = False, vllm: str = "auto",
              min_pass_s: float = DEFAULT_MIN_PASS_S) -> dict:
    """Run the benchmark; returns a dict (``rows``: list of :class:`Row` dicts, plus the setup;
    ``vllm``: the peer's description, or why it is absent).

    ``vllm``: "auto" (the vLLM column when vLLM's fs tier io loads, see :mod:`kvtier.cli.peer`),
    "on" (ValueError if it does not), "off".  Raises ValueError for bad arguments (unknown
    preset, non-positive sizes, or 2 x ``blocks`` x block bytes more than MemAvailable in
    /proc/meminfo); OSError ENOSPC (filename = the root) before any store when the root's
    filesystem reports less free space than the modes' copies of the blocks (rounded up to
    its blocks, plus metadata).
    """
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from kvtier.manager import FileSystemTierManager, filesystem_type

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    for name, v in (("tokens", tokens), ("blocks", blocks), ("threads", threads), ("repeat", repeat)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if vllm not in ("auto", "on", "off"):
        raise ValueError(f"vllm must be auto, on or off, got {vllm!r}")
    if not min_pass_s >= 0:
        raise ValueError(f"min_pass_s must be >= 0 seconds, got {min_pass_s!r}")
    jobs = tuple(jobs)
    if not jobs or any((not isinstance(j, int)) or j < 1 for j in jobs):
        raise ValueError(f"jobs must be positive ints, got {jobs!r}")
    p = PRESETS[preset]
    bs = p.block_bytes(tokens)
    hash_bs = 16 if tokens % 16 == 0 else tokens
    groups = [{"tokens_per_block": hash_bs, "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(p.layers)]}]
    vio, vnote = None, "not asked for (--vllm off)"
    if vllm != "off":
        from kvtier.cli.peer import load_vllm_io

        vio, vnote = load_vllm_io()
        if vio is None and vllm == "on":
            raise ValueError(f"--vllm on: {vnote}")
    modes = [("on" if ck else "off") for ck in checksums] + (["vllm"] if vio is not None else [])

    # the source and the load buffer: refuse up front rather than fill a shared host's memory
    need_ram, avail_ram = 2 * blocks * bs, _mem_available()
    if avail_ram is not None and need_ram > avail_ram:
        raise ValueError(f"needs {human_bytes(need_ram, 2)} of RAM (source and load buffers, 2 x {blocks} blocks of "
                         f"{human_bytes(bs, 2)}), {human_bytes(avail_ram, 2)} available (MemAvailable); use --blocks")
    rng = np.random.default_rng(seed)
    src = np.frombuffer(rng.bytes(blocks * bs), dtype=np.uint8).reshape(blocks, bs)
    # the primary tier: page-aligned, as vLLM's CPU tier (an mmap), so O_DIRECT applies to every mode
    import mmap

    buf = np.frombuffer(mmap.mmap(-1, blocks * bs), dtype=np.uint8).reshape(blocks, bs)
    keys = [(rng.bytes(32), 0) for _ in range(blocks)]
    key_row = {k: i for i, k in enumerate(keys)}
    verified = 0  # bytes of loaded blocks compared with the source

    base = tempfile.mkdtemp(prefix="kvtier-bench-", dir=root)
    n_passes = len(modes) * repeat * (1 + len(jobs))
    bar = tqdm(total=n_passes, desc="kvtier bench", unit="pass", file=sys.stderr,
               disable=None if progress else True, leave=False)  # None: only on a terminal
    rows: List[Row] = []
    mgrs = {}
    samples = {}
    info = {}
    job_base = 0
    peer_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-bench-vllm") if vio is not None else None
    try:
        # Loads of every mode read one set of files ("blocks", stored by the checksummed
        # store pass when there is one); the other store passes write their own copy.
        # Refuse up front rather than time a run of ENOSPC failures (each block rounded up
        # to whole filesystem blocks, plus one for its inode's xattr and 64 KiB per copy for
        # config.json / kvtier.json and the directories).
        st = os.statvfs(base)
        frag = st.f_frsize or 4096
        need = len(modes) * (blocks * (-(-bs // frag) + 1) * frag + 64 * 1024)
        free = st.f_bavail * st.f_frsize
        if st.f_blocks and free < need:  # f_blocks 0: no size reported (ramfs): nothing to check
            raise OSError(errno.ENOSPC, f"needs {human_bytes(need, 2)} free ({len(modes)} x {blocks} blocks of "
                          f"{human_bytes(bs, 2)}, each rounded up to {human_bytes(frag)} filesystem blocks, plus one "
                          f"for its xattr and 64 KiB per copy for config files and directories), "
                          f"{human_bytes(free, 2)} available; use --blocks or another --root",
                          root or os.path.dirname(base))
        load_src = "on" if "on" in modes else "off"  # whose store pass writes the shared files

        def manager(ck, where):
            return FileSystemTierManager(
                buf, os.path.join(base, where), p.model, tokens_per_hash=hash_bs,
                blocks_per_file=tokens // hash_bs, dtype=p.dtype, kv_cache_groups=groups,
                n_read_threads=threads, n_write_threads=threads, checksum_blocks=ck,
                use_o_direct=use_o_direct)

        for m in ("off", "on"):
            if m in modes:
                mgrs[("load", m)] = manager(m == "on", "blocks")
                mgrs[("store", m)] = mgrs[("load", m)] if m == load_src else manager(m == "on", m)
        fstype, mnt = filesystem_type(base)
        o_direct = all(m.use_o_direct for m in mgrs.values())
        info = {"fstype": fstype, "mount": mnt, "o_direct": o_direct}
        blocks_mgr = mgrs[("load", load_src)]
        load_paths = blocks_mgr.file_mapper.get_file_names(keys)
        peer_view = memoryview(buf).cast("B")
        if vio is not None:  # the same layout as kvtier's (kvtier.file_mapper) in a root of its own
            peer_root = os.path.join(base, "vllm")
            peer_paths = [os.path.join(peer_root, os.path.relpath(x, blocks_mgr.file_mapper.rank_path))
                          for x in load_paths]

        def add(op, n_jobs, mode, samples):
            wall = [s[0] for s in samples]
            cpu = [s[1] for s in samples]
            lat = [x for s in samples for x in s[2]]
            rounds = [s[4] for s in samples]
            gb = [blocks * bs * s[4] / s[0] / 1e9 for s in samples]
            per_gib = [s[1] / (blocks * bs * s[4] / 2**30) for s in samples]  # CPU per GiB moved, per pass
            w = statistics.median(wall)
            k = statistics.median(rounds)
            rows.append(Row(op, n_jobs, mode == "on", mode, blocks, blocks * bs, w, statistics.median(cpu),
                            statistics.median(gb), _percentile(lat, 50) * 1e3, _percentile(lat, 99) * 1e3,
                            sum(s[5] for s in samples), sum(sum(r.checksum_failed for r in s[3]) for s in samples),
                            sum(s[6] for s in samples), min(gb), max(gb), int(k), statistics.median(per_gib)))

        store_jobs = max(jobs)
        for r in range(repeat):
            # alternate the order of the modes, so write-back or cache state left by one
            # pass does not always land on the same mode; the shared files' writer goes last
            order = tuple(modes) if r % 2 == 0 else tuple(reversed(modes))
            store_order = [m for m in order if m != load_src] + [load_src]
            for m in store_order:  # each repeat stores into a fresh directory
                buf[:] = src
                bar.set_postfix_str(f"store {m}")
                # every store pass starts from an empty root directory and creates the
                # blocks' directories (two levels, kvtier.file_mapper's layout) while timed
                if m == "vllm":
                    shutil.rmtree(peer_root, ignore_errors=True)
                    os.makedirs(peer_root)
                    s = _peer_pass(vio, peer_pool, "store", keys, peer_paths, peer_view, bs, store_jobs,
                                   o_direct, 0)
                else:
                    mgr = mgrs[("store", m)]
                    rank = mgr.file_mapper.rank_path  # emptied, not replaced: the tier watches
                    for name in os.listdir(rank):       # its directory's identity (root lost)
                        q = os.path.join(rank, name)
                        shutil.rmtree(q) if os.path.isdir(q) else os.unlink(q)
                    s = _pass(mgr, "store", keys, store_jobs, job_base)
                    job_base += store_jobs
                samples.setdefault(("store", m), []).append(s + (0,))
                bar.update()
            for n_jobs in jobs:
                for m in order:  # interleaved
                    buf.fill(0)
                    bar.set_postfix_str(f"load {n_jobs} jobs, {m}")
                    if m == "vllm":
                        s = _peer_pass(vio, peer_pool, "load", keys, load_paths, peer_view, bs, n_jobs, o_direct,
                                       min_pass_s)
                    else:
                        s = _pass(mgrs[("load", m)], "load", keys, n_jobs, job_base, min_pass_s)
                        job_base += n_jobs * s[4]
                    # compare the blocks the tier says it loaded in the last round: a failed
                    # job's blocks are misses (counted in failed_jobs), not wrong bytes
                    loaded = [key_row[k] for res in s[3] for k in res.successful_keys]
                    bad = _mismatched_bytes(buf, src, loaded)
                    verified += len(loaded) * bs
                    samples.setdefault(("load", n_jobs, m), []).append(s + (bad,))
                    bar.update()
        for m in modes:
            add("store", store_jobs, m, samples[("store", m)])
        for n_jobs in jobs:
            for m in modes:
                add("load", n_jobs, m, samples[("load", n_jobs, m)])
    finally:
        bar.close()
        if peer_pool is not None:
            peer_pool.shutdown()
        for m in {id(m): m for m in mgrs.values()}.values():
            m.shutdown()
        if not keep:
            shutil.rmtree(base, ignore_errors=True)

    import kvtier
    import kvtier.io as kio

    # the I/O engine in use, as `kvtier info` names it: io_uring or the plain syscall path
    eng = kio._c_module().io_engine_status()["engine"] if kio.backend == "c" else "python"
    return {
        "preset": preset, "model": p.model, "geometry": asdict(p), "tokens_per_block": tokens,
        "block_bytes": bs, "blocks": blocks, "bytes_per_pass": blocks * bs, "threads": threads,
        "repeat": repeat, "min_pass_s": min_pass_s, "root": base if keep else (root or tempfile.gettempdir()),
        **info, "io_backend": kio.backend, "io_engine": eng, "crc32c_backend": kvtier.crc32c_backend, "vllm": vnote,
        "rows": [asdict(r) for r in rows],
        "verified_bytes": verified,
        "mismatched_bytes": sum(r.mismatched_bytes for r in rows),
        "failed_jobs": sum(r.failed_jobs for r in rows),
        "ok": all(r.mismatched_bytes == 0 and r.failed_jobs == 0 for r in rows),
    }


def _mem_available() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def format_table(d: dict) -> str:
    """The text table for a :func:`run_bench` result ``d``: a setup header, then one line per
    (op, jobs) with GB/s (median and [min-max] over the repeats), p50/p99 job latency (ms)
    and CPU seconds per GiB moved for checksum off and on, the on/off ratios, and vLLM's GB/s and the
    on/vLLM ratio when the peer ran ("-" where a mode was not run, and for GB/s where a
    pass had failed jobs).  Returns a str (no trailing newline).
    """
    g = d["geometry"]
    lines = [
        f"kvtier bench: {d['model']} ({d['preset']}): {g['layers']} layers x {g['kv_heads']} KV heads x "
        f"head_dim {g['head_dim']} x {g['dtype']} x {d['tokens_per_block']} tokens = "
        f"{human_bytes(d['block_bytes'], 2)} per block",
        f"{d['blocks']} blocks = {human_bytes(d['bytes_per_pass'], 2)} per round; root {d['root']} "
        f"({d['fstype']}, {'O_DIRECT' if d['o_direct'] else 'buffered'}); {d['threads']}+{d['threads']} "
        f"threads; I/O {d['io_backend']} (engine {d.get('io_engine', '-')}), CRC32C {d['crc32c_backend']}; median [min-max] of {d['repeat']} "
        f"passes of >= {d.get('min_pass_s', 0):g} s, modes interleaved, every mode loading the same files",
        f"a round: the jobs moving every block once; a store pass: 1 round; a load pass: rounds until >= "
        f"{d.get('min_pass_s', 0):g} s; CPU: process CPU s (all threads) per GiB moved",
        f"vLLM: {d.get('vllm', '-')}",
        "",
    ]
    rows = d["rows"]
    by = {(r["op"], r["jobs"], r.get("mode", "on" if r["checksum"] else "off")): r for r in rows}
    keys = []
    for r in rows:
        k = (r["op"], r["jobs"])
        if k not in keys:
            keys.append(k)
    peer = any(m == "vllm" for (_, _, m) in by)
    hdr = (f"{'op':<6}{'jobs':>5} | {'GB/s off':>19}{'on':>19}{'on/off':>7} | {'p50 ms off':>11}{'on':>8} | "
           f"{'p99 ms off':>11}{'on':>8} | {'CPU s/GiB off':>14}{'on':>8}{'on/off':>7}")
    if peer:
        hdr += f" | {'GB/s vLLM':>19}{'on/vLLM':>8}{'CPU s/GiB':>10}"
    lines += [hdr, "-" * len(hdr)]

    def cell(v, fmt):
        return format(v, fmt) if v is not None else format("-", ">" + fmt.split(".")[0])

    def gb(r, width):  # "median [min-max]", none for a pass with failed jobs: its bytes did not all move
        if r is None or r["failed_jobs"]:
            return format("-", f">{width}")
        lo, hi = r.get("gbps_min", r["gbps"]), r.get("gbps_max", r["gbps"])
        return format(f"{r['gbps']:.2f} [{lo:.2f}-{hi:.2f}]", f">{width}")

    for op, jobs in keys:
        off, on, vl = by.get((op, jobs, "off")), by.get((op, jobs, "on")), by.get((op, jobs, "vllm"))

        def g_(r, f):
            return None if r is None or (f == "gbps" and r["failed_jobs"]) else r.get(f)  # a result saved by an older kvtier: "-"

        def ratio(a_, b_, f):
            a, b = g_(a_, f), g_(b_, f)
            return None if a is None or b is None or not a else b / a

        line = (f"{op:<6}{jobs:>5} | {gb(off, 19)}{gb(on, 19)}"
                f"{cell(ratio(off, on, 'gbps'), '7.2f')} | {cell(g_(off, 'p50_ms'), '11.1f')}"
                f"{cell(g_(on, 'p50_ms'), '8.1f')} | "
                f"{cell(g_(off, 'p99_ms'), '11.1f')}{cell(g_(on, 'p99_ms'), '8.1f')} | "
                f"{cell(g_(off, 'cpu_s_per_gib'), '14.3f')}{cell(g_(on, 'cpu_s_per_gib'), '8.3f')}"
                f"{cell(ratio(off, on, 'cpu_s_per_gib'), '7.2f')}")
        if peer:
            line += f" | {gb(vl, 19)}{cell(ratio(vl, on, 'gbps'), '8.2f')}{cell(g_(vl, 'cpu_s_per_gib'), '10.3f')}"
        lines.append(line)
    lines.append("")
    status = "OK" if d["ok"] else "FAILED"
    lines.append(f"verified {d['verified_bytes']:,} bytes loaded, {d['mismatched_bytes']:,} mismatched, "
                 f"{d['failed_jobs']} failed jobs: {status}")
    return "\n".join(lines)


def plot(d: dict, path: str) -> None:
    """Into ``path`` (PNG): GB/s per row and mode (checksum off, on, vLLM) with the spread
    over the repeats as error bars (min-max); the on/off and on/vLLM GB/s ratios with their
    spread (min/max of on over max/min of the other); process CPU seconds per GiB moved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = d["rows"]

    def lab(r):
        return f"{r['op']}\n{r['jobs']} job{'s' if r['jobs'] > 1 else ''}"

    labels = []
    for r in rows:
        if lab(r) not in labels:
            labels.append(lab(r))
    by = {(lab(r), r.get("mode", "on" if r["checksum"] else "off")): r for r in rows}
    modes = [m for m in ("off", "on", "vllm") if any(k[1] == m for k in by)]
    names = {"off": "kvtier checksum off", "on": "kvtier checksum on", "vllm": "vLLM fs_io_C"}
    x = np.arange(len(labels))
    w = 0.8 / len(modes)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, m in enumerate(modes):
        rs = [by.get((l, m)) for l in labels]
        med = [r["gbps"] if r else 0 for r in rs]
        err = [[(r["gbps"] - r.get("gbps_min", r["gbps"])) if r else 0 for r in rs],
               [(r.get("gbps_max", r["gbps"]) - r["gbps"]) if r else 0 for r in rs]]
        a1.bar(x + (i - (len(modes) - 1) / 2) * w, med, w, yerr=err, capsize=3, label=names[m])
        a3.bar(x + (i - (len(modes) - 1) / 2) * w, [r["cpu_s_per_gib"] if r else 0 for r in rs], w, label=names[m])
    pairs = [(m, "on") for m in ("off", "vllm") if m in modes and "on" in modes]
    for i, (base, top) in enumerate(pairs):
        med, lo, hi = [], [], []
        for l in labels:
            b, t = by.get((l, base)), by.get((l, top))
            if not b or not t or not b["gbps"]:
                med.append(0), lo.append(0), hi.append(0)
                continue
            r = t["gbps"] / b["gbps"]
            med.append(r)
            lo.append(r - t.get("gbps_min", t["gbps"]) / max(b.get("gbps_max", b["gbps"]), 1e-12))
            hi.append(t.get("gbps_max", t["gbps"]) / max(b.get("gbps_min", b["gbps"]), 1e-12) - r)
        a2.bar(x + (i - (len(pairs) - 1) / 2) * 0.38, med, 0.38, yerr=[lo, hi], capsize=3,
               label=f"on / {'off' if base == 'off' else 'vLLM'}")
    a2.axhline(1.0, color="grey", lw=0.8)
    for a, t in ((a1, "throughput (GB/s), min-max over repeats"), (a2, "GB/s ratio, with spread"),
                 (a3, "process CPU s per GiB moved")):
        a.set_xticks(x, labels)
        a.set_title(t)
        a.legend(fontsize=8)
    fig.suptitle(f"kvtier bench: {d['model']}, {human_bytes(d['block_bytes'], 2)} blocks, "
                 f"{d['fstype']} {'O_DIRECT' if d['o_direct'] else 'buffered'}, median of {d['repeat']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand (options, preset list in the epilog) to ``sub``, an
    argparse subparsers object; returns the new parser (its ``func`` is :func:`cmd_bench`)."""
    from kvtier.cli._text import plain_text

    p = sub.add_parser(
        "bench", help="store and load real-model KV blocks through the tier, checksum off vs on vs vLLM",
        description=plain_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets:\n" + "\n".join(
            f"  {n:<14} {pr.model}: {pr.source}" for n, pr in PRESETS.items()))
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS), help=f"model geometry (default {DEFAULT_PRESET})")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens per block (default {DEFAULT_TOKENS})")
    p.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS, help=f"blocks per pass (default {DEFAULT_BLOCKS})")
    p.add_argument("--jobs", default=",".join(map(str, DEFAULT_JOBS)),
                   help="comma-separated jobs in flight for loads (default 1,4,16); stores use the largest")
    p.add_argument("--root", default=None, help="directory to create the temp cache in (default: $TMPDIR or /tmp)")
    p.add_argument("--node-b", metavar="DIR", default=None,
                   help="two-client mode: the same directory as --root through another mount (node B); one "
                        "process per mount stores and loads the same keys at once (kvtier/cli/bench_nodes.py)")
    p.add_argument("--checksum", choices=("both", "off", "on"), default="both", help="checksum modes (default both)")
    p.add_argument("--threads", type=int, default=16, help="read- and write-priority threads each (default 16)")
    p.add_argument("--no-o-direct", action="store_true", help="buffered I/O instead of O_DIRECT")
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help=f"repeat every pass, report medians (default {DEFAULT_REPEAT})")
    p.add_argument("--min-pass-s", type=float, default=DEFAULT_MIN_PASS_S,
                   help=f"a load pass repeats its jobs until it ran this many seconds (default {DEFAULT_MIN_PASS_S:g})")
    p.add_argument("--vllm", choices=("auto", "on", "off"), default="auto",
                   help="a column for vLLM 0.33's own fs tier I/O (fs_io_C): auto = when installed (default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random block bytes and keys (default 0)")
    p.add_argument("--keep", action="store_true", help="keep the cache directory")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw the results into a PNG (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``kvtier bench`` for parsed ``args``; prints the table (or JSON with ``--json``)
    on stdout, messages on stderr, and draws ``--plot`` after the table.

    Returns the exit status: 0 every byte verified and every job succeeded; 1 mismatched
    bytes or failed jobs; 2 bad arguments (``--jobs`` not comma-separated ints, a
    non-positive size, ``--plot`` without matplotlib or into a missing / read-only
    directory, a ``--root`` that does not exist or is not a directory) or an OSError setting up
    the cache (message names the errno text and path).
    """
    if args.node_b is not None:  # "" too: refused below as a path, not a one-node run
        from kvtier.cli.bench_nodes import cmd_two_clients

        return cmd_two_clients(args)
    try:
        jobs = tuple(int(x) for x in args.jobs.split(",") if x.strip())
    except ValueError:
        print(f"kvtier bench: --jobs must be comma-separated integers, got {args.jobs!r}", file=sys.stderr)
        return 2
    checks = {"both": (False, True), "off": (False,), "on": (True,)}[args.checksum]
    if args.plot:  # check before the run, not after it
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            print("kvtier bench: --plot needs matplotlib: pip install 'kvtier[plot]'", file=sys.stderr)
            return 2
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        ext = os.path.splitext(args.plot)[1].lower().lstrip(".")
        kinds = FigureCanvasAgg.get_supported_filetypes()
        if ext not in kinds or os.path.isdir(args.plot):
            print(f"kvtier bench: --plot {args.plot!r}: name a file ending in one of "
                  f"{', '.join('.' + k for k in sorted(kinds))}", file=sys.stderr)
            return 2
        d_plot = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(d_plot) or not os.access(d_plot, os.W_OK):
            print(f"kvtier bench: --plot: directory {d_plot!r} does not exist or is not writable", file=sys.stderr)
            return 2
    err = None if args.root is None else dir_error(args.root)
    if err is not None:  # else the error names a temp under it
        print(f"kvtier bench: --root {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        d = run_bench(args.preset, args.tokens, args.blocks, jobs, args.root, checks, args.threads,
                      not args.no_o_direct, args.repeat, args.seed, not args.no_progress, args.keep,
                      vllm=args.vllm, min_pass_s=args.min_pass_s)
    except (ValueError, OSError) as e:
        print(f"kvtier bench: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(format_table(d))
    if args.plot:  # after the table: a plotting failure never loses the results
        plot(d, args.plot)
        print(f"kvtier bench: plot written to {args.plot}", file=sys.stderr)
    if not d["ok"]:
        print("kvtier bench: FAILED: mismatched bytes or failed jobs", file=sys.stderr)
        return 1
    return 0
