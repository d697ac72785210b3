"""Command-line options made from a recipe's config dataclass, and errors that name the option.

A recipe lists the fields a user may set with a help text (``HELP``); `add_config_options` turns each
into ``--field-name`` whose help ends with the dataclass default (and whose usage lists the values of a
field in the config class's ``CHOICES``, or names its value as the class's ``METAVARS`` say), plus
``--config FILE.yaml`` taking the same fields by name. `config_from_args` merges the two (the command
line wins) and builds the config; every problem becomes a one-line ``SystemExit`` that starts with the
option at fault (`option_error`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import yaml


class _ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; a learning rate written that way must be a float."""


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)?\.?[0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def option(name: str) -> str:
    """A config field's command-line spelling: learning_rate -> --learning-rate."""
    return "--" + name.replace("_", "-")


def option_error(err: Exception, names) -> SystemExit:
    """A one-line SystemExit for a ValueError/TypeError whose message starts with ``field: ``: the field is
    spelled as its option when it is one of ``names``, and so are the other fields of ``names`` with an
    underscore that the message mentions ("must divide batch_size 2" -> "must divide --batch-size 2"), except
    in an error of ``config`` (a --config file), which names its keys as the file spells them."""
    name, separator, message = str(err).partition(": ")
    if not (separator and name in set(names)):
        return SystemExit(str(err))
    for other in names if name != "config" else ():
        if "_" in other:
            message = re.sub(rf"(?<![\w-]){other}(?!\w)", option(other), message)
    return SystemExit(f"{option(name)}: {message}")


def option_fields(config_class, args: argparse.Namespace) -> list[str]:
    """The fields of ``config_class`` that are options of the command ``args`` was parsed for; errors spell
    them as options (a field only a --config file sets keeps its name)."""
    return [field.name for field in dataclasses.fields(config_class) if hasattr(args, field.name)]


def load_config(path: str | None) -> dict:
    """The mapping in a ``--config`` YAML file ({} without one); errors name ``--config``."""
    if path is None:
        return {}
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"--config: no such file {path!r}")
    try:
        values = yaml.load(file.read_text(), Loader=_ConfigLoader) or {}
    except yaml.YAMLError as err:
        raise SystemExit(f"--config: {path} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(values, dict):
        raise SystemExit(f"--config: {path} must hold a mapping of option: value")
    return values


def with_default(text: str, default) -> str:
    """An option's help ``text`` ending with "(default: X)", unless it states its default already."""
    if "(default" in text:
        return text
    def show(value):  # a string whose spaces or newlines matter is quoted, as it would be typed in a shell
        return repr(value) if isinstance(value, str) and value != value.strip() else str(value)

    shown = " ".join(map(show, default)) or "none" if isinstance(default, (tuple, list)) else show(default)
    return f"{text} (default: {shown})"


def add_config_options(parser: argparse.ArgumentParser, config_class, helps: dict[str, str]) -> None:
    """``--config`` and one option per field named in ``helps`` (in that order). A help text
    that does not state its default gets the dataclass's. Unset options stay None, so `config_from_args`
    can tell them from values given on the command line."""
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="YAML file of these options by field name, e.g. 'learning_rate: 1e-3'; options given "
                             "on the command line win (default: none)")
    fields = {field.name: field for field in dataclasses.fields(config_class)}
    choices = getattr(config_class, "CHOICES", {})  # field -> its values, shown in the usage line
    metavars = getattr(config_class, "METAVARS", {})  # field -> its value's name in --help
    for name in helps:  # in the order of ``helps``
        field = fields[name]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        text = with_default(helps[field.name], default)
        if field.type == "bool":
            flag = option(field.name) if not default else "--no-" + field.name.replace("_", "-")
            parser.add_argument(flag, dest=field.name, action="store_const", const=not default, default=None,
                                help=text)
        elif field.type.startswith("tuple"):
            parser.add_argument(option(field.name), dest=field.name, nargs="+",
                                metavar=metavars.get(field.name, field.name.upper()), help=text)
        elif field.name in choices:
            parser.add_argument(option(field.name), dest=field.name, choices=choices[field.name], help=text)
        else:
            kind = {"int": int, "float": float}.get(field.type.split(" |")[0], str)
            parser.add_argument(option(field.name), dest=field.name, type=kind,
                                metavar=metavars.get(field.name, field.name.upper()), help=text)


def add_config_parser(subcommands, name: str, summary: str, config_class, helps: dict[str, str], run,
                      description: str) -> argparse.ArgumentParser:
    """The subcommand ``name`` whose options are `add_config_options`'s. Its handler builds ``config_class`` from
    them (a bad value ends the command at once, naming its option) and returns ``run(config, args)``: pass a
    `logitless._lazy.later` function, so that what the command runs is imported only when it runs."""
    parser = subcommands.add_parser(name, help=summary, description=description)
    add_config_options(parser, config_class, helps)
    parser.set_defaults(handler=lambda args: run(config_from_args(config_class, args), args))
    return parser


def config_from_args(config_class, args: argparse.Namespace):
    """``config_class`` from ``--config`` and the options given; a bad value exits naming its option."""
    names = [field.name for field in dataclasses.fields(config_class)]
    values = load_config(args.config)
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    try:
        return config_class.from_dict({**values, **given})
    except (TypeError, ValueError) as err:
        raise option_error(err, ["config", *option_fields(config_class, args)]) from None  # config: its unknown keys
