"""fused_linear_jsd (two heads in parts or whole), the generalized JSD of a student's head from a teacher's,
against the fp64
materialized oracle (`reference.generalized_jsd`) and TRL's ChunkedDivergenceFunction: values, the student's
entropy and gradients, every beta TRL treats apart, teacher hidden size != student's, soft cap, logit scale and
bias on each side, masks, -inf logits, prime V, odd N, gradcheck in fp64. The Triton twin is checked in
tests/ops/test_triton.py."""

import pytest
import torch
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

from logitless.ops import BlockSizes, LinearHead, engine, reference
from logitless.ops.two_heads import fused_linear_jsd

BETAS = [0.0, 0.5, 1.0, 0.3]
BLOCKS = BlockSizes(tokens=5, vocab=64)  # 13 rows: 3 chunks, the last of 3; 1009 columns: 16 blocks, the last of 49


def _inputs(n=13, hidden_s=8, hidden_t=6, vocab=1009, dtype=torch.float32, seed=0, scale=0.7):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    student = dict(hidden_s=make(n, hidden_s), weight_s=make(vocab, hidden_s), bias_s=make(vocab))
    teacher = dict(hidden_t=make(n, hidden_t), weight_t=make(vocab, hidden_t), bias_t=make(vocab))
    for tensor in student.values():
        tensor.requires_grad_(True)
    return student, teacher


def _upstream(shape, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(11), dtype=dtype)


def _grads(divergence, student):
    return torch.autograd.grad((divergence * _upstream(divergence.shape, divergence.dtype)).sum(),
                               list(student.values()))


def _oracle(student, teacher, beta, heads, mask=None):
    """fp64: the materialized logits of both heads (``heads``: each side's (temperature, softcap, logit_scale)),
    the divergence by `reference.generalized_jsd`, the student's entropy; with the fp64 student leaves."""
    leaves = {name: t.detach().double().requires_grad_() for name, t in student.items()}
    (temperature_s, softcap_s, scale_s), (temperature_t, softcap_t, scale_t) = heads
    log_p_s = torch.log_softmax(reference.linear_logits(leaves["hidden_s"], leaves["weight_s"], leaves["bias_s"],
                                                        softcap=softcap_s, temperature=temperature_s,
                                                        logit_scale=scale_s), -1)
    hidden_t, weight_t, bias_t = (teacher[k].double() for k in ("hidden_t", "weight_t", "bias_t"))
    log_p_t = torch.log_softmax(reference.linear_logits(hidden_t, weight_t, bias_t, softcap=softcap_t,
                                                        temperature=temperature_t, logit_scale=scale_t), -1)
    divergence = reference.generalized_jsd(log_p_s, log_p_t, beta)
    entropy = reference.entropy_from_log_probs(log_p_s)
    if mask is not None:
        divergence, entropy = divergence * mask, entropy * mask
    return divergence, entropy.detach(), leaves


def _assert_close(got, want, name, rtol=1e-5):
    """Each tensor within ``rtol`` of its largest entry (gradients are sums of cancelling terms)."""
    scale = want.detach().abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.detach().to(want.dtype), want.detach(), rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
def test_matches_the_fp64_oracle(beta, temperature):
    """Prime V, 13 rows in chunks of 5, another hidden size for the teacher, biases, a soft cap, a logit scale and a
    mask: the divergence, the student's entropy and the gradients of the student's hidden states, weight, bias."""
    student, teacher = _inputs()
    mask = torch.ones(13, dtype=torch.bool)
    mask[[2, 7]] = False
    options = dict(temperature=temperature, softcap=3.0, logit_scale=1.3)
    divergence, entropy = fused_linear_jsd(**student, **teacher, beta=beta, mask=mask, block_sizes=BLOCKS,
                                           impl="chunked", return_token_entropy=True, **options)
    heads = [(temperature, 3.0, 1.3)] * 2
    want, want_entropy, leaves = _oracle(student, teacher, beta, heads, mask)
    assert divergence.dtype == entropy.dtype == torch.float32 and divergence.shape == (13,)
    assert bool((divergence[mask] > 0).all()) and bool((divergence[~mask] == 0).all())
    _assert_close(divergence, want, "divergence")
    _assert_close(entropy, want_entropy, "entropy")
    for name, got, expected in zip(student, _grads(divergence, student), _grads(want, leaves)):
        _assert_close(got, expected, name)


