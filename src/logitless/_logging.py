"""The library's logger: `logging.getLogger("logitless")`, whose INFO messages (a trainer's line saying what scores
its tokens) and warnings reach stderr by default, as transformers and datasets configure their own loggers. A
handler is added only where the application has configured none for logitless or the root logger; silence it
with ``logging.getLogger("logitless").setLevel(logging.WARNING)``."""

from __future__ import annotations

import logging

LOGGER = logging.getLogger("logitless")


def configure() -> None:
    """Give the library's logger a stderr handler at INFO, unless logitless's or the root logger has a handler."""
    if LOGGER.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(handler)
    if LOGGER.level == logging.NOTSET:
        LOGGER.setLevel(logging.INFO)
