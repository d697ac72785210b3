"""`Head`: the JAX backend's definition of an LM head's logits, as `logitless.ops.head.LinearHead` defines them.

    logits = cap(scale * (hidden @ weight.T + bias)) / temperature        (fp32)

``cap(x) = softcap * tanh(x / softcap)``, the identity without a softcap; ``scale`` is a model's logit
multiplier (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``). The fused op's block engine
and the materialized oracle both compute logits through `Head.logits`, and the engine carries a
gradient from the logits back to ``hidden @ weight.T + bias`` through `Head.raw_grad`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from logitless._checks import check_positive_finite
from logitless.ops.blocks import BlockSizes


def stat_dtype(dtype) -> jnp.dtype:
    """Logits, statistics and gradient sums are fp32, or fp64 for fp64 inputs (check_grads)."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


@dataclass(frozen=True)
class Head:
    """The static part of an LM head (hashable, so a jitted function may take it): how ``hidden @ weight.T +
    bias`` becomes logits, and the block sizes the fused op cuts them into (None fields: `jax_block_sizes`)."""

    temperature: float = 1.0
    softcap: float | None = None
    scale: float = 1.0
    blocks: BlockSizes = BlockSizes()

    def __post_init__(self):
        object.__setattr__(self, "temperature", check_positive_finite("temperature", self.temperature))
        object.__setattr__(self, "scale", check_positive_finite("logit_scale", self.scale))
        if self.softcap is not None:
            object.__setattr__(self, "softcap", check_positive_finite("softcap", self.softcap))

    def logits(self, hidden, weight, bias, dtype) -> jax.Array:
        """hidden (n, H), weight (v, H), bias (v,) or None -> logits (n, v) in ``dtype``; the matmul takes
        the inputs' dtype and accumulates in ``dtype``."""
        raw = lax.dot_general(hidden, weight, (((1,), (1,)), ((), ())), preferred_element_type=dtype)
        if bias is not None:
            raw = raw + bias.astype(dtype)
        if self.scale != 1.0:
            raw = self.scale * raw
        logits = raw if self.softcap is None else self.softcap * jnp.tanh(raw / self.softcap)
        return logits if self.temperature == 1.0 else logits / self.temperature

    def raw_grad(self, grad, logits) -> jax.Array:
        """d loss / d logits (n, v) -> d loss / d (hidden @ weight.T + bias): multiplied by ``scale / temperature``
        and by the soft cap's slope ``1 - tanh^2 = 1 - (logits * temperature / softcap)^2``."""
        if self.temperature != 1.0:
            grad = grad / self.temperature
        if self.scale != 1.0:
            grad = grad * self.scale
        if self.softcap is not None:
            capped = logits * (self.temperature / self.softcap)  # tanh(scale * raw / softcap)
            grad = grad * (1.0 - capped * capped)
        return grad
