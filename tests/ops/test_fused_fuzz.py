"""Property-based fuzzing of every fused op against its materialized oracle (`ops/reference.py`).

Each op gets at least 500 random cases: shapes (no tokens at all, N not a multiple of the chunk, V
prime or tiny), dtypes (fp32 tight; bf16 to the rounding of a result to bf16; both judged against the oracle in
float64 on the same inputs), masks, biases with -inf entries (padded vocabulary rows), temperatures, soft caps,
logit scales,
chunk and vocabulary-block sizes, and for the GRPO loss every option of `GRPOSettings` with gradient
accumulation and ``num_items_in_batch``. Values and the gradients of hidden, weight and bias are compared.
``derandomize`` keeps CI's cases the same from run to run.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logitless import GRPOSettings, fused_grpo_loss, fused_linear_cross_entropy, fused_linear_kl, fused_linear_logprobs
from logitless.ops import BlockSizes, fused_linear_jsd, reference
from logitless.op_settings import GRPO_LOSS_TYPES

FUZZ = settings()  # the session's hypothesis profile (tests/conftest.py): 500 examples each, or 50 in make test-fast


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Thousands of tiny ops: a second thread only adds synchronization (4x slower on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@st.composite
def heads(draw):
    """Random LM-head inputs: hidden (N, H) or (B, T, H), weight, bias, options, targets avoiding -inf rows."""
    dtype = draw(st.sampled_from([torch.float32] * 4 + [torch.bfloat16]))
    batched = draw(st.booleans())
    if batched:
        shape = (draw(st.integers(1, 3)), draw(st.integers(1, 9)))
    else:
        shape = (draw(st.integers(0, 40)),)
    hidden_size, vocab = draw(st.integers(1, 12)), draw(st.integers(2, 300))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    hidden = (torch.randn(*shape, hidden_size, generator=generator) * 0.7).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.7).to(dtype)
    bias_kind = draw(st.sampled_from(["none", "finite", "neg_inf"]))
    bias = None if bias_kind == "none" else (torch.randn(vocab, generator=generator) * 0.5).to(dtype)
    allowed = torch.arange(vocab)
    if bias_kind == "neg_inf":
        padded = torch.rand(vocab, generator=generator) < 0.3
        padded[torch.randint(0, vocab, (1,), generator=generator)] = False  # some row stays sampleable
        bias[padded] = float("-inf")
        allowed = allowed[~padded]
    targets = allowed[torch.randint(0, allowed.numel(), shape, generator=generator)]
    mask = torch.rand(shape, generator=generator) < 0.8
    options = dict(
        temperature=draw(st.floats(0.3, 3.0)), softcap=draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        logit_scale=draw(st.sampled_from([1.0, 1.0, 0.5, 2.0])),
        block_sizes=BlockSizes(tokens=draw(st.one_of(st.none(), st.integers(1, 17))),
                               vocab=draw(st.one_of(st.none(), st.integers(max(1, vocab // 30), 64)))))
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, mask=mask, options=options,
                generator=generator)


def _leaves(case):
    """The differentiable inputs, and float64 copies of them for the oracle (an fp32 oracle is itself off by
    ~1.5e-5 at temperature 0.3, where logits are large)."""
    tensors = [case["hidden"], case["weight"]] + ([case["bias"]] if case["bias"] is not None else [])
    fused = [t.clone().requires_grad_() for t in tensors]
    oracle = [t.detach().double().requires_grad_() for t in tensors]
    return fused, oracle


def _head(leaves):
    return dict(hidden=leaves[0], weight=leaves[1], bias=leaves[2] if len(leaves) > 2 else None)


def _oracle_options(options):
    return {k: v for k, v in options.items() if k != "block_sizes"}


BF16_ROUNDING = torch.finfo(torch.bfloat16).eps  # 2^-7: twice the relative error of rounding a value to bf16


def _assert_matches(got, want, low_precision: bool, tolerance: float = 2e-5, options: dict | None = None):
    """fp32 within ``tolerance`` of the float64 oracle, times the head's logit factor (logit_scale / temperature:
    the logits' fp32 rounding grows with their size, and their gradients with the factor). With bf16 inputs the
    statistics are computed in fp32 from the bf16 values, which the oracle reads exactly, so only the rounding of a
    result to bf16 (the gradients come back in their inputs' dtype) is allowed on top: each entry within 2^-7 of its
    own size."""
    options = options or {}
    tolerance *= max(1.0, options.get("logit_scale", 1.0) / options.get("temperature", 1.0))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        rtol = BF16_ROUNDING if low_precision and g.dtype == torch.bfloat16 else tolerance
        torch.testing.assert_close(g.detach().to(w.dtype), w.detach(), atol=tolerance, rtol=rtol)


def _grads(output, leaves):
    if not output.requires_grad:  # no tokens: nothing reaches the inputs
        return [torch.zeros_like(t) for t in leaves]
    return torch.autograd.grad(output, leaves, allow_unused=True, materialize_grads=True)


@FUZZ
@given(case=heads(), with_mask=st.booleans())
def test_logprobs_and_entropy(case, with_mask):
    fused, oracle = _leaves(case)
    mask = case["mask"] if with_mask else None
    upstream = torch.randn(2, *case["targets"].shape, generator=case["generator"])
    log_probs, entropy = fused_linear_logprobs(**_head(fused), targets=case["targets"], return_token_entropy=True,
                                               mask=mask, **case["options"])
    ref_log_probs, ref_entropy = reference.linear_logprobs(**_head(oracle), targets=case["targets"],
                                                           return_token_entropy=True,
                                                           **_oracle_options(case["options"]))
    if mask is not None:
        ref_log_probs, ref_entropy = ref_log_probs * mask, ref_entropy * mask
    got = [log_probs, entropy, *_grads((log_probs * upstream[0] + entropy * upstream[1]).sum(), fused)]
    want = [ref_log_probs, ref_entropy, *_grads((ref_log_probs * upstream[0] + ref_entropy * upstream[1]).sum(),
                                                oracle)]
    _assert_matches(got, want, case["hidden"].dtype == torch.bfloat16, options=case["options"])


@FUZZ
@given(case=heads(), reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.2]))
def test_cross_entropy(case, reduction, smoothing):
    if (smoothing and case["bias"] is not None and torch.isneginf(case["bias"]).any()
            and case["options"]["softcap"] is None):
        smoothing = 0.0  # smoothing over a -inf logit is an infinite loss, in PyTorch too
    fused, oracle = _leaves(case)
    targets = case["targets"].masked_fill(~case["mask"], -100)
    loss = fused_linear_cross_entropy(**_head(fused), targets=targets, reduction=reduction,
                                      label_smoothing=smoothing, **case["options"])
    logits = reference.linear_logits(**_head(oracle), **{k: v for k, v in case["options"].items()
                                                        if k in ("softcap", "temperature", "logit_scale")})
    want = reference.cross_entropy(logits, targets, reduction=reduction, label_smoothing=smoothing)
    if reduction == "none":
        want = want.reshape(targets.shape)
    upstream = torch.randn(loss.shape, generator=case["generator"])
    if reduction == "mean" and not bool((targets != -100).any()):  # NaN loss, zero gradients, like PyTorch
        assert torch.isnan(loss) and torch.isnan(want)
        assert all(bool((g == 0).all()) for g in _grads(loss, fused))
        return
    _assert_matches([loss, *_grads((loss * upstream).sum(), fused)],
                    [want, *_grads((want * upstream).sum(), oracle)], case["hidden"].dtype == torch.bfloat16,
                    options=case["options"])


@FUZZ
@given(case=heads().filter(lambda c: c["hidden"].dim() == 3), loss_type=st.sampled_from(GRPO_LOSS_TYPES),
       beta=st.sampled_from([0.0, 0.04]), with_old=st.booleans(), with_ref=st.booleans(),
       delta=st.sampled_from([None, 1.5]), epsilons=st.sampled_from([(0.2, 0.2), (0.1, 0.28)]),
       bias_correction=st.booleans(), accumulation=st.sampled_from([1, 3]),
       max_completion_length=st.sampled_from([None, 12]), num_items=st.sampled_from([None, 17]),
       per_token_advantages=st.booleans())
def test_grpo_loss(case, loss_type, beta, with_old, with_ref, delta, epsilons, bias_correction, accumulation,
                   max_completion_length, num_items, per_token_advantages):
    """Every option of the GRPO loss, gradient accumulation and num_items_in_batch included, against the oracle
    transcribed from TRL's formulas (`reference.grpo_loss`, which shares no code with the op)."""
    fused, oracle = _leaves(case)
    generator = case["generator"]
    batch, length = case["targets"].shape
    with torch.no_grad():
        log_probs, _ = reference.linear_logprobs(**_head(oracle), targets=case["targets"],
                                                 **_oracle_options(case["options"]))
    log_probs = log_probs.float()
    settings = GRPOSettings(loss_type=loss_type, beta=beta, epsilon_low=epsilons[0], epsilon_high=epsilons[1],
                            delta=delta, use_bias_correction_kl=bias_correction,
                            max_completion_length=max_completion_length, gradient_accumulation_steps=accumulation)
    kwargs = dict(settings=settings, num_items_in_batch=num_items,
                  old_log_probs=log_probs + 0.3 * torch.randn(batch, length, generator=generator) if with_old else None,
                  ref_log_probs=(log_probs + 0.2 * torch.randn(batch, length, generator=generator)
                                 if with_ref or beta else None))
    advantages = torch.randn((batch, length) if per_token_advantages else (batch,), generator=generator)
    inputs = dict(completion_ids=case["targets"], completion_mask=case["mask"], advantages=advantages)
    loss, metrics = fused_grpo_loss(fused[0], fused[1], bias=_head(fused)["bias"], **inputs, **kwargs,
                                    **case["options"])
    want, want_metrics = reference.grpo_loss(oracle[0], oracle[1], bias=_head(oracle)["bias"], **inputs, **kwargs,
                                             **_oracle_options(case["options"]))
    low_precision = case["hidden"].dtype == torch.bfloat16
    _assert_matches([loss, *_grads(loss, fused)], [want, *_grads(want, oracle)], low_precision,
                    options=case["options"])
    assert metrics.keys() == want_metrics.keys()
    if not low_precision:
        for name, value in metrics.items():
            assert value == pytest.approx(want_metrics[name], abs=2e-5, rel=2e-5, nan_ok=True), name


@FUZZ
@given(case=heads(), teacher_size=st.integers(1, 10), with_mask=st.booleans())
def test_kl(case, teacher_size, with_mask):
    # the q side: another hidden size, its own bias (with -inf entries where the p side has them, plus others)
    fused, oracle = _leaves(case)
    generator, dtype = case["generator"], case["hidden"].dtype
    hidden_q = (torch.randn(*case["hidden"].shape[:-1], teacher_size, generator=generator) * 0.7).to(dtype)
    weight_q = (torch.randn(case["weight"].shape[0], teacher_size, generator=generator) * 0.7).to(dtype)
    bias_q = None if case["bias"] is None else case["bias"] + torch.randn(case["bias"].shape, generator=generator).to(
        dtype)
    options = {k: v for k, v in case["options"].items() if k in ("temperature", "block_sizes")}
    mask = case["mask"] if with_mask else None
    kl = fused_linear_kl(fused[0], fused[1], hidden_q, weight_q, bias_p=_head(fused)["bias"], bias_q=bias_q,
                         mask=mask, **options)
    log_p, log_q = (torch.log_softmax(reference.linear_logits(h.double(), w.double(), None if b is None else b.double(),
                                                              temperature=options["temperature"]), -1)
                    for h, w, b in ((oracle[0], oracle[1], _head(oracle)["bias"]), (hidden_q, weight_q, bias_q)))
    taken = log_p.exp() > 0  # 0 * log(0 / q) = 0
    want = (log_p.exp() * torch.where(taken, log_p - log_q, 0.0)).sum(-1)
    if mask is not None:
        want = want * mask
    upstream = torch.randn(want.shape, generator=generator)
    _assert_matches([kl, *_grads((kl * upstream).sum(), fused)],
                    [want, *_grads((want * upstream.double()).sum(), oracle)], dtype == torch.bfloat16, 5e-5,
                    options)


@FUZZ
@given(case=heads(), teacher_size=st.integers(1, 10), with_mask=st.booleans(),
       beta=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.01, 0.99)))
