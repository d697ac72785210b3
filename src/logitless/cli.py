"""The ``logitless`` command: demo | sft | grpo | verifree | grade | distill | bench (lmhead | grpo | reward | jax |
grade | grade-variance | trl | cli | distributed).

Each subcommand's options live in a module of their own, which exposes ``add_parser(subcommands)`` (adding
its parser and a ``handler``); registering one is one line in `build_parser`. Those modules load no
PyTorch: what a command runs is imported when it runs, so ``--help``, ``--version`` and a bad option
answer at once.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import warnings

from logitless import __version__, demo_options, interrupts
from logitless._lazy import install_hint
from logitless.bench import cli as bench_cli
from logitless.recipes import distill_options, grade_options, grpo_options, sft_options, verifree_options


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line that names the option, as all of the command's errors are."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="logitless", description="LLM post-training without [B, T, V] logits")
    parser.add_argument("--version", action="version", version=f"logitless {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_options.add_parser(commands)
    sft_options.add_parser(commands)
    grpo_options.add_parser(commands)
    verifree_options.add_parser(commands)
    grade_options.add_parser(commands)
    distill_options.add_parser(commands)
    bench_cli.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; Ctrl-C and SIGTERM end it with one line and exit status 130 / 143. A one-line error
    starts with the command's name, as argparse's usage errors do ("logitless sft: --steps: ...")."""
    args = build_parser().parse_args(argv)
    name = " ".join([args.command, *([args.target] if args.command == "bench" else [])])  # "sft", "bench jax"
    command = f"logitless {name}"
    backend = "jax" if name == "bench jax" else "torch"
    if importlib.util.find_spec(backend) is None:  # before the command writes anything
        raise SystemExit(f"{command}: {install_hint(backend)}")
    # TRL 1.16 reads model.is_gradient_checkpointing at every generation, which transformers 5 deprecates:
    # a warning per step that the user can do nothing about
    with interrupts.handling(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        try:
            return args.handler(args)
        except SystemExit as stop:
            if isinstance(stop.code, str) and not stop.code.startswith("logitless "):
                raise SystemExit(f"{command}: {stop.code}") from None
            raise
        except ModuleNotFoundError as missing:
            hint = install_hint(missing.name or "")
            if hint is None:
                raise
            raise SystemExit(f"{command}: {hint}") from None
        except (KeyboardInterrupt, interrupts.Terminated) as interrupt:
            stopped_by = type(interrupt)
    # out of the except clause the interrupted frames are released, and with them the progress bars they held, which
    # close (drawing their last state) now rather than after the summary line when the process exits
    gc.collect()
    print(interrupts.summary(name), file=sys.stderr)
    return interrupts.EXIT_STATUS[stopped_by]


if __name__ == "__main__":
    sys.exit(main())
