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

The default needs nothing downloaded: the embedded tiny Qwen2 (random weights, the real 151,936-token
vocabulary) learns to write capitalized words (" The", " Paris"): the reward is the fraction of its
generated tokens that are one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

from logitless.checkpoint import last_complete_checkpoint
from logitless.grade import GRPOBaseline, GumbelTrainer, GumbelTrainerMemoryEfficient
from logitless.recipes import interrupts
from logitless.recipes.common import (announce_start, check_model_source, load_model, refuse_other_commands_data,
                                      resume_checkpoint, run_recipe)
from logitless.recipes.grade_options import FIXED_OPTIONS, METHODS, STEERING_OPTIONS, GradeRunConfig
from logitless.rundir import RunDirectory, file_identity, write_text_atomically

# method -> the trainer that runs it (`grade_options.METHODS` has the settings each one fixes)
TRAINERS = {"gumbel": GumbelTrainerMemoryEfficient, "ste": GumbelTrainerMemoryEfficient,
            "gumbel_legacy": GumbelTrainer, "ste_legacy": GumbelTrainer, "grpo": GRPOBaseline}
DEFAULT_PROMPTS = ["Once upon a time", "The weather today is", "My favourite food is", "Yesterday I went to",
                   "The best way to learn is", "In the morning", "A good friend", "The city at night",
                   "When I was young", "The meeting is about", "Dear diary,", "The recipe needs",
                   "Our team will", "The old house", "Scientists found that", "Tomorrow we will"]
EVAL_PROMPTS = ["Last summer we", "The library opens", "My brother said", "On the mountain", "The new teacher",
                "After dinner", "The river was", "Every weekend I"]  # held out: never trained on


def _recorded_options(run: GradeRunConfig) -> dict:
    """Every option by name, as the run directory records and compares them (``straight_through`` is the
    method's, not an option)."""
    options = {**dataclasses.asdict(run), "data": file_identity(run.data)}
    del options["straight_through"]
    return json.loads(json.dumps(options))


def claim_run_directory(run: GradeRunConfig, methods: list[str]) -> dict[str, Path | None]:
    """Claim OUTPUT_DIR, find each method's checkpoint to resume from (None: it starts at step 0) and record
    this run's options (refusing changed ones on a resume): before any model loads."""
    directory = RunDirectory.claim(run.output_dir, "grade", overwrite=run.overwrite,
                                   outputs=(*METHODS, "reward_by_method.png", "val_reward_by_method.png",
                                            "summary.md"))
    with directory.released_on_error():
        checkpoints = {method: resume_checkpoint("grade", directory.path / method, run) for method in methods}
        # another method's results in the directory belong to the same run: it continues (its options are
        # compared) instead of starting over, which would delete them
        others = run.resume and any(last_complete_checkpoint(directory.path / method)[0] is not None
                                    for method in METHODS if method not in methods)
        options = _recorded_options(run)
        directory.start(options, resume=any(checkpoints.values()) or others,
                        result_options=[n for n in options if n not in STEERING_OPTIONS],
                        fixed_options=FIXED_OPTIONS, allow_changed=run.allow_changed)
    return checkpoints


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


def step_prompts(records: list[dict], count: int, seed: int, step: int) -> list[dict]:
    """The prompts of one optimizer step: a function of (seed, step) only, so a resumed run sees the same."""
    rng = random.Random(f"{seed}:{step}")
    return rng.sample(records, count) if count <= len(records) else rng.choices(records, k=count)


def load_prompts(run: GradeRunConfig) -> list[dict]:
    """The training prompts: ``data``, or the built-in ones; errors name ``data``."""
    from logitless.multichoice.data import synthetic_multichoice

    if run.data is not None:
        return _read_prompts(run, "data")
    if run.reward == "judge":
        return synthetic_multichoice(count=64, seed=run.seed)
    return [{"prompt": text} for text in DEFAULT_PROMPTS]


def load_held_out_prompts(run: GradeRunConfig, training: list[dict]) -> list[dict]:
    """The held-out prompts: ``eval_data``; without it, built-in ones none of ``training`` holds ([] when the
    training prompts come from a file: then only ``eval_data`` names them). Errors name ``eval_data``."""
    from logitless.multichoice.data import synthetic_multichoice

    if run.eval_data is not None:
        return _read_prompts(run, "eval_data")
    if run.data is not None:
        return []
    if run.reward == "judge":  # another seed's draw, without the training questions
        trained = {record["question"] for record in training}
        return [record for record in synthetic_multichoice(count=64, seed=run.seed + 1)
                if record["question"] not in trained][:16]
    return [{"prompt": text} for text in EVAL_PROMPTS]


def _read_prompts(run: GradeRunConfig, field: str) -> list[dict]:
    """The records of the file that option ``field`` names: multiple-choice questions for the judge reward,
    else {"prompt": ...} lines."""
    from logitless.data import read_jsonl
    from logitless.multichoice.data import load_multichoice

    path = getattr(run, field)
    refuse_other_commands_data(field, path, "grade", "grpo" if run.reward == "judge" else "grade")
    if run.reward == "judge":
        return load_multichoice(path, name=field)
    records = []
    for where, record in read_jsonl(path, field):
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f"{field}: {where} has no 'prompt' string")
        if not record["prompt"]:  # the policy would start its completion from nothing
            raise ValueError(f"{field}: {where} has an empty 'prompt'")
        records.append(record)
    if not records:
        raise ValueError(f"{field}: {path} holds no prompts")
    return records


