"""The error and verification policy of block I/O, shared by the Python side.

The rules (docs/design.md "Error policy", the table) are implemented once per backend:
the C core (csrc/) and kvtier/fallback.py (pure Python), with the same outcomes. This
module holds what both present to Python: the counter names a batch call's ``counts=``
dict gets, the ``operation`` and ``condemned`` names an OSError carries, the retry
constants and the checksum modes (:func:`check_mode`). The on-disk records and their
judgement are kvtier._blockio.records.
"""
from __future__ import annotations

import errno
import time
from typing import Union

COUNT_DOCS = {
    "unverified": "blocks loaded without a CRC record on a checksummed tier",
    "unverified_miss": "blocks without a CRC record in strict mode: a miss, file kept",
    "reread_checksum": "blocks re-read after a first CRC mismatch",
    "reread_identity": "blocks re-read after a first identity-record mismatch",
    "reread_short": "blocks reopened after a short read (each reopen)",
    "restat_size": "blocks reopened after a first wrong size",
    "condemned_checksum": "blocks condemned by a CRC mismatch on two reads (EBADMSG, removed)",
    "condemned_identity": "blocks condemned by an identity mismatch on two reads (EBADMSG, removed)",
    "condemned_size": "blocks condemned by a wrong size on two opens (EIO, removed)",
    "condemned_short": "always 0 since issue #24: a short read of a file of the right size is a miss, kept "
                       "(design.md P6); kept for the metric series",
    "retry_eintr": "EINTR retried in place (what the backend sees; CPython retries some calls itself)",
    "retry_eagain": "EAGAIN/EWOULDBLOCK: the block retried from its open",
    "retry_estale": "ESTALE: the block retried from its open",
    "durable_existing": "durable stores that synced an existing block (file and directory)",
    "replaced": "stores that replaced a symlink, FIFO or file of another size at the block path",
    "existing": "stores skipped: a regular file of the block size was already there (no bytes written)",
    "buffered_unaligned": "stores written buffered although O_DIRECT was on: the caller's buffer is not page "
                          "aligned (every store writes straight from it)",
}
"""The per-call policy counters and their meaning, in the C core's order (csrc/policy.h)."""
COUNT_NAMES = tuple(COUNT_DOCS)
"""Names of the per-call policy counters, in the C core's order (csrc/policy.h)."""

OPERATIONS = ("open", "stat", "read", "getxattr", "verify", "mkdir", "write", "setxattr", "sync", "close",
              "rename")
"""Values of a batch OSError's ``operation`` (the failing call; "verify": the block's bytes,
size or records were judged)."""

CAUSES = ("checksum", "identity", "size", "short_read")
"""Values of a batch OSError's ``condemned`` (None when the file was kept)."""

RETRY_EINTR_MAX = 100
"""EINTR: a call is retried at once, in place, up to this many times in a row."""
RETRY_TRANSIENT = 3
"""EAGAIN / EWOULDBLOCK / ESTALE: a block is retried from its open this many times."""
BACKOFF_US = 1000
"""Sleep before the first such retry (microseconds), doubled for each next one."""
RETRY_ENOENT_STORE = 9
"""A store's temp open answering ENOENT although its parents were just made (a shared
filesystem's name cache, GlusterFS about 1 s): parents made again and the open retried this
many times, after 2 ms, 4 ms ... 512 ms (csrc/policy.h KVT_RETRY_ENOENT_STORE)."""
TRANSIENT_ERRNOS = {errno.EAGAIN: "retry_eagain", errno.EWOULDBLOCK: "retry_eagain", errno.ESTALE: "retry_estale"}


def check_mode(value, what: str = "checksum") -> Union[bool, str]:
    """``value`` if it is a checksum mode (False, True, "strict"), else TypeError/ValueError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value == "strict":
            return value
        raise ValueError(f"{what} must be True, False or 'strict', not {value!r}")
    raise TypeError(f"{what} must be a bool or 'strict', got {type(value).__name__}")


def retry_transient(err: int, attempt: int, counts: dict) -> bool:
    """True (counted, after the backoff) if ``err`` is retried from the block's open at
    0-based ``attempt`` (csrc/policy.c kvt_policy_retry)."""
    name = TRANSIENT_ERRNOS.get(err)
    if name is None or attempt >= RETRY_TRANSIENT:
        return False
    counts[name] = counts.get(name, 0) + 1
    time.sleep(BACKOFF_US * (1 << attempt) / 1e6)
    return True
