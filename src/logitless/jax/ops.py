"""The public JAX ops of one LM head: `fused_linear_logprobs`, `fused_linear_cross_entropy` and `fused_grpo_loss`,
with the arguments and semantics of the PyTorch ones.

Each takes ``impl="auto"`` (default) or ``"chunked"``: the block engine through `fused.linear_stats`, vocabulary
blocks, no (N, V) array, sharded as the inputs are (`sharding.fused_stats`); or ``impl="reference"``: the plain-JAX
oracle of `reference.py`. The head is ``weight`` with ``bias``, ``temperature``, ``softcap`` and ``logit_scale``,
or ``head=Head(...)``. All are jit-able: ``temperature``, ``softcap``, ``logit_scale``, ``settings`` (and the GRPO
options given as keywords), ``block_sizes``, ``impl`` and the CE's options are Python values (static); arrays,
``num_items_in_batch`` included, may be traced.

Masked tokens cost compute (shapes are static under jit, so they cannot be dropped as the PyTorch ops drop them)
but contribute nothing: their ids are replaced by 0 and their statistics by 0, with no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from logitless._checks import (JAX_IMPLS, check_advantages_shape, check_choice, check_completion_mask_given,
                               check_grpo_options, check_impl,
                               checked_keywords, head_wholes)
from logitless.jax import reference
from logitless.jax.checks import (check_array, check_finite, check_mask, check_same_shape,
                                  check_token_ids, concrete, take_head)
from logitless.jax.fused import TokenLoss
from logitless.jax.grpo import GRPOData, GRPOTerms, grpo_objective, token_weights
from logitless.jax.head import Head
from logitless.jax.sharding import fused_loss, fused_stats
from logitless.jax.softmax import SoftmaxAccumulator, SoftmaxStats
from logitless.op_settings import GRPO_OPTIONS, BlockSizes, GRPOSettings


class LinearInputs(NamedTuple):
    """Validated LM-head inputs, flattened over tokens."""

    head: Head
    hidden: jax.Array  # (N, H)
    targets: jax.Array  # (N,); 0 where masked, so every id indexes the vocabulary
    keep: jax.Array | None  # (N,) bool, or None when nothing is masked
    block_sizes: BlockSizes


def _linear_inputs(hidden, weight, targets, bias, temperature, softcap, logit_scale, head, mask, block_sizes,
                   impl, targets_name: str = "targets", mask_name: str = "mask") -> LinearInputs:
    check_impl(impl, JAX_IMPLS)
    hidden = check_array("hidden", hidden, ndim=(2, 3), floating=True)
    head = take_head(head, weight, bias, temperature, softcap, logit_scale, hidden)
    if targets is None:
        raise TypeError(f"{targets_name}: expected an integer array of token ids, got None")
    targets = check_array(targets_name, targets, ndim=hidden.ndim - 1, integer=True)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"{targets_name}: shape {tuple(targets.shape)} does not match hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}")
    keep = None if mask is None else check_mask(mask_name, mask, targets_name, targets)
    check_token_ids(targets_name, targets, head.vocab_size, keep)
    flat_targets = targets.reshape(-1)
    flat_keep = None if keep is None else keep.reshape(-1)
    if flat_keep is not None:
        flat_targets = jnp.where(flat_keep, flat_targets, 0)
    return LinearInputs(head, hidden.reshape(-1, hidden.shape[-1]), flat_targets, flat_keep,
                        BlockSizes.of(block_sizes))


def _kept_stats(inputs: LinearInputs, outputs: tuple, need_entropy: bool, need_mean_log_prob: bool) -> SoftmaxStats:
    """The (N,) outputs (log_probs, entropy, mean_log_prob) as statistics: those asked for (else None), 0 where
    masked; the log-sum-exp is left out (None)."""
    log_probs, entropy, mean_log_prob = outputs
    stats = SoftmaxStats(log_probs, None, entropy if need_entropy else None,
                         mean_log_prob if need_mean_log_prob else None)
    if inputs.keep is None:
        return stats
    return SoftmaxStats(*(None if value is None else jnp.where(inputs.keep, value, 0.0) for value in stats))


def _reference_outputs(inputs: LinearInputs) -> tuple[SoftmaxStats, tuple]:
    log_probs, entropy, mean_log_prob = reference.token_stats(inputs.head, inputs.hidden, inputs.targets)
    return SoftmaxStats(log_probs, None, entropy, mean_log_prob), (log_probs, entropy, mean_log_prob)


def _token_stats(inputs: LinearInputs, impl: str, need_entropy: bool = False,
                 need_mean_log_prob: bool = False) -> SoftmaxStats:
    """(N,) log-probs, and the entropies and mean log-probs asked for, as `_kept_stats` gives them."""
    if impl == "reference":
        outputs = _reference_outputs(inputs)[1]
    else:
        accumulator = SoftmaxAccumulator(inputs.head.vocab_size, need_entropy, need_mean_log_prob)
        outputs = fused_stats(accumulator, inputs.block_sizes, (inputs.head,), (inputs.hidden,), inputs.targets)
    return _kept_stats(inputs, outputs, need_entropy, need_mean_log_prob)


def _loss(inputs: LinearInputs, impl: str, token_loss: TokenLoss, loss_data, need_entropy: bool = False,
          need_mean_log_prob: bool = False) -> tuple[jax.Array, SoftmaxStats]:
    """(the sum of ``token_loss``'s terms over all tokens (), the statistics as `_token_stats` gives them, without
    gradient). ``loss_data``: the loss's per-token arrays (N,)."""
    if impl == "reference":
        stats, outputs = _reference_outputs(inputs)
        loss, outputs = token_loss(stats, loss_data).sum(), jax.lax.stop_gradient(outputs)
    else:
        accumulator = SoftmaxAccumulator(inputs.head.vocab_size, need_entropy, need_mean_log_prob)
        loss, outputs = fused_loss(accumulator, inputs.block_sizes, token_loss, inputs.head, inputs.hidden,
                                   inputs.targets, loss_data)
    return loss, _kept_stats(inputs, outputs, need_entropy, need_mean_log_prob)


