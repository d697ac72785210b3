"""Turning (prompt, output) text pairs into training tensors (the records themselves: `records.py`).

The padding rule: concatenate ``prompt_ids + output_ids``, right-pad every
row to the batch's longest length L with the pad id (the EOS id when the tokenizer has no pad
token), then ``input_ids = padded[:, :-1]`` and ``labels = padded[:, 1:]``. Padding ``input_ids``
with zeros and then one EOS agrees with this only when the last real token's id happens to be 0.
"""

from __future__ import annotations

import torch

from logitless._checks import check_strings


def pad_token_id(tokenizer) -> int:
    """The id used for padding: the tokenizer's pad token, else its EOS token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("tokenizer: has neither a pad token nor an EOS token to pad with")
    return int(pad)


def left_padded(id_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (input_ids (B, T), attention_mask (B, T)), each row padded on the left to the longest,
    as generation and last-position reads want them."""
    longest = max(len(ids) for ids in id_lists)
    input_ids = torch.full((len(id_lists), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(id_lists), longest, dtype=torch.long)
    for row, ids in enumerate(id_lists):
        input_ids[row, longest - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, longest - len(ids):] = 1
    return input_ids, attention_mask


def tokenize_prompt_and_output(prompt_strs: list[str], output_strs: list[str], tokenizer) -> dict[str, torch.Tensor]:
    """Tokenize prompts (with special tokens) and outputs (without), concatenate and pad.

    Returns ``input_ids``, ``labels`` (long) and ``response_mask`` (float 0/1), each (B, L-1) where L
    is the longest prompt+output. ``response_mask`` marks the output tokens among ``labels``.
    """
    prompts = check_strings("prompt_strs", prompt_strs)
    outputs = check_strings("output_strs", output_strs)
    if len(prompts) != len(outputs):
        raise ValueError(f"output_strs: got {len(outputs)} outputs for {len(prompts)} prompts")
    if not prompts:
        raise ValueError("prompt_strs: expected at least one prompt")
    pad = pad_token_id(tokenizer)

    prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    output_ids = tokenizer(outputs, add_special_tokens=False)["input_ids"]
    sequences = [p + o for p, o in zip(prompt_ids, output_ids)]
    longest = max(len(s) for s in sequences)
    if longest < 2:
        raise ValueError("prompt_strs: every prompt+output is shorter than 2 tokens; nothing to predict")

    padded = torch.full((len(sequences), longest), pad, dtype=torch.long)  # (B, L)
    response_mask = torch.zeros(len(sequences), longest - 1)  # over labels = padded[:, 1:]
    for row, (sequence, prompt) in enumerate(zip(sequences, prompt_ids)):
        padded[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        # Output token k sits at padded index len(prompt)+k, i.e. labels index len(prompt)+k-1.
        response_mask[row, max(len(prompt) - 1, 0): len(sequence) - 1] = 1.0
    return {"input_ids": padded[:, :-1].contiguous(), "labels": padded[:, 1:].contiguous(),
            "response_mask": response_mask}
