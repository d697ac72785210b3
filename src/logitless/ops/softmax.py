"""The softmax accumulator of the block engine: per-token log p(target), entropy and mean log p, and on request
the statistics without gradient of `chunks.TOKEN_EXTRAS`.

It runs `chunks.OnlineSoftmax` over a row chunk's blocks through the chosen block kernels (the PyTorch
twins of `chunks.py` or the Triton kernels of `triton.py`), and turns a block into its logits gradient
with the closed form of `chunks.block_logits_grad`. Kept blocks (the one-pass schedule) use the PyTorch
math: ``keep="weights"`` keeps a block as ``exp(z - m)``, so that its gradient costs a rescale rather
than the exponentials again; a soft-capped head keeps the logits instead (``keep="logits"``: its slope
is read from them).
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch

from logitless.ops import chunks
from logitless.ops.chunks import OnlineSoftmax, StatGrads, TokenStats
from logitless.ops.engine import NewAccumulator
from logitless.ops.head import LinearHead
from logitless.ops.scratch import Scratch


class KeptWeights(NamedTuple):
    weights: torch.Tensor  # (n, c): exp(z - shift)
    shift: torch.Tensor  # (n,)


class SoftmaxAccumulator:
    """An `engine.Accumulator` of one row chunk: statistics `TokenStats`, per-row gradients `StatGrads`."""

    def __init__(self, head: LinearHead, targets: torch.Tensor, kernels: ModuleType, dtype: torch.dtype,
                 has_neg_inf: bool, need_entropy: bool, need_mean_log_prob: bool, extras: tuple[str, ...],
                 keep: str | None, scratch: Scratch):
        self.head, self.targets, self.kernels, self.has_neg_inf, self.keep = head, targets, kernels, has_neg_inf, keep
        self.scratch = scratch
        self.online = OnlineSoftmax(targets.shape[0], dtype, targets.device, need_entropy,
                                    need_logit_sum=need_mean_log_prob or "mean_logits" in extras,
                                    need_square_total="log_sum_sq_probs" in extras, need_top1="is_top1" in extras)

    def update(self, start: int, logits: list[torch.Tensor]):
        (block,) = logits  # (n, c)
        if self.keep is None:
            self.kernels.update_stats(self.online, block, start, self.targets, self.has_neg_inf, scratch=self.scratch)
            return None
        shift = chunks.update_stats(self.online, block, start, self.targets, self.has_neg_inf, keep=self.keep,
                                    scratch=self.scratch)
        return KeptWeights(block, shift) if self.keep == "weights" else logits

    def merge(self, other: SoftmaxAccumulator) -> None:
        self.online.merge(other.online)

    def finish(self) -> TokenStats:
        return self.online.result(self.head.vocab_size)

    def block_grad(self, start: int, block, stats: TokenStats, coefs: StatGrads) -> torch.Tensor:
        if isinstance(block, KeptWeights):
            return chunks.block_grad_from_weights(block.weights, block.shift, start, self.targets, stats.lse, coefs)
        (logits,) = block
        expected_logit = None if coefs.centered is None else stats.lse - stats.entropy  # (n,): E_p[z]
        return self.kernels.block_logits_grad(self.head, logits, start, self.targets, stats.lse, expected_logit,
                                              coefs, self.has_neg_inf, scratch=self.scratch)


def softmax_accumulators(head: LinearHead, targets: torch.Tensor, kernels: ModuleType, dtype: torch.dtype, *,
                         need_entropy: bool = False, need_mean_log_prob: bool = False, extras: tuple[str, ...] = (),
                         keep: str | None = None) -> NewAccumulator:
    """Row chunk -> its `SoftmaxAccumulator`, for the tokens' ``targets`` (N,) and statistics of ``dtype``; ``extras``
    names statistics of `chunks.TOKEN_EXTRAS` to keep the sums of. The chunks, which the engine runs one after
    another, share one `Scratch` for their blocks' temporaries."""
    has_neg_inf, scratch = head.may_have_neg_inf_logits, Scratch()
    return lambda rows: SoftmaxAccumulator(head, targets[rows], kernels, dtype, has_neg_inf, need_entropy,
                                           need_mean_log_prob, extras, keep, scratch)
