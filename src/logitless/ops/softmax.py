"""The softmax accumulator of the block engine: per-token log p(target), entropy and mean log p, and on request
the statistics without gradient of `TOKEN_EXTRAS`, with the math of one block of logits (the PyTorch twins of
the Triton kernels in `triton.py`).

A block is the logits ``z`` of some tokens (rows) over some vocabulary entries (columns), fp32.
`update_stats` folds a block into an online softmax, as in flash attention. Per token it keeps the
running max m, ``s = sum exp(z - m)`` and ``w = sum exp(z - m) * (z - m)``, rescaled whenever m
grows, the target's logit and (for label smoothing) ``sum z``. Once every block has been seen

    lse = m + log s        log p(target) = z_target - lse        entropy = log s - w / s
    mean log p = sum z / V - lse

so the entropy comes from numbers of its own size (no cancellation between two large log-sum-exps).
Asked for, the same pass also keeps ``q = sum exp(2 (z - m))`` and the max of the logits left of the
target, for the statistics without gradient of `TOKEN_EXTRAS` (TRL's names):

    log_sum_sq_probs = log sum p^2 = log q - 2 log s        mean_logits = sum z / V
    is_top1 = z_target >= m and z_target > max(z left of the target)  (the first argmax, as torch.argmax)

`block_logits_grad`: with lse known, the gradient of a loss with respect to a block's logits has a
closed form in the gradients g_lp, g_H, g_m that the loss sends to the three statistics,

    dz = g_lp * onehot(target) - p * (g_lp + g_m) - g_H * p * (z - E_p[z]) + g_m / V,

carried back through the soft cap and the logit factor to ``hidden @ weight.T + bias``. -inf logits
(a -inf bias on padded vocabulary rows) are exact: p = 0 there and 0 * log 0 counts 0.

`SoftmaxAccumulator` is what the ops compute: `engine.LinearStats` runs its two passes (``outputs``: log-probs,
entropy, mean log p and the extras), and the one-pass schedule its `SoftmaxSweep`s, which keep a block for its
gradient: ``keep="weights"`` keeps a block as ``exp(z - m)``, so that its gradient costs a rescale rather
than the exponentials again; a soft-capped head keeps the logits instead (``keep="logits"``: its slope is
read from them). The block math is this module's or the Triton kernels', as the op's implementation says.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import NamedTuple

import torch

from logitless.ops.base import merged_across
from logitless.ops.engine import Scratch
from logitless.ops.head import LinearHead


TOKEN_EXTRAS = ("log_sum_sq_probs", "mean_logits", "is_top1")  # per-token statistics without gradient


class TokenStats(NamedTuple):
    """Per-token statistics of softmax(logits), (n,) each, stat dtype (is_top1: bool). Unrequested ones are None."""

    lse: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    mean_log_prob: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


class OnlineSoftmax:
    """The running per-token sums over vocabulary blocks (see the module docstring)."""

    def __init__(self, num_rows: int, dtype: torch.dtype, device: torch.device, need_entropy: bool,
                 need_logit_sum: bool, need_square_total: bool = False, need_top1: bool = False):
        def zeros():
            return torch.zeros(num_rows, dtype=dtype, device=device)

        def minus_inf():
            return torch.full((num_rows,), float("-inf"), dtype=dtype, device=device)

        self.max = minus_inf()  # running max of z
        self.shift = zeros()  # what the sums measure z from: the max where it is finite, else 0
        self.total = zeros()  # sum exp(z - shift)
        self.weighted = zeros() if need_entropy else None  # sum exp(z - shift) * (z - shift)
        self.logit_sum = zeros() if need_logit_sum else None  # sum z
        self.square_total = zeros() if need_square_total else None  # sum exp(2 (z - shift))
        self.max_before_target = minus_inf() if need_top1 else None  # max of z over the columns left of the target
        self.target_logit = minus_inf()

    def rescale(self, block_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Move the sums to the new running max; returns (new shift, factor the old sums were scaled by)."""
        self.max = torch.maximum(self.max, block_max)
        new_shift = torch.where(torch.isneginf(self.max), 0.0, self.max)
        # rows with nothing summed yet stay at 0 (their old shift may be far from the new one)
        factor = torch.where(self.total > 0, torch.exp(self.shift - new_shift), 0.0)
        if self.weighted is not None:  # exp(z - m') (z - m') = f exp(z - m) ((z - m) + (m - m'))
            self.weighted = factor * (self.weighted + (self.shift - new_shift) * self.total)
        if self.square_total is not None:
            self.square_total = factor.square() * self.square_total
        self.total = factor * self.total
        self.shift = new_shift
        return new_shift, factor

    def merge(self, other: OnlineSoftmax) -> None:
        """Fold in ``other``: the sums of the same rows over other blocks (measured from its own shift)."""
        shift, _ = self.rescale(other.max)
        factor = torch.where(other.total > 0, torch.exp(other.shift - shift), 0.0)  # other's sums to this shift
        if self.weighted is not None:
            self.weighted = self.weighted + factor * (other.weighted + (other.shift - shift) * other.total)
        if self.square_total is not None:
            self.square_total = self.square_total + factor.square() * other.square_total
        self.total = self.total + factor * other.total
        if self.logit_sum is not None:
            self.logit_sum = self.logit_sum + other.logit_sum
        if self.max_before_target is not None:
            self.max_before_target = torch.maximum(self.max_before_target, other.max_before_target)
        self.target_logit = torch.maximum(self.target_logit, other.target_logit)  # -inf where a state has none

    SUMS = ("max", "shift", "total", "weighted", "logit_sum", "square_total", "max_before_target", "target_logit")

    def state(self) -> list[torch.Tensor]:
        """The running sums that are kept, (n,) each, in `SUMS` order: what another rank merges (`with_state`)."""
        return [getattr(self, name) for name in self.SUMS if getattr(self, name) is not None]

    def with_state(self, values: list[torch.Tensor]) -> OnlineSoftmax:
        """A copy holding ``values`` (another `state` of the same sums, as many) instead of its own."""
        peer = copy.copy(self)
        for name, value in zip([name for name in self.SUMS if getattr(self, name) is not None], values, strict=True):
            setattr(peer, name, value)
        return peer

    def lse(self) -> torch.Tensor:
        """log sum exp(z) (n,)."""
        return self.shift + self.total.log()

    def entropy(self) -> torch.Tensor:
        """-sum p log p (n,), where its sum was kept."""
        return self.total.log() - self.weighted / self.total

    def result(self, vocab_size: int) -> TokenStats:
        """The statistics whose sums were kept; the others None."""
        log_total = self.total.log()
        lse = self.lse()
        entropy = None if self.weighted is None else self.entropy()
        mean_logits = None if self.logit_sum is None else self.logit_sum / vocab_size
        log_sum_sq_probs = None if self.square_total is None else self.square_total.log() - 2 * log_total
        is_top1 = None if self.max_before_target is None else (
            (self.target_logit >= self.max) & (self.target_logit > self.max_before_target))
        return TokenStats(lse, self.target_logit - lse, entropy, None if mean_logits is None else mean_logits - lse,
                          log_sum_sq_probs, mean_logits, is_top1)


