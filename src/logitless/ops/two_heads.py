"""The ops that read two LM heads, `fused_linear_kl` and `fused_linear_jsd`, and their inputs: each side's
`LinearHead` (whole or in parts) and checks, the fixed side's head without gradient, and the tokens both sides keep.
A side is named by the suffix of its arguments (``p`` and ``q``, ``s`` and ``t``), and so is every error
(``weight_q: ...``). What they compute is the accumulators' of `kl.py` and `jsd.py`, run by the block engine (or
the whole logits, for ``impl="reference"``): the steps ``kl`` and ``jsd`` of `api.py`'s implementations."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from logitless._checks import check_beta, check_impl, check_mask, check_tensor, checked_keywords, head_wholes
from logitless.op_settings import BlockSizes
from logitless.ops.api import first_that_runs, implementations
from logitless.ops.fused import scatter_kept
from logitless.ops.head import LinearHead, op_head, stat_dtype


class TwoHeadInputs(NamedTuple):
    """A two-head op's checked inputs on this rank: the trained side's head and its kept rows (K, H), the fixed
    side's (without gradient), the kept positions among the N tokens (None without a mask), the leading dims of the
    output, the blocks."""

    head: LinearHead
    flat: torch.Tensor
    fixed: LinearHead
    fixed_flat: torch.Tensor
    kept: torch.Tensor | None
    leading: torch.Size
    sizes: BlockSizes
    chain: tuple  # the implementations that run it (`api.implementations`)


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
    chain = implementations(impl, hidden.device, stat_dtype(hidden.dtype))
    head, hidden, fixed, fixed_hidden = sides_on_this_rank(head, hidden, fixed, fixed_hidden,
                                                           chain[0].whole_vocabulary, sides)
    flat, fixed_flat, kept = kept_rows(hidden, fixed_hidden, mask, sides)
    return TwoHeadInputs(head, flat, fixed_head(fixed), fixed_flat.detach(), kept, hidden.shape[:-1], sizes, chain)


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



@checked_keywords(wholes=head_wholes("_p", "_q"))
def fused_linear_kl(hidden_p: torch.Tensor, weight_p: torch.Tensor | None = None, hidden_q: torch.Tensor | None = None,
                    weight_q: torch.Tensor | None = None, *, head_p: LinearHead | None = None,
                    head_q: LinearHead | None = None, bias_p: torch.Tensor | None = None,
                    bias_q: torch.Tensor | None = None, temperature: float = 1.0, softcap: float | None = None,
                    logit_scale: float = 1.0, mask: torch.Tensor | None = None, block_sizes: BlockSizes | None = None,
                    impl: str = "auto") -> torch.Tensor:
    """Per-token KL(p || q) of two LM heads over the full vocabulary, without (N, V) logits.

    hidden_p (..., H_p) with weight_p (V, H_p); hidden_q (..., H_q) with weight_q (V, H_q): the same
    leading dims and vocabulary, hidden sizes may differ (a teacher and a student). Given in parts, both logits
    are made ``cap(logit_scale * (hidden @ weight.T + bias)) / temperature`` by the same ``softcap``,
    ``logit_scale`` and ``temperature``, as in `fused_linear_logprobs`; given whole (``head_p=``, ``head_q=``:
    two `LinearHead`s, e.g. `logitless.hf.lm_head_of` of two models), each head has its own. Returns the KL with
    hidden's leading dims, fp32 (fp64 for fp64 input); tokens where ``mask`` is 0 are skipped and get 0.
    Differentiable with respect to hidden_p and p's weight and bias; the q side is a fixed target and gets no
    gradient. ``block_sizes`` and ``impl`` ("auto" | "reference" | "chunked" | "triton") as in
    `fused_linear_logprobs`.
    """
    sides = two_head_inputs(("p", "q"), (hidden_p, hidden_q), (head_p, head_q), (weight_p, weight_q),
                            (bias_p, bias_q), temperature, softcap, logit_scale, mask, block_sizes, impl)
    kl = first_that_runs(sides.chain, "kl", sides.head, sides.flat, sides.fixed, sides.fixed_flat, sides.sizes)
    return scatter_kept(kl, sides.kept, sides.leading)


@checked_keywords(wholes=head_wholes("_s", "_t"))
def fused_linear_jsd(hidden_s: torch.Tensor, weight_s: torch.Tensor | None = None, hidden_t: torch.Tensor | None = None,
                     weight_t: torch.Tensor | None = None, *, head_s: LinearHead | None = None,
                     head_t: LinearHead | None = None, beta: float = 0.5, bias_s: torch.Tensor | None = None,
                     bias_t: torch.Tensor | None = None, temperature: float = 1.0, softcap: float | None = None,
                     logit_scale: float = 1.0, mask: torch.Tensor | None = None, return_token_entropy: bool = False,
                     block_sizes: BlockSizes | None = None, impl: str = "auto"):
    """Per-token generalized JSD of a student's LM head from a teacher's over the full vocabulary, without (N, V)
    logits.

    hidden_s (..., H_s) with weight_s (V, H_s); hidden_t (..., H_t) with weight_t (V, H_t): the same leading
    dims and vocabulary, hidden sizes may differ. ``beta`` in [0, 1] picks the divergence as TRL's
    DistillationTrainer does: 0 the forward KL(p_t || p_s), 1 the reverse KL(p_s || p_t), otherwise
    ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with the mixture ``m = (1 - beta) p_s + beta p_t``. The heads
    are given in parts (both logits ``cap(logit_scale * (hidden @ weight.T + bias)) / temperature`` with the same
    ``softcap``, ``logit_scale`` and ``temperature``) or whole (``head_s=``, ``head_t=``, each with its own, as
    TRL gives each model its own logit scale and soft cap), as in `fused_linear_kl`. Returns the divergence with
    hidden's leading dims, fp32 (fp64 for fp64 input), and with ``return_token_entropy`` also the student's
    entropy (without gradient): ``(divergence, entropy)``. Tokens where ``mask`` is 0 are skipped and get 0.
    Differentiable with respect to hidden_s and the student's weight and bias; the teacher is a fixed target and
    gets no gradient. ``block_sizes`` and ``impl`` ("auto" | "reference" | "chunked" | "triton") as in
    `fused_linear_logprobs`.
    """
    beta = check_beta(beta)
    sides = two_head_inputs(("s", "t"), (hidden_s, hidden_t), (head_s, head_t), (weight_s, weight_t),
                            (bias_s, bias_t), temperature, softcap, logit_scale, mask, block_sizes, impl)
    divergence, entropy = first_that_runs(sides.chain, "jsd", sides.head, sides.flat, sides.fixed, sides.fixed_flat,
                                          beta, sides.sizes)
    divergence = scatter_kept(divergence, sides.kept, sides.leading)
    return (divergence, scatter_kept(entropy, sides.kept, sides.leading)) if return_token_entropy else divergence
