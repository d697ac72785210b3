"""logitless.jax's ops of one head (log-probs, cross-entropy, the GRPO loss) against the PyTorch ops (values,
gradients, metrics; the tests marked ``torch``) and the plain-JAX oracle; check_grads in float64, -inf logits, bf16,
masks, jit, the memory
design, the API's spellings and bad input.

One small shape throughout (V prime; blocks of 16 columns and 8 rows leave ragged ends on both axes),
so the few distinct programs compile once.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from jax_helpers import assert_close

import logitless
from logitless.jax import BlockSizes, Head, fused_grpo_loss, fused_linear_cross_entropy, fused_linear_logprobs
from logitless.jax import reference
from logitless.jax.blocks import jax_block_sizes
from logitless.jax.engine import Plan
from logitless.jax.fused import linear_stats
from logitless.jax.softmax import SoftmaxAccumulator

pytestmark = pytest.mark.jax_alone  # `make test` runs this file's tests in its JAX-only environment

B, T, H, V = 3, 7, 16, 61
BLOCKS = BlockSizes(vocab=16, tokens=8)


def grpo_inputs(seed: int = 0) -> dict:
    """NumPy inputs; masked positions hold junk (id -100, NaN old log-prob) that must not matter."""
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), bool)
    mask[0, 4:] = False
    mask[1, 0] = False
    mask[2, :] = False  # a sequence without tokens
    ids = rng.integers(0, V, (B, T))
    hidden = rng.standard_normal((B, T, H)).astype(np.float32)
    weight = (rng.standard_normal((V, H)) * 0.3).astype(np.float32)
    logits = hidden @ weight.T
    log_probs = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), ids[..., None], -1)[..., 0]
    # old and reference policies a little off the current one: ratios from about 0.7 to 1.4, some clipped
    old = (log_probs + 0.2 * rng.standard_normal((B, T))).astype(np.float32)
    ref = (log_probs + 0.1 * rng.standard_normal((B, T))).astype(np.float32)
    ids[~mask] = -100
    old[~mask] = np.nan
    return dict(hidden=hidden, weight=weight, completion_ids=ids, completion_mask=mask,
                advantages=rng.standard_normal(B).astype(np.float32),
                per_token_advantages=rng.standard_normal((B, T)).astype(np.float32), old_log_probs=old,
                ref_log_probs=ref)


def torch_grpo(inputs, **options):
    import torch

    hidden, weight = (torch.tensor(inputs[k], requires_grad=True) for k in ("hidden", "weight"))
    arrays = {k: None if inputs.get(k) is None else torch.tensor(inputs[k])
              for k in ("completion_ids", "completion_mask", "advantages", "old_log_probs", "ref_log_probs")}
    loss, metrics = logitless.fused_grpo_loss(hidden, weight, arrays["completion_ids"],
                            arrays["completion_mask"], arrays["advantages"], old_log_probs=arrays["old_log_probs"],
                            ref_log_probs=arrays["ref_log_probs"], **options)
    loss.backward()
    return loss.item(), metrics, hidden.grad.numpy(), weight.grad.numpy()


def jax_grpo(inputs, **options):
    def loss(hidden, weight):
        return fused_grpo_loss(hidden, weight, inputs["completion_ids"], inputs["completion_mask"],
                               inputs["advantages"], old_log_probs=inputs.get("old_log_probs"),
                               ref_log_probs=inputs.get("ref_log_probs"), block_sizes=BLOCKS, **options)

    (value, metrics), (grad_hidden, grad_weight) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jnp.asarray(inputs["hidden"]), jnp.asarray(inputs["weight"]))
    return float(value), {k: float(v) for k, v in metrics.items()}, np.asarray(grad_hidden), np.asarray(grad_weight)


GRPO_CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo-kl-old-per-token-advantages": dict(loss_type="bnpo", beta=0.1, per_token=True, temperature=0.9),
    "dr_grpo-kl-old-delta-bias-correction": dict(loss_type="dr_grpo", beta=0.04, delta=1.02,
                                                 use_bias_correction_kl=True, temperature=1.3,
                                                 max_completion_length=9),
    "dapo-kl-old-items-accumulation": dict(loss_type="dapo", beta=0.04, num_items_in_batch=20,
                                           gradient_accumulation_steps=2, epsilon_low=0.1, epsilon_high=0.28,
                                           temperature=1.1),
    "grpo-kl-old-scale-softcap": dict(loss_type="grpo", beta=0.04, logit_scale=2.5, softcap=3.0, temperature=0.9),
    "bnpo-kl-old-reference": dict(loss_type="bnpo", beta=0.04, impl="reference", logit_scale=1.5),
}


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("case", GRPO_CASES)
def test_grpo_loss_matches_pytorch(case):
    options = dict(GRPO_CASES[case])
    inputs = grpo_inputs()
    if options.pop("per_token", False):
        inputs["advantages"] = inputs["per_token_advantages"]
    if "beta" not in options:  # on-policy without KL: no old or reference log-probs
        inputs["old_log_probs"] = inputs["ref_log_probs"] = None
    jax_impl = options.pop("impl", "auto")
    expected, got = torch_grpo(inputs, **options), jax_grpo(inputs, impl=jax_impl, **options)
    assert got[0] == pytest.approx(expected[0], abs=1e-5)
    assert set(got[1]) == set(expected[1])
    for name, value in expected[1].items():
        assert got[1][name] == pytest.approx(value, abs=1e-5, nan_ok=True), name
    np.testing.assert_allclose(got[2], expected[2], atol=1e-5)  # d hidden
    np.testing.assert_allclose(got[3], expected[3], atol=1e-5)  # d weight
    assert np.abs(expected[3]).max() > 1e-3  # the comparison saw real gradients
    assert not math.isnan(got[1]["clip_ratio/low_min"])  # the empty sequence is left out, not NaN


def test_grpo_settings_equal_the_keywords_and_a_disagreeing_keyword_is_named():
    inputs = grpo_inputs()
    options = dict(loss_type="dr_grpo", beta=0.04, delta=1.02, max_completion_length=9)
    settings = logitless.jax.GRPOSettings(**options)
    assert settings == logitless.GRPOSettings(**options)
    by_settings, by_keywords = jax_grpo(inputs, settings=settings), jax_grpo(inputs, **options)
    assert by_settings[:2] == by_keywords[:2]
    with pytest.raises(ValueError, match="delta: 1.5 disagrees with settings.delta = 1.02"):
        jax_grpo(inputs, settings=settings, delta=1.5)


LOGPROB_CASES = {
    "batched-bias-mask-temperature": dict(temperature=0.7, bias=True, mask=True),
    "flat-default-blocks-softcap": dict(flat=True, softcap=2.0),
    "batched-scale-bias-mask-temperature-head": dict(logit_scale=1.7, temperature=0.7, bias=True, mask=True,
                                                     whole_head=True),
    "reference-scale-softcap-bias-temperature": dict(logit_scale=2.5, softcap=2.0, bias=True, temperature=1.3,
                                                     jax_impl="reference"),
}


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("case", LOGPROB_CASES)
def test_logprobs_and_entropy_match_pytorch(case):
    import torch

    options = dict(LOGPROB_CASES[case])
    inputs = grpo_inputs(seed=1)
    rng = np.random.default_rng(2)
    hidden, weight, targets = inputs["hidden"], inputs["weight"], inputs["completion_ids"]
    mask = inputs["completion_mask"] if options.pop("mask", False) else None
    if mask is None:
        targets = np.where(targets < 0, 0, targets)
    bias = rng.standard_normal(V).astype(np.float32) if options.pop("bias", False) else None
    impl, whole_head = options.pop("jax_impl", "auto"), options.pop("whole_head", False)
    if options.pop("flat", False):
        hidden, targets = hidden.reshape(-1, H), targets.reshape(-1)
        blocks = None
    else:
        blocks = BLOCKS
    weights = [rng.standard_normal(targets.shape).astype(np.float32) for _ in range(2)]

    th, tw = torch.tensor(hidden, requires_grad=True), torch.tensor(weight, requires_grad=True)
    tb = None if bias is None else torch.tensor(bias, requires_grad=True)
    log_probs, entropy = logitless.fused_linear_logprobs(th, tw, torch.tensor(targets), bias=tb,
                                 return_token_entropy=True, mask=None if mask is None else torch.tensor(mask),
                                 **options)
    (log_probs * torch.tensor(weights[0]) + entropy * torch.tensor(weights[1])).sum().backward()

    def loss(hidden, weight, bias):
        parts = dict(bias=bias, **options)
        head = dict(head=Head(weight, **parts)) if whole_head else dict(weight=weight, **parts)
        lp, ent = fused_linear_logprobs(hidden, targets=targets, return_token_entropy=True, mask=mask,
                                        block_sizes=blocks, impl=impl, **head)
        return (lp * weights[0] + ent * weights[1]).sum(), (lp, ent)

    argnums = (0, 1) if bias is None else (0, 1, 2)
    (_, (lp, ent)), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
        jnp.asarray(hidden), jnp.asarray(weight), None if bias is None else jnp.asarray(bias))
    assert lp.shape == ent.shape == targets.shape and lp.dtype == jnp.float32
    assert_close(lp, log_probs)
    assert_close(ent, entropy)
    for grad, tensor in zip(grads, (th, tw, tb)):
        assert_close(grad, tensor.grad)
    if mask is not None:
        assert (np.asarray(lp)[~mask] == 0).all() and (np.asarray(ent)[~mask] == 0).all()


CROSS_ENTROPY_CASES = {
    "mean-ignore-index-bias-temperature": dict(bias=True, temperature=0.8),
    "sum-smoothing-softcap-scale": dict(reduction="sum", label_smoothing=0.1, softcap=3.0, logit_scale=1.5),
    "none-smoothing-other-ignore-index": dict(reduction="none", label_smoothing=0.2, ignore_index=7),
    "mean-smoothing-reference": dict(label_smoothing=0.05, bias=True, jax_impl="reference"),
}


@pytest.mark.torch
@pytest.mark.parametrize("case", CROSS_ENTROPY_CASES)
def test_cross_entropy_matches_pytorch(case):
    """Against logitless's PyTorch op and torch.nn.functional.cross_entropy of the materialized logits."""
    import torch

    options = dict(CROSS_ENTROPY_CASES[case])
    inputs = grpo_inputs(seed=9)
    rng = np.random.default_rng(10)
    hidden, weight = inputs["hidden"], inputs["weight"]
    ignore_index = options.get("ignore_index", -100)
    targets = np.where(inputs["completion_mask"], inputs["completion_ids"], ignore_index)
    targets[1, 2] = 7  # an ordinary id, or the ignored one
    bias = rng.standard_normal(V).astype(np.float32) if options.pop("bias", False) else None
    impl = options.pop("jax_impl", "auto")
    cotangent = rng.standard_normal(targets.shape).astype(np.float32)  # for reduction="none"

    th, tw = torch.tensor(hidden, requires_grad=True), torch.tensor(weight, requires_grad=True)
    tb = None if bias is None else torch.tensor(bias, requires_grad=True)
    expected = logitless.fused_linear_cross_entropy(th, tw, torch.tensor(targets), bias=tb, **options)
    head_options = {k: options.pop(k) for k in ("temperature", "softcap", "logit_scale") if k in options}
    logits = logitless.ops.reference.linear_logits(torch.tensor(hidden), torch.tensor(weight),
                                                   None if bias is None else torch.tensor(bias), **head_options)
    plain = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.tensor(targets).reshape(-1), **options)
    (expected * (torch.tensor(cotangent) if expected.dim() else 1)).sum().backward()

    def loss(hidden, weight, bias):
        value = fused_linear_cross_entropy(hidden, weight, targets, bias=bias, block_sizes=BLOCKS, impl=impl,
                                           **options, **head_options)
        return (value * (cotangent if value.ndim else 1)).sum(), value

    argnums = (0, 1) if bias is None else (0, 1, 2)
    (_, value), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
        jnp.asarray(hidden), jnp.asarray(weight), None if bias is None else jnp.asarray(bias))
    assert_close(value, expected)
    assert_close(value.reshape(-1), plain.detach().reshape(-1))
    for grad, tensor in zip(grads, (th, tw, tb)):
        assert_close(grad, tensor.grad)
    assert np.abs(np.asarray(grads[1])).max() > 1e-3


