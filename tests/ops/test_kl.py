"""fused_linear_kl against the materialized KL: values and gradients, fp32 tight, bf16 loose, odd shapes,
masks, temperature, -inf logits, gradcheck in float64."""

import pytest
import torch
import torch.nn.functional as F

from logitless.ops import BlockSizes
from logitless.ops.two_heads import fused_linear_kl


def linear_kl(hidden_p, weight_p, hidden_q, weight_q, *, bias_p=None, bias_q=None, temperature=1.0, mask=None):
    """Oracle: build both (..., V) logits, log-softmax, sum p (log p - log q); q side detached."""
    dtype = torch.float64 if hidden_p.dtype == torch.float64 else torch.float32
    logits_p = (hidden_p @ weight_p.T + (0 if bias_p is None else bias_p)).to(dtype) / temperature
    logits_q = (hidden_q @ weight_q.T + (0 if bias_q is None else bias_q)).detach().to(dtype) / temperature
    log_p, log_q = F.log_softmax(logits_p, dim=-1), F.log_softmax(logits_q, dim=-1)
    taken = log_p.exp() > 0  # where p = 0 the term is 0: keep -inf out of the graph so its gradient stays exact
    kl = (log_p.exp() * torch.where(taken, log_p - log_q, 0.0)).sum(dim=-1)
    return kl if mask is None else torch.where(mask.bool(), kl, torch.zeros_like(kl))


def _inputs(n, hidden_p, hidden_q, vocab, dtype=torch.float32, bias=False, scale=1.0):
    g = torch.Generator().manual_seed(n * 1000 + vocab)
    make = lambda *shape: (torch.randn(*shape, generator=g) * scale).to(dtype)  # noqa: E731
    tensors = dict(hidden_p=make(n, hidden_p), weight_p=make(vocab, hidden_p), hidden_q=make(n, hidden_q),
                   weight_q=make(vocab, hidden_q))
    if bias:
        tensors.update(bias_p=make(vocab), bias_q=make(vocab))
    for name in ("hidden_p", "weight_p", "bias_p"):
        if name in tensors:
            tensors[name].requires_grad_(True)
    return tensors


def _grads(out, tensors, seed=0):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    names = [n for n in ("hidden_p", "weight_p", "bias_p") if n in tensors]
    return dict(zip(names, torch.autograd.grad((out * upstream).sum(), [tensors[n] for n in names])))


@pytest.mark.parametrize("n, vocab, chunk_size, bias, temperature", [
    (7, 13, 3, False, 1.0),  # N not a multiple of the chunk, V prime
    (16, 101, None, True, 0.7),
    (5, 31, 2, True, 1.9),
])
def test_values_and_gradients_match_materialized_fp32(n, vocab, chunk_size, bias, temperature):
    tensors = _inputs(n, 8, 6, vocab, bias=bias, scale=0.7)
    fused = fused_linear_kl(**tensors, temperature=temperature, block_sizes=BlockSizes(tokens=chunk_size))
    oracle = linear_kl(**tensors, temperature=temperature)
    assert fused.dtype == torch.float32 and fused.shape == (n,)
    torch.testing.assert_close(fused, oracle, rtol=1e-5, atol=1e-6)
    expected = _grads(oracle, tensors)
    for name, grad in _grads(fused, tensors).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_batched_leading_dims_and_mask():
    tensors = _inputs(12, 8, 8, 29, scale=0.5)
    tensors = {k: (v.detach().reshape(3, 4, -1) if k.startswith("hidden") else v.detach()) for k, v in tensors.items()}
    for name in ("hidden_p", "weight_p"):
        tensors[name].requires_grad_(True)
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]])
    fused = fused_linear_kl(**tensors, mask=mask, block_sizes=BlockSizes(tokens=2))
    oracle = linear_kl(**tensors, mask=mask)
    assert fused.shape == (3, 4)
    assert bool((fused[mask == 0] == 0).all()) and bool((fused[mask == 1] > 0).all())
    torch.testing.assert_close(fused, oracle, rtol=1e-5, atol=1e-6)
    expected, got = _grads(oracle, tensors), _grads(fused, tensors)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert bool((got["hidden_p"][1] == 0).all())  # a masked row gets no gradient


