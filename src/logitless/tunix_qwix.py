"""How `logitless.tunix` reads a Tunix model that qwix wrapped for LoRA or quantization (``qwix.apply_lora_to_model``,
``qwix.quantize_model``): qwix gives the model a subclass whose ``__call__`` runs the model's own with its provider's
interception on, which hands each matmul to the first of the provider's rules whose ``module_path`` matches the path
of the module running it. Where no rule matches the head module's path, the head's matmul runs as without qwix, and
the fused head computes what it computes; `check_head_untouched` proves that or refuses the model in one line.

qwix keeps the provider in the closure of that ``__call__`` (qwix 0.1.8, as Tunix 0.1.7 installs it); a model whose
provider is not found there, or is not one whose rules act only where they match (`READ_PROVIDERS`), is refused.
"""

from __future__ import annotations

import functools
import re

from qwix import LoraProvider, PtqProvider, QtProvider, QuantizationRule
from qwix._src.model import _output_transform_nnx

READ_PROVIDERS = (LoraProvider, PtqProvider, QtProvider)  # each acts on a matmul only where a rule matches its module
_USE_STOCK_HEAD = "logitless.tunix.use_stock_head() scores it"


def _provider(model_class: type):
    """The provider qwix wrapped ``model_class.__call__`` with (None: not found), read from the closure of qwix's
    wrapper, whose output transform is ``partial(_output_transform_nnx, provider, "__call__")``."""
    call = model_class.__call__
    free_names = getattr(getattr(call, "__code__", None), "co_freevars", ())
    closure = dict(zip(free_names, getattr(call, "__closure__", None) or ()))
    transform = closure["output_transform"].cell_contents if "output_transform" in closure else None
    if (isinstance(transform, functools.partial) and transform.func is _output_transform_nnx
            and transform.args[1:] == ("__call__",)):
        return transform.args[0]
    return None


def check_head_untouched(model, head) -> None:
    """Refuses ``model``, wrapped by qwix, in one line unless none of its provider's rules matches the path of
    ``head``, the module whose matmul computes its logits: LoRA there adds to the logits, quantization rounds them."""
    name = f"a {model._unquantized_type.__name__} wrapped by qwix"
    provider = _provider(type(model))
    rules = getattr(provider, "_rules", None)
    if (type(provider) not in READ_PROVIDERS or not isinstance(rules, list)
            or not all(isinstance(rule, QuantizationRule) for rule in rules)):
        found = "no provider" if provider is None else type(provider).__name__
        raise NotImplementedError(
            f"model: {name} is refused: logitless.tunix reads the rules of qwix's "
            f"{', '.join(cls.__name__ for cls in READ_PROVIDERS)}, found {found}; {_USE_STOCK_HEAD}")
    path = getattr(head, "qwix_path", None)
    if not isinstance(path, tuple):
        raise NotImplementedError(f"model: {name} is refused: its head has no qwix path; {_USE_STOCK_HEAD}")
    path = "/".join(map(str, path))  # as qwix joins it
    matching = [rule.module_path for rule in rules if re.fullmatch(rule.module_path, path)]  # whatever its op_names
    if matching:
        raise NotImplementedError(
            f"model: {name} is refused: its {type(provider).__name__}'s rule module_path={matching[0]!r} matches "
            f"its head {path!r} (LoRA or quantization of the logits, which the fused head would leave out); "
            f"{_USE_STOCK_HEAD}")
