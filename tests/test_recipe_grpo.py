import json

import pytest

from logitless.cli import main
from logitless.recipes.grpo import MultichoiceGRPOConfig


def test_grpo_command_trains_logs_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["grpo", "--output-dir", str(out), "--steps", "2", "--completions-per-step", "4", "--num-generations", "2",
            "--max-completion-length", "6", "--save-every", "1"]
    assert main(argv) == 0
    history = json.loads((out / "history.json").read_text())
    assert len(history["reward"]) == 2
    for reward, p_model, p_judge in zip(history["reward"], history["p_correct_model"], history["p_correct_judge"]):
        assert 0.0 <= p_model <= 1.0 and 0.0 <= p_judge <= 1.0 and 0.0 <= reward <= p_model + 1e-6
    assert (out / "reward.png").stat().st_size > 1000
    assert (out / "checkpoint-2").is_dir()
    assert "reward" in capsys.readouterr().out
    # a rerun with more steps continues from checkpoint-2 instead of starting over
    assert main(argv[:4] + ["3"] + argv[5:]) == 0
    assert (out / "checkpoint-3").is_dir()
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_generations"):
        MultichoiceGRPOConfig(completions_per_step=6, num_generations=4)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stepz'\]"):
        MultichoiceGRPOConfig.from_dict({"stepz": 1})
    with pytest.raises(SystemExit, match="steps"):
        main(["grpo", "--steps", "0"])
