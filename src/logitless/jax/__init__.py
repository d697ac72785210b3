"""logitless in JAX: fused LM-head log-probs, entropy and the GRPO loss without (B, T, V) logits.

Needs the ``jax`` extra (``pip install 'logitless[jax]'``). See docs/jax.md.
"""

from logitless.jax.ops import fused_grpo_loss, fused_linear_logprobs
from logitless.jax.token_stats import BlockSizes

__all__ = ["BlockSizes", "fused_grpo_loss", "fused_linear_logprobs"]
