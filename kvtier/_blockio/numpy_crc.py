"""Pure-Python (numpy) CRC32C: the CRC of ``kvtier.fallback`` and the ``"numpy"`` backend.

Private module: ``kvtier`` uses it for the ``"numpy"`` backend
(``kvtier.crc32c_using("numpy", ...)``, and ``kvtier.crc32c`` without the C core), and the
pure-Python block I/O for every checksum, whether the C core is built or not.

Same contract as the C core (``kvtier._C.crc32c``): CRC-32C (Castagnoli,
reflected polynomial 0x82F63B78, RFC 3720 B.4), init and final xor
0xFFFFFFFF, chainable. Check value: ``crc32c(b"123456789") == 0xE3069283``.

Method (vectorised over many slices at once):

1. A chunk of ``n`` bytes is cut into ``S`` slices of ``m`` bytes. The raw
   CRC register of every slice is computed at once, 8 bytes per step: with
   ``x = r ^ w0`` and ``y = w1`` (two little-endian 32-bit words) the step is
   ``r' = x*X^64 ^ y*X^32 mod P``, i.e. four lookups in 65536-entry tables
   (the low and high 16 bits of ``x`` and ``y``), each a numpy ``take`` over
   the ``S`` slices. Slice 0 starts from the running register, the others
   from 0 (CRC is linear in the register).
2. The slice registers are merged: slice ``i`` is advanced over the
   ``(S-1-i)*m`` bytes after it (multiplication by ``X^(8*(S-1-i)*m)``),
   applied bit by bit of ``S-1-i`` with 4-lookup byte tables, then XORed.
3. Fewer than ``m`` leftover bytes go through a byte-at-a-time Python loop.

Inputs over ``_CHUNK`` bytes are processed chunk by chunk (bounded memory).
Throughput: see docs/crc32c.md (benchmarks/crc32c_bench.py, row "numpy").
"""
from __future__ import annotations

import numpy as np

from kvtier._blockio.buffers import is_torch_tensor, torch_bytes_view

POLY = 0x82F63B78
"""CRC-32C polynomial, reflected (RFC 3720 B.4)."""

_CHUNK = 4 << 20  # bytes per vectorised pass (temporaries ~2x this)
_MIN_VECTOR = 4096  # below this, the byte loop is faster than numpy's per-call cost


def _mulmod(a: int, b: int) -> int:
    """a*b mod P in the reflected 32-bit representation (bit 31 = x^0)."""
    p = 0
    while a:
        if a & 0x80000000:
            p ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ (POLY if b & 1 else 0)
    return p


# _X8POW2[k] = x^(8 * 2^k) mod P: appending 2^k zero bytes.
_X8POW2 = [1 << 23]  # x^8
for _ in range(63):
    _X8POW2.append(_mulmod(_X8POW2[-1], _X8POW2[-1]))


def _x8n(n: int) -> int:
    """x^(8n) mod P (reflected): the operator appending n zero bytes."""
    acc = 1 << 31  # x^0
    k = 0
    while n:
        if n & 1:
            acc = _mulmod(acc, _X8POW2[k])
        n >>= 1
        k += 1
    return acc


def _shift(raw: int, nbytes: int) -> int:
    """Advance a raw register over nbytes zero bytes."""
    return _mulmod(_x8n(nbytes), raw) if raw else 0


_T0 = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ (POLY if _c & 1 else 0)
    _T0.append(_c)
del _i, _c


def _bytewise(raw: int, data) -> int:
    t = _T0
    for b in data:
        raw = t[(raw ^ b) & 0xFF] ^ (raw >> 8)
    return raw


def _op_columns(k: int) -> list:
    """Images of the 32 basis registers under multiplication by k."""
    return [_mulmod(k, 1 << j) for j in range(32)]


def _op_table(cols: list, lo_bit: int, nbits: int) -> np.ndarray:
    """Lookup table of a GF(2)-linear operator (columns ``cols``) on the
    ``nbits`` input bits starting at ``lo_bit``: table[v] = op(v << lo_bit)."""
    idx = np.arange(1 << nbits, dtype=np.uint32)
    t = np.zeros(1 << nbits, dtype=np.uint32)
    for j in range(nbits):
        t ^= np.where((idx >> np.uint32(j)) & np.uint32(1), np.uint32(cols[lo_bit + j]), np.uint32(0)).astype(np.uint32)
    return t


_step_tables = None


def _get_step_tables():
    """(A_lo, A_hi, C_lo, C_hi): 16-bit-indexed tables of r -> r*x^64 and
    r -> r*x^32 (8 and 4 zero bytes). Built on first use (~10 ms); a racing
    second build produces the same arrays, so no lock is needed."""
    global _step_tables
    if _step_tables is None:
        a = _op_columns(_x8n(8))
        c = _op_columns(_x8n(4))
        _step_tables = (_op_table(a, 0, 16), _op_table(a, 16, 16), _op_table(c, 0, 16), _op_table(c, 16, 16))
    return _step_tables


_shift_tables: dict = {}


