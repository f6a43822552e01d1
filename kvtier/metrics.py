"""Prometheus metrics of the filesystem tier, with vLLM's names and ``tier`` label.

Counters (names and help text as vLLM's ``TieringOffloadingMetrics``; label ``tier`` is
``"<index>:<type>"``, ``"1:fs"`` for the first secondary tier):

=================================================  ============================================
``vllm:kv_offload_tiering_read_bytes``             bytes loaded (promotions) into the buffer
``vllm:kv_offload_tiering_read_time``              seconds spent in promotion jobs
``vllm:kv_offload_tiering_write_bytes``            bytes stored (cascades) from the buffer
``vllm:kv_offload_tiering_write_time``             seconds spent in cascade jobs
``vllm:kv_offload_tiering_promotion_job_failures`` failed promotion (load) jobs
``vllm:kv_offload_tiering_cascade_job_failures``   failed cascade (store) jobs
``vllm:kv_offload_tiering_checksum_failures``      loads failed by a CRC32C mismatch; only
                                                   registered when checksums are on
``kvtier:kv_offload_tiering_checksum_retries``     kvtier's own: blocks of this tier re-read
                                                   once after a first CRC32C mismatch (the
                                                   retry-once of kvtier.io), whether the re-read
                                                   then verified or not; checksums on only
``kvtier:kv_offload_tiering_checksum_condemned``   kvtier's own: blocks of this tier condemned
                                                   (mismatched again: EBADMSG, file removed);
                                                   checksums on only
``kvtier:kv_offload_tiering_timeouts``             kvtier's own, label ``op`` (``load``,
                                                   ``store``, ``lookup``): jobs reported failed
                                                   at their deadline (``io_timeout_s``) and
                                                   lookups answered as misses at theirs
                                                   (``lookup_timeout_s``) or behind a stuck one
``kvtier:kv_offload_tiering_jobs_refused``         kvtier's own: jobs failed at once (EAGAIN)
                                                   while the cap of stuck threads is reached
``kvtier:kv_offload_tiering_stuck_threads``        kvtier's own, a gauge: threads of this tier
                                                   still in a filesystem call that outlived its
                                                   deadline
=================================================  ============================================

kvtier's error-policy counters (docs/design.md "Error policy"), always registered, one sample
per label value seen or defined:

=================================================  ============================================
``kvtier:kv_offload_tiering_condemned_blocks``     blocks removed, by ``cause``: checksum,
                                                   identity, size, short_read
``kvtier:kv_offload_tiering_rereads``              blocks read again before a verdict, by
                                                   ``cause``: checksum, identity (re-read),
                                                   short_read, size (reopened)
``kvtier:kv_offload_tiering_retries``              transient errors retried, by ``errno``:
                                                   EINTR, EAGAIN, ESTALE
``kvtier:kv_offload_tiering_unverified_blocks``    blocks without CRC record on a checksummed
                                                   tier, by ``outcome``: loaded, miss (strict)
``kvtier:kv_offload_tiering_io_errors``            failed jobs by the failing call: labels
                                                   ``operation`` (open, read, getxattr,
                                                   verify, write, sync, rename ...) and
                                                   ``errno`` (EIO, ENOENT, EBADMSG ...)
``kvtier:kv_offload_tiering_root_lost``            the tier root found deleted or replaced
                                                   while running (then restored)
``kvtier:kv_offload_tiering_geometry_refused``     jobs refused: the root's kvtier.json records
                                                   another block size (issue #24)
``kvtier:kv_offload_tiering_existing``             stores skipped: the block was already there
                                                   (a regular file of the block size; no bytes
                                                   counted in ``write_bytes``)
``kvtier:kv_offload_tiering_durable_existing``     durable stores of a block already there that
                                                   synced it (file and directory)
``kvtier:kv_offload_tiering_replaced``             stores that replaced a symlink, FIFO or file
                                                   of another size at the block path
``kvtier:kv_offload_tiering_buffered_unaligned``   stores written buffered although O_DIRECT
                                                   was on: the primary buffer is not page
                                                   aligned
=================================================  ============================================

The labelled families (``FAMILIES``: the timeouts and the four policy families above) have
the same name and label set in vLLM's stats path (:func:`kvtier.vllm.metrics`), where each is
one metric declared with labels ``tier`` and its own label (``op``, ``cause``, ``errno``,
``outcome``), and so is ``kvtier:kv_offload_tiering_io_errors{tier,operation,errno}``:
``kvtier:kv_offload_tiering_timeouts{tier="1:kvtier",op="load"}`` means the same thing
standalone and inside vLLM.

prometheus_client exposes a Counter named ``X`` as the sample ``X_total`` (plus
``X_created``), exactly as vLLM's own counters appear on its ``/metrics`` endpoint
(e.g. ``vllm:kv_offload_tiering_read_bytes_total{tier="1:fs"}``).

Registry: by default each tracker registers into its own fresh
:class:`prometheus_client.CollectorRegistry`.  Any number of trackers with different tier
labels may share one registry (e.g. ``registry=prometheus_client.REGISTRY``, the process's
default ``/metrics``): the first registers one collector for that registry, each tracker
adds its samples to the same metric families.  A second tracker with the same tier label
on one registry is a ValueError (raised before a tier touches its root directory).

The values are a tier engine's :class:`kvtier._tier.counters.Counters`, read at scrape time; the
counting rules live there (as vLLM's ``TieringMetricsTracker``): a failed job counts one
failure; a failed promotion that kept ``n`` blocks (partial keep) still counts ``n``
blocks' bytes and its time; a failed cascade counts no bytes; times are I/O seconds.  A
checksum failure (``JobResult.checksum_failed``) counts once per job; an EBADMSG
reported by the filesystem itself has ``checksum_failed=False`` and is not counted.

Extra counters (e.g. the DSA engine's, from ``kvtier.dsa``) are exported with
:meth:`TieringMetricsTracker.add_counter_source`, optionally with constant extra labels
and one per-sample label (the DSA CPU redos by ``status``).
"""
from __future__ import annotations

