"""``ringlimit simulate`` interrupted: its worker processes go with it, quietly.

A Ctrl-C (SIGINT to the terminal's process group) reached every pool worker,
and each printed a ``KeyboardInterrupt`` traceback; a SIGTERM to the command
alone left its workers running as orphans, to die later on a broken pipe
(found by an exploratory tester); and one to its whole group must not hang it
(a review found the first fix did). simulations/pool.py: workers ignore
SIGINT, and the command's SIGTERM kills its workers and exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from router.processes import ringlimit_argv
from tests.processes import ROOT

pytestmark = pytest.mark.integration


def children(pid: int) -> list[int]:
    """``pid``'s live children (a zombie is not alive)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def orphans_of(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


@pytest.mark.parametrize(
    "how", ["sigterm to the command", "sigterm to its group", "ctrl-c to its group"]
)
def test_an_interrupted_simulation_leaves_no_worker_and_no_traceback(
    how: str, tmp_path: Path
) -> None:
    err = tmp_path / "err.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            # More workers than modes left once some end: an idle worker holds
            # its pool's queue lock, which is where a SIGTERM to the group hung.
            ringlimit_argv("simulate", "large_50", "--jobs", "6"),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    workers: list[int] = []
    try:
        # Until the modes run (the progress bar counts decisions), on two workers.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            workers = children(proc.pid)
            if len(workers) >= 2 and "decisions" in err.read_text():
                break
        assert len(workers) >= 2, "the simulation never ran its modes on two workers"
        time.sleep(4.0)
        if how == "sigterm to the command":
            os.kill(proc.pid, signal.SIGTERM)
        elif how == "sigterm to its group":  # as timeout(1), systemd, kill -- -PGID
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(20)
        deadline = time.monotonic() + 10
        while orphans_of(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert orphans_of(workers) == [], "workers outlived the simulation"
        said = err.read_text()
        assert "Traceback" not in said, said[-3000:]
        assert code == (143 if how.startswith("sigterm") else 130), said[-2000:]
    finally:
        for pid in orphans_of([proc.pid, *workers]):
            os.kill(pid, signal.SIGKILL)
        proc.wait(10)
