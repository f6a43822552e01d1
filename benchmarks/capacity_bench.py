#!/usr/bin/env python3
"""What a capacity bound's eviction order is worth: usable-prefix hit rate by policy (issue 22, item 6).

    python benchmarks/capacity_bench.py                      # offline: scenarios tier and cpu, ~15 s CPU
    python benchmarks/capacity_bench.py --scenario all       # ... and restart
    python benchmarks/capacity_bench.py --requests 8000 --scale 1 --seed 3
    python benchmarks/capacity_bench.py --scenario cpu --bounds 5,10,25
    python benchmarks/capacity_bench.py --real --procs 2     # the real tier (needs max_bytes in kvtier)
    PYTHONPATH=. python benchmarks/capacity_bench.py --real  # ... with this checkout's kvtier

The trace (seeded, :func:`make_trace`): a prefix-sharing workload of
  - a few hot system prompts (``--sys-prompts``, Zipf-popular) that every request starts with;
  - multi-turn conversations picked by a Zipf law (``--zipf``) from a pool: each turn's prompt
    is the conversation so far (system prompt, every earlier user message and answer) plus a
    new user message, so its prefix grows each turn; a conversation that reaches
    ``--max-context`` blocks ends and its slot starts a new one;
  - one-off documents (``--docs`` of the requests): a system prompt, a long document, a
    question; never asked again.
Every segment is fresh random tokens cut into blocks of 16 tokens, hashed as vLLM 0.33 hashes
them (vllm/v1/core/kv_cache_utils.py ``hash_block_tokens`` with ``vllm.utils.hashing.sha256``:
block hash = sha256(pickle((parent hash, block tokens, None))), the first parent NONE_HASH =
sha256(pickle("vllm-none-hash"))), so blocks are shared exactly where token prefixes are. A
request's prompt blocks are looked up, its answer's blocks are only stored. Arrival times are
spread uniformly over ``--span-s`` of simulated time; each request goes to one of ``--nodes``
engines (its conversation's node with probability ``--sticky``, else any).

Per request (what vLLM 0.33's TieringOffloadingManager does): walk the prompt's blocks from the
head; a block in the node's CPU tier is a hit (vLLM asks the secondary tier only for blocks
missing from its CPU primary: tiering/manager.py lookup()), else the disk tier is asked, and the
walk stops at the first block neither has (usable prefix = the longest cached prefix). The disk
tier's hits are loaded (one load job, head first), the rest of the prompt is recomputed and,
with the answer's blocks, stored (one store job, head first; a block already on disk is
skipped, which the recency policies count as an access). The CPU tier (``--cpu-frac`` of the
working set per node, LRU; vLLM's CPU LRU touches a request's blocks head-newest, and so does
this one) takes every block of the request.

Disk-tier policies, each at bounds of ``--bounds`` percent of the working set (the trace's
unique blocks) and unbounded:
  a lru      exact LRU over blocks (accessed head first: the tail of a walk is the newest)
  b chain    exact LRU over prefix chains: evict the least recently used leaf (a block with no
             cached child), so a block goes only after its descendants
  c fifo     first in, first out; hits change nothing
  d llm-d    llm-d's PVC evictor: every ``--census-s``, above 85% of the bound delete down to
             70% in discovery order (directory order: by path hash), skipping files accessed
             within ``--atime-window-s`` (3600 s in llm-d); atime as ``relatime`` keeps it (the
             first read after a write, then once a day); at 100% stores fail
  e vllm-fs  vLLM 0.33's fs tier on a full disk: nothing is evicted, stores fail once full
  k kvtier   kvtier's policy (issue 22, kvtier/_tier/capacity.py): LRU by persisted mtime; a
             load or lookup hit touches the block, at most once per block per
             ``--touch-window-s`` per process; a store stamps every block of its job
             head-newest (mtime = now - i us for position i); a pass every ``--census-s``, or
             at once when a writer asks (a job taking usage over the high watermark, a
             dropped job), evicts the oldest mtimes down to the low watermark when usage is
             above the high one (``--watermarks``, 0.95 -> 0.85), after a dropped job whatever
             the usage; a store job that would take usage over the bound is dropped whole
  k-head     k without the head-newest stamps (files stamped in write order: the tail newest)
  k-rate     k without the rate limit (every hit touches)
  k-sync     k's order (mtime, rate-limited touches, head-newest) evicting one block at each store
             into a full tier: no census, no watermarks (what k's order is worth by itself)
  k*         k, also told of the blocks the CPU tier served (touches their disk copies, rate-
             limited): vLLM 0.33 never asks the disk tier about those; kvtier's vLLM tier
             learns them from vLLM's request context (every key of a finished request,
             touched in prefix order), so k* is kvtier inside vLLM, k the standalone tier
  k+evict    k, touching a block's disk copy when a node's CPU tier evicts it
  k+leaf     k evicting only leaves, with parent links known within a store job only (block
             i+1 of a job is block i's child: what a tier can record by itself)
  k+tree     k evicting only leaves, with every parent link (the first block of a store job's
             parent too: that needs the request's previous key from vLLM)
  a*, b*     (a), (b) told of the CPU tier's hits too (LRU over every access of the trace)
"best" is the best of a, b, a*, b* at the same bound.

Columns: hit = usable prompt blocks / prompt blocks (CPU and disk tier together: what the
engine saves); disk = the share of prompt blocks the disk tier served; "/best" = the policy's
hit and disk over the best of (a) and (b) at the same bound; recomputed = prompt blocks not
usable x ``--block-mib``; dropped = blocks a full tier did not store; evicted = blocks removed.
Scenarios: ``tier`` (no CPU tier: every lookup reaches the policy), ``cpu`` (a CPU tier per
node in front), ``restart`` (as cpu, and each node restarts once: its CPU tier and per-process
state are lost, at evenly spaced points of the trace).

The real path (``--real``) replays the same trace (scenario tier: no CPU tier) through
kvtier.manager.FileSystemTierManager(buf, root, model, checksum_blocks=True, max_bytes=...,
census_interval_s=..., touch_window_s=..., evict_high/evict_low=``--watermarks``) with
``--procs`` processes on one root (one engine node each, the trace's routing), twice: bound
``--real-bound`` percent of the working set, and no bound. ``--real-seconds`` of wall time
replay the trace's ``--span-s`` (the census interval and the touch window are scaled by the
same factor). Per request: lookup key by key up to the first miss (as vLLM asks), load the
usable prefix (one job; a block evicted between lookup and load is a clean miss), store the
rest with the answer (one job); every loaded block is compared with the bytes stored for
its hash ("wrong" must be 0). Reported: hit (and / the offline best of (a)-(b) at the same
bound), blocks stored and dropped, .bin files left, store and load MB/s (wall time of the
jobs), process CPU of all workers (on - off: what the evictor and census cost), and the
largest of the root's st_blocks usage sampled every 0.1 s against max_bytes + one store
batch per process; from the tier itself: blocks evicted, the evictor's CPU (per evicted
block and as a share of one core) and the last census (files, time; the per-million-files
figure is a linear extrapolation). ``--real-repeat N`` runs N pairs, the order alternating.
Compressing the time line compresses the census interval and touch window too, but not the
time a census takes (kvtier spaces censuses by at least 50 times the scan time): with a
short ``--real-seconds`` the evictor falls behind and stores are dropped at the bound; the
offline k at the same bound is printed for comparison. It needs the capacity mechanism
(``max_bytes``) in the kvtier it imports and says so, exit status 2, if that is missing.
"""
from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import math
import os
import pickle
import platform
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

