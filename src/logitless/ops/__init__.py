"""LM-head ops: one head definition (`head`), materialized oracles (`reference`), the block engine (`engine`,
with `blocks` for its sizes and schedule), its accumulators (`softmax`, `kl`, `jsd`), their block math (`chunks`,
`kl_blocks`, `jsd_blocks`, `triton`) and the fused autograd Functions built on them (`fused`, `kl`, `jsd`).

Nothing here imports transformers or TRL. The names below are imported on first use, so that a module
such as `grpo_settings` loads without PyTorch.
"""

from logitless._lazy import exports

_EXPORTS = {
    **dict.fromkeys(("BlockSizes", "default_block_sizes"), "logitless.ops.blocks"),
    **dict.fromkeys(("fused_grpo_loss", "fused_linear_cross_entropy", "fused_linear_logprobs"), "logitless.ops.fused"),
    "GRPOSettings": "logitless.ops.grpo_settings",
    "gumbel_softmax_topk": "logitless.ops.gumbel",
    "LinearHead": "logitless.ops.head",
    "fused_linear_kl": "logitless.ops.kl",
    "fused_linear_jsd": "logitless.ops.jsd",
    "compute_entropy": "logitless.ops.reference",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
