"""The implementation registry behind every op's ``impl`` (`ops/api.py`): the chain each impl tries, what "auto"
picks, what a named one needs, the switch that sets it, and the fallback from one that cannot run a call."""

import pytest
import torch

from logitless._checks import IMPLS
from logitless.ops.api import IMPLEMENTATIONS, implementations
from logitless.ops.base import CannotRunHere
from logitless.ops.head import LinearHead
from logitless.ops.blocks import Blocks
from logitless.ops.materialized import Materialized
from logitless.ops.one_pass import OnePass
from logitless.ops.softmax import PYTORCH_BLOCKS


def implementation(impl, device, dtype):
    """The block math a chain ends in: what runs every call the one pass does not."""
    return implementations(impl, device, dtype)[-1]


def test_every_impl_but_auto_is_a_registered_chain():
    assert set(IMPLEMENTATIONS) == set(IMPLS) - {"auto"}
    assert [name for name, chain in IMPLEMENTATIONS.items() if any(c.whole_vocabulary for c in chain)] == ["reference"]
    assert [type(chosen) for chosen in IMPLEMENTATIONS["chunked"]] == [OnePass, Blocks]
    assert [type(chosen) for chosen in IMPLEMENTATIONS["reference"]] == [Materialized]


def test_auto_runs_the_pytorch_blocks_on_cpu_and_for_fp64(monkeypatch):
    monkeypatch.delenv("LOGITLESS_TRITON", raising=False)
    assert implementation("auto", torch.device("cpu"), torch.float32).kernels(PYTORCH_BLOCKS) is PYTORCH_BLOCKS
    monkeypatch.setenv("LOGITLESS_TRITON", "1")
    chosen = implementation("auto", torch.device("cpu"), torch.float64)  # gradcheck stays on PyTorch
    assert chosen.name == "chunked" and chosen.kernels(PYTORCH_BLOCKS) is PYTORCH_BLOCKS
    monkeypatch.setenv("LOGITLESS_TRITON", "0")
    assert implementation("auto", torch.device("cuda"), torch.float32).name == "chunked"
    assert implementation("reference", torch.device("cpu"), torch.float32).whole_vocabulary


def test_a_loss_the_one_pass_cannot_fold_falls_back_to_the_two_passes(monkeypatch):
    """The one pass has no statistics step, and raises CannotRunHere for a loss it does not fold in one pass here; the
    chain's two passes then run the call, with the same loss and gradients as the one pass where both run."""
    from logitless.ops import fused_linear_cross_entropy
    from logitless.ops.api import first_that_runs
    from logitless.ops.one_pass import LinearLoss

    assert not hasattr(OnePass(), "token_stats")
    with pytest.raises(CannotRunHere):  # no gradient asked for: nothing for the one pass to fold in
        first_that_runs((OnePass(),), "loss", LinearHead(torch.randn(5, 3)), torch.randn(2, 3), torch.tensor([1, 2]),
                        lambda rows, log_probs, *_: -log_probs.sum())
    applied, apply = [], LinearLoss.apply
    monkeypatch.setattr(LinearLoss, "apply", staticmethod(lambda *args: applied.append(1) or apply(*args)))
    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(0, 50, (6,))
    grads = []
    for one_pass_setting in ("1", "0"):
        monkeypatch.setenv("LOGITLESS_ONE_PASS", one_pass_setting)
        loss = fused_linear_cross_entropy(hidden, weight, targets, impl="chunked")
        grads.append((loss.detach(), *torch.autograd.grad(loss, (hidden, weight))))
    assert applied == [1]  # the one pass ran the first call only; the two passes the second
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_named_implementation_that_cannot_run_here_is_refused_by_name(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="^impl: 'triton' needs a CUDA device"):
        implementation("triton", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="^impl: expected one of 'auto', 'reference', 'chunked', 'triton', got 'fast'"):
        implementation("fast", torch.device("cpu"), torch.float32)


def test_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("LOGITLESS_TRITON", "yes")
    with pytest.raises(ValueError, match="LOGITLESS_TRITON"):
        implementation("auto", torch.device("cpu"), torch.float32)
