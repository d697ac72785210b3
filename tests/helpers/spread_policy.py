"""A tiny policy whose probabilities of the tokens a test's texts use are far from 1/V, so that the probability of a
reference answer, a product of a few of them, is a number a comparison can see."""

import torch

from logitless.hf import final_hidden_states
from logitless.models import tiny_qwen2


def spread_policy(tokenizer, texts: list[str], seed: int = 0):
    """The untied tiny Qwen2 (``seed``) with its head made to spread its probability over the tokens of ``texts``
    (the random head gives every token about 1/V): every other row points against the hidden states' mean direction,
    the used rows are small random vectors."""
    model = tiny_qwen2(seed=seed, tie_word_embeddings=False)
    used = sorted({token for text in texts for token in tokenizer(text, add_special_tokens=False)["input_ids"]})
    with torch.no_grad():
        hidden = final_hidden_states(model, torch.tensor([tokenizer(" ".join(texts))["input_ids"]]))[0]
        direction = hidden.mean(0) / hidden.mean(0).norm()
        weight = model.get_output_embeddings().weight
        weight.copy_(-5.0 * direction.expand_as(weight))
        weight[used] = 0.15 * torch.randn(len(used), weight.shape[1])
    return model
