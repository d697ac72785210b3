"""Held-out accuracy of a policy on multiple-choice questions: the fraction of sampled completions that name the
reference answer's letter after "ANSWER:" (exact match), an estimate of P(correct | model) on questions it never
trained on."""

from __future__ import annotations

from pathlib import Path

import torch

from logitless.models import load_model_and_tokenizer
from logitless.multichoice.answer import find_answer_position


def sampled_accuracy(model_dir: str | Path, questions: list[dict], samples: int = 4, temperature: float = 1.0,
                     max_new_tokens: int = 8) -> float:
    """Fraction of ``samples`` completions per question (at ``temperature``, seeded: the same draws for every model
    of the same size) whose letter after "ANSWER:" is the question's ``answer``."""
    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    tokenizer.padding_side = "left"
    prompts = [q["prompt"] for q in questions for _ in range(samples)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        generated = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                   top_k=0, pad_token_id=tokenizer.pad_token_id)
    right = 0
    for index, row in enumerate(generated[:, encoded["input_ids"].shape[1]:].tolist()):
        ids = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
        position = find_answer_position(ids, tokenizer)
        right += (position is not None
                  and tokenizer.decode(ids[position]).strip() == questions[index // samples]["answer"])
    return right / len(prompts)
