"""One trainer of `logitless bench trl` in this process (``python -m logitless.bench.trainers_steps --worker
NAME:IMPLEMENTATION``): built on the benchmark's data, its steps timed, the peak memory of its run."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch
import trl
from datasets import Dataset
from transformers import TrainerCallback

import logitless.trl
from logitless.memory import PeakMemory, synchronize
from logitless.bench.timing import timed
from logitless.bench.trainers import IMPLEMENTATIONS, TRAINERS, TRLBenchConfig
from logitless.bench.worker import worker_main
from logitless.models import load_tokenizer

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit", "cedar", "amber", "pixel")


def _text(index: int, words: int) -> str:
    """A text of ``words`` words, one token each in the Qwen vocabulary (with their leading space)."""
    return "".join(f" {WORDS[(index * 7 + k * 5) % len(WORDS)]}" for k in range(words))


def _length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def _trainer(name: str, implementation: str, model_dir: str, teacher_dir: str, output_dir: str,
             config: TRLBenchConfig):
    """Trainer ``name``: stock TRL's class, or logitless's of the same name, on the benchmark's data."""
    classes = trl if implementation == "trl" else logitless.trl
    settings = dict(output_dir=output_dir, use_cpu=config.device == "cpu", bf16=False, max_steps=config.steps,
                    logging_steps=1, report_to="none", save_strategy="no", seed=0, learning_rate=1e-5,
                    disable_tqdm=True)
    kwargs = dict(model=model_dir, processing_class=load_tokenizer(model_dir))
    if name in ("sft", "dpo", "kto"):
        half, count = config.seq // 2, config.batch * config.steps
        prompts = [_text(i, half) for i in range(count)]
        completions = [_text(i + 1, config.seq - half) for i in range(count)]
        data = {"sft": {"prompt": prompts, "completion": completions},
                "dpo": {"prompt": prompts, "chosen": completions, "rejected": [_text(i + 2, config.seq - half)
                                                                               for i in range(count)]},
                "kto": {"prompt": prompts, "completion": completions, "label": [i % 2 == 0 for i in range(count)]}}
        settings.update(per_device_train_batch_size=config.batch, max_length=config.seq + 8)
        kwargs["train_dataset"] = Dataset.from_dict(data[name])
    else:
        length = config.short_completion_length if name == "distill_short" else config.completion_length
        settings.update(per_device_train_batch_size=config.completions, max_completion_length=length)
        kwargs["train_dataset"] = Dataset.from_dict({"prompt": [_text(i, 16) for i in
                                                                range(config.completions * config.steps)]})
        if name.startswith("distill"):
            kwargs["teacher_model"] = teacher_dir
        else:
            settings["num_generations"] = 4
            kwargs["reward_funcs"] = _length_reward
    config_class, trainer_class = {"sft": ("SFTConfig", "SFTTrainer"), "dpo": ("DPOConfig", "DPOTrainer"),
                                   "kto": ("KTOConfig", "KTOTrainer"), "rloo": ("RLOOConfig", "RLOOTrainer"),
                                   "grpo": ("GRPOConfig", "GRPOTrainer"),
                                   "distill": ("DistillationConfig", "DistillationTrainer"),
                                   "distill_short": ("DistillationConfig", "DistillationTrainer")}[name]
    return getattr(classes, trainer_class)(args=getattr(trl, config_class)(**settings), **kwargs)


class StepClock(TrainerCallback):
    """The wall time of each optimizer step, and of the loss and its backward within it (``loss_seconds[0]``, summed
    by `bench.timing.timed` wrappers), the work queued on ``device`` included."""

    def __init__(self, device: torch.device, loss_seconds: list[float]):
        self.device, self.loss_seconds = device, loss_seconds
        self.seconds, self.loss_backward_seconds = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.started, self.loss_started = time.perf_counter(), self.loss_seconds[0]

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - self.started)
        self.loss_backward_seconds.append(self.loss_seconds[0] - self.loss_started)


def run_worker(worker: str, model_dirs: str, config: TRLBenchConfig) -> dict:
    """One trainer (``NAME:IMPLEMENTATION``) in this fresh process: its steps timed (whole, and the loss with its
    backward), the peak memory of the run."""
    name, implementation = worker.split(":")
    model_dir, teacher_dir = model_dirs.split(",")
    with tempfile.TemporaryDirectory() as output_dir:
        torch.manual_seed(0)
        trainer = _trainer(name, implementation, model_dir, teacher_dir, output_dir, config)
        device, loss_seconds = trainer.accelerator.device, [0.0]
        trainer.compute_loss = timed(trainer.compute_loss, loss_seconds, device)
        trainer.accelerator.backward = timed(trainer.accelerator.backward, loss_seconds, device)
        clock = StepClock(device, loss_seconds)
        trainer.add_callback(clock)
        torch.manual_seed(0)
        with PeakMemory(device) as peak:
            trainer.train()
            synchronize(device)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    timed_steps = slice(1, None) if len(clock.seconds) > 1 else slice(None)  # the first step allocates
    return {"step_s": statistics.median(clock.seconds[timed_steps]), "steps_s": clock.seconds,
            "loss_backward_s": statistics.median(clock.loss_backward_seconds[timed_steps]),
            "peak_mb": peak.megabytes, "losses": losses}


if __name__ == "__main__":
    sys.exit(worker_main(run_worker, TRLBenchConfig, tuple(f"{t}:{i}" for t in TRAINERS for i in IMPLEMENTATIONS),
                         "--model-dirs"))