import re
import threading
import weakref
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtier._tier.capacity import COUNTER_DOCS as _CAPACITY_DOCS
from kvtier._tier.counters import COUNTERS, IO_ERROR_PREFIX, Counters
from kvtier._blockio.policy import COUNT_DOCS

READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
READ_TIME = "vllm:kv_offload_tiering_read_time"
WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
WRITE_TIME = "vllm:kv_offload_tiering_write_time"
PROMOTION_JOB_FAILURES = "vllm:kv_offload_tiering_promotion_job_failures"
CASCADE_JOB_FAILURES = "vllm:kv_offload_tiering_cascade_job_failures"
CHECKSUM_FAILURES = "vllm:kv_offload_tiering_checksum_failures"
CHECKSUM_RETRIES = "kvtier:kv_offload_tiering_checksum_retries"
CHECKSUM_CONDEMNED = "kvtier:kv_offload_tiering_checksum_condemned"

TIMEOUTS = "kvtier:kv_offload_tiering_timeouts"
JOBS_REFUSED = "kvtier:kv_offload_tiering_jobs_refused"
STUCK_THREADS = "kvtier:kv_offload_tiering_stuck_threads"
CONDEMNED_BLOCKS = "kvtier:kv_offload_tiering_condemned_blocks"
REREADS = "kvtier:kv_offload_tiering_rereads"
RETRIES = "kvtier:kv_offload_tiering_retries"
UNVERIFIED_BLOCKS = "kvtier:kv_offload_tiering_unverified_blocks"
IO_ERRORS = "kvtier:kv_offload_tiering_io_errors"
ROOT_LOST = "kvtier:kv_offload_tiering_root_lost"
GEOMETRY_REFUSED = "kvtier:kv_offload_tiering_geometry_refused"
EXISTING = "kvtier:kv_offload_tiering_existing"
DURABLE_EXISTING = "kvtier:kv_offload_tiering_durable_existing"
REPLACED = "kvtier:kv_offload_tiering_replaced"
BUFFERED_UNALIGNED = "kvtier:kv_offload_tiering_buffered_unaligned"
EVICTIONS = "kvtier:kv_offload_tiering_evictions"
EVICTED_BYTES = "kvtier:kv_offload_tiering_evicted_bytes"
CAPACITY_PREFIX = "kvtier:kv_offload_tiering_"
"""Capacity's other counters and gauges (kvtier._tier.capacity.COUNTER_DOCS) are exported as
``CAPACITY_PREFIX + name`` when the tier's root is bounded (docs/capacity.md)."""

