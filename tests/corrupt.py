"""Same-size corruption of a block file, shared by the tests."""


def flip_bit(path, pos, mask=0x01):
    """XOR the byte at offset ``pos`` of ``path`` with ``mask`` in place (size unchanged)."""
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))
