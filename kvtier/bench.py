"""``kvtier bench``: store and load real-model-sized KV blocks through the tier manager.

It fills a primary buffer (numpy) with random bytes, stores N blocks through
:class:`kvtier.manager.FileSystemTierManager` into a temp directory (or ``--root``),
loads them back with 1, 4 and 16 jobs in flight, once with checksums off and once on,
verifies every byte loaded, and prints GB/s, p50/p99 job latency and process CPU time
with the checksum on/off ratios.  Exit status 1 if any byte differs or a job fails.

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

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class Preset:
    """KV geometry of a model, from the fields of its public Hugging Face config.json."""

    model: str
    layers: int  # num_hidden_layers
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim, or hidden_size / num_attention_heads
    dtype: str  # torch_dtype
    source: str

    def block_bytes(self, tokens: int) -> int:
        """Bytes of one block of ``tokens`` tokens: 2 (K,V) * layers * kv_heads * head_dim * dtype bytes * tokens."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype] * tokens


PRESETS = {
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama-3.1-8b": Preset(
        "meta-llama/Llama-3.1-8B", 32, 8, 128, "bfloat16",
        "num_hidden_layers=32, num_key_value_heads=8, hidden_size=4096 / num_attention_heads=32 "
        "= head_dim 128, torch_dtype=bfloat16"),
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    "llama-3.1-70b": Preset(
        "meta-llama/Llama-3.1-70B", 80, 8, 128, "bfloat16",
        "num_hidden_layers=80, num_key_value_heads=8, hidden_size=8192 / num_attention_heads=64 "
        "= head_dim 128, torch_dtype=bfloat16"),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": Preset(
        "Qwen/Qwen3-8B", 36, 8, 128, "bfloat16",
        "num_hidden_layers=36, num_key_value_heads=8, head_dim=128, torch_dtype=bfloat16"),
    # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
    "qwen3-0.6b": Preset(
        "Qwen/Qwen3-0.6B", 28, 8, 128, "bfloat16",
        "num_hidden_layers=28, num_key_value_heads=8, head_dim=128, torch_dtype=bfloat16"),
    # https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json
    "mistral-7b": Preset(
        "mistralai/Mistral-7B-v0.3", 32, 8, 128, "bfloat16",
        "num_hidden_layers=32, num_key_value_heads=8, hidden_size=4096 / num_attention_heads=32 "
        "= head_dim 128, torch_dtype=bfloat16"),
    # not a real model: small blocks for tests and smoke runs
    "tiny": Preset("kvtier/tiny", 2, 2, 64, "float16", "test geometry: 2 layers, 2 KV heads, head_dim 64, float16"),
}
DEFAULT_PRESET = "llama-3.1-8b"
DEFAULT_TOKENS = 16
DEFAULT_BLOCKS = 192
DEFAULT_JOBS = (1, 4, 16)
DEFAULT_REPEAT = 3


@dataclass
class Row:
    """One table cell pair: ``op`` over ``jobs`` jobs in flight, checksums ``checksum``.

    ``blocks`` and ``bytes``: moved per pass.  Medians over ``--repeat`` passes:
    ``wall_s`` (seconds, first submit to last job done), ``cpu_s`` (seconds of process CPU
    time, user+sys of all threads, ``time.process_time``), ``gbps`` (``bytes / wall_s / 1e9``,
    decimal GB/s).  ``p50_ms`` / ``p99_ms``: percentiles of job latency (submit to done,
    milliseconds) over all passes.  Sums over all passes: ``failed_jobs`` (JobResult.success
    false), ``checksum_failures`` (jobs with a condemned block), ``mismatched_bytes`` (loaded
    bytes that differ from what was stored; loads only, 0 for stores).
    """

    op: str  # "store" or "load"
    jobs: int
    checksum: bool
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


def _pass(mgr, op: str, keys, n_jobs: int, job_base: int):
    """Submit all jobs at once, wait; returns (wall s, cpu s, latencies s, results)."""
    from kvtier.manager import TransferJob

    jobs = [TransferJob(job_base + j, [keys[i] for i in rng], list(rng), op == "load")
            for j, rng in enumerate(_split(len(keys), n_jobs))]
    submit = mgr.submit_load if op == "load" else mgr.submit_store
    c0, t0 = time.process_time(), time.perf_counter()
    for j in jobs:
        submit(j)
    if not mgr.drain_jobs(timeout=3600):
        raise RuntimeError("bench pass did not finish in an hour")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    results = mgr.get_finished_jobs()
    return wall, cpu, [r.transfer_time for r in results], results


