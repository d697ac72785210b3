"""How the block engine cuts its work: `BlockSizes` (tokens per row chunk, vocabulary entries per block),
their per-device defaults, and the schedule (`BlockPlan`: one pass or two).

Per-device defaults (`default_block_sizes`), sized by the bytes of one block's fp32 logits:

* Two passes: a block holds up to 16 MB on a CPU (its last-level cache holds tens of MB) and 256 MB
  on a GPU (which wants matmuls of thousands of rows and columns). All tokens go in one row chunk
  when that leaves blocks at least 256 vocabulary entries wide; otherwise fewer tokens per chunk. On a
  CPU a block is at most 32,768 entries wide: an op keeps several block-sized temporaries, which for a
  few tokens would otherwise span the whole vocabulary each (more than a materialized path holds).
* One pass (by default on a CPU, for fp32 weights and a loss known at forward time; ``LOGITLESS_ONE_PASS``
  below): a row chunk keeps the logits of as many
  tokens as `CHUNK_BYTES` holds (386 tokens at a 151k vocabulary, 236 at 248k, 1835 at 32k), folded
  in blocks of 4096 vocabulary entries, which the block workers share out (`workers.py`). The budget is
  in bytes, not tokens, because what a chunk costs is its logits, and it comes from a measured curve
  (docs/BENCHMARKS.md, `logitless bench lmhead --block-tokens ...`): fewer tokens per chunk make thinner
  matmuls and more chunks, each summing into the weight's gradient once more; this budget is the least
  memory at which the step reached 0.9 of the bare matmuls' speed on a 2-core CPU. The tokens are split
  into chunks of equal size, so that no small last chunk runs thin matmuls.

``LOGITLESS_ONE_PASS`` sets which losses known at forward time take the one pass: ``auto`` (the default) as
above, ``1`` all of them on every device and dtype, ``0`` none. It is how the schedules are compared on one
machine (``LOGITLESS_ONE_PASS=1 logitless bench lmhead ...``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitless._checks import check_positive_int, switch_setting
from logitless.ops.head import LinearHead, stat_dtype

BLOCK_BYTES = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}  # two passes: one block's logits
MIN_VOCAB_BLOCK = 256  # blocks narrower than this make thin matmuls: take fewer tokens per chunk instead
# two passes on a CPU: blocks no wider than this, so that a few tokens' block temporaries (an op keeps several
# block-sized buffers) shrink with the tokens instead of filling the whole budget
MAX_VOCAB_BLOCK = {"cpu": 32768}
CHUNK_BYTES = 224 * 2**20  # one pass: a row chunk keeps at most this many bytes of logits
SINGLE_PASS_VOCAB_BLOCK = 4096
SINGLE_PASS_DEVICES = ("cpu",)  # measured faster there; GPUs keep the two passes, as TRL's head does


def _positive_int_or_none(name: str, value) -> int | None:
    return None if value is None else check_positive_int(name, value)


@dataclass(frozen=True)
class BlockSizes:
    """Tokens per row chunk and vocabulary entries per block of logits; None takes the per-device default
    (`default_block_sizes`). Larger blocks make larger matmuls and keep more logits at once."""

    tokens: int | None = None
    vocab: int | None = None

    def __post_init__(self):
        _positive_int_or_none("block_sizes.tokens", self.tokens)
        _positive_int_or_none("block_sizes.vocab", self.vocab)

    @classmethod
    def of(cls, block_sizes: BlockSizes | None) -> BlockSizes:
        """An op's ``block_sizes`` argument: a BlockSizes, or None for every default."""
        if block_sizes is None:
            return cls()
        if not isinstance(block_sizes, BlockSizes):
            raise TypeError(f"block_sizes: expected a BlockSizes, got {type(block_sizes).__name__}")
        return block_sizes

    def or_defaults(self, defaults: BlockSizes) -> BlockSizes:
        return BlockSizes(self.tokens or defaults.tokens, self.vocab or defaults.vocab)


def default_block_sizes(device: torch.device | str, dtype: torch.dtype, *, num_tokens: int, vocab_size: int,
                        single_pass: bool = False, tokens: int | None = None) -> BlockSizes:
    """The block sizes used when none are given, for ``num_tokens`` tokens of a ``vocab_size`` head whose
    logits are computed on ``device`` from inputs of ``dtype`` (see the module docstring). With ``tokens``
    (tokens per chunk chosen already) the vocabulary default fills the block for that many tokens."""
    device_type = torch.device(device).type
    logit_bytes = torch.finfo(stat_dtype(dtype)).bits // 8
    if single_pass:
        most = max(1, CHUNK_BYTES // (logit_bytes * vocab_size))
        num_chunks = max(1, -(-num_tokens // most))
        tokens = tokens or -(-num_tokens // num_chunks)  # chunks of equal size
        vocab = SINGLE_PASS_VOCAB_BLOCK
    else:
        budget = BLOCK_BYTES.get(device_type, BLOCK_BYTES["cuda"])
        tokens = tokens or max(1, min(num_tokens, budget // (logit_bytes * MIN_VOCAB_BLOCK)))
        vocab = max(MIN_VOCAB_BLOCK, budget // (logit_bytes * tokens) // 64 * 64)
        vocab = min(vocab, MAX_VOCAB_BLOCK.get(device_type, vocab))
    return BlockSizes(max(1, min(tokens, num_tokens)), min(vocab, vocab_size))


@dataclass(frozen=True)
class BlockPlan:
    sizes: BlockSizes  # concrete: tokens per row chunk, vocabulary entries per block
    single_pass: bool  # the one-pass driver: a chunk's logits are kept from its statistics to its gradient


def plan_blocks(num_tokens: int, head: LinearHead, device: torch.device, requested: BlockSizes = BlockSizes(),
                loss_known: bool = False) -> BlockPlan:
    """The schedule and block sizes for ``num_tokens`` tokens: ``requested`` sizes override the defaults.

    One pass when the loss is known at forward time, on a CPU, for an fp32 (or fp64) weight, unless
    ``LOGITLESS_ONE_PASS`` says otherwise (see the module docstring).
    """
    setting = switch_setting("LOGITLESS_ONE_PASS")
    by_default = device.type in SINGLE_PASS_DEVICES and head.weight.dtype == stat_dtype(head.weight.dtype)
    single_pass = loss_known and (setting == "1" or (setting == "auto" and by_default))
    defaults = default_block_sizes(device, head.weight.dtype, num_tokens=num_tokens, vocab_size=head.vocab_size,
                                   single_pass=single_pass, tokens=requested.tokens)
    sizes = requested.or_defaults(defaults)
    return BlockPlan(BlockSizes(max(1, min(sizes.tokens, num_tokens)), min(sizes.vocab, head.vocab_size)),
                     single_pass)