TOKENS_PER_BLOCK = 16
VOCAB = 128_256  # Llama-3 vocabulary
NONE_HASH_SEED = "vllm-none-hash"  # vllm/v1/core/kv_cache_utils.py DEFAULT_NONE_HASH_SEED
US = 1e-6


# --------------------------------------------------------------------------- hashing
def sha256(obj) -> bytes:
    """vllm.utils.hashing.sha256: SHA-256 of the pickled object (protocol HIGHEST)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = sha256(NONE_HASH_SEED)  # vLLM's init_none_hash(sha256) without PYTHONHASHSEED


def block_hash(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """vLLM's hash_block_tokens(sha256, parent, tokens, extra_keys=None)."""
    return sha256((parent or NONE_HASH, tuple(tokens), None))


# --------------------------------------------------------------------------- trace
@dataclass
class Trace:
    """A replayable request trace over integer block ids.

    ``parent[b]``: id of block b's parent (-1 for a first block); ``hashes[b]``: its chained
    hash (empty for hand-made traces). Per request r: arrival ``t[r]`` (s), the ``prompt[r]``
    block ids (looked up, head first), the ``output[r]`` ids (stored only), ``node[r]``."""

    parent: List[int]
    t: List[float]
    prompt: List[List[int]]
    output: List[List[int]]
    node: List[int]
    hashes: List[bytes] = field(default_factory=list)
    kind: List[str] = field(default_factory=list)

    @property
    def n_blocks(self) -> int:
        return len(self.parent)

    @property
    def n_nodes(self) -> int:
        return max(self.node) + 1 if self.node else 1

    def working_set(self) -> int:
        """Unique blocks the trace touches (prompt or output)."""
        seen = set()
        for p, o in zip(self.prompt, self.output):
            seen.update(p)
            seen.update(o)
        return len(seen)


@dataclass
class TraceParams:
    requests: int = 2000
    scale: float = 0.5  # multiplies every segment length (blocks)
    seed: int = 0
    zipf: float = 1.0  # exponent of conversation and system-prompt popularity
    sys_prompts: int = 8
    conversations: int = 0  # pool size; 0 = requests // 8
    docs: float = 0.15  # share of requests that are one-off documents
    max_context: int = 256  # blocks (at scale 1) after which a conversation ends
    nodes: int = 2
    sticky: float = 0.9
    span_s: float = 4 * 3600.0


def _zipf_cdf(n: int, s: float) -> List[float]:
    w = [1.0 / (i + 1) ** s for i in range(n)]
    tot = sum(w)
    acc, out = 0.0, []
    for x in w:
        acc += x / tot
        out.append(acc)
    out[-1] = 1.0
    return out


def make_trace(p: TraceParams) -> Trace:
    rng = random.Random(p.seed)
    parent: List[int] = []
    hashes: List[bytes] = []

    def ln(lo: int, hi: int) -> int:
        return max(1, int(round(rng.randint(lo, hi) * p.scale)))

    def extend(chain: List[int], n: int) -> List[int]:
        """n fresh blocks after ``chain`` (a list of ids, head first); returns the new ids."""
        new = []
        par = chain[-1] if chain else -1
        ph = hashes[par] if par >= 0 else None
        for _ in range(n):
            toks = [rng.randrange(VOCAB) for _ in range(TOKENS_PER_BLOCK)]
            h = block_hash(ph, toks)
            b = len(parent)
            parent.append(par)
            hashes.append(h)
            new.append(b)
            par, ph = b, h
        return new

    sys_chains = [extend([], ln(8, 64)) for _ in range(p.sys_prompts)]
    sys_cdf = _zipf_cdf(p.sys_prompts, p.zipf)
    n_conv = p.conversations or max(16, p.requests // 8)
    conv_cdf = _zipf_cdf(n_conv, p.zipf)
    convs: List[Optional[List[int]]] = [None] * n_conv
    conv_node = [0] * n_conv
    max_ctx = max(4, int(p.max_context * p.scale))
    times = sorted(rng.uniform(0, p.span_s) for _ in range(p.requests))
    tr = Trace(parent, times, [], [], [], hashes, [])
    for r in range(p.requests):
        if rng.random() < p.docs:
            s = sys_chains[bisect.bisect_left(sys_cdf, rng.random())]
            doc = extend(s, ln(32, 192))
            q = extend(s + doc, ln(1, 2))
            prompt = s + doc + q
            out = extend(prompt, ln(1, 8))
            node = rng.randrange(p.nodes)
            kind = "doc"
        else:
            i = bisect.bisect_left(conv_cdf, rng.random())
            c = convs[i]
            if c is None or len(c) >= max_ctx:
                c = list(sys_chains[bisect.bisect_left(sys_cdf, rng.random())])
                conv_node[i] = rng.randrange(p.nodes)
            prompt = c + extend(c, ln(1, 6))
            out = extend(prompt, ln(2, 16))
            convs[i] = prompt + out
            node = conv_node[i] if rng.random() < p.sticky else rng.randrange(p.nodes)
            kind = "conv"
        tr.prompt.append(prompt)
        tr.output.append(out)
        tr.node.append(node)
        tr.kind.append(kind)
    return tr


# --------------------------------------------------------------------------- policies
class Policy:
    """A disk tier's content and eviction rule. Times in simulated seconds; ``node`` is the
    process asking. Counters: ``evicted``, ``dropped`` (stores refused), ``stored``."""

    name = "?"
    sees_cpu_hits = False  # told of every usable block, also those the CPU tier served

    def __init__(self, cap: Optional[int]):
        self.cap = cap  # blocks, None = unbounded
        self.evicted = self.dropped = self.stored = 0

    def tick(self, now: float) -> None:
        pass

    def restart(self, node: int) -> None:
        pass

    def __contains__(self, b: int) -> bool:
        raise NotImplementedError

    def on_hits(self, blocks: List[int], now: float, node: int) -> None:
        pass

    def store(self, blocks: List[int], now: float, node: int, prefix: Sequence[int] = ()) -> None:
        raise NotImplementedError

    def on_cpu_evict(self, blocks: List[int], now: float, node: int) -> None:
        pass

    def cached(self):
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.cached())