LABELNAMES = ("tier",)

#: Labelled families of kvtier's error-policy counters: name -> (help, label name,
#: {label value: Counters snapshot key}).
POLICY_FAMILIES: Dict[str, Tuple[str, str, Dict[str, str]]] = {
    CONDEMNED_BLOCKS: ("Blocks condemned (file removed), by cause.", "cause",
                       {"checksum": "condemned_checksum", "identity": "condemned_identity",
                        "size": "condemned_size", "short_read": "condemned_short"}),
    REREADS: ("Blocks read again before a verdict (re-read or reopened), by cause.", "cause",
              {"checksum": "reread_checksum", "identity": "reread_identity",
               "short_read": "reread_short", "size": "restat_size"}),
    RETRIES: ("Transient errors retried, by errno.", "errno",
              {"EINTR": "retry_eintr", "EAGAIN": "retry_eagain", "ESTALE": "retry_estale"}),
    UNVERIFIED_BLOCKS: ("Blocks without a CRC32C record on a checksummed tier, by outcome "
                        "(loaded unverified, or a miss in strict mode).", "outcome",
                        {"loaded": "unverified", "miss": "unverified_miss"}),
}

#: The store side's policy counters, one unlabelled family each: name -> Counters snapshot
#: key (the vLLM adapter exports them under the same names: kvtier.vllm.metrics).
STORE_POLICY_COUNTERS: Dict[str, str] = {EXISTING: "existing", DURABLE_EXISTING: "durable_existing",
                                         REPLACED: "replaced", BUFFERED_UNALIGNED: "buffered_unaligned"}

_DOCS = {
    READ_BYTES: "Total bytes read from secondary tiers into the primary tier.",
    READ_TIME: "Total time spent reading from secondary tiers into the primary tier, in seconds.",
    WRITE_BYTES: "Total bytes written from the primary tier to secondary tiers.",
    WRITE_TIME: "Total time spent writing from the primary tier to secondary tiers, in seconds.",
    PROMOTION_JOB_FAILURES: "Number of failed secondary-tier promotion jobs.",
    CASCADE_JOB_FAILURES: "Number of failed secondary-tier cascade jobs.",
    CHECKSUM_FAILURES: "Number of secondary-tier loads that failed CRC32C checksum verification.",
    CHECKSUM_RETRIES: "Blocks re-read once after a first CRC32C mismatch (loaded if the re-read verified).",
    CHECKSUM_CONDEMNED: "Blocks condemned after a second CRC32C mismatch (EBADMSG, file removed).",
    TIMEOUTS: "Jobs reported failed at their deadline (io_timeout_s), and lookups answered as misses at theirs "
              "(lookup_timeout_s) or behind a stuck one, by op.",
    JOBS_REFUSED: "Jobs failed at once because the cap of threads stuck in the filesystem was reached.",
    STUCK_THREADS: "Threads still in a filesystem call that outlived its deadline.",
}


IO_ERRORS_DOC = "Failed jobs by the failing call and errno."
"""Help of :data:`IO_ERRORS` (labels ``operation``, ``errno``: label values as they occur)."""

#: The labelled families, under one name and label set wherever kvtier's counters are
#: exported: by this tracker and by the vLLM adapter's stats (:func:`kvtier.vllm.metrics`).
#: name -> (help, label name, {label value: Counters snapshot key}).
FAMILIES: Dict[str, Tuple[str, str, Dict[str, str]]] = {
    **POLICY_FAMILIES,
    TIMEOUTS: (_DOCS[TIMEOUTS], "op", {"load": "load_timeouts", "store": "store_timeouts",
                                       "lookup": "lookup_timeouts"}),
    EVICTIONS: ("Blocks evicted from the tier's bounded root by this process's evictor, by reason (capacity: "
                "usage passed the high watermark or a store was dropped; enospc: a store hit ENOSPC).", "reason",
                {"capacity": "evicted_capacity", "enospc": "evicted_enospc"}),
    EVICTED_BYTES: ("Allocated bytes of the blocks evicted by this process's evictor, by reason.", "reason",
                    {"capacity": "evicted_bytes_capacity", "enospc": "evicted_bytes_enospc"}),
}
#: The families that exist only for a bounded root (a tier with max_bytes).
CAPACITY_FAMILIES = (EVICTIONS, EVICTED_BYTES)
#: Capacity counters exported one by one (the evictions are FAMILIES): snapshot key -> help.
CAPACITY_SINGLES = tuple(k for k in _CAPACITY_DOCS
                         if all(k not in FAMILIES[f][2].values() for f in CAPACITY_FAMILIES))


