"""logitless in JAX: fused LM-head log-probs, entropy, cross-entropy, the KL and generalized JSD of two heads and
the GRPO loss, without (B, T, V) logits, on one device or sharded over a mesh.

Needs the ``jax`` extra (``pip install 'logitless[jax]'``). See docs/jax.md.
"""

try:
    import jax  # noqa: F401
except ImportError as err:  # say how to get it, not just that it is missing
    raise ImportError("logitless.jax needs JAX: pip install 'logitless[jax]'") from err

from logitless.jax.head import Head  # noqa: E402
from logitless.jax.ops import fused_grpo_loss, fused_linear_cross_entropy, fused_linear_logprobs  # noqa: E402
from logitless.jax.two_heads import fused_linear_jsd, fused_linear_kl  # noqa: E402
from logitless.op_settings import BlockSizes  # noqa: E402
from logitless.op_settings import GRPOSettings  # noqa: E402

__all__ = ["BlockSizes", "GRPOSettings", "Head", "fused_grpo_loss", "fused_linear_cross_entropy", "fused_linear_jsd",
           "fused_linear_kl", "fused_linear_logprobs"]
