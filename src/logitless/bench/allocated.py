"""The peak of the bytes of the tensors a piece of work allocates and holds at once, counted op by op: the same count
on every run of the same work, on every rank that runs the same shapes (the resident set is not: the allocator keeps
and hands back memory as it pleases, and pages touched by an earlier step are reused unseen).

Every PyTorch op run under `AllocatedPeak` (a ``TorchDispatchMode``: on the thread that enters it, and the autograd
engine's CPU backward started there; not on other threads, such as a CPU op's block workers when PyTorch has more
than one thread, so `bench distributed` runs each rank on one) hands it its outputs. An output whose storage is new
(neither an input's nor one already counted) adds its bytes, and the storage's release takes them off again. Not
counted: the tensors the work was given, what an op allocates for itself and frees before it returns, and what a
tensor subclass (a DTensor) allocates inside its own ops beyond their outputs' local tensors.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _storages(tensor: torch.Tensor) -> list:
    """The storages that hold ``tensor``'s numbers: its own, or a wrapper subclass's inner tensors' (a DTensor's
    local tensor)."""
    if is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        return [storage for name in inner_names for storage in _storages(getattr(tensor, name))]
    return [tensor.untyped_storage()]


def _storage_ids(values) -> set[int]:
    return {id(storage) for value in tree_leaves(values) if isinstance(value, torch.Tensor)
            for storage in _storages(value)}


class AllocatedPeak(TorchDispatchMode):
    """``with AllocatedPeak() as allocated: work()`` then ``allocated.peak_bytes``: the most bytes of tensors the work
    allocated that were alive at once (``held_bytes``: those alive now)."""

    def __init__(self):
        super().__init__()
        self.held_bytes = self.peak_bytes = 0
        self._held: set[int] = set()  # ids of the counted storages still alive

    def _release(self, storage_id: int, size: int) -> None:
        self._held.discard(storage_id)
        self.held_bytes -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outputs = func(*args, **kwargs)
        given = _storage_ids((args, kwargs))
        for output in tree_leaves(outputs):
            if not isinstance(output, torch.Tensor):
                continue
            for storage in _storages(output):
                if id(storage) in given or id(storage) in self._held:  # an input's, a view or an in-place result
                    continue
                self._held.add(id(storage))
                self.held_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
                weakref.finalize(storage, self._release, id(storage), storage.nbytes())
        return outputs
