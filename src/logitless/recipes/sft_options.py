"""`logitless sft`'s options: `SFTConfig`, its help texts, and the options a resume compares. Nothing here
loads PyTorch, so ``--help`` and a bad option answer at once; the run is `logitless.recipes.sft`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from logitless._checks import check_finite_numbers, check_positive_ints
from logitless._lazy import later
from logitless.recipes.config import MODEL_HELP, RUN_CONTROL_HELP, RecipeConfig
from logitless.recipes.options import add_config_parser

DESCRIPTION = "`logitless sft`: supervised fine-tuning on (prompt, response) pairs, logit-free, resumable, crash-safe."


@dataclass
class SFTConfig(RecipeConfig):
    # the run: where, how long, how often saved
    output_dir: str = "runs/sft"
    steps: int = 40
    save_every: int = 20
    data: str | None = None  # jsonl with prompt/response; None: the built-in arithmetic set
    # a step
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

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


def add_parser(subcommands) -> argparse.ArgumentParser:
    return add_config_parser(subcommands, "sft", "supervised fine-tuning, logit-free, resumable from --output-dir",
                             SFTConfig, HELP, later("logitless.recipes.sft", "run_command"), DESCRIPTION)
