import json

import pytest

from logitless.data import tokenize_prompt_and_output
from logitless.records import arithmetic_sft_examples, iterate_batches, load_jsonl

STRINGS = ["Hello, world!", "This is a test.", "This is another test."]


def test_issue_example_with_real_qwen_vocabulary(tokenizer):
    out = tokenize_prompt_and_output(STRINGS, STRINGS, tokenizer)
    assert out["input_ids"][0].tolist() == [9707, 11, 1879, 0, 9707, 11, 1879, 0, 151643]
    assert out["labels"][0].tolist() == [11, 1879, 0, 9707, 11, 1879, 0, 151643, 151643]
    assert out["response_mask"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert out["input_ids"].shape == out["labels"].shape == out["response_mask"].shape == (3, 9)
    # the longest row is not padded at all
    longest = tokenizer(STRINGS[2])["input_ids"] * 2
    assert out["input_ids"][2].tolist() == longest[:-1]
    assert out["labels"][2].tolist() == longest[1:]


def test_padding_rule_holds_when_last_token_is_not_zero(tokenizer):
    # the literal rule "pad input_ids with 0s then EOS" only works when the last token is id 0
    prompts, outputs = ["Hi", "This is a much longer prompt"], [" there.", " ok"]
    out = tokenize_prompt_and_output(prompts, outputs, tokenizer)
    for row, (p, o) in enumerate(zip(prompts, outputs)):
        sequence = tokenizer(p)["input_ids"] + tokenizer(o, add_special_tokens=False)["input_ids"]
        assert sequence[-1] != 0
        padded = sequence + [tokenizer.eos_token_id] * (out["labels"].shape[1] + 1 - len(sequence))
        assert out["input_ids"][row].tolist() == padded[:-1]
        assert out["labels"][row].tolist() == padded[1:]
        prompt_len = len(tokenizer(p)["input_ids"])
        expected_mask = [1.0 if prompt_len - 1 <= j < len(sequence) - 1 else 0.0 for j in range(len(padded) - 1)]
        assert out["response_mask"][row].tolist() == expected_mask
        assert out["response_mask"][row].sum() == len(sequence) - prompt_len


def test_pad_token_is_used_when_tokenizer_has_one(tokenizer):
    tok = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>",
                              pad_token="<|im_end|>")
    out = tokenize_prompt_and_output(["Hi", "Hello, world!"], ["!", "!"], tok)
    assert out["labels"][0, -1].item() == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("prompts, outputs, error, match", [
    (["a", "b"], ["a"], ValueError, "output_strs"),
    ("abc", ["a"], TypeError, "prompt_strs"),
    (["a", 3], ["a", "b"], TypeError, r"prompt_strs\[1\]"),
    ([], [], ValueError, "prompt_strs"),
])
def test_bad_input(tokenizer, prompts, outputs, error, match):
    with pytest.raises(error, match=match):
        tokenize_prompt_and_output(prompts, outputs, tokenizer)


def test_load_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n\n" + json.dumps({"prompt": "q", "response": ""}))
    assert load_jsonl(path) == [{"prompt": "p", "response": "r"}, {"prompt": "q", "response": ""}]
    # a number or a null is refused with its line, not turned into "1" or "None"
    for bad in ({"prompt": 1, "response": "r"}, {"prompt": None, "response": "r"}, {"prompt": "p", "response": 2}):
        path.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n" + json.dumps(bad))
        with pytest.raises(ValueError, match=r"^data: line 2 of .* that is not a string"):
            load_jsonl(path, name="data")
    path.write_text(json.dumps({"prompt": "p"}))
    with pytest.raises(ValueError, match="lacks key"):
        load_jsonl(path)
    with pytest.raises(ValueError, match="no such file"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_batches_cover_the_data_each_pass():
    examples = arithmetic_sft_examples(count=12)
    batches = iterate_batches(examples, 4)
    first_pass = [e["prompt"] + e["response"] for _ in range(3) for e in next(batches)]
    assert sorted(first_pass) == sorted(e["prompt"] + e["response"] for e in examples)
    with pytest.raises(ValueError, match="batch_size"):
        next(iterate_batches(examples, 0))
    with pytest.raises(ValueError, match="batch_size: 13 is more than the 12 examples"):  # not an endless wait
        next(iterate_batches(examples, 13))
