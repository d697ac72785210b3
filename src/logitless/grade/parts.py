"""A causal LM taken apart for GRADE: the body that gives final hidden states, the LM head, the input embedding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitless.grade.soft_tokens import TokenEmbedding
from logitless.logprobs import LMHead, lm_head_of, model_body
from logitless.ops.kl import fused_linear_kl


@dataclass
class CausalLMParts:
    model: torch.nn.Module
    body: torch.nn.Module  # (inputs_embeds, attention_mask, position_ids, past_key_values) -> last_hidden_state
    head: LMHead
    embedding: TokenEmbedding

    @classmethod
    def of(cls, model, name: str) -> CausalLMParts:
        embedding = TokenEmbedding.of(model, name)
        try:
            head, body = lm_head_of(model), model_body(model)
        except TypeError as err:
            raise TypeError(f"{name}: {str(err).partition(': ')[2]}") from None
        if head.softcap is not None:
            raise ValueError(f"{name}: soft-capped LM heads (final_logit_softcapping) are not supported by GRADE")
        if head.weight.shape[0] != embedding.vocab_size:
            raise ValueError(f"{name}: its LM head has {head.weight.shape[0]} rows but its input embedding "
                             f"{embedding.vocab_size}; soft tokens need one vocabulary")
        return cls(model, body, head, embedding)

    @property
    def vocab_size(self) -> int:
        return self.head.weight.shape[0]

    @property
    def config(self):
        return self.model.config

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) -> (B, V) fp32, the full next-token logits."""
        raw = hidden @ self.head.weight.T if self.head.bias is None else torch.addmm(self.head.bias, hidden,
                                                                                      self.head.weight.T)
        return self.head.logits_from(raw)

    def selected_logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """(B, H), (B, k) -> (B, k) fp32: the logits of k tokens per row only (k rows of the head)."""
        raw = torch.einsum("bh,bkh->bk", hidden, self.head.weight[indices])
        if self.head.bias is not None:
            raw = raw + self.head.bias[indices]
        return self.head.logits_from(raw)

    def kl_to(self, hidden: torch.Tensor, reference: CausalLMParts, reference_hidden: torch.Tensor,
              chunk_size: int | None = None) -> torch.Tensor:
        """Per-row exact KL(self || reference) of the next-token distributions: (..., H), (..., H_ref) -> (...) fp32."""
        scale, ref_scale = self.head.scale, reference.head.scale  # folded into hidden and bias: s * (h W^T + b)
        return fused_linear_kl(hidden * scale, self.head.weight, reference_hidden * ref_scale, reference.head.weight,
                               bias_p=None if self.head.bias is None else self.head.bias * scale,
                               bias_q=None if reference.head.bias is None else reference.head.bias * ref_scale,
                               chunk_size=chunk_size)
