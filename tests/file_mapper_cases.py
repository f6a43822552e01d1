"""FileMapper inputs shared by the golden-path test (no vLLM) and the live comparison
with vLLM's FileMapper (tests/test_vllm.py); tests/data/file_mapper_golden.json holds what
vLLM 0.33.0 produced for them (regenerate: ``python tests/file_mapper_cases.py``)."""
import json
import os

LLAMA_GROUPS = [{"tokens_per_block": 16,
                 "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(32)]}]
TWO_GROUPS = [{"tokens_per_block": 16, "layer_names": ["model.layers.0.attn", "model.layers.2.attn"]},
              {"tokens_per_block": 32, "layer_names": ["model.layers.1.attn", "model.layers.3.attn"]}]

BASE = dict(model_name="meta-llama/Llama-3.1-8B", tokens_per_hash=16, blocks_per_file=1, tp_size=1,
            pp_size=1, pcp_size=1, dcp_size=1, rank=0, dtype="bfloat16", kv_cache_groups=LLAMA_GROUPS)

#: name -> (root_dir, FileMapper keyword arguments, vLLM 0.33 names)
CASES = {
    "llama8b_1gpu_agnostic": ("/mnt/kv", dict(BASE, parallel_agnostic=True)),
    "llama8b_1gpu_not_agnostic": ("/mnt/kv", dict(BASE)),
    "trailing_slash": ("/mnt/kv/", dict(BASE, parallel_agnostic=True)),
    "tp2_rank1": ("/mnt/kv", dict(BASE, tp_size=2, rank=1)),
    "tp2_rank1_agnostic": ("/mnt/kv", dict(BASE, tp_size=2, rank=1, parallel_agnostic=True)),
    "pp2_pcp2_dcp2_rank5": ("/r", dict(BASE, tp_size=2, pp_size=2, pcp_size=2, dcp_size=2, rank=5)),
    "two_groups_blocks_per_file_4": ("/r", dict(BASE, kv_cache_groups=TWO_GROUPS, blocks_per_file=4,
                                                tokens_per_hash=32)),
    "replicated_layout": ("/r", dict(BASE, tp_size=4, rank=3, parallel_agnostic=True, replicated_layout=True)),
    "canonical_layout": ("/r", dict(BASE, parallel_agnostic=True, canonical_format="v1-nhd")),
    "canonical_replicated_fp8": ("/r", dict(BASE, dtype="fp8_e4m3", parallel_agnostic=True,
                                            replicated_layout=True, canonical_format="v1-hnd")),
    "no_groups_qwen": ("relative/dir", dict(BASE, model_name="Qwen/Qwen3-8B", kv_cache_groups=None)),
}

#: keys (block hash hex, group index) whose paths are recorded
KEYS = [("00112233445566778899aabbccddeeff", 0), ("abcdef0123456789", 3)]

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "file_mapper_golden.json")


def vllm_outputs():
    """{case: {"base_path", "config_path", "config_json", "paths": [...]}} from vLLM's FileMapper."""
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.file_mapper import FileMapper

    out = {}
    for name, (root, kw) in CASES.items():
        fm = FileMapper(root, **kw)
        out[name] = {
            "base_path": fm.base_path,
            "config_path": fm.get_config_file_path(),
            "config_json": json.dumps(fm.get_run_config(), indent=2, sort_keys=True),
            "paths": [fm.get_file_name(make_offload_key(bytes.fromhex(h), g)) for h, g in KEYS],
        }
    return out


if __name__ == "__main__":
    import vllm

    data = {"vllm_version": vllm.__version__, "cases": vllm_outputs()}
    with open(GOLDEN, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {GOLDEN} from vLLM {vllm.__version__}")
