"""`logitless bench grade` and `bench grade-variance` at tiny sizes: the report's shape, and the two trainers
agreeing across processes when every token is kept."""

import math
from dataclasses import asdict

import pytest
import torch

from logitless.bench.grade import VARIANTS, GradeBenchConfig, format_table, run_worker
from logitless.bench.grade_variance import GradeVarianceConfig
from logitless.bench.grade_variance_gradients import estimator_report as run_variance
from logitless.bench.ratios import add_ratios
from logitless.cli import main


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


def test_bench_grade_variance_report():
    report = run_variance(GradeVarianceConfig(minibatches=2, batch_size=8, max_new_tokens=2, gumbel_topk=8,
                                              reference_samples=8), progress=False)
    assert set(report["results"]) == {"gumbel", "ste", "grpo"}
    assert report["reference"] == "REINFORCE over 8 samples" and -1 <= report["reference_half_cosine"] <= 1
    for result in [*report["results"].values(), *(r["body"] for r in report["results"].values())]:
        assert result["relative_variance"] >= 0 and result["minibatches"] == 2
        for name in ("cosine_to_reference", "mean_cosine_to_reference"):
            assert math.isfinite(result[name]) and -1 <= result[name] <= 1


def test_exact_reference_gradient_for_one_token_completions():
    """For T = 1 and a linear reward, the reference is autograd through the softmax: check it on a tiny policy."""
    from logitless.bench.grade_variance_gradients import _exact_reference_gradient
    from logitless.grade import TokenSetReward
    from logitless.grade.soft_tokens import PromptBatch, as_records

    from grade_helpers import ByteTokenizer, byte_model

    policy = byte_model(seed=3)
    prompts = PromptBatch.from_records(as_records(["ab", "xyz"]), ByteTokenizer())
    got = _exact_reference_gradient(policy, TokenSetReward([97, 98]), prompts)
    # E[r] = mean over prompts of p(a) + p(b), straight from the model's logits
    logits = policy(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
                    position_ids=(prompts.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    (-torch.softmax(logits, -1)[:, [97, 98]].sum(-1).mean()).backward()
    expected = torch.cat([p.grad.flatten() for p in policy.parameters()])
    torch.testing.assert_close(got, expected)


def test_grade_gradient_converges_to_the_exact_gradient_faster_than_grpo():
    """One-token completions on a 263-token vocabulary, where the exact gradient of E[reward] is known: the
    mean of GRADE's minibatch gradients approaches it (up to the relaxation's bias), and faster than GRPO's."""
    from logitless.bench.grade_variance_gradients import _exact_reference_gradient, _flat_gradient
    from logitless.grade import GradeConfig, GRPOBaseline, GumbelTrainerMemoryEfficient, TokenSetReward
    from logitless.grade.soft_tokens import PromptBatch, as_records
    from logitless.grade.trainer import microbatch_generator

    from grade_helpers import ByteTokenizer, byte_model

    policy, tokenizer, reward = byte_model(seed=0), ByteTokenizer(), TokenSetReward(list(range(97, 123)))
    texts = ["ab", "xy", "hello", "Q:"]
    exact = _exact_reference_gradient(policy, reward, PromptBatch.from_records(as_records(texts), tokenizer))
    minibatch = PromptBatch.from_records(as_records(texts * 2), tokenizer)
    cosines = {}
    for name, trainer_class in (("gumbel", GumbelTrainerMemoryEfficient), ("grpo", GRPOBaseline)):
        config = GradeConfig(gumbel_topk=16, max_new_tokens=1, batch_size=8, kl_coef=0.0, tau_start=0.7, tau_end=0.7,
                             grpo_group_size=2)
        trainer = trainer_class(policy, reward, config, tokenizer=tokenizer)
        total = 0
        for index in range(50):
            trainer.microbatch(minibatch, None, microbatch_generator(1, 0, index, "cpu"))
            total = total + _flat_gradient(trainer.parameters)
        cosines[name] = float(torch.nn.functional.cosine_similarity(total, exact, dim=0))
    assert cosines["gumbel"] > 0.7 and cosines["gumbel"] > cosines["grpo"] > 0, cosines