@checked_keywords(wholes=head_wholes(""))
def fused_linear_logprobs(hidden, weight=None, targets=None, *, bias=None, temperature: float = 1.0,
                          return_token_entropy: bool = False, mask=None, softcap: float | None = None,
                          logit_scale: float = 1.0, block_sizes: BlockSizes | None = None, impl: str = "auto",
                          head: Head | None = None):
    """log softmax(logits)[targets] with ``logits = cap(logit_scale * (hidden @ weight.T + bias)) / temperature``,
    without the (N, V) logits.

    hidden (N, H) or (B, T, H); weight (V, H); targets (N,) or (B, T) integer ids; bias (V,); or ``head`` (a
    `Head` with those fields) instead of weight, bias, temperature, softcap and logit_scale. Returns the log-probs
    (fp32; fp64 for fp64 inputs) with the shape of ``targets``, and with ``return_token_entropy`` also the
    entropy: ``(log_probs, entropy)``. Both are differentiable in hidden, weight and bias. Where ``mask`` is 0
    the outputs are 0 and pass no gradient (the ids there may be anything, e.g. -100). ``softcap`` c gives
    ``c * tanh(x / c)`` before the temperature (None: no cap); ``logit_scale`` multiplies ``hidden @ weight.T +
    bias`` before the cap. ``block_sizes`` sets the token rows and vocabulary columns per block (`BlockSizes`).

    Ids out of [0, V) raise ValueError when the ids are concrete; under jit they cannot be checked
    and their log-prob is NaN (so a bad id shows in the loss instead of reading another token).
    """
    inputs = _linear_inputs(hidden, weight, targets, bias, temperature, softcap, logit_scale, head, mask, block_sizes,
                            impl)
    stats = _token_stats(inputs, impl, need_entropy=return_token_entropy)
    log_probs = stats.log_probs.reshape(targets.shape)
    return (log_probs, stats.entropy.reshape(targets.shape)) if return_token_entropy else log_probs


@dataclass(frozen=True)
class CrossEntropyTerms:
    """The cross-entropy's per-token terms times their weight (a `fused.TokenLoss`; ``weights`` (N,) the loss
    data: 0 where ignored, 1 / count for a mean)."""

    label_smoothing: float

    def __call__(self, stats: SoftmaxStats, weights: jax.Array) -> jax.Array:
        terms = -stats.log_probs if self.label_smoothing == 0 else (
            -(1.0 - self.label_smoothing) * stats.log_probs - self.label_smoothing * stats.mean_log_prob)
        return jnp.where(weights != 0, terms, 0.0) * weights


