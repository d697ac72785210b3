"""LM-head ops: one head definition (`head`), materialized oracles (`reference`), the block engine (`engine`,
with `blocks` for its sizes and schedule), its accumulators (`softmax`, `kl`), their block math (`chunks`,
`triton`) and the fused autograd Functions built on them (`fused`, `kl`).

Nothing here imports transformers or TRL.
"""

from logitless.ops.blocks import BlockSizes, default_block_sizes
from logitless.ops.fused import fused_grpo_loss, fused_linear_cross_entropy, fused_linear_logprobs
from logitless.ops.grpo_settings import GRPOSettings
from logitless.ops.gumbel import gumbel_softmax_topk
from logitless.ops.head import LinearHead
from logitless.ops.kl import fused_linear_kl
from logitless.ops.reference import compute_entropy

__all__ = ["BlockSizes", "GRPOSettings", "LinearHead", "compute_entropy", "default_block_sizes", "fused_grpo_loss",
           "fused_linear_cross_entropy", "fused_linear_kl", "fused_linear_logprobs", "gumbel_softmax_topk"]
