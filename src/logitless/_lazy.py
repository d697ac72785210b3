"""Imports that wait until they are used, so that ``logitless --help`` answers without loading PyTorch.

`exports` gives a package the ``__getattr__`` and ``__dir__`` that import a public name's module on first
access (``from logitless import fused_linear_logprobs`` works as before); `later` is a command handler
whose module is imported when the command runs, not when its options are parsed.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def exports(package: str, names: dict[str, str]):
    """(``__getattr__``, ``__dir__``) for ``package``, whose public ``names`` live in the modules they map to."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(names[name]), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__


def later(module: str, function: str) -> Callable:
    """``module.function``, imported when it is first called."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), function)(*args, **kwargs)

    call.__qualname__ = call.__name__ = function
    return call
