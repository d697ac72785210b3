"""GRPOSettings: validation naming the field, TRL's GRPOConfig, and the ops taking it or the keywords it replaces."""

from types import SimpleNamespace

import pytest
import torch

import logitless
from logitless import GRPOSettings, fused_grpo_loss
from logitless.ops.reference import grpo_loss
from test_grpo_loss import _batch, _run


@pytest.mark.parametrize("field, value, message", [
    ("epsilon_low", -1, "settings.epsilon_low: expected a finite number >= 0, got -1"),
    ("epsilon_high", float("nan"), "settings.epsilon_high: expected a finite number >= 0"),
    ("delta", 0.0, "settings.delta: expected a finite number > 0"),
    ("loss_type", "ppo", "settings.loss_type: expected one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', "
                         "'vespo', 'luspo', got 'ppo'"),
    ("importance_sampling_level", "tokens", "settings.importance_sampling_level: expected one of 'token', 'sequence'"),
    ("top_entropy_quantile", 1.5, "settings.top_entropy_quantile: expected a fraction in (0, 1], got 1.5"),
    ("top_entropy_quantile", 0.0, "settings.top_entropy_quantile: expected a finite number > 0, got 0.0"),
    ("off_policy_mask_threshold", float("inf"), "settings.off_policy_mask_threshold: expected a finite number"),
    ("sapo_temperature_neg", 0, "settings.sapo_temperature_neg: expected a finite number > 0, got 0"),
    ("entropy_coef", -0.1, "settings.entropy_coef: expected a finite number >= 0, got -0.1"),
    ("max_completion_length", 0, "settings.max_completion_length: expected a positive int, got 0"),
    ("gradient_accumulation_steps", 1.0, "settings.gradient_accumulation_steps: expected a positive int"),
    ("use_bias_correction_kl", 1, "settings.use_bias_correction_kl: expected a bool, got 1"),
])
def test_a_bad_field_is_named(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GRPOSettings(**{field: value})
    with pytest.raises(TypeError, match="^settings.beta: expected a number, got bool"):
        GRPOSettings(beta=True)


def test_frozen_and_hashable():
    settings = GRPOSettings(beta=0.04)
    with pytest.raises(AttributeError):
        settings.beta = 0.1
    assert hash(settings) == hash(GRPOSettings(beta=0.04))


def test_from_trl_reads_the_config_fields():
    config = SimpleNamespace(loss_type="dr_grpo", beta=0.04, epsilon=0.2, epsilon_high=0.28, delta=2.0,
                             use_bias_correction_kl=True, importance_sampling_level="token",
                             max_completion_length=512, gradient_accumulation_steps=4, learning_rate=1e-6)
    assert GRPOSettings.from_trl(config) == GRPOSettings(
        loss_type="dr_grpo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28, delta=2.0, use_bias_correction_kl=True,
        max_completion_length=512, gradient_accumulation_steps=4)
    # TRL's epsilon_high=None means epsilon; fields an older config lacks keep their defaults
    assert GRPOSettings.from_trl(SimpleNamespace(epsilon=0.3, epsilon_high=None)) == GRPOSettings(
        epsilon_low=0.3, epsilon_high=0.3)
    with pytest.raises(ValueError, match="settings.importance_sampling_level"):
        GRPOSettings.from_trl(SimpleNamespace(importance_sampling_level="tokens"))


def test_exported_everywhere():
    """The ops' settings are importable from the top level, as the ops that take them are."""
    from logitless.op_settings import BlockSizes

    assert logitless.GRPOSettings is logitless.ops.GRPOSettings is GRPOSettings
    assert logitless.BlockSizes is logitless.ops.BlockSizes is BlockSizes


@pytest.mark.parametrize("op", [fused_grpo_loss, grpo_loss])
def test_settings_equal_the_keywords(op):
    batch = _batch()
    options = dict(loss_type="dr_grpo", beta=0.04, epsilon_high=0.28, delta=1.5, max_completion_length=16)
    by_keywords = _run(op, batch, **options)
    by_settings = _run(op, batch, settings=GRPOSettings(**options))
    agreeing = _run(op, batch, settings=GRPOSettings(**options), beta=0.04)
    for got in (by_settings, agreeing):
        torch.testing.assert_close(got[0], by_keywords[0])
        assert got[1] == by_keywords[1]


@pytest.mark.parametrize("op", [fused_grpo_loss, grpo_loss])
def test_a_keyword_disagreeing_with_settings_or_unknown_is_named(op):
    batch = _batch()
    with pytest.raises(ValueError, match="beta: 0.1 disagrees with settings.beta = 0.04"):
        _run(op, batch, settings=GRPOSettings(beta=0.04), beta=0.1)
    with pytest.raises(TypeError, match="unknown keyword `epsilon`; did you mean `epsilon_low`?"):
        _run(op, batch, epsilon=0.2)
    with pytest.raises(TypeError, match="settings: expected a GRPOSettings, got dict"):
        _run(op, batch, settings=dict(beta=0.04))


def test_from_trl_reads_every_option_of_a_real_grpo_config(tmp_path):
    from trl import GRPOConfig

    def config(**options):
        return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **options)

    assert GRPOSettings.from_trl(config()) == GRPOSettings(loss_type=config().loss_type,
                                                           max_completion_length=config().max_completion_length)
    options = dict(loss_type="vespo", beta=0.04, delta=2.0, use_bias_correction_kl=False,
                   importance_sampling_level="sequence", max_completion_length=64, gradient_accumulation_steps=2,
                   top_entropy_quantile=0.2, off_policy_mask_threshold=0.5, entropy_coef=0.01,
                   sapo_temperature_pos=0.9, sapo_temperature_neg=1.1, vespo_k_pos=1.0, vespo_lambda_pos=2.0,
                   vespo_k_neg=4.0, vespo_lambda_neg=3.0)
    settings = GRPOSettings.from_trl(config(epsilon=0.3, epsilon_high=0.28, **options))
    assert settings == GRPOSettings(epsilon_low=0.3, epsilon_high=0.28, **options)
