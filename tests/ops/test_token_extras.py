"""The statistics without gradient of `linear_token_stats(..., extras=...)` (log sum p^2, the mean logit, whether
the target is the first argmax) against the materialized oracle in fp64 and TRL's own ChunkedLogProbFunction:
odd shapes (N not a multiple of the row chunk, V prime), -inf logits, soft cap, logit scale, bias, temperature,
ties, masked tokens, bf16 inputs. The Triton twin is checked in tests/ops/test_triton.py."""

import pytest
import torch
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

from logitless.ops import BlockSizes, LinearHead, reference, softmax
from logitless.ops.fused import linear_token_stats

EXTRAS = ("log_sum_sq_probs", "mean_logits", "is_top1")
BLOCKS = BlockSizes(tokens=5, vocab=64)  # 37 rows: 8 chunks, the last of 2; 1009 columns: 16 blocks, the last of 49


def _head(weight, bias, options, dtype=None):
    dtype = dtype or weight.dtype
    return LinearHead(weight.to(dtype), bias=None if bias is None else bias.to(dtype),
                      temperature=options["temperature"], softcap=options["softcap"],
                      logit_scale=options["logit_scale"])


def _random_case(n=37, hidden_size=8, vocab=1009, seed=0, neg_inf=True):
    """hidden (n, H), weight (V, H), bias with -inf on padded rows, and targets: a third of them the argmax."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 0.8
    bias = torch.randn(vocab, generator=generator)
    if neg_inf:
        bias[3::7] = float("-inf")
    targets = torch.randint(0, vocab, (n,), generator=generator)
    targets[::3] = (hidden[::3] @ weight.T + bias).argmax(dim=1)
    if neg_inf:
        targets[targets % 7 == 3] += 1
    return hidden, weight, bias, targets


def _integer_case(seed=0):
    """Small integer hidden states and weights, so that every logit is an exact integer and ties abound; targets
    include the first of tied maxima (top 1) and a later one (not top 1), tied columns in different blocks."""
    generator = torch.Generator().manual_seed(seed)
    vocab = 257
    hidden = torch.randint(-1, 2, (41, 2), generator=generator).float()
    weight = torch.randint(-1, 2, (vocab, 2), generator=generator).float()
    bias = torch.zeros(vocab)
    bias[5::11] = float("-inf")
    logits = hidden @ weight.T + bias
    maxima = [(row == row.max()).nonzero().squeeze(1) for row in logits]
    assert min(len(m) for m in maxima) > 1  # every row has tied maxima
    targets = torch.stack([m[index % 3 if index % 3 < len(m) else 0] for index, m in enumerate(maxima)])
    targets[::4] = torch.randint(0, vocab, (len(targets[::4]),), generator=generator)
    targets[targets % 11 == 5] += 1
    return hidden, weight, bias, targets


def _oracle(hidden, weight, bias, targets, options):
    """fp64 materialized extras, log-probs and entropy."""
    logits = _head(weight, bias, options, torch.float64).logits(hidden.double())
    extras = reference.token_extras(logits, targets)
    log_probs, entropy = reference.logprobs_from_logits(logits, targets, return_token_entropy=True)
    return log_probs, entropy, extras


def _trl(hidden, weight, bias, targets, options, chunk_size=100):
    """TRL 1.16's fused head on the same inputs: (log_probs, entropy, {extras})."""
    log_probs, entropy, *extras = ChunkedLogProbFunction.apply(
        hidden, weight, bias, targets, options["temperature"], chunk_size, options["softcap"], options["logit_scale"],
        ("entropy", *EXTRAS))
    return log_probs, entropy, dict(zip(EXTRAS, extras))


OPTIONS = [dict(temperature=1.0, softcap=None, logit_scale=1.0), dict(temperature=0.7, softcap=None, logit_scale=1.3),
           dict(temperature=1.2, softcap=3.0, logit_scale=0.8)]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "scale_temperature", "softcap"])