class LRU(Policy):
    """(a) exact LRU over blocks; also the unbounded tier (cap None)."""

    name = "a lru"

    def __init__(self, cap):
        super().__init__(cap)
        self.od: "OrderedDict[int, None]" = OrderedDict()

    def __contains__(self, b):
        return b in self.od

    def on_hits(self, blocks, now, node):
        mte = self.od.move_to_end
        for b in blocks:
            mte(b)

    def store(self, blocks, now, node, prefix=()):
        od, cap = self.od, self.cap
        for b in blocks:
            if b in od:
                od.move_to_end(b)
                continue
            if cap is not None and len(od) >= cap:
                od.popitem(last=False)
                self.evicted += 1
            od[b] = None
            self.stored += 1

    def cached(self):
        return set(self.od)

    def __len__(self):
        return len(self.od)


class Unbounded(LRU):
    name = "unbounded"

    def __init__(self, cap=None):
        super().__init__(None)


class ChainLRU(Policy):
    """(b) LRU over prefix chains: evict the least recently used leaf."""

    name = "b chain"

    def __init__(self, cap, parent: List[int]):
        super().__init__(cap)
        self.parent = parent
        self.kids = [0] * len(parent)  # cached children of each block (cached or not)
        self.stamp: Dict[int, int] = {}
        self.heap: list = []
        self.clock = 0

    def __contains__(self, b):
        return b in self.stamp

    def _touch(self, b):
        self.clock += 1
        self.stamp[b] = self.clock
        if self.kids[b] == 0:
            heapq.heappush(self.heap, (self.clock, b))

    def on_hits(self, blocks, now, node):
        for b in blocks:
            self._touch(b)

    def _evict_one(self):
        heap, stamp, kids = self.heap, self.stamp, self.kids
        while True:
            s, b = heapq.heappop(heap)
            if stamp.get(b) != s or kids[b]:
                continue  # stale entry, or no longer a leaf (pushed again when it is)
            del stamp[b]
            self.evicted += 1
            p = self.parent[b]
            if p >= 0:
                kids[p] -= 1
                if kids[p] == 0 and p in stamp:
                    heapq.heappush(heap, (stamp[p], p))
            return

    def store(self, blocks, now, node, prefix=()):
        for b in blocks:
            if b in self.stamp:
                self._touch(b)
                continue
            if self.cap is not None and len(self.stamp) >= self.cap:
                self._evict_one()
            p = self.parent[b]
            if p >= 0:
                self.kids[p] += 1
            self._touch(b)
            self.stored += 1

    def cached(self):
        return set(self.stamp)

    def __len__(self):
        return len(self.stamp)


class FIFO(Policy):
    name = "c fifo"

    def __init__(self, cap):
        super().__init__(cap)
        self.od: "OrderedDict[int, None]" = OrderedDict()

    def __contains__(self, b):
        return b in self.od

    def store(self, blocks, now, node, prefix=()):
        od, cap = self.od, self.cap
        for b in blocks:
            if b in od:
                continue
            if cap is not None and len(od) >= cap:
                od.popitem(last=False)
                self.evicted += 1
            od[b] = None
            self.stored += 1

    def cached(self):
        return set(self.od)

    def __len__(self):
        return len(self.od)


class VllmFs(Policy):
    """(e) vLLM 0.33's fs tier: no bound of its own; once the disk is full stores fail."""

    name = "e vllm-fs"

    def __init__(self, cap):
        super().__init__(cap)
        self.s = set()

    def __contains__(self, b):
        return b in self.s

    def store(self, blocks, now, node, prefix=()):
        s = self.s
        for b in blocks:
            if b in s:
                continue
            if len(s) >= self.cap:
                self.dropped += 1
                continue
            s.add(b)
            self.stored += 1

    def cached(self):
        return set(self.s)

    def __len__(self):
        return len(self.s)


class LlmD(Policy):
    """(d) llm-d's PVC evictor: statvfs-like watermarks, atime window, discovery order."""

    name = "d llm-d"
    DAY = 86400.0

    def __init__(self, cap, hashes: List[bytes], n_blocks: int, interval: float, atime_window: float,
                 high: float = 0.85, low: float = 0.70):
        super().__init__(cap)
        # discovery (directory) order: by a hash of the file name, as ext4's htree readdir
        if hashes:
            self.key = [int.from_bytes(hashlib.blake2b(h, digest_size=8).digest(), "big") for h in hashes]
        else:
            rk = random.Random(12345)
            self.key = [rk.getrandbits(64) for _ in range(n_blocks)]
        self.interval, self.window = interval, atime_window
        self.high, self.low = high * cap, low * cap
        self.mtime: Dict[int, float] = {}
        self.atime: Dict[int, float] = {}
        self.hot: list = []  # (atime + window, b): skipped until then
        self.cold: list = []  # (discovery key, b): candidates, in directory order
        self.next = interval

    def __contains__(self, b):
        return b in self.mtime

    def on_hits(self, blocks, now, node):
        at, mt = self.atime, self.mtime
        for b in blocks:  # relatime: first read after a write, then once a day
            if at[b] <= mt[b] or now - at[b] >= self.DAY:
                at[b] = now

    def store(self, blocks, now, node, prefix=()):
        for b in blocks:
            if b in self.mtime:
                continue
            if len(self.mtime) >= self.cap:
                self.dropped += 1
                continue
            self.mtime[b] = self.atime[b] = now
            heapq.heappush(self.hot, (now + self.window, b))
            self.stored += 1

    def tick(self, now):
        while now >= self.next:
            t = self.next
            self.next += self.interval
            if len(self.mtime) < self.high:
                continue
            hot, cold, at = self.hot, self.cold, self.atime
            while hot and hot[0][0] <= t:
                _, b = heapq.heappop(hot)
                if b in at:
                    if t - at[b] >= self.window:
                        heapq.heappush(cold, (self.key[b], b))
                    else:
                        heapq.heappush(hot, (at[b] + self.window, b))
            while cold and len(self.mtime) > self.low:
                _, b = heapq.heappop(cold)
                if b not in at:
                    continue
                if t - at[b] < self.window:  # read since it cooled down
                    heapq.heappush(hot, (at[b] + self.window, b))
                    continue
                del self.mtime[b], self.atime[b]
                self.evicted += 1

    def cached(self):
        return set(self.mtime)

    def __len__(self):
        return len(self.mtime)


