"""The public JAX ops: `fused_linear_logprobs` and `fused_grpo_loss`, same semantics as the PyTorch ones.

Both take ``impl="fused"`` (default: `token_stats.linear_token_stats`, vocabulary blocks, no (N, V)
array) or ``impl="materialized"`` (the plain-JAX baseline of `reference.py`). Both are jit-able:
``temperature``, ``softcap``, ``logit_scale``, ``settings`` (and the GRPO options given as keywords),
``block_sizes`` and ``impl`` are Python values (static); arrays, ``num_items_in_batch`` included, may be
traced.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from logitless._checks import check_advantages_shape, check_choice, check_grpo_options, check_head_shapes
from logitless.jax.checks import check_array, check_finite, check_mask, check_same_shape, check_token_ids, concrete
from logitless.jax.grpo import grpo_loss_from_stats, token_weights
from logitless.jax.head import Head
from logitless.jax.reference import materialized_token_stats
from logitless.jax.sharding import per_token_shard
from logitless.jax.token_stats import linear_token_stats
from logitless.ops.blocks import BlockSizes
from logitless.ops.grpo_settings import GRPOSettings

TOKEN_STATS = {"fused": linear_token_stats, "materialized": materialized_token_stats}


class LinearInputs(NamedTuple):
    """Validated LM-head inputs, flattened over tokens."""

    hidden: jax.Array  # (N, H)
    weight: jax.Array  # (V, H)
    bias: jax.Array | None  # (V,)
    targets: jax.Array  # (N,); 0 where masked, so every id indexes the vocabulary
    keep: jax.Array | None  # (N,) bool, or None when nothing is masked
    head: Head


def _linear_inputs(hidden, weight, targets, bias, temperature, softcap, logit_scale, mask, block_sizes,
                   targets_name: str = "targets", mask_name: str = "mask") -> LinearInputs:
    hidden = check_array("hidden", hidden, ndim=(2, 3), floating=True)
    weight = check_array("weight", weight, ndim=2, floating=True)
    targets = check_array(targets_name, targets, ndim=hidden.ndim - 1, integer=True)
    check_head_shapes(hidden, weight, targets, targets_name)
    if bias is not None:
        bias = check_array("bias", bias, ndim=1, floating=True)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias: length {bias.shape[0]} does not match the vocabulary size {weight.shape[0]}")
    head = Head(temperature, softcap, logit_scale, BlockSizes.of(block_sizes))
    keep = None if mask is None else check_mask(mask_name, mask, targets_name, targets)
    check_token_ids(targets_name, targets, weight.shape[0], keep)
    flat_targets = targets.reshape(-1)
    flat_keep = None if keep is None else keep.reshape(-1)
    if flat_keep is not None:
        flat_targets = jnp.where(flat_keep, flat_targets, 0)
    return LinearInputs(hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat_targets, flat_keep, head)


def _token_stats(inputs: LinearInputs, impl: str):
    """(N,) log-probs and entropies; 0 where masked."""
    check_choice("impl", impl, tuple(TOKEN_STATS))
    log_probs, entropy = per_token_shard(TOKEN_STATS[impl], inputs.hidden, inputs.weight, inputs.bias, inputs.targets,
                                         inputs.head)
    if inputs.keep is None:
        return log_probs, entropy
    return jnp.where(inputs.keep, log_probs, 0.0), jnp.where(inputs.keep, entropy, 0.0)


def fused_linear_logprobs(hidden, weight, targets, *, bias=None, temperature: float = 1.0,
                          return_entropy: bool = False, mask=None, softcap: float | None = None,
                          logit_scale: float = 1.0, block_sizes: BlockSizes | None = None, impl: str = "fused"):
    """log softmax(logits)[targets] with ``logits = cap(logit_scale * (hidden @ weight.T + bias)) / temperature``,
    without the (N, V) logits.

    hidden (N, H) or (B, T, H); weight (V, H); targets (N,) or (B, T) integer ids; bias (V,).
    Returns the log-probs (fp32; fp64 for fp64 inputs) with the shape of ``targets``, and with
    ``return_entropy`` also the entropy: ``(log_probs, entropy)``. Both are differentiable in
    hidden, weight and bias. Where ``mask`` is 0 the outputs are 0 and pass no gradient (the ids
    there may be anything, e.g. -100). ``softcap`` c gives ``c * tanh(x / c)`` before the temperature (None:
    no cap); ``logit_scale`` multiplies ``hidden @ weight.T + bias`` before the cap (Cohere's ``logit_scale``).
    ``block_sizes`` sets the vocabulary columns and token rows per block (`BlockSizes`).

    Ids out of [0, V) raise ValueError when the ids are concrete; under jit they cannot be checked
    and their log-prob is NaN (so a bad id shows in the loss instead of reading another token).
    """
    inputs = _linear_inputs(hidden, weight, targets, bias, temperature, softcap, logit_scale, mask, block_sizes)
    log_probs, entropy = (values.reshape(targets.shape) for values in _token_stats(inputs, impl))
    return (log_probs, entropy) if return_entropy else log_probs


def _check_grpo_arrays(completion_ids, keep, advantages, old_logprobs, ref_logprobs, settings: GRPOSettings,
                       num_items_in_batch) -> jax.Array:
    """The GRPO arguments that `_linear_inputs` does not see; returns the advantages as (B, 1) or (B, T) fp32."""
    advantages = check_array("advantages", advantages, ndim=(1, 2), floating=True)
    num_sequences, length = completion_ids.shape
    check_advantages_shape(advantages.shape, num_sequences, length)
    check_finite("advantages", advantages)
    kept = concrete(keep)
    for name, value in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if value is not None:
            check_same_shape(name, check_array(name, value, floating=True), "completion_ids", completion_ids)
            values = concrete(value)
            if values is not None and kept is not None and not (values[kept] < np.inf).all():
                raise ValueError(f"{name}: NaN or +inf at a token of completion_mask (log-probabilities are <= 0)")
    check_grpo_options(settings, ref_logprobs is not None,
                       None if num_items_in_batch is None else concrete(num_items_in_batch))
    return advantages.reshape(num_sequences, -1).astype(jnp.float32)


def fused_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, *, bias=None, old_logprobs=None,
                    ref_logprobs=None, settings: GRPOSettings | None = None, num_items_in_batch=None,
                    temperature: float = 1.0, softcap: float | None = None, logit_scale: float = 1.0,
                    block_sizes: BlockSizes | None = None, impl: str = "fused",
                    **options) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss of TRL's GRPOTrainer from hidden states (B, T, H) and the LM head, without logits.

    Arguments as `logitless.fused_grpo_loss` (PyTorch): ``completion_ids``/``completion_mask``/
    ``old_logprobs``/``ref_logprobs`` (B, T); ``advantages`` (B,), (B, 1) or (B, T); ``settings``, a
    `GRPOSettings` (or its fields as keywords: ``loss_type="dapo"``, ``beta=0.04``, ...); ``beta > 0``
    adds the k3 KL to ``ref_logprobs``; ``old_logprobs`` None means on-policy (ratio 1, gradient of the
    log-prob). Head options (``bias``, ``temperature``, ``softcap``, ``logit_scale``), ``block_sizes`` and
    ``impl`` as in `fused_linear_logprobs`.
    Returns (loss, metrics): a scalar and a dict of scalar arrays with TRL's names, kl (when
    ref_logprobs is given), clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean,
    entropy, clip_ratio/low_min, clip_ratio/high_max. Differentiate with ``jax.grad(..., has_aux=True)``.
    """
    hidden = check_array("hidden", hidden, ndim=3, floating=True)
    if completion_mask is None:  # the loss's normalizers count its tokens: it is not optional, as in PyTorch
        raise TypeError("completion_mask: expected a (B, T) array, 1 where a completion token counts, got None")
    inputs = _linear_inputs(hidden, weight, completion_ids, bias, temperature, softcap, logit_scale, completion_mask,
                            block_sizes, targets_name="completion_ids", mask_name="completion_mask")
    keep = inputs.keep.reshape(completion_ids.shape)
    settings = GRPOSettings.of(settings, options)
    advantages = _check_grpo_arrays(completion_ids, keep, advantages, old_logprobs, ref_logprobs, settings,
                                    num_items_in_batch)
    log_probs, entropy = (values.reshape(completion_ids.shape) for values in _token_stats(inputs, impl))
    weights = token_weights(keep, settings, num_items_in_batch)
    return grpo_loss_from_stats(log_probs, entropy, keep, advantages, old_logprobs, ref_logprobs, weights, settings)