def _get_shift_tables(nbytes: int):
    """4 byte-indexed tables of r -> r*x^(8*nbytes) (cached per nbytes)."""
    t = _shift_tables.get(nbytes)
    if t is None:
        cols = _op_columns(_x8n(nbytes))
        t = tuple(_op_table(cols, 8 * k, 8) for k in range(4))
        _shift_tables[nbytes] = t
    return t


def _apply_shift(regs: np.ndarray, nbytes: int) -> np.ndarray:
    s0, s1, s2, s3 = _get_shift_tables(nbytes)
    return s0[regs & 0xFF] ^ s1[(regs >> 8) & 0xFF] ^ s2[(regs >> 16) & 0xFF] ^ s3[regs >> 24]


def _slice_len(n: int) -> int:
    """Slice length m (bytes, power of two >= 64), about sqrt(n)/2: balances
    numpy's per-call cost (m/8 steps) against the per-element work and the
    merge. Tuned on 64 KiB..4 MiB inputs (sqrt(4n), sqrt(n) and sqrt(n/16)
    were 1.1-1.9x slower at 1 MiB)."""
    m = 64
    while 4 * m * m < n and m < 2048:
        m *= 2
    return m


def _vector(raw: int, a: np.ndarray) -> int:
    """Raw register after ``a`` (uint8 array, len >= 2*m) from ``raw``."""
    n = a.shape[0]
    m = _slice_len(n)
    s = n // m
    a_lo, a_hi, c_lo, c_hi = _get_step_tables()
    # (m/4, S) little-endian words: row j is word j of every slice.
    words = np.ascontiguousarray(a[: s * m].view("<u4").reshape(s, m // 4).T)
    regs = np.zeros(s, dtype=np.uint32)
    regs[0] = raw
    m16 = np.uint32(0xFFFF)
    sh16 = np.uint32(16)
    for j in range(0, m // 4, 2):
        x = regs ^ words[j]
        y = words[j + 1]
        regs = a_lo[x & m16] ^ a_hi[x >> sh16] ^ c_lo[y & m16] ^ c_hi[y >> sh16]
    # Merge: slice i moves over (s-1-i)*m bytes, bit by bit of (s-1-i).
    dist = np.arange(s - 1, -1, -1, dtype=np.int64)
    bit = 0
    while (1 << bit) < s:
        sel = ((dist >> bit) & 1).astype(bool)
        if sel.any():
            regs[sel] = _apply_shift(regs[sel], m << bit)
        bit += 1
    raw = int(np.bitwise_xor.reduce(regs))
    return _bytewise(raw, a[s * m:].tobytes())


def _as_bytes_array(data) -> np.ndarray:
    if is_torch_tensor(data):
        data = torch_bytes_view(data)
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"a bytes-like object is required, not '{type(data).__name__}'") from None
    if not mv.c_contiguous:
        raise BufferError(f"{type(data).__name__} object is not C-contiguous")
    if mv.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.itemsize != 1 else mv, dtype=np.uint8)


def _check_crc(name: str, v) -> int:
    if not isinstance(v, int):
        raise TypeError(f"{name} must be int, not {type(v).__name__}")
    if not 0 <= v <= 0xFFFFFFFF:
        raise ValueError(f"{name} must be in range 0..0xFFFFFFFF")
    return v


def crc32c(data, value: int = 0, /) -> int:
    """CRC-32C (Castagnoli, RFC 3720) of a C-contiguous buffer, standard
    presentation (init and final xor 0xFFFFFFFF), numpy implementation.

    data: any buffer-protocol object (bytes, bytearray, memoryview, mmap,
    numpy array), any length. value: previous CRC (0..0xFFFFFFFF) to chain:
    ``crc32c(b, crc32c(a)) == crc32c(a + b)``. Returns an int in
    0..0xFFFFFFFF. Raises BufferError for non-contiguous data, TypeError for
    non-buffers or a non-int value, ValueError for value out of range.
    """
    raw = _check_crc("value", value) ^ 0xFFFFFFFF
    a = _as_bytes_array(data)
    n = a.shape[0]
    if n < _MIN_VECTOR:
        return _bytewise(raw, a.tobytes()) ^ 0xFFFFFFFF
    for off in range(0, n, _CHUNK):
        part = a[off: off + _CHUNK]
        if part.shape[0] < _MIN_VECTOR:
            raw = _bytewise(raw, part.tobytes())
        else:
            raw = _vector(raw, part)
    return raw ^ 0xFFFFFFFF


def crc32c_combine(crc1: int, crc2: int, len2: int, /) -> int:
    """CRC32C of A+B from crc1 = crc32c(A), crc2 = crc32c(B) and len2 =
    len(B) in bytes (0..2**64-1): crc1 advanced over len2 zero bytes
    (multiplication by x^(8*len2) mod P), XOR crc2. O(log len2).
    Raises TypeError for non-int arguments, ValueError for out-of-range ones.
    """
    _check_crc("value", crc1)
    _check_crc("value", crc2)
    if not isinstance(len2, int):
        raise TypeError("len2 must be int")
    if not 0 <= len2 < 1 << 64:
        raise ValueError("len2 must be in range 0..2**64-1")
    return _shift(crc1, len2) ^ crc2
