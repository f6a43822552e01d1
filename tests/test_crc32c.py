"""CRC32C: one test body per property, parametrised over every available
backend (kvtier.crc32c_backends(): the C ones and "numpy"); each test calls
that backend through kvtier.crc32c_using(name, ...).

Oracle: a bit-at-a-time CRC-32C written here (reflected 0x82F63B78, RFC 3720
B.4) and a GF(2) combine written here, independent of the package code.
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvtier

POLY = 0x82F63B78
BACKENDS = kvtier.crc32c_backends()
C_BACKENDS = [b for b in BACKENDS if b != "numpy"]


# ---------------------------------------------------------------- oracle

def ref_crc(data: bytes, crc: int = 0) -> int:
    """Bit-at-a-time CRC-32C, standard presentation."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (POLY if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _ref_mul(a: int, b: int) -> int:  # a*b mod P, reflected (bit 31 = x^0)
    p = 0
    for i in range(32):
        if a >> (31 - i) & 1:
            p ^= b
        b = (b >> 1) ^ (POLY if b & 1 else 0)
    return p


def ref_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc(A+B) = crc(A) * x^(8*len2) mod P ^ crc(B) (the affine terms cancel)."""
    op, sq = 1 << 31, 1 << 23  # x^0, x^8
    while len2:
        if len2 & 1:
            op = _ref_mul(op, sq)
        sq = _ref_mul(sq, sq)
        len2 >>= 1
    return _ref_mul(op, crc1) ^ crc2


def ref_zeros(n: int) -> int:
    """CRC of n zero bytes, by double-and-add over ref_combine."""
    acc, pw, pwlen = 0, ref_crc(b"\0"), 1
    while n:
        if n & 1:
            acc = ref_combine(acc, pw, pwlen)
        n >>= 1
        if n:
            pw, pwlen = ref_combine(pw, pw, pwlen), pwlen * 2
    return acc


def test_oracle_itself():
    assert ref_crc(b"123456789") == 0xE3069283
    assert ref_combine(ref_crc(b"1234"), ref_crc(b"56789"), 5) == 0xE3069283
    assert ref_zeros(32) == ref_crc(bytes(32)) == 0x8A9136AA


# ---------------------------------------------------------------- data

RNG = np.random.default_rng(20240229)
DATA = RNG.integers(0, 256, 200_000, dtype=np.uint8).tobytes()


def _seed(i: int) -> int:
    return (0, 0xFFFFFFFF, int(RNG.integers(0, 1 << 32)))[i % 3]


def _cases():
    cases = []
    for n in range(0, 301):  # every short length, offsets and seeds rotating
        cases.append((n % 64, n, _seed(n)))
    for n in (1, 7, 64, 255, 1000):  # every offset 0..63
        for off in range(64):
            cases.append((off, n, _seed(off)))
    for n in (511, 512, 513, 767, 768, 769, 1023, 1024, 1025, 2047, 4095, 4096, 4097, 5000, 8191):
        for off in (0, 1, 3, 62):
            cases.append((off, n, _seed(n + off)))
    for n in (24575, 24576, 24577, 65537, 100003):  # around sse42 lane blocks (3 * 8 KiB)
        for off in (0, 5):
            cases.append((off, n, _seed(n + off)))
    return cases


CASES = _cases()
EXPECTED = [ref_crc(DATA[off:off + n], seed) for off, n, seed in CASES]
REF_100003 = ref_crc(DATA[:100003])


# ---------------------------------------------------------------- tests

def test_backend_list_and_attribute():
    assert BACKENDS[-1] == "numpy"
    assert "table" in BACKENDS
    if os.uname().machine == "x86_64":
        assert "sse42" in BACKENDS
    assert kvtier.crc32c_backend in BACKENDS
    if "KVTIER_CRC32C_BACKEND" not in os.environ:
        assert kvtier.crc32c_backend == BACKENDS[0]  # best available is auto-selected
    assert kvtier._C.active_backend() == kvtier.crc32c_backend
    if kvtier._C.isal_version() is not None:
        assert "isal" in BACKENDS and BACKENDS.index("isal") < BACKENDS.index("table")


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_values(backend):
    f = lambda d, v=0: kvtier.crc32c_using(backend, d, v)  # noqa: E731
    assert f(b"123456789") == 0xE3069283
    assert f(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4
    assert f(b"\xff" * 32) == 0x62A8AB43
    assert f(bytes(range(32))) == 0x46DD794E
    assert f(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert f(b"") == 0 and f(b"", 0x12345678) == 0x12345678


@pytest.mark.parametrize("backend", BACKENDS)
def test_against_bitwise_reference(backend):
    mv = memoryview(DATA)
    bad = []
    for (off, n, seed), want in zip(CASES, EXPECTED):
        got = kvtier.crc32c_using(backend, mv[off:off + n], seed)
        if got != want:
            bad.append((off, n, hex(seed), hex(got), hex(want)))
    assert not bad, f"{len(bad)} mismatches, first: {bad[:5]}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_chaining_every_split(backend):
    data = DATA[:300]
    whole = ref_crc(data)
    for k in range(len(data) + 1):
        a = kvtier.crc32c_using(backend, data[:k])
        assert kvtier.crc32c_using(backend, data[k:], a) == whole, k
    # chained in 3 uneven pieces over a long input (vector path of numpy too)
    big = DATA[:100003]
    c = 0
    for lo, hi in ((0, 4097), (4097, 70001), (70001, 100003)):
        c = kvtier.crc32c_using(backend, big[lo:hi], c)
    assert c == REF_100003


@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_every_split(backend):
    data = DATA[:300]
    whole = ref_crc(data)
    for k in range(len(data) + 1):
        a = kvtier.crc32c_using(backend, data[:k])
        b = kvtier.crc32c_using(backend, data[k:])
        assert kvtier.crc32c_combine(a, b, len(data) - k) == whole, k


COMBINE_CASES = [(0, 0, 0), (0xE3069283, 0, 0), (0, 0x12345678, 1), (0xFFFFFFFF, 0xFFFFFFFF, 1 << 31),
                 (0x8A9136AA, 0x62A8AB43, (1 << 32) + 7), (0xDEADBEEF, 0xCAFEBABE, (1 << 64) - 1)]


def test_combine_c_and_fallback_match_oracle():
    from kvtier._blockio import numpy_crc

    for c1, c2, n in COMBINE_CASES:
        want = ref_combine(c1, c2, n)
        assert kvtier._C.crc32c_combine(c1, c2, n) == want, (c1, c2, n)
        assert numpy_crc.crc32c_combine(c1, c2, n) == want, (c1, c2, n)
    assert kvtier.crc32c_combine(ref_zeros(1 << 20), ref_zeros(1 << 20), 1 << 20) == ref_zeros(1 << 21)


@pytest.mark.parametrize("impl", ["c", "fallback"])
def test_combine_errors(impl):
    from kvtier._blockio import numpy_crc

    combine = kvtier._C.crc32c_combine if impl == "c" else numpy_crc.crc32c_combine
    with pytest.raises(ValueError):
        combine(-1, 0, 0)
    with pytest.raises(ValueError):
        combine(0, 1 << 32, 0)
    with pytest.raises(ValueError):
        combine(0, 0, -1)
    with pytest.raises(ValueError):
        combine(0, 0, 1 << 64)
    with pytest.raises(TypeError):
        combine("0", 0, 0)
    with pytest.raises(TypeError):
        combine(0, 0, 1.0)
    with pytest.raises(TypeError):
        combine(0, 0)


def _buffers():
    raw = DATA[:4099]
    m = mmap.mmap(-1, len(raw))
    m.write(raw)
    ro = np.frombuffer(raw, dtype=np.uint8).copy()
    ro.flags.writeable = False
    return {
        "bytes": raw,
        "bytearray": bytearray(raw),
        "memoryview": memoryview(bytearray(raw)),
        "readonly memoryview": memoryview(raw),
        "mmap": m,
        "numpy uint8": np.frombuffer(raw, dtype=np.uint8).copy(),
        "readonly numpy": ro,
        "numpy 2-D C-order int16": np.frombuffer(raw[:4098], dtype="<i2").reshape(3, 683).copy(),
        "numpy float64 slice": np.frombuffer(raw[:4096], dtype="<f8")[1:-1],
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffer_types(backend):
    for name, buf in _buffers().items():
        want = ref_crc(bytes(memoryview(buf).cast("B")))
        assert kvtier.crc32c_using(backend, buf) == want, name
        if isinstance(buf, mmap.mmap):
            buf.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_cpu_tensor(backend):
    torch = pytest.importorskip("torch")
    t = torch.arange(1000, dtype=torch.int32)
    want = ref_crc(t.numpy().tobytes())
    assert kvtier.crc32c_using(backend, t) == want
    # bf16 (the usual KV dtype) has no numpy dtype: taken as its raw bytes.
    b = torch.arange(1000, dtype=torch.bfloat16)
    assert kvtier.crc32c_using(backend, b) == ref_crc(b.view(torch.int16).numpy().tobytes())
    with pytest.raises(BufferError):
        kvtier.crc32c_using(backend, t[::2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_is_buffer_error(backend):
    a = np.frombuffer(DATA[:4096], dtype=np.uint8)
    for bad in (a[::2], a.reshape(64, 64).T, a.reshape(64, 64)[:, :10], memoryview(DATA[:4096])[::3]):
        with pytest.raises(BufferError):
            kvtier.crc32c_using(backend, bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments(backend):
    for bad in (123, "123456789", None, [1, 2, 3], 1.5):
        with pytest.raises(TypeError):
            kvtier.crc32c_using(backend, bad)
    with pytest.raises(TypeError):
        kvtier.crc32c_using(backend, b"abc", "0")
    for bad in (-1, 1 << 32, 1 << 70):
        with pytest.raises(ValueError):
            kvtier.crc32c_using(backend, b"abc", bad)
    assert kvtier.crc32c_using(backend, b"abc", 0xFFFFFFFF) == ref_crc(b"abc", 0xFFFFFFFF)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="table"):
        kvtier.crc32c_using("no-such-backend", b"abc")


def test_benchmark_peers():
    """The private peers used by benchmarks/crc32c_bench.py give right values."""
    for n in (0, 1, 9, 1000, 65537):
        d = DATA[3:3 + n]
        assert kvtier._C._crc32c_bytewise(d, 7) == ref_crc(d, 7)
        if os.uname().machine == "x86_64":
            assert kvtier._C._crc32c_serial_crc32q(d, 7) == ref_crc(d, 7)


# ------------------------------------------------ > 2 GiB and GIL release

BIG = (1 << 31) + 4099  # > 2 GiB: crosses the int-length limit of ISA-L and Py_ssize_t-as-int bugs
MARKS = {0: 0x01, (1 << 31) - 1: 0xAB, 1 << 31: 0xCD, (1 << 30) + 12345: 0x5A, BIG - 1: 0xEF}


@pytest.fixture(scope="module")
def big_buffer():
    """BIG bytes, zero except MARKS (np.zeros: untouched pages read as the
    shared zero page, so resident memory stays small)."""
    try:
        a = np.zeros(BIG, dtype=np.uint8)
    except MemoryError:
        pytest.skip("cannot allocate a > 2 GiB buffer")
    for pos, v in MARKS.items():
        a[pos] = v
    yield a
    del a


def _sparse_ref(n: int, marks: dict, seed: int = 0) -> int:
    crc, pos = seed, 0
    for p in sorted(marks):
        crc = ref_combine(crc, ref_zeros(p - pos), p - pos) if p > pos else crc
        crc = ref_crc(bytes([marks[p]]), crc)
        pos = p + 1
    return ref_combine(crc, ref_zeros(n - pos), n - pos) if n > pos else crc


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_over_2gib(backend, big_buffer):
    want = _sparse_ref(BIG, MARKS, 0x12345678)
    assert kvtier.crc32c_using(backend, big_buffer, 0x12345678) == want


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_gil_released_during_large_crc(backend, big_buffer):
    """A second thread keeps running Python code while one large crc32c call
    runs: it leaves timestamps all through the middle of the call. With the
    GIL held for the whole call there would be none there (the switch
    interval is cut to 0.1 ms so the edges of the call are sharp)."""
    buf = memoryview(big_buffer)
    # Size each call to last ~100 ms on this backend (at most the whole buffer).
    probe = buf[: 16 << 20]
    t = time.perf_counter()
    kvtier.crc32c_using(backend, probe)
    rate = (16 << 20) / max(time.perf_counter() - t, 1e-6)
    n = int(min(BIG, max(16 << 20, rate * 0.1)))
    # A loaded 2-core box can deschedule the other thread for a while, so up
    # to 3 tries; a call holding the GIL can never leave stamps mid-call, so
    # retrying does not weaken the check.
    results = []
    for _ in range(3):
        d, mid, total = _mid_call_progress(lambda: kvtier.crc32c_using(backend, buf[:n]))
        results.append((round(d * 1e3, 1), mid, total))
        if d > 0.004 and mid >= 10:
            return
    pytest.fail(f"other thread stalled during crc32c calls of {n} bytes: (ms, stamps mid-call, total) {results}")


def test_gil_probe_detects_a_held_gil():
    """Control for the test above: a long C call that keeps the GIL
    (builtin sum over a range never checks the eval breaker) leaves no
    timestamps mid-call."""
    d, mid, total = _mid_call_progress(lambda: sum(range(5_000_000)))
    assert d > 0.02 and mid == 0, (d, mid, total)


def _mid_call_progress(call):
    """Run call() while a second thread spins leaving timestamps; return
    (call duration s, stamps in the middle half of the call, all stamps)."""
    stamps = [0.0] * (1 << 20)  # preallocated: the spinner never allocates
    count = [0]
    stop = threading.Event()
    started = threading.Event()

    def spin():
        i = k = 0
        started.set()
        while not stop.is_set():
            i += 1
            if i % 64 == 0 and k < len(stamps):
                stamps[k] = time.perf_counter()
                k += 1
        count[0] = k

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    th = threading.Thread(target=spin)
    try:
        th.start()
        started.wait()
        time.sleep(0.002)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    d = t1 - t0
    got = stamps[: count[0]]
    return d, sum(1 for s in got if t0 + d / 4 <= s <= t0 + 3 * d / 4), len(got)


# ------------------------------------------------ forced backend (env var)

def _py(code: str, **env):
    e = dict(os.environ)
    e.pop("KVTIER_CRC32C_BACKEND", None)
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60)


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_forced_backend_env(backend):
    r = _py("import kvtier; print(kvtier.crc32c_backend, kvtier.crc32c(b'123456789'))",
            KVTIER_CRC32C_BACKEND=backend)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [backend, str(0xE3069283)]


def test_default_backend_env_unset():
    r = _py("import kvtier; print(kvtier.crc32c_backend)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == C_BACKENDS[0]


@pytest.mark.parametrize("value", ["no-such-backend", "SSE42", "numpy"])
def test_forced_backend_env_bad_value(value):
    r = _py("import kvtier", KVTIER_CRC32C_BACKEND=value)
    assert r.returncode != 0
    assert "ValueError" in r.stderr and "KVTIER_CRC32C_BACKEND" in r.stderr and value in r.stderr
    for name in C_BACKENDS:  # the message lists the valid names
        assert repr(name) in r.stderr, r.stderr


def test_forced_backend_env_says_why():
    """The reason fits the name: another CPU's backend, the Python fallback, or
    unknown; dsa-model, accepted though not listed as available, is named."""
    import platform

    other = "armv8" if platform.machine() == "x86_64" else "sse42"
    cases = {other: f"is not built: {'aarch64' if other == 'armv8' else 'x86-64'} only",
             "numpy": "is the pure-Python fallback, used only without the C core",
             "bogus": "is unknown"}
    for value, why in cases.items():
        r = _py("import kvtier", KVTIER_CRC32C_BACKEND=value)
        assert r.returncode != 0
        assert f"ValueError: KVTIER_CRC32C_BACKEND={value}: CRC32C backend '{value}' {why}; available backends: " \
            in r.stderr, r.stderr
        if "dsa-model" in [n for (n, _ok, _f) in kvtier._C.backends()] and "'dsa-model'" not in \
                r.stderr.split("available backends: ")[1].split("]")[0]:
            assert "(and 'dsa-model' through KVTIER_CRC32C_BACKEND, the software model of DSA)" in r.stderr


def test_forced_backend_env_unavailable():
    unavailable = [n for (n, ok, _f) in kvtier._C.backends() if not ok]
    if not unavailable:
        pytest.skip("every compiled-in backend is available here")
    r = _py("import kvtier", KVTIER_CRC32C_BACKEND=unavailable[0])
    assert r.returncode != 0
    assert "ValueError" in r.stderr and "not available" in r.stderr


# ------------------------------------------------ fallback module warning

def test_fallback_import_warns_once_with_c_core():
    code = ("import warnings; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    import kvtier.fallback\n"
            "    import kvtier.fallback\n"
            "    import importlib; importlib.import_module('kvtier.fallback')\n"
            "print(len(w), w[0].category.__name__ if w else '-', kvtier.fallback.crc32c(b'123456789'))")
    r = _py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "RuntimeWarning", str(0xE3069283)]


def test_internal_numpy_backend_does_not_warn():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import kvtier\n"
            "print(kvtier.crc32c_using('numpy', b'123456789'))")
    r = _py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(0xE3069283)
