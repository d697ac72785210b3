"""The command line: every option of every subcommand is documented with its default; errors are one line."""

import argparse
import re
import subprocess
import sys

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
    assert {"logitless demo", "logitless sft", "logitless grpo", "logitless verifree", "logitless grade",
            "logitless bench",
            "logitless bench lmhead", "logitless bench grpo", "logitless bench reward", "logitless bench jax",
            "logitless bench grade", "logitless bench grade-variance", "logitless bench learning"} <= set(commands)
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
    assert "--loss-type {grpo,bnpo,dr_grpo,dapo,cispo,sapo,vespo}" in usage
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


HEAVY_MODULES = ("torch", "transformers", "trl", "peft", "jax", "matplotlib", "datasets")


MISSING = "no-such-data.jsonl"


@pytest.mark.parametrize("argv, status", [(["--version"], 0), (["grpo", "--help"], 0), (["sft", "--steps", "-1"], 1),
                                          (["bench", "lmhead", "--help"], 0), (["demo", "--steps", "0"], 1),
                                          (["grade", "--method", "x"], 2), (["bench", "grade", "--steps", "0"], 1),
                                          *[([command, "--data", MISSING], 1)
                                            for command in ("sft", "grpo", "verifree", "grade", "distill")],
                                          (["distill", "--teacher", __file__], 1),
                                          (["bench", "compile", "--targets", "sm_75"], 1)])
def test_help_version_and_option_errors_answer_without_loading_pytorch(argv, status, tmp_path):
    """Every command took 11 - 14 s to say anything, --version and a mistyped option included: the parser imported
    the demo, transformers' Trainer and PEFT; a missing --data file took 14 s, and a --teacher that is a file 12 s.
    Nothing heavy may load before a command runs or checks its files (`logitless bench cli` measures the time:
    docs/BENCHMARKS.md)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "logitless", *argv], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == status, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert sorted(imported & set(HEAVY_MODULES)) == []
    if status == 1:  # a bad value: one line, prefixed by the command as argparse's own errors are
        message = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
        assert len(message) == 1 and message[0].startswith(f"logitless {' '.join(argv[:-2])}: --"), message
