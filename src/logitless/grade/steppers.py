"""Running a policy one generated position at a time on ``inputs_embeds``, with the autograd graph kept.

* `PrefixStepper` re-reads the prompt and every token so far at each step (O(T^2) positions): the
  obvious way, used by the legacy trainer and as the oracle of the cache.
* `CachedStepper` keeps a KV cache that stays differentiable: one position per step. The cache is a
  list of per-step key/value pieces; each step rebuilds a transformers `DynamicCache` from them,
  runs the body on the new position, and keeps the new key/value position. With
  ``checkpointing`` the step runs under `torch.utils.checkpoint`, so backward recomputes it instead of
  saving its activations and the concatenated cache (which would make the saved memory O(T^2)).

Both return the final hidden state of the last position, (B, H). Position ids count from each
row's first prompt token (left padding does not shift them).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from logitless.grade.parts import CausalLMParts
from logitless.hf import position_ids_for


class PrefixStepper:
    def __init__(self, parts: CausalLMParts, prompt_embeds: torch.Tensor, prompt_mask: torch.Tensor):
        self.parts = parts
        self.embeds, self.mask = prompt_embeds, prompt_mask  # (B, L, H), (B, L)

    def start(self) -> torch.Tensor:
        return self._last_hidden()

    def step(self, token_embeds: torch.Tensor) -> torch.Tensor:
        """Append (B, H) and re-read everything: (B, H) of the new last position."""
        self.embeds = torch.cat([self.embeds, token_embeds.unsqueeze(1)], dim=1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        return self._last_hidden()

    def _last_hidden(self) -> torch.Tensor:
        out = self.parts.body(inputs_embeds=self.embeds, attention_mask=self.mask,
                              position_ids=position_ids_for(self.mask), use_cache=False)
        return out.last_hidden_state[:, -1]


class CachedStepper:
    def __init__(self, parts: CausalLMParts, prompt_embeds: torch.Tensor, prompt_mask: torch.Tensor,
                 checkpointing: bool = False):
        self.parts, self.checkpointing = parts, checkpointing
        self.prompt_embeds, self.mask = prompt_embeds, prompt_mask
        self.next_position = prompt_mask.long().sum(dim=1, keepdim=True)  # (B, 1)
        self.pieces: list[list[torch.Tensor]] = []  # per layer: [keys, values] pieces along the sequence, 2 each

    def start(self) -> torch.Tensor:
        cache = DynamicCache(config=self.parts.config)
        out = self.parts.run_body(cache, inputs_embeds=self.prompt_embeds, attention_mask=self.mask,
                                  position_ids=position_ids_for(self.mask))
        self.pieces = [[layer.keys, layer.values] for layer in cache.layers]
        return out.last_hidden_state[:, -1]

    def step(self, token_embeds: torch.Tensor) -> torch.Tensor:
        """One new position (B, H) through the cache: (B, H) of it."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        run = _DecodeStep(self.parts, self.mask, self.next_position, [len(p) for p in self.pieces])
        flat = [piece for layer in self.pieces for piece in layer]
        if self.checkpointing and torch.is_grad_enabled():
            hidden, *new = checkpoint(run, token_embeds, *flat, use_reentrant=False)
        else:
            hidden, *new = run(token_embeds, *flat)
        for layer, (keys, values) in enumerate(zip(new[0::2], new[1::2])):
            self.pieces[layer] += [keys, values]
        self.next_position = self.next_position + 1
        return hidden


class _DecodeStep:
    """A pure function of (token embeds, cache pieces) -> (hidden, new key/value per layer): safe to recompute."""

    def __init__(self, parts: CausalLMParts, mask: torch.Tensor, position: torch.Tensor, piece_counts: list[int]):
        self.parts, self.mask, self.position, self.piece_counts = parts, mask, position, piece_counts

    def __call__(self, token_embeds: torch.Tensor, *flat_pieces: torch.Tensor):
        cache = DynamicCache(config=self.parts.config)
        start = 0
        for layer, count in enumerate(self.piece_counts):
            layer_pieces = flat_pieces[start: start + count]
            cache.update(torch.cat(layer_pieces[0::2], dim=-2), torch.cat(layer_pieces[1::2], dim=-2), layer)
            start += count
        out = self.parts.run_body(cache, inputs_embeds=token_embeds.unsqueeze(1), attention_mask=self.mask,
                                  position_ids=self.position)
        new = [piece[:, :, -1:].clone() for layer in cache.layers for piece in (layer.keys, layer.values)]
        return (out.last_hidden_state[:, -1], *new)
