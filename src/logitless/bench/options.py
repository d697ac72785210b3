"""What every ``logitless bench`` command checks before it starts, and how it writes its report.

Each check ends the command with one line that names the option at fault, before any benchmark runs:
a long measurement must not be lost to a typo in ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from logitless.rundir import check_writable_file


def require_positive(args: argparse.Namespace, names) -> None:
    """Each of ``names`` (None allowed: "not set") is at least 1."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1, got {value}")


def require_writable(args: argparse.Namespace, names=("json", "plot")) -> None:
    """Each output path among ``names`` that was given can be written (its directory is created)."""
    for name in names:
        path = getattr(args, name, None)
        if path is not None:
            try:
                check_writable_file(path)
            except OSError as err:
                raise SystemExit(f"--{name}: cannot write {path}: {err.strerror or err}") from None


def write_report(report: dict, json_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}")


def choices_metavar(choices) -> str:
    """``{a,b,c}``: how argparse shows ``choices=`` in usage. The options that take it keep checking their
    value in the command itself, so that a wrong one ends with the command's one line naming the option."""
    return "{" + ",".join(choices) + "}"
