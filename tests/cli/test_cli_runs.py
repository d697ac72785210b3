"""Runs a user can trust through the `logitless` command: an exact GRPO resume on a policy that learns,
every bad option refused in one line before any model loads, interrupts that say where to resume, and
the conveniences around checkpoints."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from logitless.checkpoint import complete_checkpoints
from logitless.cli import main

CLI = [sys.executable, "-m", "logitless"]
GRPO = ["grpo", "--completions-per-step", "4", "--num-generations", "2", "--max-completion-length", "8",
        "--save-every", "1", "--learning-rate", "1e-3"]
TINY_GRADE = ["grade", "--max-new-tokens", "2", "--gumbel-topk", "16", "--save-every", "1"]


def _refuse_to_load(*args, **kwargs):
    raise AssertionError("a model was loaded before the command checked its options")


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if model weights are built or read: the command had to stop before that."""
    monkeypatch.setattr("logitless.models.tiny_qwen2", _refuse_to_load)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", _refuse_to_load)


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def _assert_resumed_steps_equal(whole_dir, split_dir, resumed_from: int, steps):
    """Each of ``steps``' checkpoints is bitwise the same in both runs, and each step moved the weights (so a resume
    from the wrong state could not match)."""
    before = _weights(whole_dir / f"checkpoint-{resumed_from}")
    for step in steps:
        whole, split = _weights(whole_dir / f"checkpoint-{step}"), _weights(split_dir / f"checkpoint-{step}")
        assert [name for name in whole if not torch.equal(whole[name], split[name])] == [], f"step {step}"
        assert max((whole[name] - before[name]).abs().max().item() for name in before) > 1e-5, f"step {step}"
        before = whole


@pytest.mark.slow
def test_sft_stopped_after_step_2_and_resumed_equals_the_uninterrupted_run(tmp_path, capsys):
    sft = ["sft", "--batch-size", "2", "--save-every", "1"]
    assert main([*sft, "--steps", "4", "--output-dir", str(tmp_path / "whole")]) == 0
    assert main([*sft, "--steps", "2", "--output-dir", str(tmp_path / "split")]) == 0
    capsys.readouterr()
    assert main([*sft, "--steps", "4", "--output-dir", str(tmp_path / "split")]) == 0
    assert "resuming from step 2" in capsys.readouterr().out
    _assert_resumed_steps_equal(tmp_path / "whole", tmp_path / "split", resumed_from=2, steps=(3, 4))


# -- exact GRPO resume on a policy that learns ---------------------------------------------------------

@pytest.mark.slow
def test_grpo_stopped_after_step_2_and_resumed_equals_the_uninterrupted_run(tmp_path, warm_policy, capsys):
    """A resume from checkpoint-2 of a warm-started policy ended 1.6e-3 away from the uninterrupted run at step 3."""
    policy, questions = warm_policy
    grpo = [*GRPO, "--model", str(policy), "--data", str(questions)]
    assert main([*grpo, "--steps", "4", "--output-dir", str(tmp_path / "whole")]) == 0
    assert main([*grpo, "--steps", "2", "--output-dir", str(tmp_path / "split")]) == 0
    capsys.readouterr()
    assert main([*grpo, "--steps", "4", "--output-dir", str(tmp_path / "split")]) == 0
    assert f"logitless grpo: resuming from step 2 ({tmp_path / 'split' / 'checkpoint-2'})" in capsys.readouterr().out
    _assert_resumed_steps_equal(tmp_path / "whole", tmp_path / "split", resumed_from=2, steps=(3, 4))
    rewards = json.loads((tmp_path / "whole" / "history.json").read_text())["reward"]
    assert len(rewards) == 4 and max(rewards) > 0
    assert json.loads((tmp_path / "split" / "history.json").read_text())["reward"] == rewards


# -- bad options: one line naming the flag, before any model loads -------------------------------------

