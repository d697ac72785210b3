"""Fused LM-head ops: log-probs, entropy and losses from hidden states and the output embedding,
without (N, V) logits.

Each public op checks and flattens its inputs, then runs its steps by the chain of implementations its ``impl`` names
(`api.implementations`): the per-token statistics (`linear_token_stats`: log p(target), entropy and mean log p, and
on request the statistics without gradient of `softmax.TOKEN_EXTRAS`, TRL's log_sum_sq_probs, mean_logits,
is_top1), or a loss that is a sum of per-token terms of them (cross-entropy, TRL's GRPO objective), which the one
pass computes with its gradients during forward where that pays (`one_pass.py`) and the others as the statistics
then the loss. Either way the loss is ordinary PyTorch on (N,) statistics. Every public op takes ``impl`` and
``block_sizes`` (a `BlockSizes`; the defaults are `plan.default_block_sizes`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from logitless._checks import (check_choice, check_head_shapes, check_impl, check_mask, check_strings,
                               check_tensor, check_token_ids, checked_keywords, head_wholes)
from logitless.op_settings import GRPO_OPTIONS, BlockSizes, GRPOSettings
from logitless.ops.api import first_that_runs, implementations
from logitless.ops.grpo import check_grpo_inputs, grpo_objective, grpo_token_loss
from logitless.ops.head import LinearHead, op_head, stat_dtype
from logitless.ops.one_pass import TokenLoss
from logitless.ops.sharded import on_this_rank
from logitless.ops.softmax import TOKEN_EXTRAS


@checked_keywords(wholes=head_wholes(""))
def linear_token_stats(hidden: torch.Tensor, weight: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                       *, head: LinearHead | None = None, bias: torch.Tensor | None = None, temperature: float = 1.0,
                       softcap: float | None = None, logit_scale: float = 1.0, need_entropy: bool = True,
                       need_mean_log_prob: bool = False, extras: tuple[str, ...] = (),
                       block_sizes: BlockSizes | None = None, impl: str = "auto"):
    """(log_probs, entropy, mean_log_prob), each (N,), of flat hidden (N, H) and targets (N,); differentiable.

    The head as in `fused_linear_logprobs` (``weight`` and its options, or ``head=``). ``extras``: names among
    `TOKEN_EXTRAS`, statistics computed in the same pass over the blocks, without gradient: ``"log_sum_sq_probs"``
    log sum_v p_v^2, ``"mean_logits"`` the mean of the V logits (-inf where one is -inf), ``"is_top1"`` (bool)
    whether the target is the first argmax of the logits, as ``torch.argmax`` picks it. With any, a fourth item
    follows: a dict of them by name. ``impl``: "auto", "chunked" or "triton" (the block engine always)."""
    head = op_head(head, weight, bias, temperature, softcap, logit_scale)
    for index, name in enumerate(check_strings("extras", extras)):
        check_choice(f"extras[{index}]", name, TOKEN_EXTRAS)
    extras = tuple(dict.fromkeys(extras))
    check_impl(impl, ("auto", "chunked", "triton"))
    if isinstance(head.weight, DTensor):  # sharded on the vocabulary: this rank's shard (`sharded.py`)
        head, hidden = on_this_rank(head, hidden)
    chain = implementations(impl, hidden.device, stat_dtype(hidden.dtype))
    log_probs, entropy, mean_log_prob, extra_values = first_that_runs(
        chain, "token_stats", head, hidden, targets, need_entropy=need_entropy, need_mean_log_prob=need_mean_log_prob,
        extras=extras, sizes=BlockSizes.of(block_sizes))
    if not extras:
        return log_probs, entropy, mean_log_prob
    return log_probs, entropy, mean_log_prob, extra_values


def linear_loss(chain: tuple, head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, token_loss: TokenLoss, *,
                need_entropy: bool = False, need_mean_log_prob: bool = False, sizes: BlockSizes = BlockSizes(),
                loss_inputs: tuple = ()):
    """(loss, log_probs (N,), entropy (N,) or None) of a loss summed over per-token terms of the statistics, by the
    first implementation of ``chain`` that runs it (`api.py`: the one pass where it pays, else the statistics then the
    loss).

    ``token_loss(rows, log_probs, entropy, mean_log_prob)`` is the loss summed over the tokens ``rows``; it may read
    the entropy (a metric) but not differentiate it. log_probs and entropy are returned without a graph (for
    metrics). ``loss_inputs``: the other tensors ``token_loss`` reads (advantages, old log-probs...); when one of them
    needs a gradient, the two passes run, whose loss autograd differentiates with respect to everything.
    """
    return first_that_runs(chain, "loss", head, hidden, targets, token_loss, need_entropy=need_entropy,
                           need_mean_log_prob=need_mean_log_prob, sizes=sizes, loss_inputs=loss_inputs)


def _on_this_rank(head: LinearHead, hidden, chain: tuple):
    """(head, hidden) of an op on this rank (`sharded.on_this_rank`): a head sharded on the vocabulary runs its local
    shard, or whole for an implementation of the whole vocabulary; a plain head and plain hidden states as they are."""
    if not isinstance(head.weight, DTensor):
        return head, hidden
    return on_this_rank(head, hidden, materialize=chain[0].whole_vocabulary)


def _linear_inputs(head: LinearHead, hidden, targets, mask, targets_name="targets"):
    """Validate and flatten: (hidden (..., H) -> (N, H), targets (...) -> (N,), kept row ids or None).

    Tokens where ``mask`` is 0 are dropped here. Errors about ``targets`` call it ``targets_name``."""
    check_tensor("hidden", hidden, ndim=(2, 3), floating=True)
    check_tensor(targets_name, targets, ndim=hidden.dim() - 1, integer=True)
    check_head_shapes(hidden, head.weight, targets, targets_name)
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    kept = None
    if mask is not None:
        kept = check_mask("mask", mask, targets_name, targets).reshape(-1).nonzero().squeeze(1)
        flat_hidden, flat_targets = flat_hidden.index_select(0, kept), flat_targets[kept]
    check_token_ids(targets_name, flat_targets, head.whole_vocab_size)
    return flat_hidden, flat_targets, kept


def scatter_kept(values: torch.Tensor, kept: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """Per-kept-token values (K,) back at their positions among the tokens of ``shape`` (the leading dims); dropped
    tokens get 0."""
    if kept is None:
        return values.reshape(shape)
    full = torch.zeros(shape.numel(), dtype=values.dtype, device=values.device)
    return full.index_copy(0, kept, values).reshape(shape)


@checked_keywords(wholes=head_wholes(""))
def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                          *, head: LinearHead | None = None, bias: torch.Tensor | None = None, temperature: float = 1.0,
                          softcap: float | None = None, logit_scale: float = 1.0, mask: torch.Tensor | None = None,
                          return_token_entropy: bool = False, block_sizes: BlockSizes | None = None,
                          impl: str = "auto"):
    """log softmax(logits)[targets] with ``logits = cap(logit_scale * (hidden @ weight.T + bias)) / temperature``,
    without the (N, V) logits.

    hidden (N, H) or (B, T, H); weight (V, H); targets (N,) or (B, T). The head is given in parts (``weight``,
    ``bias``, ``temperature``, ``softcap``, ``logit_scale``) or whole (``head=LinearHead(...)``, without the
    parts). Returns log-probs with the shape of ``targets`` (fp32; fp64 for fp64 inputs), and with
    ``return_token_entropy`` also the entropy: ``(log_probs, entropy)``. Both are differentiable. Tokens where
    ``mask`` is 0 are skipped before the matmul and get 0. ``softcap`` c soft-caps the logits to
    ``c * tanh(x / c)`` (Gemma 2's ``final_logit_softcapping``); None leaves them as they are. ``block_sizes`` (a
    `BlockSizes`: tokens per row chunk, vocabulary entries per block) overrides the per-device block sizes.
    ``impl`` is "auto" | "reference" (the materialized logits) | "chunked" (PyTorch blocks) | "triton" (Triton
    kernels on the blocks).
    """
    head = op_head(head, weight, bias, temperature, softcap, logit_scale)
    check_tensor("hidden", hidden, ndim=(2, 3), floating=True)
    chain = implementations(impl, hidden.device, stat_dtype(hidden.dtype))
    head, hidden = _on_this_rank(head, hidden, chain)
    flat_hidden, flat_targets, kept = _linear_inputs(head, hidden, targets, mask)
    log_probs, entropy, _, _ = first_that_runs(chain, "token_stats", head, flat_hidden, flat_targets,
                                               need_entropy=return_token_entropy, sizes=BlockSizes.of(block_sizes))
    log_probs = scatter_kept(log_probs, kept, targets.shape)
    return (log_probs, scatter_kept(entropy, kept, targets.shape)) if return_token_entropy else log_probs


@checked_keywords(wholes=head_wholes(""))
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor | None = None,
                               targets: torch.Tensor | None = None, *, head: LinearHead | None = None,
                               bias: torch.Tensor | None = None, temperature: float = 1.0, softcap: float | None = None,
                               logit_scale: float = 1.0, ignore_index: int = -100, reduction: str = "mean",
                               label_smoothing: float = 0.0, block_sizes: BlockSizes | None = None,
                               impl: str = "auto") -> torch.Tensor:
    """Cross-entropy of the head's logits against ``targets``, as F.cross_entropy computes it, in fp32.

    ``reduction`` is none | mean | sum; "mean" averages over the tokens not equal to ``ignore_index``
    (NaN when there are none, with zero gradients, like PyTorch). Ignored tokens never reach the matmul.
    The head (in parts or ``head=``), ``block_sizes`` and ``impl`` as in `fused_linear_logprobs`.
    """
    head = op_head(head, weight, bias, temperature, softcap, logit_scale)
    check_choice("reduction", reduction, ("none", "mean", "sum"))
    check_impl(impl)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing: expected a number in [0, 1], got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    sizes = BlockSizes.of(block_sizes)
    check_tensor("targets", targets, integer=True)
    check_tensor("hidden", hidden, ndim=(2, 3), floating=True)
    chain = implementations(impl, hidden.device, stat_dtype(hidden.dtype))
    head, hidden = _on_this_rank(head, hidden, chain)
    keep = targets != ignore_index
    flat_hidden, flat_targets, kept = _linear_inputs(head, hidden, targets, keep)
    if reduction == "none":
        log_probs, _, mean_log_prob, _ = first_that_runs(chain, "token_stats", head, flat_hidden, flat_targets,
                                                         need_entropy=False, need_mean_log_prob=label_smoothing > 0,
                                                         sizes=sizes)
        return scatter_kept(_cross_entropy_terms(log_probs, mean_log_prob, label_smoothing), kept, targets.shape)
    num_tokens = flat_targets.shape[0]
    scale = 1.0 / num_tokens if reduction == "mean" and num_tokens else 1.0

    def token_loss(_rows, log_probs, _entropy, mean_log_prob):
        return _cross_entropy_terms(log_probs, mean_log_prob, label_smoothing).sum() * scale

    loss, _, _ = linear_loss(chain, head, flat_hidden, flat_targets, token_loss,
                             need_mean_log_prob=label_smoothing > 0, sizes=sizes)
    if reduction == "mean" and not num_tokens:
        return loss + float("nan")  # the mean of no tokens is NaN, with zero gradients, as in PyTorch
    return loss


def _cross_entropy_terms(log_probs, mean_log_prob, label_smoothing: float):
    """Per-token cross-entropy with label smoothing, from the statistics."""
    if label_smoothing == 0:
        return -log_probs
    return -(1.0 - label_smoothing) * log_probs - label_smoothing * mean_log_prob


@checked_keywords(options=GRPO_OPTIONS, wholes=head_wholes(""))
def fused_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor | None = None,
                    completion_ids: torch.Tensor | None = None, completion_mask: torch.Tensor | None = None,
                    advantages: torch.Tensor | None = None, *, head: LinearHead | None = None,
                    bias: torch.Tensor | None = None, temperature: float = 1.0, softcap: float | None = None,
                    logit_scale: float = 1.0, old_log_probs: torch.Tensor | None = None,
                    ref_log_probs: torch.Tensor | None = None, sampling_log_probs: torch.Tensor | None = None,
                    importance_sampling_ratio: torch.Tensor | None = None, settings: GRPOSettings | None = None,
                    num_items_in_batch: float | None = None, block_sizes: BlockSizes | None = None,
                    impl: str = "auto", **options) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of TRL 1.16's GRPOTrainer, every loss type and option, from hidden states (B, T, H) and the
    LM head, without logits.

    ``completion_ids``/``completion_mask``/``old_log_probs``/``ref_log_probs`` are (B, T); ``advantages``
    (B,), (B, 1) or (B, T) per token. ``settings`` (a `GRPOSettings`: loss type, beta, epsilons, importance
    sampling level, entropy mask and bonus, off-policy mask...) holds the loss's options; each may also be given
    as a keyword of its field's name (``beta=0.04``), alone or agreeing with ``settings``. ``beta > 0`` adds the
    k3 KL to ``ref_log_probs``. ``sampling_log_probs`` (B, T): the sampler's log-probs, which the off-policy mask
    compares with (default: ``old_log_probs``); ``importance_sampling_ratio`` (B, T) or (B, 1): a sampler's
    correction (vLLM's in TRL) multiplying the policy term. ``num_items_in_batch`` is the normalizer of dapo,
    cispo and vespo (default: the mask's token count). The head (in parts or ``head=``), ``block_sizes`` and
    ``impl`` as in `fused_linear_logprobs`. The entropy carries its gradient (the entropy bonus).
    Returns (loss, metrics) with TRL's metric names: kl (when ref_log_probs is given) and entropy (means over
    tokens); for the clipped loss types clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean,
    clip_ratio/low_min and clip_ratio/high_max; cispo_clip_ratio; vespo/phi_seq_mean.
    """
    head = op_head(head, weight, bias, temperature, softcap, logit_scale)
    check_impl(impl)
    sizes = BlockSizes.of(block_sizes)
    check_tensor("hidden", hidden, ndim=3, floating=True)
    settings = GRPOSettings.of(settings, options)
    batch = check_grpo_inputs(completion_ids, completion_mask, advantages, old_log_probs, ref_log_probs, settings,
                              num_items_in_batch, sampling_log_probs, importance_sampling_ratio,
                              stat_dtype(hidden.dtype))
    tensors = dict(old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, sampling_log_probs=sampling_log_probs,
                   importance_sampling_ratio=importance_sampling_ratio, num_items_in_batch=num_items_in_batch)
    chain = implementations(impl, hidden.device, stat_dtype(hidden.dtype))
    head, hidden = _on_this_rank(head, hidden, chain)
    flat_hidden, flat_ids, kept = _linear_inputs(head, hidden, completion_ids, batch.keep,
                                                 targets_name="completion_ids")

    def per_token(values):  # (K,) -> (B, T)
        return scatter_kept(values, kept, completion_ids.shape)

    if settings.per_token and importance_sampling_ratio is None:  # each token's gradient known from its log-prob

        def token_loss(rows, log_probs, _entropy, _mean_log_prob):
            return grpo_token_loss(log_probs, batch, rows)

        loss, log_probs, entropy = linear_loss(chain, head, flat_hidden, flat_ids, token_loss, need_entropy=True,
                                               sizes=sizes, loss_inputs=(advantages, old_log_probs, ref_log_probs))
        with torch.no_grad():
            _, metrics = grpo_objective(per_token(log_probs), per_token(entropy), batch.keep, advantages, settings,
                                        **tensors)
        return loss, metrics
    log_probs, entropy, _, _ = first_that_runs(chain, "token_stats", head, flat_hidden, flat_ids, need_entropy=True,
                                               sizes=sizes)  # (K,) each, differentiable
    return grpo_objective(per_token(log_probs), per_token(entropy), batch.keep, advantages, settings, **tensors)
