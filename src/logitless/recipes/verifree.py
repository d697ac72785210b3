"""`logitless verifree`: VeriFree on multiple-choice or free-form questions, logit-free, crash-safe.

The policy trains with `VeriFreeTrainer`: what each completion wrote after ``answer_start`` ("ANSWER:", where the
prompts ask for the answer) is replaced by ``answer_template`` holding the reference answer (the correct letter, or
the free-form answer), and the policy's own probability of it after the completion's reasoning, R, read in the
training forward, is both the reasoning's reward (against the mean R of the other completions of its question) and
the weight of the answer's likelihood. A completion without "ANSWER:" has R = 0.

As `logitless grpo` does: the options and the questions are checked and the output directory claimed before any
model loads (`prepare_verifree`); checkpoints every ``save_every`` steps, each complete or absent; a rerun resumes
from the newest and refuses options that change the result unless ``allow_changed`` names them; the learning rate is
constant; a NaN or infinite gradient stops the run before that step is applied or saved.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from logitless.plots import plot_curves
from logitless.recipes.common import (NONFINITE_ADVICE, check_model_sources, claim_run, curve_line, load_model,
                                      loading_snippet, plural, run_recipe)
from logitless.recipes.grpo import OUTPUTS, GRPOPlan, load_questions
from logitless.recipes.verifree_options import FIXED_OPTIONS, RESULT_OPTIONS, VeriFreeRunConfig
from logitless.rundir import write_json_atomically, write_text_atomically

REWARD_FORMULA = "pi(reference answer | prompt, reasoning)"
# (history.json's name, the Trainer's metric, the curve's label, drawn)
METRICS = (("reward", "reward", f"reward R = {REWARD_FORMULA}", True),
           ("no_answer", "verifree/no_answer", "completions without the answer marker (R = 0)", True),
           ("cut", "verifree/cut", "completions cut at --max-completion-length (R = 0)", True),
           ("reasoning_loss", "verifree/reasoning_loss", "", False),
           ("answer_loss", "verifree/answer_loss", "", False),
           ("loss", "loss", "", False), ("entropy", "entropy", "", False),
           ("learning_rate", "learning_rate", "", False))


def prepare_verifree(config: VeriFreeRunConfig) -> GRPOPlan:
    """Every check that needs no model: options, questions, output directory, resume options. Raises ValueError
    naming the option at fault; writes only ``logitless-run.json`` (and removes this run's earlier outputs when it
    starts over)."""
    records = load_questions(config, "verifree")
    check_model_sources(config)
    return GRPOPlan(**vars(claim_run("verifree", config, OUTPUTS, RESULT_OPTIONS, FIXED_OPTIONS)), records=records)


def train_verifree(config: VeriFreeRunConfig | GRPOPlan, *, progress: bool = True) -> dict:
    """Train; returns the per-step history of the reward, the fractions without an answer or cut, the loss and its
    two terms, the entropy and the learning rate."""
    from transformers.utils import logging as hf_logging

    from logitless.recipes.trl_runs import multichoice_trainer_options, questions_dataset, train_resumably
    from logitless.trl import VeriFreeConfig, VeriFreeTrainer
    from logitless.trl.nonfinite import NonFiniteGuard

    plan = config if isinstance(config, GRPOPlan) else prepare_verifree(config)
    config, output_dir = plan.config, plan.run.path
    hf_logging.disable_progress_bar()  # no bars for each checkpoint write and model load
    policy, tokenizer = load_model("model", config.model, config.seed)
    args = VeriFreeConfig(**multichoice_trainer_options(config, output_dir, progress), answer_column="answer",
                          answer_start=config.answer_start, answer_template=config.answer_template)
    guard = NonFiniteGuard(config.on_nonfinite, NONFINITE_ADVICE)
    trainer = VeriFreeTrainer(model=policy, args=args, train_dataset=questions_dataset(config, plan.records),
                              processing_class=tokenizer, callbacks=[guard])

    def write_outputs(log_history: list[dict]) -> dict:
        history = write_history(output_dir, log_history, guard.skipped)
        write_run_card(output_dir, config, history)
        return history

    train_resumably(trainer, "verifree", plan.checkpoint, config.steps, plan.changes, config.learning_rate, progress,
                    write_outputs)
    return write_outputs(trainer.state.log_history)


def write_history(output_dir: Path, log_history: list[dict], skipped: list[int]) -> dict:
    """history.json and reward.png from the Trainer's log; returns the per-step history."""
    logged = [entry for entry in log_history if "reward" in entry]
    history = {name: [entry.get(key, float("nan")) for entry in logged] for name, key, _, _ in METRICS}
    history["skipped"] = skipped
    write_json_atomically(output_dir / "history.json", history)
    plot_curves({label: history[name] for name, _, label, drawn in METRICS if drawn}, output_dir / "reward.png",
                title="logitless verifree: the reward and the completions without one", ylabel="per-step mean")
    return history


def write_run_card(output_dir: Path, config: VeriFreeRunConfig, history: dict) -> None:
    """README.md of the run directory: what was trained on what, how the reward went, how to load the result."""
    rewards = history["reward"]
    trend = f"{rewards[0]:.4f} -> {rewards[-1]:.4f} over {plural(len(rewards), 'step')}" if rewards else "no step yet"
    write_text_atomically(output_dir / "README.md", f"""# logitless verifree run

VeriFree (VeriFreeTrainer, on TRL's GRPOTrainer, scored by logitless's fused LM head) of the policy `{config.model}`
on {config.task} questions ({config.questions_named}), learning rate {config.learning_rate},
{config.num_generations} completions per question; what a completion wrote after `{config.answer_start}` replaced by
`{config.answer_template}` with the reference answer.

- reward: R = {REWARD_FORMULA}, the reasoning's reward and the answer's likelihood weight; per step mean {trend}
  (history.json, reward.png)
- checkpoints: `checkpoint-STEP/` (each complete or absent); rerun the same `logitless verifree` command to resume

""" + loading_snippet(output_dir))


def run_command(config: VeriFreeRunConfig, args: argparse.Namespace) -> int:
    plan, history = run_recipe("verifree", config, args, prepare_verifree, train_verifree)
    if history is not None:
        print(curve_line("reward", history["reward"], history, plan.run.path / "reward.png"))
    return 0
