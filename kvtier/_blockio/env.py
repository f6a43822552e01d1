"""The KVTIER_* settings the C core reads, checked at import.

The C core reads each switch with its one parser (csrc/env.c) and keeps its default on a
value it does not take; ``kvtier._C.env_check(group)`` lists such values. These checks raise
the first as a ValueError naming the variable, the value and what is valid:
:func:`check_dsa_env` when ``kvtier`` is imported, :func:`check_io_env` when ``kvtier.io``
is. An unset or empty variable is always fine (the default). Without the C core nothing
reads them: nothing to check.
"""
from __future__ import annotations


def _check(group: str) -> None:
    from kvtier import _C  # None when kvtier/__init__ found no C core

    for name, value, why in (_C.env_check(group) if _C is not None else ()):
        raise ValueError(f"{name}={value!r} is not valid{why}")


def check_io_env() -> None:
    """KVTIER_CRC_COPY and KVTIER_IO_URING (switch words, any case). ValueError."""
    _check("io")


def check_dsa_env() -> None:
    """KVTIER_DSA (model, off), KVTIER_DSA_WAIT (spin, yield, sleep),
    KVTIER_DSA_MIN_SIZE (bytes, decimal or 0x hex, 0..2**64-1),
    KVTIER_DSA_TIMEOUT_MS and KVTIER_DSA_SELFCHECK_TIMEOUT_MS (decimal ms,
    >= 1), KVTIER_DSA_MODEL_LATENCY_NS (decimal ns, < 1 s). ValueError.
    Case-sensitive, as the C core compares them."""
    _check("dsa")