class Kvtier(Policy):
    """(k) kvtier as the capacity branch builds it (kvtier/_tier/capacity.py): LRU by
    persisted mtime, rate-limited touches on hits, head-newest stamps of every block of a
    store job, passes at the census interval or when a writer asks, eviction from the high
    to the low watermark, whole store jobs dropped at the bound."""

    name = "k kvtier"

    def __init__(self, cap, n_nodes: int, census: float, touch_window: float, head_newest=True,
                 rate_limit=True, sees_cpu_hits=False, touch_on_cpu_evict=False, high=0.95, low=0.85,
                 sync=False, parents: Optional[str] = None, parent: Sequence[int] = (), name=None):
        super().__init__(cap)
        # parents: None (plain mtime order), "job" (a block is a leaf unless a block stored after
        # it in the same store job is on disk: what a tier sees by itself) or "all" (the trace's
        # parent links, as vLLM's request context would give them): only leaves are evicted
        self.parents = parents
        self.parent = parent
        self.kids = [0] * len(parent) if parents else None
        self.par: Dict[int, int] = {}
        if name:
            self.name = name
        self.census, self.window = census, touch_window
        self.head_newest, self.rate_limit = head_newest, rate_limit
        self.sees_cpu_hits, self.touch_on_cpu_evict = sees_cpu_hits, touch_on_cpu_evict
        self.sync = sync  # evict the oldest mtime at each store into a full tier (no census, no watermarks)
        self.high, self.low = high * cap, low * cap
        self.mtime: Dict[int, float] = {}
        self.heap: list = []
        self.last = [dict() for _ in range(n_nodes)]  # per process: block -> last touch
        self.next = census
        self.request: Optional[str] = None  # a pass asked for by a writer ("capacity", "drop")

    def __contains__(self, b):
        return b in self.mtime

    def restart(self, node):
        self.last[node] = {}

    def _stamp(self, i, now):
        return now - i * US if self.head_newest else now + i * US

    def _touch_job(self, blocks, now, node):
        last, w, mt = self.last[node], self.window, self.mtime
        i = 0
        for b in blocks:
            if self.rate_limit and now - last.get(b, -math.inf) < w:
                continue
            last[b] = now
            m = self._stamp(i, now)
            i += 1
            mt[b] = m
            heapq.heappush(self.heap, (m, b))

    def on_hits(self, blocks, now, node):
        self._touch_job(blocks, now, node)

    def on_cpu_evict(self, blocks, now, node):
        if self.touch_on_cpu_evict:
            self._touch_job([b for b in blocks if b in self.mtime], now, node)

    def store(self, blocks, now, node, prefix=()):
        mt, last = self.mtime, self.last[node]
        if not self.sync:
            # admission of the whole job (kvtier reserves its bytes: every block of it, on
            # disk already or not): over the bound it is dropped and a pass is asked for now;
            # over the high watermark a pass is asked for (kvtier/_tier/capacity.py admit)
            if len(mt) + len(blocks) > self.cap:
                self.dropped += sum(1 for b in blocks if b not in mt)
                self.request = "drop"
                return
            if len(mt) + len(blocks) > self.high and not self.request:
                self.request = "capacity"
        for j, b in enumerate(blocks):
            m = self._stamp(j, now)  # a store stamps every block of its job, head newest
            if b not in mt:
                if self.sync and len(mt) >= self.cap:
                    self._evict_oldest()
                self.stored += 1
                if self.parents:
                    p = self.parent[b] if self.parents == "all" else (blocks[j - 1] if j else -1)
                    if p >= 0:
                        self.kids[p] += 1
                        self.par[b] = p
            mt[b] = m
            last[b] = now
            heapq.heappush(self.heap, (m, b))

    def _evict_oldest(self):
        mt, heap, kids = self.mtime, self.heap, self.kids
        while True:
            m, b = heapq.heappop(heap)
            if mt.get(b) != m:
                continue
            if kids is not None and kids[b]:
                continue  # not a leaf: pushed again when its last child goes
            del mt[b]
            self.evicted += 1
            if kids is not None:
                p = self.par.pop(b, -1)
                if p >= 0:
                    kids[p] -= 1
                    if kids[p] == 0 and p in mt:
                        heapq.heappush(heap, (mt[p], p))
            return

    def tick(self, now):
        """The evictor: a pass (census, then eviction) every ``census`` seconds, or at once
        when a writer asked for one (kvtier spaces requested passes by 50 x the scan time:
        0 here). A pass evicts down to the low watermark when usage is above the high one,
        or after a dropped store whatever the usage (kvtier/_tier/capacity.py one_pass)."""
        if self.sync:
            return
        req, self.request = self.request, None
        if now >= self.next:
            self.next = now + self.census
        elif not req:
            return
        else:
            self.next = now + self.census
        mt = self.mtime
        if len(mt) > self.high or req == "drop":
            while len(mt) > self.low:
                self._evict_oldest()

    def cached(self):
        return set(self.mtime)

    def __len__(self):
        return len(self.mtime)


POLICIES = ["a", "b", "a*", "b*", "c", "d", "e", "k", "k-head", "k-rate", "k-sync", "k*", "k+evict", "k+leaf",
            "k+tree"]
BASELINES = ("a lru", "b chain", "a* lru", "b* chain")  # the offline LRUs: "best" is the best of them


