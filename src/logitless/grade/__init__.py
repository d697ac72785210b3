"""GRADE: training a policy by backpropagating a differentiable reward through Gumbel-softmax rollouts.

`GumbelTrainerMemoryEfficient` is the one to use; `GumbelTrainer` is the legacy design (dense (B, V) soft
tokens), kept as the reference it is tested against; `GRPOBaseline` trains the same policy on the same reward with GRPO.

The names below are imported on first use (`logitless.grade.GradeConfig` alone loads no PyTorch).
"""

from logitless._lazy import exports

_EXPORTS = {
    "GradeConfig": "logitless.grade.config",
    "GRPOBaseline": "logitless.grade.grpo",
    "MultichoiceJudgeReward": "logitless.grade.judge",
    "METRIC_NAMES": "logitless.grade.metrics",
    **dict.fromkeys(("RewardInputs", "SequenceClassifierReward", "SoftReward", "TokenLogProbReward", "TokenSetReward"),
                    "logitless.grade.rewards"),
    "SoftTokens": "logitless.grade.soft_tokens",
    **dict.fromkeys(("GumbelTrainer", "GumbelTrainerMemoryEfficient"), "logitless.grade.trainer"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
