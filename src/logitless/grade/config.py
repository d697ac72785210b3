"""GradeConfig: one dataclass for both GRADE trainers and the GRPO baseline, checked when it is built.

Its defaults are `logitless grade`'s: a run of the embedded tiny Qwen2 whose reward rises within a few
minutes on a CPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

from logitless._checks import (check_choice, check_finite_number, check_finite_numbers, check_nonnegative_int,
                               check_positive_finite, check_positive_ints, check_strings, dataclass_from_dict)
from logitless.nonfinite import POLICIES


@dataclass
class GradeConfig:
    straight_through: bool = False  # False: soft samples forward and backward; True: hard forward, soft backward
    gumbel_topk: int = 1024  # tokens kept per step by the memory-efficient trainer (the vocabulary size = all)
    tau_start: float = 1.0  # Gumbel-softmax temperature at step 0 ...
    tau_end: float = 0.5  # ... annealed geometrically to this ...
    tau_anneal_steps: int = 30  # ... over this many optimizer steps (0: tau_end from the start)
    max_new_tokens: int = 12  # tokens generated per rollout (every rollout has exactly this many)
    batch_size: int = 4  # rollouts per microbatch
    gradient_accumulation_steps: int = 1  # microbatches per optimizer step
    kl_coef: float = 0.02  # loss = -reward + kl_coef * KL(policy || reference) summed over the rollout
    learning_rate: float = 1e-2
    max_grad_norm: float = 1.0
    seed: int = 0
    activation_checkpointing: bool = True  # recompute each decode step in backward (efficient trainer)
    grpo_group_size: int = 4  # GRPO baseline: completions per prompt (must divide batch_size)
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank (peft) instead of every weight
    lora_alpha: float = 16.0
    lora_target_modules: str | list[str] = "all-linear"  # peft's target_modules
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient: "stop" (NonFiniteError before the update) or "skip"

    def __post_init__(self):
        check_choice("on_nonfinite", self.on_nonfinite, POLICIES)
        check_positive_ints(self, ("gumbel_topk", "max_new_tokens", "batch_size", "gradient_accumulation_steps",
                                   "grpo_group_size"))
        check_finite_numbers(self, ("tau_start", "tau_end", "learning_rate", "max_grad_norm"))
        check_nonnegative_int("tau_anneal_steps", self.tau_anneal_steps, "tau_end from the start")
        check_finite_number("kl_coef", self.kl_coef, allow_zero=True)
        check_nonnegative_int("seed", self.seed)
        check_nonnegative_int("lora_rank", self.lora_rank, "no LoRA")
        check_positive_finite("lora_alpha", self.lora_alpha)
        if not isinstance(self.lora_target_modules, str) and not check_strings("lora_target_modules",
                                                                               self.lora_target_modules):
            raise ValueError("lora_target_modules: the list is empty; name the modules to adapt, or 'all-linear'")
        for name in ("straight_through", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")

    def check_grpo_group(self) -> None:
        """What the GRPO baseline needs: groups of ``grpo_group_size`` >= 2 completions filling each microbatch."""
        if self.grpo_group_size < 2 or self.batch_size % self.grpo_group_size:
            raise ValueError(f"grpo_group_size: must be >= 2 and divide batch_size {self.batch_size}, "
                             f"got {self.grpo_group_size}")

    @classmethod
    def from_dict(cls, values: dict) -> GradeConfig:
        return dataclass_from_dict(cls, values)

    def tau_at(self, step: int) -> float:
        """Geometric annealing: tau_start * (tau_end / tau_start) ** min(step / tau_anneal_steps, 1)."""
        progress = 1.0 if self.tau_anneal_steps == 0 else min(step / self.tau_anneal_steps, 1.0)
        return self.tau_start * math.exp(progress * math.log(self.tau_end / self.tau_start))
