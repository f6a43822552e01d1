"""Checks of the KVTIER_* settings that the C core reads with getenv(3).

The C core falls back to its default, silently, on a value it does not
understand (csrc/fs_io.c crc_copy_read_env, csrc/uring.c, csrc/dsa/ops.c). These checks
turn such a value into a ValueError naming the variable, the value and what
is valid: ``check_dsa_env`` when ``kvtier`` is imported (before the C core
selects its CRC32C backend), ``check_io_env`` when ``kvtier.io`` is imported.
An unset or empty variable is always fine (the default).
"""
from __future__ import annotations

import os
import re

SWITCH_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")
DSA_MODES = ("model", "off")  # KVTIER_DSA (csrc/dsa/ops.c try_device_once / try_model_once)
DSA_WAIT_MODES = ("spin", "yield", "sleep")  # KVTIER_DSA_WAIT (csrc/dsa/ops.c WAIT_NAMES)
DSA_TIMEOUT_MS_MAX = (2**64 - 1) // 1_000_000 - 1  # kept in ns as uint64 (csrc/dsa/ops.c)
DSA_MODEL_LATENCY_NS_MAX = 999_999_999  # csrc/dsa/ops.c try_model_once
UINT64_MAX = 2**64 - 1

_DECIMAL = re.compile(r"[0-9]+\Z")
_C_INTEGER = re.compile(r"(0[xX][0-9a-fA-F]+|[1-9][0-9]*|0)\Z")  # strtoull base 0, no octal


def _get(name: str) -> str:
    return os.environ.get(name, "")


def _word(name: str, words, default: str) -> None:
    v = _get(name)
    if v and v.lower() not in words:
        raise ValueError(f"{name}={v!r} is not valid; valid values: {', '.join(words)} ({default})")


def _integer(name: str, lo: int, hi: int, what: str, pattern=_DECIMAL) -> None:
    v = _get(name)
    base = 10 if pattern is _DECIMAL else 0  # strtoull(s, &end, 10) or (.., 0)
    if v and not (v.isascii() and pattern.match(v) and lo <= int(v, base) <= hi):
        raise ValueError(f"{name}={v!r} is not valid: {what}, an integer {lo}..{hi}")


def check_io_env() -> None:
    """KVTIER_CRC_COPY and KVTIER_IO_URING (switch words, any case). ValueError."""
    _word("KVTIER_CRC_COPY", SWITCH_WORDS, "unset: on where the CPU has a fused kernel")
    _word("KVTIER_IO_URING", SWITCH_WORDS, "unset: io_uring where built with liburing and the kernel allows it")


def check_dsa_env() -> None:
    """KVTIER_DSA (model, off), KVTIER_DSA_WAIT (spin, yield, sleep),
    KVTIER_DSA_MIN_SIZE (bytes, decimal or 0x hex, 0..2**64-1),
    KVTIER_DSA_TIMEOUT_MS and KVTIER_DSA_SELFCHECK_TIMEOUT_MS (decimal ms,
    >= 1), KVTIER_DSA_MODEL_LATENCY_NS (decimal ns, < 1 s). ValueError.
    Case-sensitive, as the C core compares them."""
    for name, words, default in (("KVTIER_DSA", DSA_MODES, "unset: probe the device when asked"),
                                 ("KVTIER_DSA_WAIT", DSA_WAIT_MODES, "unset: yield")):
        v = _get(name)
        if v and v not in words:
            raise ValueError(f"{name}={v!r} is not valid; valid values: {', '.join(words)} ({default})")
    _integer("KVTIER_DSA_MIN_SIZE", 0, UINT64_MAX, "bytes, decimal or 0x hex (default 16384)", _C_INTEGER)
    _integer("KVTIER_DSA_TIMEOUT_MS", 1, DSA_TIMEOUT_MS_MAX, "milliseconds, decimal (default 1000)")
    _integer("KVTIER_DSA_SELFCHECK_TIMEOUT_MS", 1, UINT64_MAX // 1_000_000, "milliseconds, decimal (default 2000)")
    _integer("KVTIER_DSA_MODEL_LATENCY_NS", 0, DSA_MODEL_LATENCY_NS_MAX, "nanoseconds, decimal (default 0)")
