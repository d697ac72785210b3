"""`logitless grpo`: GRPO on multiple-choice or free-form questions, logit-free, crash-safe.

The policy trains with `GRPOTrainerWithLogits`. The reward (``reward``) is the judge reward, ``P(correct | model) *
(1 - P(correct | judge))``, the first factor read from the ``completion_logits`` the trainer passes, the judge a
frozen causal LM (by default a copy of the initial policy); or RLPR's verifier-free reward,
`reference_probability_reward` of the reference answer (the correct letter; a word or number with ``task``
"free-form"), which replaces what the completion wrote after "ANSWER:".
``reward_std_filter`` adds RLPR's filter of the groups whose rewards hardly vary (`RewardStdFilter`).

Before any model is loaded (`prepare_grpo`): the options and the questions are checked and the
output directory is claimed (`logitless.rundir`). Checkpoints (``checkpoint-STEP``, each complete or
absent) are written every ``save_every`` steps; a rerun resumes from the newest complete one and
refuses options that would change the result unless ``allow_changed`` names them. The learning rate
is constant, so a rerun with more ``steps`` continues the same curve. A NaN or infinite gradient
stops the run before that step is applied or saved (``on_nonfinite="skip"`` skips the step).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from logitless.checkpoint import CHECKPOINT_STAGING, STEP_CHECKPOINT
from logitless.plots import plot_curves
from logitless.recipes.common import (NONFINITE_ADVICE, RunPlan, check_model_sources, claim_run, curve_line,
                                      hub_reachable, load_model, loading_snippet, plural, refuse_other_commands_data,
                                      run_recipe)
from logitless.recipes.grpo_options import (FIXED_OPTIONS, RESULT_OPTIONS, SYNTHETIC_QUESTIONS,
                                            MultichoiceGRPOConfig, MultichoiceRunConfig)
from logitless.rundir import write_json_atomically, write_text_atomically

WARM_UP_HINT = ("GRPO learns only from reward differences within a group. The reward reads the answer after "
                "'ANSWER:', so the policy must first write that format: warm it up with `logitless sft` on "
                "(prompt, ' ANSWER: <answer>') pairs, as `logitless demo` does (docs/runs.md, 'GRPO that can learn')")


OUTPUTS = (STEP_CHECKPOINT, CHECKPOINT_STAGING, "history.json", "reward.png", "README.md")


@dataclass
class GRPOPlan(RunPlan):
    """What `prepare_grpo` checked and claimed, before any model is loaded: the questions too."""

    records: list[dict] = dataclasses.field(default_factory=list)


def load_questions(config: MultichoiceRunConfig, command: str = "grpo") -> list[dict]:
    """The questions of ``logitless COMMAND`` for ``config.task``, at least one step's worth; errors name ``data``."""
    from logitless.free_form.data import load_free_form
    from logitless.multichoice.data import load_multichoice, synthetic_multichoice
    from logitless.records import names_a_file

    load = load_free_form if config.task == "free-form" else load_multichoice
    if config.data is None:
        return (load_free_form(name="data") if config.task == "free-form"
                else synthetic_multichoice(count=SYNTHETIC_QUESTIONS, seed=config.seed + 1))
    refuse_other_commands_data("data", config.data, command, "grpo")
    if Path(config.data).expanduser().exists() or names_a_file(config.data) or hub_reachable():
        records = load(config.data, name="data")
    else:  # only the local cache can hold it: look there alone, not through a minute of retries
        import datasets

        offline, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, True
        try:
            records = load(config.data, name="data")
        except ValueError as err:
            raise ValueError(f"{err}; the hub is unreachable (offline) and the local cache holds no copy of "
                             "it") from None
        finally:
            datasets.config.HF_HUB_OFFLINE = offline
    if len(records) < config.prompts_per_step:
        raise ValueError(f"data: {config.data} holds {len(records)} question(s); one step needs "
                         f"completions_per_step / num_generations = {config.prompts_per_step}")
    return records


