"""Chunked LM-head autograd Functions: per-token statistics and losses without (N, V) logits.

Two ways through the chunk loop of `chunks.py`:

* `LinearTokenStats` returns per-token statistics (log p(target), entropy, mean log p). It saves
  only O(N) numbers and recomputes each chunk's logits in backward. Used when the loss is not
  known yet (`get_response_log_probs`, `fused_linear_logprobs`).
* `LinearLoss` takes the loss as a function of those statistics and computes the gradients of
  hidden/weight/bias during forward, so each chunk's logits are built once (three matmuls in all,
  like the materialized path). Backward only scales the stored gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from logitless._checks import check_choice, check_mask, check_positive, check_tensor, check_token_ids
from logitless.ops.backend import chunk_kernels
from logitless.ops.chunks import LinearGrads, chunk_logits, chunk_rows_for, raw_logits_grad, stat_dtype
from logitless.ops.grpo import check_grpo_inputs, metric_sums, metrics_from_sums, token_objective

# token_loss(rows, log_probs, entropy, mean_log_prob) -> (loss summed over the chunk's tokens,
# metric sums (M,)); rows is the chunk's slice of the (kept) tokens.
TokenLoss = Callable[[slice, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LinearTokenStats(torch.autograd.Function):
    """(N, H), (V, H) -> log_probs, entropy, mean_log_prob, each (N,) fp32; recomputes chunks in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, softcap: float | None, chunk_rows: int):
        num_rows = hidden.shape[0]
        kernels = chunk_kernels(hidden.device, stat_dtype(hidden.dtype))
        lse, log_probs, entropy, mean_log_prob = (
            torch.empty(num_rows, dtype=stat_dtype(hidden.dtype), device=hidden.device) for _ in range(4))
        for start in range(0, num_rows, chunk_rows):
            rows = slice(start, start + chunk_rows)
            stats = kernels.chunk_stats(chunk_logits(hidden[rows], weight, bias, temperature, softcap), targets[rows])
            lse[rows], log_probs[rows] = stats.lse, stats.log_probs
            entropy[rows], mean_log_prob[rows] = stats.entropy, stats.mean_log_prob
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.softcap, ctx.chunk_rows = temperature, softcap, chunk_rows
        ctx.set_materialize_grads(False)
        return log_probs, entropy, mean_log_prob

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, grad_mean_log_prob):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        grads = LinearGrads(hidden, weight, bias, ctx.needs_input_grad[:3])
        kernels = chunk_kernels(hidden.device, lse.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            logits = chunk_logits(hidden[rows], weight, bias, ctx.temperature, ctx.softcap)
            stats = kernels.chunk_stats(logits, targets[rows])
            grad = raw_logits_grad(kernels, logits, stats, targets[rows], ctx.temperature, ctx.softcap,
                                   *(None if g is None else g[rows].to(lse.dtype)
                                     for g in (grad_log_probs, grad_entropy, grad_mean_log_prob)))
            grads.add(rows, hidden[rows], weight, grad)
        return (*grads.result(weight, bias), None, None, None, None)


class LinearLoss(torch.autograd.Function):
    """Scalar loss = sum over chunks of ``token_loss``; gradients computed in forward when asked."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, softcap: float | None, chunk_rows: int,
                token_loss: TokenLoss, needs_grad: tuple[bool, bool, bool]):
        loss, metric_sums, input_grads = _loss_and_grads(hidden, weight, bias, targets, temperature, softcap,
                                                         chunk_rows, token_loss, needs_grad)
        # The gradients stay on ctx, not in save_for_backward: backward hands them over and drops its
        # reference, so the weight's gradient (the step's largest tensor at a 151k vocabulary) never
        # exists twice. A second backward (retain_graph, gradcheck) recomputes them from the inputs.
        ctx.input_grads = input_grads
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.recompute_args = (temperature, softcap, chunk_rows, token_loss, needs_grad)
        ctx.mark_non_differentiable(metric_sums)
        return loss, metric_sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        input_grads, ctx.input_grads = ctx.input_grads, None
        if input_grads is None:
            input_grads = _loss_and_grads(*ctx.saved_tensors, *ctx.recompute_args)[2]
        if not bool(grad_loss == 1):
            input_grads = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in input_grads]
        return (*input_grads, None, None, None, None, None, None)


def _loss_and_grads(hidden, weight, bias, targets, temperature, softcap, chunk_rows, token_loss, needs_grad):
    """One pass of the chunk loop: (loss, metric sums, (grad_hidden, grad_weight, grad_bias) or Nones)."""
    grads = LinearGrads(hidden, weight, bias, needs_grad) if any(needs_grad) else None
    kernels = chunk_kernels(hidden.device, stat_dtype(hidden.dtype))
    loss = torch.zeros((), dtype=stat_dtype(hidden.dtype), device=hidden.device)
    metric_sums = None
    for start in range(0, max(hidden.shape[0], 1), chunk_rows):  # one (empty) chunk when there are no rows
        rows = slice(start, start + chunk_rows)
        logits = chunk_logits(hidden[rows], weight, bias, temperature, softcap)
        stats = kernels.chunk_stats(logits, targets[rows])
        with torch.enable_grad():
            token_stats = [s.detach().requires_grad_(grads is not None)
                           for s in (stats.log_probs, stats.entropy, stats.mean_log_prob)]
            chunk_loss, chunk_metrics = token_loss(rows, *token_stats)
            stat_grads = (torch.autograd.grad(chunk_loss, token_stats, allow_unused=True)
                          if grads is not None and chunk_loss.requires_grad else None)
        if stat_grads is not None:
            grads.add(rows, hidden[rows], weight,
                      raw_logits_grad(kernels, logits, stats, targets[rows], temperature, softcap, *stat_grads))
        loss += chunk_loss.detach()
        metric_sums = chunk_metrics.detach() if metric_sums is None else metric_sums + chunk_metrics.detach()
    return loss, metric_sums, grads.result(weight, bias) if grads is not None else (None, None, None)


def _linear_inputs(hidden, weight, targets, bias, temperature, softcap, mask, targets_name="targets"):
    """Validate and flatten: hidden (..., H) -> (N, H), targets (...) -> (N,), mask -> kept row ids or None.

    Errors about ``targets`` call it ``targets_name``, the caller's name for it."""
    check_tensor("hidden", hidden, ndim=(2, 3), floating=True)
    check_tensor("weight", weight, ndim=2, floating=True)
    check_tensor(targets_name, targets, ndim=hidden.dim() - 1, integer=True)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: hidden size {weight.shape[1]} does not match hidden's last dim {hidden.shape[-1]}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (call .contiguous() first)")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"{targets_name}: shape {tuple(targets.shape)} does not match hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, floating=True)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias: length {bias.shape[0]} does not match the vocabulary size {weight.shape[0]}")
        bias = bias.to(weight.dtype)
    check_positive("temperature", temperature)
    if softcap is not None:
        check_positive("softcap", softcap)
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    kept = None
    if mask is not None:
        kept = check_mask("mask", mask, targets_name, targets).reshape(-1).nonzero().squeeze(1)
        flat_hidden, flat_targets = flat_hidden.index_select(0, kept), flat_targets[kept]
    check_token_ids(targets_name, flat_targets, weight.shape[0])
    return flat_hidden, flat_targets, bias, kept


def _scatter_rows(values: torch.Tensor, kept: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """Put per-kept-token values back at their positions; dropped tokens get 0."""
    if kept is None:
        return values.reshape(shape)
    full = torch.zeros(shape.numel(), dtype=values.dtype, device=values.device)
    return full.index_copy(0, kept, values).reshape(shape)


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None = None, temperature: float = 1.0, return_entropy: bool = False,
                          chunk_size: int | None = None, mask: torch.Tensor | None = None,
                          softcap: float | None = None):
    """log softmax(cap(hidden @ weight.T + bias) / temperature)[targets], without the (N, V) logits.

    hidden (N, H) or (B, T, H); weight (V, H); targets (N,) or (B, T). Returns log-probs with the
    shape of ``targets`` (fp32), and with ``return_entropy`` also the entropy: ``(log_probs, entropy)``.
    Both are differentiable. Tokens where ``mask`` is 0 are skipped before the matmul and get 0.
    ``softcap`` c soft-caps the logits to ``c * tanh(x / c)`` before the temperature (Gemma 2's
    ``final_logit_softcapping``); None leaves them as they are.
    """
    flat_hidden, flat_targets, bias, kept = _linear_inputs(hidden, weight, targets, bias, temperature, softcap, mask)
    rows = chunk_rows_for(flat_hidden.shape[0], weight.shape[0], chunk_size)
    log_probs, entropy, _ = LinearTokenStats.apply(flat_hidden, weight, bias, flat_targets, float(temperature),
                                                   softcap, rows)
    log_probs = _scatter_rows(log_probs, kept, targets.shape)
    return (log_probs, _scatter_rows(entropy, kept, targets.shape)) if return_entropy else log_probs


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                               label_smoothing: float = 0.0, temperature: float = 1.0,
                               chunk_size: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, as F.cross_entropy computes it.

    ``reduction`` is none | mean | sum; "mean" averages over the tokens not equal to ``ignore_index``
    (NaN when there are none, like PyTorch). Ignored tokens never reach the matmul.
    """
    check_choice("reduction", reduction, ("none", "mean", "sum"))
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing: must lie in [0, 1], got {label_smoothing}")
    check_tensor("targets", targets, integer=True)
    keep = targets != ignore_index
    flat_hidden, flat_targets, bias, kept = _linear_inputs(hidden, weight, targets, bias, temperature, softcap, keep)
    rows = chunk_rows_for(flat_hidden.shape[0], weight.shape[0], chunk_size)

    def token_loss(log_probs, mean_log_prob):
        return -(1.0 - label_smoothing) * log_probs - label_smoothing * mean_log_prob

    if reduction == "none":
        log_probs, _, mean_log_prob = LinearTokenStats.apply(flat_hidden, weight, bias, flat_targets,
                                                             float(temperature), softcap, rows)
        return _scatter_rows(token_loss(log_probs, mean_log_prob), kept, targets.shape)

    def chunk_loss(_rows, log_probs, _entropy, mean_log_prob):
        return token_loss(log_probs, mean_log_prob).sum(), torch.zeros(0)

    loss, _ = apply_linear_loss(flat_hidden, weight, bias, flat_targets, float(temperature), softcap, rows,
                                chunk_loss)
    return loss / flat_targets.shape[0] if reduction == "mean" else loss


def fused_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor,
                    completion_mask: torch.Tensor, advantages: torch.Tensor, *, bias: torch.Tensor | None = None,
                    old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                    beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.2, delta: float | None = None,
                    loss_type: str = "grpo", temperature: float = 1.0, max_completion_length: int | None = None,
                    num_items_in_batch: float | None = None, gradient_accumulation_steps: int = 1,
                    use_bias_correction_kl: bool = False, softcap: float | None = None,
                    chunk_size: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of TRL's GRPOTrainer, from hidden states (B, T, H) and the LM head, without logits.

    ``completion_ids``/``completion_mask``/``old_logprobs``/``ref_logprobs`` are (B, T); ``advantages``
    (B,), (B, 1) or (B, T) per token. ``loss_type`` is grpo | bnpo | dr_grpo | dapo (see `ops.grpo.token_weights`;
    ``max_completion_length`` defaults to T, ``num_items_in_batch`` to the mask's token count).
    ``beta > 0`` adds the k3 KL to ``ref_logprobs``. ``softcap`` as in `fused_linear_logprobs`.
    Gradients are computed during forward.
    Returns (loss, metrics) with TRL's metric names: kl (when ref_logprobs is given),
    clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, entropy (means over tokens),
    clip_ratio/low_min and clip_ratio/high_max (extremes over sequences of their clipped fractions).
    """
    check_tensor("hidden", hidden, ndim=3, floating=True)
    batch = check_grpo_inputs(completion_ids, completion_mask, advantages, old_logprobs, ref_logprobs, beta,
                              epsilon_low, epsilon_high, delta, loss_type, max_completion_length, num_items_in_batch,
                              gradient_accumulation_steps, use_bias_correction_kl)
    flat_hidden, flat_ids, bias, kept = _linear_inputs(hidden, weight, completion_ids, bias, temperature, softcap,
                                                       batch.keep, targets_name="completion_ids")

    def kept_tokens(per_token):  # (B, T) -> (kept,)
        return None if per_token is None else per_token.reshape(-1)[kept]

    num_sequences, length = completion_ids.shape
    token_sequence = torch.div(kept, length, rounding_mode="floor")  # (kept,) row of each kept token
    token_weight = kept_tokens(batch.weights)
    token_advantage = kept_tokens(batch.advantages.expand_as(completion_ids))
    token_old, token_ref = kept_tokens(batch.old_log_probs), kept_tokens(batch.ref_log_probs)

    def chunk_loss(rows, log_probs, entropy, _mean_log_prob):
        parts = token_objective(log_probs, token_advantage[rows], None if token_old is None else token_old[rows],
                                None if token_ref is None else token_ref[rows], batch.settings)
        return (parts[0] * token_weight[rows]).sum(), metric_sums(parts, entropy, token_sequence[rows], num_sequences)

    rows = chunk_rows_for(flat_hidden.shape[0], weight.shape[0], chunk_size)
    loss, sums = apply_linear_loss(flat_hidden, weight, bias, flat_ids, float(temperature), softcap, rows, chunk_loss)
    return loss, metrics_from_sums(sums, batch.keep.sum(dim=1), has_kl=ref_logprobs is not None)


def apply_linear_loss(hidden, weight, bias, targets, temperature: float, softcap: float | None, chunk_rows: int,
                      token_loss: TokenLoss):
    """Run `LinearLoss`, computing gradients in forward only for inputs that will need them."""
    enabled = torch.is_grad_enabled()
    needs_grad = tuple(enabled and t is not None and t.requires_grad for t in (hidden, weight, bias))
    return LinearLoss.apply(hidden, weight, bias, targets, temperature, softcap, chunk_rows, token_loss, needs_grad)
