"""Fixed-width text tables of a benchmark's rows, as `format_table` prints them: each column a header, a format spec
(``"<6"``, ``">9.3f"``; the header takes its alignment and width) and how a row's value is read."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import NamedTuple


MB_PER_BYTE = 1e-6  # the tables' MB are 10^6 bytes


class Column(NamedTuple):
    header: str
    spec: str
    value: Callable[[dict], object]


def column(header: str, spec: str, key: str, scale: float = 1.0) -> Column:
    """The column of ``row[key] * scale`` (``row[key]`` itself where ``scale`` is 1: a string is written as it is)."""
    return Column(header, spec, itemgetter(key) if scale == 1.0 else lambda row: row[key] * scale)


def header_line(columns: Iterable[Column]) -> str:
    return "".join(format(c.header, re.match(r"[<>^]?\d*", c.spec).group()) for c in columns)


def row_line(columns: Iterable[Column], row: dict) -> str:
    return "".join(format(c.value(row), c.spec) for c in columns)
