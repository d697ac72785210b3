"""What every ``logitless bench`` command checks before it starts, and how it writes its report.

Each check ends the command with one line that names the option at fault, before any benchmark runs:
a long measurement must not be lost to a typo in ``--json``.
"""

from __future__ import annotations

import argparse
import importlib.util
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
    """Each output path among ``names`` that was given can be written (its directory is created), and a ``--plot``
    can be drawn (matplotlib is installed)."""
    if "plot" in names and getattr(args, "plot", None) is not None and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot: needs matplotlib, which is not installed: pip install 'logitless[plots]'")
    for name in names:
        path = getattr(args, name, None)
        if path is not None:
            try:
                check_writable_file(path)
            except OSError as err:
                raise SystemExit(f"--{name}: cannot write {path}: {err.strerror or err}") from None


def add_device_option(parser, indexed: bool = True) -> None:
    """--device: cpu or cuda, with a GPU index where ``indexed`` (else the one a trainer picks itself)."""
    meaning = "cpu or cuda[:N]" if indexed else "cpu or cuda (the trainer's GPU: the first CUDA_VISIBLE_DEVICES names)"
    parser.add_argument("--device", default="cpu", help=f"{meaning} (default: %(default)s)")
    parser.set_defaults(device_indexed=indexed)


def require_device(args: argparse.Namespace) -> None:
    """``--device`` (where the command has one) is cpu or cuda (with an index where the command takes one), on a
    machine with CUDA for the latter."""
    device = getattr(args, "device", None)
    if device is None:
        return
    indexed = args.device_indexed and device.startswith("cuda:") and device[5:].isdigit()
    if device not in ("cpu", "cuda") and not indexed:
        raise SystemExit(f"--device: expected {'cpu or cuda[:N]' if args.device_indexed else 'cpu or cuda'}, "
                         f"got {device!r}")
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device: CUDA is not available on this machine")


def add_model_option(parser) -> None:
    from logitless.models import EMBEDDED_DEFAULT, EMBEDDED_MODELS

    parser.add_argument("--model", default=EMBEDDED_DEFAULT,
                        help=f"an embedded model ({', '.join(EMBEDDED_MODELS)}: random weights, the real Qwen "
                             "vocabulary) or a local model directory (default: %(default)s)")


def require_model(args: argparse.Namespace) -> None:
    """``--model`` is an embedded model's name or an existing directory."""
    from logitless.models import EMBEDDED_MODELS

    if args.model not in EMBEDDED_MODELS and not Path(args.model).expanduser().is_dir():
        raise SystemExit(f"--model: {args.model!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}) "
                         "nor a directory")


_rows_so_far: dict = {}  # the running benchmark's results, filled row by row (`rows_so_far`)


def rows_so_far(results: dict) -> dict:
    """Register ``results`` (returned as it is), the dict a benchmark fills with its rows as they finish, so that an
    interrupt writes the rows that finished (`interrupted`)."""
    global _rows_so_far
    _rows_so_far = results
    return results


def finished_rows(results: dict, path: tuple[str, ...] = ()) -> list[str]:
    """The rows of a results dict, each named by its keys ("compile ce plain"): a dict that holds measurements (a
    value that is not a dict) is a row, a dict of dicts holds rows."""
    rows = []
    for key, value in results.items():
        if isinstance(value, dict) and all(isinstance(item, dict) for item in value.values()):  # {} holds none yet
            rows += finished_rows(value, (*path, str(key)))
        else:
            rows.append(" ".join((*path, str(key))))
    return rows


def interrupted(args: argparse.Namespace) -> str:
    """What an interrupted benchmark leaves, said after "interrupted while measuring; ": the rows that finished,
    written to ``--json`` (marked ``"interrupted": true``) when one was given."""
    rows = finished_rows(_rows_so_far)
    done = f"{len(rows)} row{'' if len(rows) == 1 else 's'} finished" + (f" ({', '.join(rows)})" if rows else "")
    if not args.json:
        return f"{done}; no --json was given to keep them"
    options = {name: value for name, value in vars(args).items() if name != "handler" and not callable(value)}
    Path(args.json).write_text(json.dumps({"interrupted": True, "options": options, "results": _rows_so_far},
                                          indent=2, default=str))
    return f"{done}: written to {args.json}"


def write_report(report: dict, args: argparse.Namespace, format_table, plot=None) -> int:
    """A benchmark's ending: its table printed, the report written to ``--json`` and drawn by ``plot`` to
    ``--plot`` (where given); the command's exit status."""
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if plot is not None and args.plot:
        print(f"wrote {plot(report, args.plot)}")
    return 0


def choices_metavar(choices) -> str:
    """``{a,b,c}``: how argparse shows ``choices=`` in usage. The options that take it keep checking their
    value in the command itself, so that a wrong one ends with the command's one line naming the option."""
    return "{" + ",".join(choices) + "}"


def benchmark_parser(targets, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """``logitless bench NAME``'s parser: ``summary`` in the list of benchmarks, ``description`` in its --help."""
    return targets.add_parser(name, help=summary, description=description)


def add_shape_options(parser, defaults, dtypes, vocab_help: str = "vocabulary size") -> None:
    """--batch/-B, --seq/-T, --hidden/-H, --vocab/-V and --dtype of a benchmark's problem, defaulting to the
    fields of the same names of ``defaults``."""
    for flag, short, name, meaning in (("--batch", "-B", "batch", "completions"),
                                       ("--seq", "-T", "seq", "tokens per completion"),
                                       ("--hidden", "-H", "hidden", "hidden size"),
                                       ("--vocab", "-V", "vocab", vocab_help)):
        parser.add_argument(flag, short, dest=name, type=int, default=getattr(defaults, name),
                            help=f"{meaning} (default: %(default)s)")
    parser.add_argument("--dtype", default=defaults.dtype, metavar=choices_metavar(dtypes),
                        help="dtype of the hidden states and the weight (default: %(default)s)")


def add_report_options(parser, plot: bool = True) -> None:
    """--repeats, --json and (where ``plot``) --plot of a benchmark that times each implementation and draws bars."""
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed steps per implementation, median reported (default: %(default)s)")
    parser.add_argument("--json", help="write the report here (default: not written)")
    if plot:
        parser.add_argument("--plot", help="write a PNG bar chart here (default: not drawn)")
