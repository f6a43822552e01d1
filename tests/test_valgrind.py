"""The C test programs under tests/c run clean under valgrind (memcheck):
no invalid read/write, no use of uninitialised values, no definite leak.

test_crc32c.c (CRC32C engine, every backend vs the reference; built by
tests/c/Makefile) and test_dsa.c (DSA engine on the software device model,
with its own thread) are built without sanitizers (valgrind and ASan do not
mix) and run under ``valgrind --error-exitcode=1``; each must still print its
"N passed, 0 failed" line.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CDIR = ROOT / "tests" / "c"
VALGRIND = ["valgrind", "-q", "--error-exitcode=97", "--leak-check=full", "--errors-for-leak-kinds=definite",
            "--track-origins=yes"]


@pytest.fixture(scope="module")
def vg():
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind not installed (scripts/bootstrap --test installs it)")
    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("make or a C compiler is missing")
    return VALGRIND


def _run_under_valgrind(vg, exe: Path, min_passed: int, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") and k != "LD_PRELOAD"}
    r = subprocess.run([*vg, str(exe)], capture_output=True, text=True, timeout=timeout, env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 97, f"valgrind found errors in {exe.name}:\n{r.stderr[-6000:]}"
    assert r.returncode == 0, f"{exe.name} failed under valgrind (exit {r.returncode}):\n{out[-6000:]}"
    m = re.search(r"^(\d+) passed, (\d+) failed$", r.stdout, re.M)
    assert m, out[-3000:]
    assert int(m.group(2)) == 0 and int(m.group(1)) >= min_passed, out[-3000:]


def test_test_crc32c_is_valgrind_clean(vg, tmp_path):
    if not (CDIR / "test_crc32c.c").exists():
        pytest.skip("tests/c/test_crc32c.c not present")
    target = tmp_path / "test_crc32c"
    r = subprocess.run(["make", "-s", "-C", str(CDIR), f"O={tmp_path}", str(target)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "CFLAGS": "-O1 -g"})
    assert r.returncode == 0, r.stdout + r.stderr
    _run_under_valgrind(vg, target, min_passed=100_000)


def test_test_dsa_is_valgrind_clean(vg, tmp_path):
    if not (CDIR / "test_dsa.c").exists():
        pytest.skip("tests/c/test_dsa.c not present")
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    srcs = sorted(str(p) for p in (ROOT / "csrc/dsa").glob("*.c")) + sorted(
        str(p) for p in (ROOT / "csrc/crc32c").glob("*.c")) + [str(ROOT / "csrc/env.c")]
    exe = tmp_path / "test_dsa"
    r = subprocess.run([cc, "-std=gnu11", "-O1", "-g", f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/crc32c",
                        f"-I{ROOT}/csrc/dsa", "-o", str(exe), str(CDIR / "test_dsa.c"), *srcs, "-lpthread"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    _run_under_valgrind(vg, exe, min_passed=300)