def _check_smoothing(label_smoothing) -> float:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing: expected a number in [0, 1], got {label_smoothing!r}")
    return float(label_smoothing)


@checked_keywords(wholes=head_wholes(""))
def fused_linear_cross_entropy(hidden, weight=None, targets=None, *, bias=None, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0, temperature: float = 1.0,
                               softcap: float | None = None, logit_scale: float = 1.0,
                               block_sizes: BlockSizes | None = None, impl: str = "auto", head: Head | None = None):
    """Cross-entropy of the head's logits against ``targets``, as ``torch.nn.functional.cross_entropy`` computes it,
    in fp32 (fp64 for fp64 inputs), without the (N, V) logits.

    ``reduction`` is none | mean | sum: "none" gives the per-token loss with the shape of ``targets`` (0 where
    ignored); "mean" averages over the tokens whose id is not ``ignore_index`` (NaN when there are none, with
    zero gradients, as PyTorch). ``label_smoothing`` eps mixes in the uniform distribution:
    ``-(1 - eps) log p(target) - eps mean_v log p_v``. Head options, ``block_sizes`` and ``impl`` as in
    `fused_linear_logprobs`.
    """
    check_choice("reduction", reduction, ("none", "mean", "sum"))
    label_smoothing = _check_smoothing(label_smoothing)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    if targets is None:
        raise TypeError("targets: expected an integer array of token ids, got None")
    targets = check_array("targets", targets, integer=True)
    inputs = _linear_inputs(hidden, weight, targets, bias, temperature, softcap, logit_scale, head,
                            targets != ignore_index, block_sizes, impl)
    terms = CrossEntropyTerms(label_smoothing)
    if reduction == "none":
        stats = _token_stats(inputs, impl, need_mean_log_prob=label_smoothing > 0)
        return terms(stats, inputs.keep.astype(stats.log_probs.dtype)).reshape(targets.shape)
    count = inputs.keep.sum()
    weights = inputs.keep / (jnp.maximum(count, 1) if reduction == "mean" else 1)  # (N,)
    total, _ = _loss(inputs, impl, terms, weights, need_mean_log_prob=label_smoothing > 0)
    # the mean of no tokens is NaN, with zero gradients, as in PyTorch
    return total + jnp.where(count == 0, jnp.nan, 0.0) if reduction == "mean" else total


def _check_grpo_arrays(completion_ids, keep, advantages, old_log_probs, ref_log_probs, sampling_log_probs,
                       importance_sampling_ratio, settings: GRPOSettings, num_items_in_batch, dtype) -> jax.Array:
    """The GRPO arguments that `_linear_inputs` does not see; returns the advantages as (B, 1) or (B, T) in
    ``dtype``, the loss's."""
    advantages = check_array("advantages", advantages, ndim=(1, 2), floating=True)
    num_sequences, length = completion_ids.shape
    check_advantages_shape(advantages.shape, num_sequences, length)
    check_finite("advantages", advantages)
    kept = concrete(keep)
    for name, value in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs),
                        ("sampling_log_probs", sampling_log_probs)):
        if value is not None:
            check_same_shape(name, check_array(name, value, floating=True), "completion_ids", completion_ids)
            values = concrete(value)
            unscored = None if values is None or kept is None else (
                values[kept] == np.inf if name == "sampling_log_probs" else ~(values[kept] < np.inf))
            if unscored is not None and unscored.any():  # a sampler may leave a token unscored (NaN)
                raise ValueError(f"{name}: NaN or +inf at a token of completion_mask (log-probabilities are <= 0)")
    if importance_sampling_ratio is not None:
        ratios = check_array("importance_sampling_ratio", importance_sampling_ratio, ndim=2, floating=True)
        if tuple(ratios.shape) not in ((num_sequences, length), (num_sequences, 1)):
            raise ValueError(f"importance_sampling_ratio: expected ({num_sequences}, {length}) or "
                             f"({num_sequences}, 1), got {tuple(ratios.shape)}")
        values = concrete(ratios)
        if values is not None and kept is not None:
            values = values[kept] if values.shape[1] == length and length > 1 else values
            if not (np.isfinite(values).all() and (values >= 0).all()):
                raise ValueError("importance_sampling_ratio: expected finite ratios >= 0 at the tokens of "
                                 "completion_mask")
    check_grpo_options(settings, ref_log_probs is not None,
                       None if num_items_in_batch is None else concrete(num_items_in_batch))
    return advantages.reshape(num_sequences, -1).astype(dtype)


