"""CompletionLogits: one completion's logits rows, computed from hidden states when indexed.

Seed 000 handed reward functions a ``[completion_len, V]`` logits tensor per completion (hundreds of
MB each at a 151k vocabulary). This view keeps only the completion's hidden states ``(C, H)`` and a
reference to the LM head; ``view[t]`` computes row t, ``view[a:b]`` rows a..b-1, on demand.
"""

from __future__ import annotations

import torch

from logitless._checks import check_positive, check_tensor
from logitless.ops.chunks import chunk_logits


class CompletionLogits:
    """Lazy ``(C, V)`` logits of one completion: ``cap(hidden @ weight.T + bias) / temperature``, fp32.

    ``cap(x) = softcap * tanh(x / softcap)``, or the identity when ``softcap`` is None.

    Row t is the distribution completion token t was sampled from. Nothing of size V is stored.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 temperature: float = 1.0, softcap: float | None = None):
        check_tensor("hidden", hidden, ndim=2, floating=True)
        check_tensor("weight", weight, ndim=2, floating=True)
        if hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"hidden: size {hidden.shape[1]} does not match weight's hidden size {weight.shape[1]}")
        self.hidden = hidden.detach()  # (C, H)
        self.weight = weight.detach()  # (V, H), shared, not copied
        self.bias = None if bias is None else bias.detach()
        self.temperature = check_positive("temperature", temperature)
        self.softcap = None if softcap is None else check_positive("softcap", softcap)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.hidden.shape[0], self.weight.shape[0]))

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, index) -> torch.Tensor:
        """An int gives one row (V,); a slice or a 1-D index tensor/list gives (k, V). fp32, no grad."""
        if isinstance(index, int):
            if not -len(self) <= index < len(self):
                raise IndexError(f"index {index} is out of range for a completion of {len(self)} tokens")
        elif not isinstance(index, (slice, list, torch.Tensor)):
            raise TypeError(f"index: expected an int, slice, list or tensor, got {type(index).__name__}")
        with torch.no_grad():
            rows = self.hidden[index]  # (H,) or (k, H)
            logits = chunk_logits(rows.reshape(-1, rows.shape[-1]), self.weight, self.bias, self.temperature,
                                  self.softcap)  # the loss's own definition of a row's logits
            return logits.float().reshape(*rows.shape[:-1], -1)

    def __repr__(self) -> str:
        return f"CompletionLogits(shape={tuple(self.shape)}, temperature={self.temperature})"
