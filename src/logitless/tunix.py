"""Tunix's learners on logitless's fused head: `use_fused_head()` makes Tunix 0.1.7's RL learners (GRPO, PPO), its DPO
and ORPO trainer, its PEFT trainer's default cross-entropy and its logit distillation score tokens through
`logitless.jax`'s fused ops from the models' final hidden states, without the ``(B, T, V)`` fp32 logits.

Each of Tunix's functions that reads logits is a module or class attribute that Tunix looks up when it runs; the switch
replaces them (`_SEAMS`) and `use_stock_head()` gives them back:

- ``tunix.rl.common.compute_per_token_logps``, which the GRPO and PPO losses, the reference and old-policy scoring of
  ``RLCluster`` and the rollouts call, and ``tunix.rl.algo_core.compute_entropy_from_logits``, which the losses take
  the entropy with. The replacement `compute_per_token_logps` has Tunix's signature and returns Tunix's values; where
  Tunix returns the logits (``return_logits=True``, which its losses ask for only to take their entropy) it returns a
  `TokenEntropy` instead, which the replaced ``compute_entropy_from_logits`` reads.
- ``tunix.rl.common.get_per_token_logps``, DPO's and ORPO's scoring of the chosen and rejected completions.
- ``tunix.sft.peft_trainer._default_loss_fn``, the PEFT trainer's loss (a trainer made before the switch takes the
  replacement too).
- ``LogitStrategy``'s output and loss methods (`logitless.tunix_distillation`).

Tunix's loss code runs unchanged on all but the distillation strategy's. Needs the ``tunix`` extra (``pip install
'logitless[tunix]'``). See docs/tunix.md.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from logitless.jax import fused_linear_logprobs

try:
    from flax import nnx
    from tunix.rl import algo_core, common
    from tunix.sft import peft_trainer
    from tunix.sft.peft_trainer import PeftTrainer
except ImportError as err:  # say how to get it, not just that it is missing
    raise ImportError("logitless.tunix needs Tunix: pip install 'logitless[tunix]'") from err

from logitless import tunix_distillation
from logitless.tunix_models import final_states

TUNIX_VERSION = "0.1.7"  # the release built against: the functions replaced take the arguments these do


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
    except (AttributeError, TypeError, ValueError):  # no __call__: the model check names what it scores
        return False
    return keyword in parameters or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())


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
    final_hidden, head = final_states(model, input_tokens, **model_kwargs)  # (B, L, H), L = P + C

    scored = input_tokens.shape[1] - 1 if segment_ids is not None else completion_tokens.shape[1]
    scoring_hidden = final_hidden[:, -scored - 1:-1]  # (B, S, H): the state before each scored token
    scored_ids = input_tokens[:, -scored:]  # (B, S)
    head = dataclasses.replace(head, temperature=1.0 if temperature in (0.0, 1.0) else temperature)
    outputs = fused_linear_logprobs(scoring_hidden, targets=scored_ids, head=head, return_token_entropy=return_logits)
    log_probs, entropy = outputs if return_logits else (outputs, None)  # (B, S) each
    if segment_ids is not None:  # (B, L - 1) -> (B, L), as Tunix aligns the packed row
        log_probs = jnp.pad(log_probs, ((0, 0), (1, 0)), constant_values=0.0)
        if return_logits:
            entropy = jnp.pad(entropy, ((0, 0), (1, 0)), constant_values=math.log(head.vocab_size))
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


@nnx.jit(static_argnames=("logits_to_keep",))
def get_per_token_logps(model, input_tokens: jax.Array, positions: jax.Array, attn_mask: jax.Array,
                        logits_to_keep: int, images: jax.Array | None = None) -> jax.Array:
    """Tunix 0.1.7's ``tunix.rl.common.get_per_token_logps`` (same arguments, same values), which scores DPO's and
    ORPO's chosen and rejected completions, on the fused head: ``model`` runs on ``input_tokens`` (B, L) to its final
    hidden states, and the head scores the last ``logits_to_keep`` = K tokens, each from the state before it.
    Returns the log-probs (B, K) fp32."""
    kwargs = {} if images is None else {"images": images}
    final_hidden, head = final_states(model, input_tokens, positions=positions, attention_mask=attn_mask, cache=None,
                                      **kwargs)  # (B, L, H)
    return fused_linear_logprobs(final_hidden[:, -logits_to_keep - 1:-1], targets=input_tokens[:, -logits_to_keep:],
                                 head=head)


def default_loss_fn(model, input_tokens: jax.Array, input_mask: jax.Array, positions: jax.Array,
                    attention_mask: jax.Array, images: jax.Array | None = None) -> jax.Array:
    """Tunix 0.1.7's ``tunix.sft.peft_trainer._default_loss_fn`` (same arguments, same value), the PEFT trainer's
    cross-entropy, on the fused head: the mean over the tokens of ``input_mask`` (B, L) after the first of minus the
    log-prob of each, from the state before it."""
    kwargs = {} if images is None else {"images": images}
    final_hidden, head = final_states(model, input_tokens, positions=positions, attention_mask=attention_mask,
                                      cache=None, **kwargs)  # (B, L, H)
    log_probs = fused_linear_logprobs(final_hidden[:, :-1], targets=input_tokens[:, 1:], head=head)  # (B, L - 1)
    target_mask = input_mask[:, 1:]
    norm_factor = 1 / (jnp.sum(target_mask) + 1e-8)  # as Tunix's
    return -jnp.sum(log_probs * target_mask.astype(log_probs.dtype)) * norm_factor


_SEAMS = (  # (owner, name, ours): what the switch replaces, each looked up by Tunix when it runs
    (common, "compute_per_token_logps", compute_per_token_logps),  # the RL learners' scoring
    (algo_core, "compute_entropy_from_logits", compute_entropy_from_logits),  # their entropy
    (common, "get_per_token_logps", get_per_token_logps),  # DPO's and ORPO's scoring
    (peft_trainer, "_default_loss_fn", default_loss_fn),  # the PEFT trainer's loss (read when one is made)
    *tunix_distillation.SEAMS,  # LogitStrategy's methods that read the student's and the teacher's logits
)
_STOCK: list = []  # (owner, name, what its own attributes held: _INHERITED where a class inherited it), switch on
_INHERITED = object()


def _check_tunix() -> None:
    """Tunix's functions take the arguments ours take: a release that changed one is refused by name."""
    for owner, name, ours in _SEAMS:
        theirs = list(inspect.signature(getattr(owner, name)).parameters)
        if theirs != list(inspect.signature(ours).parameters):
            raise RuntimeError(f"logitless.tunix is built against Tunix {TUNIX_VERSION}, whose {name} takes "
                               f"({', '.join(inspect.signature(ours).parameters)}); this Tunix's takes "
                               f"({', '.join(theirs)})")


