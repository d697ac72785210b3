import pytest

from logitless.cli import main
from logitless.recipes.grpo_options import MultichoiceGRPOConfig


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


def test_the_command_line_options_reach_trl(tmp_path, monkeypatch):
    """--loss-type, --temperature, --seed, --learning-rate, --save-every and --save-total-limit are the trainer's."""
    import trl

    seen = {}

    class Stop(Exception):
        pass

    def grpo_config(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(trl, "GRPOConfig", grpo_config)
    with pytest.raises(Stop):
        main(["grpo", "--output-dir", str(tmp_path / "run"), "--loss-type", "cispo", "--temperature", "0.7",
              "--seed", "3", "--learning-rate", "2e-4", "--save-every", "3", "--save-total-limit", "2"])
    assert {key: seen[key] for key in ("loss_type", "temperature", "seed", "learning_rate", "save_steps",
                                       "save_total_limit")} == dict(loss_type="cispo", temperature=0.7, seed=3,
                                                                    learning_rate=2e-4, save_steps=3,
                                                                    save_total_limit=2)
