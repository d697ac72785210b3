"""Per-token log-probabilities (and entropy) of labels under a Hugging Face causal LM.

The default path never builds the (B, T, V) logits: it runs the model's body to get the final
hidden states and hands them with the output embedding to `fused_linear_logprobs`.
``impl="materialized"`` is seed 001's forward -> log_softmax -> gather, kept as the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitless._checks import check_choice, check_positive, check_same_shape, check_tensor, check_token_ids
from logitless.ops.fused import fused_linear_logprobs
from logitless.ops.reference import logprobs_from_logits


@dataclass
class LMHead:
    """What turns final hidden states into logits: ``logits = scale * (hidden @ weight.T + bias)``."""

    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None  # (V,)
    scale: float


# Config attributes of models whose logits are a multiple of the LM head's output.
_LOGIT_MULTIPLIERS = ("logit_scale", "output_multiplier", "lm_head_multiplier")  # Cohere; Falcon-H1
_LOGIT_DIVISORS = ("logits_scaling",)  # Granite: logits / logits_scaling
_UNSUPPORTED_HEAD_OPS = ("final_logit_softcapping", "logits_soft_cap")  # Gemma 2/3: tanh soft-capping


def lm_head_of(model) -> LMHead:
    """The output embedding of ``model`` (tied or not, with bias and logit scale if it has them)."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"model: {type(model).__name__} has no output embedding (get_output_embeddings())")
    config = model.config
    for name in _UNSUPPORTED_HEAD_OPS:
        if getattr(config, name, None):
            raise ValueError(f"model: its config sets {name}, which the fused path does not support; "
                             f"use impl='materialized'")
    scale = 1.0
    for name in _LOGIT_MULTIPLIERS:
        scale *= float(getattr(config, name, None) or 1.0)
    for name in _LOGIT_DIVISORS:
        scale /= float(getattr(config, name, None) or 1.0)
    return LMHead(head.weight, getattr(head, "bias", None), scale)


def model_body(model):
    """The transformer under a causal LM's head (``model.model`` for Qwen2, ``model.transformer`` for GPT-2)."""
    body = getattr(model, model.base_model_prefix, None)
    if body is None or body is model:
        raise TypeError(f"model: cannot find the body of {type(model).__name__} (base_model_prefix "
                        f"{model.base_model_prefix!r}); use impl='materialized'")
    return body


def position_ids_for(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Positions that start at 0 at each row's first unmasked token, so left padding does not shift them.

    Rotary models (Qwen2) are indifferent to a constant shift; models with absolute position
    embeddings (GPT-2) are not, and would score a left-padded row differently from the same row alone.
    """
    return None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def final_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) -> (B, T, H): the hidden states the LM head would read, without computing logits."""
    return model_body(model)(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids_for(attention_mask), use_cache=False).last_hidden_state


def get_response_log_probs(model, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool = False,
                           *, impl: str = "fused", temperature: float = 1.0,
                           attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """log p(labels[b, t] | input_ids[b, :t+1]) for every position, (B, T) fp32; no masking.

    With ``return_token_entropy`` also the entropy of each next-token distribution. ``temperature``
    divides the logits. ``impl`` is "fused" (default: no (B, T, V) logits) or "materialized".
    """
    check_choice("impl", impl, ("fused", "materialized"))
    check_tensor("input_ids", input_ids, ndim=2, integer=True)
    check_tensor("labels", labels, ndim=2, integer=True)
    check_same_shape("labels", labels, "input_ids", input_ids)
    temperature = check_positive("temperature", temperature)
    if attention_mask is not None:
        check_same_shape("attention_mask", attention_mask, "input_ids", input_ids)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    check_token_ids("input_ids", input_ids, model.get_input_embeddings().weight.shape[0])
    check_token_ids("labels", labels, vocab_size)

    if impl == "materialized":
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_for(attention_mask),
                       use_cache=False).logits  # (B, T, V)
        log_probs, entropy = logprobs_from_logits(logits, labels, temperature, return_token_entropy)
    else:
        head = lm_head_of(model)
        hidden = final_hidden_states(model, input_ids, attention_mask).contiguous()  # (B, T, H)
        result = fused_linear_logprobs(hidden, head.weight, labels, bias=head.bias,
                                       temperature=temperature / head.scale, return_entropy=return_token_entropy)
        log_probs, entropy = result if return_token_entropy else (result, None)
    out = {"log_probs": log_probs}
    if return_token_entropy:
        out["token_entropy"] = entropy
    return out