def prepare_grpo(config: MultichoiceGRPOConfig) -> GRPOPlan:
    """Every check that needs no model: options, questions, output directory, resume options. Raises
    ValueError naming the option at fault; writes only ``logitless-run.json`` (and removes this run's
    earlier outputs when it starts over)."""
    records = load_questions(config)
    check_model_sources(config)
    return GRPOPlan(**vars(claim_run("grpo", config, OUTPUTS, RESULT_OPTIONS, FIXED_OPTIONS)), records=records)


def train_grpo_multichoice(config: MultichoiceGRPOConfig | GRPOPlan, *, progress: bool = True) -> dict:
    """Train; returns the per-step history of reward, both reward factors, loss, entropy and learning rate."""
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig

    from logitless.recipes.trl_runs import (EqualRewardsWarning, multichoice_trainer_options, questions_dataset,
                                            train_resumably)
    from logitless.trl import GRPOTrainerWithLogits, RewardStdFilter
    from logitless.trl.nonfinite import NonFiniteGuard

    plan = config if isinstance(config, GRPOPlan) else prepare_grpo(config)
    config, output_dir = plan.config, plan.run.path
    hf_logging.disable_progress_bar()  # no bars for each checkpoint write and model load
    policy, tokenizer = load_model("model", config.model, config.seed)
    reward = make_reward(config, policy, tokenizer)
    args = GRPOConfig(**multichoice_trainer_options(config, output_dir, progress), loss_type=config.loss_type)
    guard = NonFiniteGuard(config.on_nonfinite, NONFINITE_ADVICE)
    trainer = GRPOTrainerWithLogits(model=policy, reward_funcs=reward, args=args,
                                    train_dataset=questions_dataset(config, plan.records), processing_class=tokenizer,
                                    callbacks=[guard, EqualRewardsWarning("grpo", config.steps, WARM_UP_HINT)],
                                    reward_std_filter=RewardStdFilter() if config.reward_std_filter else None)

    def write_outputs(log_history: list[dict]) -> dict:
        history = write_history(output_dir, config, log_history, guard.skipped)
        write_run_card(output_dir, config, history)
        return history

    train_resumably(trainer, "grpo", plan.checkpoint, config.steps, plan.changes, config.learning_rate, progress,
                    write_outputs)
    return write_outputs(trainer.state.log_history)


REWARD_FORMULAS = {"judge": "P(correct | model) x (1 - P(correct | judge))",
                   "reference-probability": "clip(P(answer | reasoning) - P(answer | prompt), 0, 1)"}


def make_reward(config: MultichoiceGRPOConfig, policy, tokenizer):
    """The reward function ``config.reward`` names, for TRL; the judge reward loads its judge (frozen)."""
    if config.reward == "reference-probability":  # the answer the prompt asks for after "ANSWER:", ending the line
        from logitless.trl import reference_probability_reward

        return reference_probability_reward(policy, tokenizer, answer_column="answer", answer_start="ANSWER:",
                                            answer_end="\n", temperature=config.temperature)
    from logitless.multichoice.judge import MultichoiceJudge
    from logitless.multichoice.reward import multichoice_judge_reward

    judge_model, _ = load_model("judge", config.judge, config.seed) if config.judge else load_model(
        "model", config.model, config.seed)
    judge_model.requires_grad_(False)
    return multichoice_judge_reward(MultichoiceJudge(judge_model, tokenizer), tokenizer)


def logged_metrics(config: MultichoiceGRPOConfig) -> tuple[tuple[str, str, str], ...]:
    """(history.json's name, the Trainer's metric, the curve's label) of what the reward and the filter log."""
    if config.reward == "judge":
        metrics = (("p_correct_model", "multichoice/p_correct_model", "P(correct | model)"),
                   ("p_correct_judge", "multichoice/p_correct_judge",
                    "P(correct | judge), of the policy's chain of thought"))
    else:
        from logitless.trl.reference_probability import (NO_ANSWER_METRIC, WITH_REASONING_METRIC,
                                                         WITHOUT_REASONING_METRIC)

        metrics = (("no_answer", NO_ANSWER_METRIC, "completions with no answer after 'ANSWER:' (reward 0)"),
                   ("p_reference_with_reasoning", WITH_REASONING_METRIC, "P(reference answer | reasoning)"),
                   ("p_reference_without_reasoning", WITHOUT_REASONING_METRIC, "P(reference answer | prompt)"))
    if config.reward_std_filter:
        from logitless.trl.std_filter import DROPPED_METRIC, THRESHOLD_METRIC

        metrics += (("std_filter_dropped", DROPPED_METRIC, "questions dropped by the std filter"),
                    ("std_filter_threshold", THRESHOLD_METRIC, "the std filter's threshold"))
    return metrics


