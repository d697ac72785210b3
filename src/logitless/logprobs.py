"""Per-token log-probabilities (and entropy) of labels under a Hugging Face causal LM.

The default path never builds the (B, T, V) logits: it runs the model's body to get the hidden states its head
reads and hands them with the output embedding (a `LinearHead`) to the fused log-probs, once the model's head was
checked against its own forward (`logitless.hf_probe`). ``impl="reference"`` is the plain forward -> log_softmax ->
gather, kept as the oracle.
"""

from __future__ import annotations

import torch

from logitless._checks import (check_impl, check_positive_finite, check_same_shape, check_tensor, check_token_ids,
                               checked_keywords)
from logitless.hf import final_hidden_states, lm_head_of, position_ids_for, vocabulary_rows
from logitless.hf_probe import REFERENCE_IMPL, check_head
from logitless.ops.fused import fused_linear_logprobs
from logitless.ops.reference import logprobs_from_logits

IGNORE_INDEX = -100  # a label that is not scored (as in PyTorch's and transformers' losses)


@checked_keywords()
def get_response_log_probs(model, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool = False,
                           *, impl: str = "auto", temperature: float = 1.0,
                           attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """log p(labels[b, t] | input_ids[b, :t+1]) for every position, (B, T) fp32; no masking.

    With ``return_token_entropy`` also the entropy of each next-token distribution. ``temperature``
    divides the logits. ``impl`` is the fused ops' (`logitless._checks.IMPLS`): "auto" (the default: the fused
    log-probs, no (B, T, V) logits), "chunked" or "triton" (the fused log-probs on PyTorch's or Triton's block
    math), or "reference" (the model's own forward, its (B, T, V) logits, log_softmax and gather).
    Labels of -100 (`IGNORE_INDEX`) are not scored: their log-prob is 0 (their entropy is still given).
    A model whose logits logitless cannot compute from its hidden states as its own forward does is refused by the
    fused impls (`logitless.hf_probe.UnreadableHead`, checked on the model's first call), never scored otherwise.
    """
    check_impl(impl)
    check_tensor("input_ids", input_ids, ndim=2, integer=True)
    check_tensor("labels", labels, ndim=2, integer=True)
    check_same_shape("labels", labels, "input_ids", input_ids)
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids: the batch is empty (shape {tuple(input_ids.shape)}); "
                         "expected at least one sequence of at least one token")
    temperature = check_positive_finite("temperature", temperature)
    if attention_mask is not None:
        check_same_shape("attention_mask", attention_mask, "input_ids", input_ids)
    check_token_ids("input_ids", input_ids, model.get_input_embeddings().weight.shape[0])
    ignored = labels == IGNORE_INDEX
    targets = labels.masked_fill(ignored, 0)
    check_token_ids("labels", targets, vocabulary_rows(model))

    if impl == "reference":
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids_for(attention_mask),
                       use_cache=False).logits  # (B, T, V)
        log_probs, entropy = logprobs_from_logits(logits, targets, temperature, return_token_entropy)  # (B, T) each
    else:
        check_head(model, REFERENCE_IMPL)
        head = lm_head_of(model, temperature)
        hidden = final_hidden_states(model, input_ids, attention_mask)  # (B, T, H)
        result = fused_linear_logprobs(hidden, targets=targets, head=head, return_token_entropy=return_token_entropy,
                                       impl=impl)
        log_probs, entropy = result if return_token_entropy else (result, None)
    out = {"log_probs": log_probs.masked_fill(ignored, 0.0)}
    if return_token_entropy:
        out["token_entropy"] = entropy
    return out
