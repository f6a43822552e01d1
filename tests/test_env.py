"""KVTIER_* settings the C core reads with getenv(3) are checked in Python
(kvtier/_blockio/env.py): a value the core would silently ignore is a ValueError at
import naming the variable, the value and what is valid; valid values import.
Each case runs in a fresh interpreter (the checks run at import)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier._blockio import env as _env


def _import(env: dict, module: str = "kvtier") -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=e,
                          timeout=120)


BAD = [
    ("KVTIER_DSA", "modle", "KVTIER_DSA='modle' is not valid; valid values: model, off"),
    ("KVTIER_DSA", "Model", "KVTIER_DSA='Model' is not valid; valid values: model, off"),
    ("KVTIER_DSA_WAIT", "busy", "KVTIER_DSA_WAIT='busy' is not valid; valid values: spin, yield, sleep"),
    ("KVTIER_DSA_MIN_SIZE", "-1", "KVTIER_DSA_MIN_SIZE='-1' is not valid: bytes, decimal or 0x hex"),
    ("KVTIER_DSA_MIN_SIZE", "16k", "KVTIER_DSA_MIN_SIZE='16k' is not valid"),
    ("KVTIER_DSA_MIN_SIZE", "010", "KVTIER_DSA_MIN_SIZE='010' is not valid"),  # octal to strtoull: refused
    ("KVTIER_DSA_MIN_SIZE", str(2**64), f"KVTIER_DSA_MIN_SIZE='{2**64}' is not valid"),
    ("KVTIER_DSA_TIMEOUT_MS", "0", "KVTIER_DSA_TIMEOUT_MS='0' is not valid: milliseconds, decimal (default 1000), "
                                   "an integer 1..18446744073708"),
    ("KVTIER_DSA_TIMEOUT_MS", "1.5", "KVTIER_DSA_TIMEOUT_MS='1.5' is not valid"),
    ("KVTIER_DSA_SELFCHECK_TIMEOUT_MS", "0", "KVTIER_DSA_SELFCHECK_TIMEOUT_MS='0' is not valid"),
    ("KVTIER_DSA_MODEL_LATENCY_NS", "1000000000", "KVTIER_DSA_MODEL_LATENCY_NS='1000000000' is not valid"),
    ("KVTIER_DSA_MODEL_LATENCY_NS", " 5", "KVTIER_DSA_MODEL_LATENCY_NS=' 5' is not valid"),
]


@pytest.mark.parametrize("name,value,msg", BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_bad_dsa_setting_fails_import_of_kvtier(name, value, msg):
    r = _import({name: value})
    assert r.returncode != 0
    assert f"ValueError: {msg}" in r.stderr, r.stderr[-2000:]


GOOD = [
    ("KVTIER_DSA", "off"), ("KVTIER_DSA", ""), ("KVTIER_DSA_WAIT", "spin"), ("KVTIER_DSA_WAIT", "sleep"),
    ("KVTIER_DSA_MIN_SIZE", "0"), ("KVTIER_DSA_MIN_SIZE", "0x4000"), ("KVTIER_DSA_MIN_SIZE", str(2**64 - 1)),
    ("KVTIER_DSA_TIMEOUT_MS", "1"), ("KVTIER_DSA_TIMEOUT_MS", "18446744073708"),
    ("KVTIER_DSA_TIMEOUT_MS", "0100"),  # decimal with a leading zero: strtoull base 10 reads 100
    ("KVTIER_DSA_SELFCHECK_TIMEOUT_MS", "100"), ("KVTIER_DSA_MODEL_LATENCY_NS", "999999999"),
]


@pytest.mark.parametrize("name,value", GOOD, ids=[f"{n}={v}" for n, v in GOOD])
def test_valid_dsa_setting_imports(name, value):
    r = _import({name: value})
    assert r.returncode == 0, r.stderr[-2000:]


def test_io_settings_fail_import_of_kvtier_io_only():
    """The block I/O switches are checked by kvtier.io, not by kvtier."""
    assert _import({"KVTIER_IO_URING": "2"}).returncode == 0
    r = _import({"KVTIER_IO_URING": "2"}, "kvtier.io")
    assert "ValueError: KVTIER_IO_URING='2' is not valid; valid values: 1, true, yes, on, 0, false, no, off" in r.stderr
    r = _import({"KVTIER_CRC_COPY": "enable"}, "kvtier.io")
    assert "ValueError: KVTIER_CRC_COPY='enable' is not valid; valid values: 1, true, yes, on, 0, false, no, off" \
        in r.stderr
    assert _import({"KVTIER_CRC_COPY": "OFF", "KVTIER_IO_URING": "Yes"}, "kvtier.io").returncode == 0


def test_checks_in_process(monkeypatch):
    """The same functions, called directly: each bad value raises, unset passes."""
    for k in list(os.environ):
        if k.startswith("KVTIER_"):
            monkeypatch.delenv(k)
    _env.check_dsa_env()
    _env.check_io_env()
    for name, value, msg in BAD:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match="^" + msg.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            _env.check_dsa_env()
        monkeypatch.delenv(name)
