"""The JAX GRPO loss, every loss type and option, equals the PyTorch op (which tests/ops/test_grpo_objective.py checks
against TRL 1.16's own loss) on the same inputs, and its plain-JAX oracle (``impl="reference"``): loss, gradients
of hidden and weight, and metrics, fp32, under jit and grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax import fused_grpo_loss as jax_grpo_loss
from logitless.ops import GRPOSettings, fused_grpo_loss
from grpo_cases import CASES, T, grpo_inputs


def _settings(case) -> GRPOSettings:
    return GRPOSettings(gradient_accumulation_steps=case.accumulation, max_completion_length=T, **case.config)


def _jax_step(settings, ids, mask, advantages, tensors, num_items, impl):
    arrays = {name: jnp.asarray(value.numpy()) for name, value in tensors.items()}

    @jax.jit
    def step(hidden, weight):
        def loss(hidden, weight):
            return jax_grpo_loss(hidden, weight, jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy()),
                                 jnp.asarray(advantages.numpy()), settings=settings, num_items_in_batch=num_items,
                                 impl=impl, **arrays)

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, weight)

    return step


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=str)
def test_jax_grpo_loss_equals_pytorch_and_the_plain_jax_oracle(case):
    settings = _settings(case)
    hidden, weight, ids, mask, advantages, tensors = grpo_inputs(case, seed=len(str(case)) + 1)
    hidden, weight, advantages = hidden.float(), weight.float(), advantages.float()
    tensors = {name: value.float() for name, value in tensors.items()
               if settings.beta != 0.0 or name != "ref_log_probs"}
    num_items = int(mask.sum()) + case.extra_items
    torch_hidden, torch_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want_loss, want_metrics = fused_grpo_loss(torch_hidden, torch_weight, ids, mask, advantages, settings=settings,
                                              num_items_in_batch=num_items, **tensors)
    want_loss.backward()
    assert torch_hidden.grad.abs().max() > 0
    for impl in ("auto", "reference"):
        (loss, metrics), grads = _jax_step(settings, ids, mask, advantages, tensors, num_items, impl)(
            jnp.asarray(hidden.numpy()), jnp.asarray(weight.numpy()))
        np.testing.assert_allclose(float(loss), want_loss.item(), rtol=1e-5, atol=1e-6, err_msg=impl)
        for grad, want in zip(grads, (torch_hidden.grad, torch_weight.grad)):
            np.testing.assert_allclose(np.asarray(grad), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=impl)
        assert sorted(metrics) == sorted(want_metrics)
        for name, value in want_metrics.items():
            np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_bad_importance_ratio_or_sampling_log_prob_is_named():
    case = CASES[0]
    _, _, ids, mask, advantages, tensors = grpo_inputs(case, seed=0)
    hidden, weight = jnp.zeros((ids.shape[0], T, 8)), jnp.ones((40, 8))

    def call(**arrays):
        return jax_grpo_loss(hidden, weight, jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy()),
                             jnp.asarray(advantages.numpy()), **arrays)

    with pytest.raises(ValueError, match=r"^importance_sampling_ratio: expected \(6, 7\) or \(6, 1\), got \(6, 3\)"):
        call(importance_sampling_ratio=jnp.ones((6, 3)))
    with pytest.raises(ValueError, match="^importance_sampling_ratio: expected finite ratios >= 0"):
        call(importance_sampling_ratio=-jnp.ones((6, T)))
    with pytest.raises(ValueError, match=r"^sampling_log_probs: NaN or \+inf at a token of completion_mask"):
        call(sampling_log_probs=jnp.full((6, T), jnp.inf), off_policy_mask_threshold=0.1)
    call(sampling_log_probs=jnp.full((6, T), jnp.nan), off_policy_mask_threshold=0.1)  # unscored tokens: allowed
