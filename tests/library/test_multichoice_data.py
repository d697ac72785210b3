import json
import re

import datasets
import pytest

from logitless.multichoice.data import (format_prompt, format_question, load_multichoice, synthetic_multichoice,
                                        to_trl_dataset)

ROWS = [
    {"question": "Which is a fruit?", "choices": ["carrot", "apple", "leek", "kale"], "answer": "B"},
    {"question": "2 * 3 = ?", "choices": ["5", "6", "8"], "answer": 1},  # an index, three options
    {"question": "Is water wet?", "choices": ["yes", "no"], "answer": " A "},
]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_synthetic_answers_are_right():
    records = synthetic_multichoice(40, seed=5)
    assert len(records) == 40 and {r["question"].split()[0] for r in records} == {"Which", "What"}
    for record in records:
        values = [int(option) for option in record["choices"]]
        assert len(set(values)) == 4 and record["answer"] in "ABCD"
        if record["question"] == "Which number is the largest?":
            correct = max(values)
        else:
            a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", record["question"]).groups())
            correct = a + b
            assert values.count(correct) == 1
        assert values["ABCD".index(record["answer"])] == correct
        assert record["prompt"] == format_prompt(record["question"], record["choices"])
    assert {r["answer"] for r in records} == set("ABCD")
    assert synthetic_multichoice(40, seed=5) == records and synthetic_multichoice(40, seed=6) != records
    assert all(len(r["choices"]) == 5 and r["answer"] in "VWXYZ" for r in synthetic_multichoice(8, choices="VWXYZ"))


def test_prompt_lists_the_options_and_asks_for_the_marker():
    prompt = format_prompt("Pick one.", ["red", "blue"], letters="XY")
    assert prompt.startswith("Pick one.\nX) red\nY) blue\n") and "ANSWER: <letter>" in prompt
    assert format_question("Pick one.", ["red", "blue"]) == "Pick one.\nA) red\nB) blue"
    with pytest.raises(ValueError, match="choices: 3 options but only 2 letters"):
        format_prompt("q", ["a", "b", "c"], letters="AB")
    with pytest.raises(ValueError, match="count"):
        synthetic_multichoice(0)
    with pytest.raises(ValueError, match="choices: letters must be distinct"):
        synthetic_multichoice(4, choices="AAB")


def test_load_jsonl(tmp_path):
    records = load_multichoice(write_jsonl(tmp_path / "q.jsonl", ROWS))
    assert [r["answer"] for r in records] == ["B", "B", "A"]
    assert records[1]["choices"] == ["5", "6", "8"]
    assert records[0]["prompt"] == format_prompt("Which is a fruit?", ["carrot", "apple", "leek", "kale"])
    indexed = write_jsonl(tmp_path / "indexed.jsonl", [ROWS[1]])
    assert load_multichoice(indexed, choices="WXYZ")[0]["answer"] == "X"
    assert load_multichoice(indexed, choices="WXYZ")[0]["prompt"].startswith("2 * 3 = ?\nW) 5\nX) 6\nY) 8\n")
    with pytest.raises(ValueError, match="line 1 of .* answer 'B'; expected one of the letters 'WXYZ'"):
        load_multichoice(tmp_path / "q.jsonl", choices="WXYZ")


def test_load_a_dataset_saved_to_disk(tmp_path):
    rows = [dict(row, answer=index) for row, index in zip(ROWS, [1, 1, 0])]  # int answers, as in many hub sets
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "plain"))
    assert [r["answer"] for r in load_multichoice(tmp_path / "plain")] == ["B", "B", "A"]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]),
                                   "test": datasets.Dataset.from_list(rows[1:])})
    splits.save_to_disk(str(tmp_path / "splits"))
    test_split = load_multichoice(tmp_path / "splits", split="test")
    assert [r["question"] for r in test_split] == ["2 * 3 = ?", "Is water wet?"]
    with pytest.raises(ValueError, match="split: .* not 'validation'"):
        load_multichoice(tmp_path / "splits", split="validation")


def test_a_name_that_is_not_a_path_goes_to_the_hub(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(ROWS[:1])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_multichoice("someone/mcq", split="validation")[0]["answer"] == "B"
    assert calls == [("someone/mcq", "validation")]


@pytest.mark.parametrize("bad_row, message", [
    ({"question": "q", "choices": ["a", "b"]}, r"line 2 of .* lacks key\(s\) \['answer'\]"),
    ({"question": "q", "choices": ["a", "b"], "answer": "C"}, r"line 2 of .* answer 'C'; expected one of .*'AB'"),
    ({"question": "q", "choices": ["a", "b"], "answer": 2}, r"line 2 of .* answer 2"),
    ({"question": "q", "choices": ["a", "b"], "answer": "AB"}, r"line 2 of .* answer 'AB'"),
    ({"question": "q", "choices": ["a", "b"], "answer": True}, r"line 2 of .* answer True"),
    ({"question": "q", "choices": "ab", "answer": "A"}, r"line 2 of .* 'choices' as a list"),
    ({"question": "q", "choices": ["a", "b", "c", "d", "e"], "answer": "A"}, r"line 2 of .* 2 to 4 options"),
])
def test_bad_jsonl_rows_name_their_line(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], bad_row])
    with pytest.raises(ValueError, match="path_or_name: " + message):
        load_multichoice(path)


def test_bad_input_elsewhere(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"question": "q"\n')
    with pytest.raises(ValueError, match="line 1 of .* is not valid JSON"):
        load_multichoice(tmp_path / "broken.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no questions"):
        load_multichoice(tmp_path / "empty.jsonl")
    rows = [{"question": "q", "choices": ["a", "b"], "answer": answer} for answer in (0, 7)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="path_or_name: row 1 of .* answer 7"):
        load_multichoice(tmp_path / "d")
    with pytest.raises(TypeError, match="path_or_name"):
        load_multichoice(None)


def test_to_trl_dataset():
    records = synthetic_multichoice(6, seed=2)
    dataset = to_trl_dataset(records)
    assert dataset.column_names == ["prompt", "question", "answer"] and len(dataset) == 6
    assert dataset["prompt"] == [r["prompt"] for r in records]
    assert dataset["answer"] == [r["answer"] for r in records]
    assert dataset["question"][0] == format_question(records[0]["question"], records[0]["choices"])
    assert dataset["question"][0] + "\n" in dataset["prompt"][0] and "\nD) " in dataset["question"][0]
    with pytest.raises(ValueError, match=r"records\[1\]: lacks key\(s\) \['answer'\]"):
        to_trl_dataset([records[0], {k: v for k, v in records[1].items() if k != "answer"}])
    with pytest.raises(ValueError, match=r"records\[0\]: answer 'E'"):
        to_trl_dataset([dict(records[0], answer="E")])
