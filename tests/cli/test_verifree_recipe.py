"""`logitless verifree`: its options documented and checked, and a run that learns, stopped after a checkpoint and
resumed, ending bitwise where the uninterrupted run ends."""

import json
import shutil

import pytest

from logitless.cli import main
from test_cli_runs import _assert_resumed_steps_equal

VERIFREE = ["verifree", "--completions-per-step", "4", "--num-generations", "2", "--max-completion-length", "8",
            "--save-every", "1", "--learning-rate", "1e-3", "--temperature", "0.3"]


def test_the_answer_options_are_documented_with_their_defaults_and_checked(capsys):
    with pytest.raises(SystemExit):
        main(["verifree", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--answer-start ANSWER_START where a completion's reasoning ends" in text and "(default: ANSWER:)" in text
    assert "(default: ' {answer}')" in text and "(default: runs/verifree)" in text
    with pytest.raises(SystemExit, match=r"^logitless verifree: --answer-template: expected exactly one field, "
                                         r"\{answer\}, where the reference answer goes, got \[\] in ' \{\{answer\}\}'"):
        main(["verifree", "--answer-template", " {{answer}}"])
    with pytest.raises(SystemExit, match="^logitless verifree: --num-generations: must be >= 2 and divide the 4"):
        main(["verifree", "--completions-per-step", "4", "--num-generations", "3"])


@pytest.mark.slow
def test_a_run_stopped_after_step_2_and_resumed_equals_the_uninterrupted_run(tmp_path, warm_policy, capsys):
    """Three steps on the warm-started policy (sampled at temperature 0.3, it writes "ANSWER:" in most completions), and
    the same run stopped after its step-2 checkpoint (a copy of its directory without checkpoint-3), resumed."""
    policy, questions = warm_policy
    verifree = [*VERIFREE, "--model", str(policy), "--data", str(questions)]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main([*verifree, "--steps", "3", "--output-dir", str(whole)]) == 0
    history = json.loads((whole / "history.json").read_text())
    assert len(history["reward"]) == 3 and max(history["reward"]) > 0 and min(history["no_answer"]) < 1
    assert {"cut", "reasoning_loss", "answer_loss", "entropy"} <= set(history)
    assert (whole / "reward.png").exists() and "VeriFree" in (whole / "README.md").read_text()

    shutil.copytree(whole, split, ignore=shutil.ignore_patterns("checkpoint-3"))
    capsys.readouterr()
    assert main([*verifree, "--steps", "3", "--output-dir", str(split)]) == 0
    assert f"logitless verifree: resuming from step 2 ({split / 'checkpoint-2'})" in capsys.readouterr().out
    _assert_resumed_steps_equal(whole, split, resumed_from=2, steps=(3,))
    assert json.loads((split / "history.json").read_text())["reward"] == history["reward"]
