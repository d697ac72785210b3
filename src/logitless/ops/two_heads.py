"""The inputs of the ops that read two LM heads (`fused_linear_kl`, `fused_linear_jsd`): each side's checks and
`LinearHead`, the fixed side's head without gradient, and the tokens both sides keep. A side is named by the
suffix of its arguments (``p`` and ``q``, ``s`` and ``t``), and so is every error (``weight_q: ...``)."""

from __future__ import annotations

import torch

from logitless._tensor_checks import check_mask, check_tensor
from logitless.ops.head import LinearHead


def check_side(side: str, hidden, weight, bias) -> None:
    """``hidden_SIDE`` (..., H), ``weight_SIDE`` (V, H) of the same dtype, ``bias_SIDE`` (V,) or None."""
    check_tensor(f"hidden_{side}", hidden, floating=True)
    check_tensor(f"weight_{side}", weight, ndim=2, floating=True)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight_{side}: hidden size {weight.shape[1]} does not match hidden_{side}'s last dim "
                         f"(shape {tuple(hidden.shape)})")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight_{side}: dtype {weight.dtype} differs from hidden_{side}'s {hidden.dtype}")
    if bias is not None:
        check_tensor(f"bias_{side}", bias, ndim=1, floating=True)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias_{side}: length {bias.shape[0]} does not match weight_{side}'s "
                             f"{weight.shape[0]} rows")


def side_head(side: str, weight, bias, temperature, softcap, logit_scale) -> LinearHead:
    """The ``side`` head; its errors name ``weight_SIDE`` and ``bias_SIDE``."""
    try:
        return LinearHead(weight, bias, temperature, softcap, logit_scale)
    except (TypeError, ValueError) as err:
        field, _, rest = str(err).partition(": ")
        if field in ("weight", "bias"):
            raise type(err)(f"{field}_{side}: {rest}") from None
        raise


def check_same_vocabulary(head: LinearHead, other: LinearHead, sides: tuple[str, str]) -> None:
    if other.vocab_size != head.vocab_size:
        raise ValueError(f"weight_{sides[1]}: vocabulary of {other.vocab_size} rows, weight_{sides[0]} has "
                         f"{head.vocab_size}")


def fixed_head(head: LinearHead) -> LinearHead:
    """``head`` with its weight and bias detached: a fixed target (a reference, a teacher) gets no gradient."""
    return LinearHead(head.weight.detach(), None if head.bias is None else head.bias.detach(), head.temperature,
                      head.softcap, head.scale)


def kept_rows(hidden: torch.Tensor, other_hidden: torch.Tensor, mask, sides: tuple[str, str]):
    """Both sides' hidden states (..., H_i) with the same leading dims -> (flat (K, H), flat other (K, H_other),
    the kept positions among the N = prod(leading dims), or None without ``mask``)."""
    if other_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"hidden_{sides[1]}: leading dims {tuple(other_hidden.shape[:-1])} do not match "
                         f"hidden_{sides[0]}'s {tuple(hidden.shape[:-1])}")
    flat, other_flat = hidden.reshape(-1, hidden.shape[-1]), other_hidden.reshape(-1, other_hidden.shape[-1])
    if mask is None:
        return flat, other_flat, None
    kept = check_mask("mask", mask, f"hidden_{sides[0]}'s leading dims", hidden[..., 0]).reshape(-1)
    kept = kept.nonzero().squeeze(1)
    return flat.index_select(0, kept), other_flat.index_select(0, kept), kept


def scatter_kept(values: torch.Tensor, kept: torch.Tensor | None, leading: torch.Size) -> torch.Tensor:
    """Per-kept-token values (K,) back at their positions, with the leading dims; dropped tokens get 0."""
    if kept is not None:
        values = torch.zeros(leading.numel(), dtype=values.dtype, device=values.device).index_copy(0, kept, values)
    return values.reshape(leading)
