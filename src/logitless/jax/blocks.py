"""The JAX backend's block sizes: `jax_block_sizes` fills the None fields of a `BlockSizes` (the class the
PyTorch ops take) with JAX's defaults for one problem.

JAX's defaults differ from PyTorch's (`logitless.ops.blocks.default_block_sizes`): a block spans
DEFAULT_VOCAB_BLOCK vocabulary columns and as many token rows as keep its fp32 logits within BLOCK_BYTES
(all of them at T=8192), at least 8.
"""

from __future__ import annotations

from logitless.ops.blocks import BlockSizes

BLOCK_BYTES = 64 * 2**20  # one block's fp32 logits, unless BlockSizes.tokens says otherwise
DEFAULT_VOCAB_BLOCK = 2048
MIN_TOKEN_BLOCK = 8


def jax_block_sizes(requested: BlockSizes, num_tokens: int, vocab_size: int) -> BlockSizes:
    """Concrete token rows and vocabulary columns per block for ``num_tokens`` tokens of a ``vocab_size`` head:
    ``requested``'s sizes, JAX's defaults where they are None, both clamped to the problem's size."""
    vocab = min(requested.vocab or DEFAULT_VOCAB_BLOCK, vocab_size)
    tokens = requested.tokens or max(MIN_TOKEN_BLOCK, BLOCK_BYTES // (4 * vocab))
    return BlockSizes(min(tokens, num_tokens), vocab)
