"""The ``logitless`` command: demo | sft | bench lmhead | bench grpo | bench reward."""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path

import yaml


class _ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; a learning rate written that way must be a float."""


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)?\.?[0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _load_config(path: str | None) -> dict:
    if path is None:
        return {}
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"--config: no such file {path!r}")
    try:
        values = yaml.load(file.read_text(), Loader=_ConfigLoader) or {}
    except yaml.YAMLError as err:
        raise SystemExit(f"--config: {path} is not valid YAML: {err}") from None
    if not isinstance(values, dict):
        raise SystemExit(f"--config: {path} must hold a mapping of option: value")
    return values


def _sft_overrides(args: argparse.Namespace) -> dict:
    names = ("model", "data", "output_dir", "steps", "batch_size", "gradient_accumulation_steps", "learning_rate",
             "save_every", "seed")
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.no_resume:
        overrides["resume"] = False
    return overrides


def run_sft(args: argparse.Namespace) -> int:
    from logitless.recipes.sft import SFTConfig, train_sft

    try:
        config = SFTConfig.from_dict({**_load_config(args.config), **_sft_overrides(args)})
    except (TypeError, ValueError) as err:
        raise SystemExit(f"logitless sft: {err}") from None
    history = train_sft(config)
    print(f"loss {history['loss'][0]:.3f} -> {history['loss'][-1]:.3f} over {history['step']} steps "
          f"({history['seconds']:.1f}s); plot: {Path(config.output_dir) / 'loss.png'}; "
          f"checkpoint: {Path(config.output_dir) / 'checkpoint'}")
    return 0


def run_grpo(args: argparse.Namespace) -> int:
    from logitless.recipes.grpo import MultichoiceGRPOConfig, train_grpo_multichoice

    names = ("model", "judge", "data", "output_dir", "steps", "completions_per_step", "num_generations",
             "max_completion_length", "learning_rate", "loss_type", "temperature", "save_every", "seed")
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    try:
        config = MultichoiceGRPOConfig.from_dict({**_load_config(args.config), **overrides})
    except (TypeError, ValueError) as err:
        raise SystemExit(f"logitless grpo: {err}") from None
    history = train_grpo_multichoice(config)
    print(f"reward {history['reward'][0]:.4f} -> {history['reward'][-1]:.4f} over {len(history['reward'])} steps; "
          f"plot: {Path(config.output_dir) / 'reward.png'}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from logitless.recipes.demo import check_run_args, run

    try:  # before any work, with the option's name
        check_run_args(args.output_dir, args.steps, args.grpo_steps)
    except ValueError as err:
        name, _, message = str(err).partition(": ")
        raise SystemExit(f"--{name.replace('_', '-')}: {message}") from None
    return run(output_dir=args.output_dir, steps=args.steps, grpo_steps=args.grpo_steps)


def run_bench_lmhead(args: argparse.Namespace) -> int:
    from logitless.bench import lmhead

    if args.dtype not in lmhead.DTYPES:
        raise SystemExit(f"--dtype: expected one of {sorted(lmhead.DTYPES)}, got {args.dtype!r}")
    _require_positive(args, ("batch", "seq", "hidden", "vocab", "repeats"))
    unknown = sorted(set(args.impl) - set(lmhead.IMPLEMENTATIONS))
    if unknown:
        raise SystemExit(f"--impl: unknown {unknown}; choose from {list(lmhead.IMPLEMENTATIONS)}")
    if args.device.startswith("cuda") and not __import__("torch").cuda.is_available():
        raise SystemExit("--device: CUDA is not available on this machine")
    shape = lmhead.Shape(args.batch, args.seq, args.hidden, args.vocab, args.dtype, args.device)
    report = lmhead.run(shape, args.impl, repeats=args.repeats)
    print(lmhead.format_table(report))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    _write_report(report, args.json, (lambda: lmhead.plot(report, args.plot)) if args.plot else None)
    return 0


def _require_positive(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")


def _require_groups(args: argparse.Namespace) -> None:
    if args.completions % args.num_generations:
        raise SystemExit(f"--num-generations: {args.num_generations} does not divide --completions {args.completions}")


def run_bench_trainer(args: argparse.Namespace) -> int:
    """bench grpo / bench reward: their options are the fields of the module's config dataclass."""
    import dataclasses
    import importlib

    module = importlib.import_module(f"logitless.bench.{args.target}")
    config_class = module.CONFIG
    names = tuple(field.name for field in dataclasses.fields(config_class))
    _require_positive(args, names)
    _require_groups(args)
    report = module.run(config_class(**{name: getattr(args, name) for name in names}))
    print(module.format_table(report))
    _write_report(report, args.json, None)
    return 0


def _write_report(report: dict, json_path: str | None, plot) -> None:
    import json

    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}")
    if plot is not None:
        print(f"wrote {plot()}")


