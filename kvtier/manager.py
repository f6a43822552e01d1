"""FileSystemTierManager: the filesystem ("secondary") tier under a CPU KV buffer.

Standalone (no vLLM import), shaped like vLLM's ``FileSystemTierManager``: an offload
connector submits store ("cascade") jobs that copy blocks of the primary buffer into
files, and load ("promotion") jobs that copy files back into the buffer, then polls
:meth:`FileSystemTierManager.get_finished_jobs`.

The pool, jobs, results and counters are the tier engine's (:mod:`kvtier._tier.engine`), the
same engine under kvtier's vLLM tier (:mod:`kvtier.vllm`); this module adds the standalone
API: tuple keys and :class:`FileMapper` paths, :class:`TransferJob` / :class:`JobResult`,
the startup checks, and a Prometheus tracker (:mod:`kvtier.metrics`) over the engine's
counters.  Each job is one call into the C core (``kvtier.io.batch_store_block`` /
``batch_load_block``), which runs the whole batch without the GIL.

Partial keep: a load that fails at block ``n`` (``OSError.num_succeeded == n``) reports
its first ``n`` keys in ``JobResult.successful_keys``; block ``n`` and the rest are misses.
Files are removed only when provably bad (docs/design.md, "Error policy": a CRC or
identity mismatch on two reads, a wrong size or short read on two opens with no intact
record of its own); a transient error (ENOENT, EACCES, ELOOP, EIO from the device, EBADMSG
from the filesystem...) keeps the file.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Hashable, List, Mapping, Optional, Sequence, Tuple

from kvtier._blockio.buffers import is_torch_tensor as _is_torch_tensor, torch_bytes_view
from kvtier._tier import capacity as _capacity
from kvtier._tier.config import TierConfig
from kvtier._tier.engine import TierEngine
from kvtier._tier.startup import GeometryGuard, RootGuard, filesystem_type, info_signature, start, write_block_info
from kvtier.file_mapper import FileMapper, Key, check_root_dir
from kvtier.metrics import TieringMetricsTracker, tier_label

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferJob:
    """One batch of blocks to move between the primary buffer and files.

    ``keys[i]`` (``(block_hash: bytes, group_idx: int)``) goes to / comes from block
    ``chunk_ids[i]`` of the primary buffer (byte offset ``chunk_ids[i] * block_size``).
    ``is_promotion``: True for a load into the buffer, False for a store; None lets
    :meth:`FileSystemTierManager.submit_load` / ``submit_store`` decide.
    """

    job_id: Hashable
    keys: Sequence[Key]
    chunk_ids: Sequence[int]
    is_promotion: Optional[bool] = None


@dataclass(frozen=True)
class JobResult:
    """Outcome of one job.

    ``successful_keys``: keys transferred (all on success; on a failed load the first
    ``num_succeeded`` keys, partial keep; on a failed store the blocks stored before the
    failure).  ``transfer_time``: seconds from submission to completion (queueing + I/O;
    the metrics count the I/O time only).  ``transfer_bytes``: ``len(successful_keys) *
    block_size``.  ``checksum_failed``: a block failed CRC32C verification (its file was removed).  ``error``: the OSError (or
    other exception) that failed the job, None on success.  ``checksum_retries``: blocks
    of a load re-read once after a first CRC32C mismatch (transient corruption; the
    condemned block included), from ``kvtier.io.batch_load_block``'s return value or
    ``OSError.num_retried``.
    """

    job_id: Hashable
    success: bool
    successful_keys: Tuple[Key, ...]
    transfer_time: float
    transfer_bytes: int
    checksum_failed: bool = False
    is_promotion: bool = False
    error: Optional[BaseException] = field(default=None, compare=False)
    checksum_retries: int = 0


def _primary_view(primary: Any, block_size: Optional[int]) -> Tuple[memoryview, int, int]:
    """Flat writable-or-not byte view of ``primary``, block size and number of blocks."""
    obj = primary
    if _is_torch_tensor(primary):
        # torch CPU tensors do not export the buffer protocol: their bytes as uint8 numpy
        # (the helper the C core's conversion mirrors), one row per block when >= 2-D
        if getattr(primary, "device", None) is not None and str(primary.device) != "cpu":
            raise ValueError(f"primary buffer must be on the CPU, got device {primary.device}")
        try:
            flat = torch_bytes_view(primary)
        except BufferError:
            raise BufferError("primary buffer must be C-contiguous") from None
        rows = primary.shape[0] if primary.dim() >= 2 else None
        obj = flat.reshape(rows, -1) if rows else flat
    try:
        m = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"primary buffer must support the buffer protocol (bytearray, numpy array, torch CPU "
            f"tensor, mmap...), got {type(primary).__name__}"
        ) from None
    if not m.c_contiguous:
        raise BufferError("primary buffer must be C-contiguous")
    if m.nbytes == 0:
        raise ValueError("primary buffer is empty")
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
    if m.ndim >= 2:
        stride = m.strides[0]
        if block_size is not None and block_size != stride:
            raise ValueError(
                f"block_size {block_size} does not match the primary buffer: one block per row, "
                f"row stride {stride} bytes (shape {m.shape})"
            )
        block_size = stride
    elif block_size is None:
        raise ValueError(
            "a 1-D primary buffer needs block_size (bytes); or pass a 2-D buffer with one block per row"
        )
    if m.nbytes % block_size:
        raise ValueError(f"primary buffer of {m.nbytes} bytes is not a whole number of {block_size}-byte blocks")
    flat = m.cast("B") if (m.ndim != 1 or m.format != "B") else m
    return flat, block_size, m.nbytes // block_size


class FileSystemTierManager:
    """Filesystem tier on ``primary`` (the CPU KV buffer) with files under ``root_dir``.

    Args:
        primary: buffer-protocol object (bytearray, numpy array, torch CPU tensor,
            mmap), C-contiguous; a 2-D buffer holds one block per row (block size = row
            stride in bytes), a 1-D buffer needs ``block_size``.
        root_dir: directory of the cache (created if missing; relative: against the working
            directory, once); ValueError naming it when empty ("" is no directory to resolve).
        model_name ... canonical_format: the FileMapper fields (vLLM 0.33's names) (:class:`FileMapper`).
        block_size: bytes per block (checked against a 2-D buffer's row stride).
        n_read_threads / n_write_threads: read- and write-priority threads, >= 1.
        checksum_blocks: True (the default, as the vLLM tier's), ``"strict"`` or False.
            True / "strict": record CRC32C in
            xattr ``user.vllm.kv_crc32c`` and the identity record ``user.kvtier.id`` (which
            carries the CRC too) on store, verify them on load (one xattr read for a
            block kvtier stored).  A block without a CRC record (stored by vLLM
            with checksums off, or copied without xattrs) loads with True, counted as
            ``unverified`` (a warning at most once a minute), and is a miss with
            "strict" (kept on disk, counted as ``unverified_miss``); ``kvtier scrub
            --adopt`` records checksums for such blocks.
        use_o_direct: use O_DIRECT when the filesystem accepts it (probed at startup;
            a warning and buffered I/O if refused).
        tier_idx / tier_type: metric label ``f"{tier_idx+1}:{tier_type}"`` ("1:kvtier"; inside
            vLLM the tier's label is vLLM's, e.g. "1:kvtier" for a ``"kvtier"`` entry).
        metrics: a :class:`TieringMetricsTracker` to count into (its ``checksums`` must
            match ``checksum_blocks``), or None to make one in ``registry``.
        registry: prometheus_client registry for the tracker made here (default a fresh
            one, see :mod:`kvtier.metrics`).
        sweep_stale_temps_after: seconds, or None (default: off). At startup remove this
            tier's store temps (``<hash>.bin_<hex>.tmp`` under its ``_r<rank>`` directory)
            last modified more than this long ago, left by a killed process; never
            ``.bin`` blocks, recent temps or other files (:mod:`kvtier._tier.sweep`). The
            result is ``self.last_sweep``. TypeError / ValueError (before any I/O) for
            a non-number, a value below 60 s (``kvtier._tier.sweep.MIN_SWEEP_AFTER_S``: a
            shorter one deletes live writers' temps) or an infinite one.
        durable: on store, fdatasync each temp before its rename and fsync its directory
            after, so a stored block survives power loss (default False: a crash can lose
            recently stored blocks, never publish a torn one). Cost: docs/reliability.md.
        io_timeout_s: deadline in seconds of a job (from the start of its I/O) and of the
            startup probes, 0 = none; None (default): 120 s
            (:data:`kvtier._tier.deadline.DEFAULT_IO_TIMEOUT_S`; docs/tier.md, "Deadlines").
        lookup_timeout_s: deadline in seconds of :meth:`lookup`, 0 = none; None (default):
            2 s (:data:`kvtier._tier.deadline.DEFAULT_LOOKUP_TIMEOUT_S`), or ``io_timeout_s`` when
            that is shorter and not 0.
        max_bytes: bound of the whole root (docs/capacity.md): None (off, default), bytes,
            a size ``"500G"`` (K/M/G/T = powers of 1024) or ``"90%"`` of the filesystem.
            A store job that would pass it is dropped (ENOSPC, ``stores_dropped``); the
            root's one evictor removes the oldest blocks from ``evict_high`` down to
            ``evict_low`` (fractions of max_bytes, 0.95 / 0.85), censusing the root every
            ``census_interval_s`` (10 s); loads and lookup hits refresh a block's mtime at
            most once per ``touch_window_s`` (60 s); another process takes the evictor's
            lock over when its heartbeat stays still for ``takeover_s`` (30 s: it is stopped).

    Raises, before any I/O: TypeError / ValueError for bad arguments (wrong types,
    thread counts < 1, block size not matching the buffer, bad FileMapper fields),
    BufferError for a non-contiguous buffer.  Then: OSError naming ``root_dir`` (errno
    EACCES, EROFS, ENOTDIR, ENOSPC...) if it cannot be created or written (ENOSPC while
    writing ``config.json`` / ``kvtier.json``: OSError naming that file); ValueError
    mentioning "extended attributes", the root and its filesystem type when
    ``checksum_blocks`` is on and the filesystem has no user xattrs; ValueError if the
    directory records another block size (``kvtier.json``).
    """

    def __init__(
        self,
        primary: Any,
        root_dir: "str | os.PathLike",
        model_name: str,
        tokens_per_hash: int = 16,
        blocks_per_file: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        pcp_size: int = 1,
        dcp_size: int = 1,
        rank: int = 0,
        dtype: Any = "bfloat16",
        kv_cache_groups: Optional[Sequence[Mapping]] = None,
        inference_engine: str = "vllm",
        parallel_agnostic: bool = False,
        replicated_layout: bool = False,
        canonical_format: Optional[str] = None,
        *,
        block_size: Optional[int] = None,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        checksum_blocks: "bool | str" = True,
        use_o_direct: bool = True,
        tier_idx: int = 0,
        tier_type: str = "kvtier",
        metrics: Optional[TieringMetricsTracker] = None,
        registry: Any = None,
        sweep_stale_temps_after: Optional[float] = None,  # stale-temp sweep (kvtier/_tier/sweep.py)
        durable: bool = False,  # fdatasync temp + fsync dir on store
        io_timeout_s: Optional[float] = None,  # deadline of a job, startup probe (default 120 s)
        lookup_timeout_s: Optional[float] = None,  # deadline of a lookup (default 2 s)
        load_landing: str = "auto",  # where loads land: auto, direct, bounce (kvtier/_tier/landing.py)
        load_split_blocks: int = 512,  # a load of >= twice this many blocks runs as parts on several threads
        max_bytes: Any = None,  # capacity bound of the root (kvtier/_tier/capacity.py, docs/capacity.md)
        evict_high: float = 0.95,  # watermarks, fractions of max_bytes
        evict_low: float = 0.85,
        census_interval_s: float = 10.0,  # seconds between censuses of the root
        touch_window_s: float = 60.0,  # at most one mtime refresh per block per window
        takeover_s: float = 30.0,  # a still evictor heartbeat after which another process takes over
    ) -> None:
        # ---- configuration checks: no I/O until all of them pass ----
        cfg = TierConfig(n_read_threads, n_write_threads, checksum_blocks, use_o_direct, durable,
                         sweep_stale_temps_after, io_timeout_s, lookup_timeout_s, load_landing=load_landing,
                         load_split_blocks=load_split_blocks,
                         max_bytes=max_bytes, evict_high=evict_high, evict_low=evict_low,
                         census_interval_s=census_interval_s, touch_window_s=touch_window_s,
                         takeover_s=takeover_s)
        from kvtier._tier import landing as _landing

        label = tier_label(tier_idx, tier_type)
        if metrics is not None:
            if not isinstance(metrics, TieringMetricsTracker):
                raise TypeError("metrics must be a kvtier.metrics.TieringMetricsTracker")
            if registry is not None:
                raise ValueError("pass either metrics or registry, not both")
            if metrics.checksums != bool(checksum_blocks):
                raise ValueError("metrics.checksums must equal bool(checksum_blocks)")
        self._view, self.block_size, self.num_blocks = _primary_view(primary, block_size)
        self._readonly = self._view.readonly
        self._primary = primary  # keep the exporter alive (dropped by shutdown())
        self.file_mapper = FileMapper(
            os.path.abspath(check_root_dir(root_dir)),  # "" refused; resolved once: a later chdir moves nothing
            model_name, tokens_per_hash, blocks_per_file, tp_size, pp_size,
            pcp_size, dcp_size, rank, dtype, kv_cache_groups, inference_engine, parallel_agnostic,
            replicated_layout, canonical_format,
        )
        self.root_dir = self.file_mapper.root_dir
        if cfg.capacity is not None:  # a bound below one block, before any I/O (a percentage: at attach)
            _capacity.check_holds_a_block(cfg.capacity, self.block_size, self.root_dir)
        self.checksum_blocks = checksum_blocks
        self.durable = durable
        self.n_read_threads = n_read_threads
        self.n_write_threads = n_write_threads

        # ---- metrics first: a refused registration (same tier label twice on one
        # registry) leaves nothing on disk ----
        self._owns_metrics = metrics is None  # closed by shutdown()
        self.metrics = metrics if metrics is not None else TieringMetricsTracker(
            label, checksums=bool(checksum_blocks), registry=registry)

        # ---- startup checks that touch the filesystem, under the deadline ----
        rank_path = self.file_mapper.rank_path

        from kvtier.file_mapper import BLOCK_INFO_FILENAME, write_json_if_absent

        info_path = os.path.join(self.file_mapper.base_path, BLOCK_INFO_FILENAME)
        info_checked: list = [()]  # its signature once written or checked (GeometryGuard)

        def write_files() -> None:  # config.json and kvtier.json, each only if absent
            self.file_mapper.write_run_config()
            write_block_info(info_path, self.block_size,  # ValueError: another block size's, or no record of one
                             lambda: write_json_if_absent(info_path, {"block_bytes": self.block_size}),
                             self.file_mapper.read_block_info)

        def write_config() -> None:
            write_files()
            info_checked[0] = info_signature(info_path)
            self.load_landing, self.load_landing_why = _landing.resolve(load_landing, self.root_dir)  # mountinfo

        try:  # every filesystem touch of the constructor is in start(), under the deadline
            started = start(self.root_dir, rank_path, cfg, write_config)
        except BaseException:
            if metrics is None:
                self.metrics.close()
            raise
        self.last_sweep = started.last_sweep  # kvtier._tier.sweep.SweepResult of the startup sweep, if any
        self.use_o_direct = started.use_o_direct
        self.io_timeout_s = cfg.io_timeout_s
        if started.o_direct_refused_on is not None:
            logger.warning(
                "O_DIRECT is not supported at %r (%s); using buffered I/O for the %s tier",
                self.root_dir, started.o_direct_refused_on, label,
            )
        geometry = GeometryGuard(info_path, self.block_size, self.file_mapper.read_block_info,
                                 write_files,  # both: a tree recreated under the same inodes
                                 self.metrics.counters, label, info_checked[0])
        self._root_guard = RootGuard(self.root_dir, rank_path, started.root_id, write_config,
                                     self.metrics.counters, label, geometry)
        self._export_dsa_counters()
        self.capacity = None  # the root's bound: kvtier._tier.capacity.Handle (docs/capacity.md)
        if cfg.capacity is not None:
            try:  # ValueError: a bound below one block, or another tier of this process bounds the root
                # otherwise; OSError: .kvtier/
                self.capacity = _capacity.attach(self.root_dir, cfg.capacity, self.metrics.counters,
                                                 block_size=self.block_size)
            except BaseException:
                if metrics is None:
                    self.metrics.close()
                raise
            self.metrics.counters.capacity_gauges = self.capacity.gauges

        # ---- the engine: pools, jobs, results; counts into the tracker's counters ----
        self._engine = TierEngine(
            self._view, self.block_size, self._path_of, use_o_direct=self.use_o_direct,
            counters=self.metrics.counters, thread_name="kvtier_fs", root=self.root_dir,
            before_job=self._root_guard.check, landing=self.load_landing, capacity=self.capacity,
            **cfg.engine_args())

    # ------------------------------------------------------------------ config
    @classmethod
    def config_keys(cls) -> List[str]:
        """Names accepted by :meth:`from_config` (every constructor argument but ``primary``)."""
        return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "primary")]

    @classmethod
    def from_config(cls, primary: Any, config: Mapping[str, Any]) -> "FileSystemTierManager":
        """Build from a config mapping (e.g. a tier entry of a connector's JSON config).

        Raises ValueError naming unknown keys and listing the valid ones, before any I/O.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        valid = cls.config_keys()
        unknown = sorted(set(config) - set(valid))
        if unknown:
            raise ValueError(f"unknown FileSystemTierManager config key(s) {unknown}; valid keys: {valid}")
        return cls(primary, **config)

    def _export_dsa_counters(self) -> None:
        """With checksums on and a DSA CRC backend active ("dsa" or "dsa-model",
        ``kvtier.crc32c_backend``), export the engine's counters as ``kvtier:dsa_*``
        (:func:`kvtier.dsa.prometheus_counters`) with label ``backend`` = that name, so
        the model is never reported as "dsa".  The engine is per process: every such
        tier of the process exports the same engine totals."""
        import kvtier

        backend = kvtier.crc32c_backend
        if not self.checksum_blocks or backend not in ("dsa", "dsa-model"):
            return
        from kvtier import dsa

        self.metrics.add_counter_source(functools.partial(dsa.prometheus_counters, backend),
                                        labels={"backend": backend})

    @property
    def _threads(self) -> List[threading.Thread]:
        return self._engine.threads

    def _path_of(self, key: Key) -> str:
        return self.file_mapper._file_name(*key)  # keys went through FileMapper.check_key

    # ------------------------------------------------------------------ jobs
    def _prepare(self, job: TransferJob, is_promotion: bool) -> Tuple[Tuple[Key, ...], List[int]]:
        if not isinstance(job, TransferJob):
            raise TypeError(f"job must be a TransferJob, got {type(job).__name__}")
        if job.is_promotion is not None and bool(job.is_promotion) != is_promotion:
            raise ValueError(
                f"job {job.job_id!r} has is_promotion={job.is_promotion} but was submitted with "
                f"{'submit_load' if is_promotion else 'submit_store'}"
            )
        try:
            hash(job.job_id)
        except TypeError:
            raise TypeError(f"job_id must be hashable, got {type(job.job_id).__name__}") from None
        keys = tuple(job.keys)
        chunk_ids = list(job.chunk_ids)
        if len(keys) != len(chunk_ids):
            raise ValueError(f"job {job.job_id!r}: {len(keys)} keys but {len(chunk_ids)} chunk_ids")
        offsets = []
        for c in chunk_ids:
            if isinstance(c, bool):
                raise TypeError("chunk_ids must be ints, got bool")
            if not isinstance(c, int):
                try:
                    c = int(c.__index__())  # numpy integers
                except (AttributeError, TypeError):
                    raise TypeError(f"chunk_ids must be ints, got {type(c).__name__}") from None
            if not 0 <= c < self.num_blocks:
                raise ValueError(f"job {job.job_id!r}: chunk_id {c} out of range [0, {self.num_blocks})")
            offsets.append(c * self.block_size)
        keys = tuple(FileMapper.check_key(k) for k in keys)  # once per key: paths reuse it
        if is_promotion and self._readonly:
            raise BufferError("primary buffer is read-only; loads need a writable buffer")
        return keys, offsets

    def _submit(self, job: TransferJob, is_promotion: bool) -> None:
        keys, offsets = self._prepare(job, is_promotion)
        if self._engine.is_shut_down:
            raise RuntimeError("FileSystemTierManager is shut down")
        self._engine.submit(job.job_id, keys, offsets, is_promotion)

    def submit_store(self, job: TransferJob) -> None:
        """Queue a store (cascade): block ``chunk_ids[i]`` of the buffer -> file of ``keys[i]``.

        Existing files are skipped (counted as stored).  Non-blocking.  Raises TypeError /
        ValueError for a bad job (before queueing; a key twice, or for a load a chunk_id
        twice, is a ValueError naming it), ValueError for a job id still in use,
        RuntimeError after :meth:`shutdown`.
        """
        self._submit(job, False)

    def submit_load(self, job: TransferJob) -> None:
        """Queue a load (promotion): file of ``keys[i]`` -> block ``chunk_ids[i]`` of the buffer.

        Non-blocking; same errors as :meth:`submit_store`, plus BufferError for a read-only
        buffer.
        """
        self._submit(job, True)

    def get_finished_jobs(self) -> List[JobResult]:
        """Results of the jobs finished since the last call, in completion order.  Their ids
        become free for reuse."""
        bs = self.block_size
        return [JobResult(f.job_id, f.success, f.successful_keys, f.elapsed, f.n_ok * bs,
                          f.checksum_failed, f.is_promotion, f.error, f.checksum_retries)
                for f in self._engine.take_finished()]

    def lookup(self, keys: Sequence[Key]) -> List[bool]:
        """For each key, True if its block file is a regular file of the block size (one C
        call for all keys; a directory, symlink, FIFO or file of another size is a miss, as
        vLLM's own lookup checks the size).

        Never waits for the filesystem longer than ``lookup_timeout_s`` (default 2 s): a
        lookup that has not answered by then is all misses, and while it stays stuck in
        the filesystem later lookups answer all misses at once (each counted in
        ``kvtier:kv_offload_tiering_timeouts{op="lookup"}``), until it returns."""
        paths = self.file_mapper.get_file_names(list(keys))
        if not paths:
            return []
        return self._engine.lookup(paths, self.block_size)

    def drain_jobs(self, timeout: Optional[float] = None) -> bool:
        """Block until every submitted job has finished (results stay available from
        :meth:`get_finished_jobs`).  Returns False if ``timeout`` (seconds) expired."""
        return self._engine.drain(timeout)

    def shutdown(self, wait: bool = True) -> List[Hashable]:
        """Stop the tier: queued jobs are discarded (never run, never reported), running
        jobs finish, threads are joined (``wait``).  Returns the discarded job ids.
        Idempotent; later submits raise RuntimeError.

        Frees what the tier holds: the tracker it created (no ``metrics`` argument) is
        closed, so its samples leave the registry and a new tier may use the same
        ``tier_idx`` there (a tracker passed in is the caller's to close); the tier and
        its engine drop their references to ``primary``.  A job still running keeps its
        own reference until its I/O call returns (a thread stuck in a store's write
        syscall may still read the buffer), so: after ``shutdown()`` (waiting) with no
        thread stuck, the caller may close the buffer's exporter (an mmap) once its own
        references are gone; after ``shutdown(wait=False)``, only once every I/O call
        that was running has returned (a stuck thread keeps the buffer until then)."""
        discarded = self._engine.shutdown(wait)
        if self.capacity is not None:
            self.capacity.close()
        self._view = self._primary = None
        if self._owns_metrics:
            self.metrics.close()
        return discarded

    @property
    def is_shut_down(self) -> bool:
        """True once :meth:`shutdown` has been called (also via ``with``); submits then
        raise RuntimeError.  Running jobs may still be finishing if ``wait=False``."""
        return self._engine.is_shut_down

    def __enter__(self) -> "FileSystemTierManager":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"FileSystemTierManager(root={self.root_dir!r}, block_size={self.block_size}, "
                f"num_blocks={self.num_blocks}, checksum_blocks={self.checksum_blocks}, "
                f"o_direct={self.use_o_direct})")


__all__ = ["FileSystemTierManager", "JobResult", "TransferJob", "filesystem_type"]
