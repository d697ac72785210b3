import torch

from logitless.models import EMBEDDED_DEFAULT, load_model_and_tokenizer, qwen_tokenizer, save_model_and_tokenizer


def test_real_qwen_vocabulary():
    tokenizer = qwen_tokenizer()
    assert tokenizer("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]
    assert tokenizer.eos_token_id == 151643 and tokenizer.pad_token_id == 151643
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [151644, 151645]
    assert len(tokenizer) == 151646
    text = "Qwen says: 12 + 30 = 42 ✓"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_embedded_default_has_full_vocabulary():
    model, tokenizer = load_model_and_tokenizer(EMBEDDED_DEFAULT)
    assert model.config.vocab_size == 151936 >= len(tokenizer)
    assert model.get_output_embeddings().weight.shape == (151936, model.config.hidden_size)


def test_save_and_load_round_trip(tmp_path, tiny_model, tokenizer):
    directory = save_model_and_tokenizer(tiny_model, tokenizer, tmp_path / "tiny")
    assert (directory / "model.safetensors").is_file()
    model, loaded_tokenizer = load_model_and_tokenizer(str(directory))  # the hub-loading code, on a local dir
    input_ids = torch.tensor([tokenizer("Hello, world!")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, tiny_model(input_ids).logits)
    assert loaded_tokenizer("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]
    assert loaded_tokenizer.eos_token_id == 151643
