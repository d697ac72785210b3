"""fused_linear_logprobs / fused_linear_cross_entropy against the materialized oracles."""

import pytest
import torch
import torch.nn.functional as F

from logitless import compute_entropy, fused_linear_cross_entropy, fused_linear_logprobs
from logitless.ops import BlockSizes
from logitless.ops.reference import cross_entropy, linear_logits, linear_logprobs

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5)}


def _inputs(n, h, v, dtype=torch.float32, bias=True, batch=None):
    shape = (batch, n // batch, h) if batch else (n, h)
    hidden = (torch.randn(*shape) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h) * 0.5).to(dtype).requires_grad_()
    bias_t = (torch.randn(v) * 0.1).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, shape[:-1])
    return hidden, weight, bias_t, targets


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_values_and_grads(dtype, temperature):
    # N=3*29=87 rows is not a multiple of the chunk (16); V=1009 is prime; entropy enters the loss.
    # bf16 is judged against the fp32 oracle on the same (bf16-rounded) inputs, relative to each
    # tensor's scale: the materialized bf16 path is itself further from it than the fused one.
    hidden, weight, bias, targets = _inputs(87, 24, 1009, dtype, batch=3)
    mask = torch.rand(targets.shape) > 0.3
    up_logp, up_entropy = torch.randn(targets.shape), torch.randn(targets.shape)
    inputs = (hidden, weight, bias)
    oracle_inputs = [t.detach().float().requires_grad_() for t in inputs]

    log_probs, entropy = fused_linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                               return_token_entropy=True, block_sizes=BlockSizes(tokens=16), mask=mask)
    ref_log_probs, ref_entropy = linear_logprobs(*oracle_inputs[:2], targets, bias=oracle_inputs[2],
                                                 temperature=temperature, return_token_entropy=True)
    ref_log_probs, ref_entropy = ref_log_probs * mask, ref_entropy * mask
    assert log_probs.dtype == entropy.dtype == torch.float32
    got = [log_probs, entropy, *_grads((log_probs * up_logp + entropy * up_entropy).sum(), inputs)]
    want = [ref_log_probs, ref_entropy,
            *_grads((ref_log_probs * up_logp + ref_entropy * up_entropy).sum(), oracle_inputs)]
    for grad, tensor in zip(got[2:], inputs):
        assert grad.dtype == tensor.dtype
    for g, w in zip(got, want):
        if dtype == torch.float32:
            _close(g, w, dtype)
        else:
            torch.testing.assert_close(g.float(), w, atol=2e-2 * w.abs().max().item(), rtol=0)


def test_masked_tokens_get_zero_and_no_gradient():
    hidden, weight, _, targets = _inputs(10, 8, 31, bias=False)
    mask = torch.zeros(10, dtype=torch.bool)
    mask[3] = True
    log_probs = fused_linear_logprobs(hidden, weight, targets, mask=mask)
    assert (log_probs[~mask] == 0).all() and log_probs[3] < 0
    (grad_hidden,) = torch.autograd.grad(log_probs.sum(), hidden)
    assert (grad_hidden[~mask] == 0).all() and grad_hidden[3].abs().sum() > 0