def test_cross_entropy_of_no_tokens_is_nan_with_zero_gradients():
    hidden, weight = jnp.ones((4, H)), jnp.ones((V, H))
    step = jax.jit(jax.value_and_grad(fused_linear_cross_entropy, argnums=(0, 1)))
    value, grads = step(hidden, weight, jnp.full(4, -100))
    assert np.isnan(value) and all((np.asarray(g) == 0).all() for g in grads)


def test_minus_inf_logits_are_exact():
    """Padded vocabulary rows (bias -inf): 0 * log 0 = 0 in the entropy and its gradient; those rows get
    no gradient. (PyTorch's ops give a NaN entropy here, so the oracle is the entropy over the finite
    columns.)"""
    inputs = grpo_inputs(seed=8)
    hidden, weight = jnp.asarray(inputs["hidden"]), jnp.asarray(inputs["weight"])
    padded = [5, 17, 60]
    bias = np.zeros(V, np.float32)
    bias[padded] = -np.inf
    targets = np.where(np.isin(inputs["completion_ids"], padded) | (inputs["completion_ids"] < 0), 1,
                       inputs["completion_ids"])

    def loss(hidden, weight, bias, impl):
        lp, ent = fused_linear_logprobs(hidden, weight, targets, bias=jnp.asarray(bias), return_token_entropy=True,
                                        temperature=0.7, block_sizes=BLOCKS, impl=impl)
        return lp.sum() + 2 * ent.sum(), (lp, ent)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, (lp, ent)), grads = step(hidden, weight, bias, "auto")
    finite = np.setdiff1d(np.arange(V), padded)
    logits = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64)[finite].T / 0.7
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(ent, -(np.exp(log_p) * log_p).sum(-1), atol=1e-5)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert (np.asarray(grads[1])[padded] == 0).all() and (np.asarray(grads[2])[padded] == 0).all()
    _, expected = step(hidden, weight, bias, "reference")
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_token_stats_check_grads_float64():
    """The three statistics of the softmax accumulator (log-prob, entropy, mean log-prob), differentiated in hidden,
    weight and bias."""
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        hidden, weight = jnp.asarray(rng.standard_normal((5, 3))), jnp.asarray(rng.standard_normal((11, 3)))
        bias, targets = jnp.asarray(rng.standard_normal(11)), jnp.asarray([0, 10, 3, 4, 10])
        weights = jnp.asarray(rng.standard_normal((3, 5)))
        plan = Plan(BlockSizes(vocab=4, tokens=2), 11)

        def stats_loss(hidden, weight, bias):
            head = Head(weight, bias=bias, temperature=0.8, softcap=1.5, logit_scale=2.5)
            stats = linear_stats(SoftmaxAccumulator(11, True, True), plan, (head,), (hidden,), targets)
            assert stats[0].dtype == jnp.float64
            return sum((stat * row_weights).sum() for stat, row_weights in zip(stats, weights))

        check_grads(jax.jit(stats_loss), (hidden, weight, bias), order=1, modes=["rev"])


