import pytest

from logitless.cli import main
from logitless.recipes.grpo import MultichoiceGRPOConfig


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_generations"):
        MultichoiceGRPOConfig(completions_per_step=6, num_generations=4)
    with pytest.raises(ValueError, match="^loss_type: expected one of"):
        MultichoiceGRPOConfig(loss_type="luspo")
    with pytest.raises(ValueError, match="^temperature: expected a finite number"):
        MultichoiceGRPOConfig(temperature=float("inf"))
    with pytest.raises(ValueError, match="^judge: no such model directory"):
        MultichoiceGRPOConfig(judge="/no/such/judge")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stepz'\]"):
        MultichoiceGRPOConfig.from_dict({"stepz": 1})
    with pytest.raises(SystemExit, match="--steps"):
        main(["grpo", "--steps", "0"])
    assert MultichoiceGRPOConfig(completions_per_step=12, num_generations=3).prompts_per_step == 4
