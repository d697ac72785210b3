"""`logitless bench trl`: each TRL 1.16 trainer that scores tokens, stock (TRL's own fused LM head) against
logitless's drop-in of the same name, a few steps each in a fresh process.

Same model (an embedded one, the tiny Qwen2 by default, with the real 151,936-token Qwen vocabulary; or a
local model directory), same data, same config and steps for both: the median wall time of a training
step after the first (the first allocates what the later ones reuse) and of the loss with its backward
within it, and the peak memory of the whole run beyond what the process held once the trainer was built
(`logitless.memory.PeakMemory`). The data are
synthetic texts of one token per word, so both score the same tokens: SFT ``batch`` (prompt, completion)
pairs of ``seq`` tokens; DPO ``batch`` pairs (chosen and rejected: twice the sequences, and the
reference model's pass); KTO ``batch`` examples (and TRL's KL batch); RLOO and GRPO ``completions``
completions of ``completion_length`` tokens (generation, the same work for both, is part of the step);
distillation the same, with the model at another seed as the teacher (the on-policy divergence over
the full vocabulary), and again at short completions (``distill_short``, where a fused head's fixed costs
show most); ``rlpr`` is GRPO whose reward is RLPR's, the policy's own probability of each prompt's reference answer
(a word) after its completion and an answer tag: stock TRL with that reward written the obvious way (one forward of
the scored rows with their logits), logitless with `logitless.trl.reference_probability_reward` (the same rows, one
body pass, the fused log-probs); ``verifree`` is `logitless.trl.VeriFreeTrainer` (its reward, the reasoning's
policy gradient and the answer's likelihood from the one training forward) against stock TRL's GRPO with VeriFree's
reward, R = pi(y* | x, z), read from a forward with the logits (the reasoning's policy gradient only; no term for the
answer's likelihood), both on the same completions, each cut short to end in the answer tag. Each run is
`bench.trainers_steps` in a fresh process.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from logitless.bench.options import (add_device_option, add_model_option, benchmark_parser, choices_metavar,
                                     require_device, require_model, require_positive, require_writable, rows_so_far,
                                     write_report)
from logitless.bench.ratios import add_ratios, trl_comparison_lines
from logitless.bench.worker import run_worker_process
from logitless.models import EMBEDDED_DEFAULT

# distill_short: short completions; rlpr: GRPO with RLPR's reward (the obvious one with logits on stock TRL);
# verifree: VeriFreeTrainer (stock TRL: GRPO with VeriFree's reward read from the logits)
TRAINERS = ("sft", "dpo", "kto", "rloo", "grpo", "distill", "distill_short", "rlpr", "verifree")
IMPLEMENTATIONS = ("trl", "logitless")


@dataclass
class TRLBenchConfig:
    trainers: tuple[str, ...] = TRAINERS
    steps: int = 3  # the first is not timed
    batch: int = 8  # sft, dpo, kto: examples per step
    seq: int = 256  # sft, dpo, kto: tokens per example (prompt and completion)
    completions: int = 16  # rloo, grpo, rlpr, verifree, distill: completions per step
    completion_length: int = 128  # rloo, grpo, rlpr, verifree, distill: tokens per completion at most
    short_completion_length: int = 8  # distill_short: distillation at this many tokens per completion
    model: str = EMBEDDED_DEFAULT  # an embedded model (`models.EMBEDDED_MODELS`) or a local directory
    device: str = "cpu"
    rounds: int = 2  # each pair run this many times, alternately; the fastest round of each is reported


def _fastest(runs: list[dict]) -> dict:
    """The round with the fastest step (the least disturbed by other work), each round's times and peaks beside."""
    fastest = min(runs, key=lambda run: run["step_s"])
    return {**fastest, "rounds_step_s": [run["step_s"] for run in runs],
            "rounds_loss_backward_s": [run["loss_backward_s"] for run in runs],
            "rounds_peak_mb": [run["peak_mb"] for run in runs]}


