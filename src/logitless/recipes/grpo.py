"""GRPO on multiple-choice questions with the judge reward (`logitless grpo` and the demo).

The policy trains with `GRPOTrainerWithLogits`; the reward is ``P(correct | model) * (1 -
P(correct | judge))``, the first factor read from the ``completion_logits`` the trainer passes, the
judge a frozen causal LM (by default a copy of the initial policy). Checkpoints are written every
``save_every`` steps under output_dir, and a rerun resumes from the last one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import ProgressCallback

from logitless._checks import check_generations, check_positive, check_positive_ints, dataclass_from_dict
from logitless.models import load_model_and_tokenizer
from logitless.plots import plot_curves


class _QuietProgress(ProgressCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


@dataclass
class MultichoiceGRPOConfig:
    model: str = "tiny-qwen2"  # hub id, local directory, or the embedded default
    judge: str | None = None  # a causal LM to judge chains of thought; None: a frozen copy of the initial policy
    data: str | None = None  # jsonl / saved or hub dataset with question, choices, answer; None: synthetic
    output_dir: str = "runs/grpo"
    steps: int = 4
    completions_per_step: int = 8
    num_generations: int = 4
    max_completion_length: int = 24
    learning_rate: float = 5e-5
    loss_type: str = "dapo"
    temperature: float = 1.0
    save_every: int = 2
    seed: int = 0

    def __post_init__(self):
        check_positive_ints(self, ("steps", "completions_per_step", "num_generations", "max_completion_length",
                                   "save_every"))
        check_generations(self.num_generations, self.completions_per_step)
        for name in ("learning_rate", "temperature"):
            check_positive(name, getattr(self, name))

    @classmethod
    def from_dict(cls, values: dict) -> MultichoiceGRPOConfig:
        return dataclass_from_dict(cls, values)


def _records(config: MultichoiceGRPOConfig) -> list[dict]:
    from logitless.multichoice.data import load_multichoice, synthetic_multichoice

    if config.data:
        return load_multichoice(config.data)
    return synthetic_multichoice(count=config.completions_per_step // config.num_generations * config.steps,
                                 seed=config.seed + 1)


def train_grpo_multichoice(config: MultichoiceGRPOConfig, *, progress: bool = True) -> dict:
    """Train; returns the per-step history of reward, both reward factors, loss and entropy."""
    from transformers.trainer_utils import get_last_checkpoint
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig

    from logitless.multichoice.data import to_trl_dataset
    from logitless.multichoice.reward import MultichoiceJudge, multichoice_judge_reward
    from logitless.trl import GRPOTrainerWithLogits

    hf_logging.disable_progress_bar()  # no bars for each checkpoint write and model load
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    policy, tokenizer = load_model_and_tokenizer(config.model, seed=config.seed)
    judge_model, _ = load_model_and_tokenizer(config.judge or config.model, seed=config.seed)
    judge_model.requires_grad_(False)
    reward = multichoice_judge_reward(MultichoiceJudge(judge_model, tokenizer), tokenizer)
    args = GRPOConfig(output_dir=str(output_dir), use_cpu=True, bf16=False, activation_checkpointing=False,
                      per_device_train_batch_size=config.completions_per_step, num_generations=config.num_generations,
                      max_completion_length=config.max_completion_length, max_steps=config.steps,
                      learning_rate=config.learning_rate, loss_type=config.loss_type, temperature=config.temperature,
                      logging_steps=1, report_to="none", save_strategy="steps", save_steps=config.save_every,
                      seed=config.seed, disable_dropout=True, disable_tqdm=not progress)
    trainer = GRPOTrainerWithLogits(model=policy, reward_funcs=reward, args=args,
                                    train_dataset=to_trl_dataset(_records(config)), processing_class=tokenizer)
    if progress:  # the bar, without a printed dict of every metric at each step (history.json has them)
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(_QuietProgress)
    trainer.train(resume_from_checkpoint=get_last_checkpoint(str(output_dir)))

    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    history = {name: [entry.get(key, float("nan")) for entry in logged]
               for name, key in (("reward", "reward"), ("p_correct_model", "multichoice/p_correct_model"),
                                 ("p_correct_judge", "multichoice/p_correct_judge"), ("loss", "loss"),
                                 ("entropy", "entropy"))}
    (output_dir / "history.json").write_text(json.dumps(history, indent=2))
    plot_curves({k: history[k] for k in ("reward", "p_correct_model", "p_correct_judge")}, output_dir / "reward.png",
                title="GRPO, multiple-choice judge reward", ylabel="per-step mean")
    return history
