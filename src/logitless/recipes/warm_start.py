"""A tiny policy that already answers multiple-choice questions in the form "ANSWER: fourth D".

A short SFT (`logitless.recipes.sft`) of the embedded tiny Qwen2 on synthetic questions
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

import dataclasses
import json
import tempfile
from pathlib import Path

from logitless.checkpoint import last_complete_checkpoint
from logitless.models import qwen_tokenizer
from logitless.multichoice.data import synthetic_multichoice
from logitless.recipes.sft import SFTConfig, train_sft


ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


def multichoice_sft_pairs(records: list[dict], letters: str = "ABCD", end: str = "") -> list[dict[str, str]]:
    """(prompt, response) pairs whose response is " ANSWER: <ordinal> <letter>" + ``end`` for the right option
    (" ANSWER: fourth D").

    ``letters``: the answer letters the records were built with (`synthetic_multichoice`'s
    ``choices``, at most 10); ``end``: e.g. the tokenizer's EOS, so that generation stops there.
    """
    if len(letters) > len(ORDINALS):
        raise ValueError(f"letters: at most {len(ORDINALS)} answer letters, got {letters!r}")
    for i, record in enumerate(records):
        if record["answer"] not in letters:
            raise ValueError(f"records[{i}]: answer {record['answer']!r} is not one of the letters {letters!r}")
    return [{"prompt": record["prompt"],
             "response": f" ANSWER: {ORDINALS[letters.index(record['answer'])]} {record['answer']}{end}"}
            for record in records]


def warm_start_policy(output_dir: str | Path, steps: int = 60, seed: int = 0, progress: bool = True, *,
                      model: str = "tiny-qwen2-untied", kinds: tuple[str, ...] = ("sum",), learning_rate: float = 1e-2,
                      cooldown_steps: int | None = None, batch_size: int = 8,
                      data_file: str | Path | None = None) -> tuple[dict, Path]:
    """SFT ``model`` on 256 synthetic questions of ``kinds``; returns SFT's history and the checkpoint
    directory of the warmed-up model (the one checkpoint kept in ``output_dir``).

    ``steps`` at ``learning_rate``, then ``cooldown_steps`` (default: a tenth of ``steps``) at a tenth of
    it: a resume that is allowed to change the learning rate. The large steps leave the answer prior
    swinging with the last few batches' letters; the small ones settle it near uniform (the sums'
    letters are uniform), so that GRPO starts from an unbiased policy. The training pairs are written
    to ``data_file`` (kept) or to a temporary file.
    """
    cooldown_steps = steps // 10 if cooldown_steps is None else cooldown_steps
    pairs = multichoice_sft_pairs(synthetic_multichoice(count=256, seed=seed, kinds=kinds),
                                  end=qwen_tokenizer().eos_token)
    with tempfile.TemporaryDirectory() as scratch:
        data_path = Path(data_file) if data_file is not None else Path(scratch) / "warm_start.jsonl"
        data_path.write_text("\n".join(json.dumps(pair) for pair in pairs) + "\n")
        config = SFTConfig(model=model, data=str(data_path), output_dir=str(output_dir), steps=steps, save_every=steps,
                           seed=seed, learning_rate=learning_rate, batch_size=batch_size, resume=False,
                           save_total_limit=1)
        history = train_sft(config, progress=progress)
        if cooldown_steps:
            history = train_sft(dataclasses.replace(config, steps=steps + cooldown_steps, save_every=steps + cooldown_steps,
                                                    learning_rate=learning_rate / 10, resume=True,
                                                    allow_changed=("learning_rate",)), progress=progress)
        return history, last_complete_checkpoint(output_dir)[0]
