"""How `logitless.tunix` reads the LM head of each Tunix 0.1.7 model family: `take_head` takes the head off a model
(its output is then the final hidden states where its logits were), and the `TakenHead` turns those states and the
head's weight into the operands of `logitless.jax`'s fused ops, cast as the model's head casts them.

Needs the ``tunix`` extra (``pip install 'logitless[tunix]'``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from logitless.jax import Head

try:
    from flax import nnx
    from tunix.models.gemma.model import Gemma
    from tunix.models.gemma3.model import Gemma3
    from tunix.models.gemma4.model import Gemma4
    from tunix.models.llama3.model import Llama3
    from tunix.models.qwen2.model import Qwen2
    from tunix.models.qwen3.model import Qwen3
except ImportError as err:  # say how to get it, not just that it is missing
    raise ImportError("logitless.tunix needs Tunix: pip install 'logitless[tunix]'") from err

from logitless.tunix_qwix import check_head_untouched  # qwix comes with Tunix


@dataclass(frozen=True)
class _Family:
    """How a Tunix 0.1.7 model family's ``__call__`` ends: the head is the input embedding's ``decode`` where
    ``tied(config)``, else the ``lm_head`` Einsum (its ``w`` (H, V)); ``head_dtype(head)`` is the dtype the head
    casts its input and weight to (None: it casts neither, and ``jnp.dot`` promotes them); ``take_softcap(model)``
    returns the final soft cap (None: none) and removes it from the model, whose output is then the hidden states."""

    tied: Callable
    head_dtype: Callable
    take_softcap: Callable
    other_variables: frozenset = frozenset()  # the head module's variables that are not the head (Gemma 4's)


def _no_softcap(model) -> None:
    return None


def _take_attribute_softcap(model) -> float | None:  # Gemma: ``final_logits_softcap`` on the model
    softcap, model.final_logits_softcap = model.final_logits_softcap, None
    return softcap


def _take_config_softcap(model) -> float | None:  # Gemma 4: ``final_logit_softcap`` in its config
    softcap = model.config.final_logit_softcap
    model.config = dataclasses.replace(model.config, final_logit_softcap=None)
    return softcap


_OWN_DTYPE = lambda head: head.dtype  # noqa: E731
_PROMOTED = lambda head: None  # noqa: E731
FAMILIES = {
    Qwen2: _Family(lambda config: config.use_tied_embedding, _OWN_DTYPE, _no_softcap),
    Qwen3: _Family(lambda config: config.use_tied_embedding, _OWN_DTYPE, _no_softcap),
    Llama3: _Family(lambda config: config.weight_tying, _PROMOTED, _no_softcap),
    Gemma: _Family(lambda config: True, _PROMOTED, _take_attribute_softcap),
    Gemma3: _Family(lambda config: True, _PROMOTED, _no_softcap),
    Gemma4: _Family(lambda config: True, lambda head: head.config.dtype, _take_config_softcap,
                    frozenset({"per_layer_input_embedding"})),
}  # the model classes logitless.tunix scores, each read as its __call__ computes its logits


@dataclass(frozen=True)
class TakenHead:
    """A model's LM head, taken off: its output embedding ``weight`` (V, H) as stored, the ``dtype`` its head casts
    its input and weight to (None: it casts neither) and its final ``softcap`` (None: none)."""

    weight: jax.Array  # (V, H)
    dtype: jnp.dtype | None
    softcap: float | None

    def applied(self, final_hidden: jax.Array, temperature: float = 1.0) -> tuple[jax.Array, Head]:
        """The final hidden states (..., H) and the head as the fused ops take them: both in the dtype the model's
        head computes in (exact for the states, which were in it before any fp32 cast), the head a `Head` with the
        soft cap and ``temperature``."""
        dtype = self.dtype or jnp.result_type(final_hidden.dtype, self.weight.dtype)
        return final_hidden.astype(dtype), Head(self.weight.astype(dtype), softcap=self.softcap,
                                                temperature=temperature)


def _identity(hidden):
    return hidden


def take_head(model, output: Callable = _identity) -> TakenHead:
    """Takes the head off ``model`` (a merged copy, changed in place), so that calling it returns ``output`` of its
    final hidden states (B, L, H) where it returned its logits (by default the states themselves, cast as its
    logits would be; ``output`` is kept in the model's graph, so it is one object for every call, not a closure).
    A model qwix wrapped (LoRA, quantization) is taken where none of its rules reaches the head
    (`tunix_qwix.check_head_untouched`)."""
    wrapped = getattr(type(model), "_unquantized_type", None)  # qwix's subclass of a LoRA or quantized model
    model_class = wrapped or type(model)
    family = FAMILIES.get(model_class)
    if family is None:
        names = ", ".join(cls.__name__ for cls in FAMILIES)
        raise TypeError(f"model: logitless.tunix scores Tunix's {names}, got {model_class.__module__}."
                        f"{model_class.__name__}")
    tied = family.tied(model.config)
    head, weight_name = (model.embedder, "input_embedding") if tied else (model.lm_head, "w")
    if wrapped is not None:  # its body runs under qwix's interception as it did; its head must be as without qwix
        check_head_untouched(model, head)
    variables = sorted(name for name, value in vars(head).items()
                       if isinstance(value, nnx.Variable) and name not in family.other_variables)
    if variables != [weight_name]:  # an adapter (LoRA) on the head would be left out of the fused logits
        raise NotImplementedError(f"model: its head holds {variables}; logitless.tunix scores a plain head "
                                  f"({weight_name!r} only)")
    weight = head.input_embedding[...] if tied else head.w[...].T  # (V, H); an lm_head's is (H, V)
    dtype = family.head_dtype(head)
    if tied:
        model.embedder.decode = output  # encode still embeds the ids
    else:
        model.lm_head = output
    return TakenHead(weight, dtype, family.take_softcap(model))


def final_states(model, input_tokens: jax.Array, **model_kwargs) -> tuple[jax.Array, Head]:
    """Runs a copy of ``model`` (sharing its arrays, so gradients reach them) without its head on ``input_tokens``
    (B, L) and ``model_kwargs``: its final hidden states (B, L, H) and its head, as `TakenHead.applied` gives them."""
    headless = nnx.merge(*nnx.split(model))
    head = take_head(headless)
    hidden, _ = headless(input_tokens, **model_kwargs)
    return head.applied(hidden)
