"""What a new user runs into, each case through the `logitless` command as the user runs it, using only
`logitless.cli.main` and files on disk, as a user would."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from logitless.checkpoint import complete_checkpoints, last_complete_checkpoint
from logitless.cli import main
from logitless.models import save_model_and_tokenizer, tiny_qwen2

SFT = ["sft", "--batch-size", "2", "--save-every", "1"]
GRPO = ["grpo", "--completions-per-step", "4", "--num-generations", "2", "--max-completion-length", "4",
        "--save-every", "1"]


def run(*argv, out: Path, steps: int):
    return main([*argv, "--steps", str(steps), "--output-dir", str(out)])


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if a model is built: the command had to stop before that."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the command checked its options")

    monkeypatch.setattr("logitless.models.tiny_qwen2", refuse)


# -- data loss and stuck runs ------------------------------------------------------------------------

def test_the_demo_never_removes_other_runs(tmp_path):
    """`logitless demo --output-dir R` removed R when it held only sft/ and grpo/, the other commands' defaults."""
    runs = tmp_path / "R"
    for name in ("sft", "grpo"):
        (runs / name).mkdir(parents=True)
        (runs / name / "history.json").write_text("my run")
    with pytest.raises(SystemExit, match="--output-dir: .* not empty"):
        main(["demo", "--output-dir", str(runs), "--steps", "1", "--grpo-steps", "1"])
    assert all((runs / name / "history.json").read_text() == "my run" for name in ("sft", "grpo"))


@pytest.mark.parametrize("command, mine", [(SFT, ("checkpoint/notes.txt", "history.json", "loss.png")),
                                           (GRPO, ("README.md",))])
def test_a_run_never_writes_into_a_directory_it_did_not_claim(tmp_path, command, mine):
    """sft deleted D/checkpoint/ (with the user's file in it) and overwrote D's history and plot; grpo D/README.md."""
    out = tmp_path / "D"
    for name in mine:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("the user's")
    with pytest.raises(SystemExit, match="--output-dir: .* not empty and no logitless run claimed it"):
        run(*command, out=out, steps=1)
    assert all((out / name).read_text() == "the user's" for name in mine)


@pytest.mark.slow
def test_a_crash_anywhere_in_an_sft_save_leaves_a_checkpoint(tmp_path, monkeypatch, tokenizer):
    """A crash between the two renames of an SFT checkpoint must leave one: every file-system step of a save
    (keeping one checkpoint) is interrupted in turn, and the previous or the new checkpoint is there, and the next
    save succeeds."""
    from logitless.checkpoint import last_complete_checkpoint, load_checkpoint_state, save_checkpoint

    model = tiny_qwen2(vocab_size=151646, hidden_size=8, intermediate_size=16, num_hidden_layers=1)
    optimizer = torch.optim.AdamW(model.parameters())

    class Crash(Exception):
        pass

    for crash_at in range(100):
        directory = tmp_path / f"run{crash_at}"
        save_checkpoint(directory, 1, model, tokenizer, optimizer, {"step": 1})
        mutations = [0]
        for name in ("rename", "replace", "symlink", "unlink", "rmdir"):
            real = getattr(os, name)

            def interrupted(*args, _real=real, **kwargs):
                if mutations[0] == crash_at:
                    raise Crash
                mutations[0] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(os, name, interrupted)
        try:
            save_checkpoint(directory, 2, model, tokenizer, optimizer, {"step": 2}, keep=1)
            finished = True
        except Crash:
            finished = False
        monkeypatch.undo()
        checkpoint, _ = last_complete_checkpoint(directory)
        assert checkpoint is not None, f"no checkpoint after a crash at file-system step {crash_at}"
        step = load_checkpoint_state(checkpoint, torch.optim.AdamW(model.parameters()))["step"]
        assert step in (1, 2)
        if finished:
            assert step == 2
            break
        save_checkpoint(directory, 3, model, tokenizer, optimizer, {"step": 3}, keep=1)  # the rerun's next save
        assert load_checkpoint_state(last_complete_checkpoint(directory)[0], optimizer)["step"] == 3
    assert finished and crash_at >= 2


