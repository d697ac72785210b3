"""What a relaxed rollout is made of, and how any model embeds it.

A completion of T tokens is a `SoftTokens`: per position a weighted set of token ids, either sparse
(indices and weights (B, T, k)) or dense over the vocabulary (weights (B, T, V)). A hard completion is
the sparse case with k = 1 and weight 1. Every model that shares the policy's vocabulary (policy,
reference, reward model, judge) turns it into ``inputs_embeds`` with its own embedding matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitless.data import left_padded, pad_token_id
from logitless.ops.gumbel import sparse_soft_embedding


@dataclass
class SoftTokens:
    weights: torch.Tensor  # (B, T, k) sparse, or (B, T, V) dense
    indices: torch.Tensor | None = None  # (B, T, k) token ids; None when dense

    @classmethod
    def hard(cls, token_ids: torch.Tensor) -> SoftTokens:
        """(B, T) token ids as one-hot soft tokens (k = 1)."""
        indices = token_ids.unsqueeze(-1)
        return cls(torch.ones(indices.shape, dtype=torch.float32, device=token_ids.device), indices)

    def detach(self) -> SoftTokens:
        return SoftTokens(self.weights.detach(), self.indices)

    def mass_on(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(B, T): the weight each position puts on any of ``token_ids`` (1-D)."""
        if self.indices is None:
            return self.weights[..., token_ids].sum(dim=-1)
        return (self.weights * torch.isin(self.indices, token_ids)).sum(dim=-1)


@dataclass
class TokenEmbedding:
    """A model's input embedding: rows of ``weight`` times ``scale`` (Gemma scales by sqrt(H) inside its module)."""

    weight: torch.Tensor  # (V, H)
    scale: float | torch.Tensor = 1.0

    @classmethod
    def of(cls, model, name: str) -> TokenEmbedding:
        module = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
        if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise TypeError(f"{name}: {type(model).__name__} has no input embeddings (get_input_embeddings()); "
                            "soft tokens enter a model as inputs_embeds")
        return cls(module.weight, getattr(module, "embed_scale", 1.0))

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def of_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(B, P) -> (B, P, H)."""
        return self.weight[token_ids] * self._scale()

    def of_soft(self, tokens: SoftTokens) -> torch.Tensor:
        """(B, T, k or V) -> (B, T, H): the weighted sum of the rows (sparse: k rows, no (B, T, V) tensor)."""
        if tokens.indices is None:
            mixed = tokens.weights.to(self.weight.dtype) @ self.weight
        else:
            mixed = sparse_soft_embedding(self.weight, tokens.indices, tokens.weights)
        return mixed * self._scale()

    def _scale(self):
        return self.scale.to(self.weight.dtype) if isinstance(self.scale, torch.Tensor) else self.scale


@dataclass
class PromptBatch:
    """Left-padded prompts: the completion starts at the same column in every row."""

    input_ids: torch.Tensor  # (B, P)
    attention_mask: torch.Tensor  # (B, P), 0 on the left padding
    records: list[dict]  # the prompts' records ({"prompt": text, ...any fields a reward reads})

    @classmethod
    def from_records(cls, records: list[dict], tokenizer, device=None) -> PromptBatch:
        encoded = tokenizer([r["prompt"] for r in records], add_special_tokens=True)["input_ids"]
        if any(len(ids) == 0 for ids in encoded):
            raise ValueError("prompts: a prompt tokenizes to no tokens; the first generated token needs one to follow")
        input_ids, attention_mask = left_padded(encoded, pad_token_id(tokenizer))
        return cls(input_ids.to(device), attention_mask.to(device), list(records))


def as_records(prompts) -> list[dict]:
    """Prompts as records: a string becomes {"prompt": string}; a dict must have a "prompt" string."""
    if isinstance(prompts, (str, dict)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise TypeError(f"prompts: expected a non-empty list of strings or of dicts with a 'prompt', got "
                        f"{type(prompts).__name__}")
    records = []
    for i, prompt in enumerate(prompts):
        record = {"prompt": prompt} if isinstance(prompt, str) else prompt
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise TypeError(f"prompts[{i}]: expected a string or a dict with a 'prompt' string, got {prompt!r:.80}")
        records.append(record)
    return records
