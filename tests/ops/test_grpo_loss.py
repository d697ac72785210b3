"""fused_grpo_loss against the materialized oracle, a from-scratch TRL formula, and Liger-Kernel."""

import pytest
import torch

from logitless import fused_grpo_loss
from logitless.ops import BlockSizes
from logitless.ops.reference import grpo_loss

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def _batch(b=3, t=11, h=16, v=997, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(b, t, h, generator=g) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    bias = (torch.randn(v, generator=g) * 0.1).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t)
    mask[0, 7:] = 0
    mask[-1, 3:] = 0
    advantages = torch.randn(b, generator=g)
    with torch.no_grad():
        logp = torch.log_softmax((hidden.float() @ weight.float().T + bias.float()) / 0.8, -1)
        logp = logp.gather(-1, ids[..., None]).squeeze(-1)
    old = logp + 0.3 * torch.randn(b, t, generator=g)  # ratios far enough from 1 to clip
    ref = logp + 0.2 * torch.randn(b, t, generator=g)
    return dict(hidden=hidden, weight=weight, bias=bias, completion_ids=ids, completion_mask=mask,
                advantages=advantages, old_log_probs=old, ref_log_probs=ref)


def _grads(loss, batch):
    return torch.autograd.grad(loss, [batch["hidden"], batch["weight"], batch["bias"]])


def _run(fn, batch, **kwargs):
    args = dict(batch)
    loss, metrics = fn(args.pop("hidden"), args.pop("weight"), args.pop("completion_ids"),
                       args.pop("completion_mask"), args.pop("advantages"), **args, **kwargs)
    return loss, metrics, _grads(loss, batch)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("options", [
    dict(beta=0.0), dict(beta=0.04, use_bias_correction_kl=True), dict(beta=0.04, delta=1.1, epsilon_high=0.28),
    dict(beta=0.0, delta=0.9, max_completion_length=20),
    dict(beta=0.1, delta=1.5, epsilon_high=0.28, gradient_accumulation_steps=2, max_completion_length=16,
         num_items_in_batch=40, softcap=1.5, logit_scale=0.7)])
