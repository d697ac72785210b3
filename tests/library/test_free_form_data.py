import json
import re

import pytest

from logitless.free_form.data import EMBEDDED_QUESTIONS, format_prompt, load_free_form, to_trl_dataset
from logitless.recipes.grpo_options import FREE_FORM_COUNT


def test_the_embedded_questions_are_distinct_answered_in_one_line_and_the_arithmetic_right():
    records = load_free_form()
    assert len(records) == sum(1 for line in EMBEDDED_QUESTIONS.read_text().splitlines() if line.strip()) == 140
    assert FREE_FORM_COUNT == 140  # what --help and the run card say
    assert len({r["question"] for r in records}) == len(records)
    operations = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "times": lambda a, b: a * b}
    arithmetic = 0
    for record in records:
        assert record["answer"] and "\n" not in record["answer"] and record["answer"] == record["answer"].strip()
        assert record["prompt"] == format_prompt(record["question"]) and "ANSWER: <answer>" in record["prompt"]
        sum_like = re.fullmatch(r"What is (\d+) (\+|-|times) (\d+)\?", record["question"])
        if sum_like:
            a, operation, b = sum_like.groups()
            assert record["answer"] == str(operations[operation](int(a), int(b)))
            arithmetic += 1
    assert arithmetic == 80


def test_a_users_questions_load_with_numbers_as_text_and_bad_rows_are_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 2?", "answer": 4}) + "\n"
                    + json.dumps({"question": "Capital of Peru?", "answer": " Lima "}) + "\n")
    records = load_free_form(path, name="data")
    assert [r["answer"] for r in records] == ["4", "Lima"]
    dataset = to_trl_dataset(records)
    assert dataset.column_names == ["prompt", "question", "answer"] and dataset["answer"] == ["4", "Lima"]
    for row, message in [({"question": "q"}, r"data: line 1 of .* is not an object with question and answer"),
                         ({"question": "q", "answer": "two\nlines"}, "data: line 1 of .* expected one non-empty line"),
                         ({"question": "q", "answer": None}, "data: line 1 of .* not a string or a number: None"),
                         ({"question": "", "answer": "x"}, "data: line 1 of .* not a non-empty string"),
                         ({"question": "q", "choices": ["a", "b"], "answer": "A"},
                          "data: line 1 of .* has choices: a multiple-choice question")]:
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=message):
            load_free_form(path, name="data")
    with pytest.raises(ValueError, match="data: no such file 'missing.jsonl'"):
        load_free_form("missing.jsonl", name="data")