@pytest.mark.parametrize("argv, message", [
    ([*TINY_GRADE, "--method", "all", "--batch-size", "2"], r"--grpo-group-size: .* divide --batch-size 2"),
    (["grade", "--method", "grpo", "--batch-size", "2"], r"--grpo-group-size: must be >= 2 and divide --batch-size"),
    ([*TINY_GRADE, "--gumbel-topk", "999999"], r"--gumbel-topk: expected an int in \[1, 151936\]"),
    ([*TINY_GRADE, "--reward", "words", "--reward-words", "hello_world_not_a_token"],
     r"--reward-words: 'hello_world_not_a_token' is 5 tokens .*expected exactly one"),
    ([*TINY_GRADE, "--reward-words", " good"], r"--reward-words: has no effect on this run \(used with --reward words"),
    ([*TINY_GRADE, "--method", "gumbel_legacy", "--gumbel-topk", "8"], r"--gumbel-topk: has no effect"),
    ([*TINY_GRADE, "--grpo-group-size", "2"], r"--grpo-group-size: has no effect on this run \(used by --method grpo"),
    (["grade", "--model", "nonexistent_dir"], r"--model: 'nonexistent_dir' is not a local model directory, and the "
                                              r"model hub is unreachable"),
    (["sft", "--model", "nonexistent_dir"], r"--model: 'nonexistent_dir' is not a local model directory"),
    ([*GRPO, "--model", "nonexistent_dir"], r"--model: 'nonexistent_dir' is not a local model directory"),
    (["sft", "--data", ""], r"--data: expected a path, got ''"),
    ([*GRPO, "--data", "no-org/no-dataset"], r"--data: cannot load 'no-org/no-dataset' .*; the hub is unreachable"),
    ([*GRPO, "--judge", "runs/no/such"], r"--judge: 'runs/no/such' is neither a local model directory nor a hub id"),
    (["sft", "--save-total-limit", "0"], r"--save-total-limit: expected a positive int, got 0"),
])
def test_bad_options_fail_in_one_line_naming_the_flag_before_anything_loads(tmp_path, monkeypatch, no_model_loads,
                                                                             argv, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub is unreachable, as on a machine without network
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--output-dir", str(tmp_path / "run")])
    text = str(stopped.value)
    assert "\n" not in text and stopped.value.code != 0
    prefix = f"logitless {argv[0]}: "  # as argparse's own usage errors start
    assert text.startswith(prefix) and re.match(message, text[len(prefix):]), text
    assert not (tmp_path / "run").exists() or complete_checkpoints(tmp_path / "run") == []


DATA_LINES = {"sft": {"prompt": "What is 2+2?", "response": " 4"}, "grade": {"prompt": "Once upon a time"},
              "grpo": {"question": "Which is largest?", "choices": ["1", "2"], "answer": "B"}}


@pytest.mark.parametrize("argv, given, what", [
    (["grade"], "sft", "prompts"), (["grade", "--reward", "judge"], "grade", "multiple-choice questions"),
    (["sft"], "grpo", r"\(prompt, response\) pairs"), (["sft"], "grade", r"\(prompt, response\) pairs"),
    (GRPO, "sft", "multiple-choice questions")])
def test_a_data_file_of_another_command_is_refused_by_name(tmp_path, no_model_loads, argv, given, what):
    """`logitless grade --data` given an SFT file trained on its prompts without a word about the responses."""
    data = tmp_path / f"{given}.jsonl"
    data.write_text(json.dumps(DATA_LINES[given]) + "\n")
    with pytest.raises(SystemExit, match=rf"^logitless {argv[0]}: --data: .* the data of `logitless {given}`; "
                                         rf"`logitless {argv[0]}` reads {what} "):
        main([*argv, "--data", str(data), "--output-dir", str(tmp_path / "run")])


@pytest.mark.slow
def test_a_shorter_steps_than_done_is_refused_and_allow_changed_takes_the_flag_spelling(tmp_path, capsys,
                                                                                         monkeypatch):
    out = str(tmp_path / "run")
    sft = ["sft", "--batch-size", "2", "--save-every", "1", "--output-dir", out]
    assert main([*sft, "--steps", "2"]) == 0
    with pytest.raises(SystemExit, match=r"^logitless sft: --steps: the run in .* is already at step 2, past 1; "
                                         r"pass a larger "):
        main([*sft, "--steps", "1"])
    capsys.readouterr()
    files = {path: (path.stat().st_mtime_ns, path.read_bytes()) for path in (tmp_path / "run").rglob("*")
             if path.is_file()}
    with monkeypatch.context() as patched:  # a finished run is told so before any model loads, and writes nothing
        patched.setattr("logitless.recipes.common.load_model_and_tokenizer", _refuse_to_load)
        assert main([*sft, "--steps", "2"]) == 0
    assert capsys.readouterr().out == (f"logitless sft: the run in {out} is already at step 2 of 2; "
                                       "nothing left to train\n")
    assert {path: (path.stat().st_mtime_ns, path.read_bytes()) for path in (tmp_path / "run").rglob("*")
            if path.is_file()} == files
    assert main([*sft, "--steps", "3", "--learning-rate", "0.01", "--allow-changed", "learning-rate"]) == 0
    assert "resuming from step 2" in capsys.readouterr().out
    assert main([*sft, "--steps", "4", "--learning-rate", "0.02", "--allow-changed", "learning_rate"]) == 0
    record = json.loads((tmp_path / "run" / "logitless-run.json").read_text())
    assert [change["options"] for change in record["changes"]] == [{"learning_rate": [0.003, 0.01]},
                                                                   {"learning_rate": [0.01, 0.02]}]


def test_python_dash_m_and_version():
    from logitless import __version__

    shown = subprocess.run([*CLI, "--version"], capture_output=True, text=True, check=True).stdout
    assert shown.strip() == f"logitless {__version__}"
    usage = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True).stdout
    assert usage.startswith("usage: logitless") and "grpo" in usage


