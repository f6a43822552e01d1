import hashlib
import json
import os
import threading

import numpy as np
import pytest

from file_mapper_cases import CASES, GOLDEN, KEYS
from kvtier.file_mapper import FileMapper, fields_digest


# The canonical JSON vLLM 0.33 hashes for this configuration, written out by hand
# (sorted keys, "," and ":" separators, no spaces; "parallel_agnostic": false because
# it is not parallel-agnostic).
CANONICAL = (
    '{"blocks_per_file":1,"dcp_size":1,"dtype":"bfloat16",'
    '"inference_engine":"vllm","kv_cache_groups":[{"layer_names":["l0","l1"],"tokens_per_block":16}],'
    '"model_name":"meta-llama/Llama-3.1-8B","parallel_agnostic":false,"pcp_size":1,"pp_size":1,'
    '"tokens_per_hash":16,"tp_size":2}'
)


def make(root, **kw):
    args = dict(model_name="meta-llama/Llama-3.1-8B", tokens_per_hash=16, tp_size=2, rank=1,
                dtype="bfloat16", kv_cache_groups=[{"tokens_per_block": 16, "layer_names": ["l0", "l1"]}])
    args.update(kw)
    return FileMapper(root, **args)


def test_digest_and_path_layout(tmp_path):
    fm = make(str(tmp_path))
    digest = hashlib.sha256(CANONICAL.encode()).hexdigest()[:12]
    assert fm.digest == digest
    assert fields_digest(fm.fields) == digest
    h = bytes.fromhex("abcdef0123456789")
    expected = f"{tmp_path}/meta-llama_Llama-3.1-8B_{digest}_r1/abc/de_g3/abcdef0123456789.bin"
    assert fm.get_file_name((h, 3)) == expected
    assert fm.base_path == f"{tmp_path}/meta-llama_Llama-3.1-8B_{digest}"
    assert fm.config_path == f"{tmp_path}/meta-llama_Llama-3.1-8B_{digest}/config.json"


def test_each_hashed_field_changes_digest(tmp_path):
    base = make(str(tmp_path)).digest
    variants = [
        dict(model_name="Qwen/Qwen3-8B"), dict(tokens_per_hash=32), dict(blocks_per_file=2),
        dict(tp_size=4), dict(pp_size=2), dict(pcp_size=2), dict(dcp_size=2), dict(dtype="float16"),
        dict(kv_cache_groups=[]), dict(inference_engine="other"), dict(replicated_layout=True),
        dict(canonical_format="v1-nhd"),
    ]
    digests = {make(str(tmp_path), **v).digest for v in variants}
    assert base not in digests and len(digests) == len(variants)
    # the rank is not hashed: it is the _r<rank> suffix
    assert make(str(tmp_path), rank=0).digest == base
    assert make(str(tmp_path), rank=0).rank_path.endswith(f"_{base}_r0")


def test_parallel_agnostic_collapses_layout(tmp_path):
    a = make(str(tmp_path), parallel_agnostic=True)
    b = make(str(tmp_path), tp_size=8, rank=5, parallel_agnostic=True)
    assert a.digest == b.digest and a.rank == b.rank == 0
    assert a.fields["tp_size"] == 1
    assert "parallel_agnostic" not in a.fields  # vLLM adds only the False value
    assert make(str(tmp_path)).fields["parallel_agnostic"] is False


def test_dtype_names(tmp_path):
    assert make(str(tmp_path), dtype=np.float16).fields["dtype"] == "float16"
    assert make(str(tmp_path), dtype=np.dtype("float32")).fields["dtype"] == "float32"
    assert make(str(tmp_path), dtype="torch.bfloat16").fields["dtype"] == "bfloat16"


def test_write_run_config_atomic_and_only_if_absent(tmp_path):
    fm = make(str(tmp_path))
    assert fm.write_run_config() is True
    with open(fm.config_path) as f:
        assert json.load(f) == fm.fields
    # an existing config.json is never overwritten
    with open(fm.config_path, "w") as f:
        f.write('{"keep": 1}')
    assert fm.write_run_config() is False
    with open(fm.config_path) as f:
        assert json.load(f) == {"keep": 1}
    assert sorted(os.listdir(fm.base_path)) == ["config.json"]  # no temp left


