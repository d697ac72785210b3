"""RLPR's standard-deviation filter: prompts whose group of rewards varies less than a moving threshold leave the loss.

A group whose completions all score about the same teaches GRPO little and, with a noisy reward such as
`reference_probability_reward`'s, mostly noise. For each generation batch, each prompt's group std (the unbiased std
of its completions' weighted, summed rewards, as TRL's advantages use it) is compared with ``beta`` times an
exponential moving average of the batches' mean group std; a group below it, or whose std is not a number, is
dropped. As in the paper's code: the first ``skip_batches`` batches are not counted, the next ``warmup_batches``
initialize the average with their mean (nothing is dropped before it exists), and every later batch, after its
groups are judged, moves it: ``ema = decay * ema + (1 - decay) * batch mean``.

`RewardStdFiltering` makes it an option of `GRPOTrainerWithLogits` (``reward_std_filter=RewardStdFilter()``): a
dropped group's completions leave the loss as TRL's ``mask_truncated_completions`` drops a completion (their
completion mask zeroed, the token count the loss divides by recounted). The paper's trainer generates more prompts
in their place; here the batch is smaller. The threshold and the fraction dropped are logged as
"logitless/std_filter/threshold" and "logitless/std_filter/dropped"; the filter's state is kept in checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.trainer.utils import nanstd

from logitless._checks import check_finite_number, check_nonnegative_int, check_positive_int

STATE_FILE = "logitless-std-filter.json"
THRESHOLD_METRIC = "logitless/std_filter/threshold"
DROPPED_METRIC = "logitless/std_filter/dropped"


@dataclasses.dataclass
class RewardStdFilter:
    """The threshold's settings (the paper's: ``beta`` 0.5, ``decay`` 0.99, 5 batches skipped, 5 of warm-up) and its
    state; `keep` judges one batch's groups."""

    beta: float = 0.5
    decay: float = 0.99
    skip_batches: int = 5
    warmup_batches: int = 5
    batches: int = 0  # batches judged so far
    warmup_means: list[float] = dataclasses.field(default_factory=list)
    ema: float | None = None  # the moving average of the batches' mean group std, once warmed up

    def __post_init__(self):
        check_finite_number("beta", self.beta, allow_zero=True)
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0 <= self.decay < 1:
            raise ValueError(f"decay: expected a number in [0, 1), got {self.decay!r}")
        check_nonnegative_int("skip_batches", self.skip_batches)
        check_positive_int("warmup_batches", self.warmup_batches)

    @property
    def threshold(self) -> float | None:
        """The std a group needs to stay (None: nothing is dropped yet)."""
        return None if self.ema is None else self.beta * self.ema

    def keep(self, group_stds: torch.Tensor) -> torch.Tensor:
        """(G,) group stds -> (G,) bool: the groups that stay; then this batch counts towards the average."""
        if group_stds.ndim != 1:
            raise ValueError(f"group_stds: expected one std per group (1 dimension), got shape "
                             f"{tuple(group_stds.shape)}")
        threshold = self.threshold
        kept = (torch.ones_like(group_stds, dtype=torch.bool) if threshold is None
                else group_stds >= threshold)  # NaN >= t is False: a group without a std is dropped
        self.batches += 1
        finite = group_stds[torch.isfinite(group_stds)]
        if self.batches > self.skip_batches and finite.numel():
            batch_mean = finite.double().mean().item()
            if self.ema is not None:
                self.ema = self.decay * self.ema + (1 - self.decay) * batch_mean
            else:
                self.warmup_means.append(batch_mean)
                if len(self.warmup_means) == self.warmup_batches:
                    self.ema = math.fsum(self.warmup_means) / self.warmup_batches
        return kept


class RewardStdFiltering:
    """Mixin for `trl.GRPOTrainer`: the ``reward_std_filter`` option (see the module docstring)."""

    def __init__(self, *args, reward_std_filter: RewardStdFilter | None = None, **kwargs):
        if reward_std_filter is not None and not isinstance(reward_std_filter, RewardStdFilter):
            raise TypeError(f"reward_std_filter: expected a RewardStdFilter or None, got "
                            f"{type(reward_std_filter).__name__}")
        self.reward_std_filter = reward_std_filter
        self._kept_completions: torch.Tensor | None = None  # (B,) bool, this process's completions of the batch
        super().__init__(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # (all B, F)
        if self.reward_std_filter is None or not self.model.training:
            return rewards_per_func
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # unscorable, as TRL's advantages take it
        group_stds = nanstd(rewards.view(-1, self.num_generations), dim=1)  # (prompts,)
        threshold = self.reward_std_filter.threshold  # the one this batch is judged by
        kept_groups = self.reward_std_filter.keep(group_stds)
        process = self.accelerator.process_index
        self._kept_completions = kept_groups.repeat_interleave(self.num_generations)[
            process * len(prompts):(process + 1) * len(prompts)]
        self._metrics["train"][THRESHOLD_METRIC].append(float("nan") if threshold is None else threshold)
        self._metrics["train"][DROPPED_METRIC].append(1.0 - kept_groups.float().mean().item())
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        kept, self._kept_completions = self._kept_completions, None
        if kept is None:
            return output
        kept = kept.to(output["completion_mask"].device)
        output["completion_mask"] = output["completion_mask"] * kept.unsqueeze(1)  # (B, C)
        loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        return output

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.reward_std_filter is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, STATE_FILE), "w") as file:
                json.dump(dataclasses.asdict(self.reward_std_filter), file)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, STATE_FILE)
        if self.reward_std_filter is not None and path is not None and os.path.exists(path):
            with open(path) as file:
                state = json.load(file)
            for name, value in state.items():
                setattr(self.reward_std_filter, name, value)
