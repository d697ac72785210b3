"""`logitless bench distributed` as a user runs it: its collectives counted on 2 and 4 CPU ranks, against the byte
count (`moved_bytes`) by which the ops choose between gathering the head and the vocabulary-parallel step; its peak,
a count of the tensors a step allocates that is the same on every run; its step times."""

import json
import subprocess
import sys

import pytest
import torch

from logitless.bench.allocated import AllocatedPeak
from logitless.bench.distributed import Step, computed
from logitless.ops import fused_linear_logprobs
from logitless.ops.sharded import moved_bytes

TOKENS, HIDDEN, VOCAB = 48, 64, 4096


@pytest.mark.distributed
def test_counted_collectives_equal_the_byte_count_the_ops_choose_by(tmp_path):
    report_path = tmp_path / "distributed.json"
    done = subprocess.run([sys.executable, "-m", "logitless", "bench", "distributed", "--ranks", "2", "4",
                           "--tokens", str(TOKENS), "--hidden", str(HIDDEN), "--vocab", str(VOCAB),
                           "--repeats", "2", "--json", str(report_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vocab-parallel: sent GB" in done.stdout and "gather wins past" in done.stdout
    assert "peak/rank MB  step ms x gather" in done.stdout
    report = json.loads(report_path.read_text())
    for ranks in (2, 4):
        rows = report["measured"][str(ranks)]
        moved = rows["computed"]["moved_bytes"]
        assert all(rows[way]["same_on_every_rank"] for way in ("gather", "vocab_parallel", "tensor_parallel"))
        # the peak: gathering holds the whole weight and its whole gradient at once; logitless holds neither
        peaks = {way: rows[way]["peak_bytes_per_rank"] for way in ("gather", "vocab_parallel", "tensor_parallel")}
        assert min(peaks["gather"]) >= 2 * VOCAB * HIDDEN * 4, peaks
        assert 0 < max(peaks["vocab_parallel"] + peaks["tensor_parallel"]) < min(peaks["gather"]) / 2, peaks
        # each way timed: the median of each repeat's slowest rank, and its ratio to gathering's
        for way in ("gather", "vocab_parallel", "tensor_parallel"):
            times = rows[way]["step_seconds_per_repeat"]
            assert len(times) == 2 and rows[way]["step_seconds"] == sum(times) / 2 > 0
            assert rows[way]["time_x_gather"] == rows[way]["step_seconds"] / rows["gather"]["step_seconds"]
        # gathering: the whole weight in, its whole gradient out, nothing else
        assert sorted(map(tuple, rows["gather"]["collectives"])) == [("all_gather", VOCAB * HIDDEN * 4),
                                                                     ("reduce_scatter", VOCAB * HIDDEN * 4)]
        assert moved["gather"] == 2 * VOCAB * HIDDEN * 4
        # vocabulary-parallel: every rank's hidden states in, their fp32 gradient out, and O(tokens) numbers more
        hidden_bytes = ranks * TOKENS * HIDDEN * 4
        sizes = sorted(size for _, size in rows["vocab_parallel"]["collectives"])
        assert ["reduce_scatter", hidden_bytes] in rows["vocab_parallel"]["collectives"]
        assert ["all_gather", hidden_bytes] in rows["vocab_parallel"]["collectives"]
        assert moved["vocab_parallel"] == 2 * hidden_bytes
        assert sum(sizes) - 2 * hidden_bytes <= ranks * ranks * TOKENS * 64  # the softmax's sums and counts
        assert max(sizes) < VOCAB * HIDDEN * 4 // ranks  # nothing near the size of the weight moves
        # tensor parallelism: the tokens are everywhere already; the hidden states' gradient is summed
        assert not any(kind == "reduce_scatter" for kind, _ in rows["tensor_parallel"]["collectives"])
        assert max(size for _, size in rows["tensor_parallel"]["collectives"]) == hidden_bytes


def test_the_peak_is_the_tensors_a_step_allocates_and_holds_at_once_the_same_on_every_run():
    """The resident set's growth over a step differed between runs of the same step (and read 0 where the step reused
    pages); the peak of the tensors the step allocated does not, and it sees a step's (N, V) logits."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=generator, requires_grad=True)
    weight = torch.randn(1000, 32, generator=generator, requires_grad=True)
    targets = torch.randint(0, 1000, (64,), generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of the bench runs: the blocks on this thread (block workers' are unseen)
    try:
        peaks = {}
        for impl in ("reference", "auto", "reference", "auto"):
            hidden.grad = weight.grad = None
            with AllocatedPeak() as allocated:
                fused_linear_logprobs(hidden, weight, targets, impl=impl).sum().backward()
            assert allocated.held_bytes == (hidden.numel() + weight.numel()) * 4  # the gradients stay, nothing else
            peaks.setdefault(impl, set()).add(allocated.peak_bytes)
    finally:
        torch.set_num_threads(threads)
    assert len(peaks["reference"]) == len(peaks["auto"]) == 1, peaks
    logits = 64 * 1000 * 4
    assert peaks["reference"].pop() >= 2 * logits + weight.numel() * 4 > peaks["auto"].pop(), logits


def test_crossover_is_where_gathering_starts_to_move_less():
    step = Step(tokens=8192, hidden=4096, vocab=151936, dtype="bfloat16", ranks=8)
    crossover = computed(step)["crossover_tokens_per_rank"]
    for tokens_per_rank, gather_cheaper in ((int(crossover) - 1, False), (int(crossover) + 1, True)):
        moved = moved_bytes(tokens_per_rank * 8, 4096, 151936, 2, 2)
        assert (moved["gather"] < moved["vocab_parallel"]) == gather_cheaper
    fp32 = computed(Step(tokens=1, hidden=64, vocab=4096, dtype="float32", ranks=4))
    assert fp32["crossover_tokens_per_rank"] == 4096 / 4  # fp32: tokens x P > V


@pytest.mark.parametrize("options, message", [
    (["--ranks", "3"], "--ranks: each must be at least 2 and divide --vocab (32768), got 3"),
    (["--at", "8192,4096,151936,fp8,8"], "--at: expected TOKENS,H,V,DTYPE,RANKS"),
    (["--tokens", "0"], "--tokens"),
])
def test_bad_options_are_one_line_naming_the_option(options, message):
    done = subprocess.run([sys.executable, "-m", "logitless", "bench", "distributed", *options],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
