"""The implementation registry behind every op's ``impl`` (`ops/plan.py`): what "auto" picks, what a named one
needs, and the switch that sets it."""

import pytest
import torch

from logitless._checks import IMPLS
from logitless.ops.plan import IMPLEMENTATIONS, implementation
from logitless.ops.softmax import PYTORCH_BLOCKS


def test_every_impl_but_auto_is_a_registered_implementation():
    assert set(IMPLEMENTATIONS) == set(IMPLS) - {"auto"}
    assert [name for name, chosen in IMPLEMENTATIONS.items() if chosen.materializes] == ["reference"]


def test_auto_runs_the_pytorch_blocks_on_cpu_and_for_fp64(monkeypatch):
    monkeypatch.delenv("LOGITLESS_TRITON", raising=False)
    assert implementation("auto", torch.device("cpu"), torch.float32).kernels(PYTORCH_BLOCKS) is PYTORCH_BLOCKS
    monkeypatch.setenv("LOGITLESS_TRITON", "1")
    chosen = implementation("auto", torch.device("cpu"), torch.float64)  # gradcheck stays on PyTorch
    assert chosen.name == "chunked" and chosen.kernels(PYTORCH_BLOCKS) is PYTORCH_BLOCKS
    monkeypatch.setenv("LOGITLESS_TRITON", "0")
    assert implementation("auto", torch.device("cuda"), torch.float32).name == "chunked"
    assert implementation("reference", torch.device("cpu"), torch.float32).materializes


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
