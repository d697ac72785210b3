"""`logitless distill`: on-policy distillation with the exact divergence, logit-free, resumable, crash-safe.

The student generates a completion for each prompt; the teacher scores it; the student learns the
generalized JSD (``beta``: 0 forward KL, 1 reverse KL) to the teacher over the full vocabulary, from
both models' hidden states and heads (`logitless.trl.DistillationTrainer`): no ``(B, T, V)`` tensor of
either model. Without ``--teacher`` the teacher is warm-started here first: the embedded
tiny-qwen2-untied after ``teacher_steps`` of SFT on the multiple-choice answer format
(`logitless.multichoice.warm_start`), saved in OUTPUT_DIR/teacher and reused by a resume.

Before any model is loaded (`prepare_distill`): the prompts are read and checked and the output
directory is claimed (`logitless.rundir`). Checkpoints (``checkpoint-STEP``, each complete or absent)
are written every ``save_every`` steps and at the end; a rerun resumes from the newest complete one to
the weights of the uninterrupted run, and refuses options that would change the result unless
``allow_changed`` names them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from logitless import interrupts
from logitless.checkpoint import CHECKPOINT_STAGING, STEP_CHECKPOINT
from logitless.plots import plot_curve
from logitless.recipes.common import (NONFINITE_ADVICE, RunPlan, check_model_sources, claim_run, curve_line, load_model,
                                      loading_snippet, refuse_other_commands_data, run_recipe)
from logitless.recipes.distill_options import (BUILT_IN_PROMPTS, FIXED_OPTIONS, RESULT_OPTIONS, DistillConfig)
from logitless.rundir import remove_tree, write_json_atomically, write_text_atomically

TEACHER = "teacher"  # the built-in teacher's directory in OUTPUT_DIR
BUILT_IN_TEACHER = "tiny-qwen2-untied"  # what the built-in teacher is warm-started from
OUTPUTS = (STEP_CHECKPOINT, CHECKPOINT_STAGING, TEACHER, f".{TEACHER}.partial", "history.json", "divergence.png",
           "README.md")


@dataclass
class DistillPlan(RunPlan):
    """What `prepare_distill` checked and claimed, before any model is loaded: the prompts too."""

    prompts: list[str] = dataclasses.field(default_factory=list)


def load_prompts(config: DistillConfig) -> list[str]:
    """The prompts, at least one step's worth; errors name ``data`` or ``prompts_per_step``."""
    from logitless.records import read_jsonl
    from logitless.multichoice.data import synthetic_multichoice

    if config.data is None:
        return [record["prompt"] for record in synthetic_multichoice(count=BUILT_IN_PROMPTS, seed=config.seed + 1)]
    refuse_other_commands_data("data", config.data, "distill", "grade")
    prompts = []
    for where, record in read_jsonl(config.data, "data"):
        if not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise ValueError(f"data: {where} has no 'prompt' string, or an empty one")
        prompts.append(record["prompt"])
    if len(prompts) < config.prompts_per_step:
        raise ValueError(f"prompts_per_step: {config.prompts_per_step} exceeds the {len(prompts)} prompts in "
                         f"{config.data}")
    return prompts


def check_vocabularies(config: DistillConfig) -> None:
    """The student and the teacher have one vocabulary (the divergence compares their distributions over it), read
    from both models' configs: errors name the teacher, or the student when the teacher is the built-in one."""
    from logitless.models import model_vocab_size

    def vocabulary(field: str, name: str) -> int:
        try:
            return model_vocab_size(name)
        except (OSError, ValueError) as err:
            raise ValueError(f"{field}: cannot read the vocabulary size from the config of {name!r} "
                             f"({' '.join(str(err).split())[:200]})") from None

    student = vocabulary("model", config.model)
    if config.teacher is not None:
        teacher = vocabulary("teacher", config.teacher)
        if teacher != student:
            raise ValueError(f"teacher: its vocabulary {teacher} differs from the student's {student} "
                             f"({config.model}); the divergence compares both models' distributions over one "
                             "vocabulary")
    elif student != model_vocab_size(BUILT_IN_TEACHER):
        raise ValueError(f"model: its vocabulary {student} differs from the built-in teacher's "
                         f"{model_vocab_size(BUILT_IN_TEACHER)} ({BUILT_IN_TEACHER}); pass a teacher of the "
                         "student's vocabulary with --teacher")


def prepare_distill(config: DistillConfig) -> DistillPlan:
    """Every check that needs no model weights and no PyTorch: options, prompts, both models' sources and
    vocabularies, output directory, resume options. Raises ValueError naming the option at fault; writes only
    ``logitless-run.json`` (and removes this run's earlier outputs when it starts over), and nothing for a run
    that is finished already."""
    prompts = load_prompts(config)
    check_model_sources(config)
    check_vocabularies(config)
    return DistillPlan(**vars(claim_run("distill", config, OUTPUTS, RESULT_OPTIONS, FIXED_OPTIONS)), prompts=prompts)


