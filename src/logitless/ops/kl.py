"""Exact per-token KL(p || q) between two LM heads' distributions, without (N, V) logits.

p is the distribution being trained (a policy, a student), from ``hidden_p`` and its head; q a fixed
target (a reference, a teacher) from ``hidden_q`` and its own head, which may have another hidden
size. Over the full vocabulary,

    KL = sum_v p_v (log p_v - log q_v),
    d KL / d z_p = p * (log p - log q - KL)          (z the logits; no gradient on the q side)

Two passes over vocabulary blocks, as `loops.py` schedules them: pass 1 runs an online softmax for
each head and the p-weighted sum of z_p - z_q, keeping three numbers per token (lse_p, lse_q, KL);
pass 2 (backward) recomputes both heads' blocks and turns them into p's logits gradient.

-inf logits are exact: a vocabulary entry with p = 0 adds 0 whatever q is (0 * log 0 = 0); one with
p > 0 and q = 0 makes the KL +inf (and its gradient NaN, as the materialized formula's), which is the
true value: q cannot explain what p does.
"""

from __future__ import annotations

import torch

from logitless._checks import check_mask, check_tensor
from logitless.ops.chunks import OnlineSoftmax
from logitless.ops.head import LinearHead, stat_dtype
from logitless.ops.loops import (BlockPlan, InputGrads, column_blocks, compute_operand, plan_blocks, row_chunks)