@pytest.mark.parametrize("softcaps", [(3.0, None), (None, 5.0)], ids=["student_capped", "teacher_capped"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
def test_matches_trls_chunked_divergence(beta, temperature, softcaps):
    """TRL's DistillationTrainer kernel on the same inputs: each model its own logit scale and soft cap, both the
    same temperature."""
    student, teacher = _inputs(seed=1)
    softcap_s, softcap_t = softcaps
    trl_divergence, trl_entropy = ChunkedDivergenceFunction.apply(
        *student.values(), *teacher.values(), beta, temperature, 1.3, softcap_s, 0.8, softcap_t)
    head_s = LinearHead(student["weight_s"], bias=student["bias_s"], temperature=temperature, softcap=softcap_s,
                        logit_scale=1.3)
    head_t = LinearHead(teacher["weight_t"], bias=teacher["bias_t"], temperature=temperature, softcap=softcap_t,
                        logit_scale=0.8)
    divergence, entropy = fused_linear_jsd(student["hidden_s"], hidden_t=teacher["hidden_t"], head_s=head_s,
                                           head_t=head_t, beta=beta, return_token_entropy=True, block_sizes=BLOCKS,
                                           impl="chunked")
    _assert_close(divergence, trl_divergence, "divergence")
    _assert_close(entropy, trl_entropy, "entropy")
    for name, got, expected in zip(student, _grads(divergence, student), _grads(trl_divergence, student)):
        _assert_close(got, expected, name)


@pytest.mark.parametrize("beta", BETAS)
def test_the_students_logits_gradient_has_the_closed_form(beta):
    """d divergence / d z_s, by autograd through the materialized fp64 oracle: p_s - p_t at beta 0,
    p_s (log p_s - log p_t - KL(p_s || p_t)) at 1, (1 - beta) p_s (log(p_s / m) - KL(p_s || m)) between."""
    generator = torch.Generator().manual_seed(2)
    logits_s = (torch.randn(4, 50, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    log_p_t = torch.log_softmax(torch.randn(4, 50, generator=generator, dtype=torch.float64) * 2, -1)
    log_p_s = torch.log_softmax(logits_s, -1)
    (grad,) = torch.autograd.grad(reference.generalized_jsd(log_p_s, log_p_t, beta).sum(), logits_s)
    p_s, p_t = log_p_s.exp().detach(), log_p_t.exp()
    if beta == 0.0:
        want = p_s - p_t
    else:
        log_m = log_p_t if beta == 1.0 else torch.log((1 - beta) * p_s + beta * p_t)
        log_ratio = log_p_s.detach() - log_m
        want = (1.0 if beta == 1.0 else 1 - beta) * p_s * (log_ratio - (p_s * log_ratio).sum(-1, keepdim=True))
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", BETAS)
def test_minus_inf_logits_are_exact(beta):
    """Padded vocabulary rows (-inf in both biases) add nothing and get no gradient; where only the teacher has
    p = 0, the JSD stays finite, the reverse KL is +inf and the forward KL finite; where only the student has
    p = 0, the forward KL is +inf."""
    student, teacher = _inputs(n=6, vocab=31, seed=3)
    with torch.no_grad():
        student["bias_s"][::5] = float("-inf")
    teacher["bias_t"][::5] = float("-inf")
    heads = [(1.0, None, 1.0)] * 2
    divergence, entropy = fused_linear_jsd(**student, **teacher, beta=beta, block_sizes=BlockSizes(4, 8),
                                           impl="chunked", return_token_entropy=True)
    want, want_entropy, leaves = _oracle(student, teacher, beta, heads)
    assert torch.isfinite(divergence).all() and torch.isfinite(entropy).all()
    _assert_close(divergence, want, "divergence")
    _assert_close(entropy, want_entropy, "entropy")
    grads = _grads(divergence, student)
    for name, got, expected in zip(student, grads, _grads(want, leaves)):
        assert torch.isfinite(got).all(), name
        _assert_close(got, expected, name)
    assert bool((grads[2][::5] == 0).all())  # no gradient into rows the student never picks

    only_teacher = dict(teacher, bias_t=teacher["bias_t"].clone())
    only_teacher["bias_t"][3] = float("-inf")
    only_student = dict(student, bias_s=student["bias_s"].detach().clone())
    only_student["bias_s"][3] = float("-inf")
    for sides, infinite_at in (((student, only_teacher), 1.0), ((only_student, teacher), 0.0)):
        divergence = fused_linear_jsd(**sides[0], **sides[1], beta=beta, impl="chunked")
        want = _oracle(*sides, beta, heads)[0]
        assert bool(torch.isposinf(divergence).all()) == (beta == infinite_at)
        assert bool(torch.isfinite(divergence).all()) == (beta != infinite_at)
        torch.testing.assert_close(divergence.double(), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_gradcheck_float64(beta):
    student, teacher = _inputs(n=5, hidden_s=3, hidden_t=4, vocab=7, dtype=torch.float64, seed=4)

    def divergence(hidden_s, weight_s, bias_s):
        return fused_linear_jsd(hidden_s, weight_s, *list(teacher.values())[:2], bias_s=bias_s,
                                bias_t=teacher["bias_t"], beta=beta, temperature=1.3, softcap=2.0, logit_scale=0.9,
                                block_sizes=BlockSizes(2, 3), impl="chunked")

    assert torch.autograd.gradcheck(divergence, tuple(student.values()))


def test_teacher_gets_no_gradient():
    student, teacher = _inputs(n=4, vocab=11)
    for tensor in teacher.values():
        tensor.requires_grad_(True)
    divergence, entropy = fused_linear_jsd(**student, **teacher, return_token_entropy=True)
    assert divergence.requires_grad and not entropy.requires_grad
    grads = torch.autograd.grad(divergence.sum(), [*student.values(), *teacher.values()], allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in grads[:3])
    assert all(g is None for g in grads[3:])


def test_batched_leading_dims_and_mask():
    student, teacher = _inputs(n=12, vocab=101, seed=5)
    student = {k: (v.detach().reshape(3, 4, -1) if k == "hidden_s" else v.detach()).requires_grad_() for k, v in
               student.items()}
    teacher = {k: v.reshape(3, 4, -1) if k == "hidden_t" else v for k, v in teacher.items()}
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]])
    divergence, entropy = fused_linear_jsd(**student, **teacher, beta=0.3, mask=mask, block_sizes=BlockSizes(tokens=2),
                                           return_token_entropy=True)
    assert divergence.shape == entropy.shape == (3, 4)
    flat = {k: v.reshape(12, -1) if k.startswith("hidden") else v for k, v in (student | teacher).items()}
    full, full_entropy = fused_linear_jsd(**flat, beta=0.3, return_token_entropy=True)
    kept = mask.reshape(-1).bool()
    _assert_close(divergence.reshape(-1)[kept], full[kept], "divergence")
    _assert_close(entropy.reshape(-1)[kept], full_entropy[kept], "entropy")
    assert bool((divergence[mask == 0] == 0).all()) and bool((entropy[mask == 0] == 0).all())
    (grad_hidden,) = torch.autograd.grad(divergence.sum(), student["hidden_s"])
    assert bool((grad_hidden[mask == 0] == 0).all()) and bool((grad_hidden[mask == 1] != 0).any())


def test_bf16_inputs_close_to_fp32():
    student, teacher = _inputs(n=9, hidden_s=16, hidden_t=16, vocab=257, seed=6)
    low = {k: v.detach().bfloat16().requires_grad_(k.endswith("_s")) for k, v in (student | teacher).items()}
    divergence = fused_linear_jsd(**low, beta=0.5, block_sizes=BlockSizes(tokens=4))
    want, _, leaves = _oracle({k: low[k] for k in student}, {k: low[k].detach() for k in teacher}, 0.5,
                              [(1.0, None, 1.0)] * 2)
    assert divergence.dtype == torch.float32
    _assert_close(divergence, want, "divergence", rtol=2e-2)
    grads = torch.autograd.grad((divergence * _upstream(9)).sum(), [low[k] for k in student])
    assert grads[1].dtype == torch.bfloat16
    for name, got, expected in zip(student, grads, _grads(want, leaves)):
        _assert_close(got.float(), expected, name, rtol=5e-2)


@pytest.mark.parametrize("beta, sweeps", [(0.0, 1), (1.0, 1), (0.3, 2)])
def test_a_second_sweep_only_for_the_mixture(beta, sweeps, monkeypatch):
    """The forward and reverse KL come from one sweep of the KL's online softmax; the mixture needs both
    normalizers first, hence a second sweep of each row chunk in the first pass. Backward is one more."""
    calls = []
    real_vocab_blocks = engine.vocab_blocks
    monkeypatch.setattr(engine, "vocab_blocks", lambda *args: calls.append(1) or real_vocab_blocks(*args))
    student, teacher = _inputs()
    divergence = fused_linear_jsd(**student, **teacher, beta=beta, block_sizes=BLOCKS, impl="chunked")
    assert len(calls) == 3 * sweeps  # 3 row chunks
    divergence.sum().backward()
    assert len(calls) == 3 * sweeps + 3


def test_no_tokens():
    student, teacher = _inputs(n=0, vocab=11)
    for beta in (0.0, 0.5):
        divergence, entropy = fused_linear_jsd(**student, **teacher, beta=beta, return_token_entropy=True)
        assert divergence.shape == entropy.shape == (0,)
        assert all(g.abs().sum() == 0 for g in torch.autograd.grad(divergence.sum(), list(student.values())))


def test_a_second_derivative_is_refused():
    student, teacher = _inputs(n=4, vocab=11)
    divergence = fused_linear_jsd(**student, **teacher)
    with pytest.raises(RuntimeError, match="the fused JSD: no second derivative"):
        torch.autograd.grad(divergence.sum(), student["hidden_s"], create_graph=True)


@pytest.mark.parametrize("change, error, message", [
    (dict(beta=-0.1), ValueError, r"beta: expected a number in \[0, 1\], got -0.1"),
    (dict(beta=1.5), ValueError, r"beta: expected a number in \[0, 1\], got 1.5"),
    (dict(beta=float("nan")), ValueError, "beta: expected a number"),
    (dict(beta=True), ValueError, "beta: expected a number"),
    (dict(beta="0.5"), ValueError, "beta: expected a number"),
    (dict(weight_t=torch.randn(12, 6), bias_t=None), ValueError, "weight_t: vocabulary of 12 rows, weight_s has 11"),
    (dict(hidden_t=torch.randn(5, 6)), ValueError, "hidden_t: leading dims"),
    (dict(weight_s=torch.randn(11, 7)), ValueError, "weight_s: hidden size"),
    (dict(hidden_s=torch.randn(4, 8, dtype=torch.float64)), TypeError, "weight_s: dtype"),
    (dict(bias_t=torch.randn(3)), ValueError, "bias_t: length"),
    (dict(bias_s=torch.full((11,), float("nan"))), ValueError, "^bias_s: contains NaN"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(mask=torch.ones(3)), ValueError, "mask"),
    (dict(impl="fast"), ValueError, "impl: expected one of"),
    (dict(chunk_size=0), TypeError, "fused_linear_jsd: keyword `chunk_size` is spelled `block_sizes=BlockSizes"),
])
def test_bad_input_names_the_argument(change, error, message):
    student, teacher = _inputs(n=4, vocab=11)
    arguments = {k: v.detach() for k, v in (student | teacher).items()} | dict(beta=0.5)
    with pytest.raises(error, match=message):
        fused_linear_jsd(**(arguments | change))