@pytest.mark.parametrize("softcap", [None, 0.7])
def test_gradcheck_float64(softcap):
    hidden, weight, bias, targets = _inputs(7, 3, 11, torch.float64)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)

    def both(h, w, b):
        return fused_linear_logprobs(h, w, targets, bias=b, temperature=0.8, return_token_entropy=True,
                                     block_sizes=BlockSizes(3, 4), mask=mask, softcap=softcap, logit_scale=1.3)

    assert torch.autograd.gradcheck(both, (hidden, weight, bias))

    def cross(h, w, b):
        return fused_linear_cross_entropy(h, w, targets, bias=b, label_smoothing=0.1, block_sizes=BlockSizes(3, 4),
                                          softcap=softcap)

    assert torch.autograd.gradcheck(cross, (hidden, weight, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcapped_logits_values_and_grads(dtype):
    # logits of std ~3 against a cap of 2: most rows sit on the tanh's bend, where the cap matters
    hidden, weight, bias, targets = _inputs(45, 16, 509, dtype, batch=3)
    inputs, oracle_inputs = (hidden, weight, bias), [t.detach().float().requires_grad_()
                                                     for t in (hidden, weight, bias)]
    log_probs, entropy = fused_linear_logprobs(hidden, weight, targets, bias=bias, temperature=0.8,
                                               return_token_entropy=True, block_sizes=BlockSizes(tokens=8), softcap=2.0)
    ref_log_probs, ref_entropy = linear_logprobs(*oracle_inputs[:2], targets, bias=oracle_inputs[2], temperature=0.8,
                                                 return_token_entropy=True, softcap=2.0)
    uncapped = linear_logprobs(*oracle_inputs[:2], targets, bias=oracle_inputs[2], temperature=0.8)[0]
    assert (uncapped - ref_log_probs).abs().max() > 0.5  # the cap changes the answer
    cross = fused_linear_cross_entropy(hidden, weight, targets, bias=bias, label_smoothing=0.1, softcap=2.0)
    ref_cross = cross_entropy(linear_logits(*oracle_inputs, softcap=2.0), targets, label_smoothing=0.1)
    got = [log_probs, entropy, cross, *_grads((log_probs - 0.5 * entropy).sum() + cross, inputs)]
    want = [ref_log_probs, ref_entropy, ref_cross,
            *_grads((ref_log_probs - 0.5 * ref_entropy).sum() + ref_cross, oracle_inputs)]
    for g, w in zip(got, want):
        if dtype == torch.float32:
            _close(g, w, dtype)
        else:
            torch.testing.assert_close(g.float(), w, atol=2e-2 * w.abs().max().item(), rtol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
def test_cross_entropy_matches_torch(reduction, label_smoothing):
    hidden, weight, bias, targets = _inputs(45, 16, 257)
    targets[::4] = -100
    loss = fused_linear_cross_entropy(hidden, weight, targets, bias=bias, reduction=reduction,
                                      label_smoothing=label_smoothing, block_sizes=BlockSizes(tokens=8))
    expected = cross_entropy(linear_logits(hidden, weight, bias), targets, reduction=reduction,
                             label_smoothing=label_smoothing)
    _close(loss, expected, torch.float32)
    upstream = torch.randn(loss.shape)
    for g, w in zip(_grads((loss * upstream).sum(), (hidden, weight, bias)),
                    _grads((expected * upstream).sum(), (hidden, weight, bias))):
        _close(g, w, torch.float32)


def test_cross_entropy_of_nothing_is_nan_with_zero_gradients_like_torch():
    # all labels ignored: PyTorch's loss is NaN and its gradients 0; NaN gradients for the whole weight would
    # make it all NaN in one optimizer step
    hidden, weight, bias, targets = _inputs(4, 3, 5)
    targets[:] = -100
    loss = fused_linear_cross_entropy(hidden, weight, targets, bias=bias)
    expected = F.cross_entropy(hidden @ weight.T + bias, targets)
    assert torch.isnan(loss) and torch.isnan(expected)
    for got, want in zip(_grads(loss, (hidden, weight, bias)), _grads(expected, (hidden, weight, bias))):
        assert torch.equal(got, torch.zeros_like(got)) and torch.equal(want, torch.zeros_like(want))


def test_neg_inf_bias_is_exact_in_entropy_and_its_gradient():
    # a vocabulary padded with -inf bias rows: p = 0 there and 0 * log 0 = 0; the entropy, its gradient and
    # the GRPO entropy metric stay finite (0 * -inf would be NaN)
    hidden, weight, bias, targets = _inputs(12, 6, 53)
    bias = bias.detach().clone()
    bias[40:] = float("-inf")
    bias.requires_grad_()
    targets = targets % 40
    log_probs, entropy = fused_linear_logprobs(hidden, weight, targets, bias=bias, return_token_entropy=True,
                                               block_sizes=BlockSizes(5, 16))
    # the oracle: the same distribution over the 40 real rows only
    ref_log_probs, ref_entropy = linear_logprobs(hidden, weight[:40], targets, bias=bias[:40],
                                                 return_token_entropy=True)
    _close(log_probs, ref_log_probs, torch.float32)
    _close(entropy, ref_entropy, torch.float32)
    got = _grads((log_probs + entropy).sum(), (hidden, weight))
    want = _grads((ref_log_probs + ref_entropy).sum(), (hidden, weight))
    _close(got[0], want[0], torch.float32)
    _close(got[1][:40], want[1][:40], torch.float32)
    assert (got[1][40:] == 0).all()
    logits = linear_logits(hidden, weight, bias)
    assert torch.isneginf(logits).any()
    _close(compute_entropy(logits), ref_entropy, torch.float32)  # the materialized helper too
    (entropy_grad,) = torch.autograd.grad(compute_entropy(logits).sum(), hidden)
    assert torch.isfinite(entropy_grad).all()


def test_several_row_chunks_and_vocabulary_blocks_match_one():
    # the weight's gradient is summed over row chunks only when there are several; blocks split the vocabulary
    hidden, weight, bias, targets = _inputs(40, 8, 997)
    outputs = []
    for blocks in (dict(), dict(block_sizes=BlockSizes(7, 64)), dict(block_sizes=BlockSizes(40, 1))):
        log_probs, entropy = fused_linear_logprobs(hidden, weight, targets, bias=bias, return_token_entropy=True,
                                                   **blocks)
        outputs.append([log_probs, entropy, *_grads((log_probs * 0.3 - entropy).sum(), (hidden, weight, bias))])
    for other in outputs[1:]:
        for got, want in zip(other, outputs[0]):
            _close(got, want, torch.float32)


def test_non_contiguous_hidden_is_accepted():
    # hidden[:, :-1] is how hidden states usually arrive: a non-contiguous view is accepted
    hidden, weight, _, targets = _inputs(24, 6, 37, bias=False, batch=2)
    view = hidden[:, :-1]
    assert not view.is_contiguous()
    got = fused_linear_logprobs(view, weight, targets[:, :-1])
    want = fused_linear_logprobs(view.contiguous(), weight, targets[:, :-1])
    _close(got, want, torch.float32)


def test_frozen_weight_gets_no_gradient_and_no_grad_mode_builds_no_graph():
    hidden, weight, _, targets = _inputs(12, 6, 50, bias=False)
    weight.requires_grad_(False)
    log_probs = fused_linear_logprobs(hidden, weight, targets)
    log_probs.sum().backward()
    assert weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        assert fused_linear_logprobs(hidden, weight, targets).grad_fn is None
        assert fused_linear_cross_entropy(hidden, weight, targets).grad_fn is None


def test_non_contiguous_upstream_gradient():
    hidden, weight, bias, targets = _inputs(20, 6, 37)
    upstream = torch.randn(20, 2)[:, 0]  # a strided view
    assert not upstream.is_contiguous()
    log_probs = fused_linear_logprobs(hidden, weight, targets, bias=bias, block_sizes=BlockSizes(tokens=7))
    ref, _ = linear_logprobs(hidden, weight, targets, bias=bias)
    for g, w in zip(_grads((log_probs * upstream).sum(), (hidden, weight, bias)),
                    _grads((ref * upstream).sum(), (hidden, weight, bias))):
        _close(g, w, torch.float32)


def test_bad_input_errors_name_the_argument():
    hidden, weight, _, targets = _inputs(4, 3, 5, bias=False)
    cases = [
        (dict(weight=torch.randn(5, 4)), ValueError, "weight: hidden size"),
        (dict(targets=torch.tensor([0, 1, 2, 5])), ValueError, r"targets: token ids must lie in \[0, 5\)"),
        (dict(targets=torch.tensor([0, -3, 2, 1])), ValueError, "targets"),
        (dict(targets=torch.zeros(4)), TypeError, "targets: expected token ids as an int64"),
        (dict(targets=torch.tensor([0, 1, 2, 3], dtype=torch.uint8)), TypeError, "targets: .* got torch.uint8"),
        (dict(hidden=torch.ones(4, 3, dtype=torch.long)), TypeError, "hidden: expected a floating"),
        (dict(temperature=0.0), ValueError, "temperature: expected a finite number > 0"),
        (dict(targets=torch.zeros(3, dtype=torch.long)), ValueError, "targets: shape"),
        (dict(bias=torch.zeros(4)), ValueError, "bias: length"),
        (dict(weight=torch.randn(5, 3, dtype=torch.float64)), TypeError, "weight: dtype"),
        (dict(chunk_size=0), TypeError,
         r"fused_linear_logprobs: keyword `chunk_size` is spelled `block_sizes=BlockSizes\(tokens="),
        (dict(softcap=-30.0), ValueError, "softcap: expected a finite number > 0"),
        (dict(softcap=float("inf")), ValueError, "softcap: expected a finite number > 0"),
        (dict(temperature=float("inf")), ValueError, "temperature: expected a finite number > 0"),
        (dict(logit_scale=float("nan")), ValueError, "logit_scale"),
        (dict(vocab_block_size=0), TypeError, "keyword `vocab_block_size` is spelled `block_sizes=BlockSizes"),
        (dict(block_sizes=dict(tokens=3)), TypeError, "block_sizes: expected a BlockSizes, got dict"),
        (dict(bias=torch.tensor([0.0, float("nan"), 0.0, 0.0, 0.0])), ValueError, "bias: contains NaN"),
    ]
    for overrides, error, match in cases:
        args = dict(hidden=hidden, weight=weight, targets=targets) | overrides
        with pytest.raises(error, match=match):
            fused_linear_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(hidden, weight, targets, reduction="avg")
    with pytest.raises(ValueError, match="block_sizes.vocab: expected a positive int, got 0"):
        BlockSizes(vocab=0)


def test_non_finite_hidden_gives_nan_as_pytorch_does():
    """A diverged model's NaN/inf reaches the loss (as with F.cross_entropy), where a training loop's NaN guard
    (`logitless.nonfinite`) stops or skips the step; the op neither raises nor hides it."""
    weight = torch.randn(5, 3)
    hidden = torch.tensor([[0.0, float("nan"), 1.0], [1.0, 2.0, 3.0], [float("inf"), 0.0, 0.0]])
    targets = torch.tensor([1, 2, 3])
    expected = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="none")
    assert torch.isnan(expected[0]) and torch.isfinite(expected[1])
    fused = fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    assert torch.isnan(fused[0]) and torch.isnan(fused[2]) == torch.isnan(expected[2])
    assert torch.allclose(fused[1], expected[1], atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_gradients_at_least_as_accurate_as_the_materialized_bf16_path(seed):
    # float64 reference on the same (bf16-valued) inputs; the materialized path is what a user writes in bf16:
    # logits = hidden @ weight.T in bf16, then fp32 log_softmax, and autograd's bf16 matmuls in backward
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(96, 64, generator=generator)).bfloat16()
    weight = (torch.randn(4001, 64, generator=generator) * 0.3).bfloat16()
    targets = torch.randint(0, 4001, (96,), generator=generator)
    upstream = torch.randn(96, generator=generator)

    def grads(log_probs_of, dtype):
        leaves = [hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()]
        return [g.double() for g in torch.autograd.grad((log_probs_of(*leaves) * upstream.to(dtype)).sum(), leaves)]

    def materialized(h, w):
        return torch.log_softmax((h @ w.T).float(), -1).gather(1, targets[:, None]).squeeze(1)

    def fused(h, w):
        return fused_linear_logprobs(h, w, targets, block_sizes=BlockSizes(40, 512))

    exact = grads(materialized, torch.float64)
    for name, got, plain, want in zip(("hidden", "weight"), grads(fused, torch.bfloat16),
                                      grads(materialized, torch.bfloat16), exact):
        fused_error, materialized_error = ((x - want).norm() / want.norm() for x in (got, plain))
        assert fused_error <= materialized_error, (name, fused_error.item(), materialized_error.item())


@pytest.mark.parametrize("blocks", [dict(), dict(block_sizes=BlockSizes(7, 100))])
def test_one_pass_and_two_pass_schedules_agree(blocks, monkeypatch):
    # cross-entropy and GRPO take one pass on CPU for fp32 weights, two elsewhere: both must give the same
    from logitless import fused_grpo_loss
    from logitless.ops import plan as schedule

    hidden, weight, bias, targets = _inputs(60, 16, 997, batch=3)
    mask = torch.rand(targets.shape) > 0.2
    old = torch.randn(targets.shape) * 0.1 - 7.0

    def run():
        ce = fused_linear_cross_entropy(hidden, weight, targets, bias=bias, label_smoothing=0.1, softcap=4.0, **blocks)
        grpo, metrics = fused_grpo_loss(hidden, weight, targets, mask, torch.randn(3, generator=torch.Generator()
                                        .manual_seed(1)), bias=bias, old_log_probs=old, ref_log_probs=old + 0.1,
                                        beta=0.04, temperature=0.8, **blocks)
        return [ce, grpo, *_grads(ce + grpo, (hidden, weight, bias))], metrics

    plans = []
    real_plan = schedule.plan_blocks
    for implementation in ("one_pass", "blocks"):  # the modules of the implementations that plan blocks
        monkeypatch.setattr(f"logitless.ops.{implementation}.plan_blocks",
                            lambda *a, **k: plans.append(real_plan(*a, **k)) or plans[-1])
    one_pass, one_pass_metrics = run()
    assert plans and all(plan.single_pass for plan in plans)
    monkeypatch.setattr(schedule, "SINGLE_PASS_DEVICES", ())
    plans.clear()
    two_pass, two_pass_metrics = run()
    assert plans and not any(plan.single_pass for plan in plans)
    for got, want in zip(one_pass, two_pass):
        _close(got, want, torch.float32)
    assert one_pass_metrics == pytest.approx(two_pass_metrics, rel=1e-5, abs=1e-6)


def test_a_second_derivative_is_refused_not_silently_zero():
    """create_graph=True (a gradient penalty) would get gradients without a graph, hence a 0 second derivative."""
    from logitless.ops import fused_linear_kl

    hidden, weight, _, targets = _inputs(6, 8, 50, bias=False)
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    for loss in (fused_linear_cross_entropy(hidden, weight, targets),
                 fused_linear_logprobs(hidden, weight, targets).sum(),
                 fused_linear_kl(hidden, weight, hidden.detach(), weight.detach() * 0.5).sum()):
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.autograd.grad(loss, hidden, create_graph=True)
    reference_loss = fused_linear_cross_entropy(hidden, weight, targets, impl="reference")  # what the error suggests
    (grad_hidden,) = torch.autograd.grad(reference_loss, hidden, create_graph=True)
    assert torch.autograd.grad(grad_hidden.square().sum(), weight)[0].abs().sum() > 0


def test_cross_entropy_options_and_the_kl_heads_name_their_argument():
    from logitless.ops import fused_linear_kl

    hidden, weight, _, targets = _inputs(4, 3, 5, bias=False)
    with pytest.raises(ValueError, match="label_smoothing: expected a number in \\[0, 1\\], got None"):
        fused_linear_cross_entropy(hidden, weight, targets, label_smoothing=None)
    with pytest.raises(TypeError, match="ignore_index: expected an int, got 1.5"):
        fused_linear_cross_entropy(hidden, weight, targets, ignore_index=1.5)
    with pytest.raises(ValueError, match="^bias_q: contains NaN"):
        fused_linear_kl(hidden, weight, hidden, weight, bias_q=torch.full((5,), float("nan")))
    with pytest.raises(ValueError, match="^weight_p: "):
        fused_linear_kl(hidden, weight.T.contiguous(), hidden, weight)
