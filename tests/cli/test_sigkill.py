"""SIGKILL at random moments, during steps and during checkpoint saves: every rerun ends with the weights
of an uninterrupted run (tests/helpers/sigkill.py; LOGITLESS_KILL_POINTS=N runs N kills per trainer)."""

import sys

import pytest
import torch
from safetensors.torch import load_file
from sigkill import check_sigkill_anywhere, kill_points, safetensors_weights

from logitless.checkpoint import last_complete_checkpoint

CLI = [sys.executable, "-m", "logitless"]


def _last_weights(run):
    return safetensors_weights(last_complete_checkpoint(run)[0])


@pytest.mark.slow
def test_sft_survives_sigkill_anywhere(tmp_path):
    command = CLI + ["sft", "--steps", "4", "--batch-size", "2", "--save-every", "1"]
    report = check_sigkill_anywhere(command, "--output-dir", _last_weights, tmp_path, kill_points=kill_points(3))
    print(report)
    assert report["kills"] == kill_points(3) and report["resumed"] >= 1


@pytest.mark.slow
def test_grpo_survives_sigkill_anywhere_on_a_policy_that_learns(tmp_path, warm_policy):
    policy, questions = warm_policy
    command = CLI + ["grpo", "--model", str(policy), "--data", str(questions), "--steps", "3",
                     "--completions-per-step", "4", "--num-generations", "2", "--max-completion-length", "8",
                     "--learning-rate", "1e-3", "--save-every", "1"]
    report = check_sigkill_anywhere(command, "--output-dir", _last_weights, tmp_path, kill_points=kill_points(3))
    print(report)
    assert report["kills"] == kill_points(3) and report["resumed"] >= 1
    start, end = load_file(str(policy / "model.safetensors")), _last_weights(tmp_path / "uninterrupted")
    assert max((end[name] - start[name]).abs().max().item() for name in start) > 1e-4  # the weights moved


@pytest.mark.slow
def test_grade_survives_sigkill_anywhere(tmp_path):
    command = CLI + ["grade", "--method", "ste", "--steps", "3", "--max-new-tokens", "2", "--batch-size", "2",
                     "--gumbel-topk", "16", "--save-every", "1"]
    report = check_sigkill_anywhere(command, "--output-dir", lambda run: _last_weights(run / "ste"),
                                    tmp_path, kill_points=kill_points(3))
    print(report)
    assert report["kills"] == kill_points(3) and report["resumed"] >= 1
    steps = [safetensors_weights(tmp_path / "uninterrupted" / "ste" / f"checkpoint-{step}") for step in (1, 2, 3)]
    for before, after in zip(steps, steps[1:]):  # every step moves the weights, so a resume from the wrong one shows
        assert any(not torch.equal(before[name], after[name]) for name in before)
