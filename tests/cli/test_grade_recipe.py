"""`logitless grade` end to end: the reward rises (fixed seed), a killed run resumes to the same weights,
options and errors on the command line."""

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from logitless.checkpoint import last_complete_checkpoint
from logitless.cli import build_parser, main
from logitless.grade import METRIC_NAMES
from logitless.recipes.grade import train_grade
from logitless.recipes.grade_method import VALIDATION
from logitless.recipes.grade_prompts import DEFAULT_PROMPTS, EVAL_PROMPTS
from logitless.recipes.grade_options import STEERING_OPTIONS, GradeRunConfig

TINY = dict(max_new_tokens=2, batch_size=2, gumbel_topk=16, save_every=2)


def _weights(directory):
    return load_file(str(last_complete_checkpoint(directory)[0] / "model.safetensors"))


@pytest.mark.slow
def test_reward_rises_over_a_short_cpu_run(tmp_path):
    run = GradeRunConfig.from_dict(dict(output_dir=str(tmp_path), steps=12, max_new_tokens=4, batch_size=4,
                                        save_every=12, seed=0))
    rewards = [row["reward"] for row in train_grade(run, progress=False)["gumbel"]]
    quarter = len(rewards) // 4
    assert sum(rewards[-quarter:]) / quarter > sum(rewards[:quarter]) / quarter + 0.03, rewards
    rows = [json.loads(line) for line in (tmp_path / "gumbel" / "metrics.jsonl").read_text().splitlines()]
    assert [row["reward"] for row in rows] == rewards and all(tuple(row) == (*METRIC_NAMES, VALIDATION) for row in rows)
    # the held-out score at steps 5, 10 and the end (eval_every 5), on prompts never trained on
    assert [row["step"] for row in rows if row[VALIDATION] is not None] == [5, 10, 12]
    assert all(0 <= row[VALIDATION] <= 1 for row in rows if row[VALIDATION] is not None)
    assert (tmp_path / "gumbel" / "reward.png").stat().st_size > 10_000


