"""`logitless bench cli`: how long the command line takes to answer ``--version``, ``--help``, a bad option, a missing
data file and a model directory that is a file.

Each command runs in a fresh process (``python -m logitless ...``, in an empty temporary directory that also holds the
file given as a model), ``repeats`` times, optionally with busy processes beside it (`bench.busy`); the report gives
the median and the slowest wall time of each, against the 2 s a user should wait at most.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from logitless.bench.busy import busy_processes
from logitless.bench.options import benchmark_parser, require_positive, require_writable, rows_so_far, write_report

A_FILE = "notes.txt"  # a file in the working directory, given where a model directory is expected
COMMANDS = (("--version",), ("grpo", "--help"), ("sft", "--steps", "-1"), ("bench", "lmhead", "--help"),
            ("distill", "--data", "missing.jsonl"), ("distill", "--teacher", A_FILE))
LIMIT_S = 2.0  # what a user should wait at most for any of them


def _wall_time(argv: tuple[str, ...], directory: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "logitless", *argv], capture_output=True, timeout=120, cwd=directory)
    return time.perf_counter() - started


def run(repeats: int, busy: int) -> dict:
    """{command: {median_s, max_s, times_s}}, measured with ``busy`` busy processes beside each run."""
    import platform

    results = rows_so_far({})
    with busy_processes(busy), tempfile.TemporaryDirectory() as directory:
        (Path(directory) / A_FILE).write_text("not a model\n")
        for argv in COMMANDS:
            times = [_wall_time(argv, Path(directory)) for _ in range(repeats)]
            results["logitless " + " ".join(argv)] = {"median_s": statistics.median(times), "max_s": max(times),
                                                      "times_s": times}
    return {"repeats": repeats, "busy_processes": busy, "limit_s": LIMIT_S, "python": platform.python_version(),
            "results": results}


def format_table(report: dict) -> str:
    lines = [f"command line answers, {report['repeats']} fresh processes each, {report['busy_processes']} busy "
             f"process(es) beside them", f"{'command':<46}{'median s':>10}{'max s':>8}  within {report['limit_s']} s"]
    for name, r in report["results"].items():
        within = "yes" if r["max_s"] <= report["limit_s"] else "NO"
        lines.append(f"{name:<46}{r['median_s']:>10.2f}{r['max_s']:>8.2f}  {within}")
    return "\n".join(lines)


def add_parser(targets) -> None:
    parser = benchmark_parser(
        targets, "cli",
        "how long `logitless --version`, `--help` and a bad option take to answer",
        "Wall time of `logitless --version`, `logitless grpo --help`, `logitless sft --steps -1`, "
        "`logitless bench lmhead --help`, `logitless distill --data missing.jsonl` and `logitless distill --teacher "
        "notes.txt` (a file, not a model directory), each in a fresh process, --repeats times, with --busy busy "
        "processes beside them: the median and the slowest, against 2 s.")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (default: %(default)s)")
    parser.add_argument("--busy", type=int, default=0,
                        help="processes spinning on a core each beside the measurement (default: %(default)s)")
    parser.add_argument("--json", help="write the report here (default: not written)")
    parser.set_defaults(handler=_main)


def _main(args) -> int:
    require_positive(args, ("repeats",))
    if args.busy < 0:
        raise SystemExit(f"--busy: must be >= 0, got {args.busy}")
    require_writable(args, ("json",))
    return write_report(run(args.repeats, args.busy), args, format_table)