def build_reward(run: GradeRunConfig, tokenizer, initial_policy):
    """The reward the run trains on; model-based ones default to a frozen copy of the initial policy."""
    from logitless import grade

    if run.reward == "capitalized":
        return grade.TokenSetReward.capitalized_words(tokenizer)
    if run.reward == "words":
        return grade.TokenSetReward.from_words(tokenizer, run.reward_words)
    if run.reward == "classifier":
        from transformers import AutoModelForSequenceClassification

        return grade.SequenceClassifierReward(AutoModelForSequenceClassification.from_pretrained(run.reward_model))
    model = load_model("reward_model", run.reward_model, 0)[0] if run.reward_model else copy.deepcopy(initial_policy)
    if run.reward == "token":
        return grade.TokenLogProbReward(model, tokenizer, token=run.reward_token, suffix=run.reward_suffix)
    from logitless.multichoice.reward import MultichoiceJudge

    return grade.MultichoiceJudgeReward(MultichoiceJudge(model, tokenizer))


@dataclass
class GradePlan:
    """What `prepare_grade` checked and claimed, before any model is loaded."""

    config: GradeRunConfig
    records: list[dict]  # training prompts
    eval_records: list[dict]  # held-out prompts ([]: no evaluation)
    checkpoints: dict[str, Path | None]  # each method's checkpoint to resume from


def run_method(plan: GradePlan, method: str, *, progress: bool = True) -> list[dict]:
    """Train one method for ``steps`` optimizer steps, from its checkpoint in ``plan`` if any; returns the
    metric rows (the trainer's, and ``val/reward_mean``: the held-out score at evaluation steps, else None)."""
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from logitless.checkpoint import load_checkpoint_state, save_checkpoint
    from logitless.grade.lora import load_adapter

    hf_logging.disable_progress_bar()
    run = plan.config
    directory, checkpoint = Path(run.output_dir) / method, plan.checkpoints[method]
    reference, tokenizer = load_model("model", run.model, run.seed)
    lora = run.lora_rank > 0  # a LoRA checkpoint holds the adapters only: loaded after wrapping
    policy = (load_model("model", str(checkpoint), run.seed)[0] if checkpoint is not None and not lora
              else copy.deepcopy(reference))
    trainer = TRAINERS[method](policy, build_reward(run, tokenizer, reference), run.trainer_config(method),
                            tokenizer=tokenizer, reference=reference)
    history: list[dict] = []
    if checkpoint is not None:
        state = load_checkpoint_state(checkpoint, trainer.optimizer)
        for group in trainer.optimizer.param_groups:  # the value now in force (equal, or a change that was allowed)
            group["lr"] = run.learning_rate
        trainer.step, history = state["step"], state["history"]
        if lora:
            load_adapter(trainer.model, checkpoint)
    directory.mkdir(parents=True, exist_ok=True)
    metrics_path = directory / "metrics.jsonl"  # rows past the checkpoint (from a crashed run) are dropped
    write_text_atomically(metrics_path, "".join(json.dumps(row) + "\n" for row in history))
    per_step = run.batch_size * run.gradient_accumulation_steps
    reward_name = getattr(trainer.reward, "description", run.reward)
    announce_start("grade", checkpoint, run.steps)
    interrupts.track(f"logitless grade ({method})", directory, trainer.step, run.steps)
    bar = tqdm(range(trainer.step, run.steps), initial=trainer.step, total=run.steps, desc=f"grade {method}",
               unit="step", disable=not progress)
    with metrics_path.open("a") as metrics_file:
        for step in bar:
            row = trainer.train_step(step_prompts(plan.records, per_step, run.seed, step))
            evaluated = plan.eval_records and run.eval_every and (
                trainer.step % run.eval_every == 0 or trainer.step == run.steps)
            row[VALIDATION] = trainer.evaluate(plan.eval_records, seed=run.seed) if evaluated else None
            history.append(row)
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row['kl']:.3f}")
            if trainer.step % run.save_every == 0 or trainer.step == run.steps:
                save_checkpoint(directory, trainer.step, trainer.model, tokenizer, trainer.optimizer,
                                {"step": trainer.step, "history": history}, keep=run.save_total_limit)
                _plot_method(directory, method, reward_name, history)
            interrupts.step_done(trainer.step)
    bar.close()
    _plot_method(directory, method, reward_name, history)
    return history


VALIDATION = "val/reward_mean"  # the metrics rows' held-out score (None at steps without an evaluation)


def validation_curve(history: list[dict]) -> dict[int, float]:
    """step -> held-out score, at the steps that were evaluated."""
    return {row["step"]: row[VALIDATION] for row in history if row.get(VALIDATION) is not None}


def _plot_method(directory: Path, method: str, reward: str, history: list[dict]) -> None:
    from logitless.plots import plot_curve, plot_curves

    curves = {"train (the rollouts trained on)": [row["reward"] for row in history]}
    if validation_curve(history):
        curves["held-out (sampled completions)"] = validation_curve(history)
    plot_curves(curves, directory / "reward.png", title=f"{method}: reward ({reward})", ylabel="mean reward")
    plot_curve([row["kl"] for row in history], directory / "kl.png", title=f"{method}: KL(policy || reference)",
               ylabel="KL per rollout (nats)")


def prepare_grade(run: GradeRunConfig) -> GradePlan:
    """Every check of every method that needs no model weights, and the run directory claimed. Raises
    ValueError naming the option at fault."""
    records = load_prompts(run)
    eval_records = load_held_out_prompts(run, records)
    check_model_source("model", run.model)
    if run.reward_model is not None:
        check_model_source("reward_model", run.reward_model)
    check_methods(run, run.methods)
    return GradePlan(run, records, eval_records, claim_run_directory(run, run.methods))


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
