"""The implementations ``impl="chunked"`` and ``impl="triton"``: the block engine's two passes (`engine.LinearStats`)
with a block math, the PyTorch one of each accumulator module (`softmax.py`, `kl.py`, `jsd.py`) or the Triton kernels
of `triton.py`, on CUDA (or anywhere under ``TRITON_INTERPRET=1``) for fp32 block logits; when "auto" chose the
kernels, behind `fallback.FallingBack`, which gives way to the PyTorch twins where a kernel cannot compile or launch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

from logitless.op_settings import BlockSizes
from logitless.ops.base import StatsThenLoss
from logitless.ops.engine import LinearStats
from logitless.ops.fallback import FallingBack
from logitless.ops.head import LinearHead, stat_dtype
from logitless.ops.jsd import PYTORCH_BLOCKS as JSD_BLOCKS, JSDAccumulator
from logitless.ops.kl import PYTORCH_BLOCKS as KL_BLOCKS, KLAccumulator
from logitless.ops.plan import plan_blocks
from logitless.ops.softmax import PYTORCH_BLOCKS as SOFTMAX_BLOCKS, SoftmaxAccumulator


@dataclass(frozen=True)
class Blocks(StatsThenLoss):
    """The two passes with the PyTorch block math, or with the Triton kernels (``triton``; ``falls_back``: chosen by
    "auto", a kernel that cannot run here gives way to the PyTorch blocks)."""

    name: str
    triton: bool = False
    falls_back: bool = False
    whole_vocabulary = False  # a head sharded on the vocabulary runs on this rank's shard

    def unusable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why these blocks cannot run ``dtype`` statistics on ``device`` (None: they can)."""
        if not self.triton:
            return None
        from logitless.ops import triton as triton_kernels

        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if not triton_kernels.available() or not (device.type == "cuda" or interpreted):
            return (f"'triton' needs a CUDA device with triton installed (or TRITON_INTERPRET=1), got {device.type}"
                    f"{'' if triton_kernels.triton is not None else ' without triton'}")
        if dtype != torch.float32:
            return f"'triton' runs fp32 block logits (float32, bfloat16 or float16 inputs), got {dtype} statistics"
        return None

    def kernels(self, pytorch: SimpleNamespace) -> SimpleNamespace | ModuleType:
        """The block math an accumulator runs: ``pytorch`` (the ``PYTORCH_BLOCKS`` of its module) or the module
        `triton`, which has every function of theirs (behind `fallback.FallingBack` when "auto" chose it)."""
        if not self.triton:
            return pytorch
        from logitless.ops import triton as triton_kernels

        return FallingBack(triton_kernels, pytorch) if self.falls_back else triton_kernels

    def token_stats(self, head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, *, need_entropy: bool = True,
                    need_mean_log_prob: bool = False, extras: tuple[str, ...] = (), sizes: BlockSizes = BlockSizes()):
        accumulator = SoftmaxAccumulator(head, targets, self.kernels(SOFTMAX_BLOCKS), stat_dtype(hidden.dtype),
                                         need_entropy=need_entropy, need_mean_log_prob=need_mean_log_prob,
                                         extras=extras)
        plan = plan_blocks(hidden.shape[0], head, hidden.device, sizes)
        log_probs, entropy, mean_log_prob, *extra_values = LinearStats.apply(accumulator, plan, hidden, head.weight,
                                                                             head.bias)
        return log_probs, entropy, mean_log_prob, dict(zip(extras, extra_values))

    def kl(self, head_p: LinearHead, hidden_p: torch.Tensor, head_q: LinearHead, hidden_q: torch.Tensor,
           sizes: BlockSizes) -> torch.Tensor:
        accumulator = KLAccumulator(head_p, head_q, self.kernels(KL_BLOCKS), stat_dtype(hidden_p.dtype),
                                    hidden_p.device)
        plan = plan_blocks(hidden_p.shape[0], head_p, hidden_p.device, sizes)
        (kl,) = LinearStats.apply(accumulator, plan, hidden_p, head_p.weight, head_p.bias, hidden_q)
        return kl

    def jsd(self, head_s: LinearHead, hidden_s: torch.Tensor, head_t: LinearHead, hidden_t: torch.Tensor, beta: float,
            sizes: BlockSizes) -> tuple[torch.Tensor, torch.Tensor]:
        accumulator = JSDAccumulator(head_s, head_t, beta, self.kernels(JSD_BLOCKS), stat_dtype(hidden_s.dtype),
                                     hidden_s.device)
        plan = plan_blocks(hidden_s.shape[0], head_s, hidden_s.device, sizes)
        return LinearStats.apply(accumulator, plan, hidden_s, head_s.weight, head_s.bias, hidden_t)
