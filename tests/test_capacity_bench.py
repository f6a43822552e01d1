"""benchmarks/capacity_bench.py: the offline simulators on tiny traces give the values the
policies' definitions imply (hand-counted hits, unbounded = seen before, chains closed under
parents, a full-size LRU = no bound), and its block hashes are vLLM 0.33's."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from ci import unavailable

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, os.pardir, "benchmarks", "capacity_bench.py")


@pytest.fixture(scope="module")
def cb():
    spec = importlib.util.spec_from_file_location("capacity_bench_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(cb):
    return cb.make_trace(cb.TraceParams(requests=300, scale=0.25, seed=7, span_s=3000.0))


def hand_trace(cb, parent, prompts, outputs=None, t=None, node=None):
    n = len(prompts)
    return cb.Trace(parent=parent, t=t or [float(i) for i in range(n)], prompt=prompts,
                    output=outputs or [[] for _ in range(n)], node=node or [0] * n)


def test_unbounded_hit_rate_is_the_share_of_blocks_seen_before(cb, tiny):
    # independently: a prompt block counts if an earlier request's prompt or output had it
    seen, hit, tot = set(), 0, 0
    for p, o in zip(tiny.prompt, tiny.output):
        hit += sum(b in seen for b in p)
        tot += len(p)
        seen |= set(p) | set(o)
    r = cb.replay(tiny, cb.Unbounded())
    assert r.requested == tot and r.usable == hit
    assert 0.3 < hit / tot < 1.0  # the trace shares prefixes, and has new blocks


def test_every_policy_at_the_working_set_size_equals_no_bound(cb, tiny):
    ws = tiny.working_set()
    unb = cb.replay(tiny, cb.Unbounded())
    for pol in (cb.LRU(ws), cb.ChainLRU(ws, tiny.parent), cb.FIFO(ws), cb.VllmFs(ws),
                cb.Kvtier(ws, tiny.n_nodes, census=10.0, touch_window=60.0, sync=True)):
        r = cb.replay(tiny, pol)
        assert (r.usable, r.evicted, r.dropped) == (unb.usable, 0, 0), pol.name
        assert len(pol) == ws


def test_chain_lru_never_holds_a_block_without_its_parent(cb, tiny):
    ws = tiny.working_set()
    checked = []

    class Checked(cb.ChainLRU):
        def store(self, blocks, now, node, prefix=()):
            super().store(blocks, now, node, prefix)
            held = self.cached()
            orphans = [b for b in held if self.parent[b] >= 0 and self.parent[b] not in held]
            assert not orphans, f"cached without parent: {orphans[:5]}"
            checked.append(len(held))

    for frac in (0.05, 0.2):
        pol = Checked(int(ws * frac), tiny.parent)
        r = cb.replay(tiny, pol)
        assert r.evicted > 0 and max(checked) == int(ws * frac)
    # kvtier with every parent link (k+tree) keeps the same closure, at each census
    k = cb.Kvtier(int(ws * 0.05), tiny.n_nodes, census=10.0, touch_window=60.0, parents="all", parent=tiny.parent)
    ticks = []
    real_tick = k.tick

    def tick(now):
        real_tick(now)
        held = k.cached()
        assert all(tiny.parent[b] < 0 or tiny.parent[b] in held for b in held)
        ticks.append(now)

    k.tick = tick
    assert cb.replay(tiny, k).evicted > 0 and len(ticks) == len(tiny.t)


def test_lru_and_fifo_on_a_hand_made_trace(cb):
    A, B, C = 0, 1, 2  # three one-block prompts, capacity 2
    tr = hand_trace(cb, [-1, -1, -1], [[A], [B], [A], [C], [A], [B]])
    lru = cb.replay(tr, cb.LRU(2))  # A- B- A+ C-(evicts B) A+ B-(evicts C)
    fifo = cb.replay(tr, cb.FIFO(2))  # A- B- A+ C-(evicts A) A-(evicts B) B-(evicts C)
    assert (lru.usable, lru.evicted, lru.stored) == (2, 2, 4)
    assert (fifo.usable, fifo.evicted, fifo.stored) == (1, 3, 5)
    fs = cb.replay(tr, cb.VllmFs(2))  # A- B- A+ C-(not stored: full) A+ B+
    assert (fs.usable, fs.dropped, fs.evicted) == (3, 1, 0)


def test_a_missing_head_makes_the_rest_of_the_chain_unusable(cb):
    # chain A0 -> A1 -> A2 stored by a first request, then X; capacity 3
    A0, A1, A2, X = 0, 1, 2, 3
    tr = hand_trace(cb, [-1, A0, A1, -1], [[], [X], [A0, A1, A2]], [[A0, A1, A2], [], []])
    fifo = cb.FIFO(3)  # X evicts A0, the head: A1 and A2 stay on disk but are unusable
    assert cb.replay(tr, fifo).usable == 0
    lru = cb.LRU(3)  # the same: A0 is the least recently stored
    assert cb.replay(tr, lru).usable == 0
    chain = cb.ChainLRU(3, tr.parent)  # evicts the leaf A2: A0, A1 usable
    r = cb.replay(tr, chain)
    assert r.usable == 2 and r.evicted == 2  # A2's store then evicts X, the oldest leaf
    assert chain.cached() == {A0, A1, A2}


def test_kvtier_stamps_the_head_newest_within_a_job(cb):
    A0, A1, A2, X = 0, 1, 2, 3
    tr = hand_trace(cb, [-1, A0, A1, -1], [[], [X], [A0, A1, A2]], [[A0, A1, A2], [], []])
    head = cb.Kvtier(3, 1, census=10.0, touch_window=60.0, sync=True)
    assert cb.replay(tr, head).usable == 2  # X evicted A2 (mtime t - 2 us), the oldest
    plain = cb.Kvtier(3, 1, census=10.0, touch_window=60.0, sync=True, head_newest=False)
    assert cb.replay(tr, plain).usable == 0  # X evicted A0 (mtime t), as per-file LRU does
    for parents in ("job", "all"):  # A0 and A1 have a child on disk: X evicts the leaf A2
        leaf = cb.Kvtier(3, 1, census=10.0, touch_window=60.0, sync=True, head_newest=False, parents=parents,
                         parent=tr.parent)
        assert cb.replay(tr, leaf).usable == 2, parents


def test_kvtier_touches_once_per_window_per_process(cb):
    # A stored at t=0, B at t=1; A hit at t=2 (inside the 60 s window of its store: no touch),
    # so C at t=3 evicts A; with the rate limit off the hit moves A past B and C evicts B
    A, B, C = 0, 1, 2
    tr = hand_trace(cb, [-1, -1, -1], [[A], [B], [A], [C], [A]], t=[0.0, 1.0, 2.0, 3.0, 4.0])
    limited = cb.replay(tr, cb.Kvtier(2, 1, census=10.0, touch_window=60.0, sync=True))
    assert (limited.usable, limited.evicted) == (1, 2)  # C evicts A, then A's store evicts B
    free = cb.replay(tr, cb.Kvtier(2, 1, census=10.0, touch_window=60.0, sync=True, rate_limit=False))
    assert (free.usable, free.evicted) == (2, 1)  # C evicts B


def test_kvtier_evicts_between_watermarks_and_drops_whole_jobs_at_the_bound(cb):
    k = cb.Kvtier(100, 1, census=10.0, touch_window=60.0)  # 0.95 -> 0.85
    k.store(list(range(90)), 1.0, 0)
    k.tick(2.0)
    assert len(k) == 90 and k.evicted == 0  # below the high watermark, no census due
    k.store(list(range(90, 100)), 2.0, 0)  # admitted (100 <= the bound), over the high watermark
    k.store(list(range(100, 105)), 3.0, 0)  # would pass the bound: dropped whole, not blocked
    assert len(k) == 100 and k.dropped == 5 and k.evicted == 0
    k.tick(3.5)  # the pass the writers asked for
    assert len(k) == 85 and k.evicted == 15
    # the oldest stamps went first: the first job's tail (head-newest: block i at t - i us)
    assert set(range(75, 90)).isdisjoint(k.cached()) and set(range(75)) | set(range(90, 100)) == k.cached()
    # a job is admitted on all its blocks, those on disk too: 85 + 16 > 100
    k.store(list(range(70, 86)), 4.0, 0)
    assert k.dropped == 5 + 11 and len(k) == 85


def test_llmd_skips_recently_accessed_files_and_fails_stores_when_full(cb):
    d = cb.LlmD(10, [], 20, interval=10.0, atime_window=3600.0)
    d.store(list(range(10)), 0.0, 0)
    d.tick(100.0)
    assert d.evicted == 0  # all within the atime window
    d.store([10, 11], 101.0, 0)
    assert d.dropped == 2
    d.tick(3700.0)
    assert len(d) == 7 and d.evicted == 3  # 100% -> 70%


@pytest.mark.vllm
def test_block_hash_is_vllms_hash_block_tokens(cb, monkeypatch):
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils as kcu
    except ImportError as e:
        unavailable(f"vLLM not importable: {e}")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    saved = getattr(kcu, "NONE_HASH", None), getattr(kcu, "_NONE_HASH_SEED", None)
    kcu.init_none_hash(sha256)
    try:
        ours = theirs = None
        for toks in ([1, 2, 3, 4] * 4, [7] * 16, list(range(16))):
            ours = cb.block_hash(ours, toks)
            theirs = kcu.hash_block_tokens(sha256, theirs, toks)
            assert ours == bytes(theirs)
    finally:
        kcu.NONE_HASH, kcu._NONE_HASH_SEED = saved


def test_the_script_prints_every_policy_for_every_bound(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, "--requests", "120", "--scale", "0.2", "--bounds", "10,50",
                          "--span-s", "1200", "--scenario", "all"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for sc in ("tier", "cpu", "restart"):
        assert f"== scenario {sc}:" in text
    for name in ("a lru", "b chain", "c fifo", "d llm-d", "e vllm-fs", "k kvtier", "k-head", "k-rate", "k-sync", "k*",
                 "k+evict", "k+leaf", "k+tree", "a* lru", "b* chain"):
        assert text.count(f"\n{name:<10} |") == 3, name


def test_real_replay_runs_or_says_why(cb, tmp_path):
    # with this tree's kvtier: without max_bytes it says so and exits 2; with it, a tiny replay
    # through two processes on one root loads only the bytes stored for each hash (exit 0)
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, os.pardir))
    out = subprocess.run([sys.executable, SCRIPT, "--real", "--requests", "60", "--scale", "0.2", "--span-s", "600",
                          "--real-seconds", "2", "--real-block-kib", "16", "--root", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env)
    import inspect

    from kvtier.manager import FileSystemTierManager  # this tree's (run from the root, as the subprocess)

    if "max_bytes" not in inspect.signature(FileSystemTierManager.__init__).parameters:
        assert out.returncode == 2 and "has no capacity bound" in out.stderr and "run without --real" in out.stderr
        return
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.startswith(("bound    ", "no bound "))]
    assert len(rows) == 2
    assert rows[0][6] == "0" and rows[1][7] == "0"  # the "wrong" column of both runs
    assert os.listdir(tmp_path) == []  # the roots are removed


def test_capacity_overhead_runs_both_modes_and_checks_every_byte(tmp_path):
    """benchmarks/capacity_overhead.py on a tiny grid: both modes' rows, the evictor line,
    no mismatched byte, the roots removed."""
    script = os.path.join(HERE, os.pardir, "benchmarks", "capacity_overhead.py")
    r = subprocess.run([sys.executable, script, "--root", str(tmp_path), "--sizes", "64K", "--runs", "1",
                        "--rounds", "3", "--jobs", "2", "--blocks-per-job", "2", "--threads", "2", "--no-o-direct"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "## 64 KiB blocks: cell 0 MiB, bound 100 cells" in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("| off |", "| on |"))]
    assert len(rows) == 2 and all(float(ln.split("|")[2].split()[0]) > 0 for ln in rows)
    assert "evictor (bounded runs): " in out and "mismatched bytes: 0" in out
    ev = re.search(r"(\d+) blocks evicted for (\d+) stored", out)
    assert ev and int(ev.group(1)) > 0  # the filler puts the bounded root at its high watermark
    share = re.search(r"evictor at 1 GB/s of stores of these blocks: (\d+) evictions/s x ([\d.]+) us = ([\d.]+)% "
                      r"of one core \(target < 2%\)", out)
    assert share and int(share.group(1)) == round(1e9 / 65536)
    assert abs(float(share.group(3)) - int(share.group(1)) * float(share.group(2)) / 1e4) < 0.1
    assert re.search(r"\(\w+; \S+ on \S+, options \S+ \+ \S+\)", out.splitlines()[0])  # the mount in the header
    assert os.listdir(tmp_path) == []


def test_capacity_census_censuses_evicts_and_splits_the_evictors_cpu(tmp_path):
    """benchmarks/capacity_census.py on 300 files: the census counts them, the eviction
    removes the 100 asked for (files gone from the root) and prints user and system CPU."""
    script = os.path.join(HERE, os.pardir, "benchmarks", "capacity_census.py")
    r = subprocess.run([sys.executable, script, str(tmp_path), "300", "100"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^census: 300 files, \d+ dirs", r.stdout, re.M)
    m = re.search(r"^evict: (\d+) blocks, .* user \(Python\) ([\d.]+) s, system \(kernel: lstat \+ unlink \+ "
                  r"rmdir\) ([\d.]+) s$", r.stdout, re.M)
    assert m and int(m.group(1)) == 100
    left = [f for _, _, fs in os.walk(tmp_path / "root") for f in fs if f.endswith(".bin")]
    assert len(left) == 200


def test_capacity_peak_runs_two_writers_and_reports_each(tmp_path):
    """benchmarks/capacity_peak.py, small and short, usage by census (no tmpfs here): one
    row with the peak, and per writer the jobs stored and dropped and its estimate's
    quantiles; the root removed."""
    script = os.path.join(HERE, os.pardir, "benchmarks", "capacity_peak.py")
    root = tmp_path / "r"
    r = subprocess.run([sys.executable, script, "--root", str(root), "--writers", "2", "--threads", "2",
                        "--max-bytes", "4M", "--block", "64K", "--batch", "2", "--seconds", "1.5", "--runs", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage by census (walks: not a snapshot)" in r.stdout
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| 1 |")]
    assert len(rows) == 1 and len(rows[0]) == 4 + 2 * 2
    peak = float(rows[0][1])
    stored = [int(c.split("/")[0]) for c in (rows[0][4], rows[0][6])]
    assert 0.3 < peak < 2.0 and all(n > 0 for n in stored), r.stdout  # 4 MiB bound, 1.5 s of stores
    assert not root.exists()


@pytest.mark.mount
def test_capacity_peak_runs_two_writers_through_two_glusterfs_clients():
    """--dfs glusterfs: the two writers through the two client mounts of tests/dfs.py, usage
    by the bricks' tmpfs; one row; nothing left mounted."""
    from dfs import missing

    why = missing("glusterfs")
    if why:
        unavailable(why)
    script = os.path.join(HERE, os.pardir, "benchmarks", "capacity_peak.py")
    r = subprocess.run([sys.executable, script, "--dfs", "glusterfs", "--threads", "2", "--max-bytes", "4M",
                        "--block", "64K", "--batch", "2", "--seconds", "1.5", "--runs", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "statvfs of the bricks' tmpfs" in r.stdout and "mnt-a/root" in r.stdout and "mnt-b/root" in r.stdout
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| 1 |")]
    assert len(rows) == 1 and len(rows[0]) == 4 + 2 * 2
    stored = [int(c.split("/")[0]) for c in (rows[0][4], rows[0][6])]
    assert 0.1 < float(rows[0][1]) < 2.0 and all(n > 0 for n in stored), r.stdout
    with open("/proc/self/mounts") as f:
        assert "kvtier-peak-" not in f.read()  # the benchmark's tmpfs and client mounts are gone
