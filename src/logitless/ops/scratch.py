"""`Scratch`: the few (n, c) buffers that one op call's blocks of logits and their temporaries live in.

An op visits hundreds of blocks; a fresh block-sized tensor per block costs more than its arithmetic
wherever the allocator hands large blocks back to the operating system (glibc does above its mmap
threshold, by default from 128 kB until a large block has been freed once), since every block then
page-faults its memory in again. Buffers are reused by name: a name is in use by one block at a time in
each thread (each thread has its own buffers: the block workers of `workers.py` each run a block).
"""

from __future__ import annotations

import threading

import torch


class Scratch:
    """Named flat buffers, grown on demand, handed out as (n, c) views; one set per thread."""

    def __init__(self):
        self._local = threading.local()

    def get(self, name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous ``shape`` view of this thread's buffer ``name``; its contents are whatever the last user
        left."""
        buffers = self._local.__dict__.setdefault("buffers", {})
        numel = shape[0] * shape[1]
        buffer = buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)

    def like(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Buffer ``name`` with ``tensor``'s shape, dtype and device."""
        return self.get(name, tuple(tensor.shape), tensor.dtype, tensor.device)
