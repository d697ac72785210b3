"""`logitless bench grade-variance`: how noisy and how biased each gradient estimator is, at fixed weights.

The policy (embedded tiny Qwen2, real vocabulary) and the reward (the capitalized-word fraction) stay
fixed; no optimizer step is taken. For GRADE (Gumbel-softmax), GRADE-STE and GRPO, ``minibatches``
independent minibatches (fresh noise / samples, the same prompts) of ``batch_size`` rollouts each give
flattened gradients g_1..g_M of the reward objective (kl_coef = 0, so only the reward's gradient is
estimated). Reported per method:

* ``relative_variance``: sum of the per-coordinate variances across minibatches / |mean g|^2, i.e.
  E|g_i - mean g|^2 / |mean g|^2 (below 1: one minibatch already points where the mean does);
* ``cosine_to_reference`` (mean, std over minibatches) and ``mean_cosine_to_reference`` (of mean g):
  agreement with the true gradient of E[reward]. With ``max_new_tokens`` 1 it is exact: the reward is
  linear in the soft token, so E_{v ~ p}[r(v)] = r(p) and autograd through the policy's softmax p gives
  the true gradient (``reference: "exact"``). With longer completions it is a many-sample estimate, the
  REINFORCE gradient (unbiased, group-mean baseline) over ``reference_samples`` sampled completions, and
  ``reference_half_cosine`` (the cosine between the estimates of the two halves of those samples) says
  how much of it is noise.

GRADE's gradient is biased (the relaxation is not the sampled sequence), GRPO's is not: the cosine of
the method's mean gradient to the reference separates bias from noise. Every number is given for all
parameters and for the body alone (without the embedding / LM head matrix, whose sampled gradients
touch only the rows of the tokens a minibatch saw).
"""

from __future__ import annotations

from dataclasses import asdict

from logitless.bench.grade_variance_config import PROMPTS, GradeVarianceConfig
from logitless.bench.options import benchmark_parser, require_writable, write_report

def format_table(report: dict) -> str:
    c = report["config"]
    halves = report["reference_half_cosine"]
    lines = [f"gradient estimators at fixed weights: {c['minibatches']} minibatches of {c['batch_size']} rollouts x "
             f"{c['max_new_tokens']} tokens, tau {c['tau']}, top-k {c['gumbel_topk']}; reference gradient: "
             f"{report['reference']}" + ("" if halves is None else f" (its two halves agree to cosine {halves:.3f})"),
             f"{'method':<8}{'rel. variance':>15}{'cos(g_i, ref)':>16}{'cos(mean g, ref)':>18}"]
    for part in ("all parameters", "body only (no embedding / LM head)"):
        lines.append(f"  {part}")
        for name, r in report["results"].items():
            r = r if part.startswith("all") else r["body"]
            lines.append(f"{name:<8}{r['relative_variance']:>15.3f}{r['cosine_to_reference']:>9.3f} ± "
                         f"{r['cosine_to_reference_std']:<5.3f}{r['mean_cosine_to_reference']:>17.3f}")
    return "\n".join(lines)


def add_parser(targets) -> None:
    defaults = GradeVarianceConfig()
    parser = benchmark_parser(
        targets, "grade-variance",
        "variance and bias of the GRADE, GRADE-STE and GRPO gradient estimators at fixed weights",
        "At the embedded tiny Qwen2's initial weights, each method's gradient of -reward (the "
        "capitalized-word fraction, kl_coef 0) on independent minibatches: their relative variance "
        "and their cosines, one by one and averaged, with the true gradient (exact for one-token "
        "completions, otherwise a REINFORCE estimate over --reference-samples).")
    meaning = {"minibatches": "independent minibatches per method", "batch_size": "rollouts per minibatch",
               "max_new_tokens": "tokens per rollout (1: the reference gradient is exact)",
               "gumbel_topk": "tokens kept per step by GRADE", "tau": "Gumbel-softmax temperature",
               "reference_samples": "samples of the REINFORCE reference when max_new_tokens > 1"}
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(value), default=value,
                            help=f"{meaning[name]} (default: %(default)s)")
    parser.add_argument("--json", help="write the report here (default: not written)")
    parser.set_defaults(handler=_main)


def _main(args) -> int:
    for name in asdict(GradeVarianceConfig()):
        value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        if name == "minibatches" and value < 2:
            raise SystemExit(f"{flag}: must be >= 2 (a variance needs two minibatches), got {value}")
        if not value > 0:
            raise SystemExit(f"{flag}: must be > 0, got {value}")
    config = GradeVarianceConfig(**{name: getattr(args, name) for name in asdict(GradeVarianceConfig())})
    if config.reference_samples < 2 * len(PROMPTS) or config.batch_size % len(PROMPTS) or config.batch_size < 8:
        raise SystemExit(f"--batch-size / --reference-samples: need multiples of the {len(PROMPTS)} prompts "
                         f"(batch >= 8 so that GRPO's groups have 2 completions, reference >= {2 * len(PROMPTS)})")
    require_writable(args, ("json",))
    from logitless.bench.grade_variance_gradients import estimator_report

    report = estimator_report(config)
    return write_report(report, args, format_table)
