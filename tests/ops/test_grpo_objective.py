"""The GRPO loss against TRL 1.16 itself: every loss type and option, gradient accumulation and
``num_items_in_batch``.

The oracle is TRL's own ``GRPOTrainer._compute_loss``, run on a stock trainer whose per-token log-probs and
entropies are replaced by those of a small head computed here in plain PyTorch (the patched
``_get_per_token_logps_and_entropies``), so the loss, its gradient to the head and TRL's logged metrics come
from TRL's code. Against it: the materialized oracle (`ops.reference.grpo_loss`), `fused_grpo_loss` on both of
its paths (the one-pass schedule for per-token settings, the log-probs and entropies of the two passes otherwise)
and the settings TRL's config gives (`GRPOSettings.from_trl`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import trl
from datasets import Dataset

from logitless.models import qwen_tokenizer, save_model_and_tokenizer, tiny_qwen2
from logitless.ops import BlockSizes, GRPOSettings, fused_grpo_loss, reference
from grpo_cases import B, CASES, LOSS_TYPES, T, Case, grpo_inputs



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = qwen_tokenizer()
    return str(save_model_and_tokenizer(tiny_qwen2(hidden_size=16, intermediate_size=32), tokenizer,
                                        tmp_path_factory.mktemp("model")))


def _trainer(model_dir, case: Case, tmp_path):
    args = trl.GRPOConfig(str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=B, num_generations=3,
                          max_completion_length=T, report_to="none", save_strategy="no",
                          gradient_accumulation_steps=case.accumulation, **case.config)
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["a"] * B}),
                              processing_class=qwen_tokenizer())
    trainer.current_gradient_accumulation_steps = case.accumulation
    trainer.model.train()
    return trainer


def _trl_loss(trainer, case, hidden, weight, ids, mask, advantages, tensors, num_items):
    """TRL's loss, its gradient to (hidden, weight) and its metrics."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_probs_all = F.log_softmax(hidden @ weight.T, -1)
    log_probs = log_probs_all.gather(-1, ids[..., None]).squeeze(-1)
    entropies = -(log_probs_all.exp() * log_probs_all).sum(-1)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (log_probs, entropies, None)
    if case.importance_ratio:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    inputs = dict(prompt_ids=torch.zeros(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                  completion_ids=ids, completion_mask=mask.long(), advantages=advantages,
                  old_per_token_logps=tensors["old_log_probs"].nan_to_num(0.0),
                  sampling_per_token_logps=tensors["sampling_log_probs"],
                  num_items_in_batch=torch.tensor(float(num_items)))
    if trainer.beta != 0.0:
        inputs["ref_per_token_logps"] = tensors["ref_log_probs"].nan_to_num(0.0)
    if case.importance_ratio:
        inputs["importance_sampling_ratio"] = tensors["importance_sampling_ratio"]
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()
               if name not in ("policy_loss", "entropy_coef")}
    return loss.detach(), (hidden.grad, weight.grad), metrics


def _ours(function, settings, hidden, weight, ids, mask, advantages, tensors, num_items, **options):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if settings.beta == 0.0:
        tensors = {name: value for name, value in tensors.items() if name != "ref_log_probs"}
    loss, metrics = function(hidden, weight, ids, mask, advantages, settings=settings, num_items_in_batch=num_items,
                             **tensors, **options)
    loss.backward()
    return loss.detach(), (hidden.grad, weight.grad), metrics


