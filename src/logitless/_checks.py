"""Argument checks shared by every public function and command, in one error style: a ValueError/TypeError whose
message starts with the argument's name, so a user sees which input was wrong and what was expected.

* Plain values (numbers, strings, options, a GRPO group's size, a head's shapes).
* The public ops' keywords, checked by name before an op runs (`checked_keywords`): a keyword an op does not take
  is a TypeError naming the op and the nearest keyword it takes (``fused_grpo_loss: unknown keyword `softcapp`;
  did you mean `softcap`?``), a keyword of another spelling (`SPELLINGS`) names the spelling the op takes, and a
  head given whole (``head=LinearHead(...)``) together with its parts (``weight=``, ``temperature=``...) is
  refused. `check_impl` checks ``impl`` against the one vocabulary `IMPLS`.
* Tensors (`check_tensor`, masks, token ids), which import PyTorch when first called.

The module itself imports neither PyTorch nor JAX: the command line checks options before either loads, and
the PyTorch and JAX ops share it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch



def check_positive_finite(name: str, value) -> float:
    """A finite number > 0 as a float: an LM head's temperature, soft cap or logit scale."""
    return float(check_finite_number(name, value))


@dataclasses.dataclass(frozen=True, eq=False)
class HeadNumbers:
    """How an LM head's ``hidden @ weight.T + bias`` becomes logits, shared by the PyTorch `LinearHead` and the JAX
    `Head` (each adds its arrays, ``weight`` first and positional): keyword-only, each a finite number > 0 (a
    ``softcap`` of None: no cap), stored as floats."""

    _: dataclasses.KW_ONLY
    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "logit_scale", "softcap"):
            value = getattr(self, name)
            if value is not None or name != "softcap":
                object.__setattr__(self, name, check_positive_finite(name, value))


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


def check_answer_template(name: str, template) -> str:
    """A ``str.format`` template with one ``{answer}`` field and no other (literal braces doubled)."""
    import string

    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{name}: expected a non-empty template such as '> \\boxed{{{{{{answer}}}}}} </answer>', "
                         f"got {template!r}")
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as err:
        raise ValueError(f"{name}: {err} in {template!r} (write a literal brace twice: {{{{ }}}})") from None
    if fields != ["answer"]:
        raise ValueError(f"{name}: expected exactly one field, {{answer}}, where the reference answer goes, got "
                         f"{fields} in {template!r} (write a literal brace twice: {{{{ }}}})")
    return template


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


def check_beta(beta) -> float:
    """The generalized JSD's ``beta``, which picks the divergence (the PyTorch and JAX ops'): a number in [0, 1]."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta: expected a number in [0, 1], got {beta!r}")
    return float(beta)


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


def check_completion_mask_given(completion_mask) -> None:
    """The GRPO loss's normalizers count the tokens of its ``completion_mask``: it is not optional."""
    if completion_mask is None:
        raise TypeError("completion_mask: expected a (B, T) mask, 1 where a completion token counts, got None")


def check_grpo_options(settings, has_ref_log_probs: bool, num_items_in_batch=None) -> None:
    """What a GRPO loss's validated `GRPOSettings` cannot say alone, whatever the array library: beta != 0
    needs ``ref_log_probs``, and ``num_items_in_batch`` is a finite number > 0 when it is known (None: not given,
    or not known under a JAX trace)."""
    if settings.beta != 0 and not has_ref_log_probs:
        raise ValueError("ref_log_probs: required when beta != 0 (the KL penalty needs the reference log-probs)")
    if num_items_in_batch is not None:
        check_finite_number("num_items_in_batch", float(num_items_in_batch))


# -- the public ops' keywords ---------------------------------------------------------------------------------


# Every op's implementations: the block engine chosen per device, the materialized oracle, the block engine with
# the block math of the array library, the block engine with the Triton kernels (PyTorch's only).
IMPLS = ("auto", "reference", "chunked", "triton")
JAX_IMPLS = IMPLS[:3]

# keyword -> how the ops spell it
SPELLINGS = {
    "old_logprobs": "old_log_probs",
    "ref_logprobs": "ref_log_probs",
    "return_entropy": "return_token_entropy",
    "chunk_size": "block_sizes=BlockSizes(tokens=...)",
    "vocab_block_size": "block_sizes=BlockSizes(vocab=...)",
    "scale": "logit_scale",
}
IMPL_SPELLINGS = "impl: 'fused' is spelled 'auto' (or 'chunked'); 'materialized' is 'reference'"

# A head given whole, and the keywords that would give its parts: LinearHead(weight, bias=, temperature=,
# softcap=, logit_scale=).
HEAD_PARTS = ("weight", "bias", "temperature", "softcap", "logit_scale")


