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


def test_random_qwen25_05b_has_the_published_shape():
    """Qwen2.5-0.5B: 24 layers, hidden size 896, tied embeddings, 494,032,768 parameters (built on the meta
    device: no memory, no time)."""
    from transformers import Qwen2ForCausalLM

    from logitless.models import EMBEDDED_MODELS, tiny_qwen2_config

    config = tiny_qwen2_config(**EMBEDDED_MODELS["random-qwen2.5-0.5b"])
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (24, 896, 151936)


def test_embedded_model_names_the_argument():
    import pytest

    from logitless.models import embedded_model

    with pytest.raises(ValueError, match="name: 'qwen-huge' is not an embedded model"):
        embedded_model("qwen-huge")
    assert embedded_model("tiny-qwen2", hidden_size=8).config.hidden_size == 8
