import json

import pytest

from logitless.cli import main
from logitless.recipes.sft import SFTConfig, train_sft


def test_loss_falls(tmp_path):
    history = train_sft(SFTConfig(output_dir=str(tmp_path), steps=12, batch_size=4, save_every=100), progress=False)
    assert len(history["loss"]) == 12 and history["loss"][-1] < history["loss"][0] - 1.0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert (tmp_path / "checkpoint" / "model.safetensors").is_file()


def test_resume_after_interruption_loses_nothing(tmp_path):
    settings = dict(steps=6, batch_size=4, save_every=3)
    straight = train_sft(SFTConfig(output_dir=str(tmp_path / "a"), **settings), progress=False)
    # "crash" after step 3: run to 3, then start again with the full step count
    train_sft(SFTConfig(output_dir=str(tmp_path / "b"), **settings | dict(steps=3)), progress=False)
    resumed = train_sft(SFTConfig(output_dir=str(tmp_path / "b"), **settings), progress=False)
    assert resumed["step"] == 6
    assert resumed["loss"] == pytest.approx(straight["loss"], abs=1e-5)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="steps"):
        SFTConfig(steps=0)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stepz'\]"):
        SFTConfig.from_dict({"stepz": 3})


def test_cli_sft_with_yaml_config(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Say {i}:", "response": f" {i}"}) for i in range(8)))
    config = tmp_path / "c.yaml"
    config.write_text(f"steps: 2\nbatch_size: 4\nlearning_rate: 1e-3\ndata: {data}\n")  # 1e-3: a float, not a str
    assert main(["sft", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 0
    assert "over 2 steps" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "checkpoint" / "trainer_state.json").read_text())
    assert saved["optimizer_param_groups"][0]["lr"] == 1e-3
    config.write_text("steps: [2\n")
    with pytest.raises(SystemExit, match="--config: .* is not valid YAML"):
        main(["sft", "--config", str(config)])
    with pytest.raises(SystemExit, match="--config: no such file"):
        main(["sft", "--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(SystemExit, match="batch_size"):
        main(["sft", "--batch-size", "0", "--output-dir", str(tmp_path / "o2")])


def test_demo_refuses_a_directory_it_did_not_write_and_checks_options_first(tmp_path):
    from logitless.cli import main
    from logitless.recipes.demo import MARKER, fresh_output_dir

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "important.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="--output-dir: .* holds files the demo did not write"):
        main(["demo", "--output-dir", str(precious)])
    with pytest.raises(SystemExit, match="--steps: expected a positive int"):
        main(["demo", "--steps", "0", "--output-dir", str(tmp_path / "new")])
    assert (precious / "important.txt").read_text() == "keep me" and not (tmp_path / "new").exists()
    # an earlier demo's directory (it carries the marker) is replaced
    earlier = fresh_output_dir(str(tmp_path / "demo"))
    (earlier / "sft").mkdir()
    assert (earlier / MARKER).exists()
    again = fresh_output_dir(str(earlier))
    assert not (again / "sft").exists() and (again / MARKER).exists()
