"""`logitless distill`: the student's divergence to the teacher falls, a resume ends bitwise where the uninterrupted run
does, the built-in teacher is made once, and bad options end in one line naming the flag."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from logitless.cli import main  # noqa: E402
from logitless.multichoice.warm_start import warm_start_policy  # noqa: E402
from test_cli_runs import _assert_resumed_steps_equal  # noqa: E402

SMALL = ["distill", "--prompts-per-step", "4", "--max-completion-length", "8", "--save-every", "1",
         "--save-total-limit", "3"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A teacher as `logitless sft` makes one: the embedded untied tiny Qwen2 taught the answer format."""
    return str(warm_start_policy(tmp_path_factory.mktemp("teacher"), steps=20, progress=False)[1])


@pytest.mark.slow
def test_the_divergence_to_the_teacher_falls(tmp_path, teacher, capsys):
    assert main([*SMALL, "--teacher", teacher, "--steps", "12", "--output-dir", str(tmp_path / "run")]) == 0
    divergence = json.loads((tmp_path / "run" / "history.json").read_text())["loss"]
    assert len(divergence) == 12 and sum(divergence[-3:]) / 3 < 0.8 * sum(divergence[:3]) / 3, divergence
    assert "divergence to the teacher " in capsys.readouterr().out
    assert (tmp_path / "run" / "divergence.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.parametrize("beta", ["0.5", "0.0"])
def test_a_run_stopped_after_step_2_and_resumed_equals_the_uninterrupted_run(tmp_path, teacher, capsys, beta):
    run = [*SMALL, "--teacher", teacher, "--beta", beta]
    assert main([*run, "--steps", "4", "--output-dir", str(tmp_path / "whole")]) == 0
    assert main([*run, "--steps", "2", "--output-dir", str(tmp_path / "split")]) == 0
    capsys.readouterr()
    assert main([*run, "--steps", "4", "--output-dir", str(tmp_path / "split")]) == 0
    assert "logitless distill: resuming from step 2" in capsys.readouterr().out
    _assert_resumed_steps_equal(tmp_path / "whole", tmp_path / "split", resumed_from=2, steps=(3, 4))
    histories = [json.loads((tmp_path / run_dir / "history.json").read_text())["loss"]
                 for run_dir in ("whole", "split")]
    assert histories[0] == histories[1]
    if beta == "0.5":
        _assert_a_rerun_of_a_finished_run_loads_and_writes_nothing([*run, "--steps", "4"], tmp_path / "whole")


HEAVY_MODULES = ("torch", "transformers", "trl", "peft", "datasets", "matplotlib")


def _imported_and_said(argv: list[str]) -> tuple[set[str], subprocess.CompletedProcess]:
    """(the top-level packages ``logitless ARGV`` imported, the finished process), run in a fresh process."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "logitless", *argv], capture_output=True,
                          text=True, timeout=120)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    done.stderr = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("import time:"))
    return imported, done


def _snapshot(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``directory``: its modification time and a digest of its content."""
    return {str(path.relative_to(directory)): (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
            for path in sorted(directory.rglob("*")) if path.is_file()}


def _assert_a_rerun_of_a_finished_run_loads_and_writes_nothing(argv: list[str], run_dir: Path) -> None:
    """A finished run rerun loaded both models (40 s), showed 0/6 progress bars and rewrote history.json, README.md
    and divergence.png: it must say so before loading anything, and leave every file as it was."""
    before = _snapshot(run_dir)
    imported, done = _imported_and_said([*argv, "--output-dir", str(run_dir)])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (f"logitless distill: the run in {run_dir} is already at step 4 of 4; "
                                   "nothing left to train")
    assert sorted(imported & set(HEAVY_MODULES)) == [] and _snapshot(run_dir) == before


def test_a_teacher_of_another_vocabulary_is_refused_in_one_line_before_any_model_loads(tmp_path):
    """A teacher with another vocabulary got a traceback from TRL after 28 s, both models loaded, and left a claimed
    run directory behind: both configs are read first, and a refused start leaves nothing."""
    teacher = tmp_path / "llama-teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32000}))
    imported, done = _imported_and_said([*SMALL, "--teacher", str(teacher), "--output-dir", str(tmp_path / "run")])
    assert done.returncode == 1 and done.stderr.strip() == (
        "logitless distill: --teacher: its vocabulary 32000 differs from the student's 151936 (tiny-qwen2-untied); "
        "the divergence compares both models' distributions over one vocabulary")
    assert sorted(imported & set(HEAVY_MODULES)) == [] and not (tmp_path / "run").exists()
    imported, done = _imported_and_said([*SMALL, "--model", str(teacher), "--output-dir", str(tmp_path / "run")])
    assert done.returncode == 1 and done.stderr.startswith(
        "logitless distill: --model: its vocabulary 32000 differs from the built-in teacher's 151936")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_built_in_teacher_is_warm_started_once(tmp_path, capsys):
    run = [*SMALL, "--teacher-steps", "3", "--output-dir", str(tmp_path / "run")]
    assert main([*run, "--steps", "1"]) == 0
    assert "warm-starting the teacher" in capsys.readouterr().out
    teacher = tmp_path / "run" / "teacher"
    assert (teacher / "config.json").is_file() and not (tmp_path / "run" / ".teacher.partial").exists()
    made = (teacher / "model.safetensors").stat().st_mtime_ns
    assert main([*run, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "resuming from step 1" in out and "warm-starting" not in out
    assert (teacher / "model.safetensors").stat().st_mtime_ns == made


@pytest.mark.parametrize("argv, message", [
    (["--beta", "1.5"], r"--beta: expected a number in \[0, 1\]"),
    (["--teacher", "/no/such/teacher"], r"--teacher: no such model directory '/no/such/teacher'"),
    (["--teacher", "tiny-qwen2", "--teacher-steps", "5"], r"--teacher-steps: has no effect on this run"),
    (["--prompts-per-step", "0"], r"--prompts-per-step: expected a positive int, got 0"),
])
def test_bad_options_end_in_one_line_naming_the_flag(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=rf"^logitless distill: {message}"):
        main(["distill", *argv, "--output-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
