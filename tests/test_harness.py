"""The test harness's own rules, checked on its source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import processes

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


def test_xdist_workers_pick_ports_apart_and_never_hand_one_out_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two xdist workers that picked the same free port each started a child on
    it: one test's node joined another test's cluster (CI failed on "could not
    join the ring ... missing_user_id"). Each worker now has its own slice of
    the range, and a port handed out (whose child may not have bound it yet)
    is not handed out again by that process."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(processes._port_range(4))
    (a0, a1), (b0, b1) = slices
    assert a0 < a1 <= b0 < b1, slices
    monkeypatch.setattr(processes, "_HANDED", set())
    ports = [processes.free_block(4) for _ in range(200)]
    assert all(b0 <= port and port + 3 < b1 for port in ports)
    handed = [port + i for port in ports for i in range(4)]
    assert len(set(handed)) == len(handed)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert processes._port_range(1)[1] - processes._port_range(1)[0] > b1 - b0
