"""The keyword arguments of the public ops, checked by name before an op runs, and the one ``impl`` vocabulary.

Nothing here imports PyTorch or JAX: the PyTorch ops and the JAX ops share it.

* `checked_keywords` wraps a public op so that a keyword it does not take is a TypeError that names the op and
  the nearest keyword it does take (``fused_grpo_loss: unknown keyword `softcapp`; did you mean `softcap`?``),
  and a keyword of another spelling (`SPELLINGS`) names the spelling the op takes. An op with ``**options``
  names the keywords those options may be (a GRPO op: the fields of `GRPOSettings`). A head given whole
  (``head=LinearHead(...)``) and its parts (``weight=``, ``temperature=``...) in one call is refused too.
* `check_impl` checks ``impl`` against `IMPLS` (or a backend's part of it), and names the spelling of a value
  from another vocabulary.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping

# Every op's implementations: the block engine chosen per device, the materialized oracle, the block engine with
# the PyTorch block math, the block engine with the Triton kernels. A backend takes a part (JAX: no "triton").
IMPLS = ("auto", "reference", "chunked", "triton")

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


def check_impl(impl, choices: Iterable[str] = IMPLS) -> str:
    """``impl`` if it is one of ``choices``; a ValueError naming ``impl`` (and the spelling of a value from another
    vocabulary) otherwise."""
    choices = tuple(choices)
    if impl in ("fused", "materialized"):
        raise ValueError(IMPL_SPELLINGS)
    if impl not in choices:
        raise ValueError(f"impl: expected one of {', '.join(map(repr, choices))}, got {impl!r}")
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
