"""Buffers as bytes: a torch CPU tensor's byte view and a buffer's address.

Used by the Python check of both backends (kvtier.io), the tier shells and the numpy CRC;
the C core takes a tensor the same way (its torch_bytes_view)."""
from __future__ import annotations

import numpy as np


def is_torch_tensor(obj) -> bool:
    """Whether ``obj`` is a torch tensor (checked by its type's module: torch not imported)."""
    mod = type(obj).__module__ or ""
    return mod == "torch" or mod.startswith("torch.")


def torch_bytes_view(t) -> np.ndarray:
    """uint8 ndarray aliasing a contiguous CPU torch tensor's bytes (any dtype,
    bf16 included), as the C core takes it. BufferError if not contiguous."""
    import torch

    if not t.is_contiguous():
        raise BufferError("torch tensor is not contiguous")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def buffer_address(mv) -> int:
    """The address of a byte memoryview's first byte (0 when empty)."""
    return np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0] if len(mv) else 0
