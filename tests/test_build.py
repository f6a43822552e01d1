"""Build configurations of the C core, each in a temp copy of the tree:

- KVTIER_NO_ISAL=1: the extension builds without the ISA-L backend, imports,
  has no "isal" backend, isal_version() is None, and gives the check values;
- a compile error is a build error (non-zero exit), never a silent
  pure-Python install.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _copy_tree(dst: Path) -> Path:
    for name in ("csrc", "kvtier"):
        shutil.copytree(ROOT / name, dst / name,
                        ignore=shutil.ignore_patterns("*.so", "__pycache__", "build"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    return dst


def _build(tree: Path, **env):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "--build-temp", str(tree / "tmp")],
                          cwd=tree, env=e, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_build_without_isal(tmp_path):
    tree = _copy_tree(tmp_path)
    r = _build(tree, KVTIER_NO_ISAL="1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "WITHOUT ISA-L" in r.stderr
    code = (
        "import kvtier, kvtier._C as C\n"
        "print(kvtier.__file__)\n"
        "print(C.isal_version())\n"
        "print(','.join(kvtier.crc32c_backends(available_only=False)))\n"
        "print(kvtier.crc32c_backend)\n"
        "print(all(kvtier.crc32c_using(b, b'123456789') == 0xE3069283 for b in kvtier.crc32c_backends()))\n"
        "print(kvtier.crc32c(bytes(32)) == 0x8A9136AA)\n"
    )
    e = dict(os.environ, PYTHONPATH=str(tree))
    e.pop("KVTIER_CRC32C_BACKEND", None)
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, env=e, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    file_, isal, names, active, ok1, ok2 = p.stdout.split("\n")[:6]
    assert Path(file_).resolve().is_relative_to(tree.resolve())  # the temp build, not the work tree
    assert isal == "None"
    assert "isal" not in names.split(",") and "table" in names.split(",")
    assert active != "isal"
    assert ok1 == "True" and ok2 == "True"
    r2 = subprocess.run([sys.executable, "-m", "kvtier", "info"], cwd=tree, env=e, capture_output=True, text=True,
                        timeout=60)
    assert r2.returncode == 0, r2.stderr
    lines = r2.stdout.splitlines()
    isal_line = next(line for line in lines if line.startswith("ISA-L:"))
    assert not re.search(r"\d+\.\d+", isal_line), isal_line  # no version: says it is absent
    assert not any(line.split()[:1] == ["isal"] for line in lines), r2.stdout


def test_compile_error_is_build_error(tmp_path):
    tree = _copy_tree(tmp_path)
    (tree / "csrc" / "aaa_broken.c").write_text("int broken(void) { return 1 +; }\n")
    r = _build(tree, KVTIER_NO_ISAL="1")
    assert r.returncode != 0
    assert "aaa_broken.c" in r.stdout + r.stderr
    assert not list((tree / "kvtier").glob("_C*.so"))
