"""The PyTorch ops and their JAX twins are one API: every op takes the same keywords, and the same bad input gets the
same error (type and message, up to the names of the array types) in both."""

import dataclasses
import inspect
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import logitless
import logitless.jax

OPS = ("fused_linear_logprobs", "fused_linear_cross_entropy", "fused_grpo_loss", "fused_linear_kl", "fused_linear_jsd")
B, T, H, V = 2, 3, 4, 11
HEAD_CLASSES = {"torch": logitless.LinearHead, "jax": logitless.jax.Head}


def _arrays(backend: str):
    """numpy array -> the backend's array."""
    return torch.from_numpy if backend == "torch" else jnp.asarray


def _good(op: str) -> dict[str, np.ndarray]:
    """Valid arguments of ``op`` as numpy arrays (every option left at its default)."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((B, T, H), np.float32)
    weight = rng.standard_normal((V, H), np.float32)
    ids = rng.integers(0, V, (B, T))
    if op in ("fused_linear_kl", "fused_linear_jsd"):
        p, q = ("_p", "_q") if op == "fused_linear_kl" else ("_s", "_t")
        return {f"hidden{p}": hidden, f"weight{p}": weight, f"hidden{q}": hidden + 1, f"weight{q}": weight * 2}
    if op == "fused_grpo_loss":
        return dict(hidden=hidden, weight=weight, completion_ids=ids, completion_mask=np.ones((B, T), np.float32),
                    advantages=rng.standard_normal(B).astype(np.float32))
    return dict(hidden=hidden, weight=weight, targets=ids)


def _call(backend: str, op: str, changes: dict):
    """``op`` of ``backend`` on `_good`'s arguments with ``changes`` (a numpy array is made the backend's array; a
    ``"head"`` value of "whole" is the backend's head of the weight)."""
    arrays = _arrays(backend)
    args = {**_good(op), **changes}
    for name, value in args.items():
        if isinstance(value, np.ndarray):
            args[name] = arrays(value)
        elif isinstance(value, str) and value == "whole":  # head, head_p...: that side's weight as a head
            args[name] = HEAD_CLASSES[backend](arrays(_good(op)[name.replace("head", "weight")]))
    module = logitless if backend == "torch" else logitless.jax
    return getattr(module, op)(**args)


def _error(backend: str, op: str, changes: dict) -> tuple[str, str]:
    with pytest.raises((TypeError, ValueError)) as caught:
        _call(backend, op, changes)
    message = str(caught.value).replace(", 'triton'", "")  # PyTorch's impl vocabulary has the Triton kernels too
    for words in (r"torch\.Tensor|jax\.Array|LinearHead|Head|tensor|array|got Tensor|got ArrayImpl", r"torch\.(\w+)"):
        message = re.sub(words, lambda match: match.group(1) if match.groups() else "<array>", message)
    return type(caught.value).__name__, message


