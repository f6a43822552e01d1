"""Intel DSA offload: C-level tests on the software device model (tests/c/test_dsa.c,
built and run here), discovery from fake sysfs trees, the "dsa-model" backend
through Python, and `kvtier.dsa.describe()` on this (DSA-less) host."""
import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier import _C
from kvtier import dsa

ROOT = Path(__file__).resolve().parent.parent
CHECK = 0xE3069283  # CRC32C("123456789")

try:
    import google_crc32c as _oracle

    def oracle(data, value=0):
        return _oracle.extend(value, bytes(data))
except ImportError:  # pragma: no cover
    from kvtier import fallback as _fb

    def oracle(data, value=0):
        return _fb.crc32c(data, value)


def _cc():
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def _build_and_run(tmp_path, name, extra):
    srcs = sorted(str(p) for p in (ROOT / "csrc/dsa").glob("*.c")) + sorted(
        str(p) for p in (ROOT / "csrc/crc32c").glob("*.c")) + [str(ROOT / "csrc/env.c")]
    exe = tmp_path / name
    cmd = [_cc(), "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
           f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/crc32c", f"-I{ROOT}/csrc/dsa", *extra,
           "-o", str(exe), str(ROOT / "tests/c/test_dsa.c"), *srcs, "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 and any(f.startswith("-fsanitize") for f in extra) and "sanitize" in r.stderr:
        pytest.skip(f"sanitizer runtime unavailable: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=240, env=env)
    m = re.search(r"(\d+) passed, (\d+) failed", r.stdout)
    assert m, r.stdout + r.stderr
    assert int(m.group(2)) == 0 and r.returncode == 0, r.stdout + r.stderr
    assert int(m.group(1)) >= 300  # every check ran
    return r


def test_c_dsa_asan_ubsan(tmp_path):
    """Layout asserts, model semantics, resume, errors, gate, discovery — under ASan+UBSan."""
    _build_and_run(tmp_path, "test_dsa_asan", ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"])


@pytest.mark.slow
def test_c_dsa_tsan(tmp_path):
    """The same program under ThreadSanitizer: model thread vs submitter ordering."""
    r = _build_and_run(tmp_path, "test_dsa_tsan", ["-fsanitize=thread", "-Wno-error=tsan"])
    assert "WARNING: ThreadSanitizer" not in r.stderr, r.stderr


# --------------------------------------------------------------------------
# Discovery from fake sysfs trees
# --------------------------------------------------------------------------

def _fake_tree(tmp_path, wqs, gen_cap="0x40915f0107"):
    sysroot, devroot = tmp_path / "sys", tmp_path / "dev"
    devices = sysroot / "bus/dsa/devices"
    (devices / "dsa0").mkdir(parents=True)
    (devices / "dsa0/gen_cap").write_text(gen_cap + "\n")
    (devroot / "dsa").mkdir(parents=True)
    for name, attrs, node in wqs:
        d = devices / name
        d.mkdir()
        base = {"state": "enabled", "type": "user", "mode": "dedicated", "size": "16",
                "max_transfer_size": "2097152", "block_on_fault": "0"}
        base.update(attrs)
        for k, v in base.items():
            (d / k).write_text(v + "\n")
        if node:
            (devroot / "dsa" / name).touch(mode=0o600)
    return str(sysroot), str(devroot)


def test_discovery_picks_and_explains(tmp_path):
    sysroot, devroot = _fake_tree(tmp_path, [
        ("wq0.0", {"mode": "dedicated"}, True),
        ("wq0.1", {"mode": "shared", "size": "64", "block_on_fault": "0"}, True),
        ("wq0.2", {"mode": "shared", "size": "32", "block_on_fault": "1"}, True),
        ("wq0.3", {"state": "disabled"}, True),
        ("wq0.4", {"type": "kernel"}, True),
        ("wq0.5", {"mode": "shared"}, False),
    ])
    d = dsa.discover(sysroot, devroot)
    assert d["devices_dir"] == sysroot + "/bus/dsa/devices" and d["devices_dir_present"]
    by = {w["name"]: w for w in d["wqs"]}
    assert sorted(by) == ["wq0.0", "wq0.1", "wq0.2", "wq0.3", "wq0.4", "wq0.5"]
    assert d["chosen"] == "wq0.2"  # shared and block_on_fault=1
    assert by["wq0.0"]["usable"] and by["wq0.0"]["mode"] == "dedicated" and by["wq0.0"]["size"] == 16
    assert by["wq0.0"]["gen_cap"] == 0x40915F0107 and by["wq0.0"]["device"] == "dsa0"
    assert by["wq0.0"]["path"] == devroot + "/dsa/wq0.0"
    assert by["wq0.2"]["block_on_fault"] is True and by["wq0.1"]["block_on_fault"] is False
    assert "state=disabled" in by["wq0.3"]["reason"] and not by["wq0.3"]["usable"]
    assert "type=kernel" in by["wq0.4"]["reason"] and not by["wq0.4"]["usable"]
    assert "missing" in by["wq0.5"]["reason"] and not by["wq0.5"]["usable"]
    # explicit WQ by argument and by environment (in a subprocess)
    assert dsa.discover(sysroot, devroot, wq="wq0.0")["chosen"] == "wq0.0"
    code = "from kvtier import dsa; d = dsa.discover(); print(d['chosen'])"
    env = dict(os.environ, KVTIER_DSA_SYSFS=sysroot, KVTIER_DSA_DEV=devroot, KVTIER_DSA_WQ="wq0.1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "wq0.1"


def test_discovery_bof_and_dedicated_only(tmp_path):
    sysroot, devroot = _fake_tree(tmp_path, [
        ("wq1.0", {"mode": "dedicated", "block_on_fault": "0", "size": "8"}, True),
        ("wq1.1", {"mode": "dedicated", "block_on_fault": "1", "size": "8"}, True),
    ])
    (Path(sysroot) / "bus/dsa/devices/dsa1").mkdir()
    (Path(sysroot) / "bus/dsa/devices/dsa1/gen_cap").write_text("0x1\n")
    d = dsa.discover(sysroot, devroot)
    assert d["chosen"] == "wq1.1"
    assert {w["name"]: w["gen_cap"] for w in d["wqs"]} == {"wq1.0": 1, "wq1.1": 1}


def test_discovery_nothing_usable_and_absent(tmp_path):
    sysroot, devroot = _fake_tree(tmp_path, [("wq0.0", {"state": "disabled"}, True)])
    d = dsa.discover(sysroot, devroot)
    assert d["chosen"] is None and d["wqs"][0]["reason"] == "state=disabled (not enabled)"
    d = dsa.discover(str(tmp_path / "nope"), devroot)
    assert d["devices_dir_present"] is False and d["wqs"] == [] and d["chosen"] is None


def test_describe_fake_tree_not_usable(tmp_path):
    sysroot, devroot = _fake_tree(tmp_path, [("wq0.0", {"type": "kernel"}, True),
                                             ("wq0.1", {"state": "disabled"}, True)])
    code = "from kvtier import dsa; print(dsa.describe())"
    env = dict(os.environ, KVTIER_DSA_SYSFS=sysroot, KVTIER_DSA_DEV=devroot)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("WQ found but not usable: wq0.0: type=kernel (not a user WQ); "
                                  "wq0.1: state=disabled (not enabled)")


# --------------------------------------------------------------------------
# This host: no DSA
# --------------------------------------------------------------------------

@pytest.mark.skipif(os.path.exists("/sys/bus/dsa/devices"), reason="host has DSA devices")
def test_describe_says_no_dsa_here():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    code = "from kvtier import dsa; print(dsa.describe())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "no DSA devices found (/sys/bus/dsa/devices absent)"
    # and the dsa backend is listed but unavailable; forcing it fails the import loudly
    assert ("dsa", False) in [(n, ok) for n, ok, _ in _C.backends()]
    env["KVTIER_CRC32C_BACKEND"] = "dsa"
    r = subprocess.run([sys.executable, "-c", "import kvtier"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "KVTIER_CRC32C_BACKEND=dsa" in r.stderr and "not available" in r.stderr


# --------------------------------------------------------------------------
# The dsa-model backend through Python
# --------------------------------------------------------------------------

def test_backend_env_selects_model_lazily():
    code = r"""
import json, os, kvtier
from kvtier import dsa
data = bytes((i * 7 + 3) & 0xFF for i in range(3 << 20))
out = {
  "backend": kvtier.crc32c_backend,
  "check": kvtier.crc32c(b"123456789"),
  "big": kvtier.crc32c(data),
  "chained": kvtier.crc32c(data[100000:], kvtier.crc32c(data[:100000])),
  "counters": dsa.counters(),
  "describe": dsa.describe(),
}
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_CRC32C_BACKEND"] = "dsa-model"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    data = bytes((i * 7 + 3) & 0xFF for i in range(3 << 20))
    assert out["backend"] == "dsa-model"
    assert out["check"] == CHECK
    assert out["big"] == out["chained"] == oracle(data)
    c = out["counters"]
    assert c["backend"] == "dsa-model"
    # self-check (1 MiB CRCGEN in 1 descriptor, check value, 1 MiB COPY_CRC) + 3 MiB in 2 MiB chunks
    # + 100000 B and 3045728 B chained; the 9-byte check value stayed on the CPU (gate)
    assert c["completed_on_device"] == c["descriptors_submitted"] == 3 + 2 + 1 + 2
    assert c["below_min_size"] == 1 and c["cpu_redo_total"] == 0
    assert "enabled: dsa-model (software model, not hardware" in out["describe"]
    assert "no DSA devices found" in out["describe"]


def test_env_model_is_listed_not_selected():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_DSA"] = "model"
    code = "import kvtier; print(kvtier.crc32c_backend, kvtier.crc32c_backends())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    backend, _, rest = r.stdout.partition(" ")
    assert backend not in ("dsa", "dsa-model")
    assert "'dsa-model'" in rest and "'dsa'," not in rest


@pytest.fixture
def model():
    assert dsa.enable_model(size=8, max_transfer_size=64 * 1024)
    dsa.configure("dsa-model", min_size=0)
    dsa.reset_counters("dsa-model")
    yield
    dsa.disable("dsa-model")


def _payload(n, seed=1):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_model_values_and_copy(model):
    assert kvtier.crc32c_using("dsa-model", b"123456789") == CHECK
    data = _payload(300_001)
    assert kvtier.crc32c_using("dsa-model", data, 0xFFFFFFFF) == oracle(data, 0xFFFFFFFF)
    dst = bytearray(len(data))
    assert dsa.copy_crc(dst, data, 0, backend="dsa-model") == oracle(data)
    assert bytes(dst) == data
    c = dsa.counters("dsa-model")
    assert c["completed_on_device"] == c["descriptors_submitted"] == 1 + 5 + 5
    assert c["bytes_on_device"] == 9 + 2 * len(data)
    assert dsa.model_stats()["dropped"] == 0


@pytest.mark.parametrize("kind,param,status", [
    ("bof_flag", 0, "invalid_flags"),
    ("cc_flag", 0, "invalid_flags"),
    ("stale_reserved", 0, "nozero_reserve"),
    ("xfer_erange", 4096, "xfer_erange"),
    ("reject_all", 0, "invalid_flags"),
    ("reject_all", 0x20, "hw_err1"),  # DSA_COMP_HW_ERR1
])
def test_model_injected_errors_redone_on_cpu(model, kind, param, status):
    data = _payload(50_000, seed=len(kind))
    dsa.inject(kind, 1, param)
    assert kvtier.crc32c_using("dsa-model", data) == oracle(data)
    c = dsa.counters("dsa-model")
    assert c["cpu_redo_by_status"] == {status: 1}
    assert c["cpu_redo_total"] == 1 and c["completed_on_device"] == 0


def test_model_page_fault_resume_copy(model):
    data = _payload(200_000, seed=9)
    dst = bytearray(len(data))
    dsa.inject("page_fault", 2, 40_000)  # two faults in the first 64 KiB descriptor's retries
    assert dsa.copy_crc(dst, data, 7, backend="dsa-model") == oracle(data, 7)
    assert bytes(dst) == data
    c = dsa.counters("dsa-model")
    assert c["page_fault_resumes"] == 2 and c["cpu_redo_total"] == 0
    assert dsa.model_stats()["faults_injected"] == 2


def test_model_enqcmd_retry_shared():
    assert dsa.enable_model(shared=True, size=4)
    try:
        dsa.configure("dsa-model", min_size=0)
        dsa.reset_counters("dsa-model")
        data = _payload(100_000, seed=3)
        dsa.inject("enqcmd_retry", 3)
        assert kvtier.crc32c_using("dsa-model", data) == oracle(data)
        c = dsa.counters("dsa-model")
        assert c["enqcmd_retries"] == 3 and c["completed_on_device"] == 1
        assert dsa.status("dsa-model")["wq"]["mode"] == "shared"
    finally:
        dsa.disable("dsa-model")


def test_model_min_size_gate(model):
    dsa.configure("dsa-model", min_size=16384)
    small, big = _payload(16383), _payload(16384)
    assert kvtier.crc32c_using("dsa-model", small) == oracle(small)
    c = dsa.counters("dsa-model")
    assert c["descriptors_submitted"] == 0 and c["below_min_size"] == 1
    assert kvtier.crc32c_using("dsa-model", big) == oracle(big)
    assert dsa.counters("dsa-model")["descriptors_submitted"] == 1


def test_model_reject_everything_fails_selfcheck():
    try:
        assert dsa.enable_model(reject_status=0x11) is False
        st = dsa.status("dsa-model")
        assert st["enabled"] is False
        sc = st["selfcheck"]
        assert sc["ran"] and not sc["crcgen_on_device"] and not sc["copy_on_device"]
        assert sc["crcgen_match"] and sc["copy_match"]  # the CPU redo gave right answers
        assert sc["crcgen_status"] == 0x11
        assert "not completed on the device" in st["reason"]
        assert st["counters"]["cpu_redo_by_status"] == {"invalid_flags": 3}
        assert "dsa-model" not in kvtier.crc32c_backends()
        with pytest.raises(ValueError, match=r"'dsa-model' is not enabled \(explicit only: "
                           r"KVTIER_DSA=model or KVTIER_CRC32C_BACKEND=dsa-model\)"):
            kvtier.crc32c_using("dsa-model", b"x")
        assert dsa.describe().splitlines()[-1].startswith("dsa-model not enabled: self-check failed")
    finally:
        dsa.disable("dsa-model")


def test_bad_arguments(model):
    with pytest.raises(ValueError):
        dsa.enable_model(size=0)
    with pytest.raises(ValueError):
        dsa.enable_model(max_transfer_size=1 << 32)
    with pytest.raises(ValueError, match="unknown fault kind"):
        dsa.inject("nope")
    with pytest.raises(ValueError, match="'dsa' or 'dsa-model'"):
        dsa.status("dsa0")
    with pytest.raises(ValueError, match="wait must be"):
        dsa.configure("dsa-model", wait="busy")
    with pytest.raises(ValueError, match="dst has 3 bytes, src 4"):
        dsa.copy_crc(bytearray(3), b"abcd", backend="dsa-model")
    with pytest.raises(BufferError):
        dsa.copy_crc(b"abcd", b"abcd", backend="dsa-model")  # read-only dst
    with pytest.raises(LookupError):
        _C.dsa_configure("dsa", min_size=1)  # no device engine on this host
    for bad in (0, -1.0, float("nan"), 1e9):
        with pytest.raises(ValueError, match="timeout must be"):
            dsa.configure("dsa-model", timeout=bad)
    with pytest.raises(TypeError):
        dsa.configure("dsa-model", timeout="1s")
    assert dsa.status("dsa-model")["timeout"] == 1.0  # default, unchanged by the rejects


def test_copy_crc_rejects_overlap(model):
    buf = bytearray(_payload(100_000, seed=11))
    before = bytes(buf)
    with pytest.raises(ValueError, match=r"dst and src overlap \(dst at src\+0, 100000 bytes\)"):
        dsa.copy_crc(buf, buf, backend="dsa-model")
    mv = memoryview(buf)
    with pytest.raises(ValueError, match=r"dst and src overlap \(dst at src\+100, 50000 bytes\)"):
        dsa.copy_crc(mv[100:50_100], mv[:50_000], backend="dsa-model")
    with pytest.raises(ValueError, match=r"dst and src overlap \(dst at src-1, 50000 bytes\)"):
        dsa.copy_crc(mv[0:50_000], mv[1:50_001], backend="dsa-model")
    assert bytes(buf) == before  # nothing written
    # adjacent (not overlapping) halves are fine
    assert dsa.copy_crc(mv[50_000:], mv[:50_000], backend="dsa-model") == oracle(before[:50_000])
    assert bytes(buf) == before[:50_000] * 2
    assert dsa.counters("dsa-model")["descriptors_submitted"] == 1


def test_model_hang_times_out_and_disables(model):
    """A WQ that stops completing descriptors: the CRC comes back right
    within the timeout (CPU), the timeout is counted, the engine says why it
    is disabled, and later calls go straight to the CPU."""
    import time

    dsa.configure("dsa-model", timeout=0.2)
    assert dsa.status("dsa-model")["timeout"] == pytest.approx(0.2)
    data = _payload(4 << 20, seed=12)
    dsa.inject("hang", 1)
    t0 = time.monotonic()
    assert kvtier.crc32c_using("dsa-model", data) == oracle(data)
    dt = time.monotonic() - t0
    assert 0.2 <= dt < 0.2 + 2.0
    c = dsa.counters("dsa-model")
    assert c["timeouts"] == 1 and c["cpu_redo_total"] == 1
    assert c["descriptors_submitted"] == 1 and c["completed_on_device"] == 0
    assert dsa.model_stats()["hung"] == 1
    st = dsa.status("dsa-model")
    assert st["enabled"] is False
    assert st["reason"].startswith("dsa-model disabled: device stopped completing descriptors")
    assert "device stopped completing descriptors" in st["engine_reason"]
    assert dsa.describe().splitlines()[-1] == st["reason"]
    assert "dsa-model" not in kvtier.crc32c_backends()
    assert ("dsa-model", False) in [(n, ok) for n, ok, _ in _C.backends()]
    # the engine stays installed but unused: CPU, immediately, nothing submitted
    t0 = time.monotonic()
    assert _C.dsa_copy_crc("dsa-model", bytearray(len(data)), data) == oracle(data)
    assert time.monotonic() - t0 < 0.2
    assert dsa.counters("dsa-model")["descriptors_submitted"] == 1


# --------------------------------------------------------------------------
# Block I/O with checksums on the dsa-model backend
# --------------------------------------------------------------------------

_TIER_CODE = r"""
import errno, json, os, sys
import numpy as np
import kvtier
from kvtier import dsa
from kvtier.io import for_backend

root = sys.argv[1]
io = for_backend("c")
bs, n = 3 * 256 * 1024 + 4096, 4  # 4 chunks of the block I/O core per block
view = np.random.default_rng(5).integers(0, 256, n * bs, dtype=np.uint8)
offs = [i * bs for i in range(n)]
paths = [os.path.join(root, f"b{i}.bin") for i in range(n)]
out = {"backend": kvtier.crc32c_backend}
dsa.reset_counters("dsa-model")
io.batch_store_block(paths, view, offs, bs, use_o_direct=False, checksum=True)
out["store"] = dsa.counters()
out["xattrs"] = [os.getxattr(p, "user.vllm.kv_crc32c").hex() for p in paths]
dsa.reset_counters("dsa-model")
got = np.zeros_like(view)
dsa.inject("page_fault", 1, 1000)
io.batch_load_block(paths, got, offs, bs, use_o_direct=False, checksum=True)
out["load_equal"] = bool(np.array_equal(got, view))
out["load"] = dsa.counters()
# corrupt one byte of block 2 (xattr kept) and load again
with open(paths[2], "r+b") as f:
    f.seek(bs // 2)
    b = f.read(1)
    f.seek(bs // 2)
    f.write(bytes([b[0] ^ 0x01]))
dsa.reset_counters("dsa-model")
try:
    io.batch_load_block(paths, got, offs, bs, use_o_direct=False, checksum=True)
    out["error"] = None
except OSError as e:
    out["error"] = [e.errno, e.num_succeeded, e.checksum_failed, os.path.basename(e.filename)]
out["exists"] = [os.path.exists(p) for p in paths]
out["corrupt_load"] = dsa.counters()
print(json.dumps(out))
"""


def _tier_on_dsa_model(tmp_path, code, seed, timeout, **env_extra):
    """Run a tier script on dsa-model in a fresh interpreter (skips where
    user xattrs are unsupported). Returns (its JSON output, the view of the
    4 blocks of 3 x 256 KiB + 4 KiB it stored from `seed`, block size)."""
    import json

    import numpy as np

    from kvtier.io import probe_xattr

    if not probe_xattr(str(tmp_path)):
        pytest.skip(f"user xattrs not supported under {tmp_path}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_CRC32C_BACKEND"] = "dsa-model"
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    bs, n = 3 * 256 * 1024 + 4096, 4
    return json.loads(r.stdout), np.random.default_rng(seed).integers(0, 256, n * bs, dtype=np.uint8), bs


def test_tier_round_trip_on_dsa_model(tmp_path):
    out, view, bs = _tier_on_dsa_model(tmp_path, _TIER_CODE, 5, 180)
    n = len(view) // bs
    assert out["backend"] == "dsa-model"
    # the records are the standard CRC32C, big-endian
    assert out["xattrs"] == [oracle(view[i * bs:(i + 1) * bs]).to_bytes(4, "big").hex() for i in range(n)]
    # every chunk (3 x 256 KiB + 4 KiB, all above the 16 KiB gate but the last) went to the device
    st = out["store"]
    assert st["completed_on_device"] == st["descriptors_submitted"] == n * 3
    assert st["below_min_size"] == n and st["cpu_redo_total"] == 0
    assert out["load_equal"] is True
    ld = out["load"]
    assert ld["completed_on_device"] == n * 3 and ld["page_fault_resumes"] == 1 and ld["cpu_redo_total"] == 0
    # ... as COPY_CRC ops: the commit copy into the caller's buffer is the device's
    assert ld["commit_ops"] == n * 3 and ld["commit_bytes_on_device"] == n * 3 * 256 * 1024
    assert ld["commit_bytes_cpu"] == 0 and st["commit_ops"] == 0  # a store copies nothing
    assert out["error"] == [errno.EBADMSG, 2, True, "b2.bin"]
    assert out["exists"] == [True, True, False, True]
    assert out["corrupt_load"]["completed_on_device"] >= 3  # block 2 verified on the device


_HANG_TIER_CODE = r"""
import json, os, sys, time
import numpy as np
import kvtier
from kvtier import dsa
from kvtier.io import for_backend

root = sys.argv[1]
io = for_backend("c")
bs, n = 3 * 256 * 1024 + 4096, 4
view = np.random.default_rng(6).integers(0, 256, n * bs, dtype=np.uint8)
offs = [i * bs for i in range(n)]
paths = [os.path.join(root, f"b{i}.bin") for i in range(n)]
out = {"backend": kvtier.crc32c_backend, "timeout": dsa.status("dsa-model")["timeout"]}
dsa.reset_counters("dsa-model")
dsa.inject("hang", -1)  # the WQ stops completing anything
t0 = time.monotonic()
io.batch_store_block(paths, view, offs, bs, use_o_direct=False, checksum=True)
out["store_s"] = time.monotonic() - t0
out["xattrs"] = [os.getxattr(p, "user.vllm.kv_crc32c").hex() for p in paths]
got = np.zeros_like(view)
t0 = time.monotonic()
io.batch_load_block(paths, got, offs, bs, use_o_direct=False, checksum=True)
out["load_s"] = time.monotonic() - t0
out["load_equal"] = bool(np.array_equal(got, view))
out["crc"] = kvtier.crc32c(view[:bs])  # active backend is still dsa-model: CPU inside
out["counters"] = dsa.counters("dsa-model")
out["status"] = dsa.status("dsa-model")
out["hung"] = dsa.model_stats()["hung"]
out["describe"] = dsa.describe()
print(json.dumps(out))
"""


def test_tier_store_load_after_device_hang(tmp_path):
    """Checksummed store/load on dsa-model when the device stops completing
    descriptors: one timeout (KVTIER_DSA_TIMEOUT_MS), then the CPU; the
    records are right and the data round-trips."""
    out, view, bs = _tier_on_dsa_model(tmp_path, _HANG_TIER_CODE, 6, 120, KVTIER_DSA_TIMEOUT_MS="300")
    n = len(view) // bs
    assert out["backend"] == "dsa-model" and out["timeout"] == pytest.approx(0.3)
    assert out["xattrs"] == [oracle(view[i * bs:(i + 1) * bs]).to_bytes(4, "big").hex() for i in range(n)]
    assert out["load_equal"] is True
    assert out["crc"] == oracle(view[:bs])
    c = out["counters"]
    assert c["timeouts"] == 1 and c["descriptors_submitted"] == 1 and c["completed_on_device"] == 0
    assert out["hung"] == 1
    assert 0.3 <= out["store_s"] < 0.3 + 5 and out["load_s"] < 5
    assert out["status"]["enabled"] is False
    assert "device stopped completing descriptors" in out["status"]["reason"]
    assert "dsa-model disabled: device stopped completing descriptors" in out["describe"]


_COMMIT_CODE = r"""
import json, os, sys
import numpy as np
import kvtier
from kvtier import dsa
from kvtier.io import JobState, for_backend

root, mode = sys.argv[1], os.environ["COMMIT_MODE"]
io = for_backend("c")
bs, n = 3 * 256 * 1024 + 4096, 4  # 3 pieces of 256 KiB (COPY_CRC) + 4 KiB (below the gate) per block
view = np.random.default_rng(7).integers(0, 256, n * bs, dtype=np.uint8)
offs = [i * bs for i in range(n)]
paths = [os.path.join(root, f"b{i}.bin") for i in range(n)]
io.batch_store_block(paths, view, offs, bs, use_o_direct=False, checksum=True)
out = {"backend": kvtier.crc32c_backend}

def load(tag, job_state):
    dsa.reset_counters("dsa-model")
    got = np.zeros_like(view)
    js = JobState() if job_state else None
    io.batch_load_block(paths, got, offs, bs, use_o_direct=False, checksum=True, job_state=js)
    out[tag] = {"equal": bool(np.array_equal(got, view)), "blocks": js.blocks_done if js else None,
                "c": dsa.counters("dsa-model")}

if mode == "mixed":
    load("device", True)
    load("device_no_deadline", False)
    dsa.inject("reject_all", 2, 0)  # the first two COPY_CRC descriptors refused: redone on the CPU
    load("refused", True)
    dsa.inject("page_fault", 1, 1000)  # a write fault on the destination, resumed on the device
    load("fault", True)
else:  # the device stops completing descriptors
    dsa.inject("hang", -1)
    load("hang", True)
    out["enabled"] = dsa.status("dsa-model")["enabled"]
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["mixed", "hang"])
def test_load_commit_copy_is_copy_crc_and_counts_only_device_bytes(tmp_path, mode):
    """With dsa-model active, a checksummed load's commit copy (private memory ->
    the caller's buffer, csrc/block/engine.c commit_piece) is one COPY_CRC op per piece:
    commit_bytes_on_device counts only bytes whose completion record said the device
    did them; refused descriptors and a timed-out one are commit_bytes_cpu, and the
    bytes are right either way (under a job state too: every block counted)."""
    out, view, bs = _tier_on_dsa_model(tmp_path, _COMMIT_CODE, 7, 120, COMMIT_MODE=mode,
                                       KVTIER_DSA_TIMEOUT_MS="300")
    n, piece = len(view) // bs, 256 * 1024
    assert out["backend"] == "dsa-model"
    if mode == "mixed":
        for tag in ("device", "device_no_deadline", "refused", "fault"):
            r = out[tag]
            assert r["equal"] is True and r["blocks"] in (n, None), tag
            c = r["c"]
            assert c["commit_ops"] == 3 * n, tag  # the 4 KiB tail piece stays on the CPU
            assert c["commit_bytes_on_device"] + c["commit_bytes_cpu"] == 3 * n * piece, tag
            assert c["below_min_size"] == n, tag
        assert out["device"]["c"]["commit_bytes_on_device"] == 3 * n * piece
        assert out["device"]["c"]["completed_on_device"] == 3 * n and out["device"]["c"]["cpu_redo_total"] == 0
        r = out["refused"]["c"]
        assert (r["commit_bytes_cpu"], r["commit_bytes_on_device"]) == (2 * piece, (3 * n - 2) * piece)
        assert r["cpu_redo_total"] == 2 and r["completed_on_device"] == 3 * n - 2
        f = out["fault"]["c"]
        assert f["page_fault_resumes"] == 1 and f["commit_bytes_on_device"] == 3 * n * piece
    else:
        r = out["hang"]
        assert r["equal"] is True and r["blocks"] == n
        c = r["c"]
        assert c["timeouts"] == 1 and c["completed_on_device"] == 0
        # the timed-out op is CPU bytes; then the engine is off and the commits are plain copies
        assert (c["commit_ops"], c["commit_bytes_on_device"], c["commit_bytes_cpu"]) == (1, 0, piece)
        assert out["enabled"] is False


_GIL_CODE = r"""
import sys, threading, time
ticks = 0
stop = False
gap = 0.0  # the longest the counting thread went without running, once measuring
measuring = False
def count():
    global ticks, gap
    last = time.monotonic()
    while not stop:
        ticks += 1
        now = time.monotonic()
        if measuring and now - last > gap:
            gap = now - last
        last = now
t = threading.Thread(target=count)
t.start()
time.sleep(0.05)
r0 = ticks
time.sleep(0.2)  # the counting rate with the GIL free
rate = (ticks - r0) / 0.2
measuring = True
if sys.argv[1] == "import":
    t0, n0 = time.monotonic(), ticks
    import kvtier  # KVTIER_CRC32C_BACKEND=dsa-model: the model's self-check runs in the import
    dt, dn = time.monotonic() - t0, ticks - n0
    assert kvtier.crc32c_backend == "dsa-model"
else:
    from kvtier import _C  # KVTIER_DSA=model: the self-check runs in the first backends(),
    t0, n0 = time.monotonic(), ticks  # timed alone (the package import holds the GIL, rightly)
    b = _C.backends()
    dt, dn = time.monotonic() - t0, ticks - n0
    assert ("dsa-model", True) in [(n, ok) for n, ok, _ in b]
stop = True
t.join()
print(dt, dn, rate, gap)
"""


@pytest.mark.parametrize("how", ["import", "backends"])
def test_selfcheck_releases_the_gil(how):
    """The model's enable-time self-check (3 descriptors x 0.2 s latency) runs
    without the GIL: another Python thread keeps counting meanwhile."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_DSA_MODEL_LATENCY_NS"] = "200000000"
    if how == "import":
        env["KVTIER_CRC32C_BACKEND"] = "dsa-model"
    else:
        env["KVTIER_DSA"] = "model"
    r = subprocess.run([sys.executable, "-c", _GIL_CODE, how], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    dt, dn, rate, gap = (float(x) for x in r.stdout.split())
    assert dt >= 0.5  # the self-check really took that long
    # With the GIL held through the self-check the other thread stops for all of
    # it (>= 0.6 s; its count 0.05-0.08 of its rate, measured without the fix);
    # released, it never waits long (a switch interval, a busy host's scheduling)
    # and counts ~0.95 of its rate on an idle host. On a busy host the rate alone
    # varies (0.19 seen under a concurrent test suite): either tells a release.
    assert gap < 0.3 or dn >= 0.3 * rate * dt, r.stdout


def test_model_concurrent_threads_small_wq(tmp_path):
    """4 threads share a 2-slot dedicated WQ: never more than 2 in flight (the
    model counts a MOVDIR64B to a full dedicated WQ as dropped), all right."""
    from concurrent.futures import ThreadPoolExecutor

    assert dsa.enable_model(size=2, max_transfer_size=32 * 1024)
    try:
        dsa.reset_counters("dsa-model")
        bufs = [_payload(200_000 + 4096 * i, seed=i) for i in range(8)]
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda b: kvtier.crc32c_using("dsa-model", b), bufs * 4))
        assert got == [oracle(b) for b in bufs] * 4
        c = dsa.counters("dsa-model")
        assert c["cpu_redo_total"] == 0 and c["completed_on_device"] == c["descriptors_submitted"] > 8 * 4
        assert dsa.model_stats()["dropped"] == 0
    finally:
        dsa.disable("dsa-model")


def test_fork_child_computes_on_cpu():
    code = r"""
import os, sys, kvtier
from kvtier import dsa
data = bytes(range(256)) * 4096
want = kvtier.crc32c_using("table", data)
assert kvtier.crc32c(data) == want
pid = os.fork()
if pid == 0:
    ok = kvtier.crc32c(data) == want and not dsa.status("dsa-model")["enabled"]
    ok = ok and "fork" in dsa.status("dsa-model")["reason"]
    os._exit(0 if ok else 1)
_, st = os.waitpid(pid, 0)
assert kvtier.crc32c(data) == want and dsa.status("dsa-model")["enabled"]
sys.exit(os.waitstatus_to_exitcode(st))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_CRC32C_BACKEND"] = "dsa-model"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
