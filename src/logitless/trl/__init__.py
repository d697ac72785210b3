"""logitless for TRL users: `GRPOTrainerWithLogits`, a drop-in `trl.GRPOTrainer` that never builds logits.

Split by concern: `lm_head` (TRL's fused-LM-head seam answered by logitless's ops), `rewards`
(``completion_logits`` / ``completion_logprobs`` for reward functions), `checkpoints` (atomic
checkpoints and resume), `notices` (the line and warnings a run starts with), `trainer` (the class
that puts them together).
"""

from logitless.trl.version import check_trl_version

check_trl_version()

from logitless.trl.checkpoints import CHECKPOINT_STAGING  # noqa: E402
from logitless.trl.lm_head import add_logitless_lm_head  # noqa: E402
from logitless.trl.nonfinite import NonFiniteGuard  # noqa: E402
from logitless.trl.rewards import LOGIT_KWARGS, wanted_logit_kwargs  # noqa: E402
from logitless.trl.trainer import GRPOTrainerWithLogits  # noqa: E402

__all__ = ["CHECKPOINT_STAGING", "GRPOTrainerWithLogits", "LOGIT_KWARGS", "NonFiniteGuard", "add_logitless_lm_head",
           "wanted_logit_kwargs"]
