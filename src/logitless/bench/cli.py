"""The ``logitless bench`` subcommands: lmhead, grpo, reward.

`add_parser(subcommands)` adds ``bench`` and returns its own subcommands, so a benchmark module can
register itself there with one line (``mymodule.add_parser(bench_targets)``). Every option is checked,
and every output file proven writable, before a benchmark starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
from pathlib import Path

from logitless._checks import check_generations
from logitless.rundir import check_writable_file

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _require_positive(args: argparse.Namespace, names) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")


def _require_writable(option: str, path: str | None) -> None:
    if path is not None:
        try:
            check_writable_file(path)
        except OSError as err:
            raise SystemExit(f"{option}: cannot write {path}: {err.strerror or err}") from None


def run_lmhead(args: argparse.Namespace) -> int:
    import torch

    from logitless.bench import lmhead

    if args.dtype not in lmhead.DTYPES:
        raise SystemExit(f"--dtype: expected one of {sorted(lmhead.DTYPES)}, got {args.dtype!r}")
    _require_positive(args, ("batch", "seq", "hidden", "vocab", "repeats"))
    unknown = sorted(set(args.impl) - set(lmhead.IMPLEMENTATIONS))
    if unknown:
        raise SystemExit(f"--impl: unknown {unknown}; choose from {list(lmhead.IMPLEMENTATIONS)}")
    if not _DEVICE.match(args.device):
        raise SystemExit(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device: CUDA is not available on this machine")
    _require_writable("--json", args.json)
    _require_writable("--plot", args.plot)
    shape = lmhead.Shape(args.batch, args.seq, args.hidden, args.vocab, args.dtype, args.device)
    report = lmhead.run(shape, args.impl, repeats=args.repeats)
    print(lmhead.format_table(report))
    _write_report(report, args.json)
    if args.plot:
        print(f"wrote {lmhead.plot(report, args.plot)}")
    return 0


def run_trainer_bench(args: argparse.Namespace) -> int:
    """bench grpo / bench reward: their options are the fields of the module's config dataclass."""
    module = importlib.import_module(f"logitless.bench.{args.target}")
    names = tuple(field.name for field in dataclasses.fields(module.CONFIG))
    _require_positive(args, names)
    try:
        check_generations(args.num_generations, args.completions)
    except ValueError as err:
        raise SystemExit(f"--num-generations: {str(err).partition(': ')[2]} (--completions)") from None
    _require_writable("--json", args.json)
    report = module.run(module.CONFIG(**{name: getattr(args, name) for name in names}))
    print(module.format_table(report))
    _write_report(report, args.json)
    return 0


def _write_report(report: dict, json_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}")


def _add_lmhead(targets) -> None:
    lmhead = targets.add_parser("lmhead", help="GRPO loss fwd+bwd through the LM head: time, peak memory, accuracy")
    lmhead.add_argument("--batch", "-B", type=int, default=2, help="sequences (default: %(default)s)")
    lmhead.add_argument("--seq", "-T", type=int, default=512, help="tokens per sequence (default: %(default)s)")
    lmhead.add_argument("--hidden", "-H", type=int, default=512, help="hidden size (default: %(default)s)")
    lmhead.add_argument("--vocab", "-V", type=int, default=151936, help="vocabulary size (default: %(default)s)")
    lmhead.add_argument("--dtype", default="float32", help="float32 | bfloat16 (default: %(default)s)")
    lmhead.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default: %(default)s)")
    lmhead.add_argument("--impl", nargs="+", default=["materialized", "torch_chunked", "liger", "logitless"],
                        help="implementations to compare; materialized always runs: it is the yardstick "
                             "(default: %(default)s)")
    lmhead.add_argument("--repeats", type=int, default=3,
                        help="timed steps per implementation, the median reported (default: %(default)s)")
    lmhead.add_argument("--json", help="write the report here (default: not written)")
    lmhead.add_argument("--plot", help="write a PNG bar chart here (default: not drawn)")
    lmhead.set_defaults(handler=run_lmhead)


def _add_trainer_bench(targets, name: str, description: str, completion_length: int, steps: int) -> argparse.ArgumentParser:
    parser = targets.add_parser(name, help=description)
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
    bench = subcommands.add_parser("bench", help="microbenchmarks against the peers, side by side")
    targets = bench.add_subparsers(dest="target", required=True, metavar="BENCHMARK")
    _add_lmhead(targets)
    grpo = _add_trainer_bench(targets, "grpo", "a few GRPO steps: stock TRL GRPOTrainer vs GRPOTrainerWithLogits",
                              completion_length=128, steps=3)
    grpo.add_argument("--hidden-size", dest="hidden_size", type=int, default=64,
                      help="hidden size of the tiny Qwen2 (default: %(default)s)")
    reward = _add_trainer_bench(targets, "reward",
                                "multiple-choice judge reward: completion_logits vs recomputing them",
                                completion_length=32, steps=2)
    reward.add_argument("--warm-start-steps", dest="warm_start_steps", type=int, default=40,
                        help="warm-up SFT steps that teach the tiny policy to answer 'ANSWER: <ordinal> X' "
                             "(default: %(default)s)")
    return targets
