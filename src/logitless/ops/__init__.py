"""LM-head ops: materialized oracles (`reference`) and chunked fused autograd Functions (`fused`).

Nothing here imports transformers or TRL.
"""

from logitless.ops.fused import fused_grpo_loss, fused_linear_cross_entropy, fused_linear_logprobs
from logitless.ops.gumbel import gumbel_softmax_topk
from logitless.ops.kl import fused_linear_kl
from logitless.ops.reference import compute_entropy

__all__ = ["compute_entropy", "fused_grpo_loss", "fused_linear_cross_entropy", "fused_linear_kl", "fused_linear_logprobs",
           "gumbel_softmax_topk"]
