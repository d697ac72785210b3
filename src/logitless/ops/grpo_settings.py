"""`GRPOSettings`: every option of the GRPO loss that is a setting, not a tensor, validated in one place.

Shared by the PyTorch op, the JAX op and the oracle; frozen and hashable, so a jitted function may close
over it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from logitless._checks import check_choice, check_finite_number, check_positive_int
from logitless._keywords import unknown_keyword

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token",)  # TRL's "sequence" (GSPO) ratios are not computed by these ops


@dataclass(frozen=True)
class GRPOSettings:
    """The options of TRL's GRPO loss (see `logitless.ops.grpo` for the formulas).

    Fields:

    * ``loss_type``: how per-token losses are normalized: "grpo" (mean over sequences of each sequence's
      token mean), "bnpo" (mean over the batch's tokens), "dr_grpo" (sum / (B * max_completion_length)),
      "dapo" (sum / num_items_in_batch).
    * ``beta``: weight of the k3 KL to the reference policy (>= 0; > 0 needs ``ref_log_probs``).
    * ``epsilon_low``, ``epsilon_high``: the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high].
    * ``delta``: upper cap of the unclipped ratio (TRL's two-sided clipping), or None for no cap.
    * ``use_bias_correction_kl``: multiply the KL by the importance ratio.
    * ``importance_sampling_level``: "token" (one ratio per token; the only level computed).
    * ``max_completion_length``: dr_grpo's normalizer; None takes the completions' length T.
    * ``gradient_accumulation_steps``: grpo, bnpo and dr_grpo divide the loss by it (dapo's
      ``num_items_in_batch`` already spans the accumulated batch).
    """

    loss_type: str = "grpo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    use_bias_correction_kl: bool = False
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    gradient_accumulation_steps: int = 1

    def __post_init__(self):
        check_choice("settings.loss_type", self.loss_type, GRPO_LOSS_TYPES)
        for name in ("beta", "epsilon_low", "epsilon_high"):
            check_finite_number(f"settings.{name}", getattr(self, name), allow_zero=True)
        if self.delta is not None:
            check_finite_number("settings.delta", self.delta)
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ValueError(f"settings.use_bias_correction_kl: expected a bool, got {self.use_bias_correction_kl!r}")
        check_choice("settings.importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        if self.max_completion_length is not None:
            check_positive_int("settings.max_completion_length", self.max_completion_length)
        check_positive_int("settings.gradient_accumulation_steps", self.gradient_accumulation_steps)

    @classmethod
    def from_trl(cls, grpo_config) -> GRPOSettings:
        """The settings of a TRL ``GRPOConfig`` (read by attribute name; fields it lacks keep their defaults).

        TRL's ``epsilon`` is the lower clip, and its ``epsilon_high`` defaults to ``epsilon``. An option of
        TRL's loss that these settings do not model (an entropy mask or bonus, the off-policy mask, vLLM's
        importance-sampling correction) is refused by name rather than dropped: `GRPOTrainerWithLogits`
        runs such losses (TRL's loss code on fused log-probs).
        """
        unmodelled = {"top_entropy_quantile": getattr(grpo_config, "top_entropy_quantile", 1.0) != 1.0,
                      "off_policy_mask_threshold": getattr(grpo_config, "off_policy_mask_threshold", None) is not None,
                      "entropy_coef": getattr(grpo_config, "entropy_coef", 0.0) != 0.0,
                      "vllm_importance_sampling_correction": bool(
                          getattr(grpo_config, "use_vllm", False)
                          and getattr(grpo_config, "vllm_importance_sampling_correction", False))}
        for name, used in unmodelled.items():
            if used:
                raise ValueError(f"grpo_config.{name}: {getattr(grpo_config, name)!r} is an option of TRL's loss "
                                 "that GRPOSettings does not model; GRPOTrainerWithLogits computes it (TRL's loss "
                                 "on fused log-probs)")
        same_names = {field.name: getattr(grpo_config, field.name, field.default) for field in dataclasses.fields(cls)
                      if field.name not in ("epsilon_low", "epsilon_high")}
        epsilon_low = getattr(grpo_config, "epsilon", cls.epsilon_low)
        epsilon_high = getattr(grpo_config, "epsilon_high", None)
        return cls(epsilon_low=epsilon_low, epsilon_high=epsilon_low if epsilon_high is None else epsilon_high,
                   **same_names)

    @classmethod
    def of(cls, settings: GRPOSettings | None, options: dict) -> GRPOSettings:
        """A GRPO op's ``settings`` and its keyword options (``beta=...``, one per field) as one GRPOSettings.

        Without ``settings`` the options build one; with it, each option given must equal its field.
        """
        fields = {field.name for field in dataclasses.fields(cls)}
        for name in options:
            if name not in fields:
                raise unknown_keyword("GRPOSettings", name, fields)
        if settings is None:
            return cls(**options)
        if not isinstance(settings, GRPOSettings):
            raise TypeError(f"settings: expected a GRPOSettings, got {type(settings).__name__}")
        for name, value in options.items():
            if value != getattr(settings, name):
                raise ValueError(f"{name}: {value!r} disagrees with settings.{name} = {getattr(settings, name)!r}; "
                                 f"give it once")
        return settings


GRPO_OPTIONS = tuple(field.name for field in dataclasses.fields(GRPOSettings))  # what a GRPO op's **options may hold
