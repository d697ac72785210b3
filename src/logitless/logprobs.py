"""Per-token log-probabilities (and entropy) of labels under a Hugging Face causal LM.

The default path never builds the (B, T, V) logits: it runs the model's body to get the final
hidden states and hands them with the output embedding to `fused_linear_logprobs`.
``impl="materialized"`` is seed 001's forward -> log_softmax -> gather, kept as the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitless._checks import check_choice, check_positive, check_same_shape, check_tensor, check_token_ids
from logitless.ops.chunks import softcap_
from logitless.ops.fused import fused_linear_logprobs
from logitless.ops.reference import logprobs_from_logits


@dataclass
class LMHead:
    """What turns final hidden states into logits: ``logits = cap(scale * (hidden @ weight.T + bias))``.

    ``cap(x) = softcap * tanh(x / softcap)`` when the model soft-caps its logits (Gemma 2/3n,
    nanochat), the identity when ``softcap`` is None.
    """

    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None  # (V,)
    scale: float
    softcap: float | None = None

    def logits_from(self, raw: torch.Tensor) -> torch.Tensor:
        """The model's logits (fp32) from ``hidden @ weight.T + bias``, of any shape (or a subset of columns)."""
        return softcap_(raw.float() * self.scale, self.softcap)

    def logit_options(self, temperature: float) -> dict:
        """``temperature`` and ``softcap`` for the fused ops, with the scale folded into both:
        cap_c(s * x) / T = s * cap_{c/s}(x) / T = cap_{c/s}(x) / (T / s)."""
        return {"temperature": temperature / self.scale,
                "softcap": None if self.softcap is None else self.softcap / self.scale}


# Config attributes that scale the LM head's output, looked up in this order; the first one set wins
# (as transformers' models and TRL read them). Cohere: logit_scale; Muse Glimmer: output_multiplier;
# Falcon-H1: lm_head_multiplier; Granite, MiniCPM3: logits / logits_scaling, HyperCLOVA X: logits * logits_scaling.
_LOGIT_MULTIPLIERS = ("logit_scale", "output_multiplier", "lm_head_multiplier")
_LOGIT_DIVISOR = "logits_scaling"
_MULTIPLIES_BY_LOGITS_SCALING = ("hyperclovax",)
_SOFTCAP = "final_logit_softcapping"  # Gemma 2/3/3n/4, nanochat, Mistral Large 4: cap * tanh(logits / cap)


def lm_head_of(model) -> LMHead:
    """The output embedding of ``model`` (tied or not, with bias, logit scale and soft cap if it has them)."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"model: {type(model).__name__} has no output embedding (get_output_embeddings())")
    config = model.config.get_text_config()  # composite (vision-language) configs keep these on the text part
    scale = next((getattr(config, name) for name in _LOGIT_MULTIPLIERS if getattr(config, name, None) is not None),
                 None)
    if scale is None and getattr(config, _LOGIT_DIVISOR, None) is not None:
        divisor = float(getattr(config, _LOGIT_DIVISOR))
        scale = divisor if config.model_type in _MULTIPLIES_BY_LOGITS_SCALING else 1.0 / divisor
    scale = 1.0 if scale is None else float(scale)
    softcap = getattr(config, _SOFTCAP, None)
    return LMHead(head.weight, getattr(head, "bias", None), scale, None if softcap is None else float(softcap))


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
                                       return_entropy=return_token_entropy, **head.logit_options(temperature))
        log_probs, entropy = result if return_token_entropy else (result, None)
    out = {"log_probs": log_probs}
    if return_token_entropy:
        out["token_entropy"] = entropy
    return out
