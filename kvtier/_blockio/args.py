"""The argument checks of the block-I/O calls: paths, views, offsets, flags, counts.

Two shapes, one set of rules and messages: :func:`check_blocks` (and :func:`check_paths`,
:func:`as_int`, :func:`check_bool`) for kvtier.io's ``(paths, view, offsets, block_size)``
calls, which check before either backend runs; :func:`encode_paths`, :func:`views`,
:func:`views_at`, :func:`check_list`, :func:`check_counts` and :func:`c_mode` for
kvtier.fallback's entry points, which take what kvtier._C takes and refuse what it refuses
(the same exception types, the same messages). TypeError / ValueError / BufferError, before
any I/O.
"""
from __future__ import annotations

import operator
import os
from collections import abc as _abc

from kvtier._blockio.buffers import is_torch_tensor, torch_bytes_view

_STR, _INT = {str}, {int}
_DIR_END, _last_char = frozenset("/."), operator.itemgetter(-1)


def check_path(i: int, p, what: str):
    """``p`` as str or bytes (``what[i]`` in messages): TypeError for another type,
    ValueError for an embedded NUL or a path naming a directory (:func:`dir_tail`; the
    same message as kvtier._C's)."""
    if not isinstance(p, (str, bytes)) and not hasattr(p, "__fspath__"):
        raise TypeError(f"{what}[{i}] must be str, bytes or os.PathLike, not {type(p).__name__}")
    f = os.fspath(p)
    if ("\0" if isinstance(f, str) else b"\0") in f:
        raise ValueError(f"{what}[{i}]: embedded null byte")
    tail = dir_tail(f)
    if tail is not None:
        raise ValueError(f"{what}[{i}]: a block path may not end in {tail!r} (it would name a directory)")
    return f


def dir_tail(f) -> "str | None":
    """How the path ``f`` (str or bytes) names a directory rather than a file: ``"/"`` when
    it ends in a path separator, ``"."`` or ``".."`` when that is its last component; else
    None. A block path may end in none of them: a store would make that directory (the
    parent of its temp) and then fail at the rename, leaving a directory at the key (EISDIR
    for every later store); a load or lookup of it can never find a block."""
    if isinstance(f, bytes):
        f = f.decode("latin-1")  # only the bytes '/' and '.' matter
    if f.endswith("/"):
        return "/"
    last = f.rpartition("/")[2]
    return last if last in (".", "..") else None


def check_paths(paths, what="paths") -> list:
    """``paths`` as a list (TypeError for a str, bytes or non-sequence); each a path
    (:func:`check_path`: no NUL, not ending in ``/``, ``.`` or ``..``) and not empty
    (ValueError)."""
    # a list first: isinstance() against an ABC costs more than the rest of a one-block check
    if type(paths) is not list and (isinstance(paths, (str, bytes)) or not isinstance(paths, _abc.Sequence)):
        raise TypeError(f"{what} must be a sequence of paths, not {type(paths).__name__}")
    paths = list(paths)
    # fast path (the engine's str paths): one scan for NUL, empties, and a last character that
    # may end a directory name ('/', '.': dir_tail decides); per-path checks only on a hit
    if (set(map(type, paths)) == _STR and "\0" not in "".join(paths) and all(paths)
            and _DIR_END.isdisjoint(map(_last_char, paths))):
        return paths
    for i, p in enumerate(paths):
        if not check_path(i, p, what):
            raise ValueError(f"{what}[{i}]: empty path")
    return paths


def as_int(v, what: str) -> int:
    """v as an int (operator.index: numpy integers too), else TypeError naming `what`."""
    if isinstance(v, bool):
        raise TypeError(f"{what} must be int, not bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be int, not {type(v).__name__}") from None