def targets_in_block(targets: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows whose target lies in columns [start, start + width), those targets' columns within the block)."""
    rows = ((targets >= start) & (targets < start + width)).nonzero().squeeze(1)
    return rows, targets[rows] - start


def update_stats(stats: OnlineSoftmax, logits: torch.Tensor, start: int, targets: torch.Tensor,
                 has_neg_inf: bool, keep: str | None = None, scratch: Scratch | None = None) -> torch.Tensor:
    """Add one block of logits (n, c) to the running sums; returns the shift m (n,) the block was measured from.

    ``keep``: None consumes ``logits``; "logits" leaves them as they are; "weights" overwrites them with
    ``exp(z - m)`` (what `block_grad_from_weights` turns into the gradient). ``has_neg_inf``: the block
    may hold -inf logits, which must count as 0 * log 0 = 0. ``scratch`` holds the block's temporaries
    (fresh tensors without it).
    """
    scratch = scratch or Scratch()
    rows, columns = targets_in_block(targets, start, logits.shape[1])
    stats.target_logit[rows] = logits[rows, columns]
    if stats.logit_sum is not None:
        stats.logit_sum += logits.sum(dim=1)
    block_max = logits.amax(dim=1)  # (n,)
    if stats.max_before_target is not None:
        _update_max_before_target(stats, logits, block_max, start, targets, rows, columns)
    shift, _ = stats.rescale(block_max)
    if keep is None:
        shifted = logits.sub_(shift.unsqueeze(1))  # (n, c), <= 0
    else:
        shifted = torch.sub(logits, shift.unsqueeze(1), out=scratch.like("shifted", logits))
    if keep == "weights":
        weights = torch.exp(shifted, out=logits)
    elif keep is None and stats.weighted is None:  # nothing reads the shifted logits again
        weights = shifted.exp_()
    else:
        weights = torch.exp(shifted, out=scratch.like("weights", logits))  # (n, c)
    stats.total += weights.sum(dim=1)
    if stats.square_total is not None:
        stats.square_total += torch.einsum("nc,nc->n", weights, weights)
    if stats.weighted is not None:
        if has_neg_inf:  # a -inf logit has weight 0 and adds 0 * log 0 = 0, not 0 * -inf = NaN
            shifted.masked_fill_(torch.isneginf(shifted), 0.0)
        stats.weighted += shifted.mul_(weights).sum(dim=1)
    return shift


def _update_max_before_target(stats: OnlineSoftmax, logits: torch.Tensor, block_max: torch.Tensor, start: int,
                              targets: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> None:
    """Fold a block (n, c) into the running max of the logits left of each row's target: the whole block for a
    target right of it, the columns before the target for the ``rows`` whose target lies in it (at ``columns``)."""
    before = stats.max_before_target
    stats.max_before_target = torch.where(targets >= start + logits.shape[1], torch.maximum(before, block_max), before)
    if rows.numel():
        left = torch.arange(logits.shape[1], device=logits.device) < columns.unsqueeze(1)  # (r, c)
        left_max = logits[rows].masked_fill_(~left, float("-inf")).amax(dim=1)  # (r,)
        stats.max_before_target[rows] = torch.maximum(stats.max_before_target[rows], left_max)


class StatGrads(NamedTuple):
    """Per-token coefficients of the gradient's closed form, already multiplied by d logits / d raw; None = 0."""

    onehot: torch.Tensor | None  # g_lp
    probs: torch.Tensor | None  # g_lp + g_m
    centered: torch.Tensor | None  # g_H
    uniform: torch.Tensor | None  # g_m / V


def stat_grads(head: LinearHead, grad_log_probs, grad_entropy, grad_mean_log_prob, dtype,
               vocab_size: int | None = None) -> StatGrads:
    """The closed form's coefficients from the gradients sent to log p, the entropy and the mean log p over the
    ``vocab_size`` entries of the whole vocabulary (default: the head's, which a vocabulary shard is a part of)."""
    factor = head.logit_factor

    def scaled(grad, by=1.0):
        return None if grad is None else grad.to(dtype) * (factor * by)

    probs_terms = [g for g in (grad_log_probs, grad_mean_log_prob) if g is not None]
    probs = sum(probs_terms[1:], probs_terms[0]) if probs_terms else None
    return StatGrads(scaled(grad_log_probs), scaled(probs), scaled(grad_entropy),
                     scaled(grad_mean_log_prob, 1.0 / (vocab_size or head.vocab_size)))


def block_logits_grad(head: LinearHead, logits: torch.Tensor, start: int, targets: torch.Tensor, lse: torch.Tensor,
                      expected_logit: torch.Tensor | None, coefs: StatGrads, has_neg_inf: bool,
                      scratch: Scratch | None = None) -> torch.Tensor:
    """d loss / d (hidden @ W.T + b) for one block of logits (n, c), which is consumed; see the module docstring.

    ``expected_logit`` is E_p[z] per token (lse - entropy), needed only with an entropy gradient. ``scratch``
    holds the block's temporaries (fresh tensors without it).
    """
    scratch = scratch or Scratch()
    slope_logits = scratch.like("slope", logits).copy_(logits) if head.softcap is not None else None
    centered = None
    if coefs.centered is not None:
        # (n, c): z - E_p[z]
        centered = torch.sub(logits, expected_logit.unsqueeze(1), out=scratch.like("centered", logits))
        if has_neg_inf:  # where z = -inf, p = 0 and the term is 0 (not 0 * -inf = NaN)
            centered.masked_fill_(torch.isneginf(centered), 0.0)
    grad = logits.sub_(lse.unsqueeze(1)).exp_()  # (n, c): p
    if centered is not None:
        coef = centered.mul_(coefs.centered.unsqueeze(1))
        if coefs.probs is not None:
            coef.add_(coefs.probs.unsqueeze(1))
        grad.mul_(coef).neg_()
    elif coefs.probs is not None:
        grad.mul_(coefs.probs.neg().unsqueeze(1))
    else:
        grad.zero_()
    return head.softcap_slope_(_add_target_terms_(grad, start, targets, coefs), slope_logits)


def block_grad_from_weights(weights: torch.Tensor, shift: torch.Tensor, start: int, targets: torch.Tensor,
                            lse: torch.Tensor, coefs: StatGrads) -> torch.Tensor:
    """`block_logits_grad` from a block kept as ``exp(z - m)`` (see `update_stats`), without the exponentials
    again: ``p = exp(z - m) * exp(m - lse)``, a per-row rescale. For a loss that does not differentiate
    the entropy, of a head without a soft cap. ``weights`` is consumed.
    """
    if coefs.centered is not None:
        raise ValueError("coefs: an entropy gradient needs the logits, not their exponentials")
    if coefs.probs is None:
        grad = weights.zero_()
    else:
        grad = weights.mul_((coefs.probs * (shift - lse).exp()).neg_().unsqueeze(1))  # (n, c)
    return _add_target_terms_(grad, start, targets, coefs)


def _add_target_terms_(grad: torch.Tensor, start: int, targets: torch.Tensor, coefs: StatGrads) -> torch.Tensor:
    """In place: the closed form's terms that need no probabilities, ``g_m / V`` everywhere and ``g_lp`` at each
    row's target (where it lies in the block starting at ``start``), added to a block's gradient (n, c)."""
    if coefs.uniform is not None:
        grad.add_(coefs.uniform.unsqueeze(1))
    if coefs.onehot is not None:
        rows, columns = targets_in_block(targets, start, grad.shape[1])
        grad[rows, columns] += coefs.onehot[rows]
    return grad


# the block math above, as an implementation hands it to the accumulator (the Triton kernels have the same names)
PYTORCH_BLOCKS = SimpleNamespace(update_stats=update_stats, block_logits_grad=block_logits_grad)


class KeptWeights(NamedTuple):
    weights: torch.Tensor  # (n, c): exp(z - shift)
    shift: torch.Tensor  # (n,)


class SoftmaxSweep:
    """An `base.Sweep` of one row chunk: statistics `TokenStats`, per-row gradients `StatGrads`."""

    def __init__(self, head: LinearHead, targets: torch.Tensor, kernels: ModuleType, dtype: torch.dtype,
                 has_neg_inf: bool, need_entropy: bool, need_mean_log_prob: bool, extras: tuple[str, ...],
                 keep: str | None, scratch: Scratch, vocab_size: int):
        self.head, self.targets, self.kernels, self.has_neg_inf, self.keep = head, targets, kernels, has_neg_inf, keep
        self.scratch, self.vocab_size = scratch, vocab_size
        self.online = OnlineSoftmax(targets.shape[0], dtype, targets.device, need_entropy,
                                    need_logit_sum=need_mean_log_prob or "mean_logits" in extras,
                                    need_square_total="log_sum_sq_probs" in extras, need_top1="is_top1" in extras)

    def update(self, start: int, logits: list[torch.Tensor]):
        (block,) = logits  # (n, c)
        if self.keep is None:
            self.kernels.update_stats(self.online, block, start, self.targets, self.has_neg_inf, scratch=self.scratch)
            return None
        shift = update_stats(self.online, block, start, self.targets, self.has_neg_inf, keep=self.keep,
                                    scratch=self.scratch)
        return KeptWeights(block, shift) if self.keep == "weights" else logits

    def merge(self, other: SoftmaxSweep) -> None:
        self.online.merge(other.online)

    def across(self, shard) -> None:
        self.online = merged_across(self.online, shard)

    def finish(self) -> TokenStats:
        return self.online.result(self.vocab_size)

    def block_grad(self, start: int, block, stats: TokenStats, coefs: StatGrads) -> torch.Tensor:
        if isinstance(block, KeptWeights):
            return block_grad_from_weights(block.weights, block.shift, start, self.targets, stats.lse, coefs)
        (logits,) = block
        expected_logit = None if coefs.centered is None else stats.lse - stats.entropy  # (n,): E_p[z]
        return self.kernels.block_logits_grad(self.head, logits, start, self.targets, stats.lse, expected_logit,
                                              coefs, self.has_neg_inf, scratch=self.scratch)


@dataclass(eq=False)
class SoftmaxAccumulator:
    """The `base.Accumulator` of the softmax statistics of ``head``'s logits for the tokens' ``targets`` (N,), with
    statistics of ``dtype`` and the block math of ``kernels`` (`PYTORCH_BLOCKS` or `triton`): outputs (log_probs,
    entropy, mean_log_prob, then the ``extras`` of `TOKEN_EXTRAS`), the entropy and mean log p as zeros without
    gradient unless asked for, the extras always without. Its row chunks, which the engine runs one after
    another, share one `Scratch` for their blocks' temporaries."""

    head: LinearHead
    targets: torch.Tensor
    kernels: ModuleType
    dtype: torch.dtype
    need_entropy: bool = False
    need_mean_log_prob: bool = False
    extras: tuple[str, ...] = ()
    keep: str | None = None  # the one-pass schedule: what a swept block is kept as (see the module docstring)
    name = "the fused log-probs"

    def __post_init__(self):
        self.vocab_size = self.head.whole_vocab_size  # of which a sharded head holds a part
        self.heads = (self.head,)
        self.differentiable = (True, self.need_entropy, self.need_mean_log_prob, *(False for _ in self.extras))
        self.has_neg_inf, self.scratch = self.head.may_have_neg_inf_logits, Scratch()

    def sweep(self, rows: slice) -> SoftmaxSweep:
        return SoftmaxSweep(self.head, self.targets[rows], self.kernels, self.dtype, self.has_neg_inf,
                            self.need_entropy, self.need_mean_log_prob, self.extras, self.keep, self.scratch,
                            self.vocab_size)

    def second_sweep(self, rows: slice, first: TokenStats) -> None:
        return None

    def every_rank(self, gather) -> SoftmaxAccumulator:
        return dataclasses.replace(self, targets=gather(self.targets))

    def outputs(self, stats: TokenStats) -> tuple[torch.Tensor, ...]:
        """(log_probs, entropy, mean_log_prob, *extras); the entropy is also kept for the mean logit, but returned
        only when asked for."""
        entropy, mean_log_prob = (value if asked else torch.zeros_like(stats.lse) for value, asked in
                                  ((stats.entropy, self.need_entropy), (stats.mean_log_prob, self.need_mean_log_prob)))
        return stats.log_probs, entropy, mean_log_prob, *(getattr(stats, name) for name in self.extras)

    def row_grads(self, grad_outputs: tuple, stats: TokenStats) -> StatGrads:
        grad_log_probs, grad_entropy, grad_mean_log_prob = grad_outputs[:3]
        return stat_grads(self.head, grad_log_probs, grad_entropy if self.need_entropy else None,
                          grad_mean_log_prob if self.need_mean_log_prob else None, stats.lse.dtype, self.vocab_size)
