"""The GRPO baseline on the same prompts and reward as GRADE, built from logitless's own primitives.

Per microbatch of ``batch_size`` completions: the first ``batch_size / grpo_group_size`` prompts, each
``grpo_group_size`` times (as many completions as a GRADE microbatch has rollouts). The policy samples
``max_new_tokens`` hard tokens at temperature 1 (`sample_tokens`), the same reward scores them as
one-hot soft tokens, and the KL penalty enters the reward as in classic RLHF:
``r - kl_coef * sum_t log(pi / pi_ref)(sampled token)`` (its REINFORCE gradient is that of
E[r] - kl_coef * KL). Advantages are group-normalized (`compute_group_normalized_rewards`) and the loss
is `fused_grpo_loss` (no logits) with `BASELINE_SETTINGS`: TRL's "grpo" loss, clipped at 0.2, no KL
term of its own (the penalty is in the reward), one update per sample so the ratio is 1. One policy
forward serves both the loss and the KL. The logged ``kl`` is the exact KL of the sampled prefixes
(`fused_linear_kl`), comparable with GRADE's.
"""

from __future__ import annotations

import torch

from logitless.grade.rewards import RewardInputs
from logitless.grade.rollout import sample_tokens
from logitless.grade.soft_tokens import PromptBatch, SoftTokens
from logitless.grade.trainer import TrainerBase
from logitless.hf import final_hidden_states
from logitless.losses import group_normalized_advantages
from logitless.ops.fused import fused_grpo_loss, fused_linear_logprobs
from logitless.op_settings import GRPOSettings

BASELINE_SETTINGS = GRPOSettings(loss_type="grpo", beta=0.0, epsilon_low=0.2, epsilon_high=0.2)


class GRPOBaseline(TrainerBase):
    """GRPO with the GRADE trainers' interface: ``train_step(prompts)`` (``noise`` is not used)."""

    def __init__(self, policy, reward, config, **kwargs):
        super().__init__(policy, reward, config, **kwargs)
        config.check_grpo_group()

    def microbatch(self, prompt: PromptBatch, noise, generator) -> dict:
        config = self.config
        group = config.grpo_group_size
        size = prompt.input_ids.shape[0]
        rows = torch.arange(size // group, device=self.device).repeat_interleave(group)
        grouped = PromptBatch(prompt.input_ids[rows], prompt.attention_mask[rows],
                              [prompt.records[int(i)] for i in rows])
        completion_ids = sample_tokens(self.policy, grouped, config.max_new_tokens, generator)  # (B, T)
        with torch.no_grad():
            rewards = self.reward(RewardInputs(grouped, SoftTokens.hard(completion_ids))).float()  # (B,)
        sequence = torch.cat([grouped.input_ids, completion_ids], dim=1)  # (B, P + T)
        attention = torch.cat([grouped.attention_mask, torch.ones_like(completion_ids)], dim=1)
        input_ids, attention = sequence[:, :-1], attention[:, :-1]  # each position predicts the next token
        # (B, T, H): the positions whose next token is a completion token, with the graph for the loss
        hidden = final_hidden_states(self.policy.model, input_ids, attention)[:, -config.max_new_tokens:]
        kl, log_ratio = self._kl(hidden.detach(), input_ids, attention, completion_ids)
        shaped = rewards - config.kl_coef * log_ratio  # (B,)
        advantages, _ = group_normalized_advantages(shaped, group, advantage_eps=1e-6, normalize_by_std=True)
        loss, _ = fused_grpo_loss(hidden, completion_ids=completion_ids,
                                  completion_mask=torch.ones_like(completion_ids),
                                  advantages=advantages.to(hidden.device), head=self.policy.head,
                                  settings=BASELINE_SETTINGS)
        (loss / config.gradient_accumulation_steps).backward()
        return {"reward": float(rewards.mean()), "kl": float(kl.mean()), "loss": float(loss.detach())}

    @torch.no_grad()
    def _kl(self, policy_hidden, input_ids, attention, completion_ids):
        """(exact KL(policy || reference) summed over the completion (B,), sum of log pi/pi_ref at the samples (B,)),
        from the policy's hidden states at the completion positions (B, T, H)."""
        steps = completion_ids.shape[1]
        reference_hidden = final_hidden_states(self.reference.model, input_ids, attention)[:, -steps:]
        kl = self.policy.kl_to(policy_hidden, self.reference, reference_hidden).sum(dim=1)
        log_probs = fused_linear_logprobs(policy_hidden, targets=completion_ids, head=self.policy.head)
        reference_log_probs = fused_linear_logprobs(reference_hidden, targets=completion_ids, head=self.reference.head)
        return kl, (log_probs - reference_log_probs).sum(dim=1)
