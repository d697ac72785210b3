"""logitless.jax's ops of two heads, the KL and TRL's generalized JSD, against the PyTorch ops (the student's values
and gradients; the tests marked ``torch``) and the plain-JAX oracle (the teacher's gradient, which JAX computes only
where it is asked for); check_grads in float64, heads given whole, bad input.

The teacher has another hidden size than the student; V is prime and the blocks leave ragged ends on both axes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from jax_helpers import assert_close

import logitless
from logitless.jax import BlockSizes, Head, fused_linear_jsd, fused_linear_kl

pytestmark = pytest.mark.jax_alone  # `make test` runs this file's tests in its JAX-only environment

B, T, H_S, H_T, V = 2, 5, 12, 20, 61
BLOCKS = BlockSizes(vocab=16, tokens=4)


def two_heads(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), bool)
    mask[1, 3:] = False
    return dict(hidden_s=rng.standard_normal((B, T, H_S)).astype(np.float32),
                weight_s=(rng.standard_normal((V, H_S)) * 0.4).astype(np.float32),
                bias_s=(rng.standard_normal(V) * 0.5).astype(np.float32),
                hidden_t=rng.standard_normal((B, T, H_T)).astype(np.float32),
                weight_t=(rng.standard_normal((V, H_T)) * 0.4).astype(np.float32),
                bias_t=(rng.standard_normal(V) * 0.5).astype(np.float32), mask=mask,
                cotangent=rng.standard_normal((B, T)).astype(np.float32))


CASES = {
    "kl": dict(op="kl"),
    "kl-bias-mask-scale-softcap-temperature": dict(op="kl", bias=True, mask=True, logit_scale=1.5, softcap=4.0,
                                                   temperature=0.8),
    "jsd-forward-kl-mask": dict(op="jsd", beta=0.0, mask=True),
    "jsd-mixture-bias-temperature": dict(op="jsd", beta=0.4, bias=True, temperature=1.2),
    "jsd-reverse-kl-softcap-scale": dict(op="jsd", beta=1.0, softcap=3.0, logit_scale=2.0),
    "jsd-mixture-reference": dict(op="jsd", beta=0.7, mask=True, jax_impl="reference"),
}
SIDES = {"kl": ("p", "q"), "jsd": ("s", "t")}


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("case", CASES)
def test_student_values_and_gradients_match_pytorch(case):
    import torch

    options = dict(CASES[case])
    op, impl = options.pop("op"), options.pop("jax_impl", "auto")
    student, teacher = SIDES[op]
    inputs = two_heads(seed=len(case))
    biased, masked = options.pop("bias", False), options.pop("mask", False)
    if op == "jsd":
        options["return_token_entropy"] = True

    def arrays(convert, side_names=("s", "t")):
        named = {f"hidden_{side}": convert(inputs[f"hidden_{name}"]) for side, name in zip((student, teacher),
                                                                                            side_names)}
        named.update({f"weight_{side}": convert(inputs[f"weight_{name}"])
                      for side, name in zip((student, teacher), side_names)})
        if biased:
            named.update({f"bias_{side}": convert(inputs[f"bias_{name}"])
                          for side, name in zip((student, teacher), side_names)})
        return named

    torch_arrays = arrays(torch.tensor)
    for name in (f"hidden_{student}", f"weight_{student}", f"bias_{student}"):
        if name in torch_arrays:
            torch_arrays[name].requires_grad_()
    torch_op = logitless.fused_linear_kl if op == "kl" else logitless.fused_linear_jsd
    expected = torch_op(mask=torch.tensor(inputs["mask"]) if masked else None, **torch_arrays, **options)
    expected_divergence, expected_entropy = expected if op == "jsd" else (expected, None)
    (expected_divergence * torch.tensor(inputs["cotangent"])).sum().backward()

    jax_op = fused_linear_kl if op == "kl" else fused_linear_jsd
    student_names = [name for name in (f"hidden_{student}", f"weight_{student}", f"bias_{student}")
                     if name in torch_arrays]

    def loss(student_arrays, fixed):
        got = jax_op(**student_arrays, **fixed, mask=inputs["mask"] if masked else None, block_sizes=BLOCKS, impl=impl,
                     **options)
        divergence = got[0] if op == "jsd" else got
        return (divergence * inputs["cotangent"]).sum(), got

    jax_arrays = arrays(jnp.asarray)
    student_arrays = {name: jax_arrays.pop(name) for name in student_names}
    (_, got), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(student_arrays, jax_arrays)
    divergence, entropy = got if op == "jsd" else (got, None)
    assert divergence.shape == (B, T) and divergence.dtype == jnp.float32
    assert_close(divergence, expected_divergence)
    assert_close(entropy, expected_entropy)
    for name in student_names:
        assert_close(grads[name], torch_arrays[name].grad, what=name)
    assert np.abs(np.asarray(grads[f"weight_{student}"])).max() > 1e-3
    if masked:
        assert (np.asarray(divergence)[~inputs["mask"]] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("op, beta", [("kl", None), ("jsd", 0.0), ("jsd", 0.4), ("jsd", 1.0)])
def test_teacher_gradient_is_the_plain_jax_one_and_is_computed_only_when_asked(op, beta):
    inputs = {k: jnp.asarray(v) for k, v in two_heads(seed=3).items()}
    options = {} if beta is None else {"beta": beta}
    jax_op, (student, teacher) = (fused_linear_kl, SIDES["kl"]) if op == "kl" else (fused_linear_jsd, SIDES["jsd"])

    def loss(hidden_s, weight_s, hidden_t, weight_t, impl):
        arrays = {f"hidden_{student}": hidden_s, f"weight_{student}": weight_s, f"hidden_{teacher}": hidden_t,
                  f"weight_{teacher}": weight_t}
        return (jax_op(**arrays, temperature=0.9, block_sizes=BLOCKS, impl=impl, **options) * inputs["cotangent"]).sum()

    arguments = [inputs[name] for name in ("hidden_s", "weight_s", "hidden_t", "weight_t")]
    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), static_argnums=4)
    for got, want in zip(both(*arguments, "auto"), both(*arguments, "reference")):
        assert_close(got, want)
    assert np.abs(np.asarray(both(*arguments, "auto")[3])).max() > 1e-3

    def matmuls(argnums) -> int:
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=argnums), static_argnums=4)(*arguments, "auto")
        return str(jaxpr).count("dot_general")

    assert matmuls((0, 1)) < matmuls((0, 1, 2, 3))  # the teacher's dh and dW are not computed when not asked for


@pytest.mark.torch
def test_heads_given_whole_may_differ_as_in_pytorch():
    import torch

    inputs = two_heads(seed=5)
    rows = (B * T, -1)
    th, tw = (torch.tensor(inputs[k].reshape(rows) if k.startswith("hidden") else inputs[k], requires_grad=True)
              for k in ("hidden_s", "weight_s"))
    torch_heads = (logitless.ops.LinearHead(tw, temperature=0.8, softcap=5.0, logit_scale=1.3),
                   logitless.ops.LinearHead(torch.tensor(inputs["weight_t"]), bias=torch.tensor(inputs["bias_t"]),
                                            temperature=1.1))
    expected = logitless.ops.fused_linear_kl(th, hidden_q=torch.tensor(inputs["hidden_t"].reshape(rows)),
                                             head_p=torch_heads[0], head_q=torch_heads[1])
    expected.sum().backward()

    def loss(hidden, head):
        teacher = Head(inputs["weight_t"], bias=inputs["bias_t"], temperature=1.1)
        return fused_linear_kl(hidden, hidden_q=inputs["hidden_t"], head_p=head, head_q=teacher,
                               block_sizes=BLOCKS).sum()

    head = Head(jnp.asarray(inputs["weight_s"]), temperature=0.8, softcap=5.0, logit_scale=1.3)
    value, (grad_hidden, grad_head) = jax.value_and_grad(loss, argnums=(0, 1))(jnp.asarray(inputs["hidden_s"]), head)
    assert float(value) == pytest.approx(expected.sum().item(), abs=1e-5)
    assert_close(grad_hidden.reshape(rows), th.grad)
    assert_close(grad_head.weight, tw.grad)


@pytest.mark.parametrize("beta", [None, 0.4])
def test_divergences_check_grads_float64_in_both_heads(beta):
    rng = np.random.default_rng(6)
    with jax.enable_x64(True):
        arrays = [jnp.asarray(rng.standard_normal(shape)) for shape in ((5, 3), (11, 3), (5, 4), (11, 4), (11,))]

        def divergence(hidden_s, weight_s, hidden_t, weight_t, bias_t):
            heads = dict(head_s=Head(weight_s, temperature=0.9, softcap=3.0), head_t=Head(weight_t, bias=bias_t))
            if beta is None:
                value = fused_linear_kl(hidden_s, hidden_q=hidden_t, head_p=heads["head_s"], head_q=heads["head_t"],
                                        block_sizes=BlockSizes(vocab=4, tokens=2))
            else:
                value = fused_linear_jsd(hidden_s, hidden_t=hidden_t, beta=beta,
                                         block_sizes=BlockSizes(vocab=4, tokens=2), **heads)
            assert value.dtype == jnp.float64
            return (value * jnp.arange(1.0, 6.0)).sum()

        check_grads(jax.jit(divergence), arrays, order=1, modes=["rev"])


@pytest.mark.parametrize("changes, error, match", [
    (dict(weight_t=np.zeros((V + 1, H_T), np.float32), bias_t=None), ValueError,
     "weight_t: vocabulary of 62 rows, weight_s has 61"),
    (dict(hidden_t=np.zeros((B, T + 1, H_T), np.float32)), ValueError, "hidden_t: leading dims"),
    (dict(weight_t=np.zeros((V, H_S), np.float32)), ValueError, "weight_t: hidden size 12 does not match hidden_t's"),
    (dict(weight_s=np.zeros((V, H_S), np.float16)), TypeError, "weight_s: dtype float16 differs from hidden_s's"),
    (dict(bias_t=np.zeros(V + 1, np.float32)), ValueError, "bias_t: length 62"),
    (dict(beta=1.5), ValueError, r"beta: expected a number in \[0, 1\]"),
    (dict(head_s=Head(np.zeros((V, H_S), np.float32))), TypeError,
     "fused_linear_jsd: `head_s` is given with `weight_s`; give"),
    (dict(weight_t=None), TypeError, r"weight_t: required \(or the whole head as head_t=Head"),
    (dict(hidden_t=None), TypeError, "hidden_t: expected"),
    (dict(impl="materialized"), ValueError, "'materialized' is 'reference'"),
    (dict(mask=np.ones((B, T + 1), bool)), ValueError, "mask: shape"),
])
def test_bad_input_names_the_argument_and_its_side(changes, error, match):
    inputs = two_heads()
    arguments = {k: inputs[k] for k in ("hidden_s", "weight_s", "hidden_t", "weight_t", "bias_t")}
    arguments.update(changes)
    with pytest.raises(error, match=match):
        fused_linear_jsd(arguments.pop("hidden_s"), **arguments)