def test_grpo_loss_check_grads_float64():
    head_options = dict(logit_scale=1.3, temperature=0.9)
    with jax.enable_x64(True):
        inputs = {k: jnp.asarray(v.astype(np.float64)) if v.dtype == np.float32 else jnp.asarray(v)
                  for k, v in grpo_inputs(seed=4).items()}
        hidden, weight = inputs["hidden"][..., :4], inputs["weight"][:, :4]
        log_probs = fused_linear_logprobs(hidden, weight, inputs["completion_ids"], mask=inputs["completion_mask"],
                                          **head_options)
        old = log_probs + 0.05 * inputs["per_token_advantages"]  # ratios near 1, away from the clip's kinks

        def grpo(hidden, weight):
            return fused_grpo_loss(hidden, weight, inputs["completion_ids"], inputs["completion_mask"],
                                   inputs["advantages"], old_log_probs=old, ref_log_probs=inputs["ref_log_probs"],
                                   beta=0.04, block_sizes=BLOCKS, **head_options)[0]

        check_grads(jax.jit(grpo), (hidden, weight), order=1, modes=["rev"])


def test_bf16_inputs_keep_fp32_statistics():
    inputs = grpo_inputs(seed=5)
    hidden, weight = (jnp.asarray(inputs[k], jnp.bfloat16) for k in ("hidden", "weight"))
    targets = np.where(inputs["completion_ids"] < 0, 0, inputs["completion_ids"])

    def loss(hidden, weight, impl):
        lp, ent = fused_linear_logprobs(hidden, weight, targets, return_token_entropy=True, block_sizes=BLOCKS,
                                        impl=impl)
        return lp.sum() + ent.sum(), (lp, ent)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (_, (lp, ent)), (grad_hidden, grad_weight) = step(hidden, weight, "auto")
    assert lp.dtype == ent.dtype == jnp.float32
    assert grad_hidden.dtype == grad_weight.dtype == jnp.bfloat16
    # the same bf16 numbers in fp32, materialized: only the bf16 matmul inputs differ
    (_, (lp32, ent32)), grads32 = step(hidden.astype(jnp.float32), weight.astype(jnp.float32), "reference")
    np.testing.assert_allclose(lp, lp32, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, ent32, atol=2e-5, rtol=1e-5)
    for grad, grad32 in zip((grad_hidden, grad_weight), grads32):  # one bf16 rounding of the result
        np.testing.assert_allclose(grad.astype(jnp.float32), grad32, rtol=1e-2, atol=1e-2)


