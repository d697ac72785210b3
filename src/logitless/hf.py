"""Hugging Face adapters: a causal LM's head as a `LinearHead`, its body, and the hidden states its head reads.

Everything logit-free starts here: run the body (the transformer under the LM head) to get the hidden states
the head would read, and hand them with the head to the fused ops. Where transformers' causal LMs differ between
the body and the logits, this module reads each structure it knows (`head_structure` names them):

- the body: the module under ``base_model_prefix``, or, where that prefix names a composite model's text part
  (Llama 4's and Mllama's causal LMs: ``language_model``), the language model the causal LM holds as ``model``;
- the hidden states the head reads: the body's last hidden state (ProphetNet's: its first predicting stream),
  through the transform a BERT-style head applies before its output embedding (dense, activation, LayerNorm:
  BERT, RoBERTa and their kin, ModernBERT's decoder, ELECTRA's generator), divided by a muP width multiplier
  (Inkling);
- the head: the output embedding (tied or not, with its bias), its rows of the vocabulary the logits keep
  (``unpadded_vocab_size``), the logit scale and the soft cap the config names.

What a model's forward does beyond these, no config says: `logitless.hf_probe` checks each model against its own
forward once before its head is read.
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
# cap * tanh(logits / cap): Gemma 2/3/3n/4, nanochat, Mistral Large 4 (final_logit_softcapping); RecurrentGemma
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap")
_MUP_DIVISOR = "logits_mup_width_multiplier"  # Inkling: the head reads the hidden states divided by it
_PREDICTING_STREAMS = "ngram"  # ProphetNet: the head reads the first of its n-gram predicting streams
_UNPADDED_VOCABULARY = "unpadded_vocab_size"  # Inkling: the logits keep the first rows of a padded output embedding
# A model holding its output embedding as ``decoder`` beside the transform module before it, by their attribute names:
# (output embedding, transform). ModernBERT's decoder, ELECTRA's generator.
_TRANSFORM_BESIDE = (("decoder", "lm_head"), ("generator_lm_head", "generator_predictions"))
# Modules that hold the output embedding as their ``decoder`` and transform the hidden states before it: BERT's
# (``transform``), RoBERTa's (dense, GELU, LayerNorm written out) and RemBERT's (dense, its activation, LayerNorm).
_TRANSFORM_HOLDERS = ("cls.predictions", "lm_head")


def _text_config(model):
    return model.config.get_text_config()  # composite (vision-language) configs keep these on the text part


def _causal_lm(model):
    """The transformers model itself: a PEFT model's base model (with the adapters' layers in it, as TRL reads it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft.PeftModel


def _output_embedding(model) -> torch.nn.Module:
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"model: {type(model).__name__} has no output embedding (get_output_embeddings())")
    return head


def vocabulary_rows(model) -> int:
    """How many tokens ``model``'s logits score: its output embedding's rows, or the unpadded part of them."""
    rows = _output_embedding(model).weight.shape[0]
    unpadded = getattr(_text_config(model), _UNPADDED_VOCABULARY, None)
    return unpadded if isinstance(unpadded, int) and 0 < unpadded < rows else rows


def _logit_scale(config) -> float:
    scale = next((getattr(config, name) for name in _LOGIT_MULTIPLIERS if getattr(config, name, None) is not None),
                 None)
    if scale is None and getattr(config, _LOGIT_DIVISOR, None) is not None:
        divisor = float(getattr(config, _LOGIT_DIVISOR))
        scale = divisor if config.model_type in _MULTIPLIES_BY_LOGITS_SCALING else 1.0 / divisor
    return 1.0 if scale is None else float(scale)


def _softcap(config) -> float | None:
    return next((float(getattr(config, name)) for name in _SOFTCAPS if getattr(config, name, None)), None)


def lm_head_of(model, temperature: float = 1.0) -> LinearHead:
    """The output embedding of ``model`` as a `LinearHead` (tied or not, with its bias, logit scale and soft cap if it
    has them, its rows the unpadded vocabulary), whose logits are the model's divided by ``temperature``, from the
    hidden states `head_hidden_states` gives."""
    head = _output_embedding(model)
    config = _text_config(model)
    rows = vocabulary_rows(model)
    weight, bias = head.weight, getattr(head, "bias", None)
    if rows < weight.shape[0]:
        weight, bias = weight[:rows], None if bias is None else bias[:rows]
    return LinearHead(weight, bias=bias, temperature=temperature, softcap=_softcap(config),
                      logit_scale=_logit_scale(config))


def _nested_language_model(model):
    """The language model a causal LM holds as ``model`` when its ``base_model_prefix`` names none of its modules
    (Llama 4's and Mllama's causal LMs, whose prefix is the composite model's ``language_model``), else None."""
    from transformers import PreTrainedModel

    if getattr(model, model.base_model_prefix, None) is not None:
        return None
    nested = getattr(model, "model", None)
    return nested if isinstance(nested, PreTrainedModel) and nested is not model else None


