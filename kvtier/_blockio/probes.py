"""Probes of a directory's filesystem: O_DIRECT and user xattrs (a temp file each, removed).

Used by the tier's startup (kvtier._tier) and ``kvtier doctor``; kvtier.io re-exports them."""
from __future__ import annotations

import errno
import mmap
import os
import secrets

from kvtier._blockio.records import XATTR_NAME

_PROBE_SIZE = 4096  # one page: aligned for every O_DIRECT alignment in use


def _probe_file(directory):
    d = os.fspath(directory)
    name = os.path.join(d, (b".kvtier_probe_" if isinstance(d, bytes) else ".kvtier_probe_") + (
        secrets.token_hex(8).encode() if isinstance(d, bytes) else secrets.token_hex(8)))
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    return name, fd


def probe_o_direct(directory) -> bool:
    """Whether files in ``directory`` accept O_DIRECT: a page-aligned 4 KiB
    write and read back with O_DIRECT succeed on a temp file (removed); on a
    full filesystem (ENOSPC, EDQUOT at the write) the kernel's acceptance of
    O_DIRECT for the file decides. Raises OSError naming ``directory`` if it
    cannot hold a temp file (ENOENT, EACCES) or the I/O fails otherwise (EIO)."""
    import fcntl

    name, fd = _probe_file(directory)
    buf = mmap.mmap(-1, _PROBE_SIZE)  # page-aligned anonymous memory
    try:
        buf.write(b"\xa5" * _PROBE_SIZE)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            if os.pwrite(fd, buf, 0) != _PROBE_SIZE:
                return False
            back = mmap.mmap(-1, _PROBE_SIZE)
            try:
                return os.preadv(fd, [back], 0) == _PROBE_SIZE and back[:] == buf[:]
            finally:
                back.close()
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                # a full filesystem (or quota) answered the write: the kernel took O_DIRECT for
                # this file (F_SETFL refuses it with EINVAL where the filesystem has none), so
                # yes; the block I/O drops O_DIRECT for a file whose first I/O says EINVAL.
                # A tier restarted on its full disk serves the blocks it has.
                return True
            raise OSError(e.errno, e.strerror, os.fspath(directory)) from e
    finally:
        buf.close()
        os.close(fd)
        os.unlink(name)


def probe_xattr(directory) -> bool:
    """Whether files in ``directory`` hold user xattrs: sets and reads back
    ``user.vllm.kv_crc32c`` on a temp file (removed). False when the
    filesystem says EOPNOTSUPP (e.g. ramfs) or EPERM; other OSErrors (ENOENT,
    EACCES, ENOSPC ...) are raised."""
    name, fd = _probe_file(directory)
    try:
        value = b"\x12\x34\x56\x78"
        try:
            os.setxattr(fd, XATTR_NAME, value)
            return os.getxattr(fd, XATTR_NAME) == value
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EPERM):
                return False
            raise
    finally:
        os.close(fd)
        os.unlink(name)