def tier_label(tier_idx: int, tier_type: str = "kvtier") -> str:
    """vLLM's tier label: ``f"{tier_idx + 1}:{tier_type}"`` (index 0 -> ``"1:kvtier"``; vLLM's own tier is ``"1:fs"``)."""
    if isinstance(tier_idx, bool) or not isinstance(tier_idx, int) or tier_idx < 0:
        raise ValueError(f"tier_idx must be an int >= 0, got {tier_idx!r}")
    if not isinstance(tier_type, str) or not tier_type:
        raise ValueError("tier_type must be a non-empty str")
    return f"{tier_idx + 1}:{tier_type}"


SourceEntry = Union[Tuple[str, float], Tuple[str, Mapping[str, float], str]]
"""An entry of a counter source: ``(help, value)``, or ``(help, {label_value: value},
label_name)`` for one sample per value of ``label_name``."""

_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _check_label_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not _LABEL_RE.match(name) or name.startswith("__") or name in LABELNAMES:
        raise ValueError(f"{what} {name!r} is not a valid Prometheus label name other than {LABELNAMES}")
    return name


class _SourceCollector:
    """Custom collector: calls ``fn()`` at scrape time, yields one counter family per entry."""

    def __init__(self, fn: Callable[[], Mapping[str, SourceEntry]], label: str,
                 const_labels: Mapping[str, str]) -> None:
        self._fn = fn
        self._names = list(LABELNAMES) + list(const_labels)
        self._values = [label] + [str(v) for v in const_labels.values()]

    def collect(self) -> Iterable[CounterMetricFamily]:
        for name, entry in sorted(self._fn().items()):
            if len(entry) == 3:
                doc, per_label, label_name = entry
                fam = CounterMetricFamily(name, doc, labels=self._names + [_check_label_name(label_name, "label")])
                for lv, value in sorted(per_label.items()):
                    fam.add_metric(self._values + [str(lv)], float(value))
            else:
                doc, value = entry
                fam = CounterMetricFamily(name, doc, labels=self._names)
                fam.add_metric(self._values, float(value))
            yield fam


#: Exported metric name -> the :class:`kvtier._tier.counters.Counters` counter it reads.
COUNTER_OF = {
    READ_BYTES: "bytes_read",
    READ_TIME: "read_time",
    WRITE_BYTES: "bytes_written",
    WRITE_TIME: "write_time",
    PROMOTION_JOB_FAILURES: "load_failures",
    CASCADE_JOB_FAILURES: "store_failures",
    CHECKSUM_FAILURES: "checksum_failures",
    CHECKSUM_RETRIES: "checksum_retries",
    CHECKSUM_CONDEMNED: "blocks_condemned",
}


