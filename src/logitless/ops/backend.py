"""Which implementation of an op runs (``impl``), and for the block engine, which block kernels: Triton or PyTorch.

``impl`` is one of `logitless._keywords.IMPLS`: "reference" materializes the logits (`ops/reference.py`), "chunked" runs
the PyTorch block math (`ops/chunks.py`, `ops/kl_blocks.py` for the KL, `ops/jsd_blocks.py` for the
generalized JSD), "triton" the Triton kernels of `ops/triton.py`, and "auto" picks: Triton for fp32
block logits on CUDA when triton works, PyTorch everywhere else. ``LOGITLESS_TRITON`` sets what "auto"
picks: ``0`` turns Triton off; ``1`` asks for it wherever it can run (with TRITON_INTERPRET=1 that
includes the CPU, which is how the tests check the kernels end to end).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from logitless._checks import switch_setting
from logitless._keywords import IMPLS, check_impl
from logitless.ops import chunks

BLOCK_IMPLS = tuple(impl for impl in IMPLS if impl != "reference")  # the implementations that run the block engine


def chunk_kernels(device: torch.device, stat_dtype: torch.dtype, impl: str = "auto",
                  pytorch: ModuleType = chunks) -> ModuleType:
    """The block math for blocks of this device and dtype under ``impl``: the module ``pytorch`` (`chunks` for the
    softmax accumulator, `kl_blocks` for the KL's, `jsd_blocks` for the JSD's) or `triton`, which has every kernel
    those modules have."""
    check_impl(impl, BLOCK_IMPLS)
    if impl == "chunked":
        return pytorch
    if impl == "triton":
        return _triton_kernels(device, stat_dtype)
    setting = switch_setting("LOGITLESS_TRITON")
    wanted = setting == "1" or (setting == "auto" and device.type == "cuda")
    if not wanted or stat_dtype != torch.float32:
        return pytorch
    from logitless.ops import triton as triton_kernels

    return triton_kernels if triton_kernels.available() else pytorch


def _triton_kernels(device: torch.device, stat_dtype: torch.dtype) -> ModuleType:
    from logitless.ops import triton as triton_kernels

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not triton_kernels.available() or not (device.type == "cuda" or interpreted):
        raise ValueError(f"impl: 'triton' needs a CUDA device with triton installed (or TRITON_INTERPRET=1), "
                         f"got {device.type}{'' if triton_kernels.triton is not None else ' without triton'}")
    if stat_dtype != torch.float32:
        raise ValueError(f"impl: 'triton' runs fp32 block logits (float32, bfloat16 or float16 inputs), "
                         f"got {stat_dtype} statistics")
    return triton_kernels
