"""Which implementation of a block's statistics update and logits gradient runs: Triton or PyTorch.

Triton (`ops/triton.py`) is chosen automatically for fp32 chunk logits on CUDA when triton works;
the PyTorch twins in `ops/chunks.py` run everywhere else. ``LOGITLESS_TRITON=0`` turns Triton off;
``LOGITLESS_TRITON=1`` asks for it wherever it can run (with TRITON_INTERPRET=1 that includes the
CPU, which is how the tests check the kernels end to end).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from logitless.ops import chunks


def chunk_kernels(device: torch.device, stat_dtype: torch.dtype) -> ModuleType:
    """A module with ``update_stats`` and ``block_logits_grad`` for blocks of this device and dtype."""
    setting = os.environ.get("LOGITLESS_TRITON", "auto")
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"LOGITLESS_TRITON: expected auto, 0 or 1, got {setting!r}")
    wanted = setting == "1" or (setting == "auto" and device.type == "cuda")
    if setting == "0" or not wanted or stat_dtype != torch.float32:
        return chunks
    from logitless.ops import triton as triton_kernels

    return triton_kernels if triton_kernels.available() else chunks
