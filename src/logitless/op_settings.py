"""The ops' settings that are not tensors, validated where they are made, without PyTorch or JAX: the PyTorch ops
and the JAX ops share them (the oracles read their fields by name), and a jitted function may close over them
(frozen and hashable).

* `BlockSizes`: tokens per row chunk and vocabulary entries per block of logits.
* `GRPOSettings`: every option of the GRPO loss that is a setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from logitless._checks import check_choice, check_finite_number, check_positive_int, unknown_keyword

@dataclass(frozen=True)
class BlockSizes:
    """Tokens per row chunk and vocabulary entries per block of logits; None takes the per-device default
    (`logitless.ops.plan.default_block_sizes`). Larger blocks make larger matmuls and keep more logits at once."""

    tokens: int | None = None
    vocab: int | None = None

    def __post_init__(self):
        for name in ("tokens", "vocab"):
            if getattr(self, name) is not None:
                check_positive_int(f"block_sizes.{name}", getattr(self, name))

    @classmethod
    def of(cls, block_sizes: BlockSizes | None) -> BlockSizes:
        """An op's ``block_sizes`` argument: a BlockSizes, or None for every default."""
        if block_sizes is None:
            return cls()
        if not isinstance(block_sizes, BlockSizes):
            raise TypeError(f"block_sizes: expected a BlockSizes, got {type(block_sizes).__name__}")
        return block_sizes

    def or_defaults(self, defaults: BlockSizes) -> BlockSizes:
        return BlockSizes(self.tokens or defaults.tokens, self.vocab or defaults.vocab)


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")  # TRL 1.16's
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOSettings:
    """The options of TRL 1.16's GRPO loss that are settings, not tensors, with TRL's names and defaults but for
    ``loss_type`` (TRL's GRPOConfig defaults to "dapo") (see `logitless.ops.grpo` for the formulas).

    Fields:

    * ``loss_type``: the objective and how its per-token terms are normalized. The clipped objective:
      "grpo" (mean over sequences of each sequence's token mean), "bnpo" (mean over the batch's tokens),
      "dr_grpo" (sum / (B * max_completion_length)), "dapo" (sum / num_items_in_batch), "luspo" (each sequence's
      sum, averaged over sequences: a sequence's loss scaled by its length; meant for
      ``importance_sampling_level="sequence"``). Others: "cispo" (the clipped ratio, without gradient, times
      the log-prob; sum / num_items_in_batch), "sapo" (a sigmoid gate of temperature ``sapo_temperature_pos``
      or ``sapo_temperature_neg`` instead of the clip; normalized as grpo), "vespo" (a Gamma weight of the
      sequence's ratio, without gradient, times the log-prob; sum / num_items_in_batch).
    * ``beta``: weight of the k3 KL to the reference policy (>= 0; > 0 needs ``ref_log_probs``).
    * ``epsilon_low``, ``epsilon_high``: the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high]
      (cispo clips at ``epsilon_high`` from above only).
    * ``delta``: upper cap of the unclipped ratio (TRL's two-sided clipping), or None for no cap.
    * ``use_bias_correction_kl``: multiply the KL by the importance ratio (TRL 1.16's default, True).
    * ``importance_sampling_level``: "token" (one ratio per token) or "sequence" (GSPO: one ratio per
      sequence, exp of its tokens' mean log-ratio).
    * ``max_completion_length``: dr_grpo's normalizer; None takes the completions' length T.
    * ``gradient_accumulation_steps``: grpo, bnpo, dr_grpo, sapo, luspo and the entropy bonus divide by it
      (``num_items_in_batch``, the normalizer of dapo, cispo and vespo, already spans the accumulated batch).
    * ``top_entropy_quantile``: < 1 keeps only the tokens whose entropy is in the top fraction of the batch's
      (the policy term; the KL stays on every token).
    * ``off_policy_mask_threshold``: drops the sequences with a negative advantage whose mean
      ``sampling_log_probs - log_probs`` (the drift from the policy that sampled them) exceeds it; None: none.
    * ``entropy_coef``: subtracts this times the mean entropy of the tokens the policy term acts on.
    * ``vespo_k_pos``, ``vespo_lambda_pos``, ``vespo_k_neg``, ``vespo_lambda_neg``: vespo's Gamma weight
      for advantages >= 0 and < 0.
    """

    loss_type: str = "grpo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    use_bias_correction_kl: bool = True
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    gradient_accumulation_steps: int = 1
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self):
        check_choice("settings.loss_type", self.loss_type, GRPO_LOSS_TYPES)
        for name in ("beta", "epsilon_low", "epsilon_high", "entropy_coef", "vespo_k_pos", "vespo_k_neg"):
            check_finite_number(f"settings.{name}", getattr(self, name), allow_zero=True)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            check_finite_number(f"settings.{name}", getattr(self, name))
        if self.delta is not None:
            check_finite_number("settings.delta", self.delta)
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ValueError(f"settings.use_bias_correction_kl: expected a bool, got {self.use_bias_correction_kl!r}")
        check_choice("settings.importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        if self.max_completion_length is not None:
            check_positive_int("settings.max_completion_length", self.max_completion_length)
        check_positive_int("settings.gradient_accumulation_steps", self.gradient_accumulation_steps)
        check_finite_number("settings.top_entropy_quantile", self.top_entropy_quantile)
        if self.top_entropy_quantile > 1:
            raise ValueError(f"settings.top_entropy_quantile: expected a fraction in (0, 1], got "
                             f"{self.top_entropy_quantile!r}")
        if self.off_policy_mask_threshold is not None:
            check_finite_number("settings.off_policy_mask_threshold", self.off_policy_mask_threshold, allow_zero=True)

    @property
    def per_token(self) -> bool:
        """Whether each token's loss term depends on that token's log-prob alone (given the tensors passed in):
        no sequence-level ratio, vespo weight, entropy quantile, off-policy mask or entropy bonus. Such a loss's
        gradient is known as soon as a token's log-prob is, which the one-pass schedule needs."""
        return (self.importance_sampling_level == "token" and self.loss_type != "vespo"
                and self.top_entropy_quantile == 1.0 and self.off_policy_mask_threshold is None
                and self.entropy_coef == 0.0)

    @classmethod
    def from_trl(cls, grpo_config) -> GRPOSettings:
        """The settings of a TRL ``GRPOConfig`` (read by attribute name; fields it lacks keep their defaults).

        TRL's ``epsilon`` is the lower clip, and its ``epsilon_high`` defaults to ``epsilon``. The tensors of
        TRL's loss (the reference, old and sampling log-probs, vLLM's importance-sampling ratio) are the op's
        arguments, not settings. TRL's adaptive entropy coefficient is the trainer's state: pass the coefficient
        of the current step as ``entropy_coef``.
        """
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
