"""What the recipes that train with a TRL trainer (`logitless grpo`, `logitless distill`) share: a quiet progress
bar, a learning rate a resume was allowed to change, interrupts that report the step, and outputs kept current at
every checkpoint."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm
from transformers import ProgressCallback, TrainerCallback

from logitless import interrupts
from logitless.recipes.common import announce_start


def multichoice_trainer_options(config, output_dir: Path, progress: bool) -> dict:
    """The GRPOConfig options of a `MultichoiceRunConfig` run (`logitless grpo`, `logitless verifree`): one generation
    per optimizer step on the CPU, a constant learning rate, a log line per step, checkpoints every ``save_every``."""
    return dict(output_dir=str(output_dir), use_cpu=True, bf16=False, activation_checkpointing=False,
                per_device_train_batch_size=config.completions_per_step, num_generations=config.num_generations,
                max_completion_length=config.max_completion_length, max_steps=config.steps,
                learning_rate=config.learning_rate, lr_scheduler_type="constant", temperature=config.temperature,
                logging_steps=1, report_to="none", save_strategy="steps", save_steps=config.save_every,
                save_total_limit=config.save_total_limit, seed=config.seed, disable_dropout=True,
                disable_tqdm=not progress)


def questions_dataset(config, records: list[dict]):
    """The TRL dataset (prompt, question, answer) of a `MultichoiceRunConfig` run's questions, for its ``task``."""
    if config.task == "free-form":
        from logitless.free_form.data import to_trl_dataset
    else:
        from logitless.multichoice.data import to_trl_dataset
    return to_trl_dataset(records)


class QuietProgress(ProgressCallback):
    """TRL's step bar, named like the other commands' bars, without a printed dict of metrics per step."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description(self.label)

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


class NewLearningRate(TrainerCallback):
    """A resume that was allowed to change the learning rate: the restored optimizer and (constant)
    schedule take the new one."""

    def __init__(self, learning_rate: float):
        self.learning_rate = learning_rate

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        for group in optimizer.param_groups:
            group["lr"] = self.learning_rate
        lr_scheduler.base_lrs = [self.learning_rate] * len(optimizer.param_groups)
        lr_scheduler._last_lr = list(lr_scheduler.base_lrs)  # what the Trainer logs as this step's rate


class EqualRewardsWarning(TrainerCallback):
    """A warning when every completion of each group of the first steps got the same reward: a GRPO run that learns
    nothing, with ``hint`` on what to do."""

    FIRST_STEPS = 2  # how many steps in, at most

    def __init__(self, command: str, steps: int, hint: str):
        self.command, self.first_steps, self.hint = command, min(self.FIRST_STEPS, steps), hint

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "frac_reward_zero_std" not in (logs or {}) or state.global_step != self.first_steps:
            return
        first = [entry for entry in state.log_history if "frac_reward_zero_std" in entry][:self.first_steps]
        if all(entry["frac_reward_zero_std"] == 1.0 for entry in first):
            rewards = sorted({round(entry["reward"], 4) for entry in first})
            tqdm.write(f"logitless {self.command}: warning: in each group of the first {len(first)} step(s), every "
                       f"completion got the same reward (mean {', '.join(map(str, rewards))}): nothing was learned. "
                       + self.hint, file=sys.stderr)


class RunTracking(TrainerCallback):
    """The step an interrupt reports, and ``write_outputs(log_history)`` (history, plots) at every save."""

    def __init__(self, label: str, output_dir: Path, steps: int, write_outputs: Callable[[list[dict]], object]):
        self.label, self.output_dir, self.steps, self.write_outputs = label, output_dir, steps, write_outputs

    def on_train_begin(self, args, state, control, **kwargs):
        interrupts.track(self.label, self.output_dir, state.global_step, self.steps)

    def on_step_end(self, args, state, control, **kwargs):
        interrupts.step_done(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self.write_outputs(state.log_history)


def train_resumably(trainer, command: str, checkpoint: Path | None, steps: int, changes: dict, learning_rate: float,
                    progress: bool, write_outputs: Callable[[list[dict]], object]) -> None:
    """Train ``trainer`` for ``logitless COMMAND``, from ``checkpoint`` when resuming (with the learning rate a resume
    was allowed to change), its outputs written at every save."""
    if "learning_rate" in changes:
        trainer.add_callback(NewLearningRate(learning_rate))
    if progress:  # the bar, without a printed dict of every metric at each step (history.json has them)
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(QuietProgress(f"logitless {command}"))
    trainer.add_callback(RunTracking(f"logitless {command}", Path(trainer.args.output_dir), steps, write_outputs))
    announce_start(command, checkpoint)
    trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