@pytest.mark.parametrize("block_sizes", [BLOCKS, None], ids=["blocks", "default"])
def test_extras_match_the_fp64_oracle(options, block_sizes):
    hidden, weight, bias, targets = _random_case()
    log_probs, entropy, _, extras = linear_token_stats(hidden, targets=targets,
                                                       head=_head(weight, bias, options), extras=EXTRAS,
                                                       block_sizes=block_sizes, impl="chunked")
    want_log_probs, want_entropy, want = _oracle(hidden, weight, bias, targets, options)
    assert extras["log_sum_sq_probs"].dtype == extras["mean_logits"].dtype == torch.float32
    assert extras["is_top1"].dtype == torch.bool
    torch.testing.assert_close(extras["log_sum_sq_probs"].double(), want["log_sum_sq_probs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(extras["mean_logits"].double(), want["mean_logits"], rtol=1e-5, atol=1e-6)
    assert torch.equal(extras["is_top1"], want["is_top1"])
    assert 0 < int(extras["is_top1"].sum()) < len(targets)
    if options["softcap"] is None:  # a -inf bias makes -inf logits, whose mean is -inf
        assert torch.isneginf(extras["mean_logits"]).all()
    torch.testing.assert_close(log_probs.double(), want_log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=1e-5, atol=1e-5)


def test_ties_pick_the_first_argmax_as_the_oracle_and_trl_do():
    hidden, weight, bias, targets = _integer_case()
    for options in OPTIONS:
        *_, extras = linear_token_stats(hidden, targets=targets, head=_head(weight, bias, options), extras=("is_top1",),
                                        block_sizes=BlockSizes(tokens=6, vocab=16), impl="chunked")
        want = _oracle(hidden, weight, bias, targets, options)[2]["is_top1"]
        assert torch.equal(extras["is_top1"], want)
        assert torch.equal(extras["is_top1"], _trl(hidden, weight, bias, targets, options, chunk_size=50)[2]["is_top1"])
        assert 0 < int(want.sum()) < len(want) - len(want[::4])  # some tied targets count, some do not


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "scale_temperature", "softcap"])
def test_extras_match_trls_fused_head_on_kept_tokens(options):
    """TRL scores the positions whose label is not -100, as logitless's seam does: the kept rows of (B, T)."""
    hidden, weight, bias, targets = _random_case(n=60, vocab=997, seed=1, neg_inf=False)
    hidden, labels = hidden.reshape(3, 20, -1), targets.reshape(3, 20).clone()
    labels[0, :7], labels[2, 15:] = -100, -100
    kept = labels != -100
    kept_hidden, kept_labels = hidden[kept], labels[kept]  # (K, H), (K,)
    log_probs, entropy, _, extras = linear_token_stats(kept_hidden, targets=kept_labels,
                                                       head=_head(weight, bias, options),
                                                       extras=EXTRAS, block_sizes=BLOCKS, impl="chunked")
    trl_log_probs, trl_entropy, trl_extras = _trl(kept_hidden, weight, bias, kept_labels, options)
    for got, want in ((log_probs, trl_log_probs), (entropy, trl_entropy),
                      *((extras[name], trl_extras[name]) for name in ("log_sum_sq_probs", "mean_logits"))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(extras["is_top1"], trl_extras["is_top1"]) and extras["is_top1"].any()


def test_extras_carry_no_gradient_and_leave_the_other_statistics_as_they_were():
    hidden, weight, bias, targets = _random_case(seed=2)
    options = OPTIONS[2]
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    head = _head(leaves[1], leaves[2], options)
    plain = linear_token_stats(leaves[0], targets=targets, head=head, block_sizes=BLOCKS, impl="chunked")
    log_probs, entropy, mean_log_prob, extras = linear_token_stats(leaves[0], targets=targets, head=head, extras=EXTRAS,
                                                                   block_sizes=BLOCKS, impl="chunked")
    assert len(plain) == 3 and set(extras) == set(EXTRAS)
    assert not any(value.requires_grad for value in extras.values())
    for got, want in zip((log_probs, entropy, mean_log_prob), plain):
        assert torch.equal(got, want)
    upstream = torch.randn(len(targets), generator=torch.Generator().manual_seed(3))
    for got, want in zip(torch.autograd.grad(((log_probs + entropy) * upstream).sum(), leaves),
                         torch.autograd.grad(((plain[0] + plain[1]) * upstream).sum(), leaves)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("keep", [None, "logits", "weights"])
def test_the_block_math_keeps_the_extras_however_a_block_is_kept(keep):
    """`softmax.update_stats` of the two-pass schedule (keep=None) and of the one-pass schedule (a block kept as
    its logits or its exponentials): the same extras, against the oracle."""
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(9, 300, generator=generator) * 3
    logits[:, 7::13] = float("-inf")
    targets = torch.randint(0, 300, (9,), generator=generator)
    targets[::2] = logits[::2].argmax(dim=1)
    targets[targets % 13 == 7] += 1
    online = softmax.OnlineSoftmax(9, torch.float32, logits.device, need_entropy=True, need_logit_sum=True,
                                  need_square_total=True, need_top1=True)
    for start in range(0, 300, 64):
        softmax.update_stats(online, logits[:, start:start + 64].clone(), start, targets, True, keep=keep)
    stats, want = online.result(300), reference.token_extras(logits.double(), targets)
    torch.testing.assert_close(stats.log_sum_sq_probs.double(), want["log_sum_sq_probs"], rtol=1e-5, atol=1e-6)
    assert torch.isneginf(stats.mean_logits).all()
    assert torch.equal(stats.is_top1, want["is_top1"]) and bool(stats.is_top1[::2].all())


def test_bf16_inputs_give_fp32_statistics():
    hidden, weight, bias, targets = _random_case(seed=4)
    options = OPTIONS[1]
    low = [t.bfloat16() for t in (hidden, weight, bias)]
    *_, extras = linear_token_stats(low[0], targets=targets, head=_head(low[1], low[2], options), extras=EXTRAS,
                                    block_sizes=BLOCKS, impl="chunked")
    want = _oracle(*(t.double() for t in low), targets, options)[2]  # the same bf16 values, materialized in fp64
    assert extras["log_sum_sq_probs"].dtype == extras["mean_logits"].dtype == torch.float32
    torch.testing.assert_close(extras["log_sum_sq_probs"].double(), want["log_sum_sq_probs"], rtol=1e-5, atol=1e-5)
    assert torch.equal(extras["is_top1"], want["is_top1"])


def test_no_tokens():
    _, weight, bias, _ = _random_case()
    no_ids = torch.zeros(0, dtype=torch.long)
    *_, extras = linear_token_stats(torch.zeros(0, 8), targets=no_ids,
                                    head=_head(weight, bias, OPTIONS[0]), extras=EXTRAS,
                                    impl="chunked")
    assert all(value.shape == (0,) for value in extras.values())


@pytest.mark.parametrize("extras, error, message", [
    (("top1",), ValueError, r"extras\[0\]: expected one of 'log_sum_sq_probs', 'mean_logits', 'is_top1', got 'top1'"),
    ("is_top1", TypeError, "extras: expected a list of strings, got str"),
    ((None,), TypeError, r"extras\[0\]: expected a string"),
])
def test_bad_extras_are_named(extras, error, message):
    hidden, weight, bias, targets = _random_case(n=4, vocab=11)
    with pytest.raises(error, match=message):
        linear_token_stats(hidden, targets=targets, head=_head(weight, bias, OPTIONS[0]), extras=extras)