def write_history(output_dir: Path, config: MultichoiceGRPOConfig, log_history: list[dict],
                  skipped: list[int]) -> dict:
    """history.json and reward.png from the Trainer's log; returns the per-step history."""
    logged = [entry for entry in log_history if "reward" in entry]
    metrics = logged_metrics(config)
    history = {name: [entry.get(key, float("nan")) for entry in logged]
               for name, key in (("reward", "reward"), *((name, key) for name, key, _ in metrics), ("loss", "loss"),
                                 ("entropy", "entropy"), ("learning_rate", "learning_rate"),
                                 ("frac_reward_zero_std", "frac_reward_zero_std"))}
    history["skipped"] = skipped
    write_json_atomically(output_dir / "history.json", history)
    curves = {f"reward = {REWARD_FORMULAS[config.reward]}": history["reward"],
              **{label: history[name] for name, _, label in metrics}}
    plot_curves(curves, output_dir / "reward.png", title=f"logitless grpo: the {config.reward} reward",
                ylabel="per-step mean")
    return history


def stalled_steps(history: dict) -> int:
    """Steps with nothing to learn from: every completion of each group got the same reward (zero included)."""
    return sum(1 for zero_std in history["frac_reward_zero_std"] if zero_std == 1.0)


def write_run_card(output_dir: Path, config: MultichoiceGRPOConfig, history: dict) -> None:
    """README.md of the run directory: what was trained on what, how the reward went, how to load the result
    (in place of the hub model card TRL writes, which names no base model for a local or embedded one)."""
    rewards = history["reward"]
    trend = f"{rewards[0]:.4f} -> {rewards[-1]:.4f} over {plural(len(rewards), 'step')}" if rewards else "no step yet"
    reward_line = (f"{REWARD_FORMULAS['judge']}, the judge `{config.judge or 'a frozen copy of the initial policy'}`"
                   if config.reward == "judge" else f"RLPR's, {REWARD_FORMULAS[config.reward]}")
    if config.reward_std_filter:
        reward_line += ", with RLPR's filter of the questions whose rewards hardly vary"
    write_text_atomically(output_dir / "README.md", f"""# logitless grpo run

GRPO (TRL's GRPOTrainer, scored by logitless's fused LM head) of the policy `{config.model}` on {config.task}
questions ({config.questions_named}), loss type `{config.loss_type}`,
learning rate {config.learning_rate}, {config.num_generations} completions per question.

- reward: {reward_line}; per step mean {trend} (history.json, reward.png)
- checkpoints: `checkpoint-STEP/` (each complete or absent); rerun the same `logitless grpo` command to resume

""" + loading_snippet(output_dir))


def run_command(config: MultichoiceGRPOConfig, args: argparse.Namespace) -> int:
    plan, history = run_recipe("grpo", config, args, prepare_grpo, train_grpo_multichoice)
    if history is None:
        return 0
    rewards = history["reward"]
    print(curve_line("reward", rewards, history, plan.run.path / "reward.png"))
    stalled = stalled_steps(history)
    if stalled > len(rewards) / 2:
        print(f"logitless grpo: warning: in {stalled} of {plural(len(rewards), 'step')}, every completion of each "
              f"group got the same reward (reward {rewards[0]:.4f} -> {rewards[-1]:.4f}), so those steps had nothing "
              "to learn from. " + WARM_UP_HINT, file=sys.stderr)
    return 0
