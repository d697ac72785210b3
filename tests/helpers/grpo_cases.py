"""The GRPO loss's cases, every loss type and option TRL 1.16 has, and their inputs: shared by the PyTorch op's
test against TRL's own loss and the JAX op's test against the PyTorch op."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

B, T, H, V = 6, 7, 8, 40
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")


@dataclasses.dataclass
class Case:
    config: dict  # GRPOConfig options
    importance_ratio: bool = False  # vLLM's importance-sampling correction
    accumulation: int = 1
    per_token_advantages: bool = False
    extra_items: int = 0  # num_items_in_batch beyond this batch's tokens (the rest of the accumulated batch)

    def __str__(self):
        return "-".join([f"{k}={v}" for k, v in self.config.items()] + ["is"] * self.importance_ratio
                        + [f"ga{self.accumulation}"] * (self.accumulation > 1) + ["adv_bt"] * self.per_token_advantages
                        + [f"items+{self.extra_items}"] * bool(self.extra_items))


def _level(loss_type):
    return {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}


CASES = (
    [Case({"loss_type": t, **_level(t)}) for t in LOSS_TYPES]
    + [Case({"loss_type": t, "beta": 0.04, "epsilon_high": 0.28, **_level(t)}, importance_ratio=True, accumulation=2,
            extra_items=9) for t in LOSS_TYPES]
    + [Case({"loss_type": "luspo"}, importance_ratio=True),  # token level: TRL broadcasts the sequence loss
       Case({"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.1}),
       Case({"loss_type": "dapo", "top_entropy_quantile": 0.5, "entropy_coef": 0.01}, accumulation=2),
       Case({"loss_type": "grpo", "off_policy_mask_threshold": 0.05}, per_token_advantages=True),
       Case({"loss_type": "bnpo", "off_policy_mask_threshold": 0.05, "top_entropy_quantile": 0.3},
            importance_ratio=True),
       Case({"loss_type": "grpo", "delta": 1.2, "beta": 0.1, "use_bias_correction_kl": False}),
       Case({"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5}, per_token_advantages=True),
       Case({"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_neg": 1.0, "vespo_k_neg": 2.0,
             "vespo_lambda_pos": 2.5, "beta": 0.02}, importance_ratio=True),
       Case({"loss_type": "cispo", "epsilon_high": 1.1, "entropy_coef": 0.05})]
)


def grpo_inputs(case: Case, seed: int):
    """A head (hidden, weight) and the loss's tensors: ratios off 1 by enough to clip, a padded and an empty-ish
    sequence, junk at the masked positions."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.6
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 5:] = 0
    mask[3, 1:] = 0
    with torch.no_grad():
        log_probs = F.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None]).squeeze(-1)

    def near(scale):
        return (log_probs + scale * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)

    tensors = dict(old_log_probs=near(0.3), ref_log_probs=near(0.2), sampling_log_probs=near(0.1))
    advantages = torch.randn(B, T if case.per_token_advantages else 1, generator=g, dtype=torch.float64)
    if not case.per_token_advantages:
        advantages = advantages.squeeze(1)
    if case.importance_ratio:
        tensors["importance_sampling_ratio"] = torch.where(mask.bool(), torch.rand(B, T, generator=g,
                                                                                   dtype=torch.float64) + 0.5, 1.0)
    for name in ("old_log_probs", "ref_log_probs"):
        tensors[name] = torch.where(mask.bool(), tensors[name], torch.nan)  # never read
    return hidden, weight, ids, mask, advantages, tensors