def _tracker_families(t: "TieringMetricsTracker") -> Iterable[CounterMetricFamily]:
    """The families of one tracker, with its samples, read from its Counters at scrape time."""
    snap = t.counters.snapshot()
    for name in t._names:
        fam = CounterMetricFamily(name, _DOCS[name], labels=LABELNAMES)
        fam.add_metric([t.tier], float(snap[COUNTER_OF[name]]))
        yield fam
    for name, (doc, label, keys) in FAMILIES.items():
        if name in CAPACITY_FAMILIES and t.counters.capacity_gauges is None:
            continue
        fam = CounterMetricFamily(name, doc, labels=LABELNAMES + (label,))
        for value, key in keys.items():
            fam.add_metric([t.tier, value], float(snap.get(key, 0)))
        yield fam
    fam = CounterMetricFamily(IO_ERRORS, IO_ERRORS_DOC,
                              labels=LABELNAMES + ("operation", "errno"))
    for key in sorted(k for k in snap if k.startswith(IO_ERROR_PREFIX)):
        op, err = key[len(IO_ERROR_PREFIX):].split(":", 1)
        fam.add_metric([t.tier, op, err], float(snap[key]))
    yield fam
    fam = CounterMetricFamily(ROOT_LOST, "Times the tier root was found deleted or replaced while running.",
                              labels=LABELNAMES)
    fam.add_metric([t.tier], float(snap.get("root_lost", 0)))
    yield fam
    fam = CounterMetricFamily(GEOMETRY_REFUSED, "Jobs refused because the root's kvtier.json records another "
                              "block size (nothing read or written).", labels=LABELNAMES)
    fam.add_metric([t.tier], float(snap.get("geometry_refused", 0)))
    yield fam
    for name, key in STORE_POLICY_COUNTERS.items():
        doc = COUNT_DOCS[key]
        fam = CounterMetricFamily(name, doc[:1].upper() + doc[1:] + ".", labels=LABELNAMES)
        fam.add_metric([t.tier], float(snap.get(key, 0)))
        yield fam
    # deadlines (docs/tier.md, "Deadlines"); the timeouts are a family (FAMILIES)
    fam = CounterMetricFamily(JOBS_REFUSED, _DOCS[JOBS_REFUSED], labels=LABELNAMES)
    fam.add_metric([t.tier], float(snap["jobs_refused"]))
    yield fam
    fam = GaugeMetricFamily(STUCK_THREADS, _DOCS[STUCK_THREADS], labels=LABELNAMES)
    fam.add_metric([t.tier], float(snap["stuck_threads"]))
    yield fam
    if t.counters.capacity_gauges is not None:  # a bounded root (docs/capacity.md)
        for key in CAPACITY_SINGLES:
            doc = COUNTERS[key]
            gauge = doc.startswith("gauge:")
            doc = doc[len("gauge: "):] if gauge else doc
            fam = (GaugeMetricFamily if gauge else CounterMetricFamily)(
                CAPACITY_PREFIX + key, doc[:1].upper() + doc[1:] + ".", labels=LABELNAMES)
            fam.add_metric([t.tier], float(snap.get(key, 0)))
            yield fam
    for src in list(t._sources):
        yield from src.collect()


class _RegistryCollector:
    """The one collector of a registry: every tracker on it adds its samples to the same
    families (so tiers never collide on metric names; their tier labels differ)."""

    def __init__(self) -> None:
        self.trackers: List["TieringMetricsTracker"] = []

    def describe(self) -> Iterable[CounterMetricFamily]:
        return []  # families vary with the trackers: never checked against other collectors

    def collect(self) -> Iterable[CounterMetricFamily]:
        fams: Dict[str, CounterMetricFamily] = {}
        for t in list(self.trackers):
            for fam in _tracker_families(t):
                have = fams.get(fam.name)
                if have is None:
                    fams[fam.name] = fam
                else:
                    have.samples.extend(fam.samples)
        return list(fams.values())


_shared_lock = threading.Lock()
_shared: "weakref.WeakKeyDictionary[CollectorRegistry, _RegistryCollector]" = weakref.WeakKeyDictionary()


def _attach(t: "TieringMetricsTracker") -> None:
    with _shared_lock:
        col = _shared.get(t.registry)
        if col is None:
            col = _shared[t.registry] = _RegistryCollector()
            t.registry.register(col)
        if any(o.tier == t.tier for o in col.trackers):
            raise ValueError(f"a tracker with tier label {t.tier!r} is already registered on this registry; "
                             "give each tier its own tier_idx / tier_type")
        col.trackers.append(t)


def _detach(t: "TieringMetricsTracker") -> None:
    with _shared_lock:
        col = _shared.get(t.registry)
        if col is None or t not in col.trackers:
            return
        col.trackers.remove(t)
        if not col.trackers:
            t.registry.unregister(col)
            del _shared[t.registry]


