"""Fused LM-head ops: log-probs, entropy and losses from hidden states and the output embedding,
without (N, V) logits.

Two autograd Functions over the chunk loops of `loops.py`:

* `LinearTokenStats`: per-token log p(target), entropy and mean log p. Forward is the two-pass
  schedule's pass 1 (saving O(N) numbers), backward its pass 2. For statistics whose loss is not
  known yet (`fused_linear_logprobs`).
* `LinearLoss`: a loss that is a sum of per-token terms of those statistics (cross-entropy, TRL's
  GRPO objective), with its gradients computed during forward in one pass where that pays (CPU,
  fp32 weights); backward only scales them.

`linear_loss` picks between them; either way the loss is ordinary PyTorch on (N,) statistics.
"""

from __future__ import annotations

import torch

from logitless._checks import check_choice, check_head_shapes, check_mask, check_tensor, check_token_ids
from logitless.ops.backend import chunk_kernels
from logitless.ops.grpo import check_grpo_inputs, grpo_metrics, grpo_token_loss
from logitless.ops.head import LinearHead, stat_dtype
from logitless.ops.loops import BlockPlan, TokenLoss, input_grads, loss_and_grads, plan_blocks, token_stats


class LinearTokenStats(torch.autograd.Function):
    """hidden (N, H), head -> log_probs, entropy, mean_log_prob, each (N,) in stat dtype.

    ``weight`` and ``bias`` are the head's own tensors, passed again so that autograd sees them as
    inputs. Statistics not asked for come back as zeros and carry no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head: LinearHead, plan: BlockPlan, need_entropy: bool,
                need_mean_log_prob: bool):
        kernels = chunk_kernels(hidden.device, stat_dtype(hidden.dtype))
        stats = token_stats(head, hidden, targets, plan, kernels, need_entropy, need_mean_log_prob)
        expected_logit = stats.lse - stats.entropy if need_entropy else None  # E_p[z], for the entropy's gradient
        ctx.save_for_backward(hidden, weight, bias, targets, stats.lse, expected_logit)
        ctx.head, ctx.plan = head, plan
        ctx.set_materialize_grads(False)
        absent = [s is None for s in (stats.entropy, stats.mean_log_prob)]
        entropy, mean_log_prob = (torch.zeros_like(stats.lse) if s is None else s
                                  for s in (stats.entropy, stats.mean_log_prob))
        ctx.mark_non_differentiable(*(s for s, missing in zip((entropy, mean_log_prob), absent) if missing))
        return stats.log_probs, entropy, mean_log_prob

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, grad_mean_log_prob):
        hidden, weight, bias, targets, lse, expected_logit = ctx.saved_tensors
        kernels = chunk_kernels(hidden.device, lse.dtype)
        grads = input_grads(ctx.head, hidden, targets, lse, expected_logit, grad_log_probs, grad_entropy,
                            grad_mean_log_prob, ctx.needs_input_grad[:3], ctx.plan, kernels)
        return (*grads, None, None, None, None, None)


class LinearLoss(torch.autograd.Function):
    """A loss summed over per-token terms (``token_loss``), and the statistics it was computed from.

    Returns (loss (), log_probs (N,), entropy (N,) or zeros); the statistics carry no gradient. The
    gradients of hidden/weight/bias are computed in forward (`loss_and_grads`) and kept on ctx, not
    in save_for_backward: backward hands them over and drops its reference, so the weight's gradient
    (the step's largest tensor at a 151k vocabulary) never exists twice. A second backward
    (retain_graph, gradcheck) recomputes them from the inputs.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head: LinearHead, plan: BlockPlan, token_loss: TokenLoss,
                need_entropy: bool, need_mean_log_prob: bool, needs: tuple[bool, bool, bool]):
        ctx.recompute = (head, plan, token_loss, needs, need_entropy, need_mean_log_prob)
        loss, stats, input_grads_ = loss_and_grads(*_positional(hidden, targets, ctx.recompute))
        ctx.input_grads = input_grads_
        ctx.save_for_backward(hidden, weight, bias, targets)
        entropy = torch.zeros_like(stats.lse) if stats.entropy is None else stats.entropy
        ctx.mark_non_differentiable(stats.log_probs, entropy)
        return loss, stats.log_probs, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_log_probs, _grad_entropy):
        input_grads_, ctx.input_grads = ctx.input_grads, None
        if input_grads_ is None:
            hidden, _, _, targets = ctx.saved_tensors
            input_grads_ = loss_and_grads(*_positional(hidden, targets, ctx.recompute))[2]
        if not bool(grad_loss == 1):
            input_grads_ = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in input_grads_]
        return (*input_grads_, None, None, None, None, None, None, None)


def _positional(hidden, targets, recompute):
    """`loss_and_grads`'s arguments from a `LinearLoss` call's inputs and settings."""
    head, plan, token_loss, needs, need_entropy, need_mean_log_prob = recompute
    return head, hidden, targets, plan, token_loss, needs, need_entropy, need_mean_log_prob


