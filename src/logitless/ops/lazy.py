"""CompletionLogits: one completion's logits rows, computed from hidden states when indexed.

Handing reward functions a ``[completion_len, V]`` logits tensor per completion costs hundreds of
MB each at a 151k vocabulary. This view keeps only the completion's hidden states ``(C, H)`` and a
reference to the LM head; ``view[t]`` computes row t, ``view[a:b]`` rows a..b-1, on demand.
"""

from __future__ import annotations

import operator

import torch

from logitless._checks import check_tensor
from logitless.ops.head import LinearHead, stat_dtype


class CompletionLogits:
    """Lazy ``(C, V)`` logits of one completion: ``head.logits(hidden)`` (fp32), the loss's own definition
    of a row's logits (bias, logit scale, soft cap and temperature included).

    Row t is the distribution completion token t was sampled from. Nothing of size V is stored: the
    head's weight is shared, not copied.
    """

    def __init__(self, hidden: torch.Tensor, head: LinearHead):
        check_tensor("hidden", hidden, ndim=2, floating=True)
        if not isinstance(head, LinearHead):
            raise TypeError(f"head: expected a LinearHead, got {type(head).__name__}")
        if hidden.shape[1] != head.hidden_size:
            raise ValueError(f"hidden: size {hidden.shape[1]} does not match the head's hidden size {head.hidden_size}")
        self.hidden = hidden.detach()  # (C, H)
        self.head = head

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.hidden.shape[0], self.head.vocab_size))

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, index) -> torch.Tensor:
        """An int gives one row (V,); a slice or a 1-D index tensor/list gives (k, V), k >= 0. fp32 (fp64 for fp64
        hidden states), no grad."""
        if not isinstance(index, (slice, list, torch.Tensor)) and hasattr(index, "__index__"):  # int, numpy int
            index = operator.index(index)
            if not -len(self) <= index < len(self):
                raise IndexError(f"index {index} is out of range for a completion of {len(self)} tokens")
        elif not isinstance(index, (slice, list, torch.Tensor)):
            raise TypeError(f"index: expected an int, slice, list or tensor, got {type(index).__name__}")
        with torch.no_grad():
            rows = self.hidden[index]  # (H,) or (k, H)
            logits = self.head.logits(rows.reshape(-1, rows.shape[-1]))
            return logits.to(stat_dtype(rows.dtype)).reshape(*rows.shape[:-1], self.head.vocab_size)

    def __repr__(self) -> str:
        return f"CompletionLogits(shape={tuple(self.shape)}, temperature={self.head.temperature})"
