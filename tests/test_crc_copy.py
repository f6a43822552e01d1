"""The fused copy + CRC that moves checksummed loads from private memory into
the caller's buffer (csrc/block/engine.c, kernels in csrc/crc32c/copy.c; the kernels themselves are tested
against the bit-at-a-time reference by tests/c/test_crc32c.c).

Each test runs a fresh interpreter (the C core reads KVTIER_CRC_COPY once per
process) with the C block I/O backend and a clean KVTIER_* environment, and
checks bytes round-tripped, the bytes around each block untouched, corruption
caught (EBADMSG, checksum_failed, file removed), and the counters of
kvtier._C.crc_copy_status() against the loads made.
Where this CPU has no fused kernel the path is off: those tests check that it
says so and the loads still verify.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from corrupt import flip_bit

import kvtier

ROOT = Path(__file__).resolve().parent.parent
_C = pytest.importorskip("kvtier._C", reason="the fused copy path is part of the C core")

PRELUDE = textwrap.dedent("""
    import errno, json, os, sys, threading
    import numpy as np
    from kvtier import io as kio
    from kvtier import _C
    io = kio.for_backend("c")
    d = sys.argv[1]

    def data(n, seed):
        return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)

    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # cwd: the repository root
    from corrupt import flip_bit as flip

    def result(**kw):
        print("RESULT " + json.dumps(kw))
