"""Gumbel-softmax samples (top-k, against the dense sample written out), straight-through, and the sparse
soft-token embedding."""

import pytest
import torch

from logitless.ops.gumbel import gumbel_noise, gumbel_softmax_topk, perturbed_topk_and_tail_mass, sparse_soft_embedding


def _relaxed_sample(logits, noise, tau):
    """softmax((z + g) / tau) over the last dim, written out (no code shared with the samplers)."""
    scaled = (logits.double() + noise.double()) / tau
    weights = (scaled - scaled.max(dim=-1, keepdim=True).values).exp()
    return weights / weights.sum(dim=-1, keepdim=True)


def gumbel_softmax_dense(logits, tau, noise, hard=False):
    """The Gumbel-softmax sample over the whole vocabulary, ``softmax((z + g) / tau)`` in the logits' dtype and
    differentiable, with ``hard`` the straight-through one-hot (its value the one-hot, its gradient the soft
    sample's): the top-k sampler's oracle, written out."""
    soft = torch.softmax((logits + noise) / tau, dim=-1)
    if not hard:
        return soft
    return torch.nn.functional.one_hot(soft.argmax(dim=-1), soft.shape[-1]).to(soft.dtype) + (soft - soft.detach())


@pytest.mark.parametrize("tau", [0.3, 1.0, 2.5])
def test_each_sampler_is_the_softmax_of_the_perturbed_logits_over_tau(tau):
    """The top-k weights against the formula: the k largest of the dense sample, renormalized over themselves."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(7)) * 2
    noise = gumbel_noise((3, 40), generator=torch.Generator().manual_seed(8))
    expected = _relaxed_sample(logits, noise, tau)
    # fp32 against fp64: exp rounds each probability to fp32's relative precision times the size of its exponent
    rtol = 8 * torch.finfo(torch.float32).eps * ((logits + noise) / tau).abs().max().item()
    indices, weights = gumbel_softmax_topk(logits, tau, 7, noise=noise)
    kept = expected.gather(-1, indices)
    torch.testing.assert_close(weights.double(), kept / kept.sum(-1, keepdim=True), rtol=rtol, atol=0)


@pytest.mark.parametrize("tau", [0.3, 1.0, 2.5])
def test_the_tail_mass_is_the_relaxed_samples_mass_outside_the_kept_tokens(tau):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(9)) * 2
    noise = gumbel_noise((4, 300), generator=torch.Generator().manual_seed(10))
    indices, tail = perturbed_topk_and_tail_mass(logits.clone(), noise, 5, tau)
    assert torch.equal(indices, (logits + noise).topk(5).indices)
    expected = 1 - _relaxed_sample(logits, noise, tau).gather(-1, indices).sum(-1)
    torch.testing.assert_close(tail.double(), expected, atol=1e-6, rtol=1e-5)


def test_topk_with_k_equal_to_vocab_equals_dense_sample_and_gradient():
    logits = torch.randn(3, 17, requires_grad=True)
    noise = gumbel_noise((3, 17), generator=torch.Generator().manual_seed(1))
    dense = gumbel_softmax_dense(logits, 0.7, noise)
    indices, weights = gumbel_softmax_topk(logits, 0.7, 17, noise=noise)
    scattered = torch.zeros(3, 17).scatter(-1, indices, weights)
    torch.testing.assert_close(scattered, dense)
    upstream = torch.randn(3, 17)
    (grad_dense,) = torch.autograd.grad((dense * upstream).sum(), logits)
    (grad_sparse,) = torch.autograd.grad((weights * upstream.gather(-1, indices)).sum(), logits)
    torch.testing.assert_close(grad_sparse, grad_dense)


def test_topk_keeps_the_largest_perturbed_logits_and_renormalizes():
    logits = torch.randn(4, 50)
    noise = gumbel_noise((4, 50), generator=torch.Generator().manual_seed(2))
    indices, weights = gumbel_softmax_topk(logits, 0.5, 5, noise=noise)
    expected = (logits + noise).topk(5).indices
    assert torch.equal(indices, expected)
    dense = gumbel_softmax_dense(logits, 0.5, noise)
    torch.testing.assert_close(weights, dense.gather(-1, indices) / dense.gather(-1, indices).sum(-1, keepdim=True))
    torch.testing.assert_close(weights.sum(-1), torch.ones(4))


def test_hard_sample_is_one_hot_forward_soft_backward():
    logits = torch.randn(2, 9, requires_grad=True)
    noise = gumbel_noise((2, 9), generator=torch.Generator().manual_seed(3))
    indices, hard = gumbel_softmax_topk(logits, 0.9, 4, hard=True, noise=noise)
    soft = gumbel_softmax_topk(logits, 0.9, 4, noise=noise)[1]
    assert torch.equal(hard.detach(), torch.tensor([[1.0, 0, 0, 0]] * 2))
    assert torch.equal(indices[:, 0], (logits + noise).argmax(-1))
    upstream = torch.randn(2, 4)
    torch.testing.assert_close(torch.autograd.grad((hard * upstream).sum(), logits)[0],
                               torch.autograd.grad((soft * upstream).sum(), logits)[0])
    # with k = V, the dense straight-through sample's value and gradient
    indices, hard = gumbel_softmax_topk(logits, 0.9, 9, hard=True, noise=noise)
    dense = gumbel_softmax_dense(logits, 0.9, noise, hard=True)
    upstream = torch.randn(2, 9)
    torch.testing.assert_close(torch.zeros(2, 9).scatter(-1, indices, hard), dense)
    torch.testing.assert_close(torch.autograd.grad((hard * upstream.gather(-1, indices)).sum(), logits)[0],
                               torch.autograd.grad((dense * upstream).sum(), logits)[0])


def test_gumbel_max_samples_the_softmax():
    """The argmax of logits + Gumbel noise is a sample of softmax(logits): frequencies match."""
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    noise = gumbel_noise((20000, 4), generator=torch.Generator().manual_seed(4))
    counts = torch.bincount((logits + noise).argmax(-1), minlength=4).float() / 20000
    torch.testing.assert_close(counts, torch.softmax(logits, 0), atol=0.015, rtol=0)


def test_generator_makes_samples_reproducible():
    logits = torch.randn(2, 30)
    first = gumbel_softmax_topk(logits, 1.0, 3, generator=torch.Generator().manual_seed(5))
    second = gumbel_softmax_topk(logits, 1.0, 3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_sparse_soft_embedding_equals_dense_and_gradients():
    weight = torch.randn(23, 6, dtype=torch.float64, requires_grad=True)
    indices = torch.randint(0, 23, (2, 3, 4))
    weights = torch.rand(2, 3, 4, dtype=torch.float64, requires_grad=True)
    got = sparse_soft_embedding(weight, indices, weights)
    dense_weights = torch.zeros(2, 3, 23, dtype=torch.float64).scatter_add(-1, indices, weights)
    expected = dense_weights @ weight
    assert got.shape == (2, 3, 6)
    torch.testing.assert_close(got, expected)
    assert torch.autograd.gradcheck(lambda w, e: sparse_soft_embedding(e, indices, w), (weights, weight))
    (grad_weight,) = torch.autograd.grad(got.sum(), weight)
    untouched = torch.ones(23, dtype=torch.bool)
    untouched[indices.flatten()] = False
    assert bool((grad_weight[untouched] == 0).all())  # only the k selected rows get a gradient


def test_gradcheck_topk_weights_float64():
    logits = torch.randn(2, 11, dtype=torch.float64, requires_grad=True)
    noise = gumbel_noise((2, 11), generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda z: gumbel_softmax_topk(z, 0.8, 4, noise=noise)[1], (logits,))


@pytest.mark.parametrize("call, message", [
    (lambda z: gumbel_softmax_topk(z, 1.0, 0), "k: expected an int in \\[1, 10\\]"),
    (lambda z: gumbel_softmax_topk(z, 1.0, 11), "k: expected an int in \\[1, 10\\]"),
    (lambda z: gumbel_softmax_topk(z, 0.0, 3), "tau: expected a finite number > 0"),
    (lambda z: gumbel_softmax_topk(z, -1.0, 3), "tau: expected a finite number > 0"),
    (lambda z: gumbel_softmax_topk(z, 1.0, 3, noise=torch.zeros(2, 9)), "noise: shape"),
    (lambda z: gumbel_softmax_topk(z.long(), 1.0, 3), "logits: expected a floating-point"),
    (lambda z: sparse_soft_embedding(torch.zeros(10, 4), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 2)),
     "weights: shape"),
])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(torch.randn(2, 10))
