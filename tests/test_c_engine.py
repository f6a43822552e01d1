"""C-level tests of the CRC32C engine (tests/c/test_crc32c.c), built with
tests/c/Makefile and run from pytest: native with ISA-L (when pkg-config finds
libisal), native without ISA-L, ISA-L with a 13-byte chunk (exercises the
int-length split of isal.c on every length), native under ASan+UBSan, and an
aarch64 cross build run under qemu-user so the armv8 backend really runs.

Each program compares every backend compiled in (and the non-dispatched
variants) against the bit-at-a-time reference and prints "N passed, N failed".
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CDIR = HERE / "c"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
AARCH64_SYSROOT = "/usr/aarch64-linux-gnu"


def _have_isal() -> bool:
    pc = shutil.which("pkg-config")
    return pc is not None and subprocess.run([pc, "--exists", "libisal"]).returncode == 0


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("make or a C compiler is missing")
    return tmp_path_factory.mktemp("crc32c-c")


def _make(build_dir: Path, target: str):
    r = subprocess.run(["make", "-s", "-C", str(CDIR), f"O={build_dir}", f"{build_dir}/{target}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"build of {target} failed:\n{r.stdout}\n{r.stderr}"
    return build_dir / target


def _run(cmd, timeout=300):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    m = re.search(r"^(\d+) passed, (\d+) failed$", r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "",
                  re.M)
    assert m, f"no summary line (exit {r.returncode}):\n{out}"
    passed, failed = int(m.group(1)), int(m.group(2))
    assert failed == 0 and r.returncode == 0, out
    assert passed > 100_000, out  # all groups ran (a full run is ~400k-550k checks)
    return r.stdout


def _tested(stdout: str) -> list:
    line = next(l for l in stdout.splitlines() if l.startswith("testing:"))
    return line.split()[1:]


def test_native_default(build_dir):
    out = _run([str(_make(build_dir, "test_crc32c"))])
    names = _tested(out)
    assert {"table", "bytewise", "slice8", "slice16"} <= set(names)
    if os.uname().machine == "x86_64":
        assert "sse42" in names and "sse42_serial" in names
    if _have_isal():
        assert "isal" in names


def test_native_without_isal(build_dir):
    out = _run([str(_make(build_dir, "test_crc32c_noisal"))])
    assert "isal" not in _tested(out)
    assert "isal version: (none)" in out


def test_isal_int_length_split(build_dir):
    if not _have_isal():
        pytest.skip("libisal not found by pkg-config")
    out = _run([str(_make(build_dir, "test_crc32c_isalsplit")), "--require", "isal"])
    assert "isal" in _tested(out)


def test_native_asan_ubsan(build_dir):
    exe = _make(build_dir, "test_crc32c_asan")
    _run([str(exe)])


def test_aarch64_under_qemu(build_dir):
    if shutil.which(CROSS_CC) is None:
        pytest.skip(f"{CROSS_CC} not installed (apt-get install gcc-aarch64-linux-gnu)")
    if shutil.which(QEMU) is None:
        pytest.skip(f"{QEMU} not installed (apt-get install qemu-user)")
    exe = _make(build_dir, "test_crc32c_aarch64")
    assert exe.read_bytes()[18:20] == (183).to_bytes(2, "little")  # ELF e_machine EM_AARCH64
    out = _run([QEMU, "-L", AARCH64_SYSROOT, str(exe), "--require", "armv8"], timeout=600)
    names = _tested(out)
    assert "armv8" in names and "sse42" not in names
