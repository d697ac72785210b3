"""`logitless grade`'s options: `GradeRunConfig` (the run's options and every trainer setting of `GradeConfig`),
their help texts, and the options a resume compares. Nothing here loads PyTorch, so ``--help`` and a bad option
answer at once; the run is `logitless.recipes.grade`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from logitless._checks import (check_choice, check_nonnegative_int, check_positive_ints, check_strings,
                               dataclass_from_dict)
from logitless._lazy import later
from logitless.grade.config import GradeConfig
from logitless.recipes.config import MODEL_HELP, RUN_CONTROL_HELP, RecipeConfig, check_model_name
from logitless.recipes.options import add_config_parser

DESCRIPTION = "`logitless grade`: GRADE (or the GRPO baseline) on prompts with a differentiable reward."

# method -> the GradeConfig settings it fixes (its trainer: `logitless.recipes.grade_method.TRAINERS`)
METHODS = {"gumbel": {"straight_through": False}, "ste": {"straight_through": True},
           "gumbel_legacy": {"straight_through": False}, "ste_legacy": {"straight_through": True}, "grpo": {}}
REWARDS = ("capitalized", "words", "token", "classifier", "judge")


@dataclass
class GradeRunConfig(RecipeConfig, GradeConfig):
    """`logitless grade`'s options, one flat set of names: the run's (RecipeConfig's and those below) and the
    trainers' settings (GradeConfig's, the same for every method; ``straight_through`` is the method's)."""

    method: str = "gumbel"  # a key of METHODS, or "all": every one in turn
    reward: str = "capitalized"  # one of REWARDS
    reward_model: str | None = None  # token, judge: a causal LM (None: a copy of the initial policy); classifier
    reward_words: tuple[str, ...] = (" good", " great")  # reward "words"
    reward_token: str = " yes"  # reward "token": its log-probability after the completion ...
    reward_suffix: str = "\nIs this a good answer?"  # ... and this text
    data: str | None = None  # jsonl of {"prompt": ...} (judge: question/choices/answer); None: built-in prompts
    eval_data: str | None = None  # held-out prompts, as data; None: built-in ones (none when data is a file)
    eval_every: int = 5  # steps between held-out evaluations (and one at the end); 0: none
    output_dir: str = "runs/grade"
    steps: int = 20
    save_every: int = 10

    CHOICES = {**RecipeConfig.CHOICES, "method": (*METHODS, "all"), "reward": REWARDS}
    METAVARS = {**RecipeConfig.METAVARS, "reward_words": "WORD"}
    MODEL_OPTIONS = ("model", "reward_model", "lora_target_modules")  # lora_target_modules: none in the model

    def __post_init__(self):
        RecipeConfig.__post_init__(self)
        GradeConfig.__post_init__(self)
        check_choice("method", self.method, (*METHODS, "all"))
        check_choice("reward", self.reward, REWARDS)
        check_positive_ints(self, ("steps", "save_every"))
        check_nonnegative_int("eval_every", self.eval_every, "no evaluation")
        self.reward_words = tuple(check_strings("reward_words", self.reward_words))
        if not self.reward_words:
            raise ValueError("reward_words: the list is empty; the reward would always be 0")
        for name in ("reward_token", "reward_suffix"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}: expected a string, got {type(getattr(self, name)).__name__}")
        if self.reward_model is not None:
            check_model_name("reward_model", self.reward_model)
        if self.reward == "classifier" and not self.reward_model:
            raise ValueError("reward_model: a sequence classifier (hub id or directory) is required for reward "
                             "'classifier'")

    @classmethod
    def from_dict(cls, values: dict) -> GradeRunConfig:
        """The config of these options by field name; an option this run would not use is refused."""
        run = dataclass_from_dict(cls, values)
        run.refuse_unused(values)
        return run

    @property
    def methods(self) -> list[str]:
        return list(METHODS) if self.method == "all" else [self.method]

    def trainer_config(self, method: str) -> GradeConfig:
        """The settings of ``method``'s trainer: this run's, and those the method fixes."""
        settings = {field.name: getattr(self, field.name) for field in dataclasses.fields(GradeConfig)}
        return GradeConfig(**{**settings, **METHODS[method]})

    def refuse_unused(self, given) -> None:
        """A ValueError naming the first option in ``given`` that this run would not use (it would do nothing)."""
        methods, lora = set(self.methods), self.lora_rank > 0
        words, token = ("used with --reward words only", "pass --reward words"), ("used with --reward token only",
                                                                                 "pass --reward token")
        unused = {  # option -> (why it does nothing here, what would make it count), for this run only
            "straight_through": ("each --method fixes it: ste and ste_legacy are straight-through",
                                 "pass --method ste"),
            "reward_words": self.reward != "words" and words,
            "reward_token": self.reward != "token" and token,
            "reward_suffix": self.reward != "token" and token,
            "reward_model": self.reward not in ("token", "judge", "classifier") and (
                "used with --reward token, judge or classifier only", "pass one of those rewards"),
            "grpo_group_size": "grpo" not in methods and ("used by --method grpo only", "pass --method grpo or all"),
            "gumbel_topk": not {"gumbel", "ste"} & methods and (
                "used by the memory-efficient methods gumbel and ste only", "pass --method gumbel, ste or all"),
            "lora_alpha": not lora and ("used with --lora-rank above 0 only", "pass --lora-rank"),
            "eval_every": self.data is not None and self.eval_data is None and (
                "there are no held-out prompts when --data is a file", "pass --eval-data"),
            "lora_target_modules": not lora and ("used with --lora-rank above 0 only", "pass --lora-rank"),
        }
        for name in given:
            if unused.get(name):
                why, hint = unused[name]
                raise ValueError(f"{name}: has no effect on this run ({why}); leave it out, or {hint}")


# Options that change a method's trained weights: a resume refuses a change unless allowed. Not among them:
# method (each has its own directory), steps (the learning rate is constant and tau follows its own
# schedule, so more steps continue the run), and what only steers the run.
STEERING_OPTIONS = ("method", "output_dir", "steps", "save_every", "resume", "overwrite", "allow_changed",
                    "on_nonfinite", "activation_checkpointing", "save_total_limit", "eval_data", "eval_every")
# a resume continues the checkpoint's weights: a new model, or a new adapter shape, cannot take effect
FIXED_OPTIONS = ("model", "lora_rank", "lora_alpha", "lora_target_modules")


HELP = {
    "method": "the trainer: gumbel or ste (memory-efficient, soft or straight-through tokens), their legacy dense "
              "versions, the GRPO baseline, or all five one after another",
    "model": MODEL_HELP,
    "reward": "what the rollouts are rewarded for: capitalized words, the --reward-words, the log-probability of "
              "--reward-token under --reward-model, a sequence classifier's score, or a multiple-choice judge",
    "reward_model": "reward token or judge: a causal LM (default: a frozen copy of the initial policy); reward "
                    "classifier: a sequence classifier, required",
    "reward_words": "reward words: single-token words",
    "reward_token": "reward token: the token whose log-probability is the reward",
    "reward_suffix": "reward token: text appended after the completion",
    "data": "jsonl with a 'prompt' per line (reward judge: question/choices/answer) (default: built-in prompts)",
    "eval_data": "held-out prompts, as --data; scored with ordinary sampled completions and the same reward "
                 "(default: built-in held-out prompts, or none when --data is a file)",
    "eval_every": "steps between held-out evaluations, logged as val/reward_mean (and one at the end); 0: none",
    "output_dir": "each method writes OUTPUT_DIR/METHOD",
    "steps": "optimizer steps (a resume continues up to this number)",
    "save_every": "write a checkpoint-STEP every this many steps (and at the end)",
    "gumbel_topk": "tokens kept per step by the memory-efficient methods gumbel and ste (at most the vocabulary "
                   "size)",
    "tau_start": "Gumbel-softmax temperature at step 0",
    "tau_end": "temperature reached after --tau-anneal-steps steps (geometric annealing)",
    "tau_anneal_steps": "steps to anneal tau over",
    "max_new_tokens": "tokens per rollout",
    "batch_size": "rollouts per microbatch",
    "gradient_accumulation_steps": "microbatches per optimizer step",
    "kl_coef": "weight of KL(policy || reference) in the loss",
    "learning_rate": "AdamW learning rate",
    "max_grad_norm": "gradient clipping norm",
    "grpo_group_size": "method grpo: completions per prompt (at least 2, dividing --batch-size)",
    "lora_rank": "> 0: train LoRA adapters of this rank (needs peft) instead of every weight; 0: off",
    "lora_alpha": "LoRA scaling alpha",
    "activation_checkpointing": "keep each decode step's activations instead of recomputing them (default: "
                                "checkpointing on)",
    "seed": "seed of the model, the prompts and the Gumbel noise",
    **RUN_CONTROL_HELP,
    "resume": "start over: every method's earlier outputs in OUTPUT_DIR are replaced (default: resume each method "
              "from its checkpoint)",
    "save_total_limit": RUN_CONTROL_HELP["save_total_limit"].replace("directories", "directories of each method"),
}


def add_parser(subcommands) -> argparse.ArgumentParser:
    return add_config_parser(subcommands, "grade", "GRADE: backprop a differentiable reward through Gumbel-softmax "
                             "rollouts (and the GRPO baseline), resumable from --output-dir", GradeRunConfig, HELP,
                             later("logitless.recipes.grade", "run_command"), DESCRIPTION)
