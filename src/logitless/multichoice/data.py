"""Multiple-choice questions: a synthetic set, loading a user's set, and the TRL dataset for GRPO.

A record is ``{"question": text without the options, "choices": [option texts], "answer": letter,
"prompt": formatted prompt}``. The prompt lists the options as "A) ..." lines and asks the model to
reason briefly and finish with "ANSWER: <letter>", the marker the multichoice rewards look for.
"""

from __future__ import annotations

import random
from pathlib import Path

from logitless._checks import check_positive_int
from logitless.records import read_rows

INSTRUCTION = "Think briefly, then finish with a line of the form ANSWER: <letter>."


def _check_letters(name: str, letters) -> str:
    if not isinstance(letters, str) or not letters:
        raise TypeError(f"{name}: expected a non-empty string of answer letters such as 'ABCD', got {letters!r}")
    if len(set(letters)) != len(letters):
        raise ValueError(f"{name}: letters must be distinct, got {letters!r}")
    return letters


def format_question(question: str, choices: list[str], letters: str = "ABCD") -> str:
    """The question followed by one "A) option" line per choice."""
    _check_letters("letters", letters)
    if not isinstance(question, str):
        raise TypeError(f"question: expected a string, got {type(question).__name__}")
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
        raise TypeError(f"choices: expected a non-empty list of option texts, got {choices!r}")
    if len(choices) > len(letters):
        raise ValueError(f"choices: {len(choices)} options but only {len(letters)} letters {letters!r}")
    options = "\n".join(f"{letter}) {option}" for letter, option in zip(letters, choices))
    return f"{question}\n{options}"


def format_prompt(question: str, choices: list[str], letters: str = "ABCD") -> str:
    """The question, its options as "A) ..." lines, and the instruction to end with "ANSWER: <letter>"."""
    return f"{format_question(question, choices, letters)}\n{INSTRUCTION}\n"


def _largest_number_question(rng: random.Random, count: int) -> tuple[str, list[str], int]:
    numbers = rng.sample(range(1, 100), count)
    return "Which number is the largest?", [str(n) for n in numbers], numbers.index(max(numbers))


def _sum_question(rng: random.Random, count: int) -> tuple[str, list[str], int]:
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    wrong = rng.sample([a + b + d for d in range(-9, 10) if d != 0], count - 1)
    options = [a + b, *wrong]
    rng.shuffle(options)
    return f"What is {a} + {b}?", [str(n) for n in options], options.index(a + b)


def _sorted_largest_question(rng: random.Random, count: int) -> tuple[str, list[str], int]:
    numbers = sorted(rng.sample(range(1, 100), count))
    return "Which number is the largest?", [str(n) for n in numbers], count - 1


def _sorted_smallest_question(rng: random.Random, count: int) -> tuple[str, list[str], int]:
    numbers = sorted(rng.sample(range(1, 100), count))
    return "Which number is the smallest?", [str(n) for n in numbers], 0


# "largest" lists the options in random order; "sorted_largest" / "sorted_smallest" in increasing order,
# so the answer is always the last / the first option: a rule a tiny model can learn from a reward alone
QUESTION_KINDS = {"largest": _largest_number_question, "sum": _sum_question,
                  "sorted_largest": _sorted_largest_question, "sorted_smallest": _sorted_smallest_question}


def synthetic_multichoice(count: int = 64, seed: int = 0, choices: str = "ABCD",
                          kinds: tuple[str, ...] = ("largest", "sum")) -> list[dict]:
    """``count`` questions with a known answer, each of a kind drawn from ``kinds`` (`QUESTION_KINDS`):
    "Which number is the largest?" / "...smallest?" or "What is a + b?".

    Each has one option per letter of ``choices`` (2 to 10 letters), exactly one of them right.
    """
    _check_letters("choices", choices)
    if not 2 <= len(choices) <= 10:
        raise ValueError(f"choices: expected 2 to 10 letters, got {len(choices)}")
    check_positive_int("count", count)
    if isinstance(kinds, str) or not kinds or not set(kinds) <= set(QUESTION_KINDS):
        raise ValueError(f"kinds: expected a non-empty tuple of {sorted(QUESTION_KINDS)}, got {kinds!r}")
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        make = QUESTION_KINDS[rng.choice(kinds)]
        question, options, correct = make(rng, len(choices))
        records.append({"question": question, "choices": options, "answer": choices[correct],
                        "prompt": format_prompt(question, options, choices)})
    return records


