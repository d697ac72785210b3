"""`logitless bench grade`: the legacy GumbelTrainer against GumbelTrainerMemoryEfficient.

Both train the same policy (an embedded model: the tiny Qwen2 by default, or random weights at
Qwen2.5-0.5B's shapes; the real 151,936-token vocabulary; or a local model directory) on the same
prompts, reward (the capitalized-word fraction), seed, config and steps, each in a fresh process. One
warm-up step (it creates the optimizer's state, equal for both) is not measured; then ``steps``
optimizer steps are, and each worker reports the peak memory growth over them (CPU: peak RSS of the
process; CUDA: allocated memory), the median step time, and the mean reward and KL of the measured
steps.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from logitless.bench.options import (add_device_option, add_model_option, benchmark_parser, choices_metavar,
                                     require_device, require_model, require_positive, require_writable, write_report)
from logitless.bench.ratios import add_ratios, format_ratio
from logitless.bench.worker import run_variants, worker_main
from logitless.models import EMBEDDED_DEFAULT

VARIANTS = ("legacy", "efficient")
METHODS = ("gumbel", "ste")  # ste: GradeConfig(straight_through=True)
PROMPTS = ["Once upon a time", "The weather today is", "My favourite food is", "Yesterday I went to",
           "The best way to learn is", "In the morning", "A good friend", "The city at night"]


@dataclass
class GradeBenchConfig:
    steps: int = 2  # measured optimizer steps (after one warm-up step)
    batch_size: int = 8
    max_new_tokens: int = 64
    gumbel_topk: int = 256
    method: str = "gumbel"  # gumbel | ste
    activation_checkpointing: bool = True  # the efficient trainer's per-step recomputation
    model: str = EMBEDDED_DEFAULT  # an embedded model (`models.EMBEDDED_MODELS`) or a local directory
    device: str = "cpu"  # cpu or cuda[:N]


def _trainer(variant: str, config: GradeBenchConfig):
    from logitless.grade import GradeConfig, GumbelTrainer, GumbelTrainerMemoryEfficient, TokenSetReward
    from logitless.models import load_model_and_tokenizer

    policy, tokenizer = load_model_and_tokenizer(config.model, seed=0)
    policy.to(config.device)
    grade = GradeConfig(straight_through=config.method == "ste", gumbel_topk=config.gumbel_topk,
                        max_new_tokens=config.max_new_tokens, batch_size=config.batch_size, learning_rate=1e-2,
                        kl_coef=0.02, activation_checkpointing=config.activation_checkpointing)
    trainer_class = GumbelTrainer if variant == "legacy" else GumbelTrainerMemoryEfficient
    return trainer_class(policy, TokenSetReward.capitalized_words(tokenizer), grade, tokenizer=tokenizer)


def run_worker(variant: str, _directory: str, config: GradeBenchConfig) -> dict:
    import torch

    from logitless.memory import PeakMemory, synchronize

    trainer = _trainer(variant, config)
    prompts = [PROMPTS[(i + step) % len(PROMPTS)] for step in range(config.steps + 1)
               for i in range(config.batch_size)]
    device = torch.device(config.device)
    trainer.train_step(prompts[:config.batch_size])  # warm-up: optimizer state, lazy allocations
    rows = []
    with PeakMemory(device) as peak:
        for step in range(1, config.steps + 1):
            started = time.perf_counter()
            row = trainer.train_step(prompts[step * config.batch_size: (step + 1) * config.batch_size])
            synchronize(device)
            rows.append({**row, "step_s": time.perf_counter() - started})
    return {"peak_mb": peak.megabytes, "step_s": statistics.median(r["step_s"] for r in rows),
            "reward": statistics.mean(r["reward"] for r in rows), "kl": statistics.mean(r["kl"] for r in rows),
            "topk_tail_mass": statistics.mean(r["topk_tail_mass"] for r in rows)}


def run(config: GradeBenchConfig, progress: bool = True) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        results = run_variants("logitless.bench.grade", VARIANTS, ["--scratch", scratch, "--config",
                                                                   json.dumps(asdict(config))], "bench grade", progress)
    add_ratios(results, "legacy", time_key="step_s")
    return {"config": asdict(config), "results": results}


def format_table(report: dict) -> str:
    c = report["config"]

    def row(name: str, r: dict) -> str:
        return (f"{name:<10}{r['step_s']:>9.2f}{format_ratio(r['time_ratio'], 10)}{r['peak_mb']:>10.0f}"
                f"{format_ratio(r['peak_ratio'], 10)}{r['reward']:>9.4f}{r['kl']:>9.4f}")

    return "\n".join([
        f"GRADE ({c['method']}), {c['steps']} steps of {c['batch_size']} rollouts x "
        f"{c['max_new_tokens']} tokens, top-k "
        f"{c['gumbel_topk']}, activation checkpointing {'on' if c['activation_checkpointing'] else 'off'}, "
        f"{c['model']}, {c['device']}",
        f"{'trainer':<10}{'step s':>9}{'x legacy':>10}{'peak MB':>10}{'x legacy':>10}{'reward':>9}{'kl':>9}",
        *(row(name, r) for name, r in report["results"].items())])


def add_parser(targets) -> None:
    """Register ``logitless bench grade``."""
    defaults = GradeBenchConfig()
    parser = benchmark_parser(
        targets, "grade",
        "GRADE: legacy GumbelTrainer vs GumbelTrainerMemoryEfficient, peak memory and step time in "
        "fresh processes",
        "GRADE training steps of the legacy GumbelTrainer and of GumbelTrainerMemoryEfficient on the "
        "same model (--model): the same prompts, reward (the "
        "capitalized-word fraction), seed and config, each in a fresh process. After one unmeasured "
        "warm-up step, reports the peak memory growth, the median step time and the mean reward and "
        "KL of the measured steps.")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="measured optimizer steps, after one warm-up step (default: %(default)s)")
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=defaults.batch_size,
                        help="rollouts per step (default: %(default)s)")
    parser.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=defaults.max_new_tokens,
                        help="tokens per rollout (default: %(default)s)")
    parser.add_argument("--gumbel-topk", dest="gumbel_topk", type=int, default=defaults.gumbel_topk,
                        help="tokens kept per step by the efficient trainer (default: %(default)s)")
    parser.add_argument("--method", default=defaults.method, metavar=choices_metavar(METHODS),
                        help="gumbel: soft tokens forward and backward; ste: hard forward, soft backward "
                             "(default: %(default)s)")
    parser.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false",
                        help="the efficient trainer keeps each decode step's activations (default: recomputes them)")
    add_model_option(parser)
    add_device_option(parser)
    parser.add_argument("--json", help="write the report here (default: not written)")
    parser.set_defaults(handler=_main)


def _main(args) -> int:
    require_positive(args, ("steps", "batch_size", "max_new_tokens", "gumbel_topk"))
    if args.method not in METHODS:
        raise SystemExit(f"--method: expected gumbel or ste, got {args.method!r}")
    require_model(args)
    require_device(args)
    from logitless.models import model_vocab_size
    from logitless.ops.gumbel import check_topk

    try:
        check_topk(args.gumbel_topk, model_vocab_size(args.model), "--gumbel-topk")
    except ValueError as err:
        raise SystemExit(str(err)) from None
    require_writable(args, ("json",))
    report = run(GradeBenchConfig(args.steps, args.batch_size, args.max_new_tokens, args.gumbel_topk, args.method,
                                  args.activation_checkpointing, args.model, args.device))
    return write_report(report, args, format_table)


if __name__ == "__main__":
    sys.exit(worker_main(run_worker, GradeBenchConfig, VARIANTS, "--scratch"))
