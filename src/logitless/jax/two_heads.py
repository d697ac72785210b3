"""The public JAX ops that read two LM heads, `fused_linear_kl` and `fused_linear_jsd`, with the arguments and
semantics of the PyTorch ones (`logitless.ops.two_heads`, as here); the accumulators are `kl.py`'s and
`jsd.py`'s. A side is named by the suffix of its arguments (``p`` and ``q``, ``s`` and ``t``), and so is every error
(``weight_q: ...``).

The trained side (p, the student) takes gradients in its hidden states, weight and bias. The other side (q, the
teacher) is a target: the PyTorch ops detach it; here it takes a gradient where JAX differentiates it and costs
none where it does not (a teacher closed over, or behind ``jax.lax.stop_gradient``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from logitless._checks import JAX_IMPLS, check_beta, check_impl, checked_keywords, head_wholes
from logitless.jax import reference
from logitless.jax.checks import check_array, check_mask, take_head
from logitless.jax.head import Head
from logitless.jax.jsd import JSDAccumulator
from logitless.jax.kl import KLAccumulator
from logitless.jax.sharding import fused_stats
from logitless.op_settings import BlockSizes


def _sides(sides: tuple[str, str], hiddens, parts, head_options, mask, impl):
    """Both sides' flat hidden states (N, H_i) and heads, and the kept tokens (N,) bool or None, checked."""
    check_impl(impl, JAX_IMPLS)
    flat, heads = [], []
    for side, hidden, (weight, bias, head) in zip(sides, hiddens, parts):
        if hidden is None:
            raise TypeError(f"hidden_{side}: expected a (..., H) array, got None")
        hidden = check_array(f"hidden_{side}", hidden, floating=True)
        if hidden.ndim < 2:
            raise ValueError(f"hidden_{side}: expected (..., H) with at least 2 dimensions, got shape {hidden.shape}")
        heads.append(take_head(head, weight, bias, *head_options, hidden, suffix=f"_{side}"))
        flat.append(hidden)
    if flat[1].shape[:-1] != flat[0].shape[:-1]:
        raise ValueError(f"hidden_{sides[1]}: leading dims {tuple(flat[1].shape[:-1])} do not match "
                         f"hidden_{sides[0]}'s {tuple(flat[0].shape[:-1])}")
    if heads[1].vocab_size != heads[0].vocab_size:
        raise ValueError(f"weight_{sides[1]}: vocabulary of {heads[1].vocab_size} rows, weight_{sides[0]} has "
                         f"{heads[0].vocab_size}")
    leading = flat[0].shape[:-1]
    keep = None if mask is None else check_mask("mask", mask, f"hidden_{sides[0]}'s leading dims",
                                                flat[0][..., 0]).reshape(-1)
    return leading, tuple(heads), tuple(hidden.reshape(-1, hidden.shape[-1]) for hidden in flat), keep


def _per_token(values, keep, leading):
    """(N,) values with the leading dims, 0 where masked."""
    return (values if keep is None else jnp.where(keep, values, 0.0)).reshape(leading)


@checked_keywords(wholes=head_wholes("_p", "_q"))
def fused_linear_kl(hidden_p, weight_p=None, hidden_q=None, weight_q=None, *, bias_p=None, bias_q=None,
                    temperature: float = 1.0, mask=None, softcap: float | None = None, logit_scale: float = 1.0,
                    block_sizes: BlockSizes | None = None, impl: str = "auto", head_p: Head | None = None,
                    head_q: Head | None = None):
    """Per-token KL(p || q) of two LM heads over the full vocabulary, without (N, V) logits.

    hidden_p (..., H_p) with weight_p (V, H_p); hidden_q (..., H_q) with weight_q (V, H_q): the same leading dims
    and vocabulary, hidden sizes may differ (a teacher and a student). Both logits are ``cap(logit_scale *
    (hidden @ weight.T + bias)) / temperature`` with the same ``softcap``, ``logit_scale`` and ``temperature``;
    heads that differ in those are given whole, ``head_p=Head(...)``, ``head_q=Head(...)`` (instead of weight,
    bias and the three numbers). Returns the KL with hidden's leading dims, fp32 (fp64 for fp64 input); 0 where
    ``mask`` is 0. Differentiable with respect to the p side; the q side takes a gradient only where JAX
    differentiates it. ``block_sizes`` and ``impl`` ("auto" | "chunked" | "reference") as in
    `fused_linear_logprobs`.
    """
    leading, heads, hiddens, keep = _sides(("p", "q"), (hidden_p, hidden_q),
                                           ((weight_p, bias_p, head_p), (weight_q, bias_q, head_q)),
                                           (temperature, softcap, logit_scale), mask, impl)
    if impl == "reference":
        kl = reference.token_kl(heads[0], hiddens[0], heads[1], hiddens[1])
    else:
        (kl,) = fused_stats(KLAccumulator(), BlockSizes.of(block_sizes), heads, hiddens, ())
    return _per_token(kl, keep, leading)


@checked_keywords(wholes=head_wholes("_s", "_t"))
def fused_linear_jsd(hidden_s, weight_s=None, hidden_t=None, weight_t=None, *, beta: float = 0.5, bias_s=None,
                     bias_t=None, temperature: float = 1.0, mask=None, softcap: float | None = None,
                     logit_scale: float = 1.0, block_sizes: BlockSizes | None = None, impl: str = "auto",
                     return_token_entropy: bool = False, head_s: Head | None = None, head_t: Head | None = None):
    """Per-token generalized JSD of a student's LM head from a teacher's over the full vocabulary, without (N, V)
    logits.

    hidden_s (..., H_s) with weight_s (V, H_s); hidden_t (..., H_t) with weight_t (V, H_t): the same leading dims and
    vocabulary, hidden sizes may differ; or the heads whole (``head_s``, ``head_t``), as in `fused_linear_kl`.
    ``beta`` in [0, 1] picks the divergence as TRL's DistillationTrainer does: 0 the forward KL(p_t || p_s), 1 the
    reverse KL(p_s || p_t), otherwise ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with the mixture
    ``m = (1 - beta) p_s + beta p_t``. Returns the divergence with hidden's leading dims, fp32 (fp64 for fp64
    input), and with ``return_token_entropy`` also the student's entropy (without gradient): ``(divergence,
    entropy)``; 0 where ``mask`` is 0. Differentiable with respect to the student; the teacher takes a gradient
    only where JAX differentiates it. ``block_sizes`` and ``impl`` as in `fused_linear_logprobs`.
    """
    beta = check_beta(beta)
    leading, heads, hiddens, keep = _sides(("s", "t"), (hidden_s, hidden_t),
                                           ((weight_s, bias_s, head_s), (weight_t, bias_t, head_t)),
                                           (temperature, softcap, logit_scale), mask, impl)
    if impl == "reference":
        divergence, entropy = reference.token_jsd(heads[0], hiddens[0], heads[1], hiddens[1], beta)
    else:
        divergence, entropy = fused_stats(JSDAccumulator(beta), BlockSizes.of(block_sizes), heads, hiddens, ())
    divergence = _per_token(divergence, keep, leading)
    if not return_token_entropy:
        return divergence
    return divergence, _per_token(lax.stop_gradient(entropy), keep, leading)