class FusedHead:
    """The switch, on; as a context manager it turns it off on leaving (`use_stock_head`)."""

    def __enter__(self) -> FusedHead:
        return self

    def __exit__(self, *exc_info) -> None:
        use_stock_head()


def _retrace_compiled_steps(replaced: dict) -> None:
    """Every live Tunix trainer drops its compiled train and eval steps, and JAX its caches of traced functions,
    which hold the scoring they were traced with: the next step of every learner is traced with the scoring now
    switched on, so no step mixes the two. A trainer whose loss is a function just replaced (the PEFT trainer's
    default, which it took when it was made) takes its replacement: ``replaced`` {old: new}."""
    for trainer in [found for found in gc.get_objects() if issubclass(type(found), PeftTrainer)]:
        trainer.clear_jit_cache()
        for old, new in replaced.items():
            if trainer.loss_fn is old:
                trainer.loss_fn = new
            if trainer.eval_loss_fn is old:
                trainer.eval_loss_fn = new
    jax.clear_caches()


def use_fused_head() -> FusedHead:
    """Make Tunix score tokens on logitless's fused head: replaces each of Tunix's functions in `_SEAMS` with this
    module's (once: a second call changes nothing). It takes effect at any time: the steps Tunix's trainers compiled
    before are traced again at their next call. Returns a `FusedHead`, which as a context manager switches back on
    leaving."""
    if not _STOCK:
        _check_tunix()
        replaced = {}
        for owner, name, ours in _SEAMS:
            replaced[getattr(owner, name)] = ours
            _STOCK.append((owner, name, vars(owner).get(name, _INHERITED)))
            setattr(owner, name, ours)
        _retrace_compiled_steps(replaced)
    return FusedHead()


def use_stock_head() -> None:
    """Give Tunix its own functions back (nothing to do when the switch is off); the steps compiled with the switch
    on are traced again at their next call."""
    if _STOCK:
        replaced = {}
        while _STOCK:
            owner, name, stock = _STOCK.pop()
            ours = getattr(owner, name)
            if stock is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, stock)
            replaced[ours] = getattr(owner, name)
        _retrace_compiled_steps(replaced)


def fused_head_in_use() -> bool:
    """Whether Tunix scores tokens through this module (`use_fused_head` is on)."""
    return common.compute_per_token_logps is compute_per_token_logps


__all__ = ["FusedHead", "TokenEntropy", "compute_entropy_from_logits", "compute_per_token_logps", "default_loss_fn",
           "fused_head_in_use", "get_per_token_logps", "use_fused_head", "use_stock_head"]
