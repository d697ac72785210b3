import json

import pytest

from logitless.cli import main


@pytest.fixture
def commands_in_process(monkeypatch):
    """bench learning's commands (the warm start, each method) run in this process, one after another, instead of a
    fresh process each: the same runs without three imports of TRL."""
    import time

    from logitless.bench import learning
    from logitless.cli import build_parser

    def in_process(arguments):  # the command's handler: `main` is the bench's own, running already
        started = time.perf_counter()
        args = build_parser().parse_args(arguments)
        assert args.handler(args) == 0
        return time.perf_counter() - started

    monkeypatch.setattr(learning, "logitless_command", in_process)


@pytest.mark.slow
def test_bench_learning_trains_every_method_at_the_same_settings_and_measures_held_out_accuracy(
        tmp_path, capsys, commands_in_process):
    out_json, out_png = tmp_path / "learning.json", tmp_path / "learning.png"
    assert main(["bench", "learning", "--warm-start-steps", "2", "--steps", "1", "--train-questions", "4",
                 "--eval-questions", "3", "--eval-samples", "2", "--completions-per-step", "4", "--num-generations",
                 "2", "--max-completion-length", "6", "--seed", "3", "--json", str(out_json),
                 "--plot", str(out_png)]) == 0
    report = json.loads(out_json.read_text())
    assert set(report) == {"config", "warm_start_loss", "held_out", "results"}
    assert report["held_out"] == {"questions": 3, "samples": 2, "temperature": 1.0}
    assert list(report["results"]) == ["judge", "rlpr", "verifree"]
    expected = {"steps": 1, "completions_per_step": 4, "num_generations": 2, "max_completion_length": 6,
                "learning_rate": 1e-3, "temperature": 1.0, "seed": 3}
    for name, result in report["results"].items():
        assert result["options"] == expected, name  # what each run recorded in its logitless-run.json
        assert len(result["reward"]) == 1 and len(result["logged"]["loss"]) == 1, name  # every step ran, logged
        assert "--seed 3" in result["command"] and "--steps 1" in result["command"], name
        for accuracy in ("accuracy_before", "accuracy_after"):
            assert 0.0 <= result[accuracy] <= 1.0, (name, accuracy)
    assert len({result["accuracy_before"] for result in report["results"].values()}) == 1  # one warm start
    assert report["results"]["judge"]["command"].startswith("logitless grpo --reward judge --model sft/")
    assert report["results"]["verifree"]["command"].startswith("logitless verifree --model sft/")
    assert out_png.stat().st_size > 5000
    assert "verifree" in capsys.readouterr().out


@pytest.mark.parametrize("arguments, error", [
    (["--methods", "rlpr", "rlpr"], "--methods: each method at most once"),
    (["--num-generations", "3"], "--num-generations: must be >= 2 and divide the 32"),
    (["--train-questions", "1"], "--train-questions: a step needs 8 questions"),
    (["--temperature", "0"], "--temperature: must be a finite number > 0"),
    (["--steps", "0"], "--steps: must be >= 1"),
])
def test_bench_learning_refuses_bad_options_before_training(arguments, error, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "learning", *arguments])
    assert str(exit_info.value).startswith(f"logitless bench learning: {error}")
