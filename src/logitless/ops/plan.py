"""How one call runs on the block engine: its schedule, block sizes and layout (`plan_blocks`: a `base.BlockPlan`,
one pass or two, `LOCAL` or a `vocab_shard.VocabShardLayout`). Which implementation runs it is `api.py`'s.

Per-device default block sizes (`default_block_sizes`), sized by the bytes of one block's fp32 logits:

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

import torch

from logitless._checks import switch_setting
from logitless.op_settings import BlockSizes
from logitless.ops.base import BlockPlan, Layout
from logitless.ops.head import LinearHead, stat_dtype
from logitless.ops.vocab_shard import VocabShard, VocabShardLayout

BLOCK_BYTES = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}  # two passes: one block's logits
MIN_VOCAB_BLOCK = 256  # blocks narrower than this make thin matmuls: take fewer tokens per chunk instead
# two passes on a CPU: blocks no wider than this, so that a few tokens' block temporaries (an op keeps several
# block-sized buffers) shrink with the tokens instead of filling the whole budget
MAX_VOCAB_BLOCK = {"cpu": 32768}
CHUNK_BYTES = 224 * 2**20  # one pass: a row chunk keeps at most this many bytes of logits
SINGLE_PASS_VOCAB_BLOCK = 4096
SINGLE_PASS_DEVICES = ("cpu",)  # measured faster there; GPUs keep the two passes, as TRL's head does


class _Local:
    """One process holds the whole head and its own tokens: every step of `Layout` is the identity."""

    offset = 0
    partial = False

    def swept_tokens(self, num_tokens):
        return num_tokens

    def tokens(self, hiddens, accumulator):
        return hiddens, accumulator

    def across(self, sweep) -> None:
        return None

    def own_rows(self, outputs):
        return outputs

    def every_rows(self, grad_outputs):
        return grad_outputs

    def input_grads(self, grads, dtypes):
        return grads


LOCAL: Layout = _Local()


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


def plan_blocks(num_tokens: int, head: LinearHead, device: torch.device, requested: BlockSizes = BlockSizes(),
                loss_known: bool = False) -> BlockPlan:
    """The schedule and block sizes for ``num_tokens`` tokens: ``requested`` sizes override the defaults.

    One pass when the loss is known at forward time, on a CPU, for an fp32 (or fp64) weight, unless
    ``LOGITLESS_ONE_PASS`` says otherwise (see the module docstring). A head that holds a shard of the vocabulary
    (``head.shard``) gets a `VocabShardLayout` and takes the two passes, planned alike on every rank: for
    data-parallel shards over the tokens of every rank, which the engine gathers.
    """
    layout = LOCAL if head.shard is None else _shard_layout(head.shard, num_tokens, device)
    num_tokens = layout.swept_tokens(num_tokens)
    setting = switch_setting("LOGITLESS_ONE_PASS")
    by_default = device.type in SINGLE_PASS_DEVICES and head.weight.dtype == stat_dtype(head.weight.dtype)
    single_pass = loss_known and layout is LOCAL and (setting == "1" or (setting == "auto" and by_default))
    defaults = default_block_sizes(device, head.weight.dtype, num_tokens=num_tokens, vocab_size=head.vocab_size,
                                   single_pass=single_pass, tokens=requested.tokens)
    sizes = requested.or_defaults(defaults)
    return BlockPlan(BlockSizes(max(1, min(sizes.tokens, num_tokens)), min(sizes.vocab, head.vocab_size)),
                     single_pass, layout)


def _shard_layout(shard: VocabShard, num_tokens: int, device: torch.device) -> VocabShardLayout:
    """The layout of a call on a head holding ``shard``: for data-parallel shards, with every rank's token count."""
    return VocabShardLayout(shard, tuple(shard.counts(num_tokens, device)) if shard.tokens_local else None)
