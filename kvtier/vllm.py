"""kvtier as a vLLM (0.33+) secondary tier: ``KvtierTier``, a drop-in for vLLM's ``"fs"`` tier
whose loads are verified (CRC32C in xattr ``user.vllm.kv_crc32c``).

Use (``vllm serve ... --kv-transfer-config``; README "Use with vLLM")::

    "secondary_tiers": [{"type": "kvtier", "root_dir": "/mnt/nvme/kv"}]

(the short name is registered by kvtier's ``vllm.general_plugins`` entry point,
:func:`register`), or without the plugin::

    "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.vllm", "root_dir": ...}]

Keys: every key of ``"fs"`` (``root_dir``, ``n_read_threads=16``, ``n_write_threads=16``,
``enable_kv_events=False``, ``locality=None``; ``backpressure`` is taken by vLLM's factory)
and kvtier's own (``checksum_blocks=True``, ``durable=False``, ``use_o_direct=True``,
``sweep_stale_temps_after=None``, ``io_timeout_s`` (the engine's job deadline, default
:data:`kvtier._tier.deadline.DEFAULT_IO_TIMEOUT_S`), ``lookup_timeout_s`` (the lookup deadline,
default :data:`kvtier._tier.deadline.DEFAULT_LOOKUP_TIMEOUT_S`), and the capacity keys ``max_bytes=None``
(a bound of the whole root: bytes, ``"500G"``, ``"90%"``), ``evict_high=0.95``, ``evict_low=0.85``,
``census_interval_s=10``, ``touch_window_s=60``, ``takeover_s=30`` (docs/capacity.md); meanings as
:class:`kvtier.manager.FileSystemTierManager`).  With a bound and ``enable_kv_events``, the blocks
of this tier's rank directory that this process evicts (it holds the root's evictor lock) are
``OffloadingEvent(removed=True)``.
An unknown key is a TypeError listing the valid ones.

Files: the paths and ``config.json`` are vLLM's own (``FileMapper.from_offloading_spec(...,
parallel_agnostic=True)``, as the fs tier), so ``"fs"`` and ``"kvtier"`` on one root share
one cache.  A block stored by ``"fs"`` has no checksum: kvtier loads it unverified.

The jobs run on kvtier's tier engine (:mod:`kvtier._tier.engine`), each one C call with the GIL
released; lookups run on vLLM's ``AsyncLookupManager`` thread through kvtier's C
``batch_lookup``.  A failed load keeps the blocks before the failing one
(``JobResult.successful_keys``) and marks the rest a miss, so the next lookup of a
condemned block is a MISS and the block is recomputed and stored again.

Metrics (in vLLM's stats path, label ``tier`` as vLLM's, e.g. ``"1:kvtier"``): every
counter of the tier engine that vLLM does not derive itself (:func:`metrics`), e.g. with
checksums on ``vllm:kv_offload_tiering_checksum_failures`` (loads stopped by a block that
failed verification), ``kvtier:kv_offload_tiering_checksum_retries`` (blocks re-read once
after a first mismatch), ``kvtier:kv_offload_tiering_checksum_condemned`` (blocks removed
after a second mismatch).  vLLM derives read/write bytes, time and job failures from the
JobResults; this tier does not emit them again.

Importing this module imports vLLM's tiering base classes only (no torch, no FileMapper
until a tier is built); ``import kvtier`` never imports vLLM.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Union

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

try:
    from vllm.v1.kv_offload.tiering.base import TIER_LABEL
except ImportError:  # vLLM 0.32 names the label "tier" in place (0.33 added the constant)
    TIER_LABEL = "tier"

from kvtier._tier import capacity as _capacity
from kvtier._tier.engine import TierEngine

logger = logging.getLogger(__name__)

SHORT_NAME = "kvtier"
"""The tier type registered by :func:`register` (``{"type": "kvtier", ...}``)."""

#: Keys of vLLM 0.33's ``"fs"`` tier, with its defaults (``root_dir`` is required).
FS_KEYS: Dict[str, Any] = {"root_dir": None, "n_read_threads": 16, "n_write_threads": 16,
                           "enable_kv_events": False, "locality": None}
#: kvtier's own keys, with their defaults.
KVTIER_KEYS: Dict[str, Any] = {"checksum_blocks": True, "durable": False, "use_o_direct": True,
                               "sweep_stale_temps_after": None, "io_timeout_s": None,
                               "lookup_timeout_s": None, "load_landing": "auto", "load_split_blocks": 512,
                               # a bounded root (docs/capacity.md): max_bytes, evict_high, evict_low,
                               # census_interval_s, touch_window_s, takeover_s
                               **_capacity.CONFIG_KEYS}

#: Engine counters (:data:`kvtier._tier.counters.COUNTERS`) that vLLM derives itself from the
#: JobResults (read/write bytes and time, job failures): never emitted again by this tier.
VLLM_DERIVED = frozenset({"store_jobs", "load_jobs", "store_failures", "load_failures", "bytes_written",
                          "bytes_read", "write_time", "read_time"})
#: Counters that exist only for a bounded root (max_bytes).
CAPACITY_ONLY = frozenset(k for k in _capacity.COUNTER_DOCS if not k.startswith("evicted_"))
#: Counters that exist only with checksums on.
CHECKSUM_ONLY = frozenset({"checksum_failures", "checksum_retries", "blocks_condemned"})
_METRIC_NAMES = {
    "checksum_failures": "vllm:kv_offload_tiering_checksum_failures",  # vLLM PR #57912's name
    "checksum_retries": "kvtier:kv_offload_tiering_checksum_retries",
    "blocks_condemned": "kvtier:kv_offload_tiering_checksum_condemned",
}


def is_gauge(doc: str) -> bool:
    """An engine "counter" documented as ``"gauge: ..."`` is a level, not a total."""
    return doc.lower().startswith("gauge:")


def metrics(checksum_blocks: bool, capacity: bool = False) -> Dict[str, tuple]:
    """kvtier's metrics in vLLM's stats path: ``{metric name: (counters, help, labels)}``,
    ``counters`` = ``{label values: engine counter}`` for the extra ``labels`` (label names
    after ``tier``).  Every engine counter vLLM does not derive itself: those of a labelled
    family (:data:`kvtier.metrics.FAMILIES`: the timeouts by ``op``, the error policy's by
    ``cause`` / ``errno`` / ``outcome``) under the family's name and label, as the standalone
    tracker exports them; the others as ``kvtier:kv_offload_tiering_<counter>`` with no extra
    label (the three checksum counters keep their established names and exist only with
    checksums on; capacity's ``stores_dropped`` and ``capacity_*`` gauges only with ``capacity``,
    a bounded root).  Those whose help starts with ``gauge:`` are gauges (:func:`is_gauge`)."""
    from kvtier._tier.counters import COUNTERS
    from kvtier.metrics import CAPACITY_FAMILIES, FAMILIES

    out: Dict[str, tuple] = {}
    in_family = set()
    for name, (doc, label, keys) in FAMILIES.items():
        in_family.update(keys.values())
        if name in CAPACITY_FAMILIES and not capacity:
            continue
        out[name] = ({(value,): counter for value, counter in keys.items()}, doc, (label,))
    for counter, doc in COUNTERS.items():
        if counter in VLLM_DERIVED or counter in in_family or (counter in CHECKSUM_ONLY and not checksum_blocks):
            continue
        if counter in CAPACITY_ONLY and not capacity:
            continue
        name = _METRIC_NAMES.get(counter, f"kvtier:kv_offload_tiering_{counter}")
        out[name] = ({(): counter}, doc[:1].upper() + doc[1:] + ".", ())
    return out


#: ``config_info()`` label names (static facts of the tier).
CONFIG_INFO_KEYS = ("kvtier_checksum_blocks", "kvtier_o_direct", "kvtier_durable", "kvtier_crc32c_backend",
                    "kvtier_io_backend")


def register() -> None:
    """``vllm.general_plugins`` entry point: register the short name ``"kvtier"`` with
    vLLM's ``SecondaryTierFactory``.  vLLM may call it more than once per process."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if SHORT_NAME not in SecondaryTierFactory._registry:
        SecondaryTierFactory.register_tier(SHORT_NAME, __name__, "KvtierTier")


