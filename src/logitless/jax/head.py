"""`Head`: the JAX backend's LM head, as `logitless.ops.head.LinearHead` is the PyTorch one.

    logits = cap(logit_scale * (hidden @ weight.T + bias)) / temperature        (fp32)

``cap(x) = softcap * tanh(x / softcap)``, the identity without a softcap; ``logit_scale`` is a model's logit
multiplier (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``). A `Head` is a pytree: ``weight``
and ``bias`` are its arrays (so ``jax.grad`` of a loss of a head gives a `Head` of gradients, and a jitted
function may take one), ``temperature``, ``softcap`` and ``logit_scale`` its static part. The block engine
computes logits through `Head.logits` (the plain-JAX oracles, `reference.py`, write the formula out for
themselves), and carries a gradient from the logits back to ``hidden @ weight.T + bias`` through
`Head.raw_grad`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from logitless._checks import HeadNumbers


def stat_dtype(dtype) -> jnp.dtype:
    """Logits, statistics and gradient sums are fp32, or fp64 for fp64 inputs (check_grads)."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


@partial(jax.tree_util.register_dataclass, data_fields=["weight", "bias"],
         meta_fields=["temperature", "softcap", "logit_scale"])
@dataclass(frozen=True)
class Head(HeadNumbers):
    """An LM head: ``weight`` (V, H), optional ``bias`` (V,), and how ``hidden @ weight.T + bias`` becomes logits
    (the fields after ``weight`` are keyword-only: ``bias`` and `HeadNumbers`' ``temperature``, ``softcap`` and
    ``logit_scale``, as `logitless.LinearHead`'s).

    The arrays are checked where an op takes the head (they may be anything while JAX maps over the pytree);
    the numbers here."""

    weight: jax.Array
    _: KW_ONLY
    bias: jax.Array | None = None

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def columns(self, start, size: int) -> Head:
        """The head of vocabulary entries [start, start + size): slices of weight and bias."""
        return dataclasses.replace(self, weight=lax.dynamic_slice_in_dim(self.weight, start, size),
                                   bias=None if self.bias is None else lax.dynamic_slice_in_dim(self.bias, start, size))

    def logits(self, hidden, dtype=None) -> jax.Array:
        """hidden (n, H) -> logits (n, V) in ``dtype`` (default: `stat_dtype` of hidden's); the matmul takes the
        inputs' dtype and accumulates in ``dtype``."""
        dtype = stat_dtype(hidden.dtype) if dtype is None else dtype
        raw = lax.dot_general(hidden, self.weight, (((1,), (1,)), ((), ())), preferred_element_type=dtype)
        if self.bias is not None:
            raw = raw + self.bias.astype(dtype)
        if self.logit_scale != 1.0:
            raw = self.logit_scale * raw
        logits = raw if self.softcap is None else self.softcap * jnp.tanh(raw / self.softcap)
        return logits if self.temperature == 1.0 else logits / self.temperature

    def raw_grad(self, grad, logits) -> jax.Array:
        """d loss / d logits (n, v) -> d loss / d (hidden @ weight.T + bias): multiplied by ``logit_scale /
        temperature`` and by the soft cap's slope ``1 - tanh^2 = 1 - (logits * temperature / softcap)^2``."""
        if self.temperature != 1.0:
            grad = grad / self.temperature
        if self.logit_scale != 1.0:
            grad = grad * self.logit_scale
        if self.softcap is not None:
            capped = logits * (self.temperature / self.softcap)  # tanh(logit_scale * raw / softcap)
            grad = grad * (1.0 - capped * capped)
        return grad
