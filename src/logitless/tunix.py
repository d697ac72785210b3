"""Tunix's policy scoring on logitless's fused head: `use_fused_head()` makes Tunix 0.1.7's RL learners score the
policy, the old policy and the reference model, and read the entropy, through `logitless.jax.fused_linear_logprobs`
from the model's final hidden states, without the ``(B, P + C, V)`` fp32 logits.

Every Tunix caller (the GRPO and PPO losses, the reference and old-policy scoring of ``RLCluster``, the rollouts)
looks ``compute_per_token_logps`` up through ``tunix.rl.common`` when it runs, and the losses read the entropy through
``tunix.rl.algo_core.compute_entropy_from_logits``: the switch replaces those two module attributes. The replacement
`compute_per_token_logps` has Tunix's signature and returns Tunix's values; where Tunix returns the logits
(``return_logits=True``, which its losses ask for only to take their entropy) it returns a `TokenEntropy` instead,
which the replaced ``compute_entropy_from_logits`` reads. Tunix's loss code runs unchanged on both.

Needs the ``tunix`` extra (``pip install 'logitless[tunix]'``). See docs/tunix.md.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from logitless.jax import fused_linear_logprobs

try:
    from flax import nnx
    from tunix.models.gemma.model import Gemma
    from tunix.models.gemma3.model import Gemma3
    from tunix.models.gemma4.model import Gemma4
    from tunix.models.llama3.model import Llama3
    from tunix.models.qwen2.model import Qwen2
    from tunix.models.qwen3.model import Qwen3
    from tunix.rl import algo_core, common
    from tunix.sft.peft_trainer import PeftTrainer
except ImportError as err:  # say how to get it, not just that it is missing
    raise ImportError("logitless.tunix needs Tunix: pip install 'logitless[tunix]'") from err

TUNIX_VERSION = "0.1.7"  # the release built against: its compute_per_token_logps takes the arguments this one does


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


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenEntropy:
    """What the switched `compute_per_token_logps` returns where Tunix returns the logits: the entropy of each scored
    token's distribution (after the temperature), ``entropy`` (B, S) fp32, which `compute_entropy_from_logits` reads.
    Code that needs the logits themselves runs with the switch off."""

    entropy: jax.Array  # (B, S)


def _takes(model, keyword: str) -> bool:
    """Whether ``model.__call__`` takes ``keyword`` (by name or through ``**kwargs``), as Tunix asks it."""
    try:
        parameters = inspect.signature(model.__call__).parameters
    except (TypeError, ValueError):
        return False
    return keyword in parameters or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _detach_head(model) -> tuple[jax.Array, jnp.dtype | None, float | None]:
    """The output embedding (V, H) of ``model`` (a merged copy, changed in place), the dtype its head casts its input
    and weight to (None: it casts neither), and the final soft cap (None: none); the model's head and cap are then
    the identity, so that calling the model returns its final hidden states (B, L, H), cast as its logits would
    be."""
    family = FAMILIES.get(type(model))
    if family is None:
        names = ", ".join(cls.__name__ for cls in FAMILIES)
        raise TypeError(f"model: logitless.tunix scores Tunix's {names}, got {type(model).__module__}."
                        f"{type(model).__name__}")
    tied = family.tied(model.config)
    head, weight_name = (model.embedder, "input_embedding") if tied else (model.lm_head, "w")
    variables = sorted(name for name, value in vars(head).items()
                       if isinstance(value, nnx.Variable) and name not in family.other_variables)
    if variables != [weight_name]:  # an adapter (LoRA) on the head would be left out of the fused logits
        raise NotImplementedError(f"model: its head holds {variables}; logitless.tunix scores a plain head "
                                  f"({weight_name!r} only)")
    weight = head.input_embedding[...] if tied else head.w[...].T  # (V, H); an lm_head's is (H, V)
    dtype = family.head_dtype(head)
    if tied:
        model.embedder.decode = _identity  # encode still embeds the ids
    else:
        model.lm_head = _identity
    return weight, dtype, family.take_softcap(model)


def _identity(hidden):
    return hidden


@partial(jax.jit, static_argnames=("pad_id", "eos_id", "stop_gradient", "return_logits", "temperature"))
def compute_per_token_logps(graphdef, state, prompt_tokens: jax.Array, completion_tokens: jax.Array, pad_id: int,
                            eos_id: int, images: jax.Array | None = None, stop_gradient: bool = True,
                            return_logits: bool = False, segment_ids: jax.Array | None = None,
                            segment_positions: jax.Array | None = None, temperature: float = 1.0):
    """Tunix 0.1.7's ``tunix.rl.common.compute_per_token_logps`` (same arguments, same values) on the fused head.

    The model (``graphdef``, ``state``) runs on the prompt and completion ids (B, P) and (B, C) as in Tunix, to its
    final hidden states; the head scores only the positions Tunix keeps: each completion token from the state before
    it, (B, C), or with sequence packing (``segment_ids``) every token but the first of the packed row, (B, L - 1),
    returned padded in front to (B, L) with a 0 as Tunix pads them. ``temperature`` divides the logits unless it is
    0 or 1, as in Tunix. Returns the log-probs (fp32), and with ``return_logits`` also a `TokenEntropy` in place of
    the logits (in the padded front position, log V: the entropy of Tunix's zero row of padded logits).
    ``stop_gradient`` stops both.
    """
    model = nnx.merge(graphdef, state)
    weight, head_dtype, softcap = _detach_head(model)  # (V, H)
    input_tokens, positions, attention_mask, padding_segments = common.process_ids(
        prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids, segment_positions)
    model_kwargs = {"positions": positions, "cache": None, "attention_mask": attention_mask}
    if _takes(model, "segment_ids"):
        if segment_ids is not None:
            model_kwargs["segment_ids"] = segment_ids
        elif padding_segments is not None:
            model_kwargs["segment_ids"] = padding_segments
    if images is not None:
        model_kwargs["images"] = images
    final_hidden, _ = model(input_tokens, **model_kwargs)  # (B, L, H), L = P + C
    if head_dtype is None:  # a head that casts nothing computes in the promoted dtype of its input and weight
        head_dtype = jnp.result_type(final_hidden.dtype, weight.dtype)
    head_weight = weight.astype(head_dtype)  # as the model's head computes
    final_hidden = final_hidden.astype(head_dtype)  # exact: the states were in this dtype before any fp32 cast

    scored = input_tokens.shape[1] - 1 if segment_ids is not None else completion_tokens.shape[1]
    scoring_hidden = final_hidden[:, -scored - 1:-1]  # (B, S, H): the state before each scored token
    scored_ids = input_tokens[:, -scored:]  # (B, S)
    outputs = fused_linear_logprobs(scoring_hidden, head_weight, scored_ids,
                                    temperature=1.0 if temperature in (0.0, 1.0) else temperature,
                                    softcap=softcap, return_token_entropy=return_logits)
    log_probs, entropy = outputs if return_logits else (outputs, None)  # (B, S) each
    if segment_ids is not None:  # (B, L - 1) -> (B, L), as Tunix aligns the packed row
        log_probs = jnp.pad(log_probs, ((0, 0), (1, 0)), constant_values=0.0)
        if return_logits:
            entropy = jnp.pad(entropy, ((0, 0), (1, 0)), constant_values=math.log(head_weight.shape[0]))
    if stop_gradient:
        log_probs = jax.lax.stop_gradient(log_probs)
        entropy = None if entropy is None else jax.lax.stop_gradient(entropy)
    return (log_probs, TokenEntropy(entropy)) if return_logits else log_probs


def compute_entropy_from_logits(logits) -> jax.Array:
    """``tunix.rl.algo_core.compute_entropy_from_logits`` that also reads a `TokenEntropy`: its entropy (B, S), or
    Tunix's entropy of logits (B, S, V)."""
    if isinstance(logits, TokenEntropy):
        return logits.entropy
    return _tunix_entropy(logits)


_tunix_entropy = algo_core.compute_entropy_from_logits  # Tunix's own, whatever the switch
_STOCK: dict = {}  # what the switch replaced, while it is on: "logps" and "entropy"


def _check_tunix() -> None:
    """Tunix's function has the arguments ours takes: a release that changed them is refused by name."""
    stock = common.compute_per_token_logps
    ours = inspect.signature(compute_per_token_logps).parameters
    theirs = inspect.signature(stock).parameters
    if list(theirs) != list(ours):
        raise RuntimeError(f"logitless.tunix is built against Tunix {TUNIX_VERSION}, whose compute_per_token_logps "
                           f"takes ({', '.join(ours)}); this Tunix's takes ({', '.join(theirs)})")


class FusedHead:
    """The switch, on; as a context manager it turns it off on leaving (`use_stock_head`)."""

    def __enter__(self) -> FusedHead:
        return self

    def __exit__(self, *exc_info) -> None:
        use_stock_head()


def _retrace_compiled_steps() -> None:
    """Every live Tunix trainer drops its compiled train and eval steps, and JAX its caches of traced functions,
    which hold the scoring they were traced with: the next step of every learner is traced with the scoring now
    switched on, so no step mixes the two."""
    for trainer in [found for found in gc.get_objects() if issubclass(type(found), PeftTrainer)]:
        trainer.clear_jit_cache()
    jax.clear_caches()


def use_fused_head() -> FusedHead:
    """Make Tunix score tokens on logitless's fused head: replaces ``tunix.rl.common.compute_per_token_logps`` and
    ``tunix.rl.algo_core.compute_entropy_from_logits`` with this module's (once: a second call changes nothing).
    It takes effect at any time: the steps Tunix's trainers compiled before are traced again at their next call.
    Returns a `FusedHead`, which as a context manager switches back on leaving."""
    if not _STOCK:
        _check_tunix()
        _STOCK.update(logps=common.compute_per_token_logps, entropy=algo_core.compute_entropy_from_logits)
        common.compute_per_token_logps = compute_per_token_logps
        algo_core.compute_entropy_from_logits = compute_entropy_from_logits
        _retrace_compiled_steps()
    return FusedHead()


def use_stock_head() -> None:
    """Give Tunix its own functions back (nothing to do when the switch is off); the steps compiled with the switch
    on are traced again at their next call."""
    if _STOCK:
        common.compute_per_token_logps = _STOCK.pop("logps")
        algo_core.compute_entropy_from_logits = _STOCK.pop("entropy")
        _retrace_compiled_steps()


def fused_head_in_use() -> bool:
    """Whether Tunix scores tokens through this module (`use_fused_head` is on)."""
    return common.compute_per_token_logps is compute_per_token_logps


__all__ = ["FusedHead", "TokenEntropy", "compute_entropy_from_logits", "compute_per_token_logps", "fused_head_in_use",
           "use_fused_head", "use_stock_head"]
