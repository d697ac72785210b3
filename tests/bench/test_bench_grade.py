"""`logitless bench grade` and `bench grade-variance` at tiny sizes: the report's shape, and the two trainers
agreeing across processes when every token is kept."""

import math
from dataclasses import asdict

import pytest

from logitless.bench.grade import VARIANTS, GradeBenchConfig, format_table, run_worker
from logitless.bench.grade_variance_config import GradeVarianceConfig
from logitless.bench.grade_variance_gradients import estimator_report as run_variance
from logitless.bench.ratios import add_ratios
from logitless.cli import main


@pytest.mark.slow
def test_bench_grade_workers_report_what_the_table_prints():
    """The two workers in this process (each runs in a fresh one under `logitless bench grade`)."""
    config = GradeBenchConfig(steps=1, batch_size=2, max_new_tokens=2, gumbel_topk=8)
    results = {variant: run_worker(variant, "", config) for variant in VARIANTS}
    for result in results.values():
        assert {"peak_mb", "step_s", "reward", "kl"} <= result.keys() and result["step_s"] > 0
        assert 0 <= result["reward"] <= 1 and result["kl"] >= 0
    assert results["legacy"]["topk_tail_mass"] == 0.0 < results["efficient"]["topk_tail_mass"]
    add_ratios(results, "legacy", time_key="step_s")
    table = format_table({"config": asdict(config), "results": results})
    assert "efficient" in table and "x legacy" in table


@pytest.mark.parametrize("argv, match", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--method", "reinforce"], "--method"),
    (["--gumbel-topk", "999999"], r"--gumbel-topk: expected an int in \[1, 151936\]"),
])
def test_bench_grade_bad_options(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", "grade", *argv])


@pytest.mark.parametrize("argv, match", [(["--minibatches", "1"], "--minibatches: must be >= 2 .*, got 1"),
                                         (["--tau", "0"], "--tau: must be > 0, got 0.0")])
def test_bench_grade_variance_bad_options(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", "grade-variance", *argv])


@pytest.mark.slow
def test_bench_grade_variance_report():
    report = run_variance(GradeVarianceConfig(minibatches=2, batch_size=8, max_new_tokens=2, gumbel_topk=8,
                                              reference_samples=8), progress=False)
    assert set(report["results"]) == {"gumbel", "ste", "grpo"}
    assert report["reference"] == "REINFORCE over 8 samples" and -1 <= report["reference_half_cosine"] <= 1
    for result in [*report["results"].values(), *(r["body"] for r in report["results"].values())]:
        assert result["relative_variance"] >= 0 and result["minibatches"] == 2
        for name in ("cosine_to_reference", "mean_cosine_to_reference"):
            assert math.isfinite(result[name]) and -1 <= result[name] <= 1
