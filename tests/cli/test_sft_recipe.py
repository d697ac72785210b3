import json

import pytest

from logitless.cli import main
from logitless.recipes.sft_options import SFTConfig


def test_config_errors_name_the_field():
    for bad, field in ((dict(steps=0), "steps"), (dict(learning_rate=float("nan")), "learning_rate"),
                       (dict(weight_decay=-1.0), "weight_decay"), (dict(on_nonfinite="ignore"), "on_nonfinite"),
                       (dict(model="./no/such/dir"), "model")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            SFTConfig(**bad)
    with pytest.raises(TypeError, match="^allow_changed: "):
        SFTConfig(allow_changed="learning_rate")
    assert SFTConfig(allow_changed=["seed"]).allow_changed == ("seed",)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stepz'\]"):
        SFTConfig.from_dict({"stepz": 3})


def test_cli_sft_with_yaml_config(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Say {i}:", "response": f" {i}"}) for i in range(8)))
    config = tmp_path / "c.yaml"
    config.write_text(f"steps: 2\nbatch_size: 4\nlearning_rate: 1e-3\ndata: {data}\n")  # 1e-3: a float, not a str
    assert main(["sft", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 0
    assert "over 2 steps" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["optimizer_param_groups"][0]["lr"] == 1e-3 and saved["trainer"]["step"] == 2
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "history.json").read_text())["step"] == 2
    config.write_text("steps: [2\n")
    with pytest.raises(SystemExit, match="--config: .* is not valid YAML"):
        main(["sft", "--config", str(config)])
    with pytest.raises(SystemExit, match="--config: no such file"):
        main(["sft", "--config", str(tmp_path / "missing.yaml")])
    config.write_text("stepz: 2\n")
    with pytest.raises(SystemExit, match=r"--config: unknown key\(s\) \['stepz'\]"):
        main(["sft", "--config", str(config)])
    with pytest.raises(SystemExit, match="--batch-size: expected a positive int"):
        main(["sft", "--batch-size", "0", "--output-dir", str(tmp_path / "o2")])


def test_sft_step_accumulation_equals_one_batch_of_uneven_lengths(tokenizer):
    import torch

    from logitless.models import tiny_qwen2
    from logitless.sft import sft_step

    pairs = [{"prompt": "2+2=", "response": " 4"},
             {"prompt": "Name a colour:", "response": " a deep shade of blue, like the evening sky over the sea"},
             {"prompt": "Say yes:", "response": " yes"}]

    def step(microbatches):
        model = tiny_qwen2(seed=0)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        done = sft_step(model, tokenizer, torch.optim.SGD(model.parameters(), lr=1.0), microbatches, step=1,
                        max_grad_norm=1e9)
        return done, {name: before[name] - p.detach() for name, p in model.named_parameters()}  # the gradient

    one_batch, accumulated = step([pairs]), step([pairs[:1], pairs[1:]])
    assert abs(one_batch[0].loss - accumulated[0].loss) < 1e-5
    assert abs(one_batch[0].entropy - accumulated[0].entropy) < 1e-5
    for name, gradient in one_batch[1].items():
        torch.testing.assert_close(accumulated[1][name], gradient, rtol=1e-4, atol=1e-6, msg=name)