def test_under_jit_bad_ids_give_nan_and_an_empty_batch_gives_zero_gradients():
    inputs = grpo_inputs(seed=6)
    hidden, weight = jnp.asarray(inputs["hidden"]), jnp.asarray(inputs["weight"])
    ids = np.where(inputs["completion_ids"] < 0, 0, inputs["completion_ids"])
    ids[0, 0], ids[0, 1] = V, -1  # out of range, where the values cannot be checked
    log_probs = jax.jit(lambda h, w, t: fused_linear_logprobs(h, w, t, block_sizes=BLOCKS))(hidden, weight, ids)
    assert np.isnan(log_probs[0, :2]).all() and np.isfinite(log_probs[0, 2:]).all()

    @jax.jit
    def step(hidden, weight, mask):
        return jax.value_and_grad(lambda h, w: fused_grpo_loss(h, w, ids, mask, inputs["advantages"],
                                                               block_sizes=BLOCKS), argnums=(0, 1), has_aux=True)(
            hidden, weight)

    (loss, metrics), grads = step(hidden, weight, np.zeros((B, T), bool))
    assert float(loss) == 0.0 and all((np.asarray(g) == 0).all() for g in grads)
    assert np.isnan(metrics["clip_ratio/low_min"]) and float(metrics["entropy"]) == 0.0