def make_policy(which: str, cap: Optional[int], trace: Trace, a) -> Policy:
    if cap is None:
        return Unbounded()
    if which in ("a", "a*"):
        p = LRU(cap)
    elif which in ("b", "b*"):
        p = ChainLRU(cap, trace.parent)
    elif which == "c":
        return FIFO(cap)
    elif which == "d":
        return LlmD(cap, trace.hashes, trace.n_blocks, a.census_s, a.atime_window_s)
    elif which == "e":
        return VllmFs(cap)
    else:
        hi, lo = (float(x) for x in a.watermarks.split(","))
        kw = dict(n_nodes=trace.n_nodes, census=a.census_s, touch_window=a.touch_window_s, high=hi, low=lo)
        variants = {
            "k": dict(),
            "k-head": dict(head_newest=False),
            "k-rate": dict(rate_limit=False),
            "k-sync": dict(sync=True),
            "k*": dict(sees_cpu_hits=True),
            "k+evict": dict(touch_on_cpu_evict=True),
            "k+leaf": dict(parents="job", parent=trace.parent),
            "k+tree": dict(parents="all", parent=trace.parent),
        }
        if which not in variants:
            raise ValueError(f"unknown policy {which!r}")
        return Kvtier(cap, name="k kvtier" if which == "k" else which, **kw, **variants[which])
    if which.endswith("*"):
        p.sees_cpu_hits = True
        p.name = p.name.replace(" ", "* ", 1)
    return p


# --------------------------------------------------------------------------- replay
@dataclass
class Result:
    policy: str
    requested: int = 0  # prompt blocks
    usable: int = 0  # prompt blocks in the usable prefix (CPU or disk)
    from_disk: int = 0  # of those, served by the disk tier
    dropped: int = 0
    evicted: int = 0
    stored: int = 0
    fill_sum: float = 0.0  # usage / bound, summed over the second half's requests
    fill_n: int = 0

    @property
    def fill(self) -> float:
        return self.fill_sum / self.fill_n if self.fill_n else float("nan")

    @property
    def hit(self) -> float:
        return self.usable / self.requested if self.requested else 0.0

    @property
    def disk(self) -> float:
        return self.from_disk / self.requested if self.requested else 0.0


def replay(trace: Trace, policy: Policy, cpu_blocks: int = 0, restarts: Sequence[tuple] = ()) -> Result:
    """Run ``trace`` through a CPU tier per node (LRU of ``cpu_blocks``, 0 = none) in front of
    ``policy``. ``restarts``: (request index, node) pairs: before that request the node's CPU
    tier and the policy's per-process state of that node are lost."""
    nodes = trace.n_nodes
    cpus = [OrderedDict() for _ in range(nodes)] if cpu_blocks else None
    at_restart: Dict[int, List[int]] = {}
    for r, nd in restarts:
        at_restart.setdefault(r, []).append(nd)
    res = Result(policy.name)
    contains = policy.__contains__
    see_all = policy.sees_cpu_hits
    hook = getattr(policy, "touch_on_cpu_evict", False)
    half = len(trace.t) // 2
    for r in range(len(trace.t)):
        now = trace.t[r]
        policy.tick(now)
        node = trace.node[r]
        for nd in at_restart.get(r, ()):
            if cpus:
                cpus[nd].clear()
            policy.restart(nd)
        prompt = trace.prompt[r]
        usable = 0
        hits = []
        if cpus:
            cpu = cpus[node]
            for b in prompt:
                if b in cpu:
                    usable += 1
                elif contains(b):
                    hits.append(b)
                    usable += 1
                else:
                    break
        else:
            for b in prompt:
                if contains(b):
                    usable += 1
                else:
                    break
            hits = prompt[:usable]
        if see_all and cpus:
            held = [b for b in prompt[:usable] if contains(b)]
            if held:
                policy.on_hits(held, now, node)
        elif hits:
            policy.on_hits(hits, now, node)
        policy.store(prompt[usable:] + trace.output[r], now, node, prompt[:usable])
        res.requested += len(prompt)
        res.usable += usable
        res.from_disk += len(hits)
        if cpus:  # the whole request into the CPU LRU, head newest (vLLM's touch order)
            mte = cpu.move_to_end
            for b in reversed(trace.output[r]):
                cpu[b] = None
            for b in reversed(prompt):
                if b in cpu:
                    mte(b)
                else:
                    cpu[b] = None
            gone = []
            while len(cpu) > cpu_blocks:
                gone.append(cpu.popitem(last=False)[0])
            if gone and hook:
                policy.on_cpu_evict(gone, now, node)
        if r >= half and policy.cap:
            res.fill_sum += len(policy) / policy.cap
            res.fill_n += 1
    res.dropped, res.evicted, res.stored = policy.dropped, policy.evicted, policy.stored
    return res


def seen_before_fraction(trace: Trace) -> float:
    """Share of prompt blocks stored by an earlier request (prompt or output): the hit rate of
    an unbounded tier, counted without any cache."""
    seen = set()
    hit = tot = 0
    for p, o in zip(trace.prompt, trace.output):
        hit += sum(1 for b in p if b in seen)
        tot += len(p)
        seen.update(p)
        seen.update(o)
    return hit / tot if tot else 0.0


# --------------------------------------------------------------------------- offline report
SCENARIOS = {
    "tier": "no CPU tier: every lookup reaches the disk tier",
    "cpu": "a CPU tier per node (LRU) in front: the disk tier sees only CPU misses",
    "restart": "as cpu, and each node restarts once (CPU tier and per-process state lost)",
}


