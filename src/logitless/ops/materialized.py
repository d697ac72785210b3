"""The implementation ``impl="reference"``: every step of an op on the whole (N, V) logits, as the obvious code
computes them, through the materialized oracles of `reference.py` (the head's logits, log_softmax, gather). What it
returns is what the block engine must equal; on a head sharded on the vocabulary it runs on the head gathered whole
(`whole_vocabulary`)."""

from __future__ import annotations

import torch

from logitless.op_settings import BlockSizes
from logitless.ops import reference
from logitless.ops.base import StatsThenLoss
from logitless.ops.head import LinearHead


class Materialized(StatsThenLoss):
    """The whole logits of each call (`api.py`'s steps)."""

    name = "reference"
    triton = False
    whole_vocabulary = True  # a head sharded on the vocabulary is gathered whole for it

    def unusable(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    def token_stats(self, head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, *, need_entropy: bool = True,
                    need_mean_log_prob: bool = False, extras: tuple[str, ...] = (), sizes: BlockSizes = BlockSizes()):
        logits = reference.head_logits(hidden, head)  # (N, V)
        log_probs_all = torch.log_softmax(logits, dim=-1)  # (N, V), once for every statistic
        log_probs = log_probs_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
        zeros = torch.zeros_like(log_probs)
        entropy = reference.entropy_from_log_probs(log_probs_all) if need_entropy else zeros
        mean_log_prob = log_probs_all.mean(dim=-1) if need_mean_log_prob else zeros
        every_extra = reference.token_extras(logits.detach(), targets) if extras else {}
        return log_probs, entropy, mean_log_prob, {name: every_extra[name] for name in extras}

    def kl(self, head_p: LinearHead, hidden_p: torch.Tensor, head_q: LinearHead, hidden_q: torch.Tensor,
           sizes: BlockSizes) -> torch.Tensor:
        return reference.kl_from_log_probs(torch.log_softmax(reference.head_logits(hidden_p, head_p), dim=-1),
                                           torch.log_softmax(reference.head_logits(hidden_q, head_q), dim=-1))

    def jsd(self, head_s: LinearHead, hidden_s: torch.Tensor, head_t: LinearHead, hidden_t: torch.Tensor, beta: float,
            sizes: BlockSizes) -> tuple[torch.Tensor, torch.Tensor]:
        log_p_s = torch.log_softmax(reference.head_logits(hidden_s, head_s), dim=-1)
        log_p_t = torch.log_softmax(reference.head_logits(hidden_t, head_t), dim=-1)
        return reference.generalized_jsd(log_p_s, log_p_t, beta), reference.entropy_from_log_probs(log_p_s).detach()