def test_concurrent_config_writers_one_winner(tmp_path):
    fm = make(str(tmp_path))
    results = []
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        results.append(make(str(tmp_path)).write_run_config())

    ts = [threading.Thread(target=go) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert results.count(True) == 1
    with open(fm.config_path) as f:
        assert json.load(f) == fm.fields
    assert sorted(os.listdir(fm.base_path)) == ["config.json"]


def test_block_info_mismatch(tmp_path):
    fm = make(str(tmp_path))
    assert fm.write_block_info(4096) is True
    assert fm.write_block_info(4096) is False
    assert fm.read_block_info() == {"block_bytes": 4096}
    with pytest.raises(ValueError, match="block_bytes=4096"):
        fm.write_block_info(8192)


@pytest.mark.parametrize("content", [b"", b"garbage", b"\xff\xfe{"])
def test_block_info_not_json_names_the_file(tmp_path, content):
    fm = make(str(tmp_path))
    os.makedirs(fm.base_path)
    path = os.path.join(fm.base_path, "kvtier.json")
    with open(path, "wb") as f:
        f.write(content)
    for call in (fm.read_block_info, lambda: fm.write_block_info(4096)):
        with pytest.raises(ValueError, match="kvtier.json is not valid JSON") as ei:
            call()
        assert path in str(ei.value)
    with open(path, "rb") as f:
        assert f.read() == content  # left as it was: the operator decides


@pytest.mark.parametrize("kw,exc", [
    (dict(model_name=3), TypeError),
    (dict(model_name=""), ValueError),
    (dict(tokens_per_hash=0), ValueError),
    (dict(tokens_per_hash=16.0), TypeError),
    (dict(replicated_layout=1), TypeError),
    (dict(canonical_format=""), TypeError),
    (dict(tp_size=True), TypeError),
    (dict(rank=-1), ValueError),
    (dict(rank=2), ValueError),  # world size is 2
    (dict(dcp_size=3, tp_size=4), ValueError),
    (dict(dtype=3), TypeError),
    (dict(kv_cache_groups="x"), TypeError),
    (dict(kv_cache_groups=[{"tokens_per_block": 16}]), ValueError),
    (dict(kv_cache_groups=[{"block_size": 16, "layer_names": ["l0"]}]), ValueError),  # pre-0.33 name
    (dict(kv_cache_groups=[{"tokens_per_block": 16, "layer_names": "l0"}]), TypeError),
])
def test_bad_fields(tmp_path, kw, exc):
    with pytest.raises(exc):
        make(str(tmp_path), **kw)


def test_bad_root_and_keys(tmp_path):
    with pytest.raises(TypeError):
        make(123)
    with pytest.raises(ValueError):
        make("")
    fm = make(str(tmp_path))
    for bad, exc in [(b"\x01", TypeError), ((b"\x01",), TypeError), (("ab", 0), TypeError),
                     ((b"", 0), ValueError), ((b"\x01", -1), ValueError), ((b"\x01", 1.0), TypeError)]:
        with pytest.raises(exc):
            fm.get_file_name(bad)


def test_config_files_are_readable_like_the_blocks(tmp_path):
    """config.json is published 0644 (minus umask), not mkstemp's 0600: other ranks and
    users sharing the cache read it."""
    import stat as st

    old = os.umask(0o022)
    try:
        fm = FileMapper(str(tmp_path), "m")
        fm.write_run_config()
    finally:
        os.umask(old)
    cfgs = list(tmp_path.rglob("config.json"))
    assert len(cfgs) == 1 and st.S_IMODE(cfgs[0].stat().st_mode) == 0o644


def _golden():
    with open(GOLDEN) as f:
        return json.load(f)


@pytest.mark.parametrize("case", sorted(CASES))
def test_paths_and_config_equal_vllm_golden(case, tmp_path):
    """Paths and config.json bytes equal what vLLM 0.33.0's FileMapper produced for the same
    inputs (tests/data/file_mapper_golden.json; the live comparison is in test_vllm.py)."""
    want = _golden()["cases"][case]
    root, kw = CASES[case]
    fm = FileMapper(root, **kw)
    assert fm.base_path == want["base_path"]
    assert fm.config_path == want["config_path"]
    assert [fm.get_file_name((bytes.fromhex(h), g)) for h, g in KEYS] == want["paths"]
    # config.json written to disk: the same bytes vLLM's fs tier writes
    local = FileMapper(str(tmp_path) + ("/" if root.endswith("/") else ""), **kw)
    assert local.write_run_config()
    with open(local.config_path, "rb") as f:
        assert f.read() == want["config_json"].encode()


def test_golden_is_from_vllm_0_33():
    g = _golden()
    assert g["vllm_version"] == "0.33.0" and set(g["cases"]) == set(CASES)
    # the trailing "/" case keeps vLLM's "//"
    assert "/mnt/kv//meta-llama_Llama-3.1-8B_" in g["cases"]["trailing_slash"]["paths"][0]
