"""The one-pass schedule as an implementation (`api.py`'s chain for "chunked" and "auto", before the two passes): a
loss that is a sum of per-token terms known at forward time (cross-entropy, TRL's GRPO objective), its gradients
computed during forward by `engine.one_pass` with the PyTorch block math, where `plan.plan_blocks` says that pays (a
CPU, an fp32 weight, every gradient the loss's: none for the loss's other inputs); backward only scales them. It has no
other step, and for a loss where the one pass does not pay it raises `base.CannotRunHere`: the two passes run them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from logitless.op_settings import BlockSizes
from logitless.ops.base import BlockPlan, CannotRunHere
from logitless.ops.engine import ChunkLoss, one_pass, refuse_second_derivative
from logitless.ops.head import LinearHead, stat_dtype
from logitless.ops.plan import plan_blocks
from logitless.ops.softmax import PYTORCH_BLOCKS, SoftmaxAccumulator, TokenStats, stat_grads
from logitless.ops.workers import block_workers

# token_loss(rows, log_probs, entropy, mean_log_prob) -> the loss summed over the chunk's tokens
# (``rows``: the chunk's slice of all tokens; statistics not asked for are None)
TokenLoss = Callable[[slice, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


class LinearLoss(torch.autograd.Function):
    """A loss summed over per-token terms (``token_loss``), and the statistics it was computed from.

    Returns (loss (), log_probs (N,), entropy (N,) or zeros); the statistics carry no gradient. The
    gradients of hidden/weight/bias are computed in forward (`engine.one_pass`) and kept on ctx, not
    in save_for_backward: backward hands them over and drops its reference, so the weight's gradient
    (the step's largest tensor at a 151k vocabulary) never exists twice. A second backward
    (retain_graph, gradcheck) recomputes them from the inputs.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head: LinearHead, plan: BlockPlan, token_loss: TokenLoss,
                need_entropy: bool, need_mean_log_prob: bool, needs: tuple[bool, bool, bool]):
        ctx.recompute = (head, plan, token_loss, needs, need_entropy, need_mean_log_prob)
        loss, stats, input_grads = _one_pass_loss(hidden, targets, *ctx.recompute)
        ctx.input_grads = input_grads
        ctx.save_for_backward(hidden, weight, bias, targets)
        entropy = torch.zeros_like(stats.lse) if stats.entropy is None else stats.entropy
        ctx.mark_non_differentiable(stats.log_probs, entropy)
        return loss, stats.log_probs, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_log_probs, _grad_entropy):
        refuse_second_derivative("the fused loss")
        input_grads, ctx.input_grads = ctx.input_grads, None
        if input_grads is None:
            hidden, _, _, targets = ctx.saved_tensors
            input_grads = _one_pass_loss(hidden, targets, *ctx.recompute)[2]
        if not bool(grad_loss == 1):
            input_grads = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in input_grads]
        return (*input_grads, None, None, None, None, None, None, None)


def _one_pass_loss(hidden, targets, head: LinearHead, plan: BlockPlan, token_loss: TokenLoss,
                   needs: tuple[bool, bool, bool], need_entropy: bool, need_mean_log_prob: bool):
    """(loss, TokenStats (N,), input grads) by the one-pass driver with the PyTorch block math."""
    dtype = stat_dtype(hidden.dtype)
    accumulator = SoftmaxAccumulator(head, targets, PYTORCH_BLOCKS, dtype, need_entropy=need_entropy,
                                     need_mean_log_prob=need_mean_log_prob,
                                     keep="logits" if head.softcap is not None else "weights")
    workers = block_workers(hidden.device, -(-head.vocab_size // plan.sizes.vocab))
    return one_pass(head, hidden, plan, accumulator.sweep, _chunk_loss(head, token_loss, needs, dtype), needs, workers)


def _chunk_loss(head: LinearHead, token_loss: TokenLoss, needs: tuple[bool, bool, bool], dtype) -> ChunkLoss:
    """A chunk's share of the loss and its `StatGrads`, the gradient with respect to log p and mean log p taken
    by autograd on (n,) vectors (the entropy is handed over without a graph: a loss that differentiates it
    takes the two passes)."""

    def chunk_loss(rows: slice, stats: TokenStats):
        with torch.enable_grad():
            leaves = [None if s is None else s.detach().requires_grad_()
                      for s in (stats.log_probs, stats.mean_log_prob)]
            loss = token_loss(rows, leaves[0], stats.entropy, leaves[1])
            used = [leaf for leaf in leaves if leaf is not None]
            leaf_grads = (torch.autograd.grad(loss, used, allow_unused=True)
                          if any(needs) and loss.requires_grad else [None] * len(used))
        if not any(needs):
            return loss.detach(), None
        leaf_grad = iter(leaf_grads)
        grad_log_probs, grad_mean = (None if leaf is None else next(leaf_grad) for leaf in leaves)
        return loss.detach(), stat_grads(head, grad_log_probs, None, grad_mean, dtype)

    return chunk_loss


class OnePass:
    """The one pass of a loss known at forward time (of `api.py`'s steps, ``loss`` only: statistics whose loss is
    not known yet, the KL and the JSD are the two passes')."""

    name = "chunked"
    triton = False
    whole_vocabulary = False

    def unusable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    def loss(self, head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, token_loss: TokenLoss, *,
             need_entropy: bool = False, need_mean_log_prob: bool = False, sizes: BlockSizes = BlockSizes(),
             loss_inputs: tuple = ()):
        """(loss, log_probs (N,), entropy (N,) or None) by `LinearLoss`; `CannotRunHere` where the plan takes two
        passes, or where one of ``loss_inputs`` (the other tensors ``token_loss`` reads: advantages, old log-probs)
        needs a gradient, which the one pass does not compute."""
        needs = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad
                      for t in (hidden, head.weight, head.bias))
        inputs_need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in loss_inputs)
        plan = plan_blocks(hidden.shape[0], head, hidden.device, sizes, loss_known=any(needs) and not inputs_need_grad)
        if not plan.single_pass:
            raise CannotRunHere("the plan takes two passes")
        loss, log_probs, entropy = LinearLoss.apply(hidden, head.weight, head.bias, targets, head, plan, token_loss,
                                                    need_entropy, need_mean_log_prob, needs)
        return loss, log_probs, entropy if need_entropy else None
