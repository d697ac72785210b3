"""`logitless grpo`'s options: `MultichoiceGRPOConfig`, its help texts, and the options a resume compares.
Nothing here loads PyTorch, so ``--help`` and a bad option answer at once; the run is `logitless.recipes.grpo`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from logitless._checks import check_choice, check_finite_numbers, check_generations, check_positive_ints
from logitless._lazy import later
from logitless.op_settings import GRPO_LOSS_TYPES
from logitless.recipes.config import MODEL_HELP, RUN_CONTROL_HELP, RecipeConfig, check_model_name
from logitless.recipes.options import add_config_parser

DESCRIPTION = ("`logitless grpo`: GRPO on multiple-choice questions with the judge reward or RLPR's "
               "reference-probability reward, or on free-form questions with RLPR's, logit-free, crash-safe.")

# TRL's loss types, by TRL's names (those of `GRPOSettings`), each of which needs no other option: luspo, meant for
# sequence-level importance sampling, is not offered
LOSS_TYPES = tuple(name for name in GRPO_LOSS_TYPES if name != "luspo")
# "judge": P(correct | model) x (1 - P(correct | judge)); "reference-probability": RLPR's verifier-free reward of the
# correct letter (`logitless.trl.reference_probability`)
REWARDS = ("judge", "reference-probability")
SYNTHETIC_QUESTIONS = 256  # the default question set, the same whatever the number of steps
# "multichoice": questions with lettered options, the answer a letter; "free-form": answered by a word or a number
TASKS = ("multichoice", "free-form")
FREE_FORM_COUNT = 140  # the questions of logitless/free_form/questions.jsonl, the free-form task's default
FREE_FORM_QUESTIONS = f"{FREE_FORM_COUNT} embedded free-form questions (arithmetic and facts)"


@dataclass
class MultichoiceRunConfig(RecipeConfig):
    """What the commands that train on multiple-choice questions with TRL's GRPOTrainer share (`logitless grpo`,
    `logitless verifree`): the questions, the steps, the groups, the generation, the learning rate, the saves."""

    task: str = "multichoice"
    data: str | None = None  # jsonl / saved or hub dataset of the task's rows; None: the task's embedded questions
    output_dir: str = "runs/grpo"
    steps: int = 4
    completions_per_step: int = 8
    num_generations: int = 4
    max_completion_length: int = 24
    learning_rate: float = 5e-5
    temperature: float = 1.0
    save_every: int = 2

    CHOICES = {**RecipeConfig.CHOICES, "task": TASKS}

    def __post_init__(self):
        super().__post_init__()
        check_choice("task", self.task, TASKS)
        check_positive_ints(self, ("steps", "completions_per_step", "num_generations", "max_completion_length",
                                   "save_every"))
        check_generations(self.num_generations, self.completions_per_step)
        check_finite_numbers(self, ("learning_rate", "temperature"))

    @property
    def prompts_per_step(self) -> int:
        return self.completions_per_step // self.num_generations

    @property
    def questions_named(self) -> str:
        """The questions, as a run card names them."""
        embedded = FREE_FORM_QUESTIONS if self.task == "free-form" else f"{SYNTHETIC_QUESTIONS} synthetic questions"
        return self.data or embedded


@dataclass
class MultichoiceGRPOConfig(MultichoiceRunConfig):
    judge: str | None = None  # a causal LM to judge chains of thought; None: a frozen copy of the initial policy
    loss_type: str = "dapo"
    reward: str = "judge"
    reward_std_filter: bool = False  # RLPR's filter of the groups whose rewards hardly vary (the paper's settings)

    CHOICES = {**MultichoiceRunConfig.CHOICES, "loss_type": LOSS_TYPES, "reward": REWARDS}
    MODEL_OPTIONS = ("model", "judge")

    def __post_init__(self):
        super().__post_init__()
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("reward", self.reward, REWARDS)
        if self.task == "free-form" and self.reward == "judge":
            raise ValueError("reward: the judge reward reads the letter of a multiple-choice question; --task "
                             "free-form needs --reward reference-probability")
        if not isinstance(self.reward_std_filter, bool):
            raise TypeError(f"reward_std_filter: expected true or false, got {self.reward_std_filter!r}")
        if self.judge is not None:
            if self.reward != "judge":
                raise ValueError(f"judge: has no effect on this run (used with --reward judge only, not "
                                 f"{self.reward}); leave it out, or pass --reward judge")
            check_model_name("judge", self.judge)


HELP = {
    "model": f"policy: {MODEL_HELP}",
    "reward": "what a completion scores: 'judge', P(correct | model) x (1 - P(correct | judge)); or "
              "'reference-probability', RLPR's verifier-free reward: how much the completion's reasoning raises the "
              "policy's own probability of the reference answer (the correct letter) after 'ANSWER:' (0 without an "
              "answer)",
    "judge": "judge model reading the chain of thought, for --reward judge (default: a frozen copy of the initial "
             "policy)",
    "reward_std_filter": "drop from the loss the questions whose group of rewards varies less than 0.5 x a moving "
                         "average of the group stds (RLPR's filter, with the paper's settings: the first 10 steps only "
                         "measure the stds) (default: off)",
    "task": "'multichoice': questions with lettered options, the answer a letter; 'free-form': questions answered by "
            "a word or a number (--reward reference-probability only)",
    "data": "questions: a jsonl file, a saved dataset directory or a hub dataset with question, choices, answer "
            "(--task multichoice) or question, answer (--task free-form) (default: the task's embedded questions, "
            f"{SYNTHETIC_QUESTIONS} synthetic multiple-choice ones, or {FREE_FORM_COUNT} "
            "free-form ones: sums, differences, products, capitals, opposites, plurals...)",
    "output_dir": "run directory: checkpoint-STEP directories, history.json, reward.png (both written at every "
                  "checkpoint); a rerun resumes from it",
    "steps": "GRPO steps in all (a resume continues up to this number)",
    "completions_per_step": "completions generated and trained on per step",
    "num_generations": "completions per question (a GRPO group; at least 2, dividing --completions-per-step)",
    "max_completion_length": "tokens per completion at most",
    "learning_rate": "AdamW learning rate, constant",
    "loss_type": "TRL's loss type",
    "temperature": "sampling temperature (the loss and the reward read logits at the same temperature)",
    "save_every": "write a checkpoint-STEP every this many steps",
    "seed": "seed of the model's initialization, the question order and sampling",
    **RUN_CONTROL_HELP,
}
RESULT_OPTIONS = ("task", "reward", "reward_std_filter", "judge", "data", "completions_per_step", "num_generations",
                  "max_completion_length", "learning_rate", "loss_type", "temperature", "seed")
FIXED_OPTIONS = ("model",)  # a resume continues the checkpoint's weights; the default judge is a copy of the model


def add_parser(subcommands) -> argparse.ArgumentParser:
    return add_config_parser(subcommands, "grpo", "GRPO on multiple-choice questions with the judge or RLPR's "
                             "reward, logit-free, resumable from --output-dir", MultichoiceGRPOConfig, HELP,
                             later("logitless.recipes.grpo", "run_command"), DESCRIPTION)
