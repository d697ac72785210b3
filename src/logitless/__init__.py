"""logitless: LLM post-training (SFT, GRPO) that never builds the [batch, seq, vocab] logits unless asked.

`GRPOTrainerWithLogits` lives in `logitless.trl` (it imports TRL).
"""

from logitless.data import tokenize_prompt_and_output
from logitless.logprobs import get_response_log_probs
from logitless.losses import (compute_group_normalized_rewards, compute_grpo_clip_loss,
                              compute_naive_policy_gradient_loss, compute_policy_gradient_loss,
                              grpo_microbatch_train_step, sft_microbatch_train_step)
from logitless.masked import masked_mean, masked_normalize
from logitless.ops import (GRPOSettings, LinearHead, compute_entropy, fused_grpo_loss, fused_linear_cross_entropy,
                           fused_linear_kl, fused_linear_logprobs)
from logitless.rewards.math import math_reward
from logitless.multichoice.reward import (MultichoiceJudge, extract_answer_probability_from_logits,
                                           multichoice_judge_reward)

__version__ = "0.1.0"

__all__ = [
    "GRPOSettings", "LinearHead", "MultichoiceJudge", "compute_entropy", "compute_group_normalized_rewards",
    "compute_grpo_clip_loss",
    "compute_naive_policy_gradient_loss", "compute_policy_gradient_loss", "extract_answer_probability_from_logits",
    "fused_grpo_loss", "fused_linear_cross_entropy", "fused_linear_kl", "fused_linear_logprobs", "get_response_log_probs",
    "grpo_microbatch_train_step", "masked_mean", "masked_normalize", "math_reward", "multichoice_judge_reward",
    "sft_microbatch_train_step", "tokenize_prompt_and_output",
]