""")

# Sizes around the 256-byte fold step, the 64-byte head alignment, the
# 256 KiB bounce chunk and whole MiB blocks.
SIZES = [1, 63, 255, 256, 257, 4097, 65536 + 7, 262143, 262144, 262145, (1 << 20) + 3, 4 << 20]


def _py(tmp_path, body, env=None, timeout=180):
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e["KVTIER_IO_BACKEND"] = "c"
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(tmp_path)], capture_output=True,
                       text=True, timeout=timeout, env=e, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, r.stdout + r.stderr
    return json.loads(lines[-1][len("RESULT "):])


def _expected_kernel() -> str:
    """From /proc/cpuinfo, independent of the C core's own CPUID probe."""
    import platform

    if platform.machine() != "x86_64":
        return "generic"
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if {"avx512f", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= flags:
        return "avx512-vpclmulqdq"
    if {"pclmulqdq", "sse4_2"} <= flags:
        return "pclmulqdq"
    return "generic"


KERNEL = _expected_kernel()
needs_kernel = pytest.mark.skipif(KERNEL == "generic", reason="no fused CRC copy kernel for this CPU "
                                  "(x86-64 with PCLMULQDQ + SSE4.2 needed): the path is off here")

ROUND_TRIP = """
    sizes = json.loads(os.environ["T_SIZES"])
    direct_ok = kio.probe_o_direct(d)
    mismatched, outside, n_loads, n_bytes = [], [], 0, 0
    keep = []
    for k, bs in enumerate(sizes):
        src = data(bs, k)
        p = os.path.join(d, f"b{k}.bin")
        io.batch_store_block([p], src, [0], bs, use_o_direct=False, checksum=True)
        st0 = _C.crc_copy_status()
        if st0["blocks"] != 0:
            result(error="a store went through the copy path")
        for shift in (0, 3, 64 + 17):  # the block's slice at odd addresses too
            pool = np.full(shift + bs + 4096, 0xA5, dtype=np.uint8)
            keep.append(pool)
            io.batch_load_block([p], pool, [shift], bs, use_o_direct=False, checksum=True)
            n_loads += 1
            n_bytes += bs
            if not np.array_equal(pool[shift:shift + bs], src):
                mismatched.append([bs, shift])
            if (pool[:shift] != 0xA5).any() or (pool[shift + bs:] != 0xA5).any():
                outside.append([bs, shift])
        # Not through it: checksum off, and O_DIRECT (aligned buffer) where usable.
        pool = np.zeros(bs, dtype=np.uint8)
        keep.append(pool)
        io.batch_load_block([p], pool, [0], bs, use_o_direct=False, checksum=False)
        if direct_ok:
            import mmap
            m = mmap.mmap(-1, max(bs, 4096))
            keep.append(m)
            view = np.frombuffer(m, dtype=np.uint8)
            io.batch_load_block([p], view, [0], bs, use_o_direct=True, checksum=True)
            if not np.array_equal(view[:bs], src):
                mismatched.append([bs, "direct"])
            n_loads += 1  # O_DIRECT into private memory, then the fused copy too
            n_bytes += bs
            del view
    result(copy=_C.crc_copy_status(), mismatched=mismatched, outside=outside,
           n_loads=n_loads, n_bytes=n_bytes, direct_ok=direct_ok)
"""


@needs_kernel
def test_round_trip_through_the_copy_path(tmp_path):
    """Checksummed loads of every size, buffered and O_DIRECT, round-trip
    through the fused copy (slices at offsets 0, 3 and 81 of the buffer, the
    bytes around them untouched); the counters count exactly those loads and
    bytes; stores and unchecksummed loads do not go through it."""
    r = _py(tmp_path, ROUND_TRIP, env={"T_SIZES": json.dumps(SIZES)})
    assert r["mismatched"] == [] and r["outside"] == []
    assert r["copy"] == {"kernel": KERNEL, "enabled": True, "blocks": r["n_loads"], "bytes": r["n_bytes"]}
    assert r["n_loads"] >= 3 * len(SIZES)


def test_copy_path_off_loads_still_verify(tmp_path):
    """KVTIER_CRC_COPY=0 (any of 0/false/no/off) and a forced CRC32C backend
    turn the path off: the same loads round-trip (each piece checksummed by
    the active backend, then copied), nothing is counted on it."""
    for env in ({"KVTIER_CRC_COPY": "0"}, {"KVTIER_CRC_COPY": "OFF"},
                {"KVTIER_CRC32C_BACKEND": "table"}, {"KVTIER_CRC32C_BACKEND": "sse42"}):
        if env.get("KVTIER_CRC32C_BACKEND") == "sse42" and "sse42" not in kvtier.crc32c_backends():
            continue
        r = _py(tmp_path, ROUND_TRIP, env={**env, "T_SIZES": json.dumps([4097, (1 << 20) + 3])})
        assert r["mismatched"] == [] and r["outside"] == [], env
        if env.get("KVTIER_CRC32C_BACKEND") == kvtier.crc32c_backend:
            continue  # forcing the best CPU backend changes nothing (a build without ISA-L: sse42)
        assert r["copy"] == {"kernel": KERNEL, "enabled": False, "blocks": 0, "bytes": 0}, env


@needs_kernel
@pytest.mark.parametrize("pos", [0, 255, 256, 65536, 262143, 262144, 262145, (1 << 20) + 2])
def test_corruption_caught_on_the_copy_path(tmp_path, pos):
    """One flipped bit anywhere in a 1 MiB + 3 block (the first and last byte,
    around the 256-byte fold step and the 256 KiB chunk edges) fails the
    load with EBADMSG and checksum_failed, removes the file, leaves the block
    before it loaded; the re-read was checksummed in a private buffer.""" 
    r = _py(tmp_path, """
        bs = (1 << 20) + 3
        pos = int(os.environ["T_POS"])
        a, b = data(bs, 1), data(bs, 2)
        pa, pb = os.path.join(d, "a.bin"), os.path.join(d, "b.bin")
        io.batch_store_block([pa, pb], np.concatenate([a, b]), [0, bs], bs, use_o_direct=False, checksum=True)
        flip(pb, pos)
        out = np.zeros(2 * bs, dtype=np.uint8)
        try:
            io.batch_load_block([pa, pb], out, [0, bs], bs, use_o_direct=False, checksum=True)
            result(raised=False)
        except OSError as e:
            result(raised=True, errno=e.errno, cf=e.checksum_failed, ns=e.num_succeeded, fn=e.filename,
                   a_ok=bool(np.array_equal(out[:bs], a)), b_exists=os.path.exists(pb), a_exists=os.path.exists(pa),
                   copy=_C.crc_copy_status())
    """, env={"T_POS": str(pos)})
    assert r["raised"] is True
    assert (r["errno"], r["cf"], r["ns"]) == (__import__("errno").EBADMSG, True, 1)
    assert r["fn"].endswith("b.bin") and r["a_ok"] and r["a_exists"] and not r["b_exists"]
    bs = (1 << 20) + 3
    # a and b through the fused copy; b's re-read checksummed in a private buffer (neither counted)
    assert (r["copy"]["blocks"], r["copy"]["bytes"]) == (2, 2 * bs)


@needs_kernel
def test_threads_each_use_their_own_bounce_buffer(tmp_path):
    """8 threads loading different 1 MiB + 3 blocks at once into fresh
    buffers (each thread's bounce buffer is its own): every byte right,
    every load counted on the path."""
    r = _py(tmp_path, """
        bs, nb, rounds, nt = (1 << 20) + 3, 8, 6, 8
        src = data(bs * nb, 7)
        paths = [os.path.join(d, f"t{i}.bin") for i in range(nb)]
        io.batch_store_block(paths, src, [i * bs for i in range(nb)], bs, use_o_direct=False, checksum=True)
        bad, errors = [], []
        keep = []
        def worker(t):
            for k in range(rounds):
                out = np.zeros(bs, dtype=np.uint8)
                keep.append(out)
                i = (t + k) % nb
                try:
                    io.batch_load_block([paths[i]], out, [0], bs, use_o_direct=False, checksum=True)
                except OSError as e:
                    errors.append(str(e))
                if not np.array_equal(out, src[i * bs:(i + 1) * bs]):
                    bad.append([t, k])
        ts = [threading.Thread(target=worker, args=(t,)) for t in range(nt)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        result(bad=bad, errors=errors, copy=_C.crc_copy_status(), n=nt * rounds, bs=bs)
    """)
    assert r["bad"] == [] and r["errors"] == []
    assert r["copy"]["blocks"] == r["n"] and r["copy"]["bytes"] == r["n"] * r["bs"]


@needs_kernel
def test_fork_child_loads_through_the_copy_path(tmp_path):
    """A child forked after the parent's thread allocated its bounce buffer
    loads and verifies through the path (its copy of that buffer)."""
    r = _py(tmp_path, """
        bs = (1 << 20) + 3
        src = data(bs, 3)
        p = os.path.join(d, "f.bin")
        io.batch_store_block([p], src, [0], bs, use_o_direct=False, checksum=True)
        out = np.zeros(bs, dtype=np.uint8)
        io.batch_load_block([p], out, [0], bs, use_o_direct=False, checksum=True)
        pid = os.fork()
        if pid == 0:
            out2 = np.zeros(bs, dtype=np.uint8)
            io.batch_load_block([p], out2, [0], bs, use_o_direct=False, checksum=True)
            os._exit(0 if np.array_equal(out2, src) and _C.crc_copy_status()["blocks"] == 2 else 1)
        _, status = os.waitpid(pid, 0)
        result(parent_ok=bool(np.array_equal(out, src)), child_status=status)
    """)
    assert r["parent_ok"] and r["child_status"] == 0


def test_bad_crc_copy_env_is_refused_at_import(tmp_path):
    """kvtier.io refuses a KVTIER_CRC_COPY the C core would not understand."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e["KVTIER_CRC_COPY"] = "maybe"
    r = subprocess.run([sys.executable, "-c", "import kvtier.io"], capture_output=True, text=True, env=e,
                       cwd=str(ROOT), timeout=60)
    assert r.returncode != 0
    assert "ValueError: KVTIER_CRC_COPY='maybe' is not valid; valid values: 1, true, yes, on, 0, false, no, off" \
        in r.stderr


# ------------------------------------------- kvtier._C.crc32c_copy (Python API)

def test_crc32c_copy_values_bytes_and_neighbours():
    """Check value; the CRC equals kvtier.crc32c of the bytes, chained from a
    seed, for lengths around the fold steps at odd offsets; dst holds the
    bytes and nothing around it changes."""
    np = pytest.importorskip("numpy")
    out = bytearray(9)
    assert _C.crc32c_copy(out, b"123456789") == 0xE3069283 and out == b"123456789"
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (4 << 20) + 200, dtype=np.uint8)
    dst = np.full(len(src) + 200, 0x5A, dtype=np.uint8)
    for n in (0, 1, 63, 127, 128, 255, 256, 257, 4097, 65537, (1 << 20) + 3, 4 << 20):
        for so, do in ((0, 0), (3, 17), (64, 1), (7, 64)):
            dst[:] = 0x5A
            got = _C.crc32c_copy(dst[do:do + n], src[so:so + n], 0xDEADBEEF)
            assert got == kvtier.crc32c(src[so:so + n], 0xDEADBEEF), (n, so, do)
            assert np.array_equal(dst[do:do + n], src[so:so + n]), (n, so, do)
            assert (dst[:do] == 0x5A).all() and (dst[do + n:] == 0x5A).all(), (n, so, do)
    # chaining over a split equals one call
    a = _C.crc32c_copy(dst[:1000], src[:1000])
    assert _C.crc32c_copy(dst[1000:5000], src[1000:5000], a) == kvtier.crc32c(src[:5000])


def test_crc32c_copy_bad_input_raises_and_leaves_dst_untouched():
    np = pytest.importorskip("numpy")
    dst = bytearray(b"x" * 64)
    cases = [
        ((dst, b"y" * 63), ValueError, "crc32c_copy(): dst has 64 bytes, src 63"),
        ((dst, b"y" * 64, 1 << 32), ValueError, "0..0xFFFFFFFF"),
        ((dst, b"y" * 64, -1), ValueError, "0..0xFFFFFFFF"),
        ((b"z" * 64, b"y" * 64), BufferError, ""),
        ((dst, 64), TypeError, ""),
        ((dst,), TypeError, "takes 2 or 3 positional arguments (1 given)"),
        ((dst, b"y" * 64, 0, 0), TypeError, "takes 2 or 3 positional arguments (4 given)"),
        ((np.zeros(128, np.uint8)[::2], b"y" * 64), BufferError, "not C-contiguous"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc) as ei:
            _C.crc32c_copy(*args)
        assert msg in str(ei.value), (args, ei.value)
        assert dst == b"x" * 64
    buf = bytearray(range(100))
    m = memoryview(buf)
    with pytest.raises(ValueError, match=r"crc32c_copy\(\): dst and src overlap \(dst at src\+10, 50 bytes\)"):
        _C.crc32c_copy(m[10:60], m[0:50])
    assert buf == bytearray(range(100))
    assert _C.crc32c_copy(m[50:100], m[0:50]) == kvtier.crc32c(bytes(range(50)))  # adjacent: fine


@pytest.mark.slow
def test_crc32c_copy_releases_the_gil():
    """Another thread leaves timestamps through the middle of a large
    crc32c_copy call (the probe and its control: tests/test_crc32c.py)."""
    np = pytest.importorskip("numpy")
    import test_crc32c as tc

    n = 256 << 20
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty(n, dtype=np.uint8)
    results = []
    for _ in range(3):
        d, mid, total = tc._mid_call_progress(lambda: _C.crc32c_copy(dst, src))
        results.append((round(d * 1e3, 1), mid, total))
        if d > 0.004 and mid >= 10:
            return
    pytest.fail(f"other thread stalled during crc32c_copy calls: (ms, stamps mid-call, total) {results}")


# --------------------------------------- the pure-Python fallback uses it too

@needs_kernel
def test_fallback_loads_through_the_copy_path(tmp_path, monkeypatch):
    """With the C core importable and its copy path on, the fallback's
    checksummed buffered loads read into its bounce buffer and move each
    256 KiB chunk with kvtier._C.crc32c_copy (a spy counts the calls): bytes
    right, neighbours untouched, a second load into the same destination
    too; checksum-off loads do not call it; a flipped bit is EBADMSG,
    checksum_failed, file removed."""
    np = pytest.importorskip("numpy")
    import errno

    from kvtier import io as kio

    io = kio.for_backend("python")
    fallback = sys.modules["kvtier.fallback"]  # imported by kvtier.io (a direct import warns)
    if not _C.crc_copy_status()["enabled"]:
        pytest.skip("the copy path is off in this process (KVTIER_CRC_COPY or a forced CRC32C backend)")
    calls = []

    def spy(dst, src, value=0):
        calls.append(len(src))
        return _C.crc32c_copy(dst, src, value)

    monkeypatch.setattr(fallback, "_copy_fn_cache", [spy])
    bs = (1 << 20) + 3
    src = np.random.default_rng(9).integers(0, 256, bs, dtype=np.uint8)
    p = str(tmp_path / "f.bin")
    io.batch_store_block([p], src, [0], bs, use_o_direct=False, checksum=True)
    assert calls == []
    out = np.full(bs + 10, 0xA5, dtype=np.uint8)
    io.batch_load_block([p], out, [5], bs, use_o_direct=False, checksum=True)
    assert calls == [262144] * 4 + [3]
    assert np.array_equal(out[5:5 + bs], src) and (out[:5] == 0xA5).all() and (out[5 + bs:] == 0xA5).all()
    calls.clear()
    io.batch_load_block([p], out, [5], bs, use_o_direct=False, checksum=True)  # same destination again
    assert calls == [262144] * 4 + [3]
    assert np.array_equal(out[5:5 + bs], src)
    calls.clear()
    out2 = np.zeros(bs, dtype=np.uint8)
    io.batch_load_block([p], out2, [0], bs, use_o_direct=False, checksum=False)
    assert calls == [] and np.array_equal(out2, src)
    calls.clear()
    out3 = np.zeros(bs, dtype=np.uint8)
    flip_bit(p, 262144, 0x80)
    with pytest.raises(OSError) as ei:
        io.batch_load_block([p], out3, [0], bs, use_o_direct=False, checksum=True)
    assert (ei.value.errno, ei.value.checksum_failed, ei.value.num_succeeded) == (errno.EBADMSG, True, 0)
    assert not os.path.exists(p)
    assert calls == [262144] * 4 + [3]  # the read: mismatch; the re-read went through a private buffer


@needs_kernel
def test_fallback_load_nested_in_a_load_keeps_its_bounce_buffer(tmp_path, monkeypatch):
    """Python code can run on the loading thread in the middle of a fallback
    load (a signal handler, a finalizer) and load too. Here the first chunk
    copy of the outer load runs a whole nested checksummed load first: the
    outer load still verifies (no re-read, no condemned block) and both get
    their bytes, because each load holds its own bounce buffer."""
    np = pytest.importorskip("numpy")
    from kvtier import io as kio

    io = kio.for_backend("python")
    fallback = sys.modules["kvtier.fallback"]
    if not _C.crc_copy_status()["enabled"]:
        pytest.skip("the copy path is off in this process (KVTIER_CRC_COPY or a forced CRC32C backend)")
    bs, small = (1 << 20) + 3, 300 * 1024
    a = np.random.default_rng(1).integers(0, 256, bs, dtype=np.uint8)
    b = np.random.default_rng(2).integers(0, 256, small, dtype=np.uint8)
    pa, pb = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    io.batch_store_block([pa], a, [0], bs, use_o_direct=False, checksum=True)
    io.batch_store_block([pb], b, [0], small, use_o_direct=False, checksum=True)
    nested_out = np.zeros(small, dtype=np.uint8)
    nested, started = [], []

    def spy(dst, src, value=0):
        if not started:  # once: the nested load's own copies go straight through
            started.append(1)
            nested.append(io.batch_load_block([pb], nested_out, [0], small, use_o_direct=False, checksum=True))
        return _C.crc32c_copy(dst, src, value)

    monkeypatch.setattr(fallback, "_copy_fn_cache", [spy])
    out = np.zeros(bs, dtype=np.uint8)
    before = io.checksum_stats()
    assert io.batch_load_block([pa], out, [0], bs, use_o_direct=False, checksum=True) == 0  # no re-read
    assert nested == [0]
    assert np.array_equal(out, a) and np.array_equal(nested_out, b)
    assert io.checksum_stats() == before and os.path.exists(pa)


# ------------------- a re-read is judged on bytes the caller's threads cannot touch

RACE = """
    bs = 4 << 20
    src = data(bs, 21)
    p = os.path.join(d, "race.bin")
    io.batch_store_block([p], src, [0], bs, use_o_direct=False, checksum=True)
    dst = np.zeros(bs, dtype=np.uint8)
    stop = threading.Event()
    def scribble():  # the caller's bug: another thread writes the destination during loads
        while not stop.is_set():
            dst[::4096] = 0x5A
    t = threading.Thread(target=scribble)
    t.start()
    errors, retried = [], 0
    try:
        for _ in range(int(os.environ["T_LOADS"])):
            try:
                retried += io.batch_load_block([p], dst, [0], bs, use_o_direct=False, checksum=True)
            except OSError as e:
                errors.append([e.errno, e.checksum_failed])
                break
    finally:
        stop.set()
        t.join()
    result(errors=errors, retried=retried, exists=os.path.exists(p), stats=kio.checksum_stats())
"""


def test_caller_race_on_the_destination_never_condemns_a_good_block_c(tmp_path):
    """A thread of the caller writes the destination while the C core loads
    into it (KVTIER_CRC_COPY=0: the first read is checksummed in the caller's
    buffer): mismatches happen and are re-read, but the re-read is checksummed
    in a private buffer, so the good block is never condemned or removed."""
    r = _py(tmp_path, RACE, env={"KVTIER_CRC_COPY": "0", "T_LOADS": "300"})
    assert r["errors"] == [] and r["exists"]
    assert r["stats"]["checksum_condemned"] == 0
    assert r["retried"] == r["stats"]["checksum_retries"]


def test_caller_race_on_the_destination_never_condemns_a_good_block_fallback(tmp_path, monkeypatch):
    """The same in the fallback, deterministically: every read into the
    caller's buffer is followed by a scribble on it (the regular path, copy
    path off), yet the load verifies after one private re-read and the block
    stays."""
    np = pytest.importorskip("numpy")
    import errno
    import mmap

    from kvtier import io as kio

    io = kio.for_backend("python")
    fallback = sys.modules["kvtier.fallback"]
    monkeypatch.setattr(fallback, "_copy_fn_cache", [None])  # regular path for the first read
    real = fallback._preadv_into

    def read_then_scribble(fd, mv, off):
        n = real(fd, mv, off)
        if not isinstance(memoryview(mv).obj, mmap.mmap):  # the caller's buffer, not a bounce buffer
            memoryview(mv).cast("B")[0] ^= 0xFF  # another thread of the caller writes the buffer
        return n

    monkeypatch.setattr(fallback, "_preadv_into", read_then_scribble)
    bs = (1 << 20) + 3
    src = np.random.default_rng(4).integers(0, 256, bs, dtype=np.uint8)
    p = str(tmp_path / "r.bin")
    io.batch_store_block([p], src, [0], bs, use_o_direct=False, checksum=True)
    out = np.zeros(bs, dtype=np.uint8)
    before = io.checksum_stats()
    assert io.batch_load_block([p], out, [0], bs, use_o_direct=False, checksum=True) == 1  # one re-read
    assert np.array_equal(out, src) and os.path.exists(p)
    after = io.checksum_stats()
    assert after["checksum_condemned"] == before["checksum_condemned"]
    # a block that is really bad is still condemned by the private re-read
    flip_bit(p, 12345)
    with pytest.raises(OSError) as ei:
        io.batch_load_block([p], out, [0], bs, use_o_direct=False, checksum=True)
    assert (ei.value.errno, ei.value.checksum_failed) == (errno.EBADMSG, True) and not os.path.exists(p)
