"""Small models for the GRADE tests: a byte-level tokenizer and tiny Qwen2s over its 263-token vocabulary
(a prime, so no shape lines up by accident), fast enough to compare trainers exactly."""

from logitless.models import tiny_qwen2

BYTE_VOCAB = 263  # 256 bytes, EOS/pad = 256, 6 unused ids
SMALL = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)


class ByteTokenizer:
    """Text -> its UTF-8 bytes as token ids; enough of a Hugging Face tokenizer for logitless.grade."""

    pad_token_id = eos_token_id = 256

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [self.encode(text) for text in texts]}


def byte_model(seed=0, **overrides):
    return tiny_qwen2(seed=seed, **{"vocab_size": BYTE_VOCAB, "eos_token_id": 256, "pad_token_id": 256, **SMALL,
                                    **overrides})