@pytest.mark.slow
def test_killed_run_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    options = ["--steps", "5", "--max-new-tokens", "2", "--batch-size", "2", "--gumbel-topk", "16",
               "--save-every", "2", "--method", "ste"]
    killed = tmp_path / "killed"

    process = subprocess.Popen([sys.executable, "-m", "logitless.cli", "grade", "--output-dir", str(killed), *options],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while (last_complete_checkpoint(killed / "ste")[0] is None and process.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    state = json.loads((last_complete_checkpoint(killed / "ste")[0] / "trainer_state.json").read_text())["trainer"]
    assert 2 <= state["step"] < 5, "the run was not killed in the middle"
    at_kill = _weights(killed / "ste")
    assert main(["grade", "--output-dir", str(killed), *options]) == 0  # resumes
    assert main(["grade", "--output-dir", str(tmp_path / "whole"), *options]) == 0
    resumed, whole = _weights(killed / "ste"), _weights(tmp_path / "whole" / "ste")
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name
    assert any(not torch.equal(at_kill[name], resumed[name]) for name in at_kill), \
        "the steps after the kill moved nothing"
    rows = (killed / "ste" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 4, 5]
    with pytest.raises(SystemExit, match="--learning-rate: resuming the run .* changed options"):
        main(["grade", "--output-dir", str(killed), *options, "--steps", "6", "--learning-rate", "0.5"])
    assert main(["grade", "--output-dir", str(killed), *options, "--steps", "6", "--learning-rate", "0.5",
                 "--allow-changed", "learning_rate"]) == 0
    record = json.loads((killed / "logitless-run.json").read_text())
    assert record["changes"][-1]["options"] == {"learning_rate": [0.01, 0.5]}


def test_a_directory_the_user_filled_is_refused_before_any_model_loads(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="--output-dir: .* not empty and no logitless run claimed it"):
        main(["grade", "--output-dir", str(tmp_path), "--steps", "1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_help_states_every_default():
    grade = build_parser()._subparsers._group_actions[0].choices["grade"]
    for action in grade._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in (action.help or ""), action.option_strings
    helps = {action.dest: action.help for action in grade._actions}
    assert helps["reward_words"].endswith("(default: ' good' ' great')")  # the leading spaces are part of the words


@pytest.mark.parametrize("argv, message", [
    (["--gumbel-topk", "0"], "--gumbel-topk: expected a positive int"),
    (["--tau-start", "0"], "--tau-start: expected a finite number > 0"),
    (["--learning-rate", "inf"], "--learning-rate: expected a finite number > 0, got inf"),
    (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive int"),
    (["--reward", "classifier"], "--reward-model: a sequence classifier"),
    (["--config", "missing.yaml"], "--config: no such file"),
    (["--model", "./no-such-model"], "--model: no such model directory"),
    (["--allow-changed", "method"], "--allow-changed: .* are not options a resume may change"),
])
def test_command_line_errors_name_the_option(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main(["grade", "--output-dir", str(tmp_path), *argv])


@pytest.mark.slow
def test_lora_run_resumes_from_its_adapter_checkpoint(tmp_path):
    pytest.importorskip("peft")  # in the dev extra
    settings = dict(max_new_tokens=2, batch_size=2, gumbel_topk=8, lora_rank=2, save_every=1)
    train_grade(GradeRunConfig.from_dict(dict(output_dir=str(tmp_path / "split"), steps=1, **settings)), progress=False)
    resumed = train_grade(GradeRunConfig.from_dict(dict(output_dir=str(tmp_path / "split"), steps=2, **settings)),
                        progress=False)["gumbel"]
    whole = train_grade(GradeRunConfig.from_dict(dict(output_dir=str(tmp_path / "whole"), steps=2, **settings)),
                      progress=False)["gumbel"]
    assert [row["step"] for row in resumed] == [1, 2]
    assert [row["loss"] for row in resumed] == [row["loss"] for row in whole]
    split = load_file(str(tmp_path / "split" / "gumbel" / "checkpoint-2" / "adapter_model.safetensors"))
    unsplit = load_file(str(tmp_path / "whole" / "gumbel" / "checkpoint-2" / "adapter_model.safetensors"))
    assert split.keys() == unsplit.keys() and all(torch.equal(split[k], unsplit[k]) for k in split)
    first = load_file(str(tmp_path / "whole" / "gumbel" / "checkpoint-1" / "adapter_model.safetensors"))
    assert any(not torch.equal(first[k], unsplit[k]) for k in first), "step 2 moved no adapter weight"


def test_the_default_config_file_spells_out_the_commands_defaults():
    """configs/grade.yaml says it is the default run: each of its values is the one `logitless grade` uses, and
    it names every option that changes that run's result."""
    import yaml

    values = yaml.safe_load((Path(__file__).parents[2] / "configs" / "grade.yaml").read_text())
    defaults = GradeRunConfig()
    assert len(values) >= 15 and {name: getattr(defaults, name) for name in values} == values
    assert GradeRunConfig.from_dict(values) == defaults

    def used(name):  # by the default run (refuse_unused refuses the others)
        try:
            defaults.refuse_unused([name])
        except ValueError:
            return False
        return True

    result = [field.name for field in dataclasses.fields(GradeRunConfig) if field.name not in STEERING_OPTIONS]
    assert [name for name in result if used(name) and name not in values] == []


@pytest.mark.slow
def test_method_all_ends_with_a_table_and_a_plot_of_every_methods_held_out_reward(tmp_path, capsys):
    assert not set(EVAL_PROMPTS) & set(DEFAULT_PROMPTS)  # held out: never trained on
    argv = ["grade", "--method", "all", "--steps", "2", "--eval-every", "1", "--max-new-tokens", "2",
            "--batch-size", "2", "--grpo-group-size", "2", "--gumbel-topk", "16", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    for method in ("gumbel", "ste", "gumbel_legacy", "ste_legacy", "grpo"):
        rows = [json.loads(line) for line in (tmp_path / method / "metrics.jsonl").read_text().splitlines()]
        first, last = rows[0][VALIDATION], rows[-1][VALIDATION]
        assert f"| {method} | " in table and f"| {first:.4f} (step 1) -> {last:.4f} (step 2) |" in table
    assert (tmp_path / "val_reward_by_method.png").stat().st_size > 10_000
    saved = (tmp_path / "summary.md").read_text()  # the table is kept, as the demo keeps its own
    assert saved.startswith("| method |") and all(f"| {method} | " in saved for method in ("gumbel", "grpo"))


def test_eval_every_without_held_out_prompts_is_refused(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    with pytest.raises(SystemExit, match=r"^logitless grade: --eval-every: has no effect on this run "
                                         r"\(there are no held-out prompts"):
        main(["grade", "--data", str(data), "--eval-every", "2", "--output-dir", str(tmp_path / "run")])


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "Hi"}', '{"text": "Hi"}'], r"^logitless grade: --data: line 2 of .* has no 'prompt' string$"),
    (['{"prompt": "Hi"}', '{"prompt": ""}'], r"^logitless grade: --data: line 2 of .* has an empty 'prompt'$"),
    ([], r"^logitless grade: --data: .* holds no prompts$"),
])
def test_prompt_files_are_checked_before_any_model_loads(lines, message, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(SystemExit, match=message):
        main(["grade", "--data", str(data), "--steps", "1", "--output-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_config_file_keys_that_are_no_options_keep_their_names_in_errors(tmp_path):
    """straight_through is each method's (ste, ste_legacy); a --config error lists the keys as the file spells them."""
    config = tmp_path / "grade.yaml"
    config.write_text("straight_through: true\n")
    with pytest.raises(SystemExit, match=r"^logitless grade: straight_through: has no effect on this run "
                                         r"\(each --method fixes it"):
        main(["grade", "--config", str(config), "--output-dir", str(tmp_path / "run")])
    config.write_text("topk: 3\n")
    with pytest.raises(SystemExit, match=r"^logitless grade: --config: unknown key\(s\) \['topk'\]; "
                                         r"known: \[.*'batch_size', 'data'"):
        main(["grade", "--config", str(config), "--output-dir", str(tmp_path / "run")])


@pytest.mark.parametrize("yaml_text, message", [
    ("reward: words\nreward_words: []\n", r"^logitless grade: --reward-words: the list is empty"),
    ("reward: token\nreward_suffix: 5\n", r"^logitless grade: --reward-suffix: expected a string, got int$"),
    ("reward: token\nreward_token: 5\n", r"^logitless grade: --reward-token: expected a string, got int$"),
    ("lora_rank: 2\nlora_target_modules: []\n", r"^logitless grade: lora_target_modules: the list is empty"),
    ("lora_rank: 2\nlora_target_modules: [qproj]\n", r"^logitless grade: lora_target_modules: .*qproj.* "
                                                       r"\(this model's linear modules: "
                                                       r"down_proj, .*q_proj"),
])
def test_config_file_values_of_the_wrong_kind_are_named_in_one_line(yaml_text, message, tmp_path):
    pytest.importorskip("peft")  # in the dev extra
    config = tmp_path / "grade.yaml"
    config.write_text(yaml_text + "steps: 1\nbatch_size: 2\nmax_new_tokens: 2\n")
    with pytest.raises(SystemExit, match=message) as stopped:
        main(["grade", "--config", str(config), "--output-dir", str(tmp_path / "run")])
    assert "\n" not in str(stopped.value)


def test_a_reward_model_that_cannot_be_loaded_is_named_in_one_line(tmp_path):
    (tmp_path / "not_a_model").mkdir()
    with pytest.raises(SystemExit) as stopped:
        main(["grade", "--reward", "token", "--reward-model", str(tmp_path / "not_a_model"), "--steps", "1",
              "--output-dir", str(tmp_path / "run")])
    assert str(stopped.value).startswith(f"logitless grade: --reward-model: cannot load '{tmp_path / 'not_a_model'}'")
    assert "\n" not in str(stopped.value)


@pytest.mark.slow
def test_another_method_in_the_same_directory_keeps_the_first_ones_results(tmp_path, capsys):
    """The directory is one run: a second method joins it (options compared), never deletes the first's results."""
    common = ["--output-dir", str(tmp_path), "--steps", "1", "--max-new-tokens", "2", "--batch-size", "2",
              "--save-every", "1"]
    options = [*common, "--gumbel-topk", "16"]
    assert main(["grade", *options]) == 0
    gumbel = _weights(tmp_path / "gumbel")
    assert main(["grade", "--method", "ste", *options]) == 0
    kept = _weights(tmp_path / "gumbel")
    assert _weights(tmp_path / "ste") and all(torch.equal(gumbel[name], kept[name]) for name in gumbel)
    files = {path: (path.stat().st_mtime_ns, path.read_bytes()) for path in tmp_path.rglob("*") if path.is_file()}
    capsys.readouterr()
    assert main(["grade", "--method", "ste", *options]) == 0  # finished: nothing loaded, trained or written
    assert capsys.readouterr().out == (f"logitless grade: the run in {tmp_path} is already at step 1 of 1; "
                                       "nothing left to train\n")
    assert {path: (path.stat().st_mtime_ns, path.read_bytes()) for path in tmp_path.rglob("*")
            if path.is_file()} == files
    with pytest.raises(SystemExit, match="resuming the run .* with changed options"):  # the same run's options
        main(["grade", "--method", "grpo", *common, "--grpo-group-size", "2", "--kl-coef", "0.5"])
    assert main(["grade", "--no-resume", "--method", "ste", *options]) == 0  # starting over is explicit
    assert not (tmp_path / "gumbel").exists()
