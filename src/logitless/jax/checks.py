"""Argument checks for the JAX ops: each error starts with the argument's name, as in `logitless._checks`.

Shapes and dtypes are checked always (they are known under jit too). Checks of values (mask entries,
token id ranges, finite advantages) run only on concrete arrays: under `jax.jit` the values are not
known when the function is traced.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from logitless.jax.head import Head



def concrete(value) -> np.ndarray | None:
    """The values of ``value`` when they are known now (not a tracer under jit), else None."""
    return None if isinstance(value, jax.core.Tracer) else np.asarray(value)


def check_array(name: str, value, *, ndim: int | Sequence[int] | None = None, floating: bool = False,
                integer: bool = False) -> jax.Array:
    """``value`` as a jax array; a NumPy array is accepted and converted."""
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{name}: expected a jax.Array, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.ndim not in allowed:
            raise ValueError(f"{name}: expected {' or '.join(map(str, allowed))} dimensions, "
                             f"got shape {tuple(value.shape)}")
    if floating and not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{name}: expected a floating-point array, got {value.dtype}")
    if integer and not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer array of token ids, got {value.dtype}")
    return jnp.asarray(value)


def check_same_shape(name: str, value, other_name: str, other) -> None:
    if tuple(value.shape) != tuple(other.shape):
        raise ValueError(f"{name}: shape {tuple(value.shape)} does not match {other_name} shape {tuple(other.shape)}")


def check_mask(name: str, mask, like_name: str, like) -> jax.Array:
    """A bool or 0/1 mask of ``like``'s shape, returned as bool."""
    mask = check_array(name, mask)
    check_same_shape(name, mask, like_name, like)
    if mask.dtype == jnp.bool_:
        return mask
    values = concrete(mask)
    if values is not None and not ((values == 0) | (values == 1)).all():
        raise ValueError(f"{name}: expected a bool or 0/1 mask, found other values")
    return mask != 0


def check_token_ids(name: str, ids, vocab_size: int, keep=None) -> None:
    """Ids (where ``keep``, if given) lie in [0, vocab_size), when they are concrete."""
    values, kept = concrete(ids), None if keep is None else concrete(keep)
    if values is None or (keep is not None and kept is None):
        return
    if kept is not None:
        values = values[kept]
    if values.size and (values.min() < 0 or values.max() >= vocab_size):
        raise ValueError(f"{name}: token ids must lie in [0, {vocab_size}), got range [{values.min()}, {values.max()}]")


def check_finite(name: str, value) -> None:
    values = concrete(value)
    if values is not None and not np.isfinite(values).all():
        first = np.argwhere(~np.isfinite(values))[0].tolist()
        raise ValueError(f"{name}: contains NaN or inf (first at index {first})")


def take_head(head, weight, bias, temperature, softcap, logit_scale, hidden, suffix: str = "") -> Head:
    """An op's head: ``head`` given whole, or built from its parts (``weight`` ...), checked against ``hidden``
    (..., H). The arguments are named with ``suffix`` (``weight_q``, ``head_q``). (`logitless._checks.checked_keywords`
    refuses a head given both ways.)"""
    if head is not None:
        if not isinstance(head, Head):
            raise TypeError(f"head{suffix}: expected a Head, got {type(head).__name__}")
    elif weight is None:
        raise TypeError(f"weight{suffix}: required (or the whole head as head{suffix}=Head(...))")
    else:
        head = Head(weight, bias=bias, temperature=temperature, softcap=softcap, logit_scale=logit_scale)
    weight = check_array(f"weight{suffix}", head.weight, ndim=2, floating=True)
    hidden_name = f"hidden{suffix}"
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight{suffix}: hidden size {weight.shape[1]} does not match {hidden_name}'s last dim "
                         f"{hidden.shape[-1]}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight{suffix}: dtype {weight.dtype} differs from {hidden_name}'s {hidden.dtype}")
    bias = head.bias
    if bias is not None:
        bias = check_array(f"bias{suffix}", bias, ndim=1, floating=True)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias{suffix}: length {bias.shape[0]} does not match the vocabulary size "
                             f"{weight.shape[0]}")
        values = concrete(bias)
        if values is not None and (np.isnan(values).any() or np.isposinf(values).any()):
            raise ValueError(f"bias{suffix}: contains NaN or +inf (only -inf, for vocabulary rows that can never be "
                             "sampled, is allowed)")
    return Head(weight, bias=bias, temperature=head.temperature, softcap=head.softcap,
                logit_scale=head.logit_scale)
