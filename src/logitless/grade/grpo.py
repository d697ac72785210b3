"""The GRPO baseline on the same prompts and reward as GRADE, built from logitless's own primitives.

Per microbatch of ``batch_size`` completions: the first ``batch_size / grpo_group_size`` prompts, each
``grpo_group_size`` times (as many completions as a GRADE microbatch has rollouts). The policy samples
``max_new_tokens`` hard tokens at temperature 1 (`sample_tokens`), the same reward scores them as
one-hot soft tokens, and the KL penalty enters the reward as in classic RLHF:
``r - kl_coef * sum_t log(pi / pi_ref)(sampled token)`` (its REINFORCE gradient is that of
E[r] - kl_coef * KL). Advantages are group-normalized (`compute_group_normalized_rewards`), log-probs
come from `get_response_log_probs` (fused, no logits) and the step is `grpo_microbatch_train_step`
(grpo_clip, one update per sample so the ratio is 1). The logged ``kl`` is the exact KL of the
sampled prefixes (`fused_linear_kl`), comparable with GRADE's.
"""

from __future__ import annotations

import torch

from logitless.grade.rewards import RewardInputs
from logitless.grade.rollout import sample_tokens
from logitless.grade.soft_tokens import PromptBatch, SoftTokens
from logitless.grade.trainer import _Trainer
from logitless.hf import final_hidden_states
from logitless.logprobs import get_response_log_probs
from logitless.losses import compute_group_normalized_rewards, grpo_microbatch_train_step
from logitless.ops.fused import head_logprobs


class GRPOBaseline(_Trainer):
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
        input_ids, labels, attention = sequence[:, :-1], sequence[:, 1:], attention[:, :-1]
        response_mask = torch.zeros_like(labels, dtype=torch.bool)
        response_mask[:, grouped.input_ids.shape[1] - 1:] = True  # labels that are completion tokens
        log_probs = get_response_log_probs(self.policy.model, input_ids, labels, attention_mask=attention)["log_probs"]
        kl, log_ratio = self._kl(input_ids, labels, attention, log_probs.detach())
        shaped = rewards - config.kl_coef * log_ratio  # (B,)
        advantages, _, _ = compute_group_normalized_rewards(
            lambda index, _: {"reward": float(shaped[index])}, list(range(size)), [None] * size, group,
            advantage_eps=1e-6, normalize_by_std=True)  # responses are their row numbers: scored above, in one batch
        loss, _ = grpo_microbatch_train_step(log_probs, response_mask, config.gradient_accumulation_steps, "grpo_clip",
                                             advantages=advantages[:, None].to(log_probs.dtype),
                                             old_log_probs=log_probs.detach(), cliprange=0.2)
        return {"reward": float(rewards.mean()), "kl": float(kl.mean()),
                "loss": float(loss.detach()) * config.gradient_accumulation_steps}

    @torch.no_grad()
    def _kl(self, input_ids, labels, attention, log_probs):
        """(exact KL(policy || reference) summed over the completion (B,), sum of log pi/pi_ref at the samples (B,))."""
        steps = self.config.max_new_tokens
        policy_hidden = final_hidden_states(self.policy.model, input_ids, attention)[:, -steps:]  # (B, T, H)
        reference_hidden = final_hidden_states(self.reference.model, input_ids, attention)[:, -steps:]
        kl = self.policy.kl_to(policy_hidden, self.reference, reference_hidden).sum(dim=1)
        head = self.reference.head
        reference_log_probs = head_logprobs(head, reference_hidden, labels[:, -steps:])
        return kl, (log_probs[:, -steps:] - reference_log_probs).sum(dim=1)
