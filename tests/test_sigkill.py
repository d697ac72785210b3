"""SIGKILL at random moments, during steps and during checkpoint saves: every rerun ends with the weights
of an uninterrupted run (tests/sigkill.py; LOGITLESS_KILL_POINTS=N runs N kills per trainer)."""

import sys

from sigkill import check_sigkill_anywhere, kill_points, safetensors_weights

from logitless.checkpoint import last_complete_checkpoint

CLI = [sys.executable, "-m", "logitless.cli"]


def test_sft_survives_sigkill_anywhere(tmp_path):
    command = CLI + ["sft", "--steps", "4", "--batch-size", "2", "--save-every", "1"]
    report = check_sigkill_anywhere(command, "--output-dir", lambda run: safetensors_weights(run / "checkpoint"),
                                    tmp_path, kill_points=kill_points(3))
    print(report)
    assert report["kills"] == kill_points(3)


def test_grpo_survives_sigkill_anywhere(tmp_path):
    command = CLI + ["grpo", "--steps", "2", "--completions-per-step", "4", "--num-generations", "2",
                     "--max-completion-length", "4", "--save-every", "1"]
    report = check_sigkill_anywhere(command, "--output-dir",
                                    lambda run: safetensors_weights(last_complete_checkpoint(run)[0]),
                                    tmp_path, kill_points=kill_points(3))
    print(report)
    assert report["kills"] == kill_points(3)


def test_grade_survives_sigkill_anywhere(tmp_path):
    command = CLI + ["grade", "--method", "ste", "--steps", "3", "--max-new-tokens", "2", "--batch-size", "2",
                     "--gumbel-topk", "16", "--reward", "words", "--save-every", "1"]
    report = check_sigkill_anywhere(command, "--output-dir", lambda run: safetensors_weights(run / "ste" / "checkpoint"),
                                    tmp_path, kill_points=kill_points(3))
    print(report)
    assert report["kills"] == kill_points(3)
