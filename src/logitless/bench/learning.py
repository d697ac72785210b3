"""`logitless bench learning`: does the policy learn the embedded task without a verifier? The judge reward, RLPR and
VeriFree from the same warm start, at the same settings, with held-out accuracy before and after.

1. Warm start: ``logitless sft`` of the embedded untied tiny Qwen2 on 16 multiple-choice questions (sums and
   largest numbers, options in random order) answered " <ordinal> ANSWER: <letter>": it learns the format, not the
   rule. The ordinal is the reasoning before the answer tag, what every method's reward conditions on (the judge
   reads it, RLPR and VeriFree replace only what follows the tag).
2. Each method is its own command in a fresh process, from that policy, on the same ``train_questions`` of the task
   "Which number is the largest?" with the options in increasing order (the answer is always the last one, a rule
   learned from the reward alone), with the same steps, groups, completion length, learning rate, temperature and
   seed: ``logitless grpo --reward judge`` (judge), ``logitless grpo --reward reference-probability`` (rlpr),
   ``logitless verifree`` (verifree).
3. Held-out accuracy (`logitless.multichoice.accuracy.sampled_accuracy`): on ``eval_questions`` other questions of the
   task (none of them a training question), the fraction of ``eval_samples`` sampled completions per question, at
   the training temperature, whose letter after "ANSWER:" is the reference answer; of the warm start (before) and
   of each method's last checkpoint (after).

Reported per method: the command, the options its run recorded (the same for all, checked), the reward of every
step and what else its run logged per step (``logged``: the reward's factors, the completions without an answer, the
loss), the accuracy before and after, and the seconds of the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from logitless.bench.options import benchmark_parser, require_positive, require_writable, rows_so_far, write_report

# the method's name in the report -> the command that trains with it
COMMANDS = {"judge": ("grpo", "--reward", "judge"), "rlpr": ("grpo", "--reward", "reference-probability"),
            "verifree": ("verifree",)}
# the options every method's run gets, equal for all: the bench's fields of the same names
TRAINING_OPTIONS = ("steps", "completions_per_step", "num_generations", "max_completion_length", "learning_rate",
                    "temperature", "seed")
TASK = ("sorted_largest",)
TRAIN_SEED, HELD_OUT_SEED = 1, 2  # of the training and of the held-out questions
WARM_START_QUESTIONS, WARM_START_SEED = 16, 0


@dataclass
class LearningBenchConfig:
    warm_start_steps: int = 60
    train_questions: int = 64
    eval_questions: int = 16
    eval_samples: int = 4
    steps: int = 12
    completions_per_step: int = 32
    num_generations: int = 4
    max_completion_length: int = 8
    learning_rate: float = 1e-3
    temperature: float = 1.0
    seed: int = 0
    methods: tuple[str, ...] = tuple(COMMANDS)


HELP = {"warm_start_steps": "logitless sft steps of the warm start, shared by every method",
        "train_questions": "questions of the task the methods train on",
        "eval_questions": "held-out questions of the task, none of them a training question",
        "eval_samples": "completions sampled per held-out question",
        "steps": "training steps of every method",
        "completions_per_step": "completions per step",
        "num_generations": "completions per question (a group; at least 2, dividing --completions-per-step)",
        "max_completion_length": "tokens per completion at most",
        "learning_rate": "AdamW learning rate of every method, constant",
        "temperature": "sampling temperature of training and of the held-out accuracy",
        "seed": "--seed of the warm start and of every method's run"}


def logitless_command(arguments: list[str]) -> float:
    """Run ``logitless ARGUMENTS...`` in a fresh process; its seconds. A failure raises with the end of its stderr."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "logitless", *arguments], capture_output=True, text=True,
                          env=dict(os.environ, TQDM_DISABLE="1"))
    if done.returncode != 0:
        raise RuntimeError(f"logitless {' '.join(arguments)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def write_questions(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps({key: r[key] for key in ("question", "choices", "answer")}) + "\n"
                            for r in records))
    return path