def test_jsd(case, teacher_size, with_mask, beta):
    # the teacher: another hidden size, its own bias (with -inf entries where the student's are)
    fused, oracle = _leaves(case)
    generator, dtype = case["generator"], case["hidden"].dtype
    hidden_t = (torch.randn(*case["hidden"].shape[:-1], teacher_size, generator=generator) * 0.7).to(dtype)
    weight_t = (torch.randn(case["weight"].shape[0], teacher_size, generator=generator) * 0.7).to(dtype)
    bias_t = None if case["bias"] is None else case["bias"] + torch.randn(case["bias"].shape, generator=generator).to(
        dtype)
    options = case["options"]
    head_options = _oracle_options(options)
    mask = case["mask"] if with_mask else None
    divergence = fused_linear_jsd(fused[0], fused[1], hidden_t, weight_t, bias_s=_head(fused)["bias"], bias_t=bias_t,
                                  beta=beta, mask=mask, **options)
    log_p_s, log_p_t = (torch.log_softmax(reference.linear_logits(h.double(), w.double(), None if b is None
                                                                  else b.double(), **head_options), -1)
                        for h, w, b in ((oracle[0], oracle[1], _head(oracle)["bias"]), (hidden_t, weight_t, bias_t)))
    want = reference.generalized_jsd(log_p_s, log_p_t, beta)
    if mask is not None:
        want = want * mask
    upstream = torch.randn(want.shape, generator=generator)
    _assert_matches([divergence, *_grads((divergence * upstream).sum(), fused)],
                    [want, *_grads((want * upstream.double()).sum(), oracle)], dtype == torch.bfloat16, 5e-5,
                    options)