ALL = dict.fromkeys(OPS)
ONE_HEAD = ("fused_linear_logprobs", "fused_linear_cross_entropy", "fused_grpo_loss")
BAD = [  # (ops, changes to the good arguments)
    (ALL, dict(softcapp=2.0)),
    (ALL, dict(scale=2.0)),
    (ALL, dict(impl="fused")),
    (ALL, dict(impl="fast")),
    (ALL, dict(temperature=0.0)),
    (ALL, dict(softcap=-1.0)),
    (ALL, dict(logit_scale=float("inf"))),
    (ALL, dict(block_sizes=(8, 8))),
    (ONE_HEAD, dict(head="whole")),
    (ONE_HEAD, dict(weight=None)),
    (ONE_HEAD, dict(head=np.zeros((V, H), np.float32), weight=None)),
    (ONE_HEAD, dict(weight=np.zeros((V, H + 1), np.float32))),
    (ONE_HEAD, dict(weight=np.zeros((V, H), np.float16))),
    (ONE_HEAD, dict(bias=np.zeros(V + 1, np.float32))),
    (ONE_HEAD, dict(bias=np.full(V, np.nan, np.float32))),
    (("fused_linear_logprobs", "fused_linear_cross_entropy"), dict(targets=np.zeros((B, T + 1), np.int64))),
    (("fused_linear_logprobs", "fused_linear_cross_entropy"), dict(targets=np.full((B, T), V, np.int64))),
    (("fused_linear_logprobs",), dict(return_entropy=True)),
    (("fused_linear_logprobs",), dict(mask=np.full((B, T), 2.0, np.float32))),
    (("fused_linear_cross_entropy",), dict(reduction="avg")),
    (("fused_linear_cross_entropy",), dict(label_smoothing=1.5)),
    (("fused_grpo_loss",), dict(beta=0.1)),
    (("fused_grpo_loss",), dict(ref_logprobs=np.zeros((B, T), np.float32))),
    (("fused_grpo_loss",), dict(loss_type="ppo")),
    (("fused_grpo_loss",), dict(advantages=np.zeros(B + 1, np.float32))),
    (("fused_grpo_loss",), dict(advantages=np.full(B, np.nan, np.float32))),
    (("fused_grpo_loss",), dict(completion_mask=None)),
    (("fused_grpo_loss",), dict(num_items_in_batch=0)),
    (("fused_linear_kl",), dict(weight_q=np.zeros((V + 1, H), np.float32))),
    (("fused_linear_kl",), dict(hidden_q=np.zeros((B, T + 1, H), np.float32))),
    (("fused_linear_kl",), dict(head_p="whole")),
    (("fused_linear_kl",), dict(bias_q=np.zeros(V + 1, np.float32))),
    (("fused_linear_kl",), dict(mask=np.ones((B, T + 1), bool))),
    (("fused_linear_jsd",), dict(beta=1.5)),
    (("fused_linear_jsd",), dict(weight_t=None)),
    (("fused_linear_jsd",), dict(weight_s=np.zeros((V, H), np.float16))),
]
CASES = [(op, changes) for ops, changes in BAD for op in ops]


@pytest.mark.parametrize("op, changes", CASES, ids=[f"{op}-{'-'.join(changes)}" for op, changes in CASES])
def test_the_same_bad_input_gets_the_same_error_in_both_backends(op, changes):
    torch_error = _error("torch", op, changes)
    named = torch_error[1].split(":")[0].split(".")[0]  # the argument (settings.loss_type: the settings' field)
    # an error names the argument changed, the op (for a keyword it does not take), or the argument the change
    # makes necessary (beta > 0 needs ref_log_probs)
    assert named in {*changes, op, "settings", "ref_log_probs"}, torch_error
    assert _error("jax", op, changes) == torch_error


def test_every_case_is_accepted_in_both_backends_once_put_right():
    """The cases' good arguments run in both backends to the same values, so an error above comes from the change."""
    for op in OPS:
        torch_out, jax_out = (_call(backend, op, {}) for backend in ("torch", "jax"))
        torch_out, jax_out = (out[0] if isinstance(out, tuple) else out for out in (torch_out, jax_out))
        np.testing.assert_allclose(np.asarray(jax_out), torch_out.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", OPS)
def test_the_twins_take_the_same_arguments_with_the_same_defaults(op):
    """The same positional arguments in the same order, the same keywords (in any order) with the same defaults."""
    torch_op, jax_op = (inspect.signature(inspect.unwrap(getattr(module, op))).parameters.values()
                        for module in (logitless, logitless.jax))
    positional, keywords = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    torch_op, jax_op = list(torch_op), list(jax_op)
    for params in torch_op, jax_op:
        assert all(p.kind in (positional, keywords, inspect.Parameter.VAR_KEYWORD) for p in params)
    assert [p.name for p in torch_op if p.kind is positional] == [p.name for p in jax_op if p.kind is positional]
    assert {p.name: p.default for p in torch_op} == {p.name: p.default for p in jax_op}


def test_the_heads_are_made_alike():
    torch_fields, jax_fields = ([(f.name, f.kw_only, f.default) for f in dataclasses.fields(cls)
                                 if f.name != "shard"] for cls in HEAD_CLASSES.values())
    assert torch_fields == jax_fields
    for cls in HEAD_CLASSES.values():
        with pytest.raises(TypeError, match="positional"):
            cls(np.zeros((V, H), np.float32), None)