@checked_keywords(options=GRPO_OPTIONS, wholes=head_wholes(""))
def fused_grpo_loss(hidden, weight=None, completion_ids=None, completion_mask=None, advantages=None, *, bias=None,
                    old_log_probs=None, ref_log_probs=None, sampling_log_probs=None, importance_sampling_ratio=None,
                    settings: GRPOSettings | None = None, num_items_in_batch=None, temperature: float = 1.0,
                    softcap: float | None = None, logit_scale: float = 1.0, block_sizes: BlockSizes | None = None,
                    impl: str = "auto", head: Head | None = None, **options) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss of TRL 1.16's GRPOTrainer, every loss type and option, from hidden states (B, T, H) and the LM
    head, without logits.

    Arguments as `logitless.fused_grpo_loss` (PyTorch): ``completion_ids``/``completion_mask``/
    ``old_log_probs``/``ref_log_probs``/``sampling_log_probs`` (B, T); ``advantages`` (B,), (B, 1) or (B, T);
    ``importance_sampling_ratio`` (B, T) or (B, 1); ``settings``, a `GRPOSettings` (or its fields as keywords:
    ``loss_type="dapo"``, ``beta=0.04``, ...); ``beta > 0`` adds the k3 KL to ``ref_log_probs``;
    ``old_log_probs`` None means on-policy (ratio 1, gradient of the log-prob). Head options (``bias``,
    ``temperature``, ``softcap``, ``logit_scale``, or ``head``), ``block_sizes`` and ``impl`` as in
    `fused_linear_logprobs`.
    Returns (loss, metrics): a scalar and a dict of scalar arrays with TRL's names (those of the PyTorch op).
    Differentiate with ``jax.grad(..., has_aux=True)``.
    """
    hidden = check_array("hidden", hidden, ndim=3, floating=True)
    check_completion_mask_given(completion_mask)
    inputs = _linear_inputs(hidden, weight, completion_ids, bias, temperature, softcap, logit_scale, head,
                            completion_mask, block_sizes, impl, targets_name="completion_ids",
                            mask_name="completion_mask")
    keep = inputs.keep.reshape(completion_ids.shape)
    settings = GRPOSettings.of(settings, options)
    dtype = jnp.float64 if hidden.dtype == jnp.float64 else jnp.float32  # the statistics' (the log-probs')
    advantages = _check_grpo_arrays(completion_ids, keep, advantages, old_log_probs, ref_log_probs,
                                    sampling_log_probs, importance_sampling_ratio, settings, num_items_in_batch,
                                    dtype)
    tensors = dict(old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, sampling_log_probs=sampling_log_probs,
                   importance_sampling_ratio=importance_sampling_ratio, num_items_in_batch=num_items_in_batch)
    if settings.per_token and importance_sampling_ratio is None:  # each token's gradient known from its log-prob
        data = GRPOData(jnp.broadcast_to(advantages, keep.shape), old_log_probs, ref_log_probs,
                        token_weights(keep, settings, num_items_in_batch, dtype), keep.astype(dtype))  # (B, T) each
        loss, stats = _loss(inputs, impl, GRPOTerms(settings), jax.tree.map(lambda values: values.reshape(-1), data),
                            need_entropy=True)
        log_probs, entropy = (values.reshape(completion_ids.shape) for values in (stats.log_probs, stats.entropy))
        return loss, grpo_objective(log_probs, entropy, keep, advantages, settings, **tensors)[1]
    stats = _token_stats(inputs, impl, need_entropy=True)  # (N,) each, differentiable
    log_probs, entropy = (values.reshape(completion_ids.shape) for values in (stats.log_probs, stats.entropy))
    return grpo_objective(log_probs, entropy, keep, advantages, settings, **tensors)