def test_a_head_is_a_pytree_whose_gradient_is_a_head():
    inputs = grpo_inputs(seed=11)
    targets = np.where(inputs["completion_ids"] < 0, 0, inputs["completion_ids"])
    head = Head(jnp.asarray(inputs["weight"]), bias=jnp.zeros(V), temperature=0.9, softcap=4.0)

    def loss(head, impl):
        return fused_linear_cross_entropy(inputs["hidden"], targets=targets, head=head, block_sizes=BLOCKS, impl=impl)

    head_grad = jax.jit(jax.grad(loss), static_argnums=1)
    grad, expected = head_grad(head, "auto"), head_grad(head, "reference")
    assert isinstance(grad, Head) and (grad.temperature, grad.softcap) == (0.9, 4.0)
    assert_close(grad.weight, expected.weight)
    assert_close(grad.bias, expected.bias)


def test_memory_design_compiled_temporaries():
    """No weight-sized fp32 buffer (a dW accumulator, an fp32 copy of a bf16 weight) in the compiled step."""
    from logitless.bench.jax import Shape, compile_step, memory_of

    shape = Shape(batch=1, seq=256, hidden=64, vocab=32003, dtype="bfloat16", vocab_block=512)
    logitless, plain = (memory_of(compile_step("grpo", impl, shape))["temp_size_in_bytes"]
                        for impl in ("logitless", "plain"))
    assert logitless < shape.vocab * shape.hidden * 4 / 2
    assert logitless < 0.1 * plain