def linear_token_stats(head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, *, need_entropy: bool = True,
                       need_mean_log_prob: bool = False, chunk_size: int | None = None,
                       vocab_block_size: int | None = None):
    """(log_probs, entropy, mean_log_prob), each (N,), of flat hidden (N, H) and targets (N,); differentiable."""
    plan = plan_blocks(hidden.shape[0], head, hidden.device, chunk_size, vocab_block_size)
    return LinearTokenStats.apply(hidden, head.weight, head.bias, targets, head, plan, need_entropy,
                                  need_mean_log_prob)


def linear_loss(head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, token_loss: TokenLoss, *,
                need_entropy: bool = False, need_mean_log_prob: bool = False, chunk_size: int | None = None,
                vocab_block_size: int | None = None):
    """(loss, log_probs (N,), entropy (N,) or None) of a loss summed over per-token terms of the statistics.

    ``token_loss(rows, log_probs, entropy, mean_log_prob)`` is the loss summed over the tokens ``rows``; it
    may read the entropy (a metric) but not differentiate it.
    One pass with the gradients computed in forward where `plan_blocks` says it pays; otherwise the
    statistics of `LinearTokenStats` and ``token_loss`` over all tokens. log_probs and entropy are
    returned without a graph (for metrics).
    """
    needs = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, head.weight, head.bias))
    plan = plan_blocks(hidden.shape[0], head, hidden.device, chunk_size, vocab_block_size, loss_known=any(needs))
    if plan.single_pass:
        loss, log_probs, entropy = LinearLoss.apply(hidden, head.weight, head.bias, targets, head, plan, token_loss,
                                                    need_entropy, need_mean_log_prob, needs)
        return loss, log_probs, entropy if need_entropy else None
    log_probs, entropy, mean_log_prob = LinearTokenStats.apply(hidden, head.weight, head.bias, targets, head, plan,
                                                               need_entropy, need_mean_log_prob)
    loss = token_loss(slice(None), log_probs, entropy.detach() if need_entropy else None,
                      mean_log_prob if need_mean_log_prob else None)
    return loss, log_probs.detach(), entropy.detach() if need_entropy else None


def _linear_inputs(hidden, weight, targets, bias, temperature, softcap, logit_scale, mask, targets_name="targets"):
    """Validate and flatten: (head, hidden (..., H) -> (N, H), targets (...) -> (N,), kept row ids or None).

    Tokens where ``mask`` is 0 are dropped here. Errors about ``targets`` call it ``targets_name``."""
    check_tensor("hidden", hidden, ndim=(2, 3), floating=True)
    check_tensor("weight", weight, ndim=2, floating=True)
    check_tensor(targets_name, targets, ndim=hidden.dim() - 1, integer=True)
    check_head_shapes(hidden, weight, targets, targets_name)
    head = LinearHead(weight, bias, temperature, softcap, logit_scale)
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    kept = None
    if mask is not None:
        kept = check_mask("mask", mask, targets_name, targets).reshape(-1).nonzero().squeeze(1)
        flat_hidden, flat_targets = flat_hidden.index_select(0, kept), flat_targets[kept]
    check_token_ids(targets_name, flat_targets, weight.shape[0])
    return head, flat_hidden, flat_targets, kept


