"""Argument checks on tensors shared by every public function: each raises ValueError/TypeError whose message
starts with the argument's name, so a user sees which input was wrong and what was expected."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_tensor(name: str, value, *, ndim: int | Sequence[int] | None = None, floating: bool = False,
                 integer: bool = False) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            raise ValueError(f"{name}: expected {' or '.join(map(str, allowed))} dimensions, got shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {value.dtype}")
    if integer and value.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected token ids as an int64 (or int32) tensor, got {value.dtype}")
    return value


def check_same_shape(name: str, value: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if value.shape != other.shape:
        raise ValueError(f"{name}: shape {tuple(value.shape)} does not match {other_name} shape {tuple(other.shape)}")


def check_finite(name: str, value: torch.Tensor) -> None:
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = (~torch.isfinite(value)).nonzero()[0].tolist()
        raise ValueError(f"{name}: contains NaN or inf (first at index {bad})")


def check_mask(name: str, mask, like_name: str, like: torch.Tensor) -> torch.Tensor:
    """A mask is bool or 0/1 numbers, of the same shape as the tensor it masks; returns it as bool."""
    check_tensor(name, mask)
    check_same_shape(name, mask, like_name, like)
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name}: expected a bool or 0/1 mask, found other values")
    return mask != 0


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    check_tensor(name, ids, integer=True)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{name}: token ids must lie in [0, {vocab_size}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")