def _bad(**changes):
    inputs = grpo_inputs()
    inputs["completion_ids"] = np.where(inputs["completion_ids"] < 0, 0, inputs["completion_ids"])
    inputs.pop("per_token_advantages")
    args = {k: jnp.asarray(v) for k, v in inputs.items()}
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, error, match", [
    (dict(loss_type="ppo"), ValueError, "loss_type: expected one of"),
    (dict(hidden=np.zeros((B * T, H), np.float32)), ValueError, "hidden: expected 3 dimensions"),
    (dict(weight=np.zeros((V, H + 1), np.float32)), ValueError, "weight: hidden size 17"),
    (dict(weight=np.zeros((V, H), np.float16)), TypeError, "weight: dtype float16 differs"),
    (dict(weight=None), TypeError, r"weight: required \(or the whole head as head=Head"),
    (dict(hidden=np.zeros((B, T, H), np.int32)), TypeError, "hidden: expected a floating-point array"),
    (dict(completion_ids=np.zeros((B, T), np.float32)), TypeError, "completion_ids: expected an integer array"),
    (dict(completion_ids=np.full((B, T), V)), ValueError, r"completion_ids: token ids must lie in \[0, 61\)"),
    (dict(completion_ids=np.zeros((B, T + 1), np.int32)), ValueError, "completion_ids: shape"),
    (dict(completion_mask=np.full((B, T), 2.0)), ValueError, "completion_mask: expected a bool or 0/1 mask"),
    (dict(completion_mask=None), TypeError, "completion_mask: expected a \\(B, T\\) mask"),
    (dict(advantages=np.zeros((B + 1,), np.float32)), ValueError, "advantages: expected"),
    (dict(advantages=np.array([0.0, np.nan, 1.0], np.float32)), ValueError, "advantages: contains NaN"),
    (dict(old_log_probs=np.zeros((B, T + 1), np.float32)), ValueError, "old_log_probs: shape"),
    (dict(ref_log_probs=None, beta=0.1), ValueError, "ref_log_?probs: required when beta"),
    (dict(beta=-1.0), ValueError, "beta: expected a finite number >= 0"),
    (dict(beta=float("nan")), ValueError, "beta: expected a finite number >= 0"),
    (dict(old_log_probs=np.full((B, T), np.nan, np.float32)), ValueError, "old_log_probs: NaN"),
    (dict(old_logprobs=np.zeros((B, T), np.float32)), TypeError, "keyword `old_logprobs` is spelled `old_log_probs`"),
    (dict(temperature=0.0), ValueError, "temperature: expected a finite number > 0"),
    (dict(logit_scale=-2.0), ValueError, "logit_scale: expected a finite number > 0"),
    (dict(bias=np.zeros(V + 1, np.float32)), ValueError, "bias: length 62"),
    (dict(bias=np.full(V, np.nan, np.float32)), ValueError, r"bias: contains NaN or \+inf"),
    (dict(block_sizes=BlockSizes), TypeError, "block_sizes: expected a BlockSizes"),
    (dict(impl="fused"), ValueError, "impl: 'fused' is spelled 'auto' \\(or 'chunked'\\); 'materialized' is "
                                     "'reference'"),
    (dict(impl="materialized"), ValueError, "'materialized' is 'reference'"),
    (dict(impl="triton"), ValueError,
     r"impl: expected one of 'auto', 'reference', 'chunked', got 'triton' \(the Triton kernels run in PyTorch only\)"),
    (dict(impl="fast"), ValueError, "impl: expected one of 'auto', 'reference', 'chunked', got 'fast'"),
    (dict(head=Head(jnp.zeros((V, H))), temperature=0.5), TypeError,
     "fused_grpo_loss: `head` is given with `weight`, `temperature`; give the head whole"),
    (dict(hidden=[[0.0] * H] * T), TypeError, "hidden: expected a jax.Array, got list"),
    (dict(num_items_in_batch=0), ValueError, "num_items_in_batch: expected a finite number > 0"),
])
def test_bad_input_names_the_argument(changes, error, match):
    args = _bad(**changes)
    with pytest.raises(error, match=match):
        fused_grpo_loss(args.pop("hidden"), args.pop("weight"), args.pop("completion_ids"), args.pop("completion_mask"),
                        args.pop("advantages"), **args)


@pytest.mark.parametrize("options, error, match", [
    (dict(reduction="avg"), ValueError, "reduction: expected one of"),
    (dict(label_smoothing=1.5), ValueError, r"label_smoothing: expected a number in \[0, 1\]"),
    (dict(ignore_index=-1.0), TypeError, "ignore_index: expected an int"),
    (dict(targets=None), TypeError, "targets: expected an integer array"),
    (dict(return_token_entropy=True), TypeError, "fused_linear_cross_entropy: unknown keyword `return_token_entropy`"),
])
def test_cross_entropy_bad_options(options, error, match):
    arguments = {"targets": jnp.zeros(4, jnp.int32), **options}
    with pytest.raises(error, match=match):
        fused_linear_cross_entropy(jnp.zeros((4, H)), jnp.zeros((V, H)), **arguments)