def _add_sft_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of SFTConfig fields (command-line options win)")
    parser.add_argument("--model", help="hub id, local model directory, or 'tiny-qwen2' (default)")
    parser.add_argument("--data", help="jsonl with 'prompt' and 'response' per line (default: built-in arithmetic)")
    parser.add_argument("--output-dir", dest="output_dir")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch-size", dest="batch_size", type=int)
    parser.add_argument("--gradient-accumulation-steps", dest="gradient_accumulation_steps", type=int)
    parser.add_argument("--learning-rate", dest="learning_rate", type=float)
    parser.add_argument("--save-every", dest="save_every", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--no-resume", action="store_true", help="start over even if output_dir has a checkpoint")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logitless", description="LLM post-training without [B, T, V] logits")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="SFT then GRPO of the embedded tiny Qwen2 (real Qwen vocabulary) on CPU")
    demo.add_argument("--output-dir", dest="output_dir", default="runs/demo",
                      help="replaced on each run; a directory the demo did not create is refused (default runs/demo)")
    demo.add_argument("--steps", type=int, default=40, help="SFT steps (default 40)")
    demo.add_argument("--grpo-steps", dest="grpo_steps", type=int, default=4, help="GRPO steps (default 4)")
    demo.set_defaults(handler=run_demo)
    sft = commands.add_parser("sft", help="supervised fine-tuning, resumable from output_dir/checkpoint")
    _add_sft_options(sft)
    sft.set_defaults(handler=run_sft)
    grpo = commands.add_parser("grpo", help="GRPO on multiple-choice questions with the judge reward, logit-free")
    grpo.add_argument("--config", help="YAML file of MultichoiceGRPOConfig fields (command-line options win)")
    grpo.add_argument("--model", help="hub id, local model directory, or 'tiny-qwen2'")
    grpo.add_argument("--judge", help="judge model (default: a frozen copy of the initial policy)")
    grpo.add_argument("--data", help="jsonl or dataset with question, choices, answer (default: synthetic)")
    grpo.add_argument("--output-dir", dest="output_dir")
    grpo.add_argument("--steps", type=int)
    grpo.add_argument("--completions-per-step", dest="completions_per_step", type=int)
    grpo.add_argument("--num-generations", dest="num_generations", type=int)
    grpo.add_argument("--max-completion-length", dest="max_completion_length", type=int)
    grpo.add_argument("--learning-rate", dest="learning_rate", type=float)
    grpo.add_argument("--loss-type", dest="loss_type")
    grpo.add_argument("--temperature", type=float)
    grpo.add_argument("--save-every", dest="save_every", type=int)
    grpo.add_argument("--seed", type=int)
    grpo.set_defaults(handler=run_grpo)
    bench = commands.add_parser("bench", help="microbenchmarks against the peers, side by side")
    targets = bench.add_subparsers(dest="target", required=True)
    lmhead = targets.add_parser("lmhead", help="GRPO loss fwd+bwd through the LM head: time, peak memory, accuracy")
    lmhead.add_argument("--batch", "-B", type=int, default=2)
    lmhead.add_argument("--seq", "-T", type=int, default=512)
    lmhead.add_argument("--hidden", "-H", type=int, default=512)
    lmhead.add_argument("--vocab", "-V", type=int, default=151936)
    lmhead.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    lmhead.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    lmhead.add_argument("--impl", nargs="+", default=["materialized", "torch_chunked", "liger", "logitless"],
                        help="implementations to compare (materialized always runs: it is the yardstick)")
    lmhead.add_argument("--repeats", type=int, default=3, help="timed steps per implementation (median reported)")
    lmhead.add_argument("--json", help="write the report here")
    lmhead.add_argument("--plot", help="write a PNG bar chart here")
    lmhead.set_defaults(handler=run_bench_lmhead)
    bench_grpo = targets.add_parser("grpo", help="a few GRPO steps: stock TRL GRPOTrainer vs GRPOTrainerWithLogits")
    bench_grpo.add_argument("--completions", type=int, default=16, help="completions per step")
    bench_grpo.add_argument("--completion-length", dest="completion_length", type=int, default=128)
    bench_grpo.add_argument("--num-generations", dest="num_generations", type=int, default=4)
    bench_grpo.add_argument("--steps", type=int, default=3)
    bench_grpo.add_argument("--hidden-size", dest="hidden_size", type=int, default=64, help="of the tiny Qwen2")
    bench_grpo.add_argument("--json", help="write the report here")
    bench_grpo.set_defaults(handler=run_bench_trainer)
    bench_reward = targets.add_parser("reward", help="multiple-choice judge reward: completion_logits vs recomputing")
    bench_reward.add_argument("--completions", type=int, default=16, help="completions per step")
    bench_reward.add_argument("--completion-length", dest="completion_length", type=int, default=32)
    bench_reward.add_argument("--num-generations", dest="num_generations", type=int, default=4)
    bench_reward.add_argument("--steps", type=int, default=2)
    bench_reward.add_argument("--warm-start-steps", dest="warm_start_steps", type=int, default=40,
                              help="SFT steps that teach the tiny policy to answer 'ANSWER: X'")
    bench_reward.add_argument("--json", help="write the report here")
    bench_reward.set_defaults(handler=run_bench_trainer)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # TRL 1.16 reads model.is_gradient_checkpointing at every generation, which transformers 5 deprecates:
    # a warning per step that the user can do nothing about
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