def model_body(model):
    """The transformer under a causal LM's head (``model.model`` for Qwen2, ``model.transformer`` for GPT-2; the
    language model Llama 4's and Mllama's causal LMs hold).

    For a PEFT model, the body of its base model, with the adapters' layers in it (as TRL reads it).
    """
    model = _causal_lm(model)
    body = getattr(model, model.base_model_prefix, None)
    if body is None:
        body = _nested_language_model(model)
    if body is None or body is model:
        raise TypeError(f"model: cannot find the body of {type(model).__name__} (base_model_prefix "
                        f"{model.base_model_prefix!r}); use impl='reference'")
    return body


def _written_out_transform(holder: torch.nn.Module):
    """RoBERTa's LM head (and its copies: GELU) and RemBERT's (its ``activation``): LayerNorm(act(dense(h)))."""
    norm = getattr(holder, "layer_norm", None) or getattr(holder, "LayerNorm", None)
    if not isinstance(getattr(holder, "dense", None), torch.nn.Linear) or norm is None:
        return None
    activation = getattr(holder, "activation", None) or torch.nn.functional.gelu
    return lambda hidden: norm(activation(holder.dense(hidden)))


def _head_transform(model):
    """What ``model``'s head applies to the body's hidden states before its output embedding (H -> H'), or None."""
    model = _causal_lm(model)
    output_embedding = model.get_output_embeddings()
    for output_name, transform_name in _TRANSFORM_BESIDE:
        transform = getattr(model, transform_name, None)
        if getattr(model, output_name, None) is output_embedding and isinstance(transform, torch.nn.Module):
            return transform
    for path in _TRANSFORM_HOLDERS:
        try:
            holder = model.get_submodule(path)
        except AttributeError:
            continue
        if getattr(holder, "decoder", None) is output_embedding:
            transform = getattr(holder, "transform", None)
            return transform if isinstance(transform, torch.nn.Module) else _written_out_transform(holder)
    return None


def _mup_divisor(model) -> float | None:
    divisor = getattr(_text_config(model), _MUP_DIVISOR, None)
    return float(divisor) if isinstance(divisor, (int, float)) and divisor != 1 else None


def _predicting_streams(model) -> bool:
    """Whether ``model``'s body predicts in n-gram streams beside its main one (ProphetNet: ``ngram``)."""
    ngram = getattr(_text_config(model), _PREDICTING_STREAMS, None)
    return isinstance(ngram, int) and ngram > 0


def head_hidden_states(model, body_outputs) -> torch.Tensor:
    """(B, T, H) the hidden states ``model``'s output embedding reads, from its body's outputs (`model_body`): the last
    hidden state (ProphetNet's first predicting stream), through the head's transform, divided by the muP width
    multiplier, as the model's own forward computes them."""
    hidden = body_outputs.last_hidden_state  # (B, T, H)
    if _predicting_streams(model):  # ProphetNet: last_hidden_state_ngram (B, ngram * T, H), stream after stream
        hidden = body_outputs.last_hidden_state_ngram[:, :hidden.shape[1]]  # the first stream predicts the next token
    transform = _head_transform(model)
    if transform is not None:
        hidden = transform(hidden)
    divisor = _mup_divisor(model)
    return hidden if divisor is None else hidden / divisor


def head_structure(model) -> tuple[str, ...]:
    """What ``model``'s head is, as this module reads it: ("plain",), or among "tied", "bias", "scaled",
    "soft-capped", "transformed", "muP-divided", "padded vocabulary", "predicting stream", "nested language model"."""
    causal_lm = _causal_lm(model)
    output_embedding = _output_embedding(model)
    config = _text_config(model)
    input_embedding = model.get_input_embeddings()
    found = {
        "tied": input_embedding is not None and output_embedding.weight is getattr(input_embedding, "weight", None),
        "bias": getattr(output_embedding, "bias", None) is not None,
        "scaled": _logit_scale(config) != 1.0,
        "soft-capped": _softcap(config) is not None,
        "transformed": _head_transform(model) is not None,
        "muP-divided": _mup_divisor(model) is not None,
        "padded vocabulary": vocabulary_rows(model) < output_embedding.weight.shape[0],
        "predicting stream": _predicting_streams(model),
        "nested language model": _nested_language_model(causal_lm) is not None,
    }
    return tuple(name for name, present in found.items() if present) or ("plain",)


def position_ids_for(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Positions that start at 0 at each row's first unmasked token, so left padding does not shift them.

    Rotary models (Qwen2) are indifferent to a constant shift; models with absolute position
    embeddings (GPT-2) are not, and would score a left-padded row differently from the same row alone.
    """
    return None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def final_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) -> (B, T, H): the hidden states the LM head would read (`head_hidden_states`), without computing logits.

    An FSDP2 model's own parameters (those in no unit of their own, such as the input embedding) are gathered for
    the call and sharded again after it, without autograd: its forward hooks, which would reduce their gradient,
    do not run when the body is called alone."""
    from torch.distributed.fsdp import FSDPModule

    run_body = functools.partial(model_body(model), input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids_for(attention_mask), use_cache=False)
    if not isinstance(model, FSDPModule):
        return head_hidden_states(model, run_body())
    if torch.is_grad_enabled():
        raise NotImplementedError("model: an FSDP2 model's log-probs with gradients come from its own forward; use "
                                  "logitless.trl's trainers, or call this under torch.no_grad()")
    model.unshard()
    try:
        return head_hidden_states(model, run_body())
    finally:
        model.reshard()