def _checksum_on(tier_config: Dict[str, Any]) -> bool:
    return bool(tier_config.get("checksum_blocks", KVTIER_KEYS["checksum_blocks"]))


def request_keys(req_context) -> List[Any]:
    """The offload keys of a request in prefix order: vLLM's scheduler records each key's
    end-token position in the request context (``ReqContext._offload_key_positions``,
    vLLM 0.32 and 0.33, every key of the request whichever tier holds it); [] where it
    records none (another vLLM)."""
    pos = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(pos, dict) or not pos:
        return []
    return sorted(pos, key=pos.__getitem__)


class _Lookup(AsyncLookupManager):
    """vLLM's async lookup state machine; the existence checks are one C call per batch
    (``kvtier.io.batch_lookup``: a stat per path, GIL released) through the engine.

    vLLM runs every ``batch_lookup`` of a tier on one thread, one batch after the other:
    a batch that never returns (vLLM's ``"fs"`` tier on a hung filesystem) leaves its
    keys and every later batch's IN_FLIGHT, so their requests see RETRY for as long as
    the filesystem hangs.  Through the engine a batch returns within
    ``lookup_timeout_s`` (all misses), and while that call stays stuck the next batches
    answer misses at once: requests go on and recompute (docs/tier.md, "Deadlines")."""

    def __init__(self, tier_type: str, path_of, lookup_paths) -> None:
        super().__init__(tier_type=tier_type)
        self._path_of = path_of
        self._lookup_paths = lookup_paths

    def batch_lookup(self, keys, req_context) -> Iterable[bool]:
        return self._lookup_paths([self._path_of(k) for k in keys])


