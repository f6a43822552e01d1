"""Type stub of kvtier._C, the C core (csrc/py/). Sizes are in bytes."""
from __future__ import annotations

import os
import sys
from typing import Any, Literal, Optional, Union

if sys.version_info >= (3, 12):
    from collections.abc import Buffer  # PEP 688
else:
    from typing_extensions import Buffer

_Path = Union[str, bytes, os.PathLike[str], os.PathLike[bytes]]
_PathList = Union[list[_Path], tuple[_Path, ...]]

GIL_RELEASE_MIN: int
"""CRC inputs of at least this many bytes run with the GIL released."""
XATTR_NAME: str
"""'user.vllm.kv_crc32c': xattr holding a block's CRC32C, 4 bytes big-endian."""

# ---------------------------------------------------------------- CRC32C

def crc32c(data: Buffer, value: int = 0, /) -> int:
    """CRC-32C (RFC 3720) of a C-contiguous buffer chained from value, 0..2**32-1."""

def crc32c_using(backend: str, data: Buffer, value: int = 0, /) -> int: ...
def crc32c_combine(crc1: int, crc2: int, len2: int, /) -> int: ...
def backends() -> list[tuple[str, bool, str]]:
    """(name, available, features) of every compiled-in backend, best first."""

def active_backend() -> str: ...
def isal_version() -> Optional[str]: ...
def _crc32c_serial_crc32q(data: Buffer, value: int = 0, /) -> int: ...
def _crc32c_bytewise(data: Buffer, value: int = 0, /) -> int: ...

# ---------------------------------------------------------------- block I/O

def batch_lookup(paths: _PathList, block_size: int = 0, /) -> list[bool]: ...
def batch_store_block(
    tmp_paths: _PathList,
    dest_paths: _PathList,
    buffers: Union[list[Buffer], tuple[Buffer, ...], Buffer],
    /,
    use_o_direct: bool = True,
    checksum: Union[bool, Literal["strict"]] = False,
    durable: bool = False,
    *,
    job_state: Optional[Buffer] = None,
    counts: Optional[dict[str, int]] = None,
    offsets: Optional[Union[list[int], tuple[int, ...]]] = None,
    block_size: Optional[int] = None,
) -> None:
    """Raises OSError(errno, strerror, dest) with num_succeeded: int,
    checksum_failed: bool, num_retried: int (0), operation: str and
    condemned: None attributes at the first failing block. counts: policy
    counters of the call are added to it (kvtier._blockio.policy.COUNT_NAMES)."""

def batch_load_block(
    source_paths: _PathList,
    buffers: Union[list[Buffer], tuple[Buffer, ...], Buffer],
    /,
    use_o_direct: bool = True,
    checksum: Union[bool, Literal["strict"]] = False,
    *,
    job_state: Optional[Buffer] = None,
    counts: Optional[dict[str, int]] = None,
    offsets: Optional[Union[list[int], tuple[int, ...]]] = None,
    block_size: Optional[int] = None,
    landing: Literal["bounce", "direct"] = "bounce",
) -> int:
    """Returns the number of blocks re-read once after a first checksum
    mismatch. Raises OSError with num_succeeded: int, checksum_failed: bool,
    num_retried: int (blocks re-read before the batch stopped, the
    failing block included: 1 for a block condemned on its re-read),
    operation: str (kvtier._blockio.policy.OPERATIONS) and condemned: Optional[str]
    (kvtier._blockio.policy.CAUSES when the file was removed). counts: policy
    counters of the call are added to it (kvtier._blockio.policy.COUNT_NAMES)."""

JOB_LIVE: int  # 0: phases (low 2 bits) of job state words, blocks << 2 | phase (job_state_cas, batch_*(job_state=...))
JOB_COMMITTING: int  # 1
JOB_EXPIRED: int  # 2
JOB_DONE: int  # 3

def job_state_cas(buf: Buffer, old: int, new: int, /) -> bool:
    """Atomically set the 32-bit word at buf[0:4] to `new` if it holds `old`."""

def checksum_stats() -> dict[Literal["checksum_retries", "checksum_condemned"], int]:
    """Process-wide totals since import (diagnostic); per-call counts are
    batch_load_block's return value and OSError.num_retried."""

def io_engine_status() -> dict[Literal["engine", "liburing", "setting", "setup_errno", "uring_ops", "plain_blocks"],
                                 Union[str, bool, int]]:
    """The block I/O engine: engine ("io_uring" or "plain"), liburing (bool:
    built with it), setting (KVTIER_IO_URING: "unset", "0", "1"), setup_errno
    (int: why the kernel refused a ring, or 0), uring_ops (int), plain_blocks
    (int: O_DIRECT blocks done with plain pread/pwrite); totals since import."""

def policy_info() -> dict[str, Any]:
    """The error policy's names (counts, operations, causes), constants
    (retry_eintr_max, retry_transient, backoff_us, id_xattr) and process-wide totals."""

def crc32c_copy(dst: Buffer, src: Buffer, value: int = 0, /) -> int:
    """Copy src into dst (same length, no overlap) and return the CRC-32C of
    the bytes, continued from value, in one pass (the fused kernel of
    crc_copy_status()). TypeError / BufferError (read-only dst) / ValueError
    (lengths differ, overlap, value out of range); GIL released from 32 KiB."""

def crc_copy_status() -> dict[Literal["kernel", "enabled", "blocks", "bytes"], Union[str, bool, int]]:
    """The fused copy + CRC of checksummed loads (C core; from private memory
    into the caller's buffer): kernel (str: "avx512-vpclmulqdq", "pclmulqdq"
    or "generic"), enabled (bool: KVTIER_CRC_COPY not off, a fused kernel,
    the best CPU CRC32C backend active), blocks (int: loads through it),
    bytes (int); totals since import."""

# ---------------------------------------------------------------- Intel DSA (csrc/dsa/)

def dsa_discover(sysfs_root: Optional[str] = None, dev_root: Optional[str] = None, wq: Optional[str] = None) -> dict[str, Any]: ...
def dsa_enable(sysfs_root: Optional[str] = None, dev_root: Optional[str] = None, wq: Optional[str] = None) -> bool: ...
def dsa_model_enable(
    *,
    shared: bool = False,
    size: int = 32,
    max_transfer_size: int = 2097152,
    block_on_fault: bool = False,
    gen_cap: int = 5,
    latency_ns: int = 0,
    reject_status: int = 0,
) -> bool: ...
def dsa_model_inject(kind: str, /, count: int = 1, param: int = 0) -> None: ...
def dsa_model_stats() -> Optional[dict[str, int]]: ...
def dsa_configure(
    backend: str,
    /,
    *,
    min_size: Optional[int] = None,
    wait: Optional[Literal["spin", "yield", "sleep"]] = None,
    sleep_ns: Optional[int] = None,
    cache_control: Optional[bool] = None,
) -> None: ...
def dsa_copy_crc(backend: str, dst: Buffer, src: Buffer, value: int = 0, /) -> int: ...
def dsa_counters(backend: str, /) -> Optional[dict[str, Any]]: ...
def dsa_cpu_features() -> dict[str, bool]: ...
def dsa_disable(backend: str, /) -> None: ...
def dsa_reset_counters(backend: str, /) -> None: ...
def dsa_status(backend: str, /) -> dict[str, Any]: ...

def env_check(group: Literal["io", "dsa"], /) -> list[tuple[str, str, str]]:
    """KVTIER_* settings of the group set to a value the C core does not take (csrc/env.c):
    (name, value, why), why completing "<name>=<value> is not valid<why>"."""
