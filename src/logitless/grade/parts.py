"""A causal LM taken apart for GRADE: the body that gives final hidden states, the LM head, the input embedding."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from logitless.grade.soft_tokens import TokenEmbedding
from logitless.hf import head_structure, lm_head_of, model_body
from logitless.hf_probe import OWN_FORWARD, check_head
from logitless.op_settings import BlockSizes
from logitless.ops.head import LinearHead
from logitless.ops.two_heads import fused_linear_kl

# head structures whose hidden states are not the body's last hidden state, which GRADE's rollouts read step by step
_NOT_THE_BODYS_OUTPUT = ("transformed", "muP-divided", "predicting stream")


@dataclass
class CausalLMParts:
    model: torch.nn.Module
    body: torch.nn.Module  # (inputs_embeds, attention_mask, position_ids, a KV cache) -> last_hidden_state
    head: LinearHead
    embedding: TokenEmbedding

    @classmethod
    def of(cls, model, name: str) -> CausalLMParts:
        embedding = TokenEmbedding.of(model, name)
        check_head(model, OWN_FORWARD, name)
        head, body = lm_head_of(model), model_body(model)
        unread = [feature for feature in head_structure(model) if feature in _NOT_THE_BODYS_OUTPUT]
        if unread:
            raise ValueError(f"{name}: GRADE reads the body's last hidden state, but {type(model).__name__}'s head "
                             f"is {', '.join(unread)}")
        if head.softcap is not None:
            raise ValueError(f"{name}: soft-capped LM heads (final_logit_softcapping) are not supported by GRADE")
        if head.weight.shape[0] != embedding.vocab_size:
            raise ValueError(f"{name}: its LM head has {head.weight.shape[0]} rows but its input embedding "
                             f"{embedding.vocab_size}; soft tokens need one vocabulary")
        return cls(model, body, head, embedding)

    def run_body(self, cache, **inputs):
        """The body with a KV cache, under the keyword this transformers version names it (``cache`` since 5.x
        deprecated ``past_key_values``)."""
        keyword = "cache" if "cache" in inspect.signature(self.body.forward).parameters else "past_key_values"
        return self.body(**inputs, **{keyword: cache}, use_cache=True)

    @property
    def vocab_size(self) -> int:
        return self.head.weight.shape[0]

    @property
    def config(self):
        return self.model.config

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) -> (B, V) fp32, the full next-token logits."""
        return self.head.logits(hidden)

    def selected_logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """(B, H), (B, k) -> (B, k) fp32: the logits of k tokens per row only (k rows of the head)."""
        return self.head.gathered_logits(hidden, indices)

    def kl_to(self, hidden: torch.Tensor, reference: CausalLMParts, reference_hidden: torch.Tensor,
              block_sizes: BlockSizes | None = None) -> torch.Tensor:
        """Per-row exact KL(self || reference) of the next-token distributions: (..., H), (..., H_ref) -> (...) fp32."""
        return fused_linear_kl(hidden, hidden_q=reference_hidden, head_p=self.head, head_q=reference.head,
                               block_sizes=block_sizes)
