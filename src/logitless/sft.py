"""One SFT optimizer step on (prompt, response) pairs, logit-free: what `logitless sft` repeats, and what the
multiple-choice warm start (`logitless.multichoice.warm_start`) runs a few dozen times.

Each microbatch is tokenized with `tokenize_prompt_and_output`, scored on its response tokens only
(`fused_linear_logprobs` with the response mask: no (B, T, V) logits, and the prompt's positions never reach the
LM head) and trained with `sft_microbatch_train_step`; then the gradients are clipped and the optimizer
steps, unless the loss or a gradient is not finite (`logitless.nonfinite.check_step`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from logitless.data import tokenize_prompt_and_output
from logitless.hf import final_hidden_states, lm_head_of
from logitless.hf_probe import OWN_FORWARD, check_head
from logitless.losses import sft_microbatch_train_step
from logitless.masked import masked_mean
from logitless.nonfinite import check_step
from logitless.ops.fused import fused_linear_logprobs


class SFTStep(NamedTuple):
    """What one step did: its means over every response token, and whether it was applied."""

    loss: float  # mean token NLL on the responses
    entropy: float  # mean entropy of the model's next-token distribution at the response positions
    applied: bool  # False: not finite, and skipped (on_nonfinite="skip")


def _response_log_probs(model, input_ids, labels, response_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy), each (B, T), at the response positions (0 elsewhere), logit-free."""
    check_head(model, OWN_FORWARD)
    head = lm_head_of(model)
    hidden = final_hidden_states(model, input_ids)  # (B, T, H)
    return fused_linear_logprobs(hidden, targets=labels, head=head, mask=response_mask, return_token_entropy=True)


def sft_step(model, tokenizer, optimizer: torch.optim.Optimizer, microbatches: list[list[dict[str, str]]], *,
             step: int, max_grad_norm: float, on_nonfinite: str = "stop", advice: str = "") -> SFTStep:
    """One optimizer step of ``model`` on ``microbatches`` of {"prompt", "response"} pairs (the gradient
    accumulated over them), clipped to ``max_grad_norm``. The loss is the mean NLL over every response token of
    the step, so accumulating microbatches gives the gradient of one batch holding them all, whatever their
    lengths. ``step`` (1-based), ``on_nonfinite`` and ``advice`` are `check_step`'s: a NaN or infinite loss or
    gradient raises `NonFiniteError` ("stop") or skips the step."""
    tokenized = [tokenize_prompt_and_output([e["prompt"] for e in batch], [e["response"] for e in batch], tokenizer)
                 for batch in microbatches]
    step_tokens = max(sum(float(tensors["response_mask"].sum()) for tensors in tokenized), 1.0)
    losses, entropies, token_counts = [], [], []
    for tensors in tokenized:
        mask = tensors["response_mask"]
        log_probs, entropy = _response_log_probs(model, tensors["input_ids"], tensors["labels"], mask)
        # per-sequence sums / this constant, meaned over the batch and the microbatches: the step's token mean
        step_tokens_per_sequence = step_tokens / (len(mask) * len(microbatches))
        _, meta = sft_microbatch_train_step(log_probs, mask, len(microbatches),
                                            normalize_constant=step_tokens_per_sequence)
        losses.append(meta["mean_token_nll"].item())
        entropies.append(masked_mean(entropy.detach(), mask).item())
        token_counts.append(float(meta["num_response_tokens"]))
    applied = check_step(step, model, losses, policy=on_nonfinite, advice=advice)
    if applied:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return SFTStep(_token_weighted(losses, token_counts), _token_weighted(entropies, token_counts), applied)


def _token_weighted(means: list[float], token_counts: list[float]) -> float:
    """The mean over every token of per-microbatch token means."""
    return sum(mean * count for mean, count in zip(means, token_counts)) / max(sum(token_counts), 1.0)
