"""The test harness's own rules, checked on its source."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _calls_with_preexec_fn(source: str) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and any(k.arg == "preexec_fn" for k in node.keywords)
    ]


def test_no_test_starts_a_process_with_a_preexec_fn() -> None:
    """A preexec_fn makes subprocess fork() and run Python in the child; in a
    worker that has used gRPC, the fork runs gRPC's fork handlers, which once
    killed etcd's child before its exec and failed every etcd test of that
    worker (tests.redis_server.dying_with_parent says what to use instead)."""
    found = {
        path.name: lines
        for path in sorted(TESTS.glob("*.py"))
        if path.name != Path(__file__).name
        and (lines := _calls_with_preexec_fn(path.read_text(encoding="utf-8")))
    }
    assert found == {}, f"preexec_fn in tests (file: lines): {found}"


def test_the_checker_sees_a_preexec_fn() -> None:
    source = "import subprocess\nsubprocess.Popen(['true'], preexec_fn=print)\n"
    assert _calls_with_preexec_fn(source) == [2]
