"""Policy-gradient losses and microbatch train steps on per-token log-probs (B, T).

Group-normalized advantages, the naive / baseline / GRPO-clip per-token losses, and the SFT and
GRPO microbatch steps that scale by gradient accumulation and call ``backward()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from logitless._checks import (check_choice, check_finite, check_mask, check_positive_finite, check_positive_int,
                               check_same_shape, check_tensor)
from logitless.masked import masked_mean, masked_normalize

LOSS_TYPES = ("no_baseline", "reinforce_with_baseline", "grpo_clip")


def group_normalized_advantages(rewards: torch.Tensor, group_size: int, advantage_eps: float,
                                normalize_by_std: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards (N,) of groups of ``group_size`` consecutive responses -> (advantages (N,), whether each group's
    rewards are all equal (N / group_size, 1)); see `compute_group_normalized_rewards`."""
    grouped = rewards.view(-1, group_size)  # (num_groups, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        centered = centered / (std + advantage_eps)
    constant_group = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(constant_group, torch.zeros_like(centered), centered).reshape(-1), constant_group


def compute_group_normalized_rewards(reward_fn: Callable[[str, str], dict], rollout_responses: Sequence[str],
                                     repeated_ground_truths: Sequence[str], group_size: int, advantage_eps: float,
                                     normalize_by_std: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score each response and normalize within its group of ``group_size`` consecutive responses.

    advantage = (r - group mean) / (group std + eps), std unbiased; just r - mean when
    ``normalize_by_std`` is False. A group whose rewards are all equal gets advantage 0.
    Returns (advantages (N,), raw_rewards (N,), metadata).
    """
    if not callable(reward_fn):
        raise TypeError(f"reward_fn: expected a callable, got {type(reward_fn).__name__}")
    if len(rollout_responses) != len(repeated_ground_truths):
        raise ValueError(f"repeated_ground_truths: got {len(repeated_ground_truths)} for "
                         f"{len(rollout_responses)} rollout_responses")
    check_positive_int("group_size", group_size)
    if not rollout_responses or len(rollout_responses) % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the {len(rollout_responses)} rollout_responses")
    if advantage_eps < 0:
        raise ValueError(f"advantage_eps: must be >= 0, got {advantage_eps}")

    scores = [reward_fn(response, truth) for response, truth in zip(rollout_responses, repeated_ground_truths)]
    for i, score in enumerate(scores):
        if not isinstance(score, dict) or "reward" not in score:
            raise ValueError(f"reward_fn: must return a dict with a 'reward' key, got {score!r} for response {i}")
    raw_rewards = torch.tensor([float(s["reward"]) for s in scores], dtype=torch.float32)
    check_finite("reward_fn (its 'reward' values)", raw_rewards)

    advantages, constant_group = group_normalized_advantages(raw_rewards, group_size, advantage_eps, normalize_by_std)
    metadata = {"reward_mean": raw_rewards.mean().item(),
                "reward_std": raw_rewards.std().item() if len(scores) > 1 else 0.0,
                "reward_max": raw_rewards.max().item(), "reward_min": raw_rewards.min().item(),
                "constant_groups": constant_group.float().mean().item()}
    for key in scores[0]:
        if key != "reward" and all(isinstance(s.get(key), (int, float)) for s in scores):
            metadata[f"{key}_mean"] = sum(float(s[key]) for s in scores) / len(scores)
    return advantages, raw_rewards, metadata


def _check_per_sequence(name: str, value: torch.Tensor, policy_log_probs: torch.Tensor) -> None:
    check_tensor(name, value, floating=True)
    if value.shape != (policy_log_probs.shape[0], 1):
        raise ValueError(f"{name}: expected shape ({policy_log_probs.shape[0]}, 1), got {tuple(value.shape)}")


def compute_naive_policy_gradient_loss(raw_rewards_or_advantages: torch.Tensor,
                                       policy_log_probs: torch.Tensor) -> torch.Tensor:
    """-A * log p per token: (B, 1), (B, T) -> (B, T)."""
    check_tensor("policy_log_probs", policy_log_probs, ndim=2, floating=True)
    _check_per_sequence("raw_rewards_or_advantages", raw_rewards_or_advantages, policy_log_probs)
    return -raw_rewards_or_advantages * policy_log_probs


def compute_grpo_clip_loss(advantages: torch.Tensor, policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                           cliprange: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-min(r A, clip(r, 1-c, 1+c) A) per token, r = exp(logp - old): (B, 1), (B, T), (B, T) -> (B, T)."""
    check_tensor("policy_log_probs", policy_log_probs, ndim=2, floating=True)
    _check_per_sequence("advantages", advantages, policy_log_probs)
    check_tensor("old_log_probs", old_log_probs, floating=True)
    check_same_shape("old_log_probs", old_log_probs, "policy_log_probs", policy_log_probs)
    cliprange = check_positive_finite("cliprange", cliprange)
    ratio = torch.exp(policy_log_probs - old_log_probs)
    unclipped, clipped = ratio * advantages, ratio.clamp(1.0 - cliprange, 1.0 + cliprange) * advantages
    return -torch.minimum(unclipped, clipped), {"clipped": clipped < unclipped}


def compute_policy_gradient_loss(policy_log_probs: torch.Tensor, loss_type: str,
                                 raw_rewards: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                                 old_log_probs: torch.Tensor | None = None,
                                 cliprange: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (B, T) for ``loss_type`` in no_baseline | reinforce_with_baseline | grpo_clip."""
    check_choice("loss_type", loss_type, LOSS_TYPES)
    check_tensor("policy_log_probs", policy_log_probs, ndim=2, floating=True)
    if loss_type == "no_baseline":
        if raw_rewards is None:
            raise ValueError("raw_rewards: required for loss_type='no_baseline'")
        _check_per_sequence("raw_rewards", raw_rewards, policy_log_probs)
        return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}
    if advantages is None:
        raise ValueError(f"advantages: required for loss_type={loss_type!r}")
    _check_per_sequence("advantages", advantages, policy_log_probs)
    if loss_type == "reinforce_with_baseline":
        return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}
    if old_log_probs is None:
        raise ValueError("old_log_probs: required for loss_type='grpo_clip'")
    if cliprange is None:
        raise ValueError("cliprange: required for loss_type='grpo_clip'")
    return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange)


def sft_microbatch_train_step(policy_log_probs: torch.Tensor, response_mask: torch.Tensor,
                              gradient_accumulation_steps: int,
                              normalize_constant: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss = mean over the batch of -(masked sum of log p over the sequence / normalize_constant),
    divided by ``gradient_accumulation_steps``; calls ``loss.backward()``."""
    check_tensor("policy_log_probs", policy_log_probs, ndim=2, floating=True)
    keep = check_mask("response_mask", response_mask, "policy_log_probs", policy_log_probs)
    check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    per_sequence = -masked_normalize(policy_log_probs, keep, normalize_constant, dim=-1)  # (B,)
    loss = per_sequence.mean() / gradient_accumulation_steps
    loss.backward()
    tokens = keep.sum()
    return loss, {"num_response_tokens": tokens.detach(),
                  "mean_token_nll": (-masked_normalize(policy_log_probs.detach(), keep) / tokens.clamp(min=1))}


def grpo_microbatch_train_step(policy_log_probs: torch.Tensor, response_mask: torch.Tensor,
                               gradient_accumulation_steps: int, loss_type: str,
                               raw_rewards: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                               old_log_probs: torch.Tensor | None = None,
                               cliprange: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy-gradient loss, masked mean per sequence, mean over the batch,
    divided by ``gradient_accumulation_steps``; calls ``loss.backward()``."""
    check_tensor("policy_log_probs", policy_log_probs, ndim=2, floating=True)
    keep = check_mask("response_mask", response_mask, "policy_log_probs", policy_log_probs)
    check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    empty_rows = (~keep.any(dim=-1)).nonzero().flatten().tolist()
    if empty_rows:
        raise ValueError(f"response_mask: rows {empty_rows} have no response token; their mean would be NaN")
    per_token, metadata = compute_policy_gradient_loss(policy_log_probs, loss_type, raw_rewards, advantages,
                                                       old_log_probs, cliprange)
    loss = masked_mean(per_token, keep, dim=-1).mean() / gradient_accumulation_steps
    loss.backward()
    if "clipped" in metadata:
        metadata["clip_fraction"] = masked_mean(metadata["clipped"].float(), keep)
    return loss, metadata
