import math

import pytest
import torch

from logitless import masked_mean, masked_normalize


def test_masked_normalize_values():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    assert masked_normalize(x, mask, 2.0).item() == pytest.approx((1 + 3 + 6) / 2)
    assert masked_normalize(x, mask, 2.0, dim=1).tolist() == [2.0, 3.0]
    assert masked_normalize(x, mask.bool(), dim=0).tolist() == [1.0, 0.0, 9.0]


def test_masked_mean_values_and_nan_rule():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(1.5)
    per_row = masked_mean(x, mask, dim=1)
    assert per_row[0].item() == pytest.approx(1.5)
    assert math.isnan(per_row[1].item())  # the mean of nothing
    assert math.isnan(masked_mean(x, torch.zeros_like(mask)).item())


def test_nan_under_the_mask_does_not_leak():
    x = torch.tensor([1.0, float("nan"), 3.0], requires_grad=True)
    mask = torch.tensor([1, 0, 1])
    out = masked_mean(x, mask)
    out.backward()
    assert out.item() == 2.0
    assert x.grad.tolist() == [0.5, 0.0, 0.5]


@pytest.mark.parametrize("fn", [masked_mean, masked_normalize])
def test_bad_masks(fn):
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="mask: shape"):
        fn(x, torch.ones(3, 2))
    with pytest.raises(ValueError, match="mask: expected a bool or 0/1"):
        fn(x, torch.full((2, 3), 0.5))
    with pytest.raises(TypeError, match="tensor"):
        fn([1.0], torch.ones(1))


def test_normalize_constant_zero_is_rejected():
    with pytest.raises(ValueError, match="normalize_constant"):
        masked_normalize(torch.ones(2), torch.ones(2), 0.0)
