"""The block engine's interface: BlockSizes, impl=, and every fused op running through the engine's loops."""

import dataclasses
import os
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from fused_cases import OPS, case_inputs, cross_entropy, on, outputs_and_grads
from logitless import fused_grpo_loss
from logitless.ops import BlockSizes, LinearHead, default_block_sizes
from logitless.ops import engine
from logitless.ops.base import BlockPlan
from logitless.ops.plan import LOCAL

BLOCKS = BlockSizes(tokens=5, vocab=64)  # several row chunks and vocabulary blocks on the shapes below
TRITON_RUNS_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _inputs(vocab=301):
    """Two sequences of 7 tokens, hidden size 8: several row chunks and vocabulary blocks of BLOCKS."""
    return on(case_inputs(2, 7, 8, vocab))


def _value_and_grads(op, **options):
    return outputs_and_grads(op, _inputs(), **options)


@pytest.mark.parametrize("impl", ["auto", "chunked"])
@pytest.mark.parametrize("name", OPS)
def test_each_impl_matches_the_reference(name, impl):
    want = _value_and_grads(OPS[name], impl="reference")
    for got, expected in zip(_value_and_grads(OPS[name], impl=impl, block_sizes=BLOCKS), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", OPS)
def test_a_bad_impl_is_named(name):
    with pytest.raises(ValueError, match="impl: expected one of 'auto', 'reference', 'chunked', 'triton', got 'fast'"):
        OPS[name](_inputs(), impl="fast")


@pytest.mark.skipif(TRITON_RUNS_HERE, reason="triton can run here")
@pytest.mark.parametrize("name", OPS)
def test_triton_where_it_cannot_run_is_named(name):
    with pytest.raises(ValueError, match="impl: 'triton' needs a CUDA device with triton installed .* got cpu"):
        OPS[name](_inputs(), impl="triton")


@pytest.mark.parametrize("name", OPS)
def test_every_op_runs_through_the_engine(name, monkeypatch):
    """Every op's blocks come from the engine's one loop over the vocabulary (two passes, or one for a loss
    known at forward time on CPU), and "reference" never enters it."""
    calls = []
    real_vocab_blocks = engine.vocab_blocks

    def counted(vocab_size, plan):
        calls.append(plan.sizes)
        return real_vocab_blocks(vocab_size, plan)

    monkeypatch.setattr(engine, "vocab_blocks", counted)
    _value_and_grads(OPS[name], impl="reference")
    assert calls == []
    _value_and_grads(OPS[name], impl="chunked", block_sizes=BLOCKS)
    assert calls and all(sizes == BLOCKS for sizes in calls)


class _RowMax(NamedTuple):
    max: torch.Tensor


class _RowLogSumExp(NamedTuple):
    max: torch.Tensor
    lse: torch.Tensor


class _MaxSweep:
    """A first sweep: each row's max logit."""

    def __init__(self, rows: slice):
        self.max = torch.full((rows.stop - rows.start,), float("-inf"))

    def update(self, start, logits):
        self.max = torch.maximum(self.max, logits[0].amax(dim=1))

    def finish(self):
        return _RowMax(self.max)


class _SumSweep:
    """A second sweep, measuring each block from the row's max the first sweep found."""

    def __init__(self, first: _RowMax):
        self.first, self.total = first, torch.zeros_like(first.max)

    def update(self, start, logits):
        self.total += (logits[0] - self.first.max.unsqueeze(1)).exp().sum(dim=1)

    def finish(self):
        return _RowLogSumExp(self.first.max, self.first.max + self.total.log())


@pytest.mark.parametrize("num_rows", [13, 0])
def test_a_second_sweep_starts_from_each_chunks_first_statistics(num_rows):
    """An accumulator's second sweep: a log-sum-exp in two sweeps of each row chunk (the max, then the sum of
    exp(z - max)), over several row chunks and vocabulary blocks, against torch's."""
    generator = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(num_rows, 8, generator=generator), LinearHead(torch.randn(301, 8, generator=generator))
    accumulator = SimpleNamespace(heads=(head,), sweep=_MaxSweep, second_sweep=lambda rows, first: _SumSweep(first))
    stats = engine.two_pass_stats(accumulator, (hidden,), BlockPlan(BLOCKS, single_pass=False, layout=LOCAL))
    assert isinstance(stats, _RowLogSumExp) and stats.lse.shape == (num_rows,)
    torch.testing.assert_close(stats.lse, torch.logsumexp(head.logits(hidden), dim=-1))


@pytest.mark.slow
@pytest.mark.parametrize("name", OPS)
def test_blocks_reuse_their_buffers(name):
    """A step allocates a handful of block-sized buffers, however many blocks it visits: a fresh tensor per block
    page-faults its memory in whenever the allocator has handed large blocks back to the operating system."""
    from torch.profiler import ProfilerActivity, profile

    blocks = BlockSizes(tokens=5, vocab=128)

    def allocations(vocab):
        x = _inputs(vocab)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            OPS[name](x, impl="chunked", block_sizes=blocks)[1].backward()
        block_bytes = blocks.tokens * blocks.vocab * 4
        return [event.cpu_memory_usage for event in prof.events()
                if not event.cpu_children and event.cpu_memory_usage >= block_bytes]

    few, many = allocations(1000), allocations(2000)  # 3 row chunks x 8 or 16 vocabulary blocks, visited 1 to 3 times
    # buffers (a handful per head and pass), dW and db, and the second head of the two-head ops; not one per block
    assert 0 < len(few) == len(many) <= (8 if name in ("logprobs", "cross_entropy", "grpo") else 20), (few, many)


@pytest.mark.parametrize("field, value", [("tokens", 0), ("vocab", -3), ("tokens", 2.0), ("vocab", True),
                                          ("tokens", "64")])
def test_block_sizes_are_validated_by_field(field, value):
    with pytest.raises(ValueError, match=f"block_sizes.{field}: expected a positive int, got {value!r}"):
        BlockSizes(**{field: value})


def test_block_sizes_are_frozen_and_default_to_none():
    sizes = BlockSizes(tokens=8)
    assert sizes.vocab is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.tokens = 4


def test_block_sizes_reach_the_engine_and_the_token_and_vocabulary_keywords_are_refused(monkeypatch):
    from logitless.ops import plan as blocks

    plans = []
    real_plan = blocks.plan_blocks
    for implementation in ("one_pass", "blocks"):  # the modules of the implementations that plan blocks
        monkeypatch.setattr(f"logitless.ops.{implementation}.plan_blocks",
                            lambda *a, **k: plans.append(real_plan(*a, **k)) or plans[-1])
    _value_and_grads(cross_entropy, block_sizes=BLOCKS)
    assert [plan.sizes for plan in plans] == [BLOCKS]
    for keyword, spelling in (("chunk_size", "tokens"), ("vocab_block_size", "vocab")):
        with pytest.raises(TypeError, match=rf"fused_linear_cross_entropy: keyword `{keyword}` is spelled "
                                            rf"`block_sizes=BlockSizes\({spelling}=\.\.\.\)`"):
            cross_entropy(_inputs(), **{keyword: 5})
    with pytest.raises(TypeError, match="block_sizes: expected a BlockSizes, got tuple"):
        cross_entropy(_inputs(), block_sizes=(5, 64))


def test_logitless_one_pass_sets_which_losses_take_one_pass(monkeypatch):
    from logitless.ops.plan import plan_blocks
    from logitless.ops.head import LinearHead

    fp32, bf16 = LinearHead(torch.zeros(10, 4)), LinearHead(torch.zeros(10, 4, dtype=torch.bfloat16))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def one_pass(head, device, loss_known=True):
        return plan_blocks(8, head, device, loss_known=loss_known).single_pass

    assert one_pass(fp32, cpu) and not one_pass(bf16, cpu) and not one_pass(fp32, cuda)  # auto: fp32 on a CPU
    monkeypatch.setenv("LOGITLESS_ONE_PASS", "1")
    assert one_pass(fp32, cpu) and one_pass(bf16, cpu) and one_pass(bf16, cuda)
    assert not one_pass(fp32, cpu, loss_known=False)  # a per-token output has no loss to fold in its pass
    monkeypatch.setenv("LOGITLESS_ONE_PASS", "0")
    assert not one_pass(fp32, cpu)
    monkeypatch.setenv("LOGITLESS_ONE_PASS", "yes")
    with pytest.raises(ValueError, match="LOGITLESS_ONE_PASS: expected auto, 0 or 1, got 'yes'"):
        one_pass(fp32, cpu)


def test_default_block_sizes_per_device():
    vocab = 151936
    # two passes: all 1024 tokens in one chunk, blocks of 16 MB (CPU) or 256 MB (GPU) of fp32 logits
    assert default_block_sizes("cpu", torch.float32, num_tokens=1024, vocab_size=vocab) == BlockSizes(1024, 4096)
    assert default_block_sizes("cuda", torch.bfloat16, num_tokens=1024, vocab_size=vocab) == BlockSizes(1024, 65536)
    # one pass: a chunk keeps at most CHUNK_BYTES (224 MiB) of fp32 logits, in blocks of 4096 entries; the tokens
    # go in chunks of equal size (1024 = 3 x 342 - 2 at a 151936 vocabulary, where 386 tokens fill the budget)
    assert default_block_sizes("cpu", torch.float32, num_tokens=1024, vocab_size=vocab,
                               single_pass=True) == BlockSizes(342, 4096)
    assert default_block_sizes("cpu", torch.float32, num_tokens=1024, vocab_size=248320,
                               single_pass=True) == BlockSizes(205, 4096)  # 236 fill it: 5 chunks
    assert default_block_sizes("cpu", torch.float32, num_tokens=1024, vocab_size=32000,
                               single_pass=True) == BlockSizes(1024, 4096)  # 1835 fill it: one chunk
    assert default_block_sizes("cpu", torch.float32, num_tokens=386, vocab_size=vocab,
                               single_pass=True) == BlockSizes(386, 4096)
    assert default_block_sizes("cpu", torch.float32, num_tokens=387, vocab_size=vocab,
                               single_pass=True) == BlockSizes(194, 4096)


@pytest.mark.parametrize("vocab", [1000, 32000, 151936, 248320, 1_000_003])
@pytest.mark.parametrize("num_tokens", [1, 100, 1024, 8192])
def test_the_one_pass_chunk_is_chosen_by_bytes(vocab, num_tokens):
    """A row chunk of the one-pass schedule never keeps more than CHUNK_BYTES of logits (at least one token), and
    as few chunks as that allows."""
    from logitless.ops.plan import CHUNK_BYTES

    tokens = default_block_sizes("cpu", torch.float32, num_tokens=num_tokens, vocab_size=vocab,
                                 single_pass=True).tokens
    fit = max(1, CHUNK_BYTES // (4 * vocab))
    assert tokens <= fit and -(-num_tokens // tokens) == -(-num_tokens // fit)

    # never more than there is
    assert default_block_sizes("cpu", torch.float32, num_tokens=3, vocab_size=100) == BlockSizes(3, 100)


def test_the_one_pass_blocks_shared_out_among_threads_give_the_same_bits_whoever_takes_them():
    """The one-pass schedule's blocks run on worker threads (`ops/workers.py`): each block's statistics on their
    own, merged in block order, so two runs, and a run whose threads take the blocks in the opposite order, give
    the same bits; a run on one thread gives the same up to the rounding of dh, one matmul of the whole chunk whose
    sum over the vocabulary the math library may split by the thread count; the workers leave the process's thread
    count as it was."""
    import threading

    from logitless.ops import workers

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 40, 16, generator=generator).requires_grad_()
    weight = (torch.randn(5003, 16, generator=generator) * 0.1).requires_grad_()
    ids, advantages = torch.randint(0, 5003, (2, 40), generator=generator), torch.randn(2, generator=generator)
    threads = torch.get_num_threads()

    def run(num_threads):
        torch.set_num_threads(num_threads)
        try:
            hidden.grad = weight.grad = None
            loss, metrics = fused_grpo_loss(hidden, weight, ids, torch.ones(2, 40), advantages, beta=0.0,
                                            block_sizes=BlockSizes(tokens=30, vocab=512))
            loss.backward()
        finally:
            torch.set_num_threads(threads)
        return [loss.detach(), hidden.grad, weight.grad], metrics

    def backwards(self, fn, items):  # the last block handed out first: each block goes to another thread
        return list(self.pool.map(fn, list(items)[::-1]))[::-1]

    calls, real = [], workers.BlockWorkers.map
    workers.BlockWorkers.map = lambda self, fn, items: calls.append(1) or real(self, fn, items)
    try:
        first, again, alone = run(2), run(2), run(1)
        workers.BlockWorkers.map = backwards
        reversed_order = run(2)
    finally:
        workers.BlockWorkers.map = real
    assert calls  # the threads ran blocks
    for other in (again, reversed_order):
        assert all(torch.equal(a, b) for a, b in zip(first[0], other[0])) and first[1] == other[1]
    for a, b in zip(first[0], alone[0]):  # a sum over 5003 entries, rounded in fp32
        torch.testing.assert_close(b, a, rtol=0, atol=5003**0.5 * torch.finfo(torch.float32).eps * a.abs().max().item())
    assert first[1] == pytest.approx(alone[1], rel=1e-6)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert torch.get_num_threads() == threads and seen == [threads]


def _cap_before_scale(self, raw):
    """`LinearHead.finish_` with the soft cap applied before the logit scale."""
    if self.softcap is not None:
        raw = torch.tanh(raw / self.softcap) * self.softcap
    return raw * self.logit_scale / self.temperature


def _temperature_before_cap(self, raw):
    """`LinearHead.finish_` with the temperature applied before the soft cap."""
    raw = raw * self.logit_scale / self.temperature
    return raw if self.softcap is None else torch.tanh(raw / self.softcap) * self.softcap


@pytest.mark.parametrize("wrong", [_cap_before_scale, _temperature_before_cap], ids=lambda f: f.__name__)
def test_the_oracle_catches_a_head_transform_in_the_wrong_order(wrong, monkeypatch):
    """The engine's and the device tests' oracle (``impl="reference"``) builds its logits from the head's fields
    (`reference.head_logits`), sharing no code with `LinearHead.logits`, which the engine runs: a transform of the
    head applied in the wrong order fails both tests (with the oracle on `LinearHead.logits` they passed)."""
    import test_devices

    from logitless.ops.head import LinearHead

    monkeypatch.setattr(LinearHead, "finish_", wrong)
    x = _inputs()
    fused, oracle = (OPS["kl"](x, impl=impl, block_sizes=BLOCKS)[0][0] for impl in ("chunked", "reference"))
    assert not torch.allclose(fused, oracle, rtol=1e-3, atol=1e-3)  # the values alone show it, not only gradients
    with pytest.raises(AssertionError):
        test_each_impl_matches_the_reference("kl", "chunked")
    with pytest.raises(AssertionError):
        test_devices.test_fused_op_on_this_device_matches_the_fp64_oracle("kl", "auto", torch.float32, "cpu",
                                                                          monkeypatch)
