"""`logitless demo` as `make demo` runs it: it learns from the reward, measures what the fused head saves, and replaces
only its own outputs."""

import json

import pytest

from logitless.demo import DemoConfig, quarter_means, summary_table
from logitless.rundir import MARKER, RunDirectory


def test_quarter_means():
    assert quarter_means([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == (0.5, 6.5)
    assert quarter_means([2.0]) == (2.0, 2.0)


def _summary_rows(text: str) -> dict[str, list[str]]:
    """The demo's summary tables: a row's first cell (up to its first parenthesis) -> its other cells."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if line.startswith("|") and len(cells) == 3 and not set(cells[1]) <= set("-"):
            rows[cells[0].split(" (")[0]] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`logitless demo` as `make demo` runs it, its defaults, in a directory of its own: (exit status, summary.md,
    the run directory)."""
    from logitless.cli import main

    directory = tmp_path_factory.mktemp("demo") / "runs"
    status = main(["demo", "--output-dir", str(directory)])
    return status, (directory / "summary.md").read_text(), directory


@pytest.mark.slow
def test_the_demo_learns_from_the_reward_and_says_so(demo_run):
    """The warm-up loss falls, the GRPO reward and P(correct | model) rise over the run, held-out accuracy rises, and
    GRADE's reward rises; each phase leaves its plot. The demo's own smaller variants were chaotic (one rounding
    change moved a seed's reward curve from 0.29 -> 0.70 to 0.30 -> 0.40): the test runs what users run."""
    status, summary, directory = demo_run
    assert status == 0
    rows = _summary_rows(summary)

    def start_end(row: str) -> tuple[float, float]:
        return tuple(float(cell.rstrip("%")) / (100 if cell.endswith("%") else 1) for cell in rows[row])

    reward, p_model = start_end("judge reward"), start_end("P(correct \\| model), same steps")
    accuracy, grade = start_end("accuracy on 32 held-out questions"), start_end("GRADE reward, capitalized words")
    assert reward[1] > reward[0] + 0.1 and p_model[1] > p_model[0] + 0.2, summary
    assert accuracy[1] > accuracy[0] + 0.2 and grade[1] > grade[0], summary
    history = json.loads((directory / "grpo" / "history.json").read_text())
    assert len(history["reward"]) == 8
    for reward_value, p_value in zip(history["reward"], history["p_correct_model"]):
        assert 0.0 <= reward_value <= p_value + 1e-6
    for plot in ("sft/loss.png", "grpo/reward.png", "grade/gumbel/reward.png"):
        assert (directory / plot).stat().st_size > 10_000


def test_the_summary_table_reads_the_results():
    config = DemoConfig(grpo_steps=8, completions_per_step=8, eval_questions=8)
    results = {"reward": (0.2, 0.4), "p_correct_model": (0.4, 0.8), "p_correct_judge": (0.5, 0.5),
               "accuracy": (0.5, 0.9), "steps_trained": 8, "completions_scored": 64}
    table = summary_table(config, results, {"trl": 400.0, "logitless": 100.0}, grade_reward=(0.08, 0.21))
    assert "| GRADE reward, capitalized words (mean of the first / last 3 GRADE steps) | 0.080 | 0.210 |" in table
    assert "| judge reward (mean of the first / last 2 GRPO steps) |" in table and "100 MB (0.25x)" in table
    assert "| policy forwards made by the reward to read P(correct \\| model) | 64 (one per completion) |" in table
    assert "| accuracy on 8 held-out questions (4 samples each) | 50% | 90% |" in table


def test_the_demo_replaces_only_its_own_outputs(tmp_path):
    run = RunDirectory.claim(tmp_path, "demo", outputs=("sft", "summary.md"))
    (tmp_path / "sft").mkdir()
    (tmp_path / "summary.md").write_text("old")
    (tmp_path / "mine.txt").write_text("a file the user put there")
    run.start({}, resume=False, result_options=())
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "mine.txt"]
    with pytest.raises(ValueError, match="steps"):
        DemoConfig(steps=0)


def _readme_step_memory_ratio() -> float:
    """The ratio the README's demo table shows for one GRPO step's peak memory ("171 MB (0.27x)")."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return float(re.search(r"\| peak memory of one GRPO step .*\((\d\.\d+)x\) \|", readme).group(1))


@pytest.mark.slow
def test_the_demo_measures_what_the_fused_head_saves_in_a_grpo_step(demo_run):
    """The demo's own measurement (16 completions x 16 tokens of the embedded model, `bench grpo` in fresh
    processes): stock TRL's step holds the (B, T, V) logits and its gradient, GRPOTrainerWithLogits's does not. The
    stock step holds at least the logits it materializes, and the ratio is the README's, within the 0.05 that
    measurements of a shared machine move by."""
    config = DemoConfig()
    cells = _summary_rows(demo_run[1])["peak memory of one GRPO step"]
    trl_mb, logitless_mb = float(cells[0].split()[0]), float(cells[1].split()[0])
    logits_mb = config.memory_completions * config.memory_completion_length * 151936 * 4 / 2**20  # 148 MB
    assert trl_mb > logits_mb and logitless_mb > 0, cells
    assert abs(logitless_mb / trl_mb - _readme_step_memory_ratio()) <= 0.05, cells
