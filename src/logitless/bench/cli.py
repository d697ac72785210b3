"""The ``logitless bench`` subcommands: lmhead, grpo, reward, jax, tunix, grade, grade-variance, trl, cli,
distributed, compile, learning.

`add_parser(subcommands)` adds ``bench`` and returns its own subcommands, so a benchmark module can
register itself there with one line (``mymodule.add_parser(bench_targets)``). Every option is checked,
and every output file proven writable, before a benchmark starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib

from logitless import interrupts
from logitless._checks import check_generations
from logitless.bench import cli_startup, distributed, grade, grade_variance, learning, lmhead, trainers
from logitless.bench import compile as bench_compile
from logitless.bench import grpo as bench_grpo
from logitless.bench import jax as bench_jax
from logitless.bench import tunix as bench_tunix
from logitless.bench.options import (add_device_option, add_model_option, benchmark_parser, interrupted,
                                     require_device, require_model, require_positive, require_writable, write_report)


def run_trainer_bench(args: argparse.Namespace) -> int:
    """bench grpo / bench reward: their options are the fields of the module's config dataclass."""
    module = importlib.import_module(f"logitless.bench.{args.target}")
    names = tuple(field.name for field in dataclasses.fields(module.CONFIG))
    require_positive(args, [name for name in names if isinstance(getattr(args, name), int)])
    require_device(args)
    if hasattr(args, "model"):
        require_model(args)
    try:
        check_generations(args.num_generations, args.completions)
    except ValueError as err:
        raise SystemExit(f"--num-generations: {str(err).partition(': ')[2]} (--completions)") from None
    require_writable(args)
    report = module.run(module.CONFIG(**{name: getattr(args, name) for name in names}))
    return write_report(report, args, module.format_table)


def _add_trainer_bench(targets, name: str, summary: str, description: str, completion_length: int,
                       steps: int) -> argparse.ArgumentParser:
    parser = benchmark_parser(targets, name, summary, description)
    parser.add_argument("--completions", type=int, default=16, help="completions per step (default: %(default)s)")
    parser.add_argument("--completion-length", dest="completion_length", type=int, default=completion_length,
                        help="tokens per completion at most (default: %(default)s)")
    parser.add_argument("--num-generations", dest="num_generations", type=int, default=4,
                        help="completions per prompt, at least 2, dividing --completions (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=steps, help="GRPO steps (default: %(default)s)")
    parser.add_argument("--json", help="write the report here (default: not written)")
    parser.set_defaults(handler=run_trainer_bench)
    return parser


def add_parser(subcommands):
    """``bench`` and its benchmarks; returns the subcommands object of ``bench`` for more benchmarks."""
    bench = subcommands.add_parser(
        "bench", help="microbenchmarks against the peers, side by side",
        description="Microbenchmarks of logitless against the materialized path and its peers (PyTorch, Liger, "
                    "TRL, plain JAX), run side by side on the same inputs, each implementation in a fresh "
                    "process where memory is measured. Every option is checked, and every output file proven "
                    "writable, before a benchmark starts. 'logitless bench BENCHMARK --help' lists a "
                    "benchmark's options.")
    targets = bench.add_subparsers(dest="target", required=True, metavar="BENCHMARK")
    lmhead.add_parser(targets)
    grpo = _add_trainer_bench(
        targets, "grpo", "a few GRPO steps: stock TRL GRPOTrainer vs GRPOTrainerWithLogits",
        "A few GRPO training steps of stock TRL GRPOTrainer and of GRPOTrainerWithLogits on the embedded tiny "
        "Qwen2 (real 151,936-token vocabulary), from the same weights on the same prompts, each in a fresh "
        "process: wall time, the time in the loss and its backward, peak memory, and the logged losses.",
        completion_length=128, steps=3)
    add_model_option(grpo)
    add_device_option(grpo, indexed=False)
    grpo.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="float32, or bfloat16: TRL's bf16 mixed precision (default: %(default)s)")
    grpo.add_argument("--setups", nargs="+", choices=tuple(bench_grpo.SETUPS), default=tuple(bench_grpo.SETUPS),
                      help="which setups to run: default (GRPOConfig's defaults), lora (LoRA r=8), cispo (loss_type "
                           "cispo with beta 0.04) (default: all)")
    reward = _add_trainer_bench(
        targets, "reward", "multiple-choice judge reward: completion_logits vs recomputing them",
        "The same GRPO steps with GRPOTrainerWithLogits and the multiple-choice judge reward, on a warm-started "
        "tiny Qwen2, each in a fresh process: the reward reading P(correct | model) from the completion_logits "
        "the trainer hands it, against recomputing it with one more policy forward per completion. Reports the "
        "time, policy forwards and peak memory inside the reward function, and the mean rewards.",
        completion_length=32, steps=2)
    reward.add_argument("--warm-start-steps", dest="warm_start_steps", type=int, default=40,
                        help="warm-up SFT steps that teach the tiny policy to answer 'ANSWER: <ordinal> X' "
                             "(default: %(default)s)")
    bench_jax.add_parser(targets)
    bench_tunix.add_parser(targets)
    grade.add_parser(targets)
    grade_variance.add_parser(targets)
    trainers.add_parser(targets)
    cli_startup.add_parser(targets)
    distributed.add_parser(targets)
    bench_compile.add_parser(targets)
    learning.add_parser(targets)
    for parser in targets.choices.values():
        parser.set_defaults(handler=_telling_interrupts(parser.get_default("handler")))
    return targets


def _telling_interrupts(handler):
    """``handler``, after which an interrupt says which rows finished (and writes them to ``--json``)."""

    def measure(args: argparse.Namespace) -> int:
        interrupts.stage("while measuring", lambda: interrupted(args))
        return handler(args)

    return measure