# -- interrupts ----------------------------------------------------------------------------------------

def _interrupt_after(command: list[str], out: Path, checkpoint: str, sent: signal.Signals):
    """Send ``sent`` to the command once ``checkpoint`` appears (the files of the save before it are complete)."""
    process = subprocess.Popen([*CLI, *command, "--output-dir", str(out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 300
    while not (out / checkpoint).is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be interrupted"
    process.send_signal(sent)
    stdout, stderr = process.communicate(timeout=120)
    return process.returncode, stdout, stderr


@pytest.mark.slow
def test_sigint_mid_grpo_run_says_where_to_resume_in_one_line_and_keeps_its_history(tmp_path, warm_policy):
    """Ctrl-C printed a 30-60 line traceback and left no history.json or plot (written only at the end)."""
    policy, questions = warm_policy
    out = tmp_path / "run"
    code, _, stderr = _interrupt_after([*GRPO, "--model", str(policy), "--data", str(questions), "--steps", "40"],
                                       out, "checkpoint-3", signal.SIGINT)
    assert code == 130 and "Traceback" not in stderr
    last = stderr.strip().replace("\r", "\n").splitlines()[-1]
    done = max(int(path.name.split("-")[1]) for path in complete_checkpoints(out))
    assert last.startswith("logitless grpo: interrupted at step ") and last.endswith(
        f"of 40; last complete checkpoint: step {done} ({out / f'checkpoint-{done}'}); rerun the same command to "
        "resume")
    assert len(json.loads((out / "history.json").read_text())["reward"]) >= 2
    assert (out / "reward.png").stat().st_size > 1000


@pytest.mark.slow
def test_sigterm_mid_sft_run_exits_143_with_the_summary(tmp_path):
    out = tmp_path / "run"
    code, _, stderr = _interrupt_after(["sft", "--steps", "400", "--batch-size", "2", "--save-every", "2"], out,
                                       "checkpoint-4", signal.SIGTERM)
    assert code == 143 and "Traceback" not in stderr
    assert "logitless sft: interrupted at step " in stderr.splitlines()[-1]
    assert json.loads((out / "history.json").read_text())["step"] >= 2 and (out / "loss.png").is_file()


# -- GRPO that can learn, and checkpoints -----------------------------------------------------------------

@pytest.mark.slow
def test_grpo_warns_when_rewards_are_all_equal_and_resumes_quietly_keeping_the_newest_checkpoints(tmp_path, capfd):
    """The untrained default model: reward 0 at every step, exit 0, no word. A resume warned of a missing
    lm_head.weight (tied embeddings), and every checkpoint was kept."""
    out = str(tmp_path / "run")
    grpo = ["grpo", "--completions-per-step", "4", "--num-generations", "2", "--max-completion-length", "4",
            "--save-every", "1", "--save-total-limit", "2", "--output-dir", out]
    assert main([*grpo, "--steps", "2"]) == 0
    err = capfd.readouterr().err
    assert "every completion got the same reward" in err and "logitless sft" in err
    # and again at the end, for a run whose first steps happened to differ (the warning above would not fire)
    last = err.splitlines()[-1]
    assert "so those steps had nothing to learn from" in last and "logitless sft" in last
    card = (tmp_path / "run" / "README.md").read_text()  # the run's own card, not a hub card of a "None" model
    assert "None" not in card and "`tiny-qwen2`" in card and "P(correct | model) x (1 - P(correct | judge))" in card
    assert main([*grpo, "--steps", "3"]) == 0
    captured = capfd.readouterr()
    assert "resuming from step 2" in captured.out
    assert "missing keys" not in captured.err + captured.out and "in each group of the first" not in captured.err
    assert captured.err.count("nothing to learn from") == 1  # the run as a whole still had nothing to learn from
    assert [path.name for path in complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]


def test_overwrite_never_replaces_a_file_the_run_did_not_write(tmp_path):
    """--overwrite replaced the user's own checkpoint-1/ ("skipping incomplete checkpoint")."""
    out = tmp_path / "mine"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "notes.txt").write_text("the user's")
    (out / "data.csv").write_text("the user's")
    for argv in (["sft", "--steps", "1"], [*GRPO, "--steps", "1"]):
        with pytest.raises(SystemExit, match=r"^logitless (sft|grpo): --output-dir: .* holds checkpoint-1, "
                                             r"where this run would write"):
            main([*argv, "--overwrite", "--output-dir", str(out)])
    assert (out / "checkpoint-1" / "notes.txt").read_text() == "the user's"
    (out / "checkpoint-1" / "notes.txt").unlink()
    (out / "checkpoint-1").rmdir()
    assert main(["sft", "--steps", "1", "--batch-size", "2", "--overwrite", "--output-dir", str(out)]) == 0
    assert (out / "data.csv").read_text() == "the user's" and (out / "checkpoint-1").is_dir()


@pytest.mark.slow
def test_an_sft_resume_needs_its_checkpoint_not_the_hub(tmp_path, monkeypatch):
    """The model check ran before the resume was found: an SFT run of a hub model could not resume offline
    although its checkpoint holds the model."""
    sft = ["sft", "--batch-size", "2", "--save-every", "1"]
    assert main([*sft, "--steps", "1", "--output-dir", str(tmp_path / "run")]) == 0
    record = tmp_path / "run" / "logitless-run.json"
    run = json.loads(record.read_text())
    run["options"]["model"] = "some-org/not-cached"  # as if the run had started from a hub model
    record.write_text(json.dumps(run))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_model = ["--model", "some-org/not-cached"]
    assert main([*sft, *hub_model, "--steps", "2", "--output-dir", str(tmp_path / "run")]) == 0
    with pytest.raises(SystemExit, match=r"^logitless sft: --model: 'some-org/not-cached' "
                                         r"is not a local model directory"):
        main([*sft, *hub_model, "--steps", "1", "--output-dir", str(tmp_path / "new")])


def test_an_interrupt_before_training_does_not_report_an_earlier_commands_run(tmp_path, monkeypatch, capsys):
    """Two commands in one process: Ctrl-C while the second loaded its model reported the first one's step."""
    sft = ["sft", "--batch-size", "2", "--save-every", "1", "--steps", "1"]
    assert main([*sft, "--output-dir", str(tmp_path / "first")]) == 0

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("logitless.recipes.sft.load_model", interrupted)
    capsys.readouterr()
    assert main([*sft, "--output-dir", str(tmp_path / "second")]) == 130
    assert capsys.readouterr().err.strip() == "logitless sft: interrupted before training started"
