"""Run directories: a command writes only into a directory it claimed, and resumes only what it would redo.

A run claims its output directory by writing ``logitless-run.json`` there: the command, the options
the run was started with, and every option change a resume was allowed to make. Then:

* a new or empty directory is claimed; a non-empty one without the file is refused (``overwrite``
  lets a run write into it beside the files there, unless one carries a name the run writes: nothing
  the run did not write is ever replaced);
* a directory claimed by another command is refused;
* writability is checked by writing that file, before any model is loaded or any step is trained;
* a resume compares the options that change the result with the recorded ones and refuses any
  difference that the caller did not allow (`RunDirectory.start`); allowed changes are recorded.

Errors are ValueErrors that start with the name of the option at fault (``output_dir: ...``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path


def remove_tree(path: str | Path) -> None:
    """Delete a directory so that it disappears at once: renamed to a hidden name, then removed."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}.deleting")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    shutil.rmtree(doomed)


MARKER = "logitless-run.json"


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync, and rename it over ``path``."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_json_atomically(path: str | Path, value) -> None:
    """`write_text_atomically` of ``value`` as indented JSON."""
    write_text_atomically(path, json.dumps(value, indent=2) + "\n")


def check_writable_file(path: str | Path) -> Path:
    """Raise OSError unless a file can be written at ``path`` (its directory is created; a probe file is
    written there and removed; nothing else is touched). For outputs named before long work starts."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
    probe.write_text("")
    probe.unlink()
    return path


def file_identity(path: str | None) -> str | None:
    """``path`` with a digest of its content when it is a file ("d.jsonl (sha256 3f2a...)"), so a resume
    notices an edited data file as well as another one."""
    if path is None or not Path(path).is_file():
        return path
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return f"{path} (sha256 {digest[:16]})"


def _describe(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _matching(directory: Path, patterns) -> list[Path]:
    """The entries of ``directory`` whose names match a glob pattern or fully match a compiled expression."""
    found = set()
    for pattern in patterns:
        if isinstance(pattern, re.Pattern):
            found |= {entry for entry in directory.iterdir() if pattern.fullmatch(entry.name)}
        else:
            found |= set(directory.glob(pattern))
    return sorted(found)


def _check_allow_changed(allow_changed: Iterable[str], result_options: tuple, fixed_options: tuple) -> None:
    changeable = set(result_options) - set(fixed_options)
    unknown = sorted(set(allow_changed) - changeable)
    if unknown:
        raise ValueError(f"allow_changed: {unknown} are not options a resume may change; "
                         f"those are {sorted(changeable)}")


class RunDirectory:
    """A directory claimed by one ``logitless`` command; see the module docstring."""

    def __init__(self, path: Path, command: str, outputs: Sequence[str], record: dict | None,
                 created: bool = False):
        self.path, self.command, self.outputs = path, command, tuple(outputs)
        self.previous = record  # the claim found there, None for a new claim
        self.created = created  # the claim created the directory

    @classmethod
    def claim(cls, path: str | Path, command: str, *, outputs: Sequence[str], overwrite: bool = False) -> RunDirectory:
        """Claim ``path`` for ``command`` (creating it), or raise ValueError naming ``output_dir``.

        ``outputs``: glob patterns (or compiled regular expressions, matched against whole names, such as
        `checkpoint.STEP_CHECKPOINT`) of the names the run writes in the directory (its checkpoints,
        history, plots): the only entries a fresh start replaces; with ``overwrite``, a directory that
        holds one of them (written by someone else) is refused.
        """
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise ValueError(f"output_dir: {path} is a file, not a directory")
        record = None
        if (path / MARKER).is_file():
            try:
                record = json.loads((path / MARKER).read_text())
                claimed_by = record["command"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"output_dir: {path / MARKER} is unreadable; move it away or choose another "
                                 "directory") from None
            if claimed_by != command:
                raise ValueError(f"output_dir: {path} holds a `logitless {claimed_by}` run; choose another directory")
        elif path.is_dir() and any(path.iterdir()):
            if not overwrite:
                raise ValueError(f"output_dir: {path} is not empty and no logitless run claimed it (no {MARKER}); "
                                 "choose a new or empty directory, or pass --overwrite to write this run's files "
                                 "beside the ones there")
            in_the_way = sorted(entry.name for entry in _matching(path, outputs))
            if in_the_way:
                raise ValueError(f"output_dir: {path} holds {', '.join(in_the_way)}, where this run would write its "
                                 "own outputs, and no logitless run wrote them; --overwrite never replaces what the "
                                 "run did not write: move them away or choose another directory")
        created = not path.exists()
        if record is None:  # a claim of our own: written now, which also proves the directory writable
            try:
                path.mkdir(parents=True, exist_ok=True)
                write_json_atomically(path / MARKER, {"command": command, "options": None, "changes": []})
            except OSError as err:
                raise ValueError(f"output_dir: cannot write to {path}: {err.strerror or err}") from None
        return cls(path, command, outputs, record, created)

    @contextlib.contextmanager
    def released_on_error(self):
        """``with run.released_on_error(): checks; run.start(...)``: when a check fails before any run was recorded
        here, the claim is undone (its marker removed, and the directory when the claim created it and it is still
        empty), so a command that was refused leaves the directory free for another."""
        try:
            yield self
        except BaseException:
            if self.previous is None:
                (self.path / MARKER).unlink(missing_ok=True)
                if self.created and not any(self.path.iterdir()):
                    self.path.rmdir()
            raise

    def existing_outputs(self) -> list[Path]:
        return _matching(self.path, self.outputs)

    def resume_changes(self, options: dict, *, result_options: Iterable[str], fixed_options: Iterable[str] = (),
                       allow_changed: Iterable[str] = (), defaults: dict | None = None) -> dict[str, list]:
        """The options a resume with ``options`` changes (name -> [recorded, now]), writing nothing.

        A change of an option in ``result_options`` is refused unless ``allow_changed`` names it; an option in
        ``fixed_options`` may never change. An option the run did not record (the command gained it after the run
        began) ran at its value in ``defaults``, and is compared as that.
        """
        result_options, fixed_options = tuple(result_options), tuple(fixed_options)
        _check_allow_changed(allow_changed, result_options, fixed_options)
        before = (self.previous or {}).get("options")
        if before is None:
            return {}
        before = {**(defaults or {}), **before}
        changes = {name: [before.get(name), options[name]] for name in result_options + fixed_options
                   if before.get(name) != options[name]}
        fixed = [name for name in changes if name in fixed_options]
        if fixed:
            name = fixed[0]
            raise ValueError(f"{name}: the run in {self.path} started from {_describe(changes[name][0])}; its "
                             f"checkpoint continues that training, so it cannot resume from "
                             f"{_describe(changes[name][1])}. Start a new run in another output directory")
        refused = [name for name in changes if name not in set(allow_changed)]
        if refused:
            listed = ", ".join(f"{name} {_describe(changes[name][0])} -> {_describe(changes[name][1])}"
                               for name in refused)
            flags = " ".join(name.replace("_", "-") for name in refused)
            raise ValueError(f"{refused[0]}: resuming the run in {self.path} with changed options that change "
                             f"its result ({listed}); pass --allow-changed {flags} to resume with the new values "
                             "(recorded in the run directory), or use another output directory")
        return changes

    def start(self, options: dict, *, resume: bool, result_options: Iterable[str], fixed_options: Iterable[str] = (),
              allow_changed: Iterable[str] = (), step: int | None = None,
              defaults: dict | None = None) -> dict[str, list]:
        """Record ``options`` for this run; returns the changes a resume was allowed to make.

        ``resume``: the run continues from a checkpoint in the directory, with the options `resume_changes`
        allows (``defaults``: the values of options the run did not record). Without ``resume`` the run starts
        over and the directory's earlier outputs (``outputs`` of `claim`) are removed, so no stale checkpoint of
        another run can be resumed later.
        """
        if resume:
            changes = self.resume_changes(options, result_options=result_options, fixed_options=fixed_options,
                                          allow_changed=allow_changed, defaults=defaults)
        else:
            _check_allow_changed(allow_changed, tuple(result_options), tuple(fixed_options))
            changes = {}
        record = {"command": self.command, "options": options,
                  "changes": list((self.previous or {}).get("changes", []))}
        if changes:
            record["changes"].append({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "step": step, "options": changes})
        try:
            write_json_atomically(self.path / MARKER, record)
        except OSError as err:
            raise ValueError(f"output_dir: cannot write to {self.path}: {err.strerror or err}") from None
        if not resume:
            for entry in self.existing_outputs():
                remove_tree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        self.previous = record
        return changes