def _record(raw, where: str, letters: str, name: str) -> dict:
    """A loaded row -> a record; errors start with ``name`` and give ``where`` ("line 3 of f.jsonl", "row 3")."""
    if not isinstance(raw, dict):
        raise ValueError(f"{name}: {where} is not an object with question/choices/answer")
    missing = [key for key in ("question", "choices", "answer") if key not in raw]
    if missing:
        raise ValueError(f"{name}: {where} lacks key(s) {missing}")
    question, options, answer = raw["question"], raw["choices"], raw["answer"]
    if not isinstance(question, str):
        raise ValueError(f"{name}: {where} has a question that is not a string: {question!r}")
    if not isinstance(options, (list, tuple)) or not 2 <= len(options) <= len(letters):
        raise ValueError(f"{name}: {where} needs 'choices' as a list of 2 to {len(letters)} options, got {options!r}")
    for option in options:  # numbers read naturally as options; null, lists or objects do not
        if isinstance(option, bool) or not isinstance(option, (str, int, float)):
            raise ValueError(f"{name}: {where} has an option that is not a string or a number: {option!r}")
    options = [str(option) for option in options]
    valid = letters[: len(options)]
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(options):
        answer = valid[answer]
    elif isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip() in valid:
        answer = answer.strip()
    else:
        raise ValueError(f"{name}: {where} has answer {answer!r}; expected one of the letters {valid!r} "
                         f"or an index in [0, {len(options)})")
    return {"question": question, "choices": options, "answer": answer,
            "prompt": format_prompt(question, options, letters)}


def load_multichoice(path_or_name: str | Path, split: str = "train", choices: str = "ABCD", *,
                     name: str = "path_or_name") -> list[dict]:
    """Records from a jsonl file (one object per line), a dataset saved with ``save_to_disk``, or the hub
    (`logitless.records.read_rows`).

    Each row needs ``question`` (str), ``choices`` (a list of option texts or numbers) and ``answer`` (a
    letter of ``choices``, or an int index, converted to its letter). Errors start with ``name`` (the caller's name
    for the argument, e.g. "data").
    """
    _check_letters("choices", choices)
    records = [_record(raw, where, choices, name) for where, raw in read_rows(path_or_name, split, name=name)]
    if not records:
        raise ValueError(f"{name}: {path_or_name} holds no questions")
    return records


def to_trl_dataset(records: list[dict], letters: str = "ABCD"):
    """A ``datasets.Dataset`` for TRL's GRPOTrainer with columns prompt, question, answer.

    ``prompt`` is the plain-text prompt; ``question`` is the question with its "A) ..." options, what
    the multichoice judge reads; ``answer`` is the letter (``letters`` as used to build the records).
    """
    import datasets

    _check_letters("letters", letters)
    if not isinstance(records, list) or not records:
        raise TypeError(f"records: expected a non-empty list of records, got {type(records).__name__}")
    columns = {"prompt": [], "question": [], "answer": []}
    for i, record in enumerate(records):
        missing = [key for key in ("question", "choices", "answer", "prompt") if key not in record]
        if missing:
            raise ValueError(f"records[{i}]: lacks key(s) {missing}")
        answer = record["answer"]
        if not isinstance(answer, str) or len(answer) != 1 or answer not in letters[: len(record["choices"])]:
            raise ValueError(f"records[{i}]: answer {answer!r} is not one of the letters "
                             f"{letters[: len(record['choices'])]!r}")
        columns["prompt"].append(record["prompt"])
        columns["question"].append(format_question(record["question"], record["choices"], letters))
        columns["answer"].append(answer)
    return datasets.Dataset.from_dict(columns)