def _scatter_rows(values: torch.Tensor, kept: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """Put per-kept-token values back at their positions; dropped tokens get 0."""
    if kept is None:
        return values.reshape(shape)
    full = torch.zeros(shape.numel(), dtype=values.dtype, device=values.device)
    return full.index_copy(0, kept, values).reshape(shape)


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None = None, temperature: float = 1.0, return_entropy: bool = False,
                          chunk_size: int | None = None, mask: torch.Tensor | None = None,
                          softcap: float | None = None, logit_scale: float = 1.0,
                          vocab_block_size: int | None = None):
    """log softmax(logits)[targets] with ``logits = cap(logit_scale * (hidden @ weight.T + bias)) / temperature``,
    without the (N, V) logits.

    hidden (N, H) or (B, T, H); weight (V, H); targets (N,) or (B, T). Returns log-probs with the
    shape of ``targets`` (fp32; fp64 for fp64 inputs), and with ``return_entropy`` also the entropy:
    ``(log_probs, entropy)``. Both are differentiable. Tokens where ``mask`` is 0 are skipped before
    the matmul and get 0. ``softcap`` c soft-caps the logits to ``c * tanh(x / c)`` (Gemma 2's
    ``final_logit_softcapping``); None leaves them as they are. ``chunk_size`` (tokens per row chunk)
    and ``vocab_block_size`` (vocabulary entries per block) override the per-device block sizes.
    """
    head, flat_hidden, flat_targets, kept = _linear_inputs(hidden, weight, targets, bias, temperature, softcap,
                                                           logit_scale, mask)
    log_probs, entropy, _ = linear_token_stats(head, flat_hidden, flat_targets, need_entropy=return_entropy,
                                               chunk_size=chunk_size, vocab_block_size=vocab_block_size)
    log_probs = _scatter_rows(log_probs, kept, targets.shape)
    return (log_probs, _scatter_rows(entropy, kept, targets.shape)) if return_entropy else log_probs


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                               label_smoothing: float = 0.0, temperature: float = 1.0,
                               chunk_size: int | None = None, softcap: float | None = None,
                               logit_scale: float = 1.0, vocab_block_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of the head's logits against ``targets``, as F.cross_entropy computes it, in fp32.

    ``reduction`` is none | mean | sum; "mean" averages over the tokens not equal to ``ignore_index``
    (NaN when there are none, with zero gradients, like PyTorch). Ignored tokens never reach the matmul.
    """
    check_choice("reduction", reduction, ("none", "mean", "sum"))
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing: must lie in [0, 1], got {label_smoothing}")
    check_tensor("targets", targets, integer=True)
    keep = targets != ignore_index
    head, flat_hidden, flat_targets, kept = _linear_inputs(hidden, weight, targets, bias, temperature, softcap,
                                                           logit_scale, keep)
    if reduction == "none":
        log_probs, _, mean_log_prob = linear_token_stats(head, flat_hidden, flat_targets, need_entropy=False,
                                                         need_mean_log_prob=label_smoothing > 0, chunk_size=chunk_size,
                                                         vocab_block_size=vocab_block_size)
        return _scatter_rows(_cross_entropy_terms(log_probs, mean_log_prob, label_smoothing), kept, targets.shape)
    num_tokens = flat_targets.shape[0]
    scale = 1.0 / num_tokens if reduction == "mean" and num_tokens else 1.0

    def token_loss(_rows, log_probs, _entropy, mean_log_prob):
        return _cross_entropy_terms(log_probs, mean_log_prob, label_smoothing).sum() * scale

    loss, _, _ = linear_loss(head, flat_hidden, flat_targets, token_loss, need_mean_log_prob=label_smoothing > 0,
                             chunk_size=chunk_size, vocab_block_size=vocab_block_size)
    if reduction == "mean" and not num_tokens:
        return loss + float("nan")  # the mean of no tokens is NaN, with zero gradients, as in PyTorch
    return loss


def _cross_entropy_terms(log_probs, mean_log_prob, label_smoothing: float):
    """Per-token cross-entropy with label smoothing, from the statistics."""
    if label_smoothing == 0:
        return -log_probs
    return -(1.0 - label_smoothing) * log_probs - label_smoothing * mean_log_prob


def fused_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor,
                    completion_mask: torch.Tensor, advantages: torch.Tensor, *, bias: torch.Tensor | None = None,
                    old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                    beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.2, delta: float | None = None,
                    loss_type: str = "grpo", temperature: float = 1.0, max_completion_length: int | None = None,
                    num_items_in_batch: float | None = None, gradient_accumulation_steps: int = 1,
                    use_bias_correction_kl: bool = False, softcap: float | None = None, logit_scale: float = 1.0,
                    chunk_size: int | None = None,
                    vocab_block_size: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of TRL's GRPOTrainer, from hidden states (B, T, H) and the LM head, without logits.

    ``completion_ids``/``completion_mask``/``old_logprobs``/``ref_logprobs`` are (B, T); ``advantages``
    (B,), (B, 1) or (B, T) per token. ``loss_type`` is grpo | bnpo | dr_grpo | dapo (see `ops.grpo.token_weights`;
    ``max_completion_length`` defaults to T, ``num_items_in_batch`` to the mask's token count).
    ``beta > 0`` adds the k3 KL to ``ref_logprobs``. Head options as in `fused_linear_logprobs`.
    Returns (loss, metrics) with TRL's metric names: kl (when ref_logprobs is given),
    clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, entropy (means over tokens),
    clip_ratio/low_min and clip_ratio/high_max (extremes over sequences of their clipped fractions).
    """
    check_tensor("hidden", hidden, ndim=3, floating=True)
    batch = check_grpo_inputs(completion_ids, completion_mask, advantages, old_logprobs, ref_logprobs, beta,
                              epsilon_low, epsilon_high, delta, loss_type, max_completion_length, num_items_in_batch,
                              gradient_accumulation_steps, use_bias_correction_kl)
    head, flat_hidden, flat_ids, _ = _linear_inputs(hidden, weight, completion_ids, bias, temperature, softcap,
                                                    logit_scale, batch.keep, targets_name="completion_ids")
    def token_loss(rows, log_probs, _entropy, _mean_log_prob):
        return grpo_token_loss(log_probs, batch, rows)

    loss, log_probs, entropy = linear_loss(head, flat_hidden, flat_ids, token_loss, need_entropy=True,
                                           chunk_size=chunk_size, vocab_block_size=vocab_block_size)  # (K,) stats
    return loss, grpo_metrics(log_probs, entropy, batch, has_kl=ref_logprobs is not None)
