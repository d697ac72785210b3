"""Hugging Face adapters: a causal LM's head as a `LinearHead`, its body, and its final hidden states.

Everything logit-free starts here: run the body (the transformer under the LM head) to get the
hidden states the head would read, and hand them with the head to the fused ops.
"""

from __future__ import annotations

import functools

import torch

from logitless.ops.head import LinearHead

# Config attributes that scale the LM head's output, looked up in this order; the first one set wins
# (as transformers' models and TRL read them). Cohere: logit_scale; Muse Glimmer: output_multiplier;
# Falcon-H1: lm_head_multiplier; Granite, MiniCPM3: logits / logits_scaling, HyperCLOVA X: logits * logits_scaling.
_LOGIT_MULTIPLIERS = ("logit_scale", "output_multiplier", "lm_head_multiplier")
_LOGIT_DIVISOR = "logits_scaling"
_MULTIPLIES_BY_LOGITS_SCALING = ("hyperclovax",)
_SOFTCAP = "final_logit_softcapping"  # Gemma 2/3/3n/4, nanochat, Mistral Large 4: cap * tanh(logits / cap)


def lm_head_of(model, temperature: float = 1.0) -> LinearHead:
    """The output embedding of ``model`` as a `LinearHead` (tied or not, with its bias, logit scale and
    soft cap if it has them), whose logits are the model's divided by ``temperature``."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"model: {type(model).__name__} has no output embedding (get_output_embeddings())")
    config = model.config.get_text_config()  # composite (vision-language) configs keep these on the text part
    scale = next((getattr(config, name) for name in _LOGIT_MULTIPLIERS if getattr(config, name, None) is not None),
                 None)
    if scale is None and getattr(config, _LOGIT_DIVISOR, None) is not None:
        divisor = float(getattr(config, _LOGIT_DIVISOR))
        scale = divisor if config.model_type in _MULTIPLIES_BY_LOGITS_SCALING else 1.0 / divisor
    softcap = getattr(config, _SOFTCAP, None)
    return LinearHead(head.weight, bias=getattr(head, "bias", None), temperature=temperature,
                      softcap=None if softcap is None else float(softcap),
                      logit_scale=1.0 if scale is None else float(scale))


def model_body(model):
    """The transformer under a causal LM's head (``model.model`` for Qwen2, ``model.transformer`` for GPT-2).

    For a PEFT model, the body of its base model, with the adapters' layers in it (as TRL reads it).
    """
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    body = getattr(model, model.base_model_prefix, None)
    if body is None or body is model:
        raise TypeError(f"model: cannot find the body of {type(model).__name__} (base_model_prefix "
                        f"{model.base_model_prefix!r}); use impl='reference'")
    return body


def position_ids_for(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Positions that start at 0 at each row's first unmasked token, so left padding does not shift them.

    Rotary models (Qwen2) are indifferent to a constant shift; models with absolute position
    embeddings (GPT-2) are not, and would score a left-padded row differently from the same row alone.
    """
    return None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def final_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) -> (B, T, H): the hidden states the LM head would read, without computing logits.

    An FSDP2 model's own parameters (those in no unit of their own, such as the input embedding) are gathered for
    the call and sharded again after it, without autograd: its forward hooks, which would reduce their gradient,
    do not run when the body is called alone."""
    from torch.distributed.fsdp import FSDPModule

    run_body = functools.partial(model_body(model), input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids_for(attention_mask), use_cache=False)
    if not isinstance(model, FSDPModule):
        return run_body().last_hidden_state
    if torch.is_grad_enabled():
        raise NotImplementedError("model: an FSDP2 model's log-probs with gradients come from its own forward; use "
                                  "logitless.trl's trainers, or call this under torch.no_grad()")
    model.unshard()
    try:
        return run_body().last_hidden_state
    finally:
        model.reshard()
