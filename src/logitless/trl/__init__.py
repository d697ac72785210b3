"""logitless for TRL users: TRL 1.16's trainers under their own names, scoring through logitless's fused LM head.

``from logitless.trl import SFTTrainer`` (or DPOTrainer, KTOTrainer, RLOOTrainer, GRPOTrainer,
DistillationTrainer) switches a script. Split by concern: `seam` (TRL's fused-LM-head seam answered
for every trainer) and `lm_head` (the head itself), `distillation` (the exact divergence of on-policy
distillation), `rewards` (``completion_logits`` / ``completion_logprobs`` for reward functions),
`reference_probability` (RLPR's reward) and `std_filter` (RLPR's filter of low-variance groups), `verifree`
(`VeriFreeTrainer`: VeriFree's objective, the reward read in the training forward),
`checkpoints` and `resume` (atomic checkpoints, exact GRPO resume), `notices` (the line and warnings a
run starts with), `trainer` (`GRPOTrainerWithLogits`) and `trainers` (the others).
"""

from logitless.trl.version import check_trl_version

check_trl_version()

from logitless.trl.checkpoints import CHECKPOINT_STAGING  # noqa: E402
from logitless.trl.distillation import DistillationTrainer  # noqa: E402
from logitless.trl.lm_head import add_logitless_lm_head  # noqa: E402
from logitless.trl.nonfinite import NonFiniteGuard  # noqa: E402
from logitless.trl.reference_probability import reference_probability_reward  # noqa: E402
from logitless.trl.rewards import LOGIT_KWARGS, wanted_logit_kwargs  # noqa: E402
from logitless.trl.std_filter import RewardStdFilter  # noqa: E402
from logitless.trl.trainer import GRPOTrainerWithLogits  # noqa: E402
from logitless.trl.trainers import DPOTrainer, GRPOTrainer, KTOTrainer, RLOOTrainer, SFTTrainer  # noqa: E402
from logitless.trl.verifree import VeriFreeConfig, VeriFreeTrainer  # noqa: E402

__all__ = ["CHECKPOINT_STAGING", "DPOTrainer", "DistillationTrainer", "GRPOTrainer", "GRPOTrainerWithLogits",
           "KTOTrainer", "LOGIT_KWARGS", "NonFiniteGuard", "RLOOTrainer", "RewardStdFilter", "SFTTrainer",
           "VeriFreeConfig", "VeriFreeTrainer", "add_logitless_lm_head", "reference_probability_reward",
           "wanted_logit_kwargs"]
