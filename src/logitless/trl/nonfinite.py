"""`NonFiniteGuard`: a step whose loss or gradient is NaN or infinite is never applied, inside a Hugging Face
Trainer (TRL's trainers included); see `logitless.nonfinite`."""

from __future__ import annotations

from transformers import TrainerCallback

from logitless._checks import check_choice
from logitless.nonfinite import POLICIES, check_step


class NonFiniteGuard(TrainerCallback):
    """`check_step` before every optimizer step of a transformers Trainer; ``skipped`` lists the steps skipped."""

    def __init__(self, policy: str = "stop", advice: str = ""):
        self.policy, self.advice, self.skipped = check_choice("policy", policy, POLICIES), advice, []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not check_step(state.global_step + 1, model, policy=self.policy, advice=self.advice):
            self.skipped.append(state.global_step + 1)
