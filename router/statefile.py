"""The router's state file: the ring it routes by, kept across restarts.

Written atomically after every change (a temporary file beside it, fsynced,
then renamed over it), so a crash mid-write leaves the old ring or the new
one, never half of either. On start the router reads it back, and also asks
the nodes for the newest view they know (router/membership.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from node.files import FileProblem, NoSuchFile, parse_json, read_text
from ring import RingView
from router.viewlog import MembershipError


def save_view(path: Path, view: RingView) -> None:
    """Write ``view`` to ``path`` atomically (its folder is made if missing);
    MembershipError if it cannot be written (the router's start saves the ring
    it starts with, so a state file that cannot be kept is found then)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ring-")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(view.to_dict(), handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise _bad(path, f"cannot write ring state: {exc.strerror or exc}") from None


def load_view(path: Path) -> RingView | None:
    """The view saved at ``path``; None if there is none, MembershipError if it
    cannot be read (a directory, not UTF-8, not a ring...)."""
    try:
        return RingView.from_dict(parse_json(read_text(path, "state file"), path))
    except NoSuchFile:
        return None
    except FileProblem as exc:
        raise _bad(path, f"cannot read ring state: {exc.problem}") from None
    except (ValueError, TypeError) as exc:
        raise _bad(path, f"cannot read ring state: {exc}") from None


def check_state_file(path: Path) -> None:
    """MembershipError unless ``path`` can be read back and written over.

    ``router --workers`` asks before it starts any: its first worker would
    otherwise find out, fail, and be restarted in a loop that ends in nine
    lines where a single router says one.
    """
    load_view(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ring-")
    except OSError as exc:
        raise _bad(path, f"cannot write ring state: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(tmp)


def _bad(path: Path, problem: str) -> MembershipError:
    return MembershipError(500, "bad_state_file", f"{path}: {problem}")
