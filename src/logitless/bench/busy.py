"""Busy processes beside a measurement or the test suite: what a shared machine does (another suite, another job).

``with busy_processes(2):`` starts two processes that each keep one core busy with a pure-Python loop, and
stops them on the way out, whatever happened inside.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` processes spinning on one core each for the duration of the block (none for 0)."""
    processes = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _main(argv: list[str]) -> int:
    """``python -m logitless.bench.busy COUNT COMMAND...``: run COMMAND with COUNT busy processes beside it; its
    exit status is returned (``make test-loaded`` runs the test suite so)."""
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m logitless.bench.busy COUNT COMMAND [ARGS...]", file=sys.stderr)
        return 2
    with busy_processes(int(argv[0])):
        return subprocess.run(argv[1:]).returncode


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