def run_offline(a) -> dict:
    t0 = time.perf_counter()
    tp = TraceParams(requests=a.requests, scale=a.scale, seed=a.seed, zipf=a.zipf, sys_prompts=a.sys_prompts,
                     docs=a.docs, nodes=a.nodes, sticky=a.sticky, span_s=a.span_s, max_context=a.max_context)
    trace = make_trace(tp)
    t_trace = time.perf_counter() - t0
    ws = trace.working_set()
    n_ref = sum(map(len, trace.prompt))
    bounds = [float(x) for x in a.bounds.split(",")]
    pols = a.policies.split(",")
    cpu_blocks = int(round(a.cpu_frac * ws)) if a.cpu_frac > 0 else 0
    scen = a.scenario.split(",") if a.scenario != "all" else list(SCENARIOS)
    print(f"capacity_bench: {a.requests} requests over {a.span_s:.0f} s simulated ({a.requests / a.span_s:.3f}/s), "
          f"seed {a.seed}, scale {a.scale}, {a.nodes} nodes, sticky {a.sticky}")
    kinds = {k: trace.kind.count(k) for k in ("conv", "doc")}
    print(f"trace: {kinds['conv']} conversation turns (Zipf {a.zipf}, pool {max(16, a.requests // 8)}), "
          f"{kinds['doc']} one-off documents, {a.sys_prompts} system prompts; working set {ws} blocks "
          f"({ws * a.block_mib / 1024:.1f} GiB at {a.block_mib} MiB/block), {n_ref} prompt blocks looked up; "
          f"seen-before share {seen_before_fraction(trace):.3f}; made in {t_trace:.1f} s")
    print(f"clocks: census/evictor every {a.census_s:g} s, kvtier touch window {a.touch_window_s:g} s, "
          f"kvtier watermarks {a.watermarks}, "
          f"llm-d atime window {a.atime_window_s:g} s; CPU tier {cpu_blocks} blocks per node "
          f"({a.cpu_frac:.0%} of the working set)")
    print(f"machine: {platform.node()} {platform.machine()}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    out = {"working_set": ws, "scenarios": {}}
    for sc in scen:
        cb = 0 if sc == "tier" else cpu_blocks
        rs = []
        if sc == "restart":
            n = len(trace.t)
            rs = [(int(n * (i + 1) / (trace.n_nodes + 1)), i) for i in range(trace.n_nodes)]
        unb = replay(trace, Unbounded(), cb, rs)
        store_rate = unb.stored / a.span_s
        rows = {}
        for bp in bounds:
            cap = max(1, int(round(ws * bp / 100)))
            rows[bp] = [replay(trace, make_policy(p, cap, trace, a), cb, rs) for p in pols]
        out["scenarios"][sc] = (unb, rows)
        print()
        print(f"== scenario {sc}: {SCENARIOS[sc]}" + (f"; restarts before requests {[r for r, _ in rs]}" if rs else ""))
        print(f"unbounded: hit {unb.hit:.3f}, disk {unb.disk:.3f}, stored {unb.stored} blocks "
              f"({store_rate:.2f} blocks/s)")
        # summary: hit rate per policy and bound, ratio to best(a,b)
        hdr = "policy    " + "".join(f" | {bp:>5g}%: hit  /best  disk  /best" for bp in bounds)
        print(hdr)
        print("-" * len(hdr))
        best = {}
        for bp in bounds:
            ab = [r for r in rows[bp] if r.policy in BASELINES]
            best[bp] = (max((r.hit for r in ab), default=float("nan")), max((r.disk for r in ab), default=float("nan")))
        for i, p in enumerate(pols):
            line = f"{rows[bounds[0]][i].policy:<10}"
            for bp in bounds:
                r = rows[bp][i]
                bh, bd = best[bp]
                line += (f" |       {r.hit:.3f} {r.hit / bh if bh else float('nan'):5.3f} {r.disk:.3f} "
                         f"{r.disk / bd if bd else float('nan'):5.3f}")
            print(line)
        print(f"{'unbounded':<10}" + "".join(f" |       {unb.hit:.3f}   -   {unb.disk:.3f}   -  " for _ in bounds))
        print()
        print(f"{'bound':>6} {'blocks':>7} {'turnover':>9} {'policy':<10} {'recomputed GiB':>14} {'dropped':>8} "
              f"{'evicted':>8} {'stored':>8} {'fill':>5}")
        for bp in bounds:
            cap = max(1, int(round(ws * bp / 100)))
            turn = cap / store_rate if store_rate else float("inf")
            for i, r in enumerate(rows[bp]):
                rec = (r.requested - r.usable) * a.block_mib / 1024
                pre = f"{bp:>5g}% {cap:>7} {turn:>8.0f}s" if i == 0 else " " * 24
                print(f"{pre} {r.policy:<10} {rec:>14.1f} {r.dropped:>8} {r.evicted:>8} {r.stored:>8} {r.fill:5.2f}")
        rec = (unb.requested - unb.usable) * a.block_mib / 1024
        print(f"{'inf':>6} {'':>7} {'':>9} {'unbounded':<10} {rec:>14.1f} {0:>8} {0:>8} {unb.stored:>8}")
    print(f"\n(turnover = bound / store rate of the unbounded tier: how long an untouched block survives; "
          f"total {time.perf_counter() - t0:.1f} s)")
    return out


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--scale", type=float, default=0.5, help="multiplies every segment's length in blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--sys-prompts", type=int, default=8)
    ap.add_argument("--docs", type=float, default=0.15, help="share of requests that are one-off documents")
    ap.add_argument("--max-context", type=int, default=256, help="blocks (at scale 1) that end a conversation")
    ap.add_argument("--nodes", type=int, default=2, help="engines (processes) sharing the disk tier")
    ap.add_argument("--sticky", type=float, default=0.9, help="probability a turn goes to its conversation's node")
    ap.add_argument("--span-s", type=float, default=4 * 3600.0, help="simulated duration of the trace")
    ap.add_argument("--bounds", default="10,25,50", help="percent of the working set")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--scenario", default="tier,cpu", help="tier, cpu, restart (comma list) or all")
    ap.add_argument("--cpu-frac", type=float, default=0.02, help="CPU tier per node, share of the working set")
    ap.add_argument("--census-s", type=float, default=10.0, help="evictor interval (kvtier census, llm-d crawl)")
    ap.add_argument("--touch-window-s", type=float, default=60.0,
                    help="kvtier: one touch per block per process per window")
    ap.add_argument("--watermarks", default="0.95,0.85",
                    help="kvtier: evict above HIGH down to LOW (shares of the bound)")
    ap.add_argument("--atime-window-s", type=float, default=3600.0, help="llm-d: skip files accessed this recently")
    ap.add_argument("--block-mib", type=float, default=2.0,
                    help="bytes per block for the GiB column (Llama-3.1-8B: 2 MiB)")
    ap.add_argument("--real", action="store_true", help="replay through the real tier (needs max_bytes in kvtier)")
    ap.add_argument("--procs", type=int, default=2, help="--real: processes on one root")
    ap.add_argument("--root", default=None, help="--real: directory for the roots (default a temp dir)")
    ap.add_argument("--real-block-kib", type=int, default=64, help="--real: block size")
    ap.add_argument("--real-bound", type=float, default=25.0, help="--real: bound, percent of the working set")
    ap.add_argument("--real-seconds", type=float, default=60.0,
                    help="--real: wall time the trace's span is replayed in")
    ap.add_argument("--real-repeat", type=int, default=1,
                    help="--real: pairs of runs (bound, no bound), order alternating")
    ap.add_argument("--keep", action="store_true", help="--real: keep the roots")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.real:
        return run_real(a)
    run_offline(a)
    return 0


# --------------------------------------------------------------------------- the real tier
def _real_api():
    """(FileSystemTierManager, TransferJob, the constructor's parameter names), or a reason."""
    import inspect

    try:
        import kvtier
        from kvtier.manager import FileSystemTierManager, TransferJob
    except ImportError as e:
        return None, f"kvtier is not importable: {e}"
    params = set(inspect.signature(FileSystemTierManager.__init__).parameters)
    if "max_bytes" not in params:
        return None, (f"this kvtier ({os.path.dirname(kvtier.__file__)}) has no capacity bound: "
                      f"FileSystemTierManager takes no max_bytes (issue 22; the capacity branch adds it). "
                      f"The offline simulation needs nothing: run without --real.")
    return (FileSystemTierManager, TransferJob, params), None


def _pattern(h: bytes, block_size: int) -> bytes:
    return (h * (block_size // len(h) + 1))[:block_size]


def _du(root: str) -> Tuple[int, int]:
    """(bytes of regular files, bytes of directories) the filesystem spends under root
    (st_blocks * 512); kvtier's census counts the first."""
    files = dirs = 0
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if e.is_dir(follow_symlinks=False):
                        dirs += st.st_blocks * 512
                        stack.append(e.path)
                    else:
                        files += st.st_blocks * 512
        except (FileNotFoundError, NotADirectoryError):
            continue
    return files, dirs


def _real_worker(proc, a, tp, root, max_bytes, t_start, speedup, q):
    """One engine process: replay the requests routed to ``proc`` through a tier on ``root``."""
    import numpy as np

    (Mgr, Job, params), _ = _real_api()
    trace = make_trace(tp)
    bs = a.real_block_kib * 1024
    nslots = max(len(p) + len(o) for p, o in zip(trace.prompt, trace.output))
    buf = np.zeros((nslots, bs), dtype=np.uint8)
    kw = dict(checksum_blocks=True, n_read_threads=4, n_write_threads=4, max_bytes=max_bytes)
    hi, lo = (float(x) for x in a.watermarks.split(","))
    for name, v in (("census_interval_s", a.census_s / speedup), ("touch_window_s", a.touch_window_s / speedup),
                    ("evict_high", hi), ("evict_low", lo)):
        if name in params:
            kw[name] = v
    mgr = Mgr(buf, root, "capacity-bench/model", **kw)
    st = dict(proc=proc, requested=0, usable=0, stored=0, dropped=0, wrong=0, load_s=0.0, load_b=0, store_s=0.0,
              store_b=0, load_miss=0, kw={k: v for k, v in kw.items() if k != "max_bytes"})
    c0 = time.process_time()
    jid = 0
    try:
        for r in range(len(trace.t)):
            if trace.node[r] != proc:
                continue
            due = t_start + trace.t[r] / speedup
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)
            prompt = trace.prompt[r]
            keys = [(trace.hashes[b], 0) for b in prompt]
            usable = 0  # one key at a time, up to the first miss, as vLLM's scheduler asks
            while usable < len(keys) and mgr.lookup(keys[usable:usable + 1])[0]:
                usable += 1
            if usable:
                jid += 1
                t0 = time.perf_counter()
                mgr.submit_load(Job(jid, keys[:usable], list(range(usable))))
                mgr.drain_jobs()
                st["load_s"] += time.perf_counter() - t0
                (res,) = mgr.get_finished_jobs()
                got = len(res.successful_keys) if not res.success else usable
                st["load_miss"] += usable - got  # evicted between lookup and load: a clean miss
                st["load_b"] += got * bs
                for i in range(got):
                    if bytes(buf[i]) != _pattern(keys[i][0], bs):
                        st["wrong"] += 1
                usable = got
            st["requested"] += len(prompt)
            st["usable"] += usable
            new = prompt[usable:] + trace.output[r]
            if new:
                for i, b in enumerate(new):
                    buf[i] = np.frombuffer(_pattern(trace.hashes[b], bs), dtype=np.uint8)
                jid += 1
                t0 = time.perf_counter()
                mgr.submit_store(Job(jid, [(trace.hashes[b], 0) for b in new], list(range(len(new)))))
                mgr.drain_jobs()
                st["store_s"] += time.perf_counter() - t0
                (res,) = mgr.get_finished_jobs()
                ok = len(new) if res.success else len(res.successful_keys)
                st["stored"] += ok
                st["dropped"] += len(new) - ok
                st["store_b"] += ok * bs
    finally:
        st["cpu_s"] = time.process_time() - c0
        try:
            snap = mgr.metrics.counters.snapshot()
        except AttributeError:
            snap = {}
        st["evicted"] = int(sum(v for k, v in snap.items() if k.startswith("evicted_") and "bytes" not in k))
        st["stores_dropped_jobs"] = int(snap.get("stores_dropped", 0))
        rc = getattr(getattr(mgr, "capacity", None), "rc", None)
        st["evictor_cpu_s"] = float(getattr(rc, "evictor_cpu_s", 0.0) or 0.0)
        st["passes"] = int(getattr(rc, "passes", 0) or 0)
        c = getattr(rc, "last_census", None)
        st["census"] = (c.files, c.scan_finished - c.scan_started, c.cpu_s) if c is not None else None
        mgr.shutdown()
        q.put(st)


def run_real(a) -> int:
    api, why = _real_api()
    if api is None:
        print(f"capacity_bench --real: cannot run: {why}", file=sys.stderr)
        return 2
    import multiprocessing as mp
    import shutil
    import tempfile
    import threading

    tp = TraceParams(requests=a.requests, scale=a.scale, seed=a.seed, zipf=a.zipf, sys_prompts=a.sys_prompts,
                     docs=a.docs, nodes=a.procs, sticky=a.sticky, span_s=a.span_s, max_context=a.max_context)
    trace = make_trace(tp)
    ws = trace.working_set()
    bs = a.real_block_kib * 1024
    cap_blocks = max(1, int(round(ws * a.real_bound / 100)))
    max_bytes = cap_blocks * bs
    batch = max(len(p) + len(o) for p, o in zip(trace.prompt, trace.output)) * bs
    speedup = a.span_s / a.real_seconds
    base = tempfile.mkdtemp(prefix="kvtier-capbench-", dir=a.root)
    print(f"capacity_bench --real: {a.requests} requests, {a.procs} processes on one root under {base}, "
          f"blocks {a.real_block_kib} KiB, working set {ws} blocks ({ws * bs / 2**20:.0f} MiB), "
          f"bound {a.real_bound:g}% = {max_bytes / 2**20:.1f} MiB; trace time x{speedup:.0f} "
          f"({a.span_s:.0f} s in {a.real_seconds:.0f} s); checksums on; load average {os.getloadavg()[0]:.1f}")
    sim = replay(trace, make_policy("k", cap_blocks, trace, a))
    best = max(replay(trace, make_policy(p, cap_blocks, trace, a)).hit for p in ("a", "b"))
    rows = []
    ctx = mp.get_context("fork")
    try:
        plan = []
        for i in range(a.real_repeat):  # alternate which goes first
            pair = [("bound", max_bytes), ("no bound", None)]
            plan += pair if i % 2 == 0 else pair[::-1]
        for n_run, (label, mb) in enumerate(plan):
            root = os.path.join(base, f"{n_run}-{label.replace(' ', '-')}")
            os.makedirs(root)
            q = ctx.Queue()
            t_start = time.time() + 2.0
            ps = [ctx.Process(target=_real_worker, args=(i, a, tp, root, mb, t_start, speedup, q))
                  for i in range(a.procs)]
            for p in ps:
                p.start()
            samples = []
            done = threading.Event()

            def sample():
                while not done.is_set():
                    samples.append(_du(root))
                    done.wait(0.1)

            th = threading.Thread(target=sample, daemon=True)
            th.start()
            sts = [q.get() for _ in ps]
            for p in ps:
                p.join()
            done.set()
            th.join()
            bad = [p.exitcode for p in ps if p.exitcode]
            if bad:
                print(f"capacity_bench --real: a worker failed (exit {bad})", file=sys.stderr)
                return 1
            agg = {k: sum(s[k] for s in sts) for k in ("requested", "usable", "stored", "dropped", "wrong",
                                                        "load_s", "load_b", "store_s", "store_b", "load_miss",
                                                        "cpu_s", "evicted", "evictor_cpu_s", "passes",
                                                        "stores_dropped_jobs")}
            agg["max_usage"] = max((f for f, _ in samples), default=0)
            agg["max_usage_dirs"] = max((f + d for f, d in samples), default=0)
            agg["censuses"] = [s["census"] for s in sts if s["census"]]
            agg["end_usage"] = _du(root)[0]
            agg["files"] = sum(f.endswith(".bin") for _, _, fs in os.walk(root) for f in fs)
            agg["samples"] = len(samples)
            agg["label"], agg["kw"] = label, sts[0]["kw"]
            rows.append(agg)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    import kvtier

    print(f"kvtier {os.path.dirname(kvtier.__file__)}; tier arguments: {rows[0]['kw']}; "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    print(f"offline at the same bound (tier scenario): k {sim.hit:.3f}, best of (a)-(b) {best:.3f}")
    print(f"{'run':<9} {'hit':>6} {'/best':>6} {'stored':>7} {'dropped':>7} {'load miss':>9} {'wrong':>5} "
          f"{'on disk':>7} {'store MB/s':>10} {'load MB/s':>9} {'CPU s':>6} {'max usage MiB':>13} {'limit MiB':>9}")
    for g in rows:
        hit = g["usable"] / g["requested"] if g["requested"] else 0.0
        lim = (max_bytes + a.procs * batch) / 2**20 if g["label"] == "bound" else float("nan")
        rel = f"{hit / best:6.3f}" if best and g["label"] == "bound" else f"{'-':>6}"
        print(f"{g['label']:<9} {hit:6.3f} {rel} {g['stored']:>7} "
              f"{g['dropped']:>7} {g['load_miss']:>9} {g['wrong']:>5} {g['files']:>7} "
              f"{g['store_b'] / 2**20 / g['store_s'] if g['store_s'] else 0:10.1f} "
              f"{g['load_b'] / 2**20 / g['load_s'] if g['load_s'] else 0:9.1f} {g['cpu_s']:6.2f} "
              f"{g['max_usage'] / 2**20:13.1f} {lim:9.1f}")
    def merged(label):
        rs = [g for g in rows if g["label"] == label]
        m = {k: sum(g[k] for g in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
        m["max_usage"] = max(g["max_usage"] for g in rs)
        m["max_usage_dirs"] = max(g["max_usage_dirs"] for g in rs)
        m["end_usage"] = max(g["end_usage"] for g in rs)
        m["censuses"] = [c for g in rs for c in g["censuses"]]
        m["label"] = label
        return m

    on, off = merged("bound"), merged("no bound")
    if a.real_repeat > 1:
        print(f"(the lines below add up the {a.real_repeat} runs of each)")
    if on["evicted"]:
        print(f"evictor: {on['evicted']} blocks evicted in {on['passes']} passes, evictor CPU "
              f"{on['evictor_cpu_s']:.2f} s = {on['evictor_cpu_s'] / on['evicted'] * 1e6:.0f} us per evicted block "
              f"({on['evictor_cpu_s'] / (a.real_seconds * a.real_repeat):.1%} of one core over the run)")
    for files, scan_s, cpu_s in on["censuses"][-1:]:
        if files:
            print(f"census: last scan {files} files in {scan_s * 1e3:.1f} ms ({cpu_s * 1e3:.1f} ms CPU): "
                  f"{scan_s / files * 1e6:.1f} s per million files by linear extrapolation")
    print(f"usage: largest sample (regular files, what the census counts) {on['max_usage'] / 2**20:.1f} MiB, "
          f"with directories {on['max_usage_dirs'] / 2**20:.1f} MiB; at the end {on['end_usage'] / 2**20:.1f} MiB")
    def rate(g, op):
        return g[f"{op}_b"] / g[f"{op}_s"] if g[f"{op}_s"] else float("nan")

    print(f"bound on / off: store throughput {rate(on, 'store') / rate(off, 'store'):.3f}, "
          f"load {rate(on, 'load') / rate(off, 'load'):.3f}; "
          f"CPU on - off {on['cpu_s'] - off['cpu_s']:+.2f} s (the evictor and census, all processes); "
          f"usage sampled {on['samples']} times (every 0.1 s), max {on['max_usage'] / 2**20:.1f} MiB vs "
          f"max_bytes + {a.procs} x one batch ({batch / 2**20:.1f} MiB) = "
          f"{(max_bytes + a.procs * batch) / 2**20:.1f} MiB")
    return 0 if all(g["wrong"] == 0 for g in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
