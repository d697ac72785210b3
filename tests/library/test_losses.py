import math

import pytest
import torch

from logitless import (compute_group_normalized_rewards, compute_grpo_clip_loss, compute_naive_policy_gradient_loss,
                       compute_policy_gradient_loss, grpo_microbatch_train_step, sft_microbatch_train_step)


def _length_reward(response, truth):
    return {"reward": float(len(response)), "format_reward": 1.0}


def test_group_normalized_rewards_values():
    responses = ["a", "bb", "ccc", "dddd", "x", "yy"]
    advantages, raw, meta = compute_group_normalized_rewards(_length_reward, responses, ["t"] * 6, 3, 1e-6, True)
    assert raw.tolist() == [1, 2, 3, 4, 1, 2]
    expected = []
    for group in ([1.0, 2.0, 3.0], [4.0, 1.0, 2.0]):
        g = torch.tensor(group)
        expected += ((g - g.mean()) / (g.std() + 1e-6)).tolist()  # unbiased std
    torch.testing.assert_close(advantages, torch.tensor(expected))
    centered, _, _ = compute_group_normalized_rewards(_length_reward, responses, ["t"] * 6, 3, 1e-6, False)
    torch.testing.assert_close(centered, torch.tensor([-1.0, 0, 1, 5 / 3, -4 / 3, -1 / 3]))
    assert meta["reward_mean"] == pytest.approx(13 / 6) and meta["format_reward_mean"] == 1.0


def test_constant_groups_get_zero_advantage_never_nan():
    def constant(response, truth):
        return {"reward": 0.1}

    for normalize in (True, False):
        advantages, _, meta = compute_group_normalized_rewards(constant, ["a"] * 6, ["t"] * 6, 3, 0.0, normalize)
        assert advantages.tolist() == [0.0] * 6 and meta["constant_groups"] == 1.0
    advantages, _, _ = compute_group_normalized_rewards(_length_reward, ["a", "bb"], ["t"] * 2, 1, 1e-6, True)
    assert advantages.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(group_size=4), "group_size: 4 does not divide"),
    (dict(group_size=0), "group_size"),
    (dict(repeated_ground_truths=["t"]), "repeated_ground_truths"),
    (dict(reward_fn=lambda r, t: {"reward": float("nan")}), "reward_fn.*NaN"),
    (dict(reward_fn=lambda r, t: 1.0), "reward_fn: must return a dict"),
])
def test_group_rewards_bad_input(kwargs, match):
    args = dict(reward_fn=_length_reward, rollout_responses=["a"] * 6, repeated_ground_truths=["t"] * 6,
                group_size=3, advantage_eps=1e-6, normalize_by_std=True) | kwargs
    with pytest.raises(ValueError, match=match):
        compute_group_normalized_rewards(**args)


def test_naive_and_clip_losses():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    adv = torch.tensor([[2.0], [-1.0]])
    torch.testing.assert_close(compute_naive_policy_gradient_loss(adv, logp), -adv * logp)
    old = torch.tensor([[-1.5, -2.0], [-0.5, -0.5]])
    loss, meta = compute_grpo_clip_loss(adv, logp, old, 0.2)
    ratio = (logp - old).exp()
    expected = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    torch.testing.assert_close(loss, expected)
    # row 0 token 0: ratio e^0.5 > 1.2 with A > 0 -> clipped; row 1 token 1: ratio e^0.4 > 1.2, A < 0 -> unclipped
    assert meta["clipped"].tolist() == [[True, False], [False, False]]


def test_policy_gradient_dispatch_and_errors():
    logp, adv, raw = torch.randn(2, 3), torch.randn(2, 1), torch.randn(2, 1)
    torch.testing.assert_close(compute_policy_gradient_loss(logp, "no_baseline", raw_rewards=raw)[0], -raw * logp)
    torch.testing.assert_close(compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=adv)[0],
                               -adv * logp)
    with pytest.raises(ValueError, match="loss_type"):
        compute_policy_gradient_loss(logp, "ppo", advantages=adv)
    with pytest.raises(ValueError, match="old_log_probs: required"):
        compute_policy_gradient_loss(logp, "grpo_clip", advantages=adv, cliprange=0.2)
    with pytest.raises(ValueError, match="raw_rewards: required"):
        compute_policy_gradient_loss(logp, "no_baseline")
    with pytest.raises(ValueError, match=r"advantages: expected shape \(2, 1\)"):
        compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=torch.randn(2))
    with pytest.raises(ValueError, match="old_log_probs: shape"):
        compute_grpo_clip_loss(adv, logp, torch.randn(2, 4), 0.2)


def test_sft_step_scales_by_accumulation_and_accumulates():
    logp = torch.randn(3, 5, requires_grad=True)
    mask = (torch.rand(3, 5) > 0.4).float()
    loss, meta = sft_microbatch_train_step(logp, mask, gradient_accumulation_steps=4, normalize_constant=2.0)
    expected = (-(logp * mask).sum(-1) / 2.0).mean() / 4
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logp.grad, -mask / 2.0 / 3 / 4)
    sft_microbatch_train_step(logp, mask, gradient_accumulation_steps=4, normalize_constant=2.0)
    torch.testing.assert_close(logp.grad, 2 * (-mask / 2.0 / 3 / 4))  # gradients add up across calls
    assert meta["num_response_tokens"].item() == mask.sum().item()


@pytest.mark.parametrize("loss_type", ["no_baseline", "reinforce_with_baseline", "grpo_clip"])
def test_grpo_step_matches_manual_and_accumulates(loss_type):
    torch.manual_seed(1)
    logp = (torch.randn(4, 6) - 1).requires_grad_()
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    mask[3, :2] = 0
    adv, raw, old = torch.randn(4, 1), torch.rand(4, 1), logp.detach() + 0.3 * torch.randn(4, 6)
    kwargs = dict(raw_rewards=raw, advantages=adv, old_log_probs=old, cliprange=0.2)
    loss, _ = grpo_microbatch_train_step(logp, mask, 2, loss_type, **kwargs)

    manual_logp = logp.detach().clone().requires_grad_()
    per_token, _ = compute_policy_gradient_loss(manual_logp, loss_type, **kwargs)
    manual = ((per_token * mask).sum(-1) / mask.sum(-1)).mean() / 2
    manual.backward()
    torch.testing.assert_close(loss, manual)
    torch.testing.assert_close(logp.grad, manual_logp.grad)
    grpo_microbatch_train_step(logp, mask, 2, loss_type, **kwargs)
    torch.testing.assert_close(logp.grad, 2 * manual_logp.grad)


def test_microbatch_step_bad_input():
    logp = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="response_mask: shape"):
        sft_microbatch_train_step(logp, torch.ones(2, 4), 1)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        sft_microbatch_train_step(logp, torch.ones(2, 3), 0)
    empty_row = torch.ones(2, 3)
    empty_row[1] = 0
    with pytest.raises(ValueError, match=r"response_mask: rows \[1\]"):
        grpo_microbatch_train_step(logp, empty_row, 1, "reinforce_with_baseline", advantages=torch.ones(2, 1))
    assert math.isfinite(sft_microbatch_train_step(logp, empty_row, 1)[0].item())
