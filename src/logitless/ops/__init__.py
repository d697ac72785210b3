"""LM-head ops: materialized oracles (`reference`) and chunked fused autograd Functions (`fused`).

Nothing here imports transformers or TRL.
"""

from logitless.ops.fused import fused_grpo_loss, fused_linear_cross_entropy, fused_linear_logprobs
from logitless.ops.reference import compute_entropy

__all__ = ["compute_entropy", "fused_grpo_loss", "fused_linear_cross_entropy", "fused_linear_logprobs"]
