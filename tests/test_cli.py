"""The command line: every option of every subcommand is documented with its default; errors are one line."""

import argparse
import re

import pytest

from logitless.cli import build_parser, main


def _subcommands(parser: argparse.ArgumentParser, prefix=("logitless",)):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _subcommands(child, prefix + (name,))


def test_every_option_has_help_with_its_default():
    commands = {" ".join(path): parser for path, parser in _subcommands(build_parser())}
    assert {"logitless demo", "logitless sft", "logitless grpo", "logitless grade", "logitless bench lmhead",
            "logitless bench grpo", "logitless bench reward", "logitless bench jax", "logitless bench grade",
            "logitless bench grade-variance"} <= set(commands)
    undocumented = [f"{name} {action.option_strings[0]}" for name, parser in commands.items()
                    for action in parser._actions
                    if action.option_strings and not isinstance(action, argparse._HelpAction)
                    and not (action.help and re.search(r"\(default[: ]", action.help))]
    assert undocumented == []


def test_help_shows_the_dataclass_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--learning-rate LEARNING_RATE AdamW learning rate, constant (default: 0.003)" in text
    assert "--no-resume" in text and "--allow-changed OPTION [OPTION ...]" in text


def test_usage_errors_are_one_line_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--steps", "many"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --steps: invalid int value: 'many'" in err