def test_bf16_inputs_close_to_fp32():
    tensors = _inputs(9, 16, 16, 257, bias=True, scale=0.5)
    as_bf16 = {k: v.detach().bfloat16().requires_grad_(k.endswith("_p")) for k, v in tensors.items()}
    upcast = {k: v.detach().float().requires_grad_(k.endswith("_p")) for k, v in as_bf16.items()}
    fused = fused_linear_kl(**as_bf16, block_sizes=BlockSizes(tokens=4))
    oracle = linear_kl(**upcast)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, oracle, rtol=2e-2, atol=2e-3)
    grads, expected = _grads(fused, as_bf16), _grads(oracle, upcast)
    assert grads["weight_p"].dtype == torch.bfloat16
    for name in ("hidden_p", "weight_p", "bias_p"):
        torch.testing.assert_close(grads[name].float(), expected[name], rtol=5e-2, atol=5e-3, msg=name)


def test_same_distribution_gives_zero_kl_and_zero_gradient():
    tensors = _inputs(6, 8, 8, 17)
    tensors["hidden_q"], tensors["weight_q"] = (tensors["hidden_p"].detach().clone(),
                                                tensors["weight_p"].detach().clone())
    fused = fused_linear_kl(**tensors)
    torch.testing.assert_close(fused, torch.zeros(6), atol=1e-6, rtol=0)
    assert all(g.abs().max() < 1e-5 for g in _grads(fused, tensors).values())


def test_minus_inf_logits_are_exact():
    """p = 0 tokens add 0 (even where q = 0 too); p > 0 where q = 0 gives +inf. The -inf sit in the biases."""
    inf = float("-inf")
    hidden = torch.randn(3, 4)
    weight_p = torch.randn(5, 4, requires_grad=True)
    weight_q = torch.randn(5, 4)
    bias_p = torch.tensor([0.0, inf, inf, 0.5, 0.0], requires_grad=True)  # p(1) = p(2) = 0
    bias_q_finite = torch.tensor([0.2, inf, 0.0, 0.0, 0.0])  # q(1) = 0 where p(1) = 0 too
    fused = fused_linear_kl(hidden, weight_p, hidden, weight_q, bias_p=bias_p, bias_q=bias_q_finite)
    oracle = linear_kl(hidden, weight_p, hidden, weight_q, bias_p=bias_p, bias_q=bias_q_finite)
    assert torch.isfinite(fused).all()  # 0 * log(0 / 0) = 0
    torch.testing.assert_close(fused, oracle)
    grad_fused = torch.autograd.grad(fused.sum(), [weight_p, bias_p])
    grad_oracle = torch.autograd.grad(oracle.sum(), [weight_p, bias_p])
    for got, expected in zip(grad_fused, grad_oracle):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected)
    assert bool((grad_fused[1][1:3] == 0).all())  # no gradient into tokens p never picks
    bias_q_zero = torch.tensor([0.2, 0.0, 0.0, inf, 0.0])  # q(3) = 0 where p(3) > 0
    fused = fused_linear_kl(hidden, weight_p, hidden, weight_q, bias_p=bias_p, bias_q=bias_q_zero)
    assert torch.isposinf(fused).all()
    torch.testing.assert_close(fused, linear_kl(hidden, weight_p, hidden, weight_q, bias_p=bias_p, bias_q=bias_q_zero))


def test_gradcheck_float64():
    tensors = _inputs(5, 3, 4, 7, dtype=torch.float64, bias=True)
    names = ("hidden_p", "weight_p", "bias_p")
    rest = {k: v for k, v in tensors.items() if k not in names}

    def function(hidden_p, weight_p, bias_p):
        return fused_linear_kl(hidden_p, weight_p, rest["hidden_q"], rest["weight_q"], bias_p=bias_p,
                               bias_q=rest["bias_q"], temperature=1.3, block_sizes=BlockSizes(tokens=2))

    assert torch.autograd.gradcheck(function, tuple(tensors[n] for n in names))


