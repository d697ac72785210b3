"""Argument checks shared by every public function, on plain values (numbers, strings, options); tensors are
checked in `logitless._tensor_checks`. Nothing here imports PyTorch, so option checks run before it loads.

Each helper raises ValueError/TypeError whose message starts with the argument's name,
so a user sees which input was wrong and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence


def check_positive_finite(name: str, value) -> float:
    """A finite number > 0 as a float: an LM head's temperature, soft cap or logit scale."""
    return float(check_finite_number(name, value))


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_strings(name: str, values) -> list[str]:
    """A list (or other sequence, not a str) of strings."""
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise TypeError(f"{name}: expected a list of strings, got {type(values).__name__}")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise TypeError(f"{name}[{i}]: expected a string, got {type(value).__name__}")
    return list(values)


def switch_setting(variable: str) -> str:
    """An on/off environment switch (``LOGITLESS_TRITON``, ``LOGITLESS_ONE_PASS``): "auto" (unset), "0" or "1"."""
    setting = os.environ.get(variable, "auto")
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"{variable}: expected auto, 0 or 1, got {setting!r}")
    return setting


def check_positive_int(name: str, value) -> int:
    """An int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def check_nonnegative_int(name: str, value, zero_means: str = "") -> int:
    """An int >= 0 (not a bool); ``zero_means`` says what 0 does, for the error message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        meaning = f" (0: {zero_means})" if zero_means else ""
        raise ValueError(f"{name}: expected an int >= 0{meaning}, got {value!r}")
    return value


def check_positive_ints(config, names: Sequence[str]) -> None:
    """Each named attribute of ``config`` is an int >= 1."""
    for name in names:
        check_positive_int(name, getattr(config, name))


def check_finite_number(name: str, value, *, allow_zero: bool = False) -> float:
    """A finite number > 0 (>= 0 with ``allow_zero``), not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}: expected a finite number {'>=' if allow_zero else '>'} 0, got {value}")
    return value


def check_finite_numbers(config, names: Sequence[str], *, allow_zero: bool = False) -> None:
    """Each named attribute of ``config`` is a finite number > 0 (>= 0 with ``allow_zero``)."""
    for name in names:
        check_finite_number(name, getattr(config, name), allow_zero=allow_zero)


def dataclass_from_dict(cls, values: dict):
    """``cls(**values)``, naming any key that is not one of the dataclass's fields."""
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config: unknown key(s) {unknown}; known: {sorted(known)}")
    return cls(**values)


def check_generations(num_generations: int, completions: int) -> None:
    """GRPO groups: at least two completions per prompt, and whole groups per step."""
    if num_generations < 2 or completions % num_generations:
        raise ValueError(f"num_generations: must be >= 2 and divide the {completions} completions per step, "
                         f"got {num_generations}")


def check_head_shapes(hidden, weight, targets, targets_name: str = "targets") -> None:
    """hidden (..., H), weight (V, H) of hidden's dtype, targets (...): for torch tensors and JAX arrays alike."""
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: hidden size {weight.shape[1]} does not match hidden's last dim {hidden.shape[-1]}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"{targets_name}: shape {tuple(targets.shape)} does not match hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}")


def check_advantages_shape(shape, num_sequences: int, length: int) -> None:
    """GRPO advantages are one per sequence, (B,) or (B, 1), or one per token, (B, T)."""
    if tuple(shape) not in ((num_sequences,), (num_sequences, 1), (num_sequences, length)):
        raise ValueError(f"advantages: expected ({num_sequences},), ({num_sequences}, 1) or per token "
                         f"({num_sequences}, {length}), got {tuple(shape)}")


def check_grpo_options(settings, has_ref_log_probs: bool, num_items_in_batch=None, *,
                       ref_name: str = "ref_logprobs") -> None:
    """What a GRPO loss's validated `GRPOSettings` cannot say alone, whatever the array library: beta != 0
    needs the reference log-probs (the argument ``ref_name``), and ``num_items_in_batch`` is a finite number > 0
    when it is known (None: not given, or not known under a JAX trace)."""
    if settings.beta != 0 and not has_ref_log_probs:
        raise ValueError(f"{ref_name}: required when beta != 0 (the KL penalty needs the reference log-probs)")
    if num_items_in_batch is not None:
        check_finite_number("num_items_in_batch", float(num_items_in_batch))
