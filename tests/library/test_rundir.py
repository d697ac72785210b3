"""Run directories: claimed with a marker, other runs and user files refused, resume options compared."""

import json

import pytest

from logitless.rundir import MARKER, RunDirectory, check_writable_file, file_identity

OPTIONS = {"model": "m", "learning_rate": 0.1, "seed": 0, "steps": 4}


def test_claims_and_refusals(tmp_path):
    run = RunDirectory.claim(tmp_path / "new" / "run", "sft", outputs=("history.json",))
    assert json.loads((run.path / MARKER).read_text())["command"] == "sft" and run.previous is None
    assert RunDirectory.claim(run.path, "sft", outputs=()).previous["command"] == "sft"  # claimed again: its own
    with pytest.raises(ValueError, match="output_dir: .* holds a `logitless sft` run"):
        RunDirectory.claim(run.path, "grpo", outputs=())
    (tmp_path / "empty").mkdir()
    RunDirectory.claim(tmp_path / "empty", "grpo", outputs=())
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="output_dir: .* is a file"):
        RunDirectory.claim(tmp_path / "file", "sft", outputs=())
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / MARKER).write_text("{")
    with pytest.raises(ValueError, match="is unreadable"):
        RunDirectory.claim(tmp_path / "broken", "sft", outputs=())


def test_overwrite_writes_beside_foreign_files_and_never_replaces_one(tmp_path):
    (tmp_path / "notes.txt").write_text("keep")
    (tmp_path / "history.json").write_text("the user's")
    with pytest.raises(ValueError, match="--overwrite"):
        RunDirectory.claim(tmp_path, "sft", outputs=("history.json",))
    with pytest.raises(ValueError, match=r"^output_dir: .* holds history.json, where this run would write"):
        RunDirectory.claim(tmp_path, "sft", outputs=("history.json", "checkpoint-*"), overwrite=True)
    assert (tmp_path / "history.json").read_text() == "the user's" and not (tmp_path / MARKER).exists()
    (tmp_path / "history.json").unlink()
    run = RunDirectory.claim(tmp_path, "sft", outputs=("history.json", "checkpoint-*"), overwrite=True)
    run.start(OPTIONS, resume=False, result_options=("learning_rate",))
    assert (tmp_path / "notes.txt").read_text() == "keep" and (tmp_path / MARKER).is_file()


def test_resume_compares_the_options_that_change_the_result(tmp_path):
    run = RunDirectory.claim(tmp_path, "sft", outputs=())
    rules = dict(result_options=("learning_rate", "seed"), fixed_options=("model",))
    assert run.start(OPTIONS, resume=True, **rules) == {}  # nothing recorded yet: a first start
    assert run.start(dict(OPTIONS, steps=8), resume=True, **rules) == {}  # steps is not a result option
    with pytest.raises(ValueError, match=r"^learning_rate: .*learning_rate 0.1 -> 0.2, seed 0 -> 1.*"
                                         r"--allow-changed learning-rate seed"):
        run.start(dict(OPTIONS, learning_rate=0.2, seed=1), resume=True, **rules)
    with pytest.raises(ValueError, match="^model: .* cannot resume from 'other'"):
        run.start(dict(OPTIONS, model="other"), resume=True, allow_changed=("learning_rate",), **rules)
    with pytest.raises(ValueError, match=r"^allow_changed: \['model'\] are not options a resume may change"):
        run.start(OPTIONS, resume=True, allow_changed=("model",), **rules)
    changes = run.start(dict(OPTIONS, learning_rate=0.2), resume=True, allow_changed=("learning_rate",), step=3,
                        **rules)
    assert changes == {"learning_rate": [0.1, 0.2]}
    record = json.loads((tmp_path / MARKER).read_text())
    assert record["options"]["learning_rate"] == 0.2 and record["changes"][0]["step"] == 3


def test_an_option_the_command_gained_after_a_run_began_is_compared_as_its_default(tmp_path):
    """A run recorded before its command had ``reward`` ran as its default does: resuming at the default changes
    nothing, another value is a change of the result (refused unless allowed)."""
    run = RunDirectory.claim(tmp_path, "grpo", outputs=())
    rules = dict(result_options=("learning_rate", "reward"), defaults={"reward": "judge", "learning_rate": 0.5})
    run.start(OPTIONS, resume=False, result_options=("learning_rate",))  # recorded without reward
    assert "reward" not in json.loads((tmp_path / MARKER).read_text())["options"]
    with pytest.raises(ValueError, match=r"^reward: .*reward 'judge' -> 'other'"):
        run.start(dict(OPTIONS, reward="other"), resume=True, **rules)
    assert run.start(dict(OPTIONS, reward="judge"), resume=True, **rules) == {}


def test_helpers(tmp_path):
    (tmp_path / "d.jsonl").write_text("a")
    assert file_identity(str(tmp_path / "d.jsonl")).endswith("(sha256 ca978112ca1bbdca)")
    assert file_identity(None) is None and file_identity("org/hub-set") == "org/hub-set"
    assert check_writable_file(tmp_path / "new" / "r.json") == tmp_path / "new" / "r.json"
    assert list((tmp_path / "new").iterdir()) == []  # the probe is gone
    with pytest.raises(IsADirectoryError):
        check_writable_file(tmp_path)


def test_a_refused_command_leaves_no_claim_behind(tmp_path):
    """A check that fails after the claim (here the resume options) undoes a claim no run was recorded in: the
    directory it created is gone, one that existed stays as it was, and another command may use either."""
    from logitless.cli import main

    created, existing = tmp_path / "new", tmp_path / "empty"
    existing.mkdir()
    for directory in (created, existing):
        with pytest.raises(SystemExit, match="--allow-changed"):
            main(["sft", "--allow-changed", "bogus", "--output-dir", str(directory)])
    assert not created.exists() and list(existing.iterdir()) == []
    run = RunDirectory.claim(created, "grpo", outputs=())  # free for another command
    run.start({"seed": 0}, resume=False, result_options=["seed"])
    with pytest.raises(ValueError, match="allow_changed"), run.released_on_error():
        run.start({"seed": 0}, resume=True, result_options=["seed"], allow_changed=["bogus"])
    assert json.loads((created / MARKER).read_text())["options"] == {"seed": 0}  # a recorded run keeps its claim


def test_starting_over_removes_only_the_checkpoints_a_run_writes(tmp_path):
    """checkpoint-STEP directories are the run's; a user's checkpoint-best copy or checkpoint-notes.txt is not."""
    from logitless.recipes.sft import OUTPUTS

    run = RunDirectory.claim(tmp_path, "sft", outputs=OUTPUTS)
    run.start({"seed": 0}, resume=False, result_options=["seed"])
    for name in ("checkpoint-3", "checkpoint-best"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-notes.txt").write_text("mine")
    (tmp_path / "history.json").write_text("{}")
    run.start({"seed": 0}, resume=False, result_options=["seed"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-best", "checkpoint-notes.txt", MARKER]


def test_recipe_paths_expand_the_home_directory():
    import os

    from logitless.recipes.sft_options import SFTConfig

    config = SFTConfig(output_dir="~/runs/x", data="~/pairs.jsonl")
    assert (config.output_dir, config.data) == (os.path.expanduser("~/runs/x"), os.path.expanduser("~/pairs.jsonl"))
    with pytest.raises(TypeError, match="output_dir: expected a path, got 5"):
        SFTConfig(output_dir=5)