def test_block_sizes_are_the_pytorch_class_with_jax_defaults():
    assert BlockSizes is logitless.ops.BlockSizes
    assert jax_block_sizes(BlockSizes(), num_tokens=8192, vocab_size=151936) == BlockSizes(tokens=8192, vocab=2048)
    assert jax_block_sizes(BlockSizes(tokens=5), num_tokens=3, vocab_size=61) == BlockSizes(tokens=3, vocab=61)
    # sharded: each device holds its part of a block
    assert jax_block_sizes(BlockSizes(), 8192, 151936, token_shards=2, vocab_shards=4) == BlockSizes(4096, 512)
    assert jax_block_sizes(BlockSizes(tokens=5, vocab=7), 8, 16, token_shards=2, vocab_shards=4) == BlockSizes(3, 2)


def test_bad_block_sizes_and_logprob_mask():
    with pytest.raises(ValueError, match="block_sizes.vocab: expected a positive int"):
        BlockSizes(vocab=0)
    hidden, weight = jnp.zeros((4, H)), jnp.zeros((V, H))
    with pytest.raises(ValueError, match="mask: shape"):
        fused_linear_logprobs(hidden, weight, jnp.zeros(4, jnp.int32), mask=jnp.ones(5, bool))
    with pytest.raises(ValueError, match="targets: token ids"):  # only kept ids are checked
        fused_linear_logprobs(hidden, weight, jnp.array([0, 1, V, -100]), mask=jnp.array([1, 1, 1, 0]))
    assert fused_linear_logprobs(hidden, weight, jnp.array([0, 1, 2, -100]), mask=jnp.array([1, 1, 1, 0]))[3] == 0


def _temperature_before_cap(head, hidden, dtype=None):
    """`Head.logits` gone wrong: the temperature divides before the soft cap instead of after it."""
    raw = jnp.matmul(hidden, head.weight.T, preferred_element_type=dtype) * head.logit_scale / head.temperature
    return head.softcap * jnp.tanh(raw / head.softcap)


def test_the_oracle_catches_a_head_transform_in_the_wrong_order(monkeypatch):
    """The plain-JAX oracle builds its logits from the head's fields, sharing no code with `Head.logits`, which the
    engine runs: a head transform applied in the wrong order there makes the op and its oracle disagree (with
    the oracle on `Head.logits` they agreed)."""
    rng = np.random.default_rng(5)
    hidden, weight = jnp.asarray(rng.standard_normal((5, H)), jnp.float32), jnp.asarray(rng.standard_normal((V, H)))
    targets = jnp.asarray(rng.integers(0, V, 5))
    head = Head(weight, temperature=0.6, softcap=2.5)
    right = fused_linear_logprobs(hidden, targets=targets, head=head, block_sizes=BLOCKS, impl="chunked")
    monkeypatch.setattr(Head, "logits", _temperature_before_cap)
    wrong, oracle = (fused_linear_logprobs(hidden, targets=targets, head=head, block_sizes=BLOCKS, impl=impl)
                     for impl in ("chunked", "reference"))
    assert_close(oracle, right)
    assert not np.allclose(wrong, oracle, atol=1e-2)


def test_stats_equal_the_plain_jax_oracle_for_any_block_sizes():
    rng = np.random.default_rng(7)
    hidden, weight = jnp.asarray(rng.standard_normal((10, H)), jnp.float32), jnp.asarray(rng.standard_normal((V, H)))
    targets = jnp.asarray(rng.integers(0, V, 10))
    expected = reference.token_stats(Head(weight), hidden, targets)
    for blocks in (BlockSizes(vocab=1, tokens=3), BlockSizes(vocab=61), BlockSizes(vocab=1000, tokens=1000)):
        plan = Plan(jax_block_sizes(blocks, 10, V), V)
        got = linear_stats(SoftmaxAccumulator(V, True, True), plan, (Head(weight),), (hidden,), targets)
        for got_stat, want in zip(got, (expected.log_probs, expected.entropy, expected.mean_log_prob)):
            np.testing.assert_allclose(got_stat, want, atol=1e-5)
