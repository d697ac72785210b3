import math

import torch
import torch.nn.functional as F

from logitless import compute_entropy
from logitless.ops.reference import cross_entropy, linear_logprobs


def test_entropy_matches_definition():
    logits = torch.randn(2, 5, 11)
    p = logits.softmax(-1)
    assert torch.allclose(compute_entropy(logits), -(p * p.log()).sum(-1), atol=1e-6)
    assert compute_entropy(logits).shape == (2, 5)


def test_entropy_uniform_is_log_v_and_one_hot_is_zero():
    assert math.isclose(compute_entropy(torch.zeros(151936)).item(), math.log(151936), rel_tol=1e-6)
    peaked = torch.tensor([[1e4, 0.0, 0.0], [-1e4, 5e4, 0.0]])
    entropy = compute_entropy(peaked)
    assert torch.isfinite(entropy).all() and entropy.abs().max() < 1e-6


def test_entropy_of_bf16_logits_is_fp32():
    assert compute_entropy(torch.randn(3, 7, dtype=torch.bfloat16)).dtype == torch.float32


def test_linear_logprobs_and_cross_entropy_agree_with_torch():
    hidden, weight = torch.randn(6, 4), torch.randn(9, 4)
    targets = torch.randint(0, 9, (6,))
    log_probs, _ = linear_logprobs(hidden, weight, targets, temperature=0.5)
    expected = F.log_softmax(hidden @ weight.T / 0.5, -1).gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(log_probs, expected, atol=1e-6)
    assert torch.allclose(cross_entropy(hidden @ weight.T, targets, reduction="none"),
                          -F.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None]).squeeze(1), atol=1e-6)
