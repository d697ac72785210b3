"""The prompts of `logitless grade`: the training prompts and the held-out ones (a file, or the built-in ones), and
the prompts of each optimizer step (a function of the seed and the step, so that a resumed run sees the same)."""

from __future__ import annotations

import random

from logitless.recipes.common import refuse_other_commands_data
from logitless.recipes.grade_options import GradeRunConfig

DEFAULT_PROMPTS = ["Once upon a time", "The weather today is", "My favourite food is", "Yesterday I went to",
                   "The best way to learn is", "In the morning", "A good friend", "The city at night",
                   "When I was young", "The meeting is about", "Dear diary,", "The recipe needs",
                   "Our team will", "The old house", "Scientists found that", "Tomorrow we will"]
EVAL_PROMPTS = ["Last summer we", "The library opens", "My brother said", "On the mountain", "The new teacher",
                "After dinner", "The river was", "Every weekend I"]  # held out: never trained on


def step_prompts(records: list[dict], count: int, seed: int, step: int) -> list[dict]:
    """The prompts of one optimizer step: a function of (seed, step) only, so a resumed run sees the same."""
    rng = random.Random(f"{seed}:{step}")
    return rng.sample(records, count) if count <= len(records) else rng.choices(records, k=count)


def load_prompts(run: GradeRunConfig) -> list[dict]:
    """The training prompts: ``data``, or the built-in ones; errors name ``data``."""
    from logitless.multichoice.data import synthetic_multichoice

    if run.data is not None:
        return _read_prompts(run, "data")
    if run.reward == "judge":
        return synthetic_multichoice(count=64, seed=run.seed)
    return [{"prompt": text} for text in DEFAULT_PROMPTS]


def load_held_out_prompts(run: GradeRunConfig, training: list[dict]) -> list[dict]:
    """The held-out prompts: ``eval_data``; without it, built-in ones none of ``training`` holds ([] when the
    training prompts come from a file: then only ``eval_data`` names them). Errors name ``eval_data``."""
    from logitless.multichoice.data import synthetic_multichoice

    if run.eval_data is not None:
        return _read_prompts(run, "eval_data")
    if run.data is not None:
        return []
    if run.reward == "judge":  # another seed's draw, without the training questions
        trained = {record["question"] for record in training}
        return [record for record in synthetic_multichoice(count=64, seed=run.seed + 1)
                if record["question"] not in trained][:16]
    return [{"prompt": text} for text in EVAL_PROMPTS]


def _read_prompts(run: GradeRunConfig, field: str) -> list[dict]:
    """The records of the file that option ``field`` names: multiple-choice questions for the judge reward,
    else {"prompt": ...} lines."""
    from logitless.records import read_jsonl
    from logitless.multichoice.data import load_multichoice

    path = getattr(run, field)
    refuse_other_commands_data(field, path, "grade", "grpo" if run.reward == "judge" else "grade")
    if run.reward == "judge":
        return load_multichoice(path, name=field)
    records = []
    for where, record in read_jsonl(path, field):
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f"{field}: {where} has no 'prompt' string")
        if not record["prompt"]:  # the policy would start its completion from nothing
            raise ValueError(f"{field}: {where} has an empty 'prompt'")
        records.append(record)
    if not records:
        raise ValueError(f"{field}: {path} holds no prompts")
    return records