class TieringMetricsTracker:
    """Exports one tier's counters (a :class:`kvtier._tier.counters.Counters`) as Prometheus
    counters, read at scrape time.

    Args:
        tier: label value (default ``"1:kvtier"``, see :func:`tier_label`).
        checksums: register ``vllm:kv_offload_tiering_checksum_failures`` and kvtier's
            ``..._checksum_retries`` / ``..._checksum_condemned`` (only when the tier
            verifies checksums; absent otherwise).
        registry: a :class:`prometheus_client.CollectorRegistry`; default a fresh one
            (see module docstring).
        counters: the counters to export (a tier engine's ``counters``); default new ones,
            fed by :meth:`on_job_finished`.

    Thread-safe: :meth:`on_job_finished` may be called from any thread.
    """

    def __init__(self, tier: str = "1:kvtier", checksums: bool = False,
                 registry: Optional[CollectorRegistry] = None,
                 counters: Optional[Counters] = None) -> None:
        if not isinstance(tier, str) or not tier:
            raise ValueError("tier must be a non-empty label string such as '1:fs'")
        if counters is not None and not isinstance(counters, Counters):
            raise TypeError("counters must be a kvtier._tier.counters.Counters")
        self.tier = tier
        self.checksums = bool(checksums)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.counters = counters if counters is not None else Counters()
        names = [READ_BYTES, READ_TIME, WRITE_BYTES, WRITE_TIME, PROMOTION_JOB_FAILURES, CASCADE_JOB_FAILURES]
        if self.checksums:
            names += [CHECKSUM_FAILURES, CHECKSUM_RETRIES, CHECKSUM_CONDEMNED]
        self._names = names
        self._sources: list = []
        _attach(self)
        self._attached = True

    def has(self, name: str) -> bool:
        """True if counter ``name`` (without ``_total``) is exported by this tracker."""
        return self._attached and name in self._names

    def value(self, name: str) -> float:
        """Current value of counter ``name`` for this tier (KeyError if not exported)."""
        if not self.has(name):
            raise KeyError(name)
        return self.counters.snapshot()[COUNTER_OF[name]]

    def inc(self, name: str, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0) to counter ``name`` (KeyError if not exported)."""
        if not self.has(name):
            raise KeyError(name)
        self.counters.add(COUNTER_OF[name], amount)

    def on_job_finished(self, is_promotion: bool, success: bool, n_keys: int,
                        n_successful_keys: int, block_bytes: int,
                        transfer_time: Optional[float], checksum_failed: bool = False,
                        checksum_retries: int = 0) -> None:
        """Account one finished job (rules: :class:`kvtier._tier.counters.Counters`).

        ``n_keys`` blocks were in the job, ``n_successful_keys`` of them transferred
        (partial keep); ``block_bytes`` is the size of one block in bytes;
        ``transfer_time`` in seconds (None: not measured).  ``checksum_failed``: the job
        stopped at a condemned block; ``checksum_retries``: blocks of the job re-read
        after a first mismatch.  A tier engine counts its jobs itself: call this only
        for counters no engine feeds.
        """
        self.counters.count_job(is_promotion, success, n_keys, n_successful_keys, block_bytes,
                                transfer_time, checksum_failed, checksum_retries)

    def add_counter_source(self, fn: Callable[[], Mapping[str, SourceEntry]],
                           labels: Optional[Mapping[str, str]] = None) -> None:
        """Export extra counters read at scrape time.

        ``fn()`` returns ``{metric_name: (help_text, value)}``; each becomes a counter with
        this tracker's ``tier`` label plus the constant ``labels`` (e.g.
        ``{"backend": "dsa-model"}``), exposed as ``<metric_name>_total``.  An entry
        ``(help_text, {label_value: value}, label_name)`` gives one sample per label value
        (e.g. CPU redos by ``status``; no sample while the mapping is empty).  Used for the
        DSA engine's counters (:func:`kvtier.dsa.prometheus_counters`).  ``fn`` must be cheap
        and must not raise.  TypeError for a non-callable ``fn``; ValueError for an invalid
        label name (or ``tier``).
        """
        if not callable(fn):
            raise TypeError("fn must be callable")
        const = dict(labels or {})
        for k in const:
            _check_label_name(k, "labels key")
        self._sources.append(_SourceCollector(fn, self.tier, const))  # collected with this tracker

    def close(self) -> None:
        """Remove this tracker's samples from its registry (lets a new tracker reuse its
        tier label there)."""
        self._sources.clear()
        _detach(self)
        self._attached = False
