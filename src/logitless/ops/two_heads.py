"""The inputs of the ops that read two LM heads (`fused_linear_kl`, `fused_linear_jsd`): each side's `LinearHead`
(whole or in parts) and checks, the fixed side's head without gradient, and the tokens both sides keep.
A side is named by the
suffix of its arguments (``p`` and ``q``, ``s`` and ``t``), and so is every error (``weight_q: ...``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from logitless._checks import check_impl, check_mask, check_tensor
from logitless.ops.head import LinearHead, op_head, stat_dtype
from logitless.ops.plan import implementation
from logitless.ops.settings import BlockSizes


class TwoHeadInputs(NamedTuple):
    """A two-head op's checked inputs on this rank: the trained side's head and its kept rows (K, H), the fixed
    side's, the kept positions among the N tokens (None without a mask), the leading dims of the output, the blocks."""

    head: LinearHead
    flat: torch.Tensor
    fixed: LinearHead
    fixed_flat: torch.Tensor
    kept: torch.Tensor | None
    leading: torch.Size
    sizes: BlockSizes


def two_head_inputs(sides: tuple[str, str], hiddens: tuple, heads: tuple, weights: tuple, biases: tuple,
                    temperature: float, softcap: float | None, logit_scale: float, mask, block_sizes, impl: str
                    ) -> TwoHeadInputs:
    """Each side's head (`op_heads`) and hidden states checked, the vocabularies the same, both sides on this rank
    (`sides_on_this_rank`) and the tokens both keep (`kept_rows`); ``sides[0]`` is the side trained."""
    head, fixed = op_heads(sides, heads, weights, biases, temperature, softcap, logit_scale)
    check_impl(impl)
    sizes = BlockSizes.of(block_sizes)
    hidden, fixed_hidden = hiddens
    check_side(sides[0], hidden, head)
    check_side(sides[1], fixed_hidden, fixed)
    check_same_vocabulary(head, fixed, sides)
    materialize = implementation(impl, hidden.device, stat_dtype(hidden.dtype)).materializes
    head, hidden, fixed, fixed_hidden = sides_on_this_rank(head, hidden, fixed, fixed_hidden, materialize, sides)
    flat, fixed_flat, kept = kept_rows(hidden, fixed_hidden, mask, sides)
    return TwoHeadInputs(head, flat, fixed, fixed_flat, kept, hidden.shape[:-1], sizes)


def op_heads(sides: tuple[str, str], heads: tuple, weights: tuple, biases: tuple, temperature: float,
             softcap: float | None, logit_scale: float) -> tuple[LinearHead, LinearHead]:
    """Both heads of a two-head op: given whole (``head_SIDE=LinearHead(...)``, each with its own temperature, soft
    cap and logit scale) or in parts (``weight_SIDE``, ``bias_SIDE``, and the ``temperature``, ``softcap`` and
    ``logit_scale`` both share); errors name the side's arguments."""
    if (heads[0] is None) != (heads[1] is None):
        given, missing = sides if heads[1] is None else sides[::-1]
        raise TypeError(f"head_{missing}: required with head_{given} (give both heads whole, or both in parts)")
    return tuple(op_head(head, weight, bias, temperature, softcap, logit_scale, side=f"_{side}")
                 for side, head, weight, bias in zip(sides, heads, weights, biases))


def check_side(side: str, hidden, head: LinearHead) -> None:
    """``hidden_SIDE`` (..., H) of the dtype of the side's head (V, H)."""
    check_tensor(f"hidden_{side}", hidden, floating=True)
    if hidden.dim() < 1 or hidden.shape[-1] != head.hidden_size:
        raise ValueError(f"weight_{side}: hidden size {head.hidden_size} does not match hidden_{side}'s last dim "
                         f"(shape {tuple(hidden.shape)})")
    if head.weight.dtype != hidden.dtype:
        raise TypeError(f"weight_{side}: dtype {head.weight.dtype} differs from hidden_{side}'s {hidden.dtype}")


def check_same_vocabulary(head: LinearHead, other: LinearHead, sides: tuple[str, str]) -> None:
    if other.vocab_size != head.vocab_size:
        raise ValueError(f"weight_{sides[1]}: vocabulary of {other.vocab_size} rows, weight_{sides[0]} has "
                         f"{head.vocab_size}")


def fixed_head(head: LinearHead) -> LinearHead:
    """``head`` with its weight and bias detached: a fixed target (a reference, a teacher) gets no gradient."""
    return dataclasses.replace(head, weight=head.weight.detach(),
                               bias=None if head.bias is None else head.bias.detach())


def sides_on_this_rank(head: LinearHead, hidden: torch.Tensor, fixed: LinearHead, fixed_hidden: torch.Tensor,
                       materialize: bool, sides: tuple[str, str]):
    """(head, hidden, fixed head, fixed hidden) of a two-head op on this rank. Where the trained side's weight is
    sharded on the vocabulary: its local shard and the fixed side's rows of the same vocabulary (its own shard, or
    those rows of its whole weight), or both heads whole for the materialized oracle and where gathering moves fewer
    bytes (`sharded.on_this_rank`). Hidden states given as DTensors become their local tensors."""
    from logitless.ops.sharded import fixed_local_head, gathered_head, is_sharded, on_this_rank

    if not is_sharded(head.weight) and not is_sharded(fixed.weight):
        return head, hidden, fixed, fixed_hidden
    head, hidden = on_this_rank(head, hidden, materialize=materialize, name=f"weight_{sides[0]}")
    fixed_hidden = fixed_hidden.to_local() if is_sharded(fixed_hidden) else fixed_hidden
    if head.shard is not None:
        return head, hidden, fixed_local_head(fixed, head.shard), fixed_hidden
    return head, hidden, gathered_head(fixed), fixed_hidden


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
