"""A NaN or infinite loss or gradient never reaches the weights: stop (default) or skip the step."""

import math

import pytest
import torch

from logitless.nonfinite import NonFiniteError, check_step, nonfinite_reason
from logitless.trl.nonfinite import NonFiniteGuard


def _model_with_grads(value: float) -> torch.nn.Module:
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    model.bias.grad[0] = value
    return model


def test_stop_or_skip():
    assert nonfinite_reason(_model_with_grads(1.0), [0.5]) is None
    assert nonfinite_reason(_model_with_grads(1.0), [math.inf]) == "the loss is inf"
    assert nonfinite_reason(_model_with_grads(math.nan)) == "the gradient of bias has nan or inf"
    with pytest.raises(NonFiniteError, match="^step 4: the gradient of bias has nan or inf; stopped before .* Advice"):
        check_step(4, _model_with_grads(math.nan), advice="Advice.")
    model = _model_with_grads(math.nan)
    assert check_step(4, model, policy="skip") is False
    assert all(p.grad is None for p in model.parameters())
    weight = model.weight.detach().clone()
    torch.optim.AdamW(model.parameters(), lr=1.0).step()  # the optimizer leaves the weights alone
    assert torch.equal(model.weight, weight)
    with pytest.raises(ValueError, match="policy"):
        NonFiniteGuard("ignore")
    model = _model_with_grads(math.nan)
    with pytest.raises(ValueError, match="policy: expected one of 'stop', 'skip', got 'stpo'"):  # not a silent skip
        check_step(4, model, policy="stpo")
    assert all(p.grad is not None for p in model.parameters())


def test_the_guard_stops_grpo_on_a_nan_loss(tmp_path, tokenizer, monkeypatch):
    """A NaN loss (here: the real one times NaN) gives NaN gradients: the run stops before its first update,
    and nothing is saved."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from logitless.models import tiny_qwen2
    from logitless.trl import GRPOTrainerWithLogits

    loss = GRPOTrainerWithLogits._compute_loss
    monkeypatch.setattr(GRPOTrainerWithLogits, "_compute_loss", lambda self, *a: loss(self, *a) * math.nan)
    model = tiny_qwen2(hidden_size=8, intermediate_size=16, num_hidden_layers=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, activation_checkpointing=False,
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=2, max_steps=1,
                          report_to="none", save_strategy="steps", save_steps=1, seed=0, learning_rate=1e-3,
                          disable_tqdm=True)
    trainer = GRPOTrainerWithLogits(model=model, args=args, processing_class=tokenizer, callbacks=[NonFiniteGuard()],
                                    reward_funcs=lambda completions, **kw: [0.0, 1.0],
                                    train_dataset=Dataset.from_dict({"prompt": ["a"]}))
    with pytest.raises(NonFiniteError, match="^step 1: the gradient of .* has nan or inf"):
        trainer.train()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert not (tmp_path / "checkpoint-1").exists()
