"""GRADE: training a policy by backpropagating a differentiable reward through Gumbel-softmax rollouts.

`GumbelTrainerMemoryEfficient` is the one to use; `GumbelTrainer` is the legacy design (dense (B, V) soft
tokens), kept as the reference it is tested against; `GRPOBaseline` trains the same policy on the same reward with GRPO.
"""

from logitless.grade.config import GradeConfig
from logitless.grade.grpo import GRPOBaseline
from logitless.grade.judge import MultichoiceJudgeReward
from logitless.grade.metrics import METRIC_NAMES
from logitless.grade.rewards import (RewardInputs, SequenceClassifierReward, SoftReward, TokenLogProbReward,
                                     TokenSetReward)
from logitless.grade.soft_tokens import SoftTokens
from logitless.grade.trainer import GumbelTrainer, GumbelTrainerMemoryEfficient

__all__ = ["GRPOBaseline", "GradeConfig", "GumbelTrainer", "GumbelTrainerMemoryEfficient", "METRIC_NAMES",
           "MultichoiceJudgeReward", "RewardInputs", "SequenceClassifierReward", "SoftReward", "SoftTokens",
           "TokenLogProbReward", "TokenSetReward"]