def head_wholes(*sides: str) -> dict[str, tuple[str, ...]]:
    """`checked_keywords`'s ``wholes`` for an op's heads, one per side suffix (``""``; ``"_p"``, ``"_q"`` for an op
    of two heads, whose weight and bias are named by side and whose head options are shared)."""
    return {f"head{side}": (f"weight{side}", f"bias{side}", *HEAD_PARTS[2:]) for side in sides}


def check_impl(impl, choices: Iterable[str] = IMPLS) -> str:
    """``impl`` if it is one of ``choices``; a ValueError naming ``impl`` (and the spelling of a value from another
    vocabulary) otherwise."""
    choices = tuple(choices)
    if impl in ("fused", "materialized"):
        raise ValueError(IMPL_SPELLINGS)
    if impl not in choices:
        where = " (the Triton kernels run in PyTorch only)" if impl == "triton" else ""
        raise ValueError(f"impl: expected one of {', '.join(map(repr, choices))}, got {impl!r}{where}")
    return impl


def unknown_keyword(op: str, name: str, known: Iterable[str]) -> TypeError:
    """The error for keyword ``name``, which ``op`` does not take: its spelling there, or the nearest of ``known``."""
    if name in SPELLINGS:
        return TypeError(f"{op}: keyword `{name}` is spelled `{SPELLINGS[name]}`")
    known = sorted(known)
    nearest = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean `{nearest[0]}`?" if nearest else f"the keywords are {', '.join(known)}"
    return TypeError(f"{op}: unknown keyword `{name}`; {hint}")


def checked_keywords(*, options: Iterable[str] = (), wholes: Mapping[str, Iterable[str]] | None = None) -> Callable:
    """A decorator for a public op: its keyword arguments are checked by name before it runs.

    ``options``: the keywords its ``**options`` may hold. ``wholes``: a keyword that gives a whole (``"head"``)
    -> the arguments that would give its parts (`HEAD_PARTS`); a call that gives both (not None) is refused.
    """
    option_names = frozenset(options)
    whole_parts = {whole: tuple(parts) for whole, parts in (wholes or {}).items()}

    def decorate(op: Callable) -> Callable:
        signature = inspect.signature(op)
        named = [p.name for p in signature.parameters.values()
                 if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL, p.POSITIONAL_ONLY)]
        positional = [p.name for p in signature.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        known = set(named) | option_names

        @functools.wraps(op)
        def checked(*args, **kwargs):
            for name in kwargs:
                if name not in known:
                    raise unknown_keyword(op.__name__, name, known)
            given = {**dict(zip(positional, args)), **kwargs}
            for whole, parts in whole_parts.items():
                if given.get(whole) is not None:
                    both = [part for part in parts if given.get(part) is not None]
                    if both:
                        raise TypeError(f"{op.__name__}: `{whole}` is given with {', '.join(f'`{p}`' for p in both)}; "
                                        f"give the head whole (its {', '.join(parts)} in it) or in parts")
            return op(*args, **kwargs)

        return checked

    return decorate


# -- tensors -----------------------------------------------------------------------------------------------------

def check_tensor(name: str, value, *, ndim: int | Sequence[int] | None = None, floating: bool = False,
                 integer: bool = False) -> torch.Tensor:
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            raise ValueError(f"{name}: expected {' or '.join(map(str, allowed))} dimensions, "
                             f"got shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {value.dtype}")
    if integer and value.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected token ids as an int64 (or int32) tensor, got {value.dtype}")
    return value


def check_same_shape(name: str, value: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if value.shape != other.shape:
        raise ValueError(f"{name}: shape {tuple(value.shape)} does not match {other_name} shape {tuple(other.shape)}")


def check_finite(name: str, value: torch.Tensor) -> None:
    import torch

    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = (~torch.isfinite(value)).nonzero()[0].tolist()
        raise ValueError(f"{name}: contains NaN or inf (first at index {bad})")


def check_mask(name: str, mask, like_name: str, like: torch.Tensor) -> torch.Tensor:
    """A mask is bool or 0/1 numbers, of the same shape as the tensor it masks; returns it as bool."""
    import torch

    check_tensor(name, mask)
    check_same_shape(name, mask, like_name, like)
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name}: expected a bool or 0/1 mask, found other values")
    return mask != 0


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    check_tensor(name, ids, integer=True)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{name}: token ids must lie in [0, {vocab_size}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")


def completion_text(name: str, value) -> str:
    """A completion as text: a string, or a conversation whose last message holds it."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict) and isinstance(value[-1].get("content"), str):
        return value[-1]["content"]
    raise TypeError(f"{name}: expected a string or a list of messages, got {type(value).__name__}")
