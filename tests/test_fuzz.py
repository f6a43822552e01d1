"""Fuzzing: libFuzzer harnesses (tests/fuzz/, clang -fsanitize=fuzzer,address,
undefined) run for a bounded time, and hypothesis property tests.

- fuzz_crc32c: every CRC32C backend compiled in vs the bit-at-a-time reference,
  whole / chained at a random split / kvt_crc32c_combine, odd alignments and
  data flush against the end of its allocation; a second build also drives
  the software DSA device ("dsa-model") for every length.
- fuzz_xattr_record: the xattr record parsers of the load path
  (kvt_xattr_parse, kvt_id_parse in csrc/block/records.c) on arbitrary records.
- hypothesis: the same differential properties through the Python API for
  each backend, and arbitrary xattr records on stored blocks through both
  block I/O implementations (only the exact 4-byte big-endian CRC32C loads).

``KVTIER_FUZZ_SECONDS`` sets each harness's time (default 10 s).
"""
from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ_DIR = os.path.join(ROOT, "tests", "fuzz")
SECONDS = int(os.environ.get("KVTIER_FUZZ_SECONDS", "10"))
XATTR = "user.vllm.kv_crc32c"


# ---------------------------------------------------------------- reference

def crc32c_ref(data: bytes, crc: int = 0) -> int:
    """Bit-at-a-time CRC-32C, reflected poly 0x82F63B78 (RFC 3720 B.4)."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_reference_check_value():
    assert crc32c_ref(b"123456789") == 0xE3069283
    assert crc32c_ref(bytes(32)) == 0x8A9136AA


# ---------------------------------------------------------------- libFuzzer

def _isal_flags():
    v = subprocess.run(["pkg-config", "--modversion", "libisal"], capture_output=True, text=True)
    if v.returncode != 0:
        return [], []
    cf = subprocess.run(["pkg-config", "--cflags", "libisal"], capture_output=True, text=True).stdout.split()
    libs = subprocess.run(["pkg-config", "--libs", "libisal"], capture_output=True, text=True).stdout.split()
    return ["-DKVTIER_HAVE_ISAL=1", f'-DKVTIER_ISAL_VERSION="{v.stdout.strip()}"', *cf], libs


def build_fuzzer(name: str, sources, extra_flags=(), tag="") -> str:
    """Compile a libFuzzer harness (cached per source content in a temp dir).
    Skips when clang or its libFuzzer runtime is missing."""
    clang = shutil.which("clang")
    if clang is None:
        pytest.skip("clang not installed (Debian: clang, libclang-rt-dev)")
    cflags, libs = _isal_flags()
    h = hashlib.sha256()
    for s in sorted(sources):
        with open(s, "rb") as f:
            h.update(s.encode() + f.read())
    for hdr in glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True):
        with open(hdr, "rb") as f:
            h.update(f.read())
    h.update(" ".join([*extra_flags, *cflags, *libs, tag]).encode())
    out_dir = os.path.join(tempfile.gettempdir(), f"kvtier-fuzz-{h.hexdigest()[:12]}")
    exe = os.path.join(out_dir, name)
    if os.path.exists(exe):
        return exe
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{exe}.{os.getpid()}.tmp"
    cmd = [clang, "-g", "-O1", "-std=gnu11", "-fsanitize=fuzzer,address,undefined",
           "-fno-sanitize-recover=undefined", "-I" + os.path.join(ROOT, "csrc"),
           "-I" + os.path.join(ROOT, "csrc", "block"), "-I" + os.path.join(ROOT, "csrc", "crc32c"), "-I" + os.path.join(ROOT, "csrc", "dsa"),
           *extra_flags, *cflags, "-o", tmp, *sources, *libs, "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        if "libclang_rt.fuzzer" in proc.stderr or "unsupported option '-fsanitize=fuzzer" in proc.stderr:
            pytest.skip(f"clang's libFuzzer runtime is missing: {proc.stderr.strip()[-300:]}")
        raise AssertionError(f"building {name} failed:\n{' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, exe)
    return exe


def run_fuzzer(exe: str, workdir, max_len: int = 4096, seconds: int = SECONDS, seeds=()):
    corpus = os.path.join(os.fspath(workdir), "corpus")
    os.makedirs(corpus, exist_ok=True)
    for i, s in enumerate(seeds):
        with open(os.path.join(corpus, f"seed{i}"), "wb") as f:
            f.write(s)
    proc = subprocess.run(
        # -rss_limit_mb=0: libFuzzer reads its peak RSS with getrusage, which a child inherits from
        # its parent across fork and exec: under scripts/sanitize pytest's own peak (2.4 GB) tripped
        # the 2 GB default at the fuzzer's first input; -malloc_limit_mb keeps the per-malloc limit
        [exe, f"-max_total_time={seconds}", "-timeout=10", f"-max_len={max_len}", "-print_final_stats=1",
         "-rss_limit_mb=0", "-malloc_limit_mb=2048",
         f"-artifact_prefix={os.fspath(workdir)}/", corpus],
        capture_output=True, text=True, timeout=seconds + 120,
        # own (clang) sanitizer runtime: never scripts/sanitize's preloaded gcc one
        env={**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
             "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0"},
    )
    log = proc.stderr
    crashes = glob.glob(os.path.join(os.fspath(workdir), "crash-*")) + glob.glob(
        os.path.join(os.fspath(workdir), "timeout-*")) + glob.glob(os.path.join(os.fspath(workdir), "leak-*"))
    assert proc.returncode == 0 and not crashes, f"fuzzer failed (exit {proc.returncode}), artifacts {crashes}:\n{log[-4000:]}"
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
    runs = int(m.group(1)) if m else 0
    return runs, log


def crc_sources():
    return sorted(glob.glob(os.path.join(ROOT, "csrc", "crc32c", "*.c")))


def test_libfuzzer_crc32c_backends(tmp_path):
    exe = build_fuzzer("fuzz_crc32c", crc_sources() + [os.path.join(FUZZ_DIR, "fuzz_crc32c.c")])
    seeds = [bytes(7) + b"123456789", b"\xff" * 4 + b"\x05\x00\x03" + bytes(range(64))]
    runs, log = run_fuzzer(exe, tmp_path, seeds=seeds)
    assert runs > 1000, log[-2000:]
    tested = re.search(r"fuzz_crc32c: backends:(.*)", log).group(1).split()
    want = [n for (n, ok, _f) in kvtier._C.backends() if ok and not n.startswith("dsa")]
    assert set(want) <= set(tested), (want, tested)
    assert "table" in tested


def test_libfuzzer_crc32c_dsa_model(tmp_path):
    dsa = sorted(glob.glob(os.path.join(ROOT, "csrc", "dsa", "*.c")))
    if not dsa:
        pytest.skip("csrc/dsa not present")
    exe = build_fuzzer("fuzz_crc32c_dsa", crc_sources() + dsa + [os.path.join(ROOT, "csrc", "env.c"),
                                                                  os.path.join(FUZZ_DIR, "fuzz_crc32c.c")],
                       extra_flags=["-DKVT_FUZZ_DSA_MODEL"])
    runs, log = run_fuzzer(exe, tmp_path, max_len=1024, seeds=[bytes(7) + b"123456789"])
    assert runs > 200, log[-2000:]
    assert "dsa-model" in re.search(r"fuzz_crc32c: backends:(.*)", log).group(1).split()


def test_libfuzzer_xattr_record_parser(tmp_path):
    srcs = [os.path.join(ROOT, "csrc", "block", "records.c")]
    exe = build_fuzzer("fuzz_xattr_record", srcs + [os.path.join(FUZZ_DIR, "fuzz_xattr_record.c")])
    seeds = [b"\x00\x00\x12\x34\x56\x78", b"\x01" + bytes([errno.ENODATA]), b"\x01" + bytes([errno.ERANGE]),
             b"\x01" + bytes([errno.EIO]), b"\x00\x00", b"\x00\x00" + bytes(40),
             # the identity record parser: 12 bytes, 8 bytes and 9 bytes after this identity, an error
             b"\x06\x00" + bytes(8) + b"\x12\x34\x56\x78", b"\x06\x00" + bytes(8), b"\x06\x00" + bytes(9),
             b"\x03" + bytes([errno.ENODATA]), b"\x03" + bytes([errno.ERANGE]),
             # 12 bytes of this identity with 1, 4 (damaged) and 5 (another identity) bits flipped
             b"\x1e\x03" + bytes(12), b"\x4e\x07" + bytes(12), b"\x5e\x02" + bytes(12)]
    runs, log = run_fuzzer(exe, tmp_path, max_len=64, seconds=max(3, SECONDS // 3), seeds=seeds)
    assert runs > 1000, log[-2000:]


# ---------------------------------------------------------------- hypothesis: CRC

BACKENDS = kvtier.crc32c_backends()


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=700), seed=st.integers(0, 0xFFFFFFFF), split=st.integers(0, 700))
def test_hypothesis_backend_matches_reference(backend, data, seed, split):
    split = min(split, len(data))
    want = crc32c_ref(data, seed)
    assert kvtier.crc32c_using(backend, data, seed) == want
    a = kvtier.crc32c_using(backend, data[:split], seed)
    assert kvtier.crc32c_using(backend, data[split:], a) == want
    tail = kvtier.crc32c_using(backend, data[split:])
    assert kvtier.crc32c_combine(a, tail, len(data) - split) == want
    # odd alignment inside a larger buffer (memoryview slice: no copy)
    big = bytearray(b"\xa5" * 3 + data + b"\x5a" * 5)
    assert kvtier.crc32c_using(backend, memoryview(big)[3:3 + len(data)], seed) == want


@settings(max_examples=200, deadline=None)
@given(c1=st.integers(0, 0xFFFFFFFF), c2=st.integers(0, 0xFFFFFFFF), n=st.integers(1, 1 << 40))
def test_hypothesis_combine_is_linear_shift(c1, c2, n):
    """combine(c1, c2, n) == combine(c1, 0, n) ^ c2 (crc2 enters by xor) and
    the shift of c1 is GF(2)-linear: properties that hold for every n >= 1,
    including lengths no test could materialise. n = 0 returns c1 (an empty
    B has crc2 = 0)."""
    z = kvtier.crc32c_combine(c1, 0, n)
    assert kvtier.crc32c_combine(c1, c2, n) == z ^ c2
    assert kvtier.crc32c_combine(c1 ^ c2, 0, n) == z ^ kvtier.crc32c_combine(c2, 0, n)
    assert kvtier.crc32c_combine(c1, 0, 0) == c1


# ---------------------------------------------------------------- hypothesis: xattr records

@pytest.fixture(scope="module")
def stored_block(tmp_path_factory):
    d = tmp_path_factory.mktemp("xrec")
    bs = 4096 + 123
    data = np.random.default_rng(3).integers(0, 256, bs, dtype=np.uint8)
    return str(d), data


@pytest.mark.parametrize("backend", ["c", "python"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=st.one_of(st.binary(max_size=40), st.binary(min_size=4, max_size=4)))
def test_hypothesis_xattr_record(backend, stored_block, record):
    """A block with vLLM's record only (no identity record: stored by vLLM with
    checksums): any record but the exact 4-byte big-endian CRC32C is a checksum
    failure (EBADMSG, checksum_failed, removed); the exact one loads."""
    from kvtier import io as kio

    io = kio.for_backend(backend)
    d, data = stored_block
    bs = data.size
    p = os.path.join(d, f"{backend}.bin")
    if not os.path.exists(p):
        io.batch_store_block([p], data, [0], bs, checksum=True)
        os.removexattr(p, "user.kvtier.id")
    good = kvtier.crc32c(data).to_bytes(4, "big")
    os.setxattr(p, XATTR, record)
    out = np.zeros(bs, dtype=np.uint8)
    if record == good:
        io.batch_load_block([p], out, [0], bs, checksum=True)
        assert np.array_equal(out, data)
        return
    with pytest.raises(OSError) as ei:
        io.batch_load_block([p], out, [0], bs, checksum=True)
    assert (ei.value.errno, ei.value.checksum_failed) == (errno.EBADMSG, True)
    assert not os.path.exists(p)


@pytest.mark.parametrize("backend", ["c", "python"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tail=st.one_of(st.binary(max_size=40), st.binary(min_size=4, max_size=4), st.just(b"")),
       flips=st.one_of(st.just(0), st.integers(1, 4), st.integers(5, 16)))
def test_hypothesis_identity_record(backend, stored_block, tail, flips):
    """Any identity record, the block's user.vllm.kv_crc32c good: this block's identity
    (``flips`` = 0) or one within 4 bits of it, followed by anything, loads (its own CRC32C;
    else the record is damaged, or its CRC bytes are, and user.vllm.kv_crc32c verifies the
    bytes: issue #24); a record of another length than 12 loads too (damaged); a
    well-formed 12-byte record of another identity (5 or more bits flipped) is an identity
    failure (EBADMSG, checksum_failed, removed)."""
    from kvtier import io as kio
    from kvtier._blockio import records

    io = kio.for_backend(backend)
    d, data = stored_block
    bs = data.size
    p = os.path.join(d, f"id_{backend}.bin")
    if not os.path.exists(p):
        io.batch_store_block([p], data, [0], bs, checksum=True)
    ident = int.from_bytes(records.block_identity(p, bs), "big")
    for k in range(flips):  # distinct bits (29 is odd)
        ident ^= 1 << (k * 29 % 64)
    record = ident.to_bytes(8, "big") + tail
    os.setxattr(p, "user.kvtier.id", record)
    out = np.zeros(bs, dtype=np.uint8)
    if flips <= records.ID_DAMAGED_BITS or len(record) != records.ID_REC_LEN:
        io.batch_load_block([p], out, [0], bs, checksum=True)
        assert np.array_equal(out, data)
        return
    with pytest.raises(OSError) as ei:
        io.batch_load_block([p], out, [0], bs, checksum=True)
    assert (ei.value.errno, ei.value.checksum_failed, ei.value.condemned) == (errno.EBADMSG, True, "identity")
    assert not os.path.exists(p)


# ---------------------------------------------------------------- hypothesis: identity

@pytest.fixture(scope="module")
def id_tree(tmp_path_factory):
    """Directories a and b nested three deep (a, a/a, a/b, ..., b/b/b) under a fresh dir."""
    d = str(tmp_path_factory.mktemp("idtree"))
    for x in "ab":
        for y in "ab":
            for z in "ab":
                os.makedirs(os.path.join(d, x, y, z), exist_ok=True)
    return d


@pytest.mark.parametrize("backend", ["c", "python"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["a", "b", ".", "", ".."]), max_size=12), absolute=st.booleans())
def test_hypothesis_identity_is_lexical_normalisation(backend, id_tree, ops, absolute):
    """The identity a store sets (csrc/block/records.c kvt_block_identity, its own component
    scanner; the fallback's records.block_identity) is that of the file's clean absolute
    path, whatever the spelling: random component lists of a, b, ".", "" (a "//") and ".."
    from <tree>/a/b (absolute) or relative to it as the working directory, ".." popping
    past the relative path's start into it; the C core's record equals
    records.block_identity of the spelling and of the clean path."""
    from kvtier import io as kio
    from kvtier._blockio import records

    io = kio.for_backend(backend)
    stack, kept = ["a", "b"], []
    for op in ops:  # keep the path inside the tree (depth 0..3), as the kernel resolves it
        if op == ".." and not stack or op in ("a", "b") and len(stack) == 3:
            continue
        if op == "..":
            stack.pop()
        elif op in ("a", "b"):
            stack.append(op)
        kept.append(op)
    while not absolute and kept[:1] == [""]:  # a leading "/" would make it absolute
        kept.pop(0)
    rel = "/".join(kept + ["f.bin"])
    clean = os.path.join(id_tree, *stack, "f.bin")
    path = os.path.join(id_tree, "a", "b") + "/" + rel if absolute else rel
    data = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    cwd = os.getcwd()
    os.chdir(os.path.join(id_tree, "a", "b"))
    try:
        io.batch_store_block([path], data, [0], 4096, checksum=True)
        rec = os.getxattr(clean, "user.kvtier.id")[:8]
        assert rec == records.block_identity(path, 4096) == records.block_identity(clean, 4096), (path, clean)
    finally:
        os.chdir(cwd)
        if os.path.exists(clean):
            os.unlink(clean)
