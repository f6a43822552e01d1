"""kvtier: a checksummed storage tier for LLM KV-cache blocks.

CRC32C (Castagnoli, RFC 3720) engine with ISA-L, SSE4.2, ARMv8, table and
Intel DSA backends; batched block I/O with the CRC in xattr
``user.vllm.kv_crc32c``; tier manager, FileMapper and metrics.
"""
from __future__ import annotations

__version__ = "0.1.0"

import importlib as _importlib

from kvtier._blockio.env import check_dsa_env as _check_dsa_env



def _said_by_the_command(e: ValueError) -> None:
    """A ``KVTIER_*`` setting refused while kvtier imports (the C core's
    ``KVTIER_CRC32C_BACKEND``, ``KVTIER_DSA*``): the ``kvtier`` command (its console script,
    ``python -m kvtier``) says it as it says every refused setting, one line and exit 2
    (kvtier.cli), not as a traceback. A program importing kvtier gets the ValueError."""
    import os
    import sys

    argv = list(getattr(sys, "orig_argv", ()))
    as_module = "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["kvtier"]
    if as_module or (sys.argv and os.path.basename(sys.argv[0]) == "kvtier"):
        print(f"kvtier: {e}", file=sys.stderr)
        raise SystemExit(2)


try:
    _C = _importlib.import_module("kvtier._C")
except ImportError as _exc:  # C core missing: the fallback is explicit, never silent
    _C = None
    _C_IMPORT_ERROR: "ImportError | None" = _exc
except ValueError as _exc:  # a refused KVTIER_CRC32C_BACKEND / KVTIER_DSA*
    _said_by_the_command(_exc)
    raise
else:
    _C_IMPORT_ERROR = None

try:
    _check_dsa_env()  # a KVTIER_DSA* value the C core does not take (it kept its default): ValueError
except ValueError as _exc:
    _said_by_the_command(_exc)
    raise

if _C is not None:
    crc32c = _C.crc32c
    crc32c_combine = _C.crc32c_combine
    crc32c_backend: str = _C.active_backend()
else:
    import warnings as _warnings

    from kvtier._blockio import numpy_crc as _numpy_crc

    _warnings.warn(
        f"kvtier: the C core (kvtier._C) is not importable ({_C_IMPORT_ERROR}); using the "
        "pure-Python fallback for CRC32C and block I/O (same results, slower; no DSA). "
        "Rebuild with `pip install .` after scripts/bootstrap.",
        RuntimeWarning,
        stacklevel=2,
    )
    crc32c = _numpy_crc.crc32c
    crc32c_combine = _numpy_crc.crc32c_combine
    crc32c_backend = "numpy"


def crc32c_backends(available_only: bool = True) -> list:
    """Names of the CRC32C backends, best first.

    With ``available_only`` (default) only those usable on this host; the
    pure-Python ``"numpy"`` fallback is always listed last.
    """
    names = []
    if _C is not None:
        names = [n for (n, ok, _f) in _C.backends() if ok or not available_only]
    return names + ["numpy"]


def crc32c_using(backend: str, data, value: int = 0) -> int:
    """CRC32C of ``data`` (C-contiguous buffer) chained from ``value``, through
    the named backend (one of :func:`crc32c_backends`).

    Raises ValueError naming the available backends if ``backend`` is unknown
    or not available here; BufferError for non-contiguous data.
    """
    if backend == "numpy":
        from kvtier._blockio import numpy_crc

        return numpy_crc.crc32c(data, value)
    if _C is None:
        raise ValueError(f"CRC32C backend {backend!r} needs the C core, which is not built; available: ['numpy']")
    return _C.crc32c_using(backend, data, value)


__all__ = ["crc32c", "crc32c_combine", "crc32c_backend", "crc32c_backends", "crc32c_using", "__version__"]