# (id(spec), tier_type, root_dir) -> tiers built so far, to tell equal configs apart
_built: Dict[tuple, int] = {}
_built_lock = threading.Lock()


class KvtierTier(SecondaryTierManager):
    """vLLM secondary tier on kvtier's engine: verified loads, same files as ``"fs"``.

    Built by vLLM's ``SecondaryTierFactory`` (module docstring for the keys).  Raises
    TypeError for an unknown key (listing the valid ones) or a wrong type, ValueError
    for a bad value, and the startup errors of :func:`kvtier.manager.prepare_root`
    (OSError naming the root; ValueError when ``checksum_blocks`` is on and the
    filesystem has no user xattrs).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, **config: Any) -> None:
        valid = {**FS_KEYS, **KVTIER_KEYS}
        unknown = sorted(set(config) - set(valid))
        if unknown:
            raise TypeError(f"unknown key(s) {unknown} for the {tier_type!r} tier (kvtier.vllm.KvtierTier); "
                            f"valid keys: {sorted(valid)}")
        if config.get("root_dir") is None:
            raise TypeError(f"the {tier_type!r} tier needs 'root_dir'; valid keys: {sorted(valid)}")
        cfg = {**valid, **config}
        root_dir = cfg["root_dir"]
        if not isinstance(root_dir, str):
            raise TypeError(f"root_dir must be a non-empty str, got {root_dir!r}")
        if not root_dir:  # abspath("") is the working directory
            raise ValueError(f"root_dir must not be empty: give the {tier_type!r} tier's root directory (\"\" would be "
                             f"the working directory)")
        from kvtier._tier.config import TierConfig, check_bool

        tc = TierConfig(**{k: cfg[k] for k in TierConfig.__dataclass_fields__})  # the keys both shells take
        check_bool("enable_kv_events", cfg["enable_kv_events"])
        from kvtier._tier import landing as _landing

        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(cfg["locality"]) if cfg["locality"] is not None else None
        self.checksum_blocks: Union[bool, str] = cfg["checksum_blocks"]
        self.durable: bool = cfg["durable"]

        self.events: Optional[List[OffloadingEvent]] = None
        self._events_lock = threading.Lock()  # the capacity thread appends removed events
        if cfg["enable_kv_events"]:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logger.warning("enable_kv_events is set on secondary tier '%s' but KV cache events are "
                               "disabled globally; the tier will not emit events.", tier_type)

        view = primary_kv_view
        if not view.c_contiguous:
            raise ValueError("the primary KV view must be C-contiguous")
        flat = view if (view.ndim == 1 and view.format == "B") else view.cast("B")
        bs = self.block_size_bytes
        if tc.capacity is not None:  # a bound below one block, before any I/O (a percentage: at attach)
            _capacity.check_holds_a_block(tc.capacity, bs, root_dir)

        # Paths: vLLM's own FileMapper, as the fs tier builds it (imported here: the
        # module import stays cheap for the API server, which only needs the metrics).
        from vllm.v1.kv_offload.file_mapper import FileMapper

        from kvtier._tier.startup import GeometryGuard, RootGuard, info_signature, start, write_block_info
        from kvtier.file_mapper import BLOCK_INFO_FILENAME, read_block_info, write_json_if_absent

        label_root, root_dir = root_dir, os.path.abspath(root_dir)  # resolved once: a later chdir moves nothing
        self.file_mapper = FileMapper.from_offloading_spec(
            root_dir=root_dir, offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True)
        self.root_dir = root_dir
        rank_path = f"{self.file_mapper.base_path}_r{self.file_mapper.rank}"

        info_dir = os.path.dirname(self.file_mapper.get_config_file_path())
        info_path = os.path.join(info_dir, BLOCK_INFO_FILENAME)
        info_checked: list = [()]  # its signature once written or checked (GeometryGuard)

        def write_files() -> None:  # config.json and kvtier.json, each only if absent
            config_path = self.file_mapper.get_config_file_path()
            os.makedirs(os.path.dirname(config_path), exist_ok=True)
            write_json_if_absent(config_path, self.file_mapper.get_run_config())  # bytes as vLLM's
            write_block_info(info_path, bs,  # kvtier.json, for `kvtier scrub`; ValueError
                             lambda: write_json_if_absent(info_path, {"block_bytes": bs}),
                             lambda: read_block_info(info_dir))

        def write_config() -> None:
            write_files()
            info_checked[0] = info_signature(info_path)
            landed[:] = _landing.resolve(tc.load_landing, root_dir)  # mountinfo: under the deadline too

        landed: List[str] = []  # (load landing, why): kvtier/_tier/landing.py

        started = start(root_dir, rank_path, tc, write_config)  # under the deadline: a silent root is named
        self.last_sweep = started.last_sweep
        self.use_o_direct = started.use_o_direct
        self.load_landing, self.load_landing_why = landed
        if started.o_direct_refused_on is not None:
            logger.warning("O_DIRECT is not supported at %r (%s); using buffered I/O for the '%s' KV "
                           "offload tier.", root_dir, started.o_direct_refused_on, tier_type)
        self.tier_label = self._find_tier_label(offloading_spec, tier_type, label_root)  # as the config spells it

        self._flat = flat
        from kvtier._tier.counters import Counters

        counters = Counters()
        self.capacity = None  # a bounded root (docs/capacity.md): evicted blocks of this rank -> removed events
        if tc.capacity is not None:
            self.capacity = _capacity.attach(root_dir, tc.capacity, counters, self._on_evicted, block_size=bs)
            counters.capacity_gauges = self.capacity.gauges
        geometry = GeometryGuard(info_path, bs, lambda: read_block_info(info_dir),
                                 write_files,  # both: a tree recreated under the same inodes
                                 counters, self.tier_label, info_checked[0])
        root_guard = RootGuard(root_dir, rank_path, started.root_id, write_config, counters, self.tier_label,
                               geometry)
        self._engine = TierEngine(flat, bs, self.file_mapper.get_file_name, use_o_direct=self.use_o_direct,
                                  counters=counters, thread_name="kvtier_vllm", root=root_dir,
                                  before_job=root_guard.check, landing=self.load_landing,
                                  capacity=self.capacity, **tc.engine_args())
        self._reported: Dict[str, float] = {}  # counters at the last get_stats()
        self._metrics = metrics(self.checksum_blocks, self.capacity is not None)
        self._discarded: List[JobResult] = []
        self._lookup = _Lookup(tier_type, self.file_mapper.get_file_name, self._engine.lookup)
        logger.info("kvtier tier %s at %s: checksum_blocks=%s, O_DIRECT=%s, durable=%s",
                    self.tier_label, self.file_mapper.base_path, self.checksum_blocks,
                    self.use_o_direct, self.durable)

    def _on_evicted(self, paths: List[str]) -> None:
        """The capacity thread evicted ``paths`` (this process is the root's evictor): those
        of this tier's rank directory become vLLM removed events (with enable_kv_events)."""
        if self.events is None:
            return
        from vllm.v1.kv_offload.base import make_offload_key

        prefix = f"{self.file_mapper.base_path}_r{self.file_mapper.rank}{os.sep}"
        real = os.path.realpath(prefix) + os.sep
        keys = [make_offload_key(*_capacity.key_of_path(p)) for p in paths
                if p.startswith(prefix) or p.startswith(real)]
        if keys:
            with self._events_lock:
                self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=True,
                                                   locality=self.locality))

    # ------------------------------------------------------------------ metrics
    @staticmethod
    def _find_tier_label(spec, tier_type: str, root_dir: str) -> str:
        """vLLM's label ``f"{index + 1}:{tier_type}"``; vLLM does not tell a tier its
        index, so it is this tier's position among the spec's tier configs (the n-th
        tier built with the same type and root on this spec is the n-th such entry)."""
        configs = getattr(spec, "secondary_tier_configs", None)
        if configs is None:
            configs = (getattr(spec, "extra_config", None) or {}).get("secondary_tiers", [])
        same = [i for i, c in enumerate(configs or [])
                if isinstance(c, dict) and c.get("type") == tier_type and c.get("root_dir") == root_dir]
        with _built_lock:
            key = (id(spec), tier_type, root_dir)
            nth = _built.get(key, 0)
            _built[key] = nth + 1
        if not same:
            logger.warning("tier %r at %r is not among the spec's secondary_tiers; labelling it 1:%s",
                           tier_type, root_dir, tier_type)
            return f"1:{tier_type}"
        return f"{same[min(nth, len(same) - 1)] + 1}:{tier_type}"

    @classmethod
    def build_metric_definitions(cls, tier_config: Dict[str, Any]) -> Dict[str, Any]:
        """kvtier's counters (:func:`metrics`), the checksum ones only with checksums on."""
        from vllm.v1.kv_offload.base import OffloadingGaugeMetadata

        from kvtier.metrics import IO_ERRORS, IO_ERRORS_DOC

        defs = {name: (OffloadingGaugeMetadata if is_gauge(doc) else OffloadingCounterMetadata)(
                    documentation=doc, labelnames=(TIER_LABEL, *labels))
                for name, (_, doc, labels) in metrics(_checksum_on(tier_config),
                                                      tier_config.get("max_bytes") is not None).items()}
        defs[IO_ERRORS] = OffloadingCounterMetadata(documentation=IO_ERRORS_DOC,
                                                    labelnames=(TIER_LABEL, "operation", "errno"))
        return defs

    def counters(self) -> Dict[str, float]:
        """The engine's counters (:data:`kvtier._tier.counters.COUNTERS`), a snapshot."""
        return self._engine.counters.snapshot()

    def get_stats(self):
        """The increase of kvtier's counters (:func:`metrics`) since the last call, as
        ``OffloadingConnectorStats`` (None when nothing changed)."""
        from kvtier._tier.counters import IO_ERROR_PREFIX
        from kvtier.metrics import IO_ERRORS

        snap = self._engine.counters.snapshot()
        stats = None
        io_errors = {tuple(k[len(IO_ERROR_PREFIX):].split(":", 1)): k for k in snap if k.startswith(IO_ERROR_PREFIX)}
        for name, (counters, doc, _) in [*self._metrics.items(), (IO_ERRORS, (io_errors, "", ()))]:
            gauge = is_gauge(doc)
            for values, counter in counters.items():
                delta = snap[counter] - self._reported.get(counter, 0)
                if not delta:
                    continue
                if stats is None:
                    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
                        OffloadingConnectorStats,
                    )

                    stats = OffloadingConnectorStats()
                if gauge:
                    stats.set_gauge(name, snap[counter], (self.tier_label, *values))
                else:
                    stats.increase_counter(name, delta, (self.tier_label, *values))
        self._reported = snap
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: Dict[str, Any]) -> tuple:
        return CONFIG_INFO_KEYS

    def config_info(self) -> Dict[str, Any]:
        import kvtier
        from kvtier import io as kio

        return {"kvtier_checksum_blocks": self.checksum_blocks, "kvtier_o_direct": self.use_o_direct,
                "kvtier_durable": self.durable, "kvtier_crc32c_backend": kvtier.crc32c_backend,
                "kvtier_io_backend": kio.backend}

    # ------------------------------------------------------------------ lookups
    def on_new_request(self, req_context) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key, req_context) -> LookupResult:
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_request_finished(self, req_context) -> None:
        self._lookup.cleanup(req_context.req_id)
        if self.capacity is not None:
            # a bounded root: every block of the request is refreshed on disk (rate-limited,
            # on the capacity thread), the prefix the CPU tier served too: vLLM asks this
            # tier only about the CPU tier's misses, so the disk copies of the blocks it keeps
            # serving would age as if unused (docs/capacity.md "Recency")
            self.capacity.touch_keys_later(self.file_mapper.get_file_name, lambda: request_keys(req_context))

    def on_schedule_end(self, context) -> None:
        self._lookup.flush()

    # ------------------------------------------------------------------ jobs
    def _offsets(self, job) -> list:
        bs = self.block_size_bytes
        return [int(c) * bs for c in job.chunk_ids]

    def submit_store(self, job_metadata) -> None:
        """Queue the store.  vLLM's manager passes a key offered twice in one
        ``complete_store`` on as it is (the same key and row twice; vLLM's fs tier writes the
        file twice): such an exact repeat is stored once.  One key from two different rows
        is a ValueError (:func:`kvtier._tier.engine.check_no_duplicates`), as in the standalone tier."""
        keys, offsets = list(job_metadata.keys), self._offsets(job_metadata)
        if len(set(keys)) != len(keys):
            pairs = dict.fromkeys(zip(keys, offsets))  # first occurrences, in order
            keys, offsets = [k for k, _ in pairs], [o for _, o in pairs]
        self._engine.submit(job_metadata.job_id, keys, offsets, False)

    def submit_load(self, job_metadata) -> None:
        self._engine.submit(job_metadata.job_id, job_metadata.keys, self._offsets(job_metadata), True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """One JobResult per job; a failed load keeps its first ``n_ok`` keys and marks
        the rest a miss (the stale HIT would re-promote them forever)."""
        bs = self.block_size_bytes
        results, self._discarded = self._discarded, []
        for f in self._engine.take_finished():
            if f.success:
                if self.events is not None and not f.is_promotion and f.keys:
                    with self._events_lock:
                        self.events.append(OffloadingEvent(keys=list(f.keys), medium=self.medium,
                                                           removed=False, locality=self.locality))
                results.append(JobResult(job_id=f.job_id, success=True, transfer_time=f.io_time,
                                         transfer_bytes=len(f.keys) * bs))
                continue
            if f.is_promotion:
                self._lookup.mark_miss(f.keys[f.n_ok:])
                kept = f.keys[:f.n_ok]
                results.append(JobResult(job_id=f.job_id, success=False,
                                         successful_keys=tuple(kept) if kept else None,
                                         transfer_time=f.io_time, transfer_bytes=len(kept) * bs))
            else:
                results.append(JobResult(job_id=f.job_id, success=False, transfer_time=f.io_time,
                                         transfer_bytes=0))
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            with self._events_lock:
                out, self.events = self.events, []
            return out
        return ()

    def drain_jobs(self) -> None:
        """Block until every submitted job has run; their results are then queued for
        :meth:`get_finished_jobs` and no tier I/O touches the primary view."""
        self._engine.drain()

    def shutdown(self) -> None:
        """Stop and free the tier, as the standalone tier's ``shutdown()`` does
        (:meth:`kvtier._tier.engine.TierEngine.shutdown`): the lookup thread stops (its batch
        returns within ``lookup_timeout_s``); queued jobs never run (each reported once
        as failed, should anyone still poll); running ones finish or are reported failed
        at their deadline (``io_timeout_s``: it never waits longer); the threads not
        stuck are joined.  The tier and its engine then drop their references to the
        primary view, so vLLM can unmap it.  A thread stuck in the filesystem keeps its
        own until its call returns (the buffer is not released under it): vLLM then keeps
        the mapping (it warns) but still removes its /dev/shm file.  Never raises for a
        stuck thread, so vLLM goes on to shut its primary tier down.  Idempotent."""
        self._lookup.shutdown()
        for job_id in self._engine.shutdown(wait=True):
            self._discarded.append(JobResult(job_id=job_id, success=False, transfer_bytes=0))
        if self.capacity is not None:
            self.capacity.close()
        self._flat = self._primary_kv_view = None  # a running job holds its own (Job.view)

    def __repr__(self) -> str:
        return (f"KvtierTier({self.tier_label}, root={self.root_dir!r}, checksum_blocks={self.checksum_blocks}, "
                f"o_direct={self.use_o_direct})")
