"""What `logitless bench grade-variance` runs and `bench.grade_variance_gradients` computes: the prompts, the
methods compared and the `GradeVarianceConfig` of a run."""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS = ["Once upon a time", "The weather today is", "My favourite food is", "Yesterday I went to"]
METHODS = ("gumbel", "ste", "grpo")


@dataclass
class GradeVarianceConfig:
    minibatches: int = 32
    batch_size: int = 8  # rollouts per minibatch: every prompt batch_size / 4 times (GRPO's group size)
    max_new_tokens: int = 1  # 1: the reference gradient is exact
    gumbel_topk: int = 1024
    tau: float = 0.7
    reference_samples: int = 256