def questions(config: LearningBenchConfig) -> tuple[list[dict], list[dict]]:
    """(training questions, held-out questions): the held-out ones are the first ``eval_questions`` of their seed's
    draw that are not training questions."""
    from logitless.multichoice.data import synthetic_multichoice

    train = synthetic_multichoice(count=config.train_questions, seed=TRAIN_SEED, kinds=TASK)
    seen = {r["prompt"] for r in train}
    drawn = synthetic_multichoice(count=config.eval_questions + len(train), seed=HELD_OUT_SEED, kinds=TASK)
    return train, [r for r in drawn if r["prompt"] not in seen][:config.eval_questions]


def warm_start(config: LearningBenchConfig, scratch: Path) -> tuple[Path, list[float]]:
    """The warm-start policy's directory and its SFT loss per step."""
    from logitless.models import qwen_tokenizer
    from logitless.multichoice.data import synthetic_multichoice
    from logitless.multichoice.warm_start import multichoice_sft_pairs

    pairs = multichoice_sft_pairs(synthetic_multichoice(count=WARM_START_QUESTIONS, seed=WARM_START_SEED),
                                  end=qwen_tokenizer().eos_token, ordinal_before_tag=True)
    data = scratch / "warm_start.jsonl"
    data.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    steps = str(config.warm_start_steps)
    logitless_command(["sft", "--model", "tiny-qwen2-untied", "--data", str(data), "--steps", steps, "--save-every",
                       steps, "--seed", str(config.seed), "--output-dir", str(scratch / "sft")])
    return scratch / "sft" / f"checkpoint-{steps}", json.loads((scratch / "sft" / "history.json").read_text())["loss"]


def method_arguments(method: str, config: LearningBenchConfig, policy: Path, data: Path,
                     output_dir: Path) -> list[str]:
    """``logitless``'s arguments that train with ``method``: the shared options, one checkpoint at the end."""
    options = [part for name in TRAINING_OPTIONS
               for part in (f"--{name.replace('_', '-')}", str(getattr(config, name)))]
    return [*COMMANDS[method], "--model", str(policy), "--data", str(data), *options, "--save-every", str(config.steps),
            "--output-dir", str(output_dir)]


def train_method(method: str, config: LearningBenchConfig, policy: Path, data: Path, output_dir: Path,
                 held_out: list[dict]) -> dict:
    """Train with ``method`` in a fresh process; its reward per step, recorded options and held-out accuracy. The
    command is reported with its paths relative to the bench's scratch directory, ``output_dir``'s parent."""
    from logitless.multichoice.accuracy import sampled_accuracy

    arguments = method_arguments(method, config, policy, data, output_dir)
    seconds = logitless_command(arguments)
    recorded = json.loads((output_dir / "logitless-run.json").read_text())["options"]
    checkpoint = output_dir / f"checkpoint-{config.steps}"
    history = json.loads((output_dir / "history.json").read_text())
    return {"command": "logitless " + " ".join(arguments).replace(f"{output_dir.parent}{os.sep}", ""),
            "options": {name: recorded[name] for name in TRAINING_OPTIONS}, "reward": history.pop("reward"),
            "logged": {name: values for name, values in history.items() if name != "skipped"},
            "accuracy_after": sampled_accuracy(checkpoint, held_out, config.eval_samples, config.temperature),
            "seconds": seconds}


def run(config: LearningBenchConfig, progress: bool = True) -> dict:
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from logitless.multichoice.accuracy import sampled_accuracy

    hf_logging.disable_progress_bar()  # no bar for each model the accuracy loads
    train, held_out = questions(config)
    results = rows_so_far({})
    bar = tqdm(total=1 + len(config.methods), desc="bench learning", disable=not progress, unit="run")
    with tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        bar.set_postfix_str("warm start")
        policy, warm_loss = warm_start(config, scratch)
        before = sampled_accuracy(policy, held_out, config.eval_samples, config.temperature)
        bar.update()
        data = write_questions(scratch / "train.jsonl", train)
        for method in config.methods:
            bar.set_postfix_str(method)
            results[method] = {**train_method(method, config, policy, data, scratch / method, held_out),
                               "accuracy_before": before}
            bar.update()
    bar.close()
    return {"config": asdict(config), "warm_start_loss": [warm_loss[0], warm_loss[-1]],
            "held_out": {"questions": len(held_out), "samples": config.eval_samples,
                         "temperature": config.temperature}, "results": results}


