"""Masked reductions: the sum and mean of the entries a mask keeps.

Masked-out entries are replaced by 0 before reducing (not multiplied by 0), so a NaN or inf
sitting under the mask never leaks into the result or its gradient.
"""

from __future__ import annotations

import torch

from logitless._checks import check_mask, check_tensor


def _masked_sum(tensor: torch.Tensor, keep: torch.Tensor, dim: int | None) -> torch.Tensor:
    kept = torch.where(keep, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_normalize(tensor: torch.Tensor, mask: torch.Tensor, normalize_constant: float = 1.0,
                     dim: int | None = None) -> torch.Tensor:
    """Sum of ``tensor`` where ``mask`` is set, over ``dim`` (all dims if None), divided by ``normalize_constant``."""
    check_tensor("tensor", tensor, floating=True)
    keep = check_mask("mask", mask, "tensor", tensor)
    if (isinstance(normalize_constant, bool) or not isinstance(normalize_constant, (int, float))
            or normalize_constant == 0):
        raise ValueError(f"normalize_constant: expected a non-zero number, got {normalize_constant!r}")
    return _masked_sum(tensor, keep, dim) / normalize_constant


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``tensor`` where ``mask`` is set, over ``dim`` (all dims if None).

    A slice with no unmasked entry is NaN, like the mean of an empty set.
    """
    check_tensor("tensor", tensor, floating=True)
    keep = check_mask("mask", mask, "tensor", tensor)
    count = keep.sum() if dim is None else keep.sum(dim=dim)
    return _masked_sum(tensor, keep, dim) / count.to(tensor.dtype)
