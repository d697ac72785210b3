"""The JAX backend's block sizes: `jax_block_sizes` fills the None fields of a `BlockSizes` (the class the
PyTorch ops take) with JAX's defaults for one problem, and cuts a block into each device's part of it when the
tokens or the vocabulary are sharded over a mesh.

JAX's defaults differ from PyTorch's (`logitless.ops.plan.default_block_sizes`): a block spans
DEFAULT_VOCAB_BLOCK vocabulary columns and as many token rows as keep its fp32 logits within BLOCK_BYTES
(all of them at T=8192), at least 8. Sharded, a block of ``tokens x vocab`` is shared by the devices as the
arrays are: each folds ``tokens / token shards`` of its own rows and ``vocab / vocabulary shards`` of its own
columns, so the step runs as many blocks as on one device and each device holds its share of one.

The one-pass schedule (`engine.one_pass`, a loss on a CPU with an fp32 weight) keeps a token block's logits over
the whole vocabulary: as PyTorch's does, it takes as many tokens as ONE_PASS_BYTES of fp32 logits hold, at least
ONE_PASS_TOKENS, the tokens split into blocks of equal size (no thin last block).
"""

from __future__ import annotations

from logitless.op_settings import BlockSizes

BLOCK_BYTES = 64 * 2**20  # one block's fp32 logits, unless BlockSizes.tokens says otherwise
DEFAULT_VOCAB_BLOCK = 2048
MIN_TOKEN_BLOCK = 8
ONE_PASS_BYTES = 112 * 2**20  # one pass: a token block's logits over the whole vocabulary...
ONE_PASS_TOKENS = 192  # ...or this many tokens' logits where that is more


def _ceil_div(length: int, parts: int) -> int:
    return -(-length // parts)


def jax_block_sizes(requested: BlockSizes, num_tokens: int, vocab_size: int, token_shards: int = 1,
                    vocab_shards: int = 1) -> BlockSizes:
    """Concrete token rows and vocabulary columns per block, on each device, for ``num_tokens`` tokens of a
    ``vocab_size`` head split into ``token_shards`` and ``vocab_shards`` equal shards: ``requested``'s sizes, JAX's
    defaults where they are None, each device's part of them, clamped to its shard."""
    vocab = min(requested.vocab or DEFAULT_VOCAB_BLOCK, vocab_size)
    tokens = min(requested.tokens or max(MIN_TOKEN_BLOCK, BLOCK_BYTES // (4 * vocab)), num_tokens)
    local_tokens, local_vocab = num_tokens // token_shards, vocab_size // vocab_shards
    return BlockSizes(max(1, min(_ceil_div(tokens, token_shards), local_tokens)),
                      min(_ceil_div(vocab, vocab_shards), local_vocab))


def one_pass_block_sizes(requested: BlockSizes, num_tokens: int, vocab_size: int) -> BlockSizes:
    """Token rows and vocabulary columns per block of the one-pass schedule: ``requested``'s sizes, the defaults
    above where they are None."""
    most = max(ONE_PASS_TOKENS, ONE_PASS_BYTES // (4 * vocab_size))
    tokens = requested.tokens or _ceil_div(num_tokens, max(1, _ceil_div(num_tokens, most)))  # blocks of equal size
    return BlockSizes(max(1, min(tokens, num_tokens)), min(requested.vocab or DEFAULT_VOCAB_BLOCK, vocab_size))
