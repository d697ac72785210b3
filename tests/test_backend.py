import pytest
import torch

from logitless.ops import backend, chunks


def test_pytorch_path_on_cpu_and_for_fp64(monkeypatch):
    monkeypatch.delenv("LOGITLESS_TRITON", raising=False)
    assert backend.chunk_kernels(torch.device("cpu"), torch.float32) is chunks
    monkeypatch.setenv("LOGITLESS_TRITON", "1")
    assert backend.chunk_kernels(torch.device("cpu"), torch.float64) is chunks  # gradcheck stays on PyTorch
    monkeypatch.setenv("LOGITLESS_TRITON", "0")
    assert backend.chunk_kernels(torch.device("cuda"), torch.float32) is chunks


def test_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("LOGITLESS_TRITON", "yes")
    with pytest.raises(ValueError, match="LOGITLESS_TRITON"):
        backend.chunk_kernels(torch.device("cpu"), torch.float32)
