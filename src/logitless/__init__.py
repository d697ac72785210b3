"""logitless: LLM post-training (SFT, GRPO) that never builds the [batch, seq, vocab] logits unless asked.

`GRPOTrainerWithLogits` lives in `logitless.trl` (it imports TRL). The names below are imported on first
use, so that the command line answers ``--help`` without loading PyTorch.
"""

from logitless import _logging
from logitless._lazy import exports

__version__ = "0.1.0"
_logging.configure()

_EXPORTS = {
    "tokenize_prompt_and_output": "logitless.data",
    "get_response_log_probs": "logitless.logprobs",
    **dict.fromkeys(("compute_group_normalized_rewards", "compute_grpo_clip_loss",
                     "compute_naive_policy_gradient_loss", "compute_policy_gradient_loss",
                     "grpo_microbatch_train_step", "sft_microbatch_train_step"), "logitless.losses"),
    **dict.fromkeys(("masked_mean", "masked_normalize"), "logitless.masked"),
    **dict.fromkeys(("BlockSizes", "GRPOSettings", "LinearHead", "compute_entropy",
                     "fused_grpo_loss", "fused_linear_cross_entropy",
                     "fused_linear_jsd", "fused_linear_kl", "fused_linear_logprobs"), "logitless.ops"),
    "math_reward": "logitless.rewards.math",
    "MultichoiceJudge": "logitless.multichoice.judge",
    "extract_answer_probability_from_logits": "logitless.multichoice.answer",
    "multichoice_judge_reward": "logitless.multichoice.reward",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