def _assert_same(got, want, tolerance):
    (loss, grads, metrics), (want_loss, want_grads, want_metrics) = got, want
    torch.testing.assert_close(loss.double(), want_loss, atol=tolerance, rtol=tolerance)
    for grad, want_grad in zip(grads, want_grads):
        torch.testing.assert_close(grad.double(), want_grad, atol=tolerance, rtol=tolerance)
    assert sorted(metrics) == sorted(want_metrics)
    for name, value in want_metrics.items():  # TRL logs its metrics in fp32
        assert value == pytest.approx(metrics[name], abs=1e-6, rel=1e-6, nan_ok=True), name


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=str)
def test_grpo_loss_equals_trls(case, model_dir, tmp_path):
    trainer = _trainer(model_dir, case, tmp_path)
    settings = GRPOSettings.from_trl(trainer.args)
    assert settings.loss_type == case.config["loss_type"] and settings.gradient_accumulation_steps == case.accumulation
    hidden, weight, ids, mask, advantages, tensors = grpo_inputs(case, seed=len(str(case)))
    num_items = int(mask.sum()) + case.extra_items
    want = _trl_loss(trainer, case, hidden, weight, ids, mask, advantages, tensors, num_items)
    assert want[1][0].abs().max() > 0  # a gradient that a wrong loss would change
    arguments = (settings, hidden, weight, ids, mask, advantages, tensors, num_items)
    _assert_same(_ours(reference.grpo_loss, *arguments), want, 1e-10)
    # the fused op, fp64: the two passes (or per-token settings on the one-pass schedule where it runs)
    _assert_same(_ours(fused_grpo_loss, *arguments, block_sizes=BlockSizes(tokens=5, vocab=16)), want, 1e-10)
    # fp32, the CPU default blocks: the one-pass schedule for per-token settings
    fp32 = (settings, hidden.float(), weight.float(), ids, mask, advantages.float(),
            {name: value.float() for name, value in tensors.items()}, num_items)
    _assert_same(_ours(fused_grpo_loss, *fp32), want, 2e-5)


def test_every_loss_type_and_option_is_covered():
    """The cases above reach every loss type, level and option of GRPOSettings with a non-default value."""
    covered = {name for case in CASES for name, value in case.config.items()}
    options = {field.name for field in dataclasses.fields(GRPOSettings)} - {
        "epsilon_low", "max_completion_length", "gradient_accumulation_steps"}  # set through TRL's config
    assert options - covered == set(), "add a case"
    assert {case.config["loss_type"] for case in CASES} == set(LOSS_TYPES)
    assert {case.importance_ratio for case in CASES} == {True, False} and {c.accumulation for c in CASES} == {1, 2}


def test_one_pass_runs_exactly_the_per_token_settings(monkeypatch):
    """The one-pass schedule (its gradient at forward time, `LinearLoss`) is taken for per-token settings only: a
    sequence-level ratio, vespo, an entropy mask or bonus, the off-policy mask or an importance ratio need every token
    first."""
    from logitless.ops.one_pass import LinearLoss

    calls = []
    real = LinearLoss.apply
    monkeypatch.setattr(LinearLoss, "apply", staticmethod(lambda *args: calls.append(1) or real(*args)))
    hidden, weight, ids, mask, advantages, tensors = grpo_inputs(Case({}), seed=0)
    for options, one_pass in ((dict(loss_type="sapo"), True), (dict(loss_type="luspo", beta=0.1), True),
                              (dict(loss_type="vespo"), False), (dict(importance_sampling_level="sequence"), False),
                              (dict(top_entropy_quantile=0.5), False), (dict(entropy_coef=0.1), False),
                              (dict(off_policy_mask_threshold=0.1), False)):
        calls.clear()
        settings = GRPOSettings(**options)
        assert settings.per_token == one_pass
        fused_grpo_loss(hidden.detach().float().requires_grad_(), weight.detach().float(), ids, mask,
                        advantages.detach().float(), settings=settings,
                        old_log_probs=tensors["old_log_probs"].detach().float(),
                        ref_log_probs=tensors["ref_log_probs"].detach().float() if settings.beta else None)
        assert bool(calls) == one_pass, options


def test_a_bad_importance_ratio_or_sampling_log_prob_is_named():
    hidden, weight, ids, mask, advantages, _ = grpo_inputs(CASES[0], seed=0)

    def call(**tensors):
        return fused_grpo_loss(hidden, weight, ids, mask, advantages, **tensors)

    with pytest.raises(ValueError, match=r"^importance_sampling_ratio: expected \(6, 7\) or \(6, 1\), got \(6, 3\)"):
        call(importance_sampling_ratio=torch.ones(6, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="^importance_sampling_ratio: expected finite ratios >= 0"):
        call(importance_sampling_ratio=torch.full((6, T), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^sampling_log_probs: NaN or \+inf at a token of completion_mask"):
        call(sampling_log_probs=torch.full((6, T), float("inf"), dtype=torch.float64), off_policy_mask_threshold=0.1)
    call(sampling_log_probs=torch.full((6, T), float("nan"), dtype=torch.float64),  # unscored tokens: allowed
         off_policy_mask_threshold=0.1)
