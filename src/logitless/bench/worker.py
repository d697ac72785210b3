"""Running one benchmark worker in a fresh Python process and reading back its JSON result."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable

from logitless.bench.options import rows_so_far


def run_worker_process(module: str, arguments: list[str]) -> dict:
    """``python -m MODULE ARGUMENTS...``; the worker prints its result as JSON on its last line.

    A fixed mmap threshold makes glibc return large freed blocks to the OS, so memory freed before a
    measurement (a warm-up step, say) cannot hide the measured work's allocations from the RSS peak.
    """
    done = subprocess.run([sys.executable, "-m", module, *arguments], capture_output=True, text=True,
                          env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072"))
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(arguments[:2])} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_variants(module: str, variants: Iterable[str], arguments: list[str], desc: str, progress: bool = True) -> dict:
    """{variant: result} of ``python -m MODULE --worker VARIANT ARGUMENTS...``, one fresh process after another,
    under a progress bar; the results so far are what an interrupt keeps (`options.rows_so_far`)."""
    from tqdm.auto import tqdm

    results = rows_so_far({})
    for variant in tqdm(list(variants), desc=desc, disable=not progress):
        results[variant] = run_worker_process(module, ["--worker", variant, *arguments])
    return results


def worker_main(run_worker: Callable, config_class, choices: tuple[str, ...], directory_flag: str) -> int:
    """The ``python -m logitless.bench.X --worker NAME DIRECTORY_FLAG DIR --config JSON`` entry point."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=choices, required=True)
    parser.add_argument(directory_flag, dest="directory", required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    print(json.dumps(run_worker(args.worker, args.directory, config_class(**json.loads(args.config)))))
    return 0