def test_an_unwritable_output_dir_fails_before_training(tmp_path, no_model_loads):
    """An unwritable --output-dir failed only at the first save, after the training time was spent."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for command in (SFT, GRPO):
        with pytest.raises(SystemExit, match="--output-dir: cannot write"):
            run(*command, out=blocker / "run", steps=1)


# -- silent wrong training ---------------------------------------------------------------------------

def _checkpoint_learning_rate(out: Path) -> float:
    checkpoint, _ = last_complete_checkpoint(out)
    return json.loads((checkpoint / "trainer_state.json").read_text())["optimizer_param_groups"][0]["lr"]


@pytest.mark.slow
def test_sft_resume_refuses_changed_options_unless_allowed(tmp_path, tokenizer):
    """Resuming with a new learning rate ignored it; a new --model was ignored."""
    out = tmp_path / "run"
    assert run(*SFT, out=out, steps=1) == 0
    with pytest.raises(SystemExit,
                       match=r"--learning-rate: .*--learning-rate 0.003 -> 0.01.*--allow-changed learning-rate "):
        run(*SFT, "--learning-rate", "0.01", out=out, steps=2)
    other = save_model_and_tokenizer(tiny_qwen2(seed=1), tokenizer, tmp_path / "other")
    with pytest.raises(SystemExit, match="--model: .*cannot resume"):
        run(*SFT, "--model", str(other), "--allow-changed", "learning_rate", out=out, steps=2)
    assert run(*SFT, "--learning-rate", "0.01", "--allow-changed", "learning_rate", out=out, steps=2) == 0
    assert _checkpoint_learning_rate(out) == 0.01  # in force, not the checkpoint's
    record = json.loads((out / "logitless-run.json").read_text())
    assert record["changes"][-1]["options"] == {"learning_rate": [0.003, 0.01]} and record["changes"][-1]["step"] == 1


def _logged_learning_rates(out: Path, step: int) -> list[float]:
    state = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return [entry["learning_rate"] for entry in state["log_history"] if "learning_rate" in entry]


@pytest.mark.slow
def test_grpo_resumes_past_a_partial_checkpoint_refuses_changed_options_and_keeps_its_learning_rate(
        tmp_path, capsys):
    """A SIGKILL during a GRPO save left a partial checkpoint-N, and every rerun crashed on its trainer_state.json.
    A new learning rate was ignored on resume, and a longer schedule logged a broken learning-rate curve."""
    out = tmp_path / "run"
    assert run(*GRPO, out=out, steps=1) == 0
    partial = out / "checkpoint-2"  # what a kill in the middle of a save by another program can leave
    partial.mkdir()
    shutil.copy(out / "checkpoint-1" / "model.safetensors", partial)
    with pytest.raises(SystemExit, match="--learning-rate: resuming"):
        run(*GRPO, "--learning-rate", "1e-4", out=out, steps=2)
    assert run(*GRPO, out=out, steps=2) == 0  # more steps: the same constant learning rate continues
    assert "skipping incomplete checkpoint" in capsys.readouterr().out
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    assert _logged_learning_rates(out, 2) == [5e-5, 5e-5]
    assert run(*GRPO, "--learning-rate", "1e-4", "--allow-changed", "learning_rate", out=out, steps=3) == 0
    assert _logged_learning_rates(out, 3) == [5e-5, 5e-5, 1e-4]


@pytest.mark.slow
def test_a_nonfinite_loss_stops_sft_before_anything_is_saved(tmp_path, capsys):
    """`logitless sft --learning-rate inf` trained to NaN, checkpointed NaN weights and exited 0."""
    with pytest.raises(SystemExit, match="--learning-rate: expected a finite number > 0, got inf"):
        run(*SFT, "--learning-rate", "inf", out=tmp_path / "inf", steps=2)
    out = tmp_path / "huge"
    with pytest.raises(SystemExit, match=r"logitless sft: step 2: the loss is nan; stopped before the optimizer step"):
        run(*SFT, "--learning-rate", "1e30", out=out, steps=3)
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-1"]
    weights = load_file(str(out / "checkpoint-1" / "model.safetensors"))  # step 1's: huge but finite
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    # or skip such steps: the run finishes, says so, and its weights stay finite
    assert run(*SFT, "--learning-rate", "1e30", "--on-nonfinite", "skip", out=tmp_path / "skip", steps=3) == 0
    assert "2 steps skipped (not finite)" in capsys.readouterr().out
    assert json.loads((tmp_path / "skip" / "history.json").read_text())["skipped"] == [2, 3]


# -- rough edges --------------------------------------------------------------------------------------

def _jsonl(path: Path, rows) -> str:
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


QUESTION = {"question": "Which is largest?", "choices": ["1", "2", "3", "4"], "answer": "D"}


@pytest.mark.parametrize("argv, message", [
    (["grpo", "--data", "{one}"], r"--data: .* holds 1 question\(s\); one step needs .* = 2"),
    (["grpo", "--data", "{missing}"], "--data: no such file"),
    (["grpo", "--data", "{null_question}"], "--data: line 1 of .* question that is not a string: None"),
    (["grpo", "--data", "{null_option}"], "--data: line 1 of .* option that is not a string or a number: None"),
    (["sft", "--data", "{missing}"], "--data: no such file"),
    (["sft", "--data", "{numeric_prompt}"], "--data: line 1 of .* prompt that is not a string: 7"),
    (["sft", "--data", "{null_prompt}"], "--data: line 1 of .* prompt that is not a string: None"),
    (["sft", "--data", "{empty_responses}"], "--data: every response in .* is empty"),
    (["sft", "--data", "{three}"], "--batch-size: 8 exceeds the 3 usable examples"),
    (["sft", "--config", "{negative_decay}"], "--weight-decay: expected a finite number >= 0, got -0.1"),
])
def test_bad_options_and_data_stop_before_any_model_loads(tmp_path, no_model_loads, argv, message):
    files = {
        "one": [QUESTION], "missing": None,
        "null_question": [dict(QUESTION, question=None)], "null_option": [dict(QUESTION, choices=["1", None])],
        "numeric_prompt": [{"prompt": 7, "response": " seven"}], "null_prompt": [{"prompt": None, "response": "x"}],
        "empty_responses": [{"prompt": f"p{i}", "response": ""} for i in range(8)],
        "three": [{"prompt": f"p{i}", "response": " r"} for i in range(3)],
    }
    paths = {name: (str(tmp_path / f"{name}.jsonl") if rows is None else _jsonl(tmp_path / f"{name}.jsonl", rows))
             for name, rows in files.items()}
    (tmp_path / "decay.yaml").write_text("weight_decay: -0.1\n")
    paths["negative_decay"] = str(tmp_path / "decay.yaml")
    with pytest.raises(SystemExit, match=message):
        main([arg.format(**paths) for arg in argv] + ["--output-dir", str(tmp_path / "out")])


@pytest.mark.parametrize("argv, message", [
    (["lmhead", "--device", "tpu"], "--device: expected cpu or cuda\\[:N\\], got 'tpu'"),
    (["grpo", "--num-generations", "1"], "--num-generations: must be >= 2"),
    (["lmhead", "-V", "64", "--json", "{blocked}/r.json"], "--json: cannot write"),
    (["lmhead", "-V", "64", "--plot", "{directory}"], "--plot: cannot write"),
])
def test_bench_options_are_checked_before_the_benchmark_runs(tmp_path, monkeypatch, argv, message):
    from logitless.bench import grpo, lmhead

    def refuse(*args, **kwargs):
        raise AssertionError("the benchmark ran before its options were checked")

    monkeypatch.setattr(lmhead, "run", refuse)
    monkeypatch.setattr(grpo, "run", refuse)
    (tmp_path / "blocked").write_text("a file, not a directory")
    paths = {"blocked": str(tmp_path / "blocked"), "directory": str(tmp_path)}
    with pytest.raises(SystemExit, match=message):
        main(["bench", *[arg.format(**paths) for arg in argv]])
