"""Tiny causal LMs for the head-structure tests: one per structure `logitless.hf` reads (`head_structure` names
them), and one whose forward changes its logits in a way no config says, which logitless must refuse."""

from model_sweep import tiny_model
from transformers import Qwen2ForCausalLM

from logitless.models import tiny_qwen2_config

# structure -> (transformers model type, config fields): a tiny model with that head
STRUCTURES = {
    "plain": ("qwen2", {"tie_word_embeddings": False}),
    "tied": ("qwen2", {"tie_word_embeddings": True}),
    "soft-capped": ("gemma2", {"final_logit_softcapping": 1.0}),
    "scaled": ("cohere", {"logit_scale": 0.37}),
    "transformed": ("bert", {}),  # BERT's LM head: dense, GELU, LayerNorm before the output embedding
    "padded vocabulary": ("inkling_text", {"unpadded_vocab_size": 200}),  # and its hidden states / muP multiplier
    "nested language model": ("llama4_text", {}),  # its base_model_prefix names Llama 4's composite model's part
}


def with_structure(structure: str):
    """The tiny model of ``structure`` (random weights, seed 0)."""
    model_type, fields = STRUCTURES[structure]
    return tiny_model(model_type, **fields)


class HalvedLogitsQwen2(Qwen2ForCausalLM):
    """A Qwen2 whose forward halves its logits: a change to the head that its config does not say."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits / 2
        return output


class UncheckedQwen2(Qwen2ForCausalLM):
    """A Qwen2 under a class of its own, which the sweep did not check: its head is read right, but only a run of its
    own forward shows it."""


def halved_logits_qwen2(**config_fields) -> HalvedLogitsQwen2:
    """A tiny `HalvedLogitsQwen2` with the Qwen vocabulary (random weights)."""
    return HalvedLogitsQwen2(tiny_qwen2_config(**config_fields))
