"""Turning (prompt, output) text pairs into training tensors, and loading such pairs.

The padding rule: concatenate ``prompt_ids + output_ids``, right-pad every
row to the batch's longest length L with the pad id (the EOS id when the tokenizer has no pad
token), then ``input_ids = padded[:, :-1]`` and ``labels = padded[:, 1:]``. Padding ``input_ids``
with zeros and then one EOS agrees with this only when the last real token's id happens to be 0.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from logitless._checks import check_positive_int, check_strings


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


def read_jsonl(path: str | Path, name: str = "path") -> Iterator[tuple[str, dict]]:
    """(where, record) for each non-blank line of a jsonl file; ``where`` reads "line N of PATH".

    Errors name the argument ``name`` and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{name}: no such file {str(path)!r}")
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{name}: line {line_no} of {path} is not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{name}: line {line_no} of {path} is not a JSON object")
            yield f"line {line_no} of {path}", record


def load_jsonl(path: str | Path, prompt_key: str = "prompt", response_key: str = "response", *,
               name: str = "path") -> list[dict[str, str]]:
    """Read (prompt, response) pairs of strings from a jsonl file, one JSON object per line.

    Errors start with ``name`` (the caller's name for the file, e.g. "data") and give the line."""
    pairs = []
    for where, record in read_jsonl(path, name):
        missing = [k for k in (prompt_key, response_key) if k not in record]
        if missing:
            raise ValueError(f"{name}: {where} lacks key(s) {missing}")
        for key in (prompt_key, response_key):
            if not isinstance(record[key], str):
                raise ValueError(f"{name}: {where} has a {key} that is not a string: {record[key]!r}")
        pairs.append({"prompt": record[prompt_key], "response": record[response_key]})
    if not pairs:
        raise ValueError(f"{name}: {path} holds no examples")
    return pairs


def arithmetic_sft_examples(count: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """A small built-in SFT set: 'What is a + b?' answered in the r1-zero format.

    Learnable by a tiny model within a few dozen steps, which is what the demo needs.
    """
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        examples.append({"prompt": f"Question: What is {a} + {b}?\nAnswer:",
                         "response": f" <think>{a} plus {b} is {a + b}.</think> <answer>{a + b}</answer>"})
    return examples


def iterate_batches(examples: list[dict[str, str]], batch_size: int, seed: int = 0) -> Iterator[list[dict[str, str]]]:
    """Endless shuffled batches; each pass over the data uses a fresh permutation (the last ``len(examples) %
    batch_size`` examples of a pass wait for the next one)."""
    check_positive_int("batch_size", batch_size)
    if batch_size > len(examples):
        raise ValueError(f"batch_size: {batch_size} is more than the {len(examples)} examples")
    rng = random.Random(seed)
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [examples[i] for i in order[start: start + batch_size]]
