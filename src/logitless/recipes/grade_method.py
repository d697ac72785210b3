"""One method of `logitless grade`, each job its function: load the models and build the method's trainer
(`build_trainer`), resume it from its checkpoint (`resume_trainer`), train it step by step with the held-out
score at evaluation steps (`train_steps`), and save a checkpoint with its plots (`save_method`). `run_method`
runs them in that order.

Each method writes into OUTPUT_DIR/METHOD/: ``metrics.jsonl`` (one row per optimizer step), ``reward.png`` and
``kl.png`` (at every checkpoint), and ``checkpoint-STEP/``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from logitless import interrupts
from logitless.recipes.common import announce_start, load_model
from logitless.recipes.grade_options import GradeRunConfig
from logitless.recipes.grade_prompts import step_prompts
from logitless.rundir import write_text_atomically

# method -> the `logitless.grade` trainer that runs it (`grade_options.METHODS` has the settings each one fixes)
TRAINERS = {"gumbel": "GumbelTrainerMemoryEfficient", "ste": "GumbelTrainerMemoryEfficient",
            "gumbel_legacy": "GumbelTrainer", "ste_legacy": "GumbelTrainer", "grpo": "GRPOBaseline"}
VALIDATION = "val/reward_mean"  # the metrics rows' held-out score (None at steps without an evaluation)


@dataclass
class GradePlan:
    """What `prepare_grade` checked and claimed, before any model is loaded."""

    config: GradeRunConfig
    records: list[dict]  # training prompts
    eval_records: list[dict]  # held-out prompts ([]: no evaluation)
    checkpoints: dict[str, Path | None]  # each method's checkpoint to resume from
    finished: str | None = None  # every method is at its last step already: what to say instead of loading anything


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
    from logitless.multichoice.judge import MultichoiceJudge

    return grade.MultichoiceJudgeReward(MultichoiceJudge(model, tokenizer))


def build_trainer(plan: GradePlan, method: str):
    """Load the models and build ``method``'s trainer: (trainer, tokenizer). The policy starts from the method's
    checkpoint (a full one; a LoRA one holds the adapters only, loaded by `resume_trainer`), else from the model."""
    from logitless import grade

    run, checkpoint = plan.config, plan.checkpoints[method]
    reference, tokenizer = load_model("model", run.model, run.seed)
    full_checkpoint = checkpoint is not None and run.lora_rank == 0
    policy = load_model("model", str(checkpoint), run.seed)[0] if full_checkpoint else copy.deepcopy(reference)
    trainer = getattr(grade, TRAINERS[method])(policy, build_reward(run, tokenizer, reference),
                                               run.trainer_config(method), tokenizer=tokenizer, reference=reference)
    return trainer, tokenizer


def resume_trainer(trainer, plan: GradePlan, method: str) -> list[dict]:
    """The trainer's optimizer state, step and LoRA adapters from the method's checkpoint; returns the metric rows
    up to it ([] without one)."""
    from logitless.checkpoint import load_checkpoint_state
    from logitless.grade.lora import load_adapter

    run, checkpoint = plan.config, plan.checkpoints[method]
    if checkpoint is None:
        return []
    state = load_checkpoint_state(checkpoint, trainer.optimizer)
    for group in trainer.optimizer.param_groups:  # the value now in force (equal, or a change that was allowed)
        group["lr"] = run.learning_rate
    trainer.step = state["step"]
    if run.lora_rank > 0:
        load_adapter(trainer.model, checkpoint)
    return state["history"]


def train_step(trainer, plan: GradePlan) -> dict:
    """One optimizer step on the step's prompts; its metric row, with the held-out score at evaluation steps."""
    run = plan.config
    row = trainer.train_step(step_prompts(plan.records, run.batch_size * run.gradient_accumulation_steps, run.seed,
                                          trainer.step))
    evaluated = plan.eval_records and run.eval_every and (trainer.step % run.eval_every == 0
                                                          or trainer.step == run.steps)
    row[VALIDATION] = trainer.evaluate(plan.eval_records, seed=run.seed) if evaluated else None
    return row


def save_method(directory: Path, method: str, trainer, tokenizer, history: list[dict], run: GradeRunConfig) -> None:
    """A ``checkpoint-STEP`` of the trainer (weights, optimizer, the metric rows), and the method's plots."""
    from logitless.checkpoint import save_checkpoint

    save_checkpoint(directory, trainer.step, trainer.model, tokenizer, trainer.optimizer,
                    {"step": trainer.step, "history": history}, keep=run.save_total_limit)
    plot_method(directory, method, getattr(trainer.reward, "description", run.reward), history)


def train_steps(trainer, tokenizer, plan: GradePlan, method: str, history: list[dict], *, progress: bool) -> None:
    """Train up to ``steps``: each step's row appended to ``history`` and to metrics.jsonl (which first holds the
    rows up to the checkpoint: rows past it, from a crashed run, are dropped), a checkpoint every ``save_every``
    steps and at the end."""
    from tqdm.auto import tqdm

    run = plan.config
    directory = Path(run.output_dir) / method
    directory.mkdir(parents=True, exist_ok=True)
    metrics_path = directory / "metrics.jsonl"
    write_text_atomically(metrics_path, "".join(json.dumps(row) + "\n" for row in history))
    interrupts.track(f"logitless grade ({method})", directory, trainer.step, run.steps)
    bar = tqdm(range(trainer.step, run.steps), initial=trainer.step, total=run.steps, desc=f"grade {method}",
               unit="step", disable=not progress)
    with metrics_path.open("a") as metrics_file:
        for _ in bar:
            row = train_step(trainer, plan)
            history.append(row)
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row['kl']:.3f}")
            if trainer.step % run.save_every == 0 or trainer.step == run.steps:
                save_method(directory, method, trainer, tokenizer, history, run)
            interrupts.step_done(trainer.step)
    bar.close()


def run_method(plan: GradePlan, method: str, *, progress: bool = True) -> list[dict]:
    """Train one method for ``steps`` optimizer steps, from its checkpoint in ``plan`` if any; returns the
    metric rows (the trainer's, and ``val/reward_mean``: the held-out score at evaluation steps, else None)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    trainer, tokenizer = build_trainer(plan, method)
    history = resume_trainer(trainer, plan, method)
    announce_start("grade", plan.checkpoints[method])
    train_steps(trainer, tokenizer, plan, method, history, progress=progress)
    run = plan.config
    plot_method(Path(run.output_dir) / method, method, getattr(trainer.reward, "description", run.reward), history)
    return history


def validation_curve(history: list[dict]) -> dict[int, float]:
    """step -> held-out score, at the steps that were evaluated."""
    return {row["step"]: row[VALIDATION] for row in history if row.get(VALIDATION) is not None}


def plot_method(directory: Path, method: str, reward: str, history: list[dict]) -> None:
    """The method's reward.png (training and held-out) and kl.png."""
    from logitless.plots import plot_curve, plot_curves

    curves = {"train (the rollouts trained on)": [row["reward"] for row in history]}
    if validation_curve(history):
        curves["held-out (sampled completions)"] = validation_curve(history)
    plot_curves(curves, directory / "reward.png", title=f"{method}: reward ({reward})", ylabel="mean reward")
    plot_curve([row["kl"] for row in history], directory / "kl.png", title=f"{method}: KL(policy || reference)",
               ylabel="KL per rollout (nats)")