def check_bool(v, name: str) -> None:
    """A flag is True or False: "no" or 0 would pass through bool() as something else."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {'None' if v is None else f'{v!r} ({type(v).__name__})'}")


def check_blocks(paths, view, offsets, block_size, writable):
    """Validate: returns (paths list, the view as a flat byte memoryview, offsets as a list
    of int, block_size). The backend takes the view and the offsets (``offsets=``,
    ``block_size=``): no per-block memoryview is made."""
    paths = check_paths(paths)
    block_size = as_int(block_size, "block_size")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0 bytes, got {block_size}")
    # torch: BufferError if not contiguous; torch's TypeError for a non-CPU tensor
    try:
        mv = memoryview(torch_bytes_view(view) if is_torch_tensor(view) else view)
    except TypeError:
        raise TypeError(f"view must be a buffer (bytes-like, numpy array, torch CPU tensor), "
                        f"not {type(view).__name__}") from None
    if not mv.c_contiguous:
        raise BufferError(f"view must be C-contiguous ({type(view).__name__} is not)")
    if writable and mv.readonly:
        raise BufferError(f"view must be writable to load into it ({type(view).__name__} is read-only)")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if isinstance(offsets, (str, bytes)) or not hasattr(offsets, "__len__"):
        raise TypeError(f"offsets must be a sequence of ints, not {type(offsets).__name__}")
    if len(offsets) != len(paths):
        raise ValueError(f"paths and offsets must have equal lengths ({len(paths)}, {len(offsets)})")
    limit = mv.nbytes - block_size
    # fast path: plain ints in range (one pass each); the checks below name the first bad one
    if type(offsets) is not list:
        offsets = list(offsets)
    if not offsets or (set(map(type, offsets)) == _INT and min(offsets) >= 0 and max(offsets) <= limit):
        return paths, mv, offsets, block_size
    ints = []
    for i, off in enumerate(offsets):
        off = as_int(off, f"offsets[{i}]")
        if off < 0 or off > limit:
            raise ValueError(
                f"offsets[{i}] = {off}: block [{off}, {off + block_size}) is outside the view of {mv.nbytes} bytes"
            )
        ints.append(off)
    return paths, mv, ints, block_size


# --- the kvtier._C-shaped entry points (kvtier.fallback) ---

def check_list(obj, what):
    """TypeError unless ``obj`` is a list or tuple (as kvtier._C's sequence arguments)."""
    if not isinstance(obj, (list, tuple)):
        raise TypeError(f"{what} must be a list, not {type(obj).__name__}")


def encode_paths(seq, what):
    """Each path of ``seq`` as bytes (:func:`check_path`)."""
    return [os.fsencode(check_path(i, p, what)) for i, p in enumerate(seq)]


def views(buffers, writable):
    """Each buffer as a flat byte memoryview: TypeError (not a buffer), BufferError (not
    C-contiguous; read-only where ``writable``)."""
    out = []
    for i, b in enumerate(buffers):
        mv = memoryview(b)  # TypeError for a non-buffer
        if not mv.c_contiguous:
            raise BufferError(f"buffers[{i}]: {type(b).__name__} object is not C-contiguous")
        if writable and mv.readonly:
            raise BufferError(f"buffers[{i}] must be a writable C-contiguous buffer: {type(b).__name__} is read-only")
        out.append(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv)
    return out


def views_at(buffer, offsets, block_size, n, writable):
    """The ``offsets=`` / ``block_size=`` form (kvtier._C's gather_at): block i is
    ``buffer[offsets[i] : offsets[i] + block_size]``; the same checks and errors."""
    if block_size is None or isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError("block_size must be int with offsets, not "
                        + ("missing" if block_size is None else type(block_size).__name__))
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0 bytes, got {block_size}")
    check_list(offsets, "offsets")
    if len(offsets) != n:
        raise ValueError(f"paths and offsets must have equal lengths ({n}, {len(offsets)})")
    try:
        (mv,) = views([buffer], writable)
    except BufferError as e:
        if not writable:
            raise
        raise BufferError(f"buffers must be a writable C-contiguous buffer: {e}") from None
    limit = len(mv) - block_size
    for i, o in enumerate(offsets):
        if isinstance(o, bool) or not isinstance(o, int):
            raise TypeError(f"offsets[{i}] must be int, not {type(o).__name__}")
        if o < 0 or o > limit:
            raise ValueError(f"offsets[{i}] = {o}: block of {block_size} bytes is outside the view of {len(mv)} bytes")
    return [mv[o : o + block_size] for o in offsets]


def c_mode(checksum):
    """``checksum=`` as kvtier._C reads it: "strict", else its truth value; ValueError for
    another str."""
    if isinstance(checksum, str):
        if checksum != "strict":
            raise ValueError(f"checksum must be True, False or 'strict', not {checksum!r}")
        return "strict"
    return bool(checksum)


COUNT_MAX = 2**64 - 1
"""The largest counter a ``counts=`` dict may hold (kvtier._C adds into an unsigned 64-bit)."""


def check_counts(counts):
    """``counts=`` of a batch call, before any I/O: None, or a dict of policy counters that
    the call adds to, so every value is an int (not bool) in 0..:data:`COUNT_MAX`:
    TypeError for another type (of ``counts`` or of a value), ValueError for a value out of
    range. (Checked after the I/O, a bad value lost the call's own result: a store had
    published its blocks, a load's EBADMSG became a TypeError.)"""
    if counts is None:
        return
    if not isinstance(counts, dict):
        raise TypeError(f"counts must be a dict or None, not {type(counts).__name__}")
    for k, v in counts.items():
        if type(v) is not int and (isinstance(v, bool) or not isinstance(v, int)):
            raise TypeError(f"counts[{k!r}] must be int, not {type(v).__name__}")
        if not 0 <= v <= COUNT_MAX:
            raise ValueError(f"counts[{k!r}] = {v}: a counter is an int in 0..2**64-1")