def test_fused_equals_the_trl_oracle(loss_type, options):
    """Against `reference.grpo_loss`, TRL's GRPOTrainer._compute_loss transcribed on materialized logits."""
    batch = _batch()
    fused = _run(fused_grpo_loss, batch, loss_type=loss_type, temperature=0.8, block_sizes=BlockSizes(tokens=7),
                 **options)
    reference = _run(grpo_loss, batch, loss_type=loss_type, temperature=0.8, **options)
    torch.testing.assert_close(fused[0], reference[0], atol=1e-5, rtol=1e-5)
    assert fused[1].keys() == reference[1].keys()
    for name in fused[1]:
        assert fused[1][name] == pytest.approx(reference[1][name], abs=1e-5), name
    for got, want in zip(fused[2], reference[2]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("loss", [fused_grpo_loss, grpo_loss], ids=["fused", "oracle"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_accumulating_micro_batches_gives_the_whole_batchs_loss_and_gradients(loss, loss_type):
    """TRL's gradient accumulation: k equal micro-batches, each scaled by gradient_accumulation_steps = k (grpo,
    dr_grpo) or normalized by the whole batch's token count num_items_in_batch (dapo), sum to the loss and the
    gradients of the batch taken at once. (bnpo normalizes by each micro-batch's own token count: no such sum.)"""
    batch = _batch(b=4, seed=12)
    batch["completion_mask"][1, 5:] = 0
    whole, _, whole_grads = _run(loss, batch, loss_type=loss_type, beta=0.04, max_completion_length=11)
    tokens = batch["completion_mask"].sum().item()
    total, grads = 0.0, None
    for rows in (slice(0, 2), slice(2, 4)):
        micro = {name: value[rows] if name not in ("weight", "bias") else value for name, value in batch.items()}
        micro["hidden"] = batch["hidden"]  # the leaf: the gradient reaches it through the slice below
        args = dict(micro)
        micro_loss, _ = loss(args.pop("hidden")[rows], args.pop("weight"), args.pop("completion_ids"),
                             args.pop("completion_mask"), args.pop("advantages"), **args, loss_type=loss_type,
                             beta=0.04, max_completion_length=11, gradient_accumulation_steps=2,
                             num_items_in_batch=tokens if loss_type == "dapo" else None)
        micro_grads = _grads(micro_loss, batch)
        total = total + micro_loss
        grads = micro_grads if grads is None else [g + m for g, m in zip(grads, micro_grads)]
    torch.testing.assert_close(total, whole, atol=1e-6, rtol=1e-5)
    for got, want in zip(grads, whole_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_metrics_values():
    batch = _batch(seed=2)
    _, metrics, _ = _run(fused_grpo_loss, batch, beta=0.04, temperature=0.8, use_bias_correction_kl=False)
    hidden, weight, bias = (batch[k].detach() for k in ("hidden", "weight", "bias"))
    logp_all = torch.log_softmax((hidden @ weight.T + bias) / 0.8, -1)
    logp = logp_all.gather(-1, batch["completion_ids"][..., None]).squeeze(-1)
    keep = batch["completion_mask"].bool()
    ratio = torch.exp(logp - batch["old_log_probs"])
    adv = batch["advantages"][:, None].expand_as(ratio)
    low = ((ratio < 0.8) & (adv < 0))[keep].float().mean().item()
    high = ((ratio > 1.2) & (adv > 0))[keep].float().mean().item()
    assert 0 < low + high  # the batch does exercise clipping
    assert metrics["clip_ratio/low_mean"] == pytest.approx(low)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(high)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(low + high)
    per_sequence_low = (((ratio < 0.8) & (adv < 0)).float() * keep).sum(1) / keep.sum(1)
    per_sequence_high = (((ratio > 1.2) & (adv > 0)).float() * keep).sum(1) / keep.sum(1)
    assert metrics["clip_ratio/low_min"] == pytest.approx(per_sequence_low.min().item())
    assert metrics["clip_ratio/high_max"] == pytest.approx(per_sequence_high.max().item())
    gap = batch["ref_log_probs"] - logp
    assert metrics["kl"] == pytest.approx((gap.exp() - gap - 1)[keep].mean().item(), rel=1e-5)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    assert metrics["entropy"] == pytest.approx(entropy[keep].mean().item(), rel=1e-5)
    assert "kl" not in _run(fused_grpo_loss, dict(batch, ref_log_probs=None))[1]


def test_without_old_log_probs_ratio_is_one_and_gradient_is_policy_gradient():
    batch = _batch(seed=3)
    batch["old_log_probs"] = None
    loss, metrics, grads = _run(fused_grpo_loss, batch, loss_type="bnpo", temperature=0.8)
    reference = _run(grpo_loss, batch, loss_type="bnpo", temperature=0.8)
    torch.testing.assert_close(loss, reference[0])
    assert metrics["clip_ratio/region_mean"] == 0.0
    assert all(g.abs().sum() > 0 for g in grads)


def test_frozen_weight_skips_its_gradient_and_no_grad_skips_all():
    batch = _batch(seed=7)
    batch["weight"].requires_grad_(False)
    batch["bias"] = None
    args = dict(batch)
    loss, _ = fused_grpo_loss(args.pop("hidden"), args.pop("weight"), args.pop("completion_ids"),
                              args.pop("completion_mask"), args.pop("advantages"), **args)
    loss.backward()
    assert batch["weight"].grad is None and batch["hidden"].grad.abs().sum() > 0
    reference, _ = grpo_loss(batch["hidden"], batch["weight"], batch["completion_ids"], batch["completion_mask"],
                             batch["advantages"], old_log_probs=batch["old_log_probs"],
                             ref_log_probs=batch["ref_log_probs"])
    (want,) = torch.autograd.grad(reference, batch["hidden"])
    torch.testing.assert_close(batch["hidden"].grad, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        loss, _ = fused_grpo_loss(batch["hidden"], batch["weight"], batch["completion_ids"],
                                  batch["completion_mask"], batch["advantages"])
    assert loss.grad_fn is None


def test_gradcheck_float64():
    batch = _batch(b=2, t=4, h=3, v=13, dtype=torch.float64, seed=4)
    batch["old_log_probs"], batch["ref_log_probs"] = batch["old_log_probs"].double(), batch["ref_log_probs"].double()

    def loss_of(hidden, weight, bias):
        return fused_grpo_loss(hidden, weight, batch["completion_ids"], batch["completion_mask"],
                               batch["advantages"].double(), bias=bias, old_log_probs=batch["old_log_probs"],
                               ref_log_probs=batch["ref_log_probs"], beta=0.1, block_sizes=BlockSizes(3, 5),
                               temperature=0.9)[0]

    assert torch.autograd.gradcheck(loss_of, (batch["hidden"], batch["weight"], batch["bias"]))


def test_bf16_close_to_fp32_oracle():
    batch = _batch(dtype=torch.bfloat16, seed=5)
    loss, _, grads = _run(fused_grpo_loss, batch, beta=0.04, temperature=0.8)
    oracle = {k: (v.detach().float().requires_grad_() if k in ("hidden", "weight", "bias") else v)
              for k, v in batch.items()}
    want_loss, _, want_grads = _run(grpo_loss, oracle, beta=0.04, temperature=0.8)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want_loss, atol=2e-2 * want_loss.abs().item() + 1e-3, rtol=0)
    for got, want in zip(grads, want_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=3e-2 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_same_loss_as_liger(loss_type, beta):
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    batch = _batch(seed=6)
    kwargs = dict(loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28, temperature=0.8,
                  max_completion_length=batch["completion_ids"].shape[1])
    ours = _run(fused_grpo_loss, batch, **kwargs, num_items_in_batch=batch["completion_mask"].sum().item(),
                use_bias_correction_kl=False)  # Liger's KL has no importance-ratio correction
    module = liger.LigerFusedLinearGRPOLoss(compiled=False, use_ref_model=beta != 0, chunk_size=1, **kwargs)
    liger_loss, liger_metrics = module(batch["hidden"], batch["weight"], batch["completion_ids"],
                                       batch["completion_mask"], batch["advantages"], bias=batch["bias"],
                                       ref_per_token_logps=batch["ref_log_probs"] if beta else None,
                                       old_per_token_logps=batch["old_log_probs"],
                                       num_items_in_batch=batch["completion_mask"].sum())
    torch.testing.assert_close(ours[0], liger_loss, atol=1e-5, rtol=1e-5)
    for got, want in zip(ours[2], _grads(liger_loss, batch)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert ours[1]["clip_ratio/region_mean"] == pytest.approx(liger_metrics[-1].item(), abs=1e-6)
    if beta:
        assert ours[1]["kl"] == pytest.approx(liger_metrics[0].item(), rel=1e-4)


def test_per_token_advantages():
    # TRL lets a subclass hand (B, T) advantages to the loss; a row of equal values is the (B,) case
    batch = _batch()
    per_token = batch["advantages"][:, None].expand_as(batch["completion_mask"]).contiguous()
    per_sequence = _run(fused_grpo_loss, batch, beta=0.04)
    expanded = _run(fused_grpo_loss, batch | dict(advantages=per_token), beta=0.04)
    torch.testing.assert_close(expanded[0], per_sequence[0])
    varied = batch | dict(advantages=torch.randn(per_token.shape, generator=torch.Generator().manual_seed(3)))
    fused, reference = _run(fused_grpo_loss, varied, beta=0.04), _run(grpo_loss, varied, beta=0.04)
    torch.testing.assert_close(fused[0], reference[0], atol=1e-5, rtol=1e-5)
    for got, want in zip(fused[2], reference[2]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(loss_type="ppo"), ValueError, "loss_type"),
    (dict(beta=0.1, ref_log_probs=None), ValueError, "ref_log_probs: required"),
    (dict(advantages=torch.zeros(2)), ValueError, "advantages: expected"),
    (dict(advantages=torch.tensor([0.0, float("nan"), 1.0])), ValueError, "advantages: contains NaN"),
    (dict(completion_mask=torch.ones(3, 5)), ValueError, "completion_mask: shape"),
    (dict(old_log_probs=torch.zeros(3, 4)), ValueError, "old_log_probs: shape"),
    (dict(epsilon_low=-0.1), ValueError, "epsilon_low"),
    (dict(delta=0.0), ValueError, "delta"),
    (dict(advantages=torch.zeros(3, 5)), ValueError, "advantages: expected"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(completion_ids=torch.full((3, 11), 997)), ValueError, "completion_ids: token ids"),
    (dict(hidden=torch.randn(33, 16)), ValueError, "hidden: expected 3 dimensions"),
    # NaN in the inputs is refused, not passed into the loss
    (dict(old_log_probs=torch.full((3, 11), float("nan"))), ValueError, "old_log_probs: NaN"),
    (dict(ref_log_probs=torch.full((3, 11), float("nan")), beta=0.04), ValueError, "ref_log_probs: NaN"),
    (dict(beta=float("nan")), ValueError, "beta: expected a finite number"),
    (dict(epsilon_high=float("nan")), ValueError, "epsilon_high: expected a finite number"),
    (dict(epsilon_low=float("inf")), ValueError, "epsilon_low: expected a finite number"),
    (dict(delta=float("nan")), ValueError, "delta"),
])
def test_bad_input(overrides, error, match):
    batch = _batch() | overrides
    with pytest.raises(error, match=match):
        _run(fused_grpo_loss, batch)


def test_masked_positions_may_hold_anything():
    # TRL pads old/ref log-probs past a completion's end; only the kept tokens are read
    batch = _batch(seed=8)
    padded = dict(batch)
    for name in ("old_log_probs", "ref_log_probs"):
        padded[name] = batch[name].masked_fill(batch["completion_mask"] == 0, float("nan"))
    loss, _, grads = _run(fused_grpo_loss, padded, beta=0.04)
    want_loss, _, want_grads = _run(fused_grpo_loss, batch, beta=0.04)
    torch.testing.assert_close(loss, want_loss)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want)


def test_neg_inf_bias_gives_a_finite_entropy_metric():
    batch = _batch(seed=9)
    bias = batch["bias"].detach().clone()
    bias[-100:] = float("-inf")  # padded vocabulary rows
    batch["bias"] = bias.requires_grad_()
    batch["completion_ids"] = batch["completion_ids"] % 800
    fused = _run(fused_grpo_loss, batch, beta=0.04, block_sizes=BlockSizes(vocab=64))
    reference = _run(grpo_loss, batch, beta=0.04)
    assert fused[1]["entropy"] == pytest.approx(reference[1]["entropy"], rel=1e-5)
    assert all(bool(torch.isfinite(g).all()) for g in fused[2][:2])
    torch.testing.assert_close(fused[0], reference[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_padding_may_hold_any_id_and_any_hidden_state(impl):
    """Masked tokens never reach the matmul, in the oracle as in the fused op: a pad id of -100 and NaN hidden
    states there change nothing."""
    batch = _batch(seed=9)
    padded = dict(batch)
    pad = batch["completion_mask"] == 0
    padded["completion_ids"] = batch["completion_ids"].masked_fill(pad, -100)
    padded["hidden"] = batch["hidden"].detach().masked_fill(pad[..., None], float("nan")).requires_grad_()
    loss, _ = fused_grpo_loss(padded["hidden"], padded["weight"], padded["completion_ids"], padded["completion_mask"],
                              padded["advantages"], bias=padded["bias"], old_log_probs=padded["old_log_probs"],
                              ref_log_probs=padded["ref_log_probs"], beta=0.04, impl=impl)
    want_loss, _, want_grads = _run(fused_grpo_loss, batch, beta=0.04)
    grads = torch.autograd.grad(loss, [padded["hidden"], batch["weight"], batch["bias"]])
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grads[0].masked_fill(pad[..., None], 0.0), want_grads[0])
    for got, want in zip(grads[1:], want_grads[1:]):
        torch.testing.assert_close(got, want)


def test_advantages_and_log_probs_that_require_grad_get_their_gradients():
    """A learned baseline or a differentiable reference: the constants of TRL's loss get the oracle's gradients
    (the fused op then takes its two passes, whose loss autograd differentiates)."""
    grads = {}
    for impl in ("auto", "reference"):
        batch = _batch(seed=10)
        constants = [batch[name].detach().clone().requires_grad_() for name in
                     ("advantages", "old_log_probs", "ref_log_probs")]
        loss, _ = fused_grpo_loss(batch["hidden"], batch["weight"], batch["completion_ids"], batch["completion_mask"],
                                  constants[0], bias=batch["bias"], old_log_probs=constants[1],
                                  ref_log_probs=constants[2], beta=0.04, impl=impl)
        grads[impl] = torch.autograd.grad(loss, [*constants, batch["hidden"], batch["weight"]])
    assert grads["reference"][0].abs().sum() > 0
    for got, want in zip(grads["auto"], grads["reference"]):
        torch.testing.assert_close(got, want)


def test_an_empty_batch_gives_a_zero_loss():
    batch = _batch(b=2, seed=11)
    loss, _ = fused_grpo_loss(batch["hidden"][:0], batch["weight"], batch["completion_ids"][:0],
                              batch["completion_mask"][:0], batch["advantages"][:0])
    assert loss.item() == 0.0
