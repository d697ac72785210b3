"""`logitless demo`'s options (`DemoConfig`). Nothing here loads PyTorch, so ``--help`` and a bad option answer at
once; the demo itself is `logitless.demo`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from logitless._checks import check_nonnegative_int, check_positive_ints
from logitless._lazy import later
from logitless.recipes.options import option_error

OPTIONS = ("output_dir", "steps", "grpo_steps", "grade_steps")  # the fields the command line sets


@dataclass
class DemoConfig:
    output_dir: str = "runs/demo"
    steps: int = 60  # warm-up SFT steps, then a tenth of them at a tenth of the learning rate
    grpo_steps: int = 8
    completions_per_step: int = 32  # 8 questions x 4: fewer, or a larger learning rate, and some warm starts collapse
    num_generations: int = 4
    grpo_learning_rate: float = 1e-3
    eval_questions: int = 32
    memory_completions: int = 16  # the GRPO step whose peak memory is measured: completions x tokens
    memory_completion_length: int = 16  # 0: not measured
    grade_steps: int = 12  # of `logitless grade`'s default run; 0: no GRADE run

    def __post_init__(self):
        check_positive_ints(self, ("steps", "grpo_steps", "completions_per_step", "num_generations",
                                   "eval_questions"))
        check_nonnegative_int("grade_steps", self.grade_steps, "no GRADE run")


def add_parser(subcommands) -> argparse.ArgumentParser:
    defaults = DemoConfig()
    parser = subcommands.add_parser(
        "demo", help="warm-up SFT then GRPO of the embedded tiny Qwen2 (real Qwen vocabulary) on CPU, with a "
                     "summary table",
        description="The embedded tiny Qwen2 (real 151,936-token Qwen vocabulary) learns from a reward on CPU, "
                    "logit-free, in a few minutes: a warm-up SFT teaches it the answer format; GRPO with the "
                    "multiple-choice judge reward then teaches it which option to pick; a short GRADE run "
                    "(logitless grade's default) follows. It ends with a summary table (accuracy before and after "
                    "GRPO, the peak memory of one GRPO step with stock TRL and with GRPOTrainerWithLogits, the "
                    "error of fused and of materialized log-probs), printed and written to "
                    "OUTPUT_DIR/summary.md. Needs nothing downloaded.")
    parser.add_argument("--output-dir", dest="output_dir", default=defaults.output_dir,
                        help="the demo's directory, replaced by the next demo run; a directory the demo did not "
                             "create is refused (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="warm-up SFT steps, followed by a tenth as many at a tenth of the learning rate "
                             "(default: %(default)s)")
    parser.add_argument("--grpo-steps", dest="grpo_steps", type=int, default=defaults.grpo_steps,
                        help="GRPO steps (default: %(default)s)")
    parser.add_argument("--grade-steps", dest="grade_steps", type=int, default=defaults.grade_steps,
                        help="steps of the short GRADE run; 0 leaves it out (default: %(default)s)")
    parser.set_defaults(handler=_checked_then_run)
    return parser


def _checked_then_run(args: argparse.Namespace) -> int:
    try:  # every check before any work, naming the option
        config = DemoConfig(**{name: getattr(args, name) for name in OPTIONS})
    except (TypeError, ValueError) as err:
        raise option_error(err, OPTIONS) from None
    return later("logitless.demo", "run_command")(config)
