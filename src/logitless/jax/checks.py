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
