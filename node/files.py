"""Reading the files a command is given: a config, a scenario, a router's state file.

Every way such a file cannot be used is one :class:`FileProblem` naming the
path and what is wrong, for the command to print as its one line. Before,
each reader caught some of them: a directory, an unreadable file, bytes that
are not UTF-8 or a document nested past the parser's recursion came out as
tracebacks, or as a codec's message that did not say which file it was.
"""

from __future__ import annotations

import os
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from node.strictjson import GivenTwice, loads_unique


class FileProblem(ValueError):
    """A file that cannot be read or parsed; ``str()`` is ``"PATH: PROBLEM"``."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class NoSuchFile(FileProblem):
    """The file is not there (a reader for which that is fine catches this one)."""


#: The most a config, scenario or state file may hold. Each is a few KiB; the
#: cap is for a path that is not such a file: ``/dev/zero`` grew a command to
#: 9.5 GB in 8 s before it was refused (an exploratory tester).
MAX_FILE_BYTES = 16 * 1024 * 1024


def read_text(path: Path, what: str = "file") -> str:
    """The UTF-8 text of ``path``; ``what`` names it in "no such ..." and "is a
    directory, not a ...". TOML and JSON files are UTF-8 by definition, so other
    bytes are refused here, with where the first one is. At most
    :data:`MAX_FILE_BYTES` are read (a pipe or a device too: never more)."""
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise NoSuchFile(path, f"no such {what}") from None
    except IsADirectoryError:
        raise FileProblem(path, f"cannot read: a directory, not a {what}") from None
    except OSError as exc:
        raise FileProblem(path, f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise FileProblem(
            path, f"more than {MAX_FILE_BYTES // (1024 * 1024)} MiB: too large for a {what}"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileProblem(
            path, f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None


def parse_toml(text: str, path: Path) -> dict[str, Any]:
    """``text`` (read from ``path``) as TOML; FileProblem if it is not."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FileProblem(path, f"not valid TOML: {exc}") from None
    except RecursionError:
        raise FileProblem(path, "not valid TOML: nested too deeply") from None


def parse_json(text: str, path: Path) -> Any:
    """``text`` (read from ``path``) as JSON; FileProblem if it is not."""
    try:
        return loads_unique(text)
    except GivenTwice as exc:  # valid JSON, but which value was meant?
        raise FileProblem(path, f"ambiguous JSON: {exc}") from None
    except ValueError as exc:
        raise FileProblem(path, f"not valid JSON: {exc}") from None
    except RecursionError:
        raise FileProblem(path, "not valid JSON: nested too deeply") from None


def check_output_file(path: Path, flag: str) -> None:
    """ValueError (``"FLAG PATH: problem"``) unless ``path`` can be written: checked
    before a run that ends by writing it, where a directory or a folder that
    cannot be made was a traceback after the whole run, its results lost. The
    check opens the file to append (its folder made), and removes it again if it
    was not there."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except IsADirectoryError:
        raise ValueError(f"{flag} {path}: a directory, not a file") from None
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"{flag} {path}: cannot write: a folder of its path is a file") from None
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)


def check_output_dir(path: Path, flag: str) -> None:
    """:func:`check_output_file` for a folder files are written into (made here)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        raise ValueError(f"{flag} {path}: not a directory") from None
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write: {exc.strerror or exc}") from None


def reader_gone() -> int:
    """The exit status of a command whose stdout's reader went away (``... | head``):
    1, quietly, where a ``BrokenPipeError`` traceback was printed. stdout goes to
    devnull so that the interpreter's final flush of what is left does not fail
    again on exit. ``ringlimit`` and ``python -m simulations`` both end so."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1
