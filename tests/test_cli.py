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


def test_every_command_has_a_description_and_every_option_its_default_in_one_format():
    commands = {" ".join(path): parser for path, parser in _subcommands(build_parser())}
    assert {"logitless demo", "logitless sft", "logitless grpo", "logitless grade", "logitless bench",
            "logitless bench lmhead", "logitless bench grpo", "logitless bench reward", "logitless bench jax",
            "logitless bench grade", "logitless bench grade-variance"} <= set(commands)
    assert [name for name, parser in commands.items() if not parser.description] == []
    options = [(f"{name} {action.option_strings[0]}", action.help or "") for name, parser in commands.items()
               for action in parser._actions
               if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))]
    assert [name for name, text in options if "(default: " not in text] == []
    assert [name for name, text in options if re.search(r"\(default [^(]", text)] == []  # one format: "(default: X)"


def test_fixed_choices_are_shown_in_the_usage_line(capsys):
    for command in (["grade"], ["grpo"], ["sft"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
    usage = capsys.readouterr().out
    assert "--method {gumbel,ste,gumbel_legacy,ste_legacy,grpo,all}" in usage
    assert "--reward {capitalized,words,token,classifier,judge}" in usage
    assert "--loss-type {dapo,grpo,bnpo,dr_grpo,cispo,sapo,vespo}" in usage
    assert usage.count("--on-nonfinite {stop,skip}") >= 3


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
    with pytest.raises(SystemExit):
        main(["grpo", "--loss-type", "foo"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --loss-type: invalid choice: 'foo'" in err