def run_bench(preset: str = DEFAULT_PRESET, tokens: int = DEFAULT_TOKENS, blocks: int = DEFAULT_BLOCKS,
              jobs=DEFAULT_JOBS, root: Optional[str] = None, checksums=(False, True),
              threads: int = 16, use_o_direct: bool = True, repeat: int = 1, seed: int = 0,
              progress: bool = True, keep: bool = False) -> dict:
    """Run the benchmark; returns a dict (``rows``: list of :class:`Row` dicts, plus the setup).

    Raises ValueError for bad arguments (unknown preset, non-positive sizes, or 2 x ``blocks``
    x block bytes more than MemAvailable in /proc/meminfo); OSError ENOSPC (filename = the
    root) before any store when the root's filesystem reports less free space than
    ``len(checksums)`` x ``blocks`` x block bytes (rounded up to its blocks, plus metadata).
    """
    from tqdm import tqdm

    from kvtier.manager import FileSystemTierManager, filesystem_type

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    for name, v in (("tokens", tokens), ("blocks", blocks), ("threads", threads), ("repeat", repeat)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    jobs = tuple(jobs)
    if not jobs or any((not isinstance(j, int)) or j < 1 for j in jobs):
        raise ValueError(f"jobs must be positive ints, got {jobs!r}")
    p = PRESETS[preset]
    bs = p.block_bytes(tokens)
    hash_bs = 16 if tokens % 16 == 0 else tokens
    groups = [{"block_size": hash_bs, "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(p.layers)]}]

    # the source and the load buffer: refuse up front rather than fill a shared host's memory
    need_ram, avail_ram = 2 * blocks * bs, _mem_available()
    if avail_ram is not None and need_ram > avail_ram:
        raise ValueError(f"needs {_fmt_bytes(need_ram)} of RAM (source and load buffers, 2 x {blocks} blocks of "
                         f"{_fmt_bytes(bs)}), {_fmt_bytes(avail_ram)} available (MemAvailable); use --blocks")
    rng = np.random.default_rng(seed)
    src = np.frombuffer(rng.bytes(blocks * bs), dtype=np.uint8).reshape(blocks, bs)
    buf = np.empty_like(src)
    keys = [(rng.bytes(32), 0) for _ in range(blocks)]
    key_row = {k: i for i, k in enumerate(keys)}
    verified = 0  # bytes of loaded blocks compared with the source

    base = tempfile.mkdtemp(prefix="kvtier-bench-", dir=root)
    n_passes = len(checksums) * repeat * (1 + len(jobs))
    bar = tqdm(total=n_passes, desc="kvtier bench", unit="pass", file=sys.stderr,
               disable=not progress, leave=False)
    rows: List[Row] = []
    mgrs = {}
    samples = {}
    info = {}
    job_base = 0
    try:
        # every checksum mode keeps its own copy of the blocks: refuse up front rather than
        # time a run of ENOSPC failures
        # (each block rounded up to whole filesystem blocks, plus one for its inode's xattr and
        # 64 KiB per mode for config.json / kvtier.json and the directories)
        st = os.statvfs(base)
        frag = st.f_frsize or 4096
        need = len(checksums) * (blocks * (-(-bs // frag) + 1) * frag + 64 * 1024)
        free = st.f_bavail * st.f_frsize
        if st.f_blocks and free < need:  # f_blocks 0: no size reported (ramfs): nothing to check
            raise OSError(errno.ENOSPC, f"needs {_fmt_bytes(need)} free ({len(checksums)} x {blocks} blocks of "
                          f"{_fmt_bytes(bs)}), {_fmt_bytes(free)} available; use --blocks or another --root",
                          root or os.path.dirname(base))
        for ck in checksums:
            mgrs[ck] = FileSystemTierManager(
                buf, os.path.join(base, "on" if ck else "off"), p.model, hash_block_size=hash_bs,
                gpu_blocks_per_file=tokens // hash_bs, dtype=p.dtype, kv_cache_groups=groups,
                n_read_threads=threads, n_write_threads=threads, checksum_blocks=ck,
                use_o_direct=use_o_direct)
        fstype, mnt = filesystem_type(base)
        info = {"fstype": fstype, "mount": mnt,
                "o_direct": all(m.use_o_direct for m in mgrs.values())}

        def add(op, n_jobs, ck, samples):
            wall = [s[0] for s in samples]
            cpu = [s[1] for s in samples]
            lat = [x for s in samples for x in s[2]]
            res = [r for s in samples for r in s[3]]
            w = statistics.median(wall)
            rows.append(Row(op, n_jobs, ck, blocks, blocks * bs, w, statistics.median(cpu),
                            blocks * bs / w / 1e9, _percentile(lat, 50) * 1e3, _percentile(lat, 99) * 1e3,
                            sum(not r.success for r in res), sum(r.checksum_failed for r in res),
                            sum(s[4] for s in samples)))

        store_jobs = max(jobs)
        for r in range(repeat):
            # alternate which mode goes first, so write-back or cache state left by one
            # pass does not always land on the same mode
            order = tuple(checksums) if r % 2 == 0 else tuple(reversed(checksums))
            for ck in order:  # each repeat stores into a fresh directory
                mgr = mgrs[ck]
                if r:
                    shutil.rmtree(mgr.file_mapper.rank_path)
                    os.makedirs(mgr.file_mapper.rank_path)
                buf[:] = src
                bar.set_postfix_str(f"store checksum {'on' if ck else 'off'}")
                s = _pass(mgr, "store", keys, store_jobs, job_base)
                job_base += store_jobs
                samples.setdefault(("store", ck), []).append(s + (0,))
                bar.update()
            for n_jobs in jobs:
                for ck in order:  # interleave off/on
                    buf.fill(0)
                    bar.set_postfix_str(f"load {n_jobs} jobs, checksum {'on' if ck else 'off'}")
                    s = _pass(mgrs[ck], "load", keys, n_jobs, job_base)
                    job_base += n_jobs
                    # compare the blocks the tier says it loaded: a failed job's blocks are
                    # misses (counted in failed_jobs), not wrong bytes
                    loaded = [key_row[k] for r in s[3] for k in r.successful_keys]
                    bad = _mismatched_bytes(buf, src, loaded)
                    verified += len(loaded) * bs
                    samples.setdefault(("load", n_jobs, ck), []).append(s + (bad,))
                    bar.update()
        for ck in checksums:
            add("store", store_jobs, ck, samples[("store", ck)])
        for n_jobs in jobs:
            for ck in checksums:
                add("load", n_jobs, ck, samples[("load", n_jobs, ck)])
    finally:
        bar.close()
        for m in mgrs.values():
            m.shutdown()
        if not keep:
            shutil.rmtree(base, ignore_errors=True)

    import kvtier
    import kvtier.io as kio

    return {
        "preset": preset, "model": p.model, "geometry": asdict(p), "tokens_per_block": tokens,
        "block_bytes": bs, "blocks": blocks, "bytes_per_pass": blocks * bs, "threads": threads,
        "repeat": repeat, "root": base if keep else (root or tempfile.gettempdir()), **info,
        "io_backend": kio.backend, "crc32c_backend": kvtier.crc32c_backend,
        "rows": [asdict(r) for r in rows],
        "verified_bytes": verified,
        "mismatched_bytes": sum(r.mismatched_bytes for r in rows),
        "failed_jobs": sum(r.failed_jobs for r in rows),
        "ok": all(r.mismatched_bytes == 0 and r.failed_jobs == 0 for r in rows),
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


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
    (op, jobs) with GB/s, p50/p99 job latency (ms) and CPU seconds, checksum off and on, and
    the on/off ratios ("-" where a mode was not run, and for GB/s where a pass had failed
    jobs).  Returns a str (no trailing newline).
    """
    g = d["geometry"]
    lines = [
        f"kvtier bench: {d['model']} ({d['preset']}): {g['layers']} layers x {g['kv_heads']} KV heads x "
        f"head_dim {g['head_dim']} x {g['dtype']} x {d['tokens_per_block']} tokens = "
        f"{_fmt_bytes(d['block_bytes'])} per block",
        f"{d['blocks']} blocks = {_fmt_bytes(d['bytes_per_pass'])} per pass; root {d['root']} "
        f"({d['fstype']}, {'O_DIRECT' if d['o_direct'] else 'buffered'}); {d['threads']}+{d['threads']} "
        f"threads; I/O {d['io_backend']}, CRC32C {d['crc32c_backend']}; median of {d['repeat']}",
        "",
    ]
    rows = d["rows"]
    by = {(r["op"], r["jobs"], r["checksum"]): r for r in rows}
    keys = []
    for r in rows:
        k = (r["op"], r["jobs"])
        if k not in keys:
            keys.append(k)
    hdr = (f"{'op':<6}{'jobs':>5} | {'GB/s off':>9}{'on':>7}{'on/off':>7} | {'p50 ms off':>11}{'on':>8} | "
           f"{'p99 ms off':>11}{'on':>8} | {'CPU s off':>10}{'on':>7}{'on/off':>7}")
    lines += [hdr, "-" * len(hdr)]

    def cell(v, fmt):
        return format(v, fmt) if v is not None else format("-", ">" + fmt.split(".")[0])

    for op, jobs in keys:
        off, on = by.get((op, jobs, False)), by.get((op, jobs, True))

        def g_(r, f):  # no GB/s for a pass with failed jobs: its bytes did not all move
            return None if r is None or (f == "gbps" and r["failed_jobs"]) else r[f]

        def ratio(f):
            a, b = g_(off, f), g_(on, f)
            return None if a is None or b is None or not a else b / a

        lines.append(
            f"{op:<6}{jobs:>5} | {cell(g_(off, 'gbps'), '9.2f')}{cell(g_(on, 'gbps'), '7.2f')}"
            f"{cell(ratio('gbps'), '7.2f')} | {cell(g_(off, 'p50_ms'), '11.1f')}{cell(g_(on, 'p50_ms'), '8.1f')} | "
            f"{cell(g_(off, 'p99_ms'), '11.1f')}{cell(g_(on, 'p99_ms'), '8.1f')} | "
            f"{cell(g_(off, 'cpu_s'), '10.2f')}{cell(g_(on, 'cpu_s'), '7.2f')}{cell(ratio('cpu_s'), '7.2f')}")
    lines.append("")
    status = "OK" if d["ok"] else "FAILED"
    lines.append(f"verified {d['verified_bytes']:,} bytes loaded, {d['mismatched_bytes']:,} mismatched, "
                 f"{d['failed_jobs']} failed jobs: {status}")
    return "\n".join(lines)


def plot(d: dict, path: str) -> None:
    """Bar chart of GB/s (checksum off vs on) per row, and CPU seconds, into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = d["rows"]
    labels = []
    for r in rows:
        lab = f"{r['op']}\n{r['jobs']} job{'s' if r['jobs'] > 1 else ''}"
        if lab not in labels:
            labels.append(lab)
    by = {(f"{r['op']}\n{r['jobs']} job{'s' if r['jobs'] > 1 else ''}", r["checksum"]): r for r in rows}
    x = np.arange(len(labels))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (ck, name) in enumerate(((False, "checksum off"), (True, "checksum on"))):
        a1.bar(x + (i - 0.5) * 0.38, [by.get((l, ck), {}).get("gbps", 0) for l in labels], 0.38, label=name)
        a2.bar(x + (i - 0.5) * 0.38, [by.get((l, ck), {}).get("cpu_s", 0) for l in labels], 0.38, label=name)
    for a, t in ((a1, "throughput (GB/s)"), (a2, "process CPU time (s)")):
        a.set_xticks(x, labels)
        a.set_title(t)
        a.legend()
    fig.suptitle(f"kvtier bench: {d['model']}, {_fmt_bytes(d['block_bytes'])} blocks, "
                 f"{d['fstype']} {'O_DIRECT' if d['o_direct'] else 'buffered'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand (options, preset list in the epilog) to ``sub``, an
    argparse subparsers object; returns the new parser (its ``func`` is :func:`cmd_bench`)."""
    from kvtier.cli import plain_text

    p = sub.add_parser(
        "bench", help="store and load real-model KV blocks through the tier, checksum off vs on",
        description=plain_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets:\n" + "\n".join(
            f"  {n:<14} {pr.model}: {pr.source}" for n, pr in PRESETS.items()))
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS), help=f"model geometry (default {DEFAULT_PRESET})")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens per block (default {DEFAULT_TOKENS})")
    p.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS, help=f"blocks per pass (default {DEFAULT_BLOCKS})")
    p.add_argument("--jobs", default=",".join(map(str, DEFAULT_JOBS)),
                   help="comma-separated jobs in flight for loads (default 1,4,16); stores use the largest")
    p.add_argument("--root", default=None, help="directory to create the temp cache in (default: $TMPDIR or /tmp)")
    p.add_argument("--checksum", choices=("both", "off", "on"), default="both", help="checksum modes (default both)")
    p.add_argument("--threads", type=int, default=16, help="read- and write-priority threads each (default 16)")
    p.add_argument("--no-o-direct", action="store_true", help="buffered I/O instead of O_DIRECT")
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help=f"repeat every pass, report medians (default {DEFAULT_REPEAT})")
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
    directory) or an OSError setting up the cache (message names the errno text and path).
    """
    try:
        jobs = tuple(int(x) for x in args.jobs.split(",") if x.strip())
    except ValueError:
        print(f"kvtier bench: --jobs must be comma-separated integers, got {args.jobs!r}", file=sys.stderr)
        return 2
    checks = {"both": (False, True), "off": (False,), "on": (True,)}[args.checksum]
    if args.plot:  # check before the run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
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
    try:
        d = run_bench(args.preset, args.tokens, args.blocks, jobs, args.root, checks, args.threads,
                      not args.no_o_direct, args.repeat, args.seed, not args.no_progress, args.keep)
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
