"""`logitless sft`: supervised fine-tuning on (prompt, response) pairs, logit-free, resumable, crash-safe.

Each optimizer step (`logitless.sft.sft_step`) takes ``gradient_accumulation_steps`` microbatches, each
scored on its response tokens only: no (B, T, V) logits, and the prompt's positions never reach the LM
head.

Before any model is loaded (`prepare_sft`): the data is read and checked, and the output directory
is claimed (`logitless.rundir`: never a directory another run or the user filled). A checkpoint
(`logitless.checkpoint`: complete or absent, whatever the moment of a crash) is written every
``save_every`` steps and at the end; a rerun with the same output directory resumes from it with the
same data order, and refuses options that would change the result unless ``allow_changed`` names
them. A NaN or infinite loss or gradient stops the run before that step is applied or saved
(``on_nonfinite="skip"`` skips the step instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from logitless._checks import check_finite_numbers, check_positive_ints
from logitless.checkpoint import (CHECKPOINT_STAGING, STEP_CHECKPOINT, checkpoint_step, last_complete_checkpoint,
                                  load_checkpoint_state, save_checkpoint)
from logitless.data import arithmetic_sft_examples, iterate_batches, load_jsonl
from logitless.plots import plot_curve
from logitless.recipes import interrupts
from logitless.recipes.common import (MODEL_HELP, NONFINITE_ADVICE, RUN_CONTROL_HELP, RecipeConfig, announce_start,
                                      check_model_source, load_model, plural, resume_checkpoint, run_recipe,
                                      skipped_note)
from logitless.recipes.options import add_config_parser
from logitless.rundir import RunDirectory, file_identity, write_json_atomically
from logitless.sft import sft_step


@dataclass
class SFTConfig(RecipeConfig):
    data: str | None = None  # jsonl with prompt/response; None: the built-in arithmetic set
    output_dir: str = "runs/sft"
    steps: int = 40
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    save_every: int = 20

    def __post_init__(self):
        super().__post_init__()
        check_positive_ints(self, ("steps", "batch_size", "gradient_accumulation_steps", "save_every"))
        check_finite_numbers(self, ("learning_rate", "max_grad_norm"))
        check_finite_numbers(self, ("weight_decay",), allow_zero=True)


HELP = {
    "model": MODEL_HELP,
    "data": "jsonl file with a 'prompt' and a 'response' string per line (default: a built-in arithmetic set)",
    "output_dir": "run directory: checkpoint-STEP directories, history.json, loss.png (both written at every "
                  "checkpoint); a rerun resumes from it",
    "steps": "optimizer steps in all (a resume continues up to this number)",
    "batch_size": "examples per microbatch",
    "gradient_accumulation_steps": "microbatches per optimizer step (the loss is the mean over all their response "
                                   "tokens: the gradient of one batch of them all)",
    "learning_rate": "AdamW learning rate, constant",
    "weight_decay": "AdamW weight decay",
    "max_grad_norm": "gradients are clipped to this global norm",
    "save_every": "write a checkpoint-STEP every this many steps (and at the end)",
    "seed": "seed of the model's initialization and of the data order",
    **RUN_CONTROL_HELP,
}
# Options whose change would change the trained weights: a resume refuses a change unless allowed.
# ``steps`` is not one of them: the learning rate is constant, so more steps continue the same run.
RESULT_OPTIONS = ("data", "batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
                  "max_grad_norm", "seed")
FIXED_OPTIONS = ("model",)  # a resume continues the checkpoint's weights: a new model cannot take effect
OUTPUTS = (STEP_CHECKPOINT, CHECKPOINT_STAGING, "history.json", "loss.png")


@dataclass
class SFTPlan:
    """What `prepare_sft` checked and claimed, before any model is loaded."""

    config: SFTConfig
    examples: list[dict[str, str]]
    run: RunDirectory
    checkpoint: Path | None  # to resume from


def load_examples(config: SFTConfig) -> list[dict[str, str]]:
    """The training pairs, checked: errors name ``data`` or ``batch_size``. Pairs with an empty response
    (nothing to learn from) are left out, with a note."""
    examples = load_jsonl(config.data, name="data") if config.data else arithmetic_sft_examples(seed=config.seed)
    usable = [example for example in examples if example["response"]]
    if not usable:
        raise ValueError(f"data: every response in {config.data} is empty; there is nothing to train on")
    if len(usable) < len(examples):
        print(f"logitless sft: leaving out {len(examples) - len(usable)} of {len(examples)} examples whose "
              "response is empty")
    if len(usable) < config.batch_size:
        raise ValueError(f"batch_size: {config.batch_size} exceeds the {len(usable)} usable examples in "
                         f"{config.data or 'the built-in set'}")
    return usable


def _recorded_options(config: SFTConfig) -> dict:
    options = dataclasses.asdict(config)
    options["data"] = file_identity(config.data)
    return options


def prepare_sft(config: SFTConfig) -> SFTPlan:
    """Every check that needs no model: data, output directory, resume options. Raises ValueError
    naming the option at fault; writes only ``logitless-run.json`` (and removes this run's earlier
    outputs when it starts over)."""
    examples = load_examples(config)
    run = RunDirectory.claim(config.output_dir, "sft", outputs=OUTPUTS, overwrite=config.overwrite)
    with run.released_on_error():
        checkpoint = resume_checkpoint("sft", run.path, config)
        if checkpoint is None:  # a resume loads the checkpoint, not --model (which may be offline by now)
            check_model_source("model", config.model)
        run.start(_recorded_options(config), resume=checkpoint is not None, result_options=RESULT_OPTIONS,
                  fixed_options=FIXED_OPTIONS, allow_changed=config.allow_changed,
                  step=None if checkpoint is None else checkpoint_step(checkpoint))
    return SFTPlan(config, examples, run, checkpoint)


def train_sft(config: SFTConfig | SFTPlan, *, progress: bool = True) -> dict:
    """Run SFT; returns the history {"loss": [...], "entropy": [...], "step", "seconds", "skipped": [...]}."""
    from transformers.utils import logging as hf_logging

    plan = config if isinstance(config, SFTPlan) else prepare_sft(config)
    config, run = plan.config, plan.run
    hf_logging.disable_progress_bar()  # our own bar is the one to watch; theirs flash on every save/load
    resuming = plan.checkpoint is not None
    torch.manual_seed(config.seed)
    model, tokenizer = load_model("model", str(plan.checkpoint) if resuming else config.model, config.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay,
                                  fused=True)  # one kernel per step: ~10x less optimizer time on CPU than foreach
    history = {"loss": [], "entropy": [], "step": 0, "seconds": 0.0, "skipped": []}
    if resuming:
        history = {"skipped": [], **load_checkpoint_state(plan.checkpoint, optimizer)}
        for group in optimizer.param_groups:  # the options now in force (equal, or a change that was allowed)
            group.update(lr=config.learning_rate, weight_decay=config.weight_decay)
    batches = iterate_batches(plan.examples, config.batch_size, seed=config.seed)
    for _ in range(history["step"] * config.gradient_accumulation_steps):  # same data order after a resume
        next(batches)

    announce_start("sft", plan.checkpoint, config.steps)
    interrupts.track("logitless sft", run.path, history["step"], config.steps)
    started = time.perf_counter() - history["seconds"]
    bar = tqdm(range(history["step"], config.steps), initial=history["step"], total=config.steps,
               desc="sft", disable=not progress, unit="step")
    for step in bar:
        done = sft_step(model, tokenizer, optimizer, [next(batches) for _ in range(config.gradient_accumulation_steps)],
                        step=step + 1, max_grad_norm=config.max_grad_norm, on_nonfinite=config.on_nonfinite,
                        advice=NONFINITE_ADVICE)
        if not done.applied:
            history["skipped"].append(step + 1)
        history["loss"].append(done.loss)
        history["entropy"].append(done.entropy)
        history["step"] = step + 1
        history["seconds"] = time.perf_counter() - started
        bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", entropy=f"{history['entropy'][-1]:.2f}")
        if history["step"] % config.save_every == 0 or history["step"] == config.steps:
            save_checkpoint(run.path, history["step"], model, tokenizer, optimizer, history,
                            keep=config.save_total_limit)
            _write_history(run.path, history)
        interrupts.step_done(history["step"])
    bar.close()
    _write_history(run.path, history)
    return history


def _write_history(run_dir: Path, history: dict) -> None:
    write_json_atomically(run_dir / "history.json", history)
    plot_curve(history["loss"], run_dir / "loss.png", title="SFT loss (mean token NLL on responses)",
               ylabel="loss (nats/token)")


# -- the `logitless sft` command -------------------------------------------------------------------

def add_parser(subcommands) -> argparse.ArgumentParser:
    return add_config_parser(subcommands, "sft", "supervised fine-tuning, logit-free, resumable from --output-dir",
                             SFTConfig, HELP, run_command, __doc__.split("\n\n")[0])


def run_command(args: argparse.Namespace) -> int:
    plan, history = run_recipe("sft", args, SFTConfig, prepare_sft, train_sft)
    print(f"loss {history['loss'][0]:.3f} -> {history['loss'][-1]:.3f} over {plural(history['step'], 'step')} "
          f"({history['seconds']:.1f}s){skipped_note(history)}; plot: {plan.run.path / 'loss.png'}; "
          f"checkpoint: {last_complete_checkpoint(plan.run.path)[0]}")
    return 0