class _OnlineKL:
    """Pass 1's running sums for one row chunk: an online softmax per head (shifts m_p, m_q; totals s_p, s_q)
    and ``g = sum exp(z_p - m_p) ((z_p - m_p) - (z_q - m_q))``, so that KL = g / s_p - log s_p + log s_q
    comes from numbers of its own size (no cancellation between large log-sum-exps)."""

    def __init__(self, num_rows: int, dtype: torch.dtype, device: torch.device):
        self.p = OnlineSoftmax(num_rows, dtype, device, need_entropy=False, need_logit_sum=False)
        self.q = OnlineSoftmax(num_rows, dtype, device, need_entropy=False, need_logit_sum=False)
        self.gap = torch.zeros(num_rows, dtype=dtype, device=device)

    def update(self, logits_p: torch.Tensor, logits_q: torch.Tensor, has_neg_inf: bool) -> None:
        """Fold in one block of both heads' logits (n, c); both are consumed."""
        old_shift_p, old_shift_q, old_total_p = self.p.shift, self.q.shift, self.p.total
        shift_q, _ = self.q.rescale(logits_q.amax(dim=1))
        shift_p, factor = self.p.rescale(logits_p.amax(dim=1))
        # the gap measured from the new shifts: each term moves by (m_p - m_p') - (m_q - m_q')
        self.gap = factor * (self.gap + ((old_shift_p - shift_p) - (old_shift_q - shift_q)) * old_total_p)
        shifted_q = logits_q.sub_(shift_q.unsqueeze(1))  # (n, c)
        self.q.total += shifted_q.exp().sum(dim=1)
        shifted_p = logits_p.sub_(shift_p.unsqueeze(1))
        weights = shifted_p.exp()  # (n, c): exp(z_p - m_p)
        self.p.total += weights.sum(dim=1)
        gap = shifted_p.sub_(shifted_q)
        if has_neg_inf:  # where p = 0 the term is 0, whatever q is
            gap.masked_fill_(weights == 0, 0.0)
        self.gap += weights.mul_(gap).sum(dim=1)

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lse_p, lse_q, KL), each (n,)."""
        log_total_p, log_total_q = self.p.total.log(), self.q.total.log()
        kl = self.gap / self.p.total - log_total_p + log_total_q
        return self.p.shift + log_total_p, self.q.shift + log_total_q, kl


def _block_kl_grad(head_p: LinearHead, logits_p: torch.Tensor, logits_q: torch.Tensor, lse_p, lse_q, kl,
                   grad_kl) -> torch.Tensor:
    """d loss / d (hidden_p @ W_p.T + b_p) for one block (n, c): g * p * (log p - log q - KL); both consumed."""
    slope_logits = logits_p.clone() if head_p.softcap is not None else None
    log_p = logits_p.sub_(lse_p.unsqueeze(1))  # (n, c)
    probs = log_p.exp()
    coef = log_p.sub_(logits_q.sub_(lse_q.unsqueeze(1))).sub_(kl.unsqueeze(1))
    coef.masked_fill_(probs == 0, 0.0)  # 0 * log 0 = 0, also where q = 0 too
    grad = probs.mul_(coef).mul_((grad_kl * head_p.logit_factor).unsqueeze(1))
    return head_p.softcap_slope_(grad, slope_logits)


class LinearKL(torch.autograd.Function):
    """(N, H_p), (N, H_q) and two heads -> KL(p || q) (N,); gradients for the p side only."""

    @staticmethod
    def forward(ctx, hidden_p, weight_p, bias_p, hidden_q, head_p: LinearHead, head_q: LinearHead, plan: BlockPlan):
        dtype = stat_dtype(hidden_p.dtype)
        has_neg_inf = head_p.may_have_neg_inf_logits or head_q.may_have_neg_inf_logits
        parts = []
        for rows in row_chunks(hidden_p.shape[0], plan):
            chunk_p, chunk_q = compute_operand(hidden_p[rows]), compute_operand(hidden_q[rows])
            online = _OnlineKL(chunk_p.shape[0], dtype, hidden_p.device)
            for _, columns in column_blocks(head_p.vocab_size, plan):
                online.update(head_p.logits(chunk_p, columns), head_q.logits(chunk_q, columns), has_neg_inf)
            parts.append(online.result())
        lse_p, lse_q, kl = ((torch.cat(part) for part in zip(*parts)) if parts else
                            (torch.empty(0, dtype=dtype, device=hidden_p.device) for _ in range(3)))
        ctx.save_for_backward(hidden_p, weight_p, bias_p, hidden_q, lse_p, lse_q, kl)
        ctx.heads, ctx.plan = (head_p, head_q), plan
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        hidden_p, _, _, hidden_q, lse_p, lse_q, kl = ctx.saved_tensors
        (head_p, head_q), plan = ctx.heads, ctx.plan
        num_rows = hidden_p.shape[0]
        grads = InputGrads(head_p, hidden_p, ctx.needs_input_grad[:3], num_chunks=-(-num_rows // plan.rows))
        grad_kl = grad_kl.to(lse_p.dtype)
        for rows in row_chunks(num_rows, plan):
            chunk_p, chunk_q = compute_operand(hidden_p[rows]), compute_operand(hidden_q[rows])
            hidden_sum = grads.hidden_sum(chunk_p)
            for _, columns in column_blocks(head_p.vocab_size, plan):
                block_grad = _block_kl_grad(head_p, head_p.logits(chunk_p, columns), head_q.logits(chunk_q, columns),
                                            lse_p[rows], lse_q[rows], kl[rows], grad_kl[rows])
                grads.add_block(columns, block_grad, chunk_p, hidden_sum, head_p.weight[columns])
            grads.finish_chunk(rows, hidden_sum)
        return (*grads.result(head_p), None, None, None, None)


def heads_kl(hidden_p: torch.Tensor, head_p: LinearHead, hidden_q: torch.Tensor, head_q: LinearHead, *,
             chunk_size: int | None = None, vocab_block_size: int | None = None) -> torch.Tensor:
    """KL(p || q) per token of flat hidden_p (N, H_p) and hidden_q (N, H_q) under two `LinearHead`s (each with its
    own bias, logit scale, soft cap and temperature: e.g. `logitless.hf.lm_head_of` of two models)."""
    if head_q.vocab_size != head_p.vocab_size:
        raise ValueError(f"weight_q: vocabulary of {head_q.vocab_size} rows, weight_p has {head_p.vocab_size}")
    fixed_q = LinearHead(head_q.weight.detach(), None if head_q.bias is None else head_q.bias.detach(),
                         head_q.temperature, head_q.softcap, head_q.scale)
    plan = plan_blocks(hidden_p.shape[0], head_p, hidden_p.device, chunk_size, vocab_block_size)
    return LinearKL.apply(hidden_p, head_p.weight, head_p.bias, hidden_q.detach(), head_p, fixed_q, plan)


def _check_side(side: str, hidden, weight, bias) -> None:
    check_tensor(f"hidden_{side}", hidden, floating=True)
    check_tensor(f"weight_{side}", weight, ndim=2, floating=True)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight_{side}: hidden size {weight.shape[1]} does not match hidden_{side}'s last dim "
                         f"(shape {tuple(hidden.shape)})")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight_{side}: dtype {weight.dtype} differs from hidden_{side}'s {hidden.dtype}")
    if bias is not None:
        check_tensor(f"bias_{side}", bias, ndim=1, floating=True)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias_{side}: length {bias.shape[0]} does not match weight_{side}'s "
                             f"{weight.shape[0]} rows")


def fused_linear_kl(hidden_p: torch.Tensor, weight_p: torch.Tensor, hidden_q: torch.Tensor, weight_q: torch.Tensor, *,
                    bias_p: torch.Tensor | None = None, bias_q: torch.Tensor | None = None, temperature: float = 1.0,
                    mask: torch.Tensor | None = None, chunk_size: int | None = None,
                    vocab_block_size: int | None = None) -> torch.Tensor:
    """Per-token KL(p || q) of two LM heads over the full vocabulary, without (N, V) logits.

    hidden_p (..., H_p) with weight_p (V, H_p); hidden_q (..., H_q) with weight_q (V, H_q): the same
    leading dims and vocabulary, hidden sizes may differ (a teacher and a student). Both logits are
    divided by ``temperature``. Returns the KL with hidden's leading dims, fp32 (fp64 for fp64 input);
    tokens where ``mask`` is 0 are skipped and get 0. Differentiable with respect to hidden_p, weight_p
    and bias_p; the q side is a fixed target and gets no gradient. ``chunk_size`` (tokens per row
    chunk) and ``vocab_block_size`` (vocabulary entries per block) override the per-device defaults.
    For heads with a logit scale or soft cap, use `heads_kl`.
    """
    _check_side("p", hidden_p, weight_p, bias_p)
    _check_side("q", hidden_q, weight_q, bias_q)
    if hidden_q.shape[:-1] != hidden_p.shape[:-1]:
        raise ValueError(f"hidden_q: leading dims {tuple(hidden_q.shape[:-1])} do not match hidden_p's "
                         f"{tuple(hidden_p.shape[:-1])}")
    head_p = LinearHead(weight_p, bias_p, temperature)
    head_q = LinearHead(weight_q, bias_q, temperature)
    leading = hidden_p.shape[:-1]
    flat_p, flat_q = hidden_p.reshape(-1, hidden_p.shape[-1]), hidden_q.reshape(-1, hidden_q.shape[-1])
    kept = None
    if mask is not None:
        kept = check_mask("mask", mask, "hidden_p's leading dims", hidden_p[..., 0]).reshape(-1).nonzero().squeeze(1)
        flat_p, flat_q = flat_p.index_select(0, kept), flat_q.index_select(0, kept)
    kl = heads_kl(flat_p, head_p, flat_q, head_q, chunk_size=chunk_size, vocab_block_size=vocab_block_size)
    if kept is not None:
        kl = torch.zeros(leading.numel(), dtype=kl.dtype, device=kl.device).index_copy(0, kept, kl)
    return kl.reshape(leading)
