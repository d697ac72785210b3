"""LinearHead: the one definition of an LM head's logits, shared by every op.

    logits = cap(logit_scale * (hidden @ weight.T + bias)) / temperature        (fp32)

``cap(x) = softcap * tanh(x / softcap)`` is the soft cap of Gemma 2/3n, nanochat and Mistral Large 4
(the identity without a softcap); ``logit_scale`` is a model's logit multiplier (Cohere's ``logit_scale``,
Granite's ``1 / logits_scaling``); ``temperature`` divides the logits exactly as in sampling, in the
policy, old, reference and reward paths alike. The block engine, `CompletionLogits`, GRADE's
rollouts and the multiple-choice judge all compute logits through `LinearHead.logits` (the materialized
oracles, `ops/reference.py`, write the formula out for themselves); the engine's accumulators send
gradients back through `logit_factor` and `softcap_slope_`. Every public op takes a head whole
(``head=LinearHead(...)``) or in parts (``weight, bias=, temperature=, softcap=, logit_scale=``); `op_head`
turns either into the one the op reads.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from logitless._checks import HeadNumbers, check_tensor
from logitless.ops.vocab_shard import VocabShard


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits, statistics and gradient sums are fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def matmul_stat(left: torch.Tensor, right: torch.Tensor, *, add_to: torch.Tensor | None = None) -> torch.Tensor:
    """``left @ right`` accumulated and returned in `stat_dtype`; with ``add_to``, added into it in place.

    Low-precision (bf16/fp16) operands keep their tensor-core matmul on CUDA (``out_dtype``: fp32
    accumulation and an fp32 result, no rounding to bf16), with an fp32 operand cast down to its
    partner's dtype; elsewhere both are upcast, since CPU matmuls have no fp32 output for them.
    """
    low = next((t.dtype for t in (left, right) if t.dtype in (torch.bfloat16, torch.float16)), None)
    if low is None:
        if add_to is not None:
            return add_to.addmm_(left, right)
        product = left @ right
    elif left.is_cuda:
        product = torch.mm(left.to(low), right.to(low), out_dtype=torch.float32)
    else:
        product = left.float() @ right.float()
    # (inside an autocast region the product may still come out in low precision, as the model's own head does)
    product = product.to(stat_dtype(left.dtype))
    return product if add_to is None else add_to.add_(product)


@dataclass(frozen=True, eq=False)
class LinearHead(HeadNumbers):
    """An LM head: ``weight`` (V, H), optional ``bias`` (V,), and how its output becomes logits (the fields after
    ``weight`` are keyword-only: ``bias``, `HeadNumbers`' ``temperature``, ``softcap`` and ``logit_scale``, and
    ``shard``)."""

    weight: torch.Tensor
    _: KW_ONLY
    bias: torch.Tensor | None = None
    shard: VocabShard | None = None  # the weight is this rank's rows of a vocabulary sharded over ranks

    def __post_init__(self):
        check_tensor("weight", self.weight, ndim=2, floating=True)
        if self.bias is not None:
            check_tensor("bias", self.bias, ndim=1, floating=True)
            if self.bias.shape[0] != self.weight.shape[0]:
                raise ValueError(f"bias: length {self.bias.shape[0]} does not match the vocabulary size "
                                 f"{self.weight.shape[0]}")
            if bool(torch.isnan(self.bias).any() | torch.isposinf(self.bias).any()):
                raise ValueError("bias: contains NaN or +inf (only -inf, for vocabulary rows that can never be "
                                 "sampled, is allowed)")
        super().__post_init__()

    @property
    def vocab_size(self) -> int:
        """The vocabulary rows of the weight this head holds (a shard's, where it holds one)."""
        return self.weight.shape[0]

    @property
    def whole_vocab_size(self) -> int:
        """The whole vocabulary, of which a sharded head holds `vocab_size` rows."""
        return self.vocab_size if self.shard is None else self.shard.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @property
    def may_have_neg_inf_logits(self) -> bool:
        """A -inf bias entry without a soft cap (which would bound it) makes a column of -inf logits."""
        return self.bias is not None and self.softcap is None and bool(torch.isneginf(self.bias).any())

    def logits(self, hidden: torch.Tensor, columns: slice | torch.Tensor | None = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, H) -> (n, v) fp32 logits of the vocabulary ``columns`` (all of them by default), into ``out``
        (a contiguous (n, v) stat-dtype buffer) when given.

        ``hidden`` and the weight are multiplied in their own dtype where the device allows an fp32
        result (see `matmul_stat`). A slice of columns reads a view of the weight; an index tensor
        or list gathers those rows.
        """
        weight = self.weight if columns is None else self.weight[columns]  # (v, H)
        # an out= matmul would escape an autocast region, in which the model's own head runs in low precision
        if out is not None and hidden.dtype == weight.dtype == out.dtype \
                and not torch.is_autocast_enabled(hidden.device.type):
            logits = torch.mm(hidden, weight.T, out=out)
        elif out is not None:
            logits = out.copy_(matmul_stat(hidden, weight.T))
        else:
            logits = matmul_stat(hidden, weight.T)  # (n, v)
        if self.bias is not None:
            logits += self.bias if columns is None else self.bias[columns]
        return self.finish_(logits)

    def gathered_logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """(n, H), (n, k) -> (n, k) fp32: the logits of k vocabulary entries per row, a different k for each row
        (only those k rows of the weight are read)."""
        raw = torch.einsum("nh,nkh->nk", hidden, self.weight[indices]).to(stat_dtype(hidden.dtype))
        if self.bias is not None:
            raw = raw + self.bias[indices]
        return self.finish_(raw)

    def finish_(self, raw: torch.Tensor) -> torch.Tensor:
        """``hidden @ weight.T + bias`` (already in stat_dtype) -> logits, in place where autograd allows."""
        if self.logit_scale != 1.0:
            raw.mul_(self.logit_scale)
        if self.softcap is not None:
            if raw.requires_grad:  # GRADE's rollouts differentiate through here; tanh keeps its output for backward
                raw = torch.tanh(raw / self.softcap) * self.softcap
            else:
                raw.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            raw.div_(self.temperature)
        return raw

    @property
    def logit_factor(self) -> float:
        """d logits / d (hidden @ weight.T + bias) without a soft cap: ``logit_scale / temperature``."""
        return self.logit_scale / self.temperature

    def softcap_slope_(self, grad: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """In place: multiply a logits gradient by the soft cap's slope ``1 - tanh^2 = 1 - (logits * T / c)^2``.

        Together with `logit_factor` this carries a gradient from the logits back to
        ``hidden @ weight.T + bias``. ``logits`` is overwritten. Without a soft cap, nothing happens.
        """
        if self.softcap is not None:
            grad.mul_(logits.mul_(self.temperature / self.softcap).square_().neg_().add_(1.0))
        return grad


def op_head(head: LinearHead | None, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
            temperature: float = 1.0, softcap: float | None = None, logit_scale: float = 1.0, *,
            side: str = "") -> LinearHead:
    """The head a public op reads: ``head`` (a `LinearHead`) when given, else one made of its parts. ``side`` is the
    suffix of the op's argument names for an op that reads two heads (``"_p"`` for ``weight_p``, ``head_p``...), and
    errors name the arguments with it. (`logitless._checks.checked_keywords` refuses a head given both ways.)"""
    if head is not None:
        if not isinstance(head, LinearHead):
            raise TypeError(f"head{side}: expected a LinearHead, got {type(head).__name__}")
        return head
    if weight is None:
        raise TypeError(f"weight{side}: required (or the whole head as head{side}=LinearHead(...))")
    try:
        return LinearHead(weight, bias=bias, temperature=temperature, softcap=softcap, logit_scale=logit_scale)
    except (TypeError, ValueError) as err:
        field, _, rest = str(err).partition(": ")
        if side and field in ("weight", "bias"):
            raise type(err)(f"{field}{side}: {rest}") from None
        raise
