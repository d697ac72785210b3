import pytest
import torch

from logitless.ops.head import LinearHead
from logitless.ops.lazy import CompletionLogits


def test_rows_equal_materialized_logits():
    hidden, weight, bias = torch.randn(7, 5), torch.randn(101, 5), torch.randn(101)
    view = CompletionLogits(hidden, LinearHead(weight, bias=bias, temperature=0.5))
    full = (hidden @ weight.T + bias) / 0.5
    assert view.shape == (7, 101) and len(view) == 7
    torch.testing.assert_close(view[3], full[3])
    torch.testing.assert_close(view[-1], full[-1])
    torch.testing.assert_close(view[2:5], full[2:5])
    torch.testing.assert_close(view[[0, 6]], full[[0, 6]])
    assert view[0].dtype == torch.float32 and not view[0].requires_grad
    for empty in (slice(10, 20), [], torch.tensor([], dtype=torch.long)):  # as the (C, V) tensor gives
        assert view[empty].shape == full[empty].shape == (0, 101)
    import numpy as np

    torch.testing.assert_close(view[np.int64(2)], full[2])


def test_softcapped_and_scaled_rows():
    hidden, weight = torch.randn(4, 5), torch.randn(101, 5)
    view = CompletionLogits(hidden, LinearHead(weight, temperature=0.5, softcap=1.5, logit_scale=2.0))
    torch.testing.assert_close(view[1:3], 1.5 * torch.tanh(2.0 * (hidden[1:3] @ weight.T) / 1.5) / 0.5)


def test_builds_no_completion_sized_logits():
    """Made and read, the view allocates the rows asked for and nothing larger: never the completion's (C, V)
    logits, nor a copy of the head."""
    from torch.profiler import ProfilerActivity, profile

    num_tokens, vocab = 100, 151936
    weight = torch.randn(vocab, 8)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        view = CompletionLogits(torch.randn(num_tokens, 8), LinearHead(weight))
        rows = view[10:13]  # (3, V)
        row = view[37]  # (V,)
    largest = max(event.self_cpu_memory_usage for event in prof.events())  # one allocation's bytes
    assert rows.shape == (3, vocab) and row.shape == (vocab,)
    assert 3 * vocab * 4 <= largest <= 3 * vocab * 4 + 4096  # the three rows, not the 100 of (C, V)
    assert view.head.weight.data_ptr() == weight.data_ptr()  # shared, not copied


def test_bad_input():
    view = CompletionLogits(torch.randn(3, 4), LinearHead(torch.randn(9, 4)))
    with pytest.raises(IndexError, match="out of range"):
        view[3]
    with pytest.raises(TypeError, match="index"):
        view["a"]
    with pytest.raises(ValueError, match="hidden: size"):
        CompletionLogits(torch.randn(3, 5), LinearHead(torch.randn(9, 4)))
    with pytest.raises(TypeError, match="head: expected a LinearHead"):
        CompletionLogits(torch.randn(3, 4), torch.randn(9, 4))
    with pytest.raises(ValueError, match="temperature"):
        LinearHead(torch.randn(9, 4), temperature=0)
