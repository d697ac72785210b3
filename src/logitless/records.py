"""Text records for training, without PyTorch: jsonl files read line by line with errors that name the option and
the line, (prompt, response) pairs, the built-in SFT examples, and shuffled batches. Nothing here loads PyTorch, so
a command checks its data files before any model or tensor library is imported."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from logitless._checks import check_positive_int


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


def names_a_file(path_or_name: str | Path) -> bool:
    """Whether a data name is plainly a local file's (a .jsonl/.json name, or a path from ``.``, ``/`` or ``~``)
    rather than a hub dataset's id."""
    return Path(path_or_name).suffix in (".jsonl", ".json") or str(path_or_name).startswith((".", "/", "~"))


def read_rows(path_or_name: str | Path, split: str = "train", *, name: str = "path_or_name"
              ) -> Iterator[tuple[str, object]]:
    """(where, row) for each row of a jsonl file, a dataset saved with ``save_to_disk`` (its ``split`` when it holds
    a DatasetDict) or a Hugging Face hub dataset id (``datasets.load_dataset(name, split=split)``); ``where`` reads
    "line 3 of f.jsonl" or "row 3 of NAME". Errors start with ``name``."""
    if not isinstance(path_or_name, (str, Path)) or not str(path_or_name):
        raise TypeError(f"{name}: expected a file, directory or dataset name, got {path_or_name!r}")
    path = Path(path_or_name).expanduser()
    if path.is_file():
        yield from read_jsonl(path, name)
        return
    if not path.is_dir() and names_a_file(path_or_name):
        raise ValueError(f"{name}: no such file {str(path_or_name)!r}")
    import datasets

    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(f"split: {path} has splits {sorted(loaded)}, not {split!r}")
                loaded = loaded[split]
        else:
            loaded = datasets.load_dataset(str(path_or_name), split=split)
    except OSError as err:  # a missing directory or hub dataset, no network
        raise ValueError(f"{name}: cannot load {str(path_or_name)!r} as a saved dataset or a hub dataset "
                         f"({' '.join(str(err).split())[:200]})") from None
    for i, row in enumerate(loaded):
        yield f"row {i} of {path_or_name}", row


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
