"""`logitless grade`: GRADE (or the GRPO baseline) on prompts with a differentiable reward.

Each method writes into OUTPUT_DIR/METHOD/: ``metrics.jsonl`` (one row per optimizer step, the names of
`logitless.grade.METRIC_NAMES`), ``reward.png`` and ``kl.png`` (at every checkpoint), and
``checkpoint-STEP/`` (written every ``save_every`` steps and at the end; complete or absent whatever the
moment of a crash). Every option of every method is checked, and OUTPUT_DIR is claimed as a run
directory (`logitless.rundir`), before any model loads. A rerun with the same output dir
resumes each method from its checkpoint and ends with the weights an uninterrupted run would have; a
resume with options that change the result is refused unless ``allow_changed`` names them, or
``--no-resume`` starts over. A NaN or infinite loss or gradient stops the run before that step is
applied or saved (``on_nonfinite``). ``--method all`` runs the five methods one after another and adds
OUTPUT_DIR/reward_by_method.png.

This module prepares a run (every check, the run directory claimed) and runs its methods one after another;
the prompts are `grade_prompts`', one method's run (load, resume, train, evaluate, save, plot) `grade_method`'s.

The default needs nothing downloaded: the embedded tiny Qwen2 (random weights, the real 151,936-token
vocabulary) learns to write capitalized words (" The", " Paris"): the reward is the fraction of its
generated tokens that are one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from logitless.checkpoint import checkpoint_step, last_complete_checkpoint
from logitless.recipes.common import check_model_source, nothing_left, resume_checkpoint, run_recipe
from logitless.recipes.grade_method import GradePlan, run_method, validation_curve
from logitless.recipes.grade_options import FIXED_OPTIONS, METHODS, STEERING_OPTIONS, GradeRunConfig
from logitless.recipes.grade_prompts import load_held_out_prompts, load_prompts
from logitless.rundir import RunDirectory, file_identity, write_text_atomically


def _recorded_options(run: GradeRunConfig) -> dict:
    """Every option by name, as the run directory records and compares them (``straight_through`` is the
    method's, not an option)."""
    options = {**dataclasses.asdict(run), "data": file_identity(run.data)}
    del options["straight_through"]
    return json.loads(json.dumps(options))


def claim_run_directory(run: GradeRunConfig, methods: list[str]) -> tuple[dict[str, Path | None], str | None]:
    """Claim OUTPUT_DIR, find each method's checkpoint to resume from (None: it starts at step 0) and record
    this run's options (refusing changed ones on a resume): before any model loads. Returns the checkpoints, and
    for a run whose every method is at its last step already, the line to say instead (nothing is written then)."""
    directory = RunDirectory.claim(run.output_dir, "grade", overwrite=run.overwrite,
                                   outputs=(*METHODS, "reward_by_method.png", "val_reward_by_method.png",
                                            "summary.md"))
    with directory.released_on_error():
        checkpoints = {method: resume_checkpoint("grade", directory.path / method, run) for method in methods}
        options = _recorded_options(run)
        result_options = [n for n in options if n not in STEERING_OPTIONS]
        if all(checkpoint is not None and checkpoint_step(checkpoint) == run.steps
               for checkpoint in checkpoints.values()):
            directory.resume_changes(options, result_options=result_options, fixed_options=FIXED_OPTIONS,
                                     allow_changed=run.allow_changed)
            return checkpoints, nothing_left("grade", directory.path, run.steps)
        # another method's results in the directory belong to the same run: it continues (its options are
        # compared) instead of starting over, which would delete them
        others = run.resume and any(last_complete_checkpoint(directory.path / method)[0] is not None
                                    for method in METHODS if method not in methods)
        directory.start(options, resume=any(checkpoints.values()) or others, result_options=result_options,
                        fixed_options=FIXED_OPTIONS, allow_changed=run.allow_changed)
    return checkpoints, None


def check_methods(run: GradeRunConfig, methods: list[str]) -> None:
    """The checks of every method's options that need the model's tokenizer or config, not its weights."""
    from logitless.grade.rewards import single_token_ids
    from logitless.models import load_tokenizer, model_vocab_size
    from logitless.ops.gumbel import check_topk

    if "grpo" in methods:
        run.check_grpo_group()
    if {"gumbel", "ste"} & set(methods):
        check_topk(run.gumbel_topk, model_vocab_size(run.model), "gumbel_topk")
    if run.reward in ("words", "token"):
        tokenizer = load_tokenizer(run.model)
        if run.reward == "words":
            single_token_ids(tokenizer, run.reward_words, "reward_words")
        else:
            single_token_ids(tokenizer, [run.reward_token], "reward_token")


def prepare_grade(run: GradeRunConfig) -> GradePlan:
    """Every check of every method that needs no model weights, and the run directory claimed. Raises
    ValueError naming the option at fault."""
    records = load_prompts(run)
    eval_records = load_held_out_prompts(run, records)
    check_model_source("model", run.model)
    if run.reward_model is not None:
        check_model_source("reward_model", run.reward_model)
    check_methods(run, run.methods)
    return GradePlan(run, records, eval_records, *claim_run_directory(run, run.methods))


def train_grade(config: GradeRunConfig | GradePlan, *, progress: bool = True) -> dict[str, list[dict]]:
    """Train ``method`` (every method in turn for "all"); returns each method's metric rows. With several,
    the plots of every method's reward (and held-out score) side by side in OUTPUT_DIR."""
    from logitless.plots import plot_curves

    plan = config if isinstance(config, GradePlan) else prepare_grade(config)
    run = plan.config
    histories = {method: run_method(plan, method, progress=progress) for method in run.methods}
    if len(histories) > 1:
        plot_curves({m: [row["reward"] for row in h] for m, h in histories.items()},
                    Path(run.output_dir) / "reward_by_method.png",
                    title="reward per step (gumbel, gumbel_legacy: of the soft samples)", ylabel="mean reward")
        if plan.eval_records and run.eval_every:
            plot_curves({m: validation_curve(h) for m, h in histories.items()},
                        Path(run.output_dir) / "val_reward_by_method.png",
                        title="held-out reward (sampled completions)", ylabel="val/reward_mean")
    return histories


def run_command(config: GradeRunConfig, args: argparse.Namespace) -> int:
    plan, histories = run_recipe("grade", config, args, prepare_grade, train_grade)
    if histories is None:
        return 0
    output_dir, several = Path(plan.config.output_dir), len(histories) > 1
    table = summary_table(histories)
    write_text_atomically(output_dir / "summary.md", table + "\n")
    print(f"{table}\nsummary: {output_dir / 'summary.md'}")
    print(f"{output_dir / (plan.config.method if not several else 'METHOD')}/: metrics.jsonl, reward.png, kl.png"
          + (f"; every method: {output_dir}/reward_by_method.png" if several else "")
          + (", val_reward_by_method.png" if several and plan.eval_records and plan.config.eval_every else ""))
    return 0


def summary_table(histories: dict[str, list[dict]]) -> str:
    """One markdown row per method: the training reward (first -> last quarter of the steps) and the held-out
    score (first -> last evaluation)."""
    lines = ["| method | train reward, first -> last quarter | held-out reward, first -> last evaluation | "
             "steps | skipped |", "|---|---|---|---|---|"]
    for method, history in histories.items():
        rewards = [row["reward"] for row in history]
        quarter = max(1, len(rewards) // 4)
        validation = validation_curve(history)
        held_out = (f"{validation[min(validation)]:.4f} (step {min(validation)}) -> "
                    f"{validation[max(validation)]:.4f} (step {max(validation)})" if validation else "not evaluated")
        lines.append(f"| {method} | {sum(rewards[:quarter]) / quarter:.4f} -> {sum(rewards[-quarter:]) / quarter:.4f} "
                     f"| {held_out} | {len(rewards)} | {sum(bool(row['skipped']) for row in history)} |")
    return "\n".join(lines)
