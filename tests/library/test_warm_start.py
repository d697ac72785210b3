"""The multiple-choice warm start, in the library so that the demo and `logitless bench reward` share it: the
answer format's (prompt, response) pairs, and a short SFT that saves a model every command can load."""

import json

import pytest
import torch

from logitless.models import load_model_and_tokenizer
from logitless.multichoice.data import synthetic_multichoice
from logitless.multichoice.warm_start import multichoice_sft_pairs, warm_start_policy


def test_pairs_answer_with_the_ordinal_and_the_letter_of_the_right_option():
    records = synthetic_multichoice(count=8, seed=0)
    pairs = multichoice_sft_pairs(records, end="<end>")
    ordinals = {"A": "first", "B": "second", "C": "third", "D": "fourth"}
    assert [pair["prompt"] for pair in pairs] == [record["prompt"] for record in records]
    assert [pair["response"] for pair in pairs] == [f" ANSWER: {ordinals[record['answer']]} {record['answer']}<end>"
                                                    for record in records]
    with pytest.raises(ValueError, match="^letters: at most 10"):
        multichoice_sft_pairs(records, letters="ABCDEFGHIJK")
    with pytest.raises(ValueError, match=r"^records\[0\]: answer"):
        multichoice_sft_pairs(records, letters="XYZ")


@pytest.mark.slow
def test_warm_start_learns_the_format_and_saves_a_model_every_command_loads(tmp_path):
    history, directory = warm_start_policy(tmp_path / "policy", steps=6, cooldown_steps=2, progress=False,
                                           data_file=tmp_path / "pairs.jsonl")
    assert directory == tmp_path / "policy" and len(history["loss"]) == len(history["entropy"]) == 8
    assert history["loss"][-1] < history["loss"][0] - 2 and history["seconds"] > 0
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == 256 and all(pair["response"].startswith(" ANSWER: ") for pair in pairs)
    model, tokenizer = load_model_and_tokenizer(directory)
    untrained, _ = load_model_and_tokenizer("tiny-qwen2-untied")
    assert tokenizer.eos_token == "<|endoftext|>" and pairs[0]["response"].endswith(tokenizer.eos_token)
    assert not torch.equal(model.lm_head.weight, untrained.lm_head.weight)