def test_q_side_gets_no_gradient():
    tensors = _inputs(4, 8, 8, 11)
    tensors["hidden_q"].requires_grad_(True)
    fused = fused_linear_kl(**tensors)
    assert fused.requires_grad
    assert torch.autograd.grad(fused.sum(), tensors["hidden_q"], allow_unused=True)[0] is None


@pytest.mark.parametrize("change, message", [
    (dict(weight_q=torch.randn(12, 8)), "weight_q: vocabulary"),
    (dict(hidden_q=torch.randn(5, 8)), "hidden_q: leading dims"),
    (dict(weight_p=torch.randn(11, 7)), "weight_p: hidden size"),
    (dict(hidden_p=torch.randn(4, 8, dtype=torch.float64)), "weight_p: dtype"),
    (dict(bias_p=torch.randn(3)), "bias_p: length"),
    (dict(temperature=0.0), "temperature"),
    (dict(mask=torch.ones(3)), "mask"),
    (dict(hidden_p=[1.0]), "hidden_p"),
])
def test_bad_input_names_the_argument(change, message):
    tensors = {k: v.detach() for k, v in _inputs(4, 8, 8, 11).items()}
    with pytest.raises((ValueError, TypeError), match=message):
        fused_linear_kl(**{**tensors, **change})


def test_vocabulary_blocks_and_heads_with_their_own_scale_and_softcap():
    # two models' heads (e.g. lm_head_of a policy and of a teacher): each its own bias, scale, soft cap
    from logitless.ops.head import LinearHead
    from logitless.ops.reference import linear_logits

    tensors = _inputs(13, 8, 6, 301, bias=True, scale=0.8)
    head_p = LinearHead(tensors["weight_p"], bias=tensors["bias_p"], temperature=0.9, softcap=2.5, logit_scale=1.3)
    head_q = LinearHead(tensors["weight_q"], bias=tensors["bias_q"], temperature=0.9, logit_scale=0.7)
    fused = fused_linear_kl(tensors["hidden_p"], hidden_q=tensors["hidden_q"], head_p=head_p, head_q=head_q,
                            block_sizes=BlockSizes(5, 64))
    log_p = torch.log_softmax(linear_logits(tensors["hidden_p"], head=head_p), -1)
    log_q = torch.log_softmax(linear_logits(tensors["hidden_q"], head=head_q), -1)
    oracle = (log_p.exp() * (log_p - log_q.detach())).sum(-1)
    torch.testing.assert_close(fused, oracle, rtol=1e-5, atol=1e-6)
    expected = _grads(oracle, tensors)
    for name, grad in _grads(fused, tensors).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("softcap, logit_scale", [(2.0, 1.0), (None, 1.7), (3.0, 0.6)])
def test_softcap_and_logit_scale_match_materialized(softcap, logit_scale):
    # both heads' logits are cap(logit_scale * (hidden @ weight.T + bias)) / temperature
    from logitless.ops.reference import linear_logits

    tensors = _inputs(11, 8, 6, 257, bias=True, scale=0.9)
    fused = fused_linear_kl(**tensors, temperature=0.8, softcap=softcap, logit_scale=logit_scale,
                            block_sizes=BlockSizes(4, 64))
    options = dict(softcap=softcap, temperature=0.8, logit_scale=logit_scale)
    log_p = torch.log_softmax(linear_logits(tensors["hidden_p"], tensors["weight_p"], tensors["bias_p"], **options), -1)
    log_q = torch.log_softmax(linear_logits(tensors["hidden_q"], tensors["weight_q"], tensors["bias_q"], **options),
                              -1).detach()
    oracle = (log_p.exp() * (log_p - log_q)).sum(-1)
    torch.testing.assert_close(fused, oracle, rtol=1e-5, atol=1e-6)
    expected = _grads(oracle, tensors)
    for name, grad in _grads(fused, tensors).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5, msg=name)  # gradients up to ~7


@pytest.mark.parametrize("change, message", [(dict(softcap=0.0), "softcap"), (dict(logit_scale=-1.0), "logit_scale")])
def test_bad_softcap_and_logit_scale_are_named(change, message):
    tensors = {k: v.detach() for k, v in _inputs(4, 8, 8, 11).items()}
    with pytest.raises(ValueError, match=message):
        fused_linear_kl(**tensors, **change)