def teacher_directory(config: DistillConfig, run_dir: Path, progress: bool) -> str:
    """``--teacher``, or the built-in teacher in OUTPUT_DIR/teacher, warm-started now unless a run made it already
    (it appears whole or not at all: written beside it, then renamed)."""
    from logitless.multichoice.warm_start import warm_start_policy

    if config.teacher is not None:
        return config.teacher
    final = run_dir / TEACHER
    if not final.is_dir():
        partial = run_dir / f".{TEACHER}.partial"
        if partial.exists():
            remove_tree(partial)  # a warm start that a crash interrupted
        print(f"logitless distill: warm-starting the teacher ({config.teacher_steps} SFT steps of {BUILT_IN_TEACHER} "
              f"on the multiple-choice answer format) into {final}")
        with interrupts.staged("while warm-starting the built-in teacher",
                               "no step of the run was trained; rerun the same command to warm it up anew and train"):
            warm_start_policy(partial, steps=config.teacher_steps, seed=config.seed, progress=progress,
                              model=BUILT_IN_TEACHER, on_step=interrupts.step_done)
        os.rename(partial, final)
    return str(final)


def train_distill(config: DistillConfig | DistillPlan, *, progress: bool = True) -> dict:
    """Train; returns the per-step history of the divergence, the student's entropy and the learning rate."""
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import DistillationConfig

    from logitless.recipes.trl_runs import train_resumably
    from logitless.trl import DistillationTrainer, NonFiniteGuard

    plan = config if isinstance(config, DistillPlan) else prepare_distill(config)
    config, output_dir = plan.config, plan.run.path
    hf_logging.disable_progress_bar()  # no bars for each checkpoint write and model load
    teacher_dir = teacher_directory(config, output_dir, progress)
    student, tokenizer = load_model("model", config.model, config.seed)
    teacher, _ = load_model("teacher", teacher_dir, config.seed)
    args = DistillationConfig(output_dir=str(output_dir), use_cpu=True, bf16=False, activation_checkpointing=False,
                              per_device_train_batch_size=config.prompts_per_step,
                              max_completion_length=config.max_completion_length, max_steps=config.steps,
                              learning_rate=config.learning_rate, lr_scheduler_type="constant", beta=config.beta,
                              temperature=config.temperature, logging_steps=1, report_to="none",
                              save_strategy="steps", save_steps=config.save_every,
                              save_total_limit=config.save_total_limit, seed=config.seed, disable_tqdm=not progress)
    guard = NonFiniteGuard(config.on_nonfinite, NONFINITE_ADVICE)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": plan.prompts}), processing_class=tokenizer,
                                  callbacks=[guard])

    def write_outputs(log_history: list[dict]) -> dict:
        return write_history(output_dir, config, log_history, guard.skipped)

    train_resumably(trainer, "distill", plan.checkpoint, config.steps, plan.changes, config.learning_rate, progress,
                    write_outputs)
    return write_outputs(trainer.state.log_history)


def divergence_name(beta: float) -> str:
    """What ``beta`` makes of the divergence, in words."""
    if beta == 0:
        return "forward KL(teacher || student)"
    if beta == 1:
        return "reverse KL(student || teacher)"
    return f"generalized JSD (beta {beta})"


def write_history(output_dir: Path, config: DistillConfig, log_history: list[dict], skipped: list[int]) -> dict:
    """history.json, divergence.png and README.md from the Trainer's log; returns the per-step history."""
    logged = [entry for entry in log_history if "loss" in entry]
    history = {name: [entry.get(name, float("nan")) for entry in logged]
               for name in ("loss", "entropy", "learning_rate")}
    history["skipped"] = skipped
    write_json_atomically(output_dir / "history.json", history)
    plot_curve(history["loss"], output_dir / "divergence.png",
               title=f"logitless distill: {divergence_name(config.beta)} to the teacher",
               ylabel="per token, on the student's completions (nats)")
    write_text_atomically(output_dir / "README.md", f"""# logitless distill run

On-policy distillation (TRL's DistillationTrainer, the divergence computed by logitless's fused LM heads) of the
student `{config.model}` from the teacher `{config.teacher or f"{output_dir / TEACHER} (warm-started here)"}`:
{divergence_name(config.beta)} over the full vocabulary, temperature {config.temperature}, learning rate
{config.learning_rate}, {config.prompts_per_step} prompts per step ({config.data or "the built-in prompts"}).

- the divergence per step: history.json (`loss`), divergence.png
- checkpoints: `checkpoint-STEP/` (each complete or absent); rerun the same `logitless distill` command to resume

""" + loading_snippet(output_dir))
    return history


def run_command(config: DistillConfig, args: argparse.Namespace) -> int:
    plan, history = run_recipe("distill", config, args, prepare_distill, train_distill)
    if history is None:
        return 0
    print(curve_line("divergence to the teacher", history["loss"], history, plan.run.path / "divergence.png"))
    return 0
