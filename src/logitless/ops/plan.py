"""How one op call runs: its implementation (`implementation`, the registry behind every op's ``impl``), and for
the block engine its schedule, block sizes and layout (`plan_blocks`: a `base.BlockPlan`, one pass or two, `LOCAL`
or a `vocab_shard.VocabShardLayout`).

Implementations (`IMPLEMENTATIONS`, one for each value of ``impl`` in `logitless._checks.IMPLS` but "auto"):

* ``"reference"``: the materialized oracle (`ops/reference.py`), the whole (N, V) logits;
* ``"chunked"``: the block engine with the PyTorch block math of the op's accumulator module (`softmax.py`,
  `kl.py`, `jsd.py`);
* ``"triton"``: the block engine with the Triton kernels of `triton.py`, on CUDA (or anywhere under
  ``TRITON_INTERPRET=1``) for fp32 block logits.

``"auto"`` takes the first usable of `AUTO_ORDER`: Triton on CUDA for fp32 block logits where triton works,
the PyTorch blocks everywhere else. ``LOGITLESS_TRITON`` sets what "auto" picks: ``0`` turns Triton off; ``1``
asks for it wherever it can run (with TRITON_INTERPRET=1 that includes the CPU, which is how the tests check
the kernels end to end).

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

import dataclasses
import os
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

from logitless._checks import check_impl, switch_setting
from logitless.ops.base import BlockPlan, Layout
from logitless.ops.fallback import FallingBack, failed_on
from logitless.ops.head import LinearHead, stat_dtype
from logitless.op_settings import BlockSizes
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


@dataclass(frozen=True)
class Implementation:
    """One way to run the ops (one of `IMPLEMENTATIONS`): materialize the logits, or run the block engine with a
    block math."""

    name: str
    materializes: bool = False  # the whole (N, V) logits, through the oracles of `reference.py`
    triton: bool = False  # the block math of `triton.py`, instead of the accumulator module's own
    falls_back: bool = False  # chosen by "auto": a kernel that cannot run here gives way to the PyTorch blocks

    def unusable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this implementation cannot run blocks of ``dtype`` statistics on ``device`` (None: it can)."""
        if not self.triton:
            return None
        from logitless.ops import triton as triton_kernels

        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if not triton_kernels.available() or not (device.type == "cuda" or interpreted):
            return (f"'triton' needs a CUDA device with triton installed (or TRITON_INTERPRET=1), got {device.type}"
                    f"{'' if triton_kernels.triton is not None else ' without triton'}")
        if dtype != torch.float32:
            return f"'triton' runs fp32 block logits (float32, bfloat16 or float16 inputs), got {dtype} statistics"
        return None

    def kernels(self, pytorch: SimpleNamespace) -> SimpleNamespace | ModuleType:
        """The block math an accumulator runs: ``pytorch`` (the ``PYTORCH_BLOCKS`` of its module: `softmax`, `kl`,
        `jsd`) or the module `triton`, which has every function of theirs (behind `fallback.FallingBack` when "auto"
        chose it)."""
        if not self.triton:
            return pytorch
        from logitless.ops import triton as triton_kernels

        return FallingBack(triton_kernels, pytorch) if self.falls_back else triton_kernels


IMPLEMENTATIONS = {implementation.name: implementation for implementation in (
    Implementation("reference", materializes=True), Implementation("chunked"), Implementation("triton", triton=True))}
AUTO_ORDER = ("triton", "chunked")  # what "auto" tries, first usable wins


def implementation(impl: str, device: torch.device, dtype: torch.dtype) -> Implementation:
    """The implementation that runs an op for ``impl`` on ``device`` with ``dtype`` statistics: the one named, or for
    "auto" the first usable of `AUTO_ORDER` (Triton only on CUDA, or wherever ``LOGITLESS_TRITON=1`` asks for it,
    and not on a device where a kernel failed: `fallback`). A named one that cannot run here is a ValueError naming
    ``impl``."""
    check_impl(impl)
    if impl != "auto":
        reason = IMPLEMENTATIONS[impl].unusable(device, dtype)
        if reason is not None:
            raise ValueError(f"impl: {reason}")
        return IMPLEMENTATIONS[impl]
    setting = switch_setting("LOGITLESS_TRITON")
    for name in AUTO_ORDER:
        chosen = IMPLEMENTATIONS[name]
        wanted = not chosen.triton or setting == "1" or (setting == "auto" and device.type == "cuda")
        if not wanted or chosen.unusable(device, dtype) is not None:
            continue
        if not chosen.triton:
            return chosen
        if failed_on(device) is None:
            return dataclasses.replace(chosen, falls_back=True)
    raise AssertionError("the PyTorch blocks run everywhere")
