"""GRPOTrainerWithLogits: TRL's GRPOTrainer scoring through logitless's fused LM head, with logit-aware rewards.

Adopt it by changing one import; every GRPOConfig option keeps its meaning.

1. Every log-prob TRL computes (policy, old, reference) comes from `add_logitless_lm_head`
   (`logitless.trl.seam`): the policy's final hidden states and output embedding through logitless's
   fused ops, so no ``(B, T, V)`` logits or logits gradient exist in a step. TRL's own ``_compute_loss``
   then runs unchanged on the per-token log-probs and entropies: every loss type, importance-sampling
   level, entropy mask or bonus, off-policy mask, vLLM correction, tool mask and MoE aux loss, with PEFT
   models and FSDP2 / ZeRO-3 sharded heads.
2. Reward functions that declare ``completion_logits`` / ``completion_logprobs`` receive them
   (`logitless.trl.rewards`), with every way TRL generates.
3. Checkpoints appear complete or not at all, and resume from the newest complete one
   (`logitless.trl.checkpoints`) to the weights the uninterrupted run would have reached
   (`logitless.trl.resume`).
4. ``reward_std_filter=RewardStdFilter()`` drops from the loss the prompts whose group of rewards varies less than
   RLPR's moving threshold (`logitless.trl.std_filter`).
5. Training starts with one line naming the head that scores the tokens and the policy's layout over the
   processes, and a warning where the launch asked for a layout that accelerate does not run
   (`logitless.trl.notices`).
"""

from __future__ import annotations

from trl import GRPOTrainer

from logitless.trl.checkpoints import AtomicCheckpoints
from logitless.trl.resume import ExactResume
from logitless.trl.rewards import LogitAwareRewards
from logitless.trl.seam import LogitlessHead
from logitless.trl.std_filter import RewardStdFiltering


class GRPOTrainerWithLogits(AtomicCheckpoints, ExactResume, RewardStdFiltering, LogitAwareRewards, LogitlessHead,
                            GRPOTrainer):
    """Drop-in for `trl.GRPOTrainer`; see the module docstring."""
