"""Skips that CI must not take.

A test that needs something CI provides (vLLM, root mounts, FUSE, a distributed
filesystem, a C compiler) calls :func:`unavailable` instead of ``pytest.skip``: on a
developer's machine it skips with the reason; under CI (``CI=true``, as ``.ci/run`` runs)
it fails, since there the missing piece is a broken install step, not a limit of the host.
Skips for what CI does not provide either (DSA hardware, another CPU) stay plain
``pytest.skip``.
"""
from __future__ import annotations

import os

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
    """Skip with ``reason``; under CI fail with it (never returns)."""
    if under_ci():
        pytest.fail(f"required under CI, but unavailable: {reason}", pytrace=False)
    pytest.skip(reason)
