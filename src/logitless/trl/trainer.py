"""GRPOTrainerWithLogits: TRL's GRPOTrainer scoring through logitless's fused LM head, with logit-aware rewards.

Adopt it by changing one import; every GRPOConfig option keeps its meaning.

1. Every log-prob TRL computes (policy, old, reference) comes from `add_logitless_lm_head`: the
   policy's final hidden states and output embedding through logitless's fused ops, so no
   ``(B, T, V)`` logits or logits gradient exist in a step. TRL's own ``_compute_loss`` then runs
   unchanged on the per-token log-probs and entropies: every loss type, importance-sampling level,
   entropy mask or bonus, off-policy mask, vLLM correction, tool mask and MoE aux loss, with PEFT
   models and FSDP2 / ZeRO-3 sharded heads.
2. Reward functions that declare ``completion_logits`` / ``completion_logprobs`` receive them
   (`logitless.trl.rewards`), with every way TRL generates.
3. Checkpoints appear complete or not at all, and resume from the newest complete one
   (`logitless.trl.checkpoints`) to the weights the uninterrupted run would have reached
   (`logitless.trl.resume`).
4. Training starts with one line naming the head that scores the tokens and the policy's layout over the
   processes, and a warning where the launch asked for a layout that accelerate does not run
   (`logitless.trl.notices`).
"""

from __future__ import annotations

import functools
import logging
from unittest import mock

import trl.trainer.grpo_trainer as trl_grpo
from accelerate.utils import is_peft_model
from trl import GRPOTrainer

from logitless.trl.checkpoints import AtomicCheckpoints
from logitless.trl.lm_head import add_logitless_lm_head, has_logitless_lm_head
from logitless.trl.notices import launch_warnings, scoring_line
from logitless.trl.resume import ExactResume
from logitless.trl.rewards import LogitAwareRewards

logger = logging.getLogger(__name__)


class GRPOTrainerWithLogits(AtomicCheckpoints, ExactResume, LogitAwareRewards, GRPOTrainer):
    """Drop-in for `trl.GRPOTrainer`; see the module docstring."""

    def __init__(self, *args, **kwargs):
        self._hidden_capture = None  # the LM head's observer may run before the rewards are set up
        # TRL installs its fused LM head on the policy (the base model of a PEFT model) and the reference model
        # by calling add_fused_lm_head while it builds the trainer: that call installs ours instead
        ours = functools.partial(add_logitless_lm_head, on_hidden=self.keep_scored_hidden)
        with mock.patch.object(trl_grpo, "add_fused_lm_head", ours):
            super().__init__(*args, **kwargs)
        if not has_logitless_lm_head(self._scoring_model):
            raise RuntimeError("GRPOTrainerWithLogits: TRL did not install a fused LM head on the policy, so "
                               "logitless's could not replace it; this TRL version is not supported")
        self._init_logit_rewards()

    @property
    def _scoring_model(self):
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if is_peft_model(model) else model

    @property
    def lm_head_path(self) -> str:
        """Which code scores the policy's tokens in a training step: ``"logitless"`` (the fused ops, from hidden
        states) whenever the trainer was built; TRL's own head is never used."""
        return "logitless" if has_logitless_lm_head(self._scoring_model) else "trl"

    def train(self, *args, **kwargs):
        """TRL's ``train``, which first prints (main process) the head that scores the tokens and the policy's layout,
        and warns where the launch asked for another layout."""
        if self.accelerator.is_main_process:
            print(scoring_line(self._scoring_model, self.accelerator, self.args.cast_lm_head_to_fp32), flush=True)
            for warning in launch_warnings(self._scoring_model, self.accelerator, self.args):
                logger.warning(warning)
        return super().train(*args, **kwargs)
