"""LM-head ops: one head definition (`head`), materialized oracles (`reference`),
how a call runs (`plan`: its implementation, schedule and block sizes), what the planner, the engine and the
accumulators share (`base`), the block engine (`engine`), its accumulators with their block math (`softmax`, `kl`,
`jsd`; the Triton twins in `triton`) and the public ops (`fused`, `two_heads`).

Nothing here imports transformers or TRL. The names below are imported on first use. The settings the ops take
(`BlockSizes`, `GRPOSettings`) live in `logitless.op_settings`, which the JAX ops share, and are exported here too.
"""

from logitless._lazy import exports

_EXPORTS = {name: f"logitless.ops.{module}" for module, names in (
    ("plan", ("default_block_sizes",)),
    ("fused", ("fused_grpo_loss", "fused_linear_cross_entropy", "fused_linear_logprobs")),
    ("gumbel", ("gumbel_softmax_topk",)), ("head", ("LinearHead",)),
    ("two_heads", ("fused_linear_jsd", "fused_linear_kl")), ("reference", ("compute_entropy",)),
) for name in names}
_EXPORTS.update(BlockSizes="logitless.op_settings", GRPOSettings="logitless.op_settings")
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
