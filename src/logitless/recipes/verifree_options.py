"""`logitless verifree`'s options: `VeriFreeRunConfig`, its help texts, and the options a resume compares. Nothing here
loads PyTorch, so ``--help`` and a bad option answer at once; the run is `logitless.recipes.verifree`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from logitless._checks import check_answer_template
from logitless._lazy import later
from logitless.recipes import grpo_options
from logitless.recipes.grpo_options import MultichoiceRunConfig
from logitless.recipes.config import RUN_CONTROL_HELP
from logitless.recipes.options import add_config_parser

DESCRIPTION = ("`logitless verifree`: VeriFree on multiple-choice or free-form questions: the policy's own "
               "probability of the reference answer after its reasoning is the reward of that reasoning and the weight "
               "of the answer's likelihood; no verifier, logit-free, crash-safe.")


@dataclass
class VeriFreeRunConfig(MultichoiceRunConfig):
    output_dir: str = "runs/verifree"
    answer_start: str = "ANSWER:"  # where the prompts ask for the answer: the reasoning ends there
    answer_template: str = " {answer}"  # what replaces the rest of the completion, {answer} the reference answer

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.answer_start, str) or not self.answer_start:
            raise ValueError(f"answer_start: expected a non-empty string, got {self.answer_start!r}")
        check_answer_template("answer_template", self.answer_template)


HELP = {
    "model": grpo_options.HELP["model"],
    "task": "'multichoice': questions with lettered options, the answer a letter; 'free-form': questions answered "
            "by a word or a number",
    "data": grpo_options.HELP["data"],
    "output_dir": "run directory: checkpoint-STEP directories, history.json, reward.png (both written at every "
                  "checkpoint), README.md; a rerun resumes from it",
    "answer_start": "where a completion's reasoning ends: what it wrote after the first occurrence is replaced by "
                    "--answer-template (a completion without it has reward 0)",
    "answer_template": "what replaces the rest of the completion, {answer} being the reference answer (literal braces "
                       "doubled); the reward is the policy's probability of it",
    "steps": "optimizer steps in all, one generation each (a resume continues up to this number)",
    **{name: grpo_options.HELP[name] for name in ("completions_per_step", "num_generations",
                                                  "max_completion_length", "learning_rate", "temperature",
                                                  "save_every", "seed")},
    **RUN_CONTROL_HELP,
}
RESULT_OPTIONS = ("task", "data", "answer_start", "answer_template", "completions_per_step", "num_generations",
                  "max_completion_length", "learning_rate", "temperature", "seed")
FIXED_OPTIONS = ("model",)  # a resume continues the checkpoint's weights


def add_parser(subcommands) -> argparse.ArgumentParser:
    return add_config_parser(subcommands, "verifree", "VeriFree on multiple-choice or free-form questions: the "
                             "probability of the reference answer after the reasoning, no verifier, logit-free, "
                             "resumable from --output-dir",
                             VeriFreeRunConfig, HELP, later("logitless.recipes.verifree", "run_command"), DESCRIPTION)
