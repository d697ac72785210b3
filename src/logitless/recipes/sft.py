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

from logitless.checkpoint import (CHECKPOINT_STAGING, STEP_CHECKPOINT, last_complete_checkpoint,
                                  load_checkpoint_state, save_checkpoint)
from logitless.plots import plot_curve
from logitless import interrupts
from logitless.recipes.common import (NONFINITE_ADVICE, RunPlan, announce_start, check_model_source, claim_run,
                                      load_model, plural, refuse_other_commands_data, run_recipe, skipped_note)
from logitless.recipes.sft_options import FIXED_OPTIONS, RESULT_OPTIONS, SFTConfig
from logitless.records import arithmetic_sft_examples, iterate_batches, load_jsonl
from logitless.rundir import write_json_atomically

OUTPUTS = (STEP_CHECKPOINT, CHECKPOINT_STAGING, "history.json", "loss.png")


@dataclass
class SFTPlan(RunPlan):
    """What `prepare_sft` checked and claimed, before any model is loaded: the training pairs too."""

    examples: list[dict[str, str]] = dataclasses.field(default_factory=list)


def load_examples(config: SFTConfig) -> list[dict[str, str]]:
    """The training pairs, checked: errors name ``data`` or ``batch_size``. Pairs with an empty response
    (nothing to learn from) are left out, with a note."""
    if config.data:
        refuse_other_commands_data("data", config.data, "sft", "sft")
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


def prepare_sft(config: SFTConfig) -> SFTPlan:
    """Every check that needs no model: data, output directory, resume options. Raises ValueError
    naming the option at fault; writes only ``logitless-run.json`` (and removes this run's earlier
    outputs when it starts over)."""
    examples = load_examples(config)
    def check_model_unless_resuming(checkpoint):
        if checkpoint is None:  # a resume loads the checkpoint, not --model (which may be offline by now)
            check_model_source("model", config.model)

    claimed = claim_run("sft", config, OUTPUTS, RESULT_OPTIONS, FIXED_OPTIONS, before_start=check_model_unless_resuming)
    return SFTPlan(**vars(claimed), examples=examples)


def train_sft(config: SFTConfig | SFTPlan, *, progress: bool = True) -> dict:
    """Run SFT; returns the history {"loss": [...], "entropy": [...], "step", "seconds", "skipped": [...]}."""
    import torch
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from logitless.sft import sft_step

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

    announce_start("sft", plan.checkpoint)
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


def run_command(config: SFTConfig, args: argparse.Namespace) -> int:
    plan, history = run_recipe("sft", config, args, prepare_sft, train_sft)
    if history is None:
        return 0
    print(f"loss {history['loss'][0]:.3f} -> {history['loss'][-1]:.3f} over {plural(history['step'], 'step')} "
          f"({history['seconds']:.1f}s){skipped_note(history)}; plot: {plan.run.path / 'loss.png'}; "
          f"checkpoint: {last_complete_checkpoint(plan.run.path)[0]}")
    return 0
