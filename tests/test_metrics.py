import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import metrics as m


def samples(registry):
    """{(sample name, tier label): value} from the text exposition."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, s.labels.get("tier"))] = s.value
    return out


POLICY = [  # kvtier's error-policy families, always registered (docs/tier.md "Metrics")
    f"{n}_total" for n in (m.CONDEMNED_BLOCKS, m.REREADS, m.RETRIES, m.UNVERIFIED_BLOCKS, m.ROOT_LOST, m.GEOMETRY_REFUSED,
                           m.EXISTING, m.DURABLE_EXISTING, m.REPLACED, m.BUFFERED_UNALIGNED)
]

BASE = POLICY + [
    "vllm:kv_offload_tiering_read_bytes_total",
    "vllm:kv_offload_tiering_read_time_total",
    "vllm:kv_offload_tiering_write_bytes_total",
    "vllm:kv_offload_tiering_write_time_total",
    "vllm:kv_offload_tiering_promotion_job_failures_total",
    "vllm:kv_offload_tiering_cascade_job_failures_total",
    # deadlines, kvtier's own (timeouts: one sample per op)
    "kvtier:kv_offload_tiering_timeouts_total",
    "kvtier:kv_offload_tiering_jobs_refused_total",
    "kvtier:kv_offload_tiering_stuck_threads",
]


def test_deadline_metrics_read_the_counters():
    reg = CollectorRegistry()
    t = m.TieringMetricsTracker("1:fs", registry=reg)
    t.counters.add("load_timeouts", 2)
    t.counters.add("lookup_timeouts")
    t.counters.add("jobs_refused", 3)
    t.counters.stuck_gauge = lambda: 4
    get = reg.get_sample_value
    assert [get(m.TIMEOUTS + "_total", {"tier": "1:fs", "op": op}) for op in ("load", "store", "lookup")] == [2, 0, 1]
    assert get(m.JOBS_REFUSED + "_total", {"tier": "1:fs"}) == 3
    assert get(m.STUCK_THREADS, {"tier": "1:fs"}) == 4


def test_exposed_names_match_vllm_checksums_off():
    reg = CollectorRegistry()
    m.TieringMetricsTracker("1:fs", checksums=False, registry=reg)
    s = samples(reg)
    assert sorted({n for n, _ in s}) == sorted(BASE)  # io_errors: no sample before an error
    assert all(t == "1:fs" for _, t in s)
    assert "vllm:kv_offload_tiering_checksum_failures_total" not in generate_latest(reg).decode()


def test_checksum_metric_only_when_on():
    reg = CollectorRegistry()
    m.TieringMetricsTracker("1:fs", checksums=True, registry=reg)
    assert sorted({n for n, _ in samples(reg)}) == sorted(BASE + [
        "vllm:kv_offload_tiering_checksum_failures_total",
        "kvtier:kv_offload_tiering_checksum_retries_total",
        "kvtier:kv_offload_tiering_checksum_condemned_total",
    ])


def test_counting_rules():
    reg = CollectorRegistry()
    t = m.TieringMetricsTracker("1:fs", checksums=True, registry=reg)
    t.on_job_finished(False, True, 4, 4, 1000, 0.25)  # store ok
    t.on_job_finished(True, True, 2, 2, 1000, 0.5)  # load ok
    t.on_job_finished(True, False, 5, 3, 1000, 0.125, checksum_failed=True)  # partial keep, CRC
    t.on_job_finished(True, False, 5, 0, 1000, 0.125, checksum_failed=False)  # FS EBADMSG etc.
    t.on_job_finished(False, False, 3, 1, 1000, 1.0)  # failed store: no bytes
    s = samples(reg)
    assert s[("vllm:kv_offload_tiering_write_bytes_total", "1:fs")] == 4000
    assert s[("vllm:kv_offload_tiering_write_time_total", "1:fs")] == 0.25
    assert s[("vllm:kv_offload_tiering_read_bytes_total", "1:fs")] == 5000
    assert s[("vllm:kv_offload_tiering_read_time_total", "1:fs")] == 0.625
    assert s[("vllm:kv_offload_tiering_promotion_job_failures_total", "1:fs")] == 2
    assert s[("vllm:kv_offload_tiering_cascade_job_failures_total", "1:fs")] == 1
    assert s[("vllm:kv_offload_tiering_checksum_failures_total", "1:fs")] == 1
    assert t.value(m.CHECKSUM_FAILURES) == 1


def test_checksum_retry_and_condemned_counters_per_tier():
    """kvtier's retry-once counters are ordinary per-tier counters: two trackers
    (two tiers) count only what their own jobs report."""
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    a = m.TieringMetricsTracker("1:fs", checksums=True, registry=reg_a)
    b = m.TieringMetricsTracker("2:fs", checksums=True, registry=reg_b)
    a.on_job_finished(True, True, 4, 4, 100, 0.1, checksum_retries=2)  # two transient re-reads, loaded
    a.on_job_finished(True, False, 4, 1, 100, 0.1, checksum_failed=True, checksum_retries=1)  # condemned
    b.on_job_finished(True, True, 4, 4, 100, 0.1)
    sa, sb = samples(reg_a), samples(reg_b)
    assert sa[("kvtier:kv_offload_tiering_checksum_retries_total", "1:fs")] == 3
    assert sa[("kvtier:kv_offload_tiering_checksum_condemned_total", "1:fs")] == 1
    assert sb[("kvtier:kv_offload_tiering_checksum_retries_total", "2:fs")] == 0
    assert sb[("kvtier:kv_offload_tiering_checksum_condemned_total", "2:fs")] == 0
    assert a.value(m.CHECKSUM_RETRIES) == 3 and b.value(m.CHECKSUM_RETRIES) == 0
    off = m.TieringMetricsTracker("3:fs", checksums=False, registry=CollectorRegistry())
    off.on_job_finished(True, True, 1, 1, 100, 0.1, checksum_retries=1)  # ignored: not registered
    assert not off.has(m.CHECKSUM_RETRIES) and not off.has(m.CHECKSUM_CONDEMNED)


def test_default_registry_is_private_and_labels():
    a = m.TieringMetricsTracker()
    b = m.TieringMetricsTracker()  # no duplicate-registration error
    assert a.registry is not b.registry
    assert m.tier_label(0) == "1:kvtier" and a.tier == "1:kvtier" and m.tier_label(1, "s3") == "2:s3"
    with pytest.raises(ValueError):
        m.tier_label(-1)
    with pytest.raises(ValueError):
        m.TieringMetricsTracker("")


def test_counter_source_hook_and_close():
    reg = CollectorRegistry()
    t = m.TieringMetricsTracker("2:fs", registry=reg)
    box = {"n": 3}
    t.add_counter_source(lambda: {"kvtier:dsa_cpu_redo": ("CRC redone on the CPU", box["n"])})
    assert samples(reg)[("kvtier:dsa_cpu_redo_total", "2:fs")] == 3
    box["n"] = 7
    assert samples(reg)[("kvtier:dsa_cpu_redo_total", "2:fs")] == 7
    with pytest.raises(TypeError):
        t.add_counter_source(5)
    t.close()
    assert samples(reg) == {}
    m.TieringMetricsTracker("2:fs", registry=reg)  # names free again


def test_counter_source_constant_and_per_sample_labels():
    reg = CollectorRegistry()
    t = m.TieringMetricsTracker("1:fs", registry=reg)
    box = {"by": {}}
    t.add_counter_source(lambda: {
        "kvtier:dsa_cpu_redo": ("redos", 4),
        "kvtier:dsa_cpu_redo_by_status": ("redos by status", dict(box["by"]), "status"),
    }, labels={"backend": "dsa-model"})

    def rows():
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                      for fam in text_string_to_metric_families(generate_latest(reg).decode())
                      for s in fam.samples if s.name.startswith("kvtier:dsa"))

    base = (("backend", "dsa-model"), ("tier", "1:fs"))
    assert rows() == [("kvtier:dsa_cpu_redo_total", base, 4.0)]  # no by-status sample yet
    box["by"] = {"page_fault": 1, "invalid_flags": 3}
    assert rows() == [
        ("kvtier:dsa_cpu_redo_by_status_total", (("backend", "dsa-model"), ("status", "invalid_flags"), ("tier", "1:fs")), 3.0),
        ("kvtier:dsa_cpu_redo_by_status_total", (("backend", "dsa-model"), ("status", "page_fault"), ("tier", "1:fs")), 1.0),
        ("kvtier:dsa_cpu_redo_total", base, 4.0),
    ]
    for bad in ({"tier": "x"}, {"9x": "y"}, {"__a": "b"}, {"a-b": "c"}):
        with pytest.raises(ValueError):
            t.add_counter_source(lambda: {}, labels=bad)


def test_dsa_prometheus_counters_shape():
    dsa = pytest.importorskip("kvtier.dsa")
    if dsa._C is None:
        pytest.skip("needs the C core")
    # no engine enabled in this process: every counter 0, no by-status sample, never raises
    src = dsa.prometheus_counters("dsa")
    names = {n for n, *_ in dsa.PROMETHEUS_COUNTERS}
    assert set(src) == names | {dsa.PROMETHEUS_CPU_REDO_BY_STATUS}
    assert all(src[n][1] == 0 for n in names)
    assert src[dsa.PROMETHEUS_CPU_REDO_BY_STATUS][1:] == ({}, "status")
    with pytest.raises(ValueError):
        dsa.prometheus_counters("isal")