def run(config: TRLBenchConfig, progress: bool = True) -> dict:
    """Both implementations of each trainer, one fresh process after another; ratios are to stock TRL's."""
    from tqdm.auto import tqdm

    from logitless.models import (EMBEDDED_MODELS, embedded_model, model_vocab_size, qwen_tokenizer,
                                  save_model_and_tokenizer)

    results = rows_so_far({})
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = config.model
        if config.model in EMBEDDED_MODELS:  # both trainers load the same saved weights
            model_dir = str(save_model_and_tokenizer(embedded_model(config.model, seed=0), qwen_tokenizer(),
                                                     Path(scratch) / "model"))
        teacher_dir = str(save_model_and_tokenizer(embedded_model(EMBEDDED_DEFAULT, seed=1), qwen_tokenizer(),
                                                   Path(scratch) / "teacher"))
        bar = tqdm(total=len(config.trainers) * len(IMPLEMENTATIONS) * config.rounds, desc="bench trl",
                   disable=not progress)
        for name in config.trainers:
            rounds = {implementation: [] for implementation in IMPLEMENTATIONS}
            for _ in range(config.rounds):  # alternately, so that a slow spell of a shared machine hits both
                for implementation in IMPLEMENTATIONS:
                    rounds[implementation].append(run_worker_process("logitless.bench.trainers_steps", [
                        "--worker", f"{name}:{implementation}", "--model-dirs", f"{model_dir},{teacher_dir}",
                        "--config", json.dumps(asdict(config))]))
                    bar.update()
            results[name] = {implementation: _fastest(runs) for implementation, runs in rounds.items()}
            add_ratios(results[name], "trl", time_key="step_s")
            add_ratios(results[name], "trl", time_key="loss_backward_s", ratio_key="loss_backward_ratio")
        bar.close()
        vocab_size = model_vocab_size(model_dir)
    return {"config": asdict(config), "vocab_size": vocab_size, "results": results}


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [f"TRL trainers, {c['steps']} steps each (the first not timed), the fastest of {c['rounds']} rounds, "
             f"{c['model']} (vocabulary {report['vocab_size']}), {c['device']}; sft/dpo/kto: {c['batch']} x {c['seq']} "
             f"tokens; rloo/grpo/distill: {c['completions']} completions x {c['completion_length']} tokens "
             f"(distill_short: x {c['short_completion_length']})",
             *trl_comparison_lines(report["results"], "step_s", "step s", "trainer", 2)]
    lines.append("loss+bwd: the loss and its backward within a step, the part the head changes; the rest of an RLOO, "
                 "GRPO or distillation step is generation, the same for both")
    return "\n".join(lines)


def add_parser(targets) -> None:
    parser = benchmark_parser(
        targets, "trl", "every TRL trainer (SFT, DPO, KTO, RLOO, GRPO, distillation): TRL's own head vs logitless's",
        "A few training steps of each TRL 1.16 trainer that scores tokens, stock TRL (its own fused LM head) and "
        "logitless's drop-in of the same name, on the same model, data, config and steps, each in a fresh process: "
        "the median step time after the first, the peak memory of the run, and the logged losses.")
    defaults = TRLBenchConfig()
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS), metavar=choices_metavar(TRAINERS),
                        help="which trainers to run (default: all)")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="training steps, the first not timed (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=defaults.batch,
                        help="sft, dpo, kto: examples per step (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=defaults.seq,
                        help="sft, dpo, kto: tokens per example, prompt and completion (default: %(default)s)")
    parser.add_argument("--completions", type=int, default=defaults.completions,
                        help="rloo, grpo, rlpr, verifree, distill: completions per step (default: %(default)s)")
    parser.add_argument("--completion-length", dest="completion_length", type=int,
                        default=defaults.completion_length,
                        help="rloo, grpo, rlpr, verifree, distill: tokens per completion at most "
                             "(default: %(default)s)")
    parser.add_argument("--short-completion-length", dest="short_completion_length", type=int,
                        default=defaults.short_completion_length,
                        help="distill_short: tokens per completion at most, a short-completion distillation "
                             "(default: %(default)s)")
    add_model_option(parser)
    add_device_option(parser, indexed=False)
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="runs of each pair, alternately; the fastest round of each is reported "
                             "(default: %(default)s)")
    parser.add_argument("--json", help="write the report here (default: not written)")
    parser.set_defaults(handler=_main)


def _main(args) -> int:
    require_positive(args, ("steps", "batch", "seq", "completions", "completion_length", "short_completion_length",
                            "rounds"))
    unknown = sorted(set(args.trainers) - set(TRAINERS))
    if unknown:
        raise SystemExit(f"--trainers: unknown {unknown}; choose from {list(TRAINERS)}")
    if args.seq < 2:
        raise SystemExit(f"--seq: must be >= 2 (a prompt and a completion token), got {args.seq}")
    if args.completions % 4:
        raise SystemExit(f"--completions: must be a multiple of 4 (RLOO and GRPO groups of 4), got {args.completions}")
    require_model(args)
    require_device(args)
    require_writable(args, ("json",))
    config = TRLBenchConfig(tuple(dict.fromkeys(args.trainers)), args.steps, args.batch, args.seq, args.completions,
                            args.completion_length, args.short_completion_length, args.model, args.device,
                            args.rounds)
    return write_report(run(config), args, format_table)
