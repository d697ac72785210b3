"""Differentiable rewards of a soft completion: any model sharing the policy's vocabulary, scored from embeddings.

A reward is called on `RewardInputs` (the left-padded prompts and the soft completion) and returns
(B,) fp32, differentiable with respect to the completion's weights. Model-based rewards build
``inputs_embeds`` = their own embedding of the prompt, of the soft completion (sparse: k rows per
position, `TokenEmbedding.of_soft`) and of an optional fixed suffix; the model is frozen.

* `TokenSetReward`: the fraction of generated tokens in a set (some words, or every capitalized word).
* `SequenceClassifierReward`: a Hugging Face sequence classifier's logit for one label.
* `TokenLogProbReward`: a causal LM's log-probability of one token after the completion (and a suffix
  such as "\\nWas this answer helpful?"), e.g. " yes", read by the head's fused log-prob op (no (B, V)
  log-softmax).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from logitless._checks import check_strings
from logitless.grade.parts import CausalLMParts
from logitless.grade.soft_tokens import PromptBatch, SoftTokens, TokenEmbedding
from logitless.hf import position_ids_for
from logitless.ops.fused import fused_linear_logprobs


@dataclass
class RewardInputs:
    prompt: PromptBatch
    completion: SoftTokens  # (B, T, k) or (B, T, V)


class SoftReward:
    """Base class: ``reward(inputs) -> (B,)``. ``model`` (if any) must share the policy's vocabulary."""

    model = None

    def __call__(self, inputs: RewardInputs) -> torch.Tensor:
        raise NotImplementedError

    def check_vocabulary(self, vocab_size: int) -> None:
        if self.model is None:
            return
        rows = TokenEmbedding.of(self.model, "reward_model").vocab_size
        if rows != vocab_size:
            raise ValueError(f"reward_model: its vocabulary has {rows} tokens, the policy's {vocab_size}; "
                             "a soft completion can only be read by a model with the policy's tokenizer")


def frozen(model):
    """The model in eval mode with no parameter gradients: a reward is a fixed function of its input."""
    return model.eval().requires_grad_(False)


def sequence_inputs(embedding: TokenEmbedding, prefix: PromptBatch, completion: SoftTokens,
                    suffix_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``inputs_embeds`` (B, P + T + S, H) with its attention mask and position ids: prefix, soft completion, suffix."""
    parts = [embedding.of_ids(prefix.input_ids), embedding.of_soft(completion)]
    if suffix_ids is not None and suffix_ids.numel():
        parts.append(embedding.of_ids(suffix_ids.to(prefix.input_ids.device)).expand(prefix.input_ids.shape[0], -1, -1))
    embeds = torch.cat(parts, dim=1)
    mask = torch.cat([prefix.attention_mask, prefix.attention_mask.new_ones(embeds.shape[0], embeds.shape[1]
                                                                            - prefix.attention_mask.shape[1])], dim=1)
    return {"inputs_embeds": embeds, "attention_mask": mask, "position_ids": position_ids_for(mask)}


def single_token_ids(tokenizer, words, name: str) -> list[int]:
    """Each word's one token id (a ValueError naming ``name`` if a word is not exactly one token)."""
    ids = []
    for word in check_strings(name, words):
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"{name}: {word!r} is {len(encoded)} tokens {encoded}, expected exactly one")
        ids.append(encoded[0])
    return ids


class TokenSetReward(SoftReward):
    """The fraction of the completion's tokens that belong to a set of token ids: 0 to 1, no model.

    Soft tokens count their weight on the set, so the reward is differentiable; a hard completion
    scores the plain fraction. `from_words` builds the set from words (each one token),
    `capitalized_words` from every vocabulary entry that is a space and a capitalized word (" Paris").
    """

    def __init__(self, token_ids, description: str = "tokens in the set"):
        # a set: a repeated id would count twice in the dense sum and once in the sparse lookup
        self.token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().unique()
        if self.token_ids.numel() == 0:
            raise ValueError("token_ids: the set is empty; the reward would always be 0")
        if int(self.token_ids.min()) < 0:
            raise ValueError(f"token_ids: token ids are >= 0, got {int(self.token_ids.min())}")
        self.description = description

    @classmethod
    def from_words(cls, tokenizer, words) -> TokenSetReward:
        words = check_strings("words", words)
        return cls(single_token_ids(tokenizer, words, "words"), f"tokens among {words}")

    @classmethod
    def capitalized_words(cls, tokenizer) -> TokenSetReward:
        """Tokens that decode to a space and a capitalized word: " The", " Paris" (about 8% of Qwen's vocabulary)."""
        pattern = re.compile(r"^ [A-Z][a-z]+$")
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        return cls([i for i, text in enumerate(texts) if pattern.match(text)], "capitalized words")

    def check_vocabulary(self, vocab_size: int) -> None:
        if int(self.token_ids.max()) >= vocab_size:
            raise ValueError(f"token_ids: id {int(self.token_ids.max())} is outside the policy's vocabulary of "
                             f"{vocab_size}")

    def __call__(self, inputs: RewardInputs) -> torch.Tensor:
        token_ids = self.token_ids.to(inputs.completion.weights.device)
        return inputs.completion.mass_on(token_ids).float().mean(dim=1)


class SequenceClassifierReward(SoftReward):
    """``model(inputs_embeds=prompt + completion).logits[:, label]`` of a Hugging Face sequence classifier."""

    def __init__(self, model, label: int = 0):
        self.model = frozen(model)
        self.embedding = TokenEmbedding.of(model, "reward_model")
        labels = getattr(model.config, "num_labels", 1)
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < labels:
            raise ValueError(f"label: expected an int in [0, {labels}), got {label!r}")
        self.label = label

    def __call__(self, inputs: RewardInputs) -> torch.Tensor:
        # Every sequence ends at the last position (prompts are left-padded). A classifier without a pad id
        # refuses a batch above 1 only because it would look for each end in input_ids, which it does not get
        # here: a placeholder id for the call lets it read the last position.
        config = self.model.config
        pad_token_id = config.pad_token_id
        if pad_token_id is None:
            config.pad_token_id = -1
        try:
            out = self.model(**sequence_inputs(self.embedding, inputs.prompt, inputs.completion), use_cache=False)
        finally:
            config.pad_token_id = pad_token_id
        return out.logits[:, self.label].float()


class TokenLogProbReward(SoftReward):
    """log p(``token``) under a causal LM after prompt + completion + ``suffix`` (text, may be empty)."""

    def __init__(self, model, tokenizer, token: str = " yes", suffix: str = ""):
        self.model = frozen(model)
        self.parts = CausalLMParts.of(model, "reward_model")
        (self.token_id,) = single_token_ids(tokenizer, [token], "token")
        if not isinstance(suffix, str):
            raise TypeError(f"suffix: expected a string, got {type(suffix).__name__}")
        self.suffix_ids = torch.tensor(tokenizer.encode(suffix, add_special_tokens=False), dtype=torch.long)

    def __call__(self, inputs: RewardInputs) -> torch.Tensor:
        batch = sequence_inputs(self.parts.embedding, inputs.prompt, inputs.completion, self.suffix_ids)
        hidden = self.parts.body(**batch, use_cache=False).last_hidden_state[:, -1]  # (B, H)
        token = torch.full(hidden.shape[:1], self.token_id, dtype=torch.long, device=hidden.device)  # (B,)
        return fused_linear_logprobs(hidden, targets=token, head=self.parts.head)  # (B,)
