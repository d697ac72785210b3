"""A tiny policy that already answers multiple-choice questions in the form "ANSWER: fourth D".

A short SFT (`logitless.sft.sft_step`) of the embedded tiny Qwen2 on synthetic questions
(`multichoice.data`), so that GRPO and `logitless bench reward` generate completions with an
answer letter to read. By default the questions are sums ("What is a + b?"), which the tiny model
cannot solve in a few dozen steps: it learns the format, not the answers.

Why an ordinal word before the letter: the multiple-choice reward reads P(correct | model) at the
answer letter, so only what the policy sampled BEFORE that letter can make one completion's reward
differ from another's (GRPO learns from those differences). A 2-layer, 64-wide model does not learn
in a minute to look back at a letter it wrote earlier, but the letter right after a word is a
function of that word alone: the sampled ordinal is the decision. With untied embeddings
("tiny-qwen2-untied") that word-to-letter map is learned within 40-50 steps for every seed tried
(0, 1, 2); with tied ones it took 70 to over 150 steps, or was not learned at all.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from logitless.records import iterate_batches
from logitless.models import load_model_and_tokenizer, save_model_and_tokenizer
from logitless.multichoice.data import synthetic_multichoice
from logitless.sft import sft_step

ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


def multichoice_sft_pairs(records: list[dict], letters: str = "ABCD", end: str = "", *,
                          ordinal_before_tag: bool = False) -> list[dict[str, str]]:
    """(prompt, response) pairs whose response is " ANSWER: <ordinal> <letter>" + ``end`` for the right option
    (" ANSWER: fourth D"), or with ``ordinal_before_tag`` " <ordinal> ANSWER: <letter>" (" fourth ANSWER: D"): the
    ordinal is then reasoning before the answer tag, what the rewards that replace the answer after the tag (RLPR's,
    VeriFree's) condition on.

    ``letters``: the answer letters the records were built with (`synthetic_multichoice`'s
    ``choices``, at most 10); ``end``: e.g. the tokenizer's EOS, so that generation stops there.
    """
    if len(letters) > len(ORDINALS):
        raise ValueError(f"letters: at most {len(ORDINALS)} answer letters, got {letters!r}")
    for i, record in enumerate(records):
        if record["answer"] not in letters:
            raise ValueError(f"records[{i}]: answer {record['answer']!r} is not one of the letters {letters!r}")
    form = " {ordinal} ANSWER: {letter}" if ordinal_before_tag else " ANSWER: {ordinal} {letter}"
    return [{"prompt": record["prompt"],
             "response": form.format(ordinal=ORDINALS[letters.index(record["answer"])], letter=record["answer"]) + end}
            for record in records]


def warm_start_policy(output_dir: str | Path, steps: int = 60, seed: int = 0, progress: bool = True, *,
                      model: str = "tiny-qwen2-untied", kinds: tuple[str, ...] = ("sum",), learning_rate: float = 1e-2,
                      cooldown_steps: int | None = None, batch_size: int = 8, data_file: str | Path | None = None,
                      on_step: Callable[[int, int], object] | None = None) -> tuple[dict, Path]:
    """SFT ``model`` on 256 synthetic questions of ``kinds`` (AdamW, gradients clipped to norm 1) and save it
    with its tokenizer in ``output_dir``; returns the history {"loss": [...], "entropy": [...], "seconds"} (the
    seconds of training) and ``output_dir``, which `load_model_and_tokenizer` and every ``--model`` load.

    ``steps`` at ``learning_rate``, then ``cooldown_steps`` (default: a tenth of ``steps``) at a tenth of
    it. The large steps leave the answer prior swinging with the last few batches' letters; the small ones
    settle it near uniform (the sums' letters are uniform), so that GRPO starts from an unbiased policy.
    The training pairs are also written to ``data_file`` when one is given; ``on_step(done, total)`` is called after
    each step.
    """
    from tqdm.auto import tqdm

    cooldown_steps = steps // 10 if cooldown_steps is None else cooldown_steps
    torch.manual_seed(seed)
    policy, tokenizer = load_model_and_tokenizer(model, seed=seed)
    policy.train()
    pairs = multichoice_sft_pairs(synthetic_multichoice(count=256, seed=seed, kinds=kinds), end=tokenizer.eos_token)
    if data_file is not None:
        Path(data_file).write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=learning_rate, weight_decay=0.0, fused=True)
    batches = iterate_batches(pairs, batch_size, seed=seed)
    history = {"loss": [], "entropy": []}
    started = time.perf_counter()
    total = steps + cooldown_steps
    for step in tqdm(range(total), desc="warm start", disable=not progress, unit="step"):
        if step == steps:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate / 10
        done = sft_step(policy, tokenizer, optimizer, [next(batches)], step=step + 1, max_grad_norm=1.0)
        history["loss"].append(done.loss)
        history["entropy"].append(done.entropy)
        if on_step is not None:
            on_step(step + 1, total)
    history["seconds"] = time.perf_counter() - started
    return history, save_model_and_tokenizer(policy, tokenizer, output_dir)