def quarter_mean(values: list[float], last: bool) -> float:
    quarter = values[-max(len(values) // 4, 1):] if last else values[:max(len(values) // 4, 1)]
    return sum(quarter) / len(quarter)


def format_table(report: dict) -> str:
    c, held_out = report["config"], report["held_out"]
    lines = [f"learning without a verifier, tiny Qwen2 (vocabulary 151936), CPU: a warm start of "
             f"{c['warm_start_steps']} SFT steps, then {c['steps']} steps of {c['completions_per_step']} completions "
             f"({c['num_generations']} per question) x {c['max_completion_length']} tokens on {c['train_questions']} "
             f"questions, learning rate {c['learning_rate']}, temperature {c['temperature']}, seed {c['seed']}; "
             "held-out accuracy: "
             f"{held_out['questions']} other questions x {held_out['samples']} samples at temperature "
             f"{held_out['temperature']}, the reference letter matched exactly",
             f"{'method':<10}{'reward, first quarter':>23}{'last quarter':>14}{'accuracy before':>17}{'after':>8}"
             f"{'seconds':>9}"]
    for name, r in report["results"].items():
        lines.append(f"{name:<10}{quarter_mean(r['reward'], False):>23.3f}{quarter_mean(r['reward'], True):>14.3f}"
                     f"{r['accuracy_before']:>17.3f}{r['accuracy_after']:>8.3f}{r['seconds']:>9.0f}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> Path:
    from logitless.plots import curves_beside_bars

    results = report["results"]
    return curves_beside_bars(
        {name: r["reward"] for name, r in results.items()},
        {name: {"before": r["accuracy_before"], "after": r["accuracy_after"]} for name, r in results.items()},
        path, title="learning without a verifier: the same warm start, steps and seeds",
        curves_ylabel="reward (each method's own), per-step mean", bars_ylabel="held-out accuracy (exact match)")


def add_parser(targets) -> None:
    defaults = LearningBenchConfig()
    parser = benchmark_parser(
        targets, "learning", "held-out accuracy before and after the judge reward, RLPR and VeriFree",
        "From one warm start (logitless sft of the embedded untied tiny Qwen2 on the answer format), the judge reward "
        "(logitless grpo --reward judge), RLPR (logitless grpo --reward reference-probability) and VeriFree "
        "(logitless verifree) each train in a fresh process on the same questions ('Which number is the largest?', "
        "options in increasing order) with the same steps, seed, learning rate and temperature. Reports each "
        "method's reward per step and the accuracy on held-out questions (the reference letter after 'ANSWER:', "
        "matched exactly, in sampled completions) before and after.")
    for name, value in asdict(defaults).items():
        if name != "methods":
            parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(value), default=value,
                                help=f"{HELP[name]} (default: %(default)s)")
    parser.add_argument("--methods", nargs="+", choices=tuple(COMMANDS), default=defaults.methods,
                        help="which methods to train (default: all)")
    parser.add_argument("--json", help="write the report here (default: not written)")
    parser.add_argument("--plot", help="write a PNG of the rewards and the accuracies here (default: not drawn)")
    parser.set_defaults(handler=_main)


def _main(args) -> int:
    from logitless._checks import check_generations

    names = [name for name in asdict(LearningBenchConfig()) if name != "methods"]
    require_positive(args, [name for name in names if isinstance(getattr(args, name), int) and name != "seed"])
    for name in ("learning_rate", "temperature"):
        if not 0 < getattr(args, name) < float("inf"):
            raise SystemExit(f"--{name.replace('_', '-')}: must be a finite number > 0, got {getattr(args, name)}")
    if len(set(args.methods)) < len(args.methods):
        raise SystemExit(f"--methods: each method at most once, got {' '.join(args.methods)}")
    try:
        check_generations(args.num_generations, args.completions_per_step)
    except ValueError as err:
        raise SystemExit(f"--num-generations: {str(err).partition(': ')[2]} (--completions-per-step)") from None
    if args.train_questions < args.completions_per_step // args.num_generations:
        raise SystemExit(f"--train-questions: a step needs {args.completions_per_step // args.num_generations} "
                         f"questions (--completions-per-step / --num-generations), got {args.train_questions}")
    require_writable(args)
    config = LearningBenchConfig(**{name: getattr(args, name) for name in names}, methods=tuple(args.methods))
    return write_report(run(config), args, format_table, plot)
