"""LM-head ops: one head definition (`head`), materialized oracles (`reference`), the block engine (`engine`,
with `blocks` for its sizes and schedule), its accumulators (`softmax`, `kl`, `jsd`), their block math (`chunks`,
`kl_blocks`, `jsd_blocks`, `triton`) and the fused autograd Functions built on them (`fused`, `kl`, `jsd`).

Nothing here imports transformers or TRL. The names below are imported on first use, so that a module
such as `grpo_settings` loads without PyTorch.
"""

from logitless._lazy import exports

_EXPORTS = {name: f"logitless.ops.{module}" for module, names in (
    ("blocks", ("BlockSizes", "default_block_sizes")),
    ("fused", ("fused_grpo_loss", "fused_linear_cross_entropy", "fused_linear_logprobs")),
    ("grpo_settings", ("GRPOSettings",)), ("gumbel", ("gumbel_softmax_topk",)), ("head", ("LinearHead",)),
    ("kl", ("fused_linear_kl",)), ("jsd", ("fused_linear_jsd",)), ("reference", ("compute_entropy",)),
) for name in names}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
