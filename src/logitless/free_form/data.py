"""Free-form questions: the embedded set, a user's set, and the TRL dataset for GRPO and VeriFree.

A record is ``{"question": text, "answer": the reference answer (one line of text), "prompt": formatted prompt}``.
The prompt asks the model to reason briefly and finish with "ANSWER: <answer>", where the rewards replace what the
completion wrote by the reference answer.
"""

from __future__ import annotations

from pathlib import Path

from logitless.records import read_rows

INSTRUCTION = "Think briefly, then finish with a line of the form ANSWER: <answer>."
EMBEDDED_QUESTIONS = Path(__file__).with_name("questions.jsonl")  # 80 sums, differences, products; 60 facts


def format_prompt(question: str) -> str:
    """The question and the instruction to end with "ANSWER: <answer>"."""
    if not isinstance(question, str):
        raise TypeError(f"question: expected a string, got {type(question).__name__}")
    return f"{question}\n{INSTRUCTION}\n"


def _record(raw, where: str, name: str) -> dict:
    """A loaded row -> a record; errors start with ``name`` and give ``where``."""
    if not isinstance(raw, dict) or "question" not in raw or "answer" not in raw:
        raise ValueError(f"{name}: {where} is not an object with question and answer")
    if "choices" in raw:  # its prompt would lose the options its answer (a letter) points into
        raise ValueError(f"{name}: {where} has choices: a multiple-choice question, not a free-form one (for "
                         "`logitless grpo` and `logitless verifree`: --task multichoice)")
    question, answer = raw["question"], raw["answer"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{name}: {where} has a question that is not a non-empty string: {question!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{name}: {where} has an answer that is not a string or a number: {answer!r}")
    answer = str(answer).strip()
    if not answer or "\n" in answer:
        raise ValueError(f"{name}: {where} has answer {raw['answer']!r}; expected one non-empty line (the completion "
                         "ends its answer at the line's end)")
    return {"question": question, "answer": answer, "prompt": format_prompt(question)}


def load_free_form(path_or_name: str | Path | None = None, split: str = "train", *,
                   name: str = "path_or_name") -> list[dict]:
    """Records of the embedded questions (``path_or_name`` None) or of a jsonl file, a saved dataset directory or a
    hub dataset (`logitless.records.read_rows`) whose rows have ``question`` (str) and ``answer`` (a string or
    number of one line). Errors start with ``name``."""
    records = [_record(raw, where, name)
               for where, raw in read_rows(EMBEDDED_QUESTIONS if path_or_name is None else path_or_name, split,
                                           name=name)]
    if not records:
        raise ValueError(f"{name}: {path_or_name} holds no questions")
    return records


def to_trl_dataset(records: list[dict]):
    """A ``datasets.Dataset`` with columns prompt, question, answer, for TRL's GRPOTrainer or `VeriFreeTrainer`."""
    import datasets

    if not isinstance(records, list) or not records:
        raise TypeError(f"records: expected a non-empty list of records, got {type(records).__name__}")
    for i, record in enumerate(records):
        missing = [key for key in ("question", "answer", "prompt") if key not in record]
        if missing:
            raise ValueError(f"records[{i}]: lacks key(s) {missing}")
    return datasets.Dataset.from_dict({key: [record[key] for record in records]
                                       for key in ("prompt", "question", "answer")})
