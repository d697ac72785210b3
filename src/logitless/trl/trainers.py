"""TRL 1.16's trainers that score tokens, on logitless's fused LM head, under TRL's own names.

Switch a script with one import line (``from logitless.trl import SFTTrainer, DPOTrainer``): each class is
the TRL trainer with `LogitlessHead` (its fused head answered by logitless's ops, for the policy and the
reference model alike) and `AtomicCheckpoints`; every config option keeps its meaning, since the
trainer's own loss and metric code runs unchanged. `GRPOTrainer` is `GRPOTrainerWithLogits`; RLOO's
reward functions get ``completion_logits`` as GRPO's do; `DistillationTrainer` lives in
`logitless.trl.distillation`.
"""

from __future__ import annotations

import trl

from logitless.trl.checkpoints import AtomicCheckpoints
from logitless.trl.rewards import LogitAwareRewards
from logitless.trl.seam import LogitlessHead
from logitless.trl.trainer import GRPOTrainerWithLogits

GRPOTrainer = GRPOTrainerWithLogits


class SFTTrainer(AtomicCheckpoints, LogitlessHead, trl.SFTTrainer):
    """Drop-in for `trl.SFTTrainer`: log-probs, entropy and the top-1 flag (token accuracy) from logitless's head."""


class DPOTrainer(AtomicCheckpoints, LogitlessHead, trl.DPOTrainer):
    """Drop-in for `trl.DPOTrainer`: the policy's and the reference model's log-probs, entropy, mean logits, top-1
    flags (and WPO's log sum p^2) from logitless's head."""


class KTOTrainer(AtomicCheckpoints, LogitlessHead, trl.KTOTrainer):
    """Drop-in for `trl.KTOTrainer`: the policy's and the reference model's log-probs, entropy and mean logits from
    logitless's head."""


class RLOOTrainer(AtomicCheckpoints, LogitAwareRewards, LogitlessHead, trl.RLOOTrainer):
    """Drop-in for `trl.RLOOTrainer`: log-probs and entropy from logitless's head, and ``completion_logits`` /
    ``completion_logprobs`` for the reward functions that declare them."""

    old_pass_before_rewards = True  # RLOO scores the old log-probs, a policy pass, before every reward
