"""`kvtier info` tells the truth about what is built and active."""
import json
import os
import shutil
import subprocess
import sys

import pytest

import kvtier


def run_info(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvtier", "info", *args], capture_output=True, text=True, env=e, check=True)


def test_info_json_matches_core():
    d = json.loads(run_info("--json").stdout)
    assert d["version"] == kvtier.__version__
    assert d["c_core"] is True
    assert d["crc32c_backend"] == kvtier.crc32c_backend
    names = [b["name"] for b in d["crc32c_backends"]]
    assert names == [n for (n, _ok, _f) in kvtier._C.backends()] + ["numpy"]
    avail = {b["name"] for b in d["crc32c_backends"] if b["available"]}
    assert avail == set(kvtier.crc32c_backends())
    assert d["isal_version"] == kvtier._C.isal_version()


@pytest.mark.skipif(shutil.which("pkg-config") is None, reason="pkg-config not installed")
def test_info_isal_version_is_the_one_built_against():
    r = subprocess.run(["pkg-config", "--modversion", "libisal"], capture_output=True, text=True)
    if r.returncode != 0:
        assert kvtier._C.isal_version() is None
        assert "isal" not in kvtier.crc32c_backends()
    else:
        assert kvtier._C.isal_version() == r.stdout.strip()
        assert "isal" in kvtier.crc32c_backends()


@pytest.mark.skipif(os.path.isdir("/sys/bus/dsa/devices"), reason="this host has a DSA bus")
def test_info_says_no_dsa_device_and_claims_no_offload():
    out = run_info().stdout
    dsa_line = [l for l in out.splitlines() if l.startswith("DSA:")]
    assert dsa_line == ["DSA:            no DSA devices found (/sys/bus/dsa/devices absent)"]
    assert "enabled: dsa " not in out
    d = json.loads(run_info("--json").stdout)
    assert d["dsa_counters"] == {}
    assert {b["name"]: b["available"] for b in d["crc32c_backends"]}.get("dsa") is False


def test_info_names_the_model_as_model_never_dsa():
    out = run_info(env={"KVTIER_CRC32C_BACKEND": "dsa-model"}).stdout
    assert "CRC32C active:  dsa-model" in out
    assert "enabled: dsa-model (software model, not hardware" in out
    assert "enabled: dsa (" not in out
