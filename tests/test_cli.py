"""The ``ringlimit`` command: help, version, and ``ringlimit up`` as a real process tree."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ring import Member, RingView
from router import __version__
from router.processes import HANGUP_LINE
from tests.processes import ROOT, Procs, free_block, free_port, wait_for, wait_healthy


def run(argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_processes_started_from_a_directory_with_packages_of_the_same_names(
    tmp_path: Path,
) -> None:
    """``ringlimit up`` and ``router --workers`` start their processes with
    ``python -m router``, which puts the working directory first on
    ``sys.path``: run where a ``router/`` or ``node/`` package (or an ``h2.py``)
    lies, every process they started imported that one and died (an exploratory
    tester; ``-P`` now keeps the directory out)."""
    from router.processes import ringlimit_argv

    for name in ("router", "node"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise SystemExit('the wrong package')\n")
    (tmp_path / "h2.py").write_text("raise SystemExit('the wrong h2')\n")
    done = subprocess.run(
        ringlimit_argv("--version"), cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and __version__ in done.stdout, done.stderr


def test_help_and_version() -> None:
    helped = run([sys.executable, "-m", "router", "--help"])
    assert helped.returncode == 0
    for command in ("up", "router", "node", "nodes"):
        assert command in helped.stdout
    version = run([sys.executable, "-m", "router", "--version"])
    assert version.returncode == 0 and version.stdout.strip() == f"ringlimit {__version__}"
    up_help = run([sys.executable, "-m", "router", "up", "--help"])
    for flag in ("--nodes", "--port", "--rule", "--algorithm", "--config", "--upstream"):
        assert flag in up_help.stdout
    nothing = run([sys.executable, "-m", "router"])
    assert nothing.returncode == 2 and "usage" in nothing.stdout


COMMANDS = ("up", "router", "node", "nodes", "rules", "simulate", "bench")


def command_actions(command: str) -> list[argparse.Action]:
    """The arguments of one subcommand, as ``ringlimit COMMAND --help`` lists them."""
    from router.cli import build_parser

    parser = build_parser(command)
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in commands.choices[command]._actions if a.help != argparse.SUPPRESS]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_a_help_text_that_shows_its_default(command: str) -> None:
    """``--help`` is where an operator looks first: every argument says what it is
    for, and one whose value is not simply absent when left out says its default.
    Before, ``router --health-interval``, ``--failure-threshold``, ``--host``,
    ``--on-error``, ``--redis-url``, ``nodes --router`` and a dozen more were a bare
    name in the help, defaults unsaid."""
    unexplained, undefaulted = [], []
    for action in command_actions(command):
        name = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip():
            unexplained.append(name)
        elif action.default not in (None, False, [], argparse.SUPPRESS) and (
            "default" not in action.help
        ):
            undefaulted.append(name)
    assert not unexplained, f"ringlimit {command}: no help text: {unexplained}"
    assert not undefaulted, f"ringlimit {command}: default not shown: {undefaulted}"


@pytest.mark.skipif(shutil.which("ringlimit") is None, reason="console script not installed")
def test_the_console_script_is_installed() -> None:
    result = run(["ringlimit", "--version"])
    assert result.returncode == 0 and __version__ in result.stdout


@pytest.mark.parametrize(
    ("command", "missing"),
    [("simulate", "matplotlib.pyplot"), ("bench", "slowapi"), ("bench", "limits.storage")],
)
def test_a_lazy_command_missing_its_extra_says_which_to_install(
    command: str,
    missing: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In process: the command's module fails to import for want of its extra."""
    from router import cli

    module = f"ringlimit_fake_{command}"
    (tmp_path / f"{module}.py").write_text(
        f"raise ModuleNotFoundError('not installed', name={missing!r})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.LAZY_COMMANDS, command, module)
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert f"ringlimit {command}: {missing} is not installed" in err
    assert f"ringlimit[{cli.EXTRAS[command]}]" in err


def test_a_lazy_command_does_not_hide_any_other_import_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from router import cli

    (tmp_path / "ringlimit_fake_broken.py").write_text("import ringlimit_no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.LAZY_COMMANDS, "simulate", "ringlimit_fake_broken")
    with pytest.raises(ModuleNotFoundError) as raised:
        cli.main(["simulate"])
    assert raised.value.name == "ringlimit_no_such_module"


def children_of(pid: int) -> list[int]:
    """Direct child processes (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: split after it.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/healthz", timeout=0.5)
        return True
    except httpx.HTTPError:
        return False


@pytest.mark.integration
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find child processes")
def test_up_starts_a_cluster_that_limits_and_sigterm_stops_every_process(procs: Procs) -> None:
    port = free_block(4)
    proc = procs.start("up", ["up", "--nodes", "3", "--port", str(port), "--rule", "5/minute"])
    router = f"http://127.0.0.1:{port}"
    node_urls = {f"n{i}": f"http://127.0.0.1:{port + i}" for i in (1, 2, 3)}
    children: list[int] = []
    try:
        assert wait_for(lambda: "try:" in proc.output() or not proc.alive(), 40), proc.output()
        assert proc.alive(), proc.output()
        banner = proc.output()
        assert f"ringlimit router: {router}" in banner
        for node_id, url in node_urls.items():
            assert f"{node_id}  {url}" in banner
        children = children_of(proc.popen.pid)
        assert len(children) == 4, children  # the router and three nodes

        ring = RingView.of([Member(n, u) for n, u in node_urls.items()], epoch=1)
        users = [f"cli-user-{n}" for n in range(12)]
        owners = {user: ring.owner_id(user) for user in users}
        assert set(owners.values()) == set(node_urls), "pick users that cover every node"
        with httpx.Client(base_url=router, timeout=10.0) as client:
            for user in users:
                answers_ = [
                    client.get(f"/hello/{user}", headers={"X-User-Id": user}) for _ in range(7)
                ]
                assert [a.status_code for a in answers_] == [200] * 5 + [429] * 2, user
                assert {a.headers["x-ringlimit-node"] for a in answers_} == {owners[user]}
                for i, allowed in enumerate(answers_[:5]):
                    assert allowed.headers["ratelimit-policy"] == '"5-per-minute";q=5;w=60'
                    assert allowed.headers["x-ratelimit-remaining"] == str(4 - i)
                    assert allowed.json()["node"] == owners[user]
                denied = answers_[-1]
                body = denied.json()
                assert body["error"] == "rate_limited" and body["rule"] == "5-per-minute"
                assert body["limit"] == 5 and body["detail"]
                retry = int(denied.headers["retry-after"])
                assert retry >= body["retry_after"] > retry - 1
                assert denied.headers["x-ratelimit-remaining"] == "0"
                # The README's quick start: t and Retry-After name the same moment.
                assert denied.headers["ratelimit"] == f'"5-per-minute";r=0;t={retry}'
                assert retry <= 12
            # The decision API and the proxy path share counters.
            user = "cli-shared"
            for _ in range(2):
                assert client.get("/", headers={"X-User-Id": user}).status_code == 200
            result = client.post("/v1/check", json={"key": user}).json()
            assert result["allowed"] is True and result["remaining"] == 2
            assert result["node"] == ring.owner_id(user)
            batch = client.post(
                "/v1/check", json={"checks": [{"key": user}, {"key": user}, {"key": user}]}
            ).json()["results"]
            assert [r["allowed"] for r in batch] == [True, True, False]
            assert client.get("/", headers={"X-User-Id": user}).status_code == 429
    finally:
        # SIGTERM to `up` alone: it must stop every process it started.
        started = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        try:
            code = proc.popen.wait(20)
        except subprocess.TimeoutExpired:
            code = None
        gone = wait_for(lambda: not any(alive(pid) for pid in children), 10)
        leftovers = [pid for pid in children if alive(pid)]
        for pid in leftovers:  # never leave our own processes behind, even on failure
            os.kill(pid, signal.SIGKILL)
    assert code == 0, proc.output()
    # Its nodes stop on SIGHUP without a line each (a node alone says one).
    assert "SIGHUP" not in proc.output(), proc.output()
    assert gone, f"processes left running after SIGTERM: {leftovers}"
    assert time.monotonic() - started < 20
    assert not answers(router)
    assert not any(answers(url) for url in node_urls.values())


@pytest.mark.integration
def test_rules_shows_and_applies_a_files_rules_to_a_running_cluster(
    procs: Procs, tmp_path: Path
) -> None:
    _, node = procs.node("n1")
    _, router = procs.router(None, "--node", f"n1={node}", "--rule", "api=3/minute")
    shown = run([sys.executable, "-m", "router", "rules", "--router", router])
    assert shown.returncode == 0, shown.stderr
    assert [r["limit"] for r in json.loads(shown.stdout)["rules"]] == [3]
    # `rules list` / `rules show`, as `nodes list` says it: the same listing.
    for word in ("list", "show"):
        listed = run([sys.executable, "-m", "router", "rules", word, "--router", router])
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout == shown.stdout
    with httpx.Client(base_url=router, timeout=10.0) as client:
        assert client.get("/x", headers={"X-User-Id": "u"}).status_code == 200
        new = tmp_path / "rules.toml"
        new.write_text('[[rules]]\nname = "api"\nrate = "1/minute"\n')
        applied = run([sys.executable, "-m", "router", "rules", str(new), "--router", router])
        assert applied.returncode == 0, applied.stderr
        assert applied.stderr == ""
        assert [r["limit"] for r in json.loads(applied.stdout)["rules"]] == [1]
        # A file's other sections are checked, not applied, and it says so (it
        # applied the rules with exit 0 and no word of them: an exploratory tester).
        full = tmp_path / "cluster.toml"
        full.write_text(
            '[limits]\nmax_body = 2048\n[policies]\ncrash = "reset"\n'
            '[[rules]]\nname = "api"\nrate = "1/minute"\n'
        )
        noted = run([sys.executable, "-m", "router", "rules", str(full), "--router", router])
        assert noted.returncode == 0, noted.stderr
        assert noted.stderr == (
            f"ringlimit rules: {full}: [limits], [policies] not applied: `ringlimit rules` "
            "changes the [[rules]] alone; `ringlimit config FILE` applies the whole file\n"
        )
        # u's bucket kept 2 tokens of 3, at most the new 1: one more, then none.
        codes = [client.get("/x", headers={"X-User-Id": "u"}).status_code for _ in range(2)]
        assert codes == [200, 429]
    # What it shows, it applies: the round trip of a saved file.
    saved = tmp_path / "saved.json"
    saved.write_text(shown.stdout)
    again = run([sys.executable, "-m", "router", "rules", str(saved), "--router", router])
    assert again.returncode == 0, again.stderr
    assert [r["limit"] for r in json.loads(again.stdout)["rules"]] == [3]


def test_config_shows_and_applies_a_whole_file_to_a_running_cluster(
    procs: Procs, tmp_path: Path
) -> None:
    """``ringlimit config FILE``: every section of a file, not the rules alone
    (identity here); what it shows, it applies; a backend other than the
    cluster's, and a router that is not there, are one line each."""
    _, node = procs.node("n1")
    _, router = procs.router(None, "--node", f"n1={node}", "--rule", "api=3/minute")
    shown = run([sys.executable, "-m", "router", "config", "--router", router])
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["identity"]["name"] == "X-User-Id"
    new = tmp_path / "cluster.toml"
    new.write_text('[identity]\nname = "X-Account"\n[[rules]]\nname = "api"\nrate = "1/minute"\n')
    applied = run([sys.executable, "-m", "router", "config", str(new), "--router", router])
    assert applied.returncode == 0 and applied.stderr == "", applied.stderr
    assert json.loads(applied.stdout)["identity"]["name"] == "X-Account"
    with httpx.Client(base_url=router, timeout=10.0) as client:
        codes = [client.get("/x", headers={"X-Account": "u"}).status_code for _ in range(2)]
        assert codes == [200, 429]
        assert client.get("/x", headers={"X-User-Id": "v"}).status_code == 400
    saved = tmp_path / "saved.json"
    saved.write_text(shown.stdout)
    again = run([sys.executable, "-m", "router", "config", str(saved), "--router", router])
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["identity"]["name"] == "X-User-Id"
    # A salt shown hidden: sent back, the cluster's is kept; used to start, refused.
    salted = tmp_path / "salted.toml"
    salted.write_text('[privacy]\nshow_keys = "hashed"\nsalt = "pepper"\n' + new.read_text())
    assert (
        run([sys.executable, "-m", "router", "config", str(salted), "--router", router]).returncode
        == 0
    )
    hidden = run([sys.executable, "-m", "router", "config", "--router", router])
    assert json.loads(hidden.stdout)["privacy"]["salt"] == "<hidden>"
    back = tmp_path / "back.json"
    back.write_text(hidden.stdout)
    kept = run([sys.executable, "-m", "router", "config", str(back), "--router", router])
    assert kept.returncode == 0, kept.stderr
    started = run([sys.executable, "-m", "router", "router", "--port", "0", "--config", str(back)])
    assert started.returncode != 0 and "put the real salt in the file" in started.stderr
    redis = tmp_path / "redis.toml"
    redis.write_text('backend = "redis"\n[[rules]]\nname = "api"\nrate = "1/minute"\n')
    refused = run([sys.executable, "-m", "router", "config", str(redis), "--router", router])
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "fixed_at_start: backend 'redis'" in refused.stderr
    gone = run(
        [sys.executable, "-m", "router", "config", "--router", f"http://127.0.0.1:{free_port()}"]
    )
    assert gone.returncode == 1 and gone.stderr.count("\n") == 1, gone.stderr


@pytest.mark.integration
def test_rules_applied_say_which_nodes_have_not_taken_them(procs: Procs, tmp_path: Path) -> None:
    """A member that did not take new rules (dead, not yet removed) was not
    mentioned: the call answered 200 and the operator believed every node had
    them. It is named, apart from the rules the command prints."""
    nodes = procs.nodes(["n1", "n2"])
    seeds = [f"{node_id}={url}" for node_id, (_, url) in nodes.items()]
    _, router = procs.router(
        None, *(f for seed in seeds for f in ("--node", seed)), "--no-health-checks"
    )
    nodes["n2"][0].kill9()
    new = tmp_path / "rules.toml"
    new.write_text('[[rules]]\nname = "api"\nrate = "1/minute"\n')
    applied = run([sys.executable, "-m", "router", "rules", str(new), "--router", router])
    assert applied.returncode == 0, applied.stderr
    assert [r["limit"] for r in json.loads(applied.stdout)["rules"]] == [1]
    assert applied.stderr.count("\n") == 1 and "not taken yet by n2" in applied.stderr, (
        applied.stderr
    )


def test_ports_asked_for_twice_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A router's --grpc-port equal to its --port, and ``up``'s ports that
    overlap, are refused before anything starts: they gave uvicorn's raw
    ``[Errno 98]`` (exit 3), and ``up --port P --node-port P`` blamed the
    router's port as taken, then had the nodes join n1's app."""
    from router.cli import main

    envoy = tmp_path / "edge.yaml"
    envoy.write_text(
        "domain: edge\ndescriptors:\n  - key: user\n"
        "    rate_limit: {unit: minute, requests_per_unit: 5}\n"
    )
    port = free_block(3)
    same = ["router", "--port", str(port), "--grpc-port", str(port), "--envoy-config", str(envoy)]
    assert main(same) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gRPC needs a port of its own" in err, err
    assert main(["up", "--port", str(port), "--node-port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"port {port} is asked for both the router and node n1" in err, err
    grpc = ["up", "--port", str(port), "--grpc-port", str(port + 1), "--envoy-config", str(envoy)]
    assert main(grpc) == 1
    err = capsys.readouterr().err
    assert "asked for both node n1 and Envoy's rate limit service" in err, err
    # A bad $RINGLIMIT_ENVOY_HEADERS is named as such, not as the flag.
    monkeypatch.setenv("RINGLIMIT_ENVOY_HEADERS", "bogus")
    argv = ["router", "--port", str(port), "--grpc-port", str(port + 1)]
    assert main([*argv, "--envoy-config", str(envoy)]) == 2
    err = capsys.readouterr().err
    assert "$RINGLIMIT_ENVOY_HEADERS: unknown set(s) bogus" in err, err


def test_output_cut_short_by_its_reader_is_no_traceback(procs: Procs, tmp_path: Path) -> None:
    """``ringlimit rules --router URL | head -3``: the reader leaves early, and
    the command printed a BrokenPipeError traceback."""
    config = tmp_path / "rules.toml"
    config.write_text(
        "\n".join(
            f'[[rules]]\nname = "rule-{i}"\nlimit = 5\nperiod = 60\npaths = ["/p/{i}/*"]\n'
            for i in range(900)
        )
    )
    port = free_block(1)
    router = procs.start("router", ["router", "--port", str(port), "--config", str(config)])
    from tests.processes import wait_healthy

    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, router, require_ok=False)
    command = [sys.executable, "-m", "router", "rules", "--router", url]
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as reader:
        assert reader.stdout is not None and reader.stderr is not None
        reader.stdout.readline()  # then leaves, as `head -1` does
        reader.stdout.close()
        err = reader.stderr.read().decode()
        code = reader.wait(timeout=30.0)
    assert "Traceback" not in err and code == 1, (code, err)


@pytest.mark.integration
def test_sighup_stops_a_router_and_a_node_saying_so(procs: Procs) -> None:
    """SIGHUP (what nginx takes for a reload) ended a router without a word."""
    proc, node = procs.node("n1")
    router_proc, _ = procs.router(None, "--node", f"n1={node}")
    for each, role in ((router_proc, "router"), (proc, "node")):
        each.stop(how=signal.SIGHUP)
        assert each.returncode is not None
        said = each.log_path.read_text()  # type: ignore[union-attr]
        line = f"ringlimit.{role} WARNING SIGHUP: stopping (ringlimit reloads nothing on SIGHUP"
        assert line in said, said[-2000:]
        # (The router's line said "a node stops without leaving the ring", as a node.)
        assert ("a node stops without leaving" in said) == (role == "node"), said[-2000:]
        assert "Traceback" not in said, said[-2000:]


@pytest.mark.integration
@pytest.mark.parametrize("command", ["router --workers", "up"])
def test_sighup_stops_what_starts_other_processes_saying_so(procs: Procs, command: str) -> None:
    """``router --workers`` and ``up`` died silently on SIGHUP, exit status 129
    (their workers and nodes were cleaned up): now one line, and exit 0 as
    for SIGTERM, every process they started stopped."""
    port = free_block(2)
    if command == "up":
        proc = procs.start("up", ["up", "--nodes", "1", "--port", str(port)])
        assert wait_for(lambda: "try:" in proc.output() or not proc.alive(), 40), proc.output()
    else:
        proc = procs.start("router", ["router", "--port", str(port), "--workers", "2"])
        wait_healthy(f"http://127.0.0.1:{port}", proc, require_ok=False)
    children = children_of(proc.popen.pid)
    assert len(children) == 2, children  # a router and a node; or two workers
    proc.stop(how=signal.SIGHUP)
    assert proc.returncode == 0, proc.output()[-2000:]
    assert HANGUP_LINE in proc.output(), proc.output()[-2000:]
    assert wait_for(lambda: not any(alive(pid) for pid in children), 10), children


@pytest.mark.integration
def test_a_node_refused_by_the_routers_admin_token_says_which_token(procs: Procs) -> None:
    """A --join node without the router's admin token (given only the internal
    one, say) logged "router answered 401: missing or wrong admin token": it
    now says the node itself needs RINGLIMIT_ADMIN_TOKEN, in one line."""
    token = "admin-s3cret-token"
    procs.env = {**procs.env, "RINGLIMIT_ADMIN_TOKEN": token}
    _, router = procs.router(None, healthy=False)
    procs.env = {k: v for k, v in procs.env.items() if k != "RINGLIMIT_ADMIN_TOKEN"}
    node = procs.start("n1", ["node", "--id", "n1", "--port", str(free_port()), "--join", router])
    node.popen.wait(30)
    said = node.log_path.read_text()  # type: ignore[union-attr]
    assert node.returncode == 1, said[-2000:]
    lines = [line for line in said.splitlines() if "could not join" in line]
    assert len(lines) == 1 and "give it the router's RINGLIMIT_ADMIN_TOKEN" in lines[0], said
    assert token not in said and "Traceback" not in said


@pytest.mark.integration
def test_the_last_node_is_removed_only_when_forced(procs: Procs) -> None:
    """Removing the ring's last node was a 200, after which every request got
    ``503 no_nodes``: one mistyped id or a script run twice took the service
    down. It is refused (409 ``last_node``) unless forced; a ``--join`` node
    leaving by itself (SIGTERM) forces, since it goes either way."""
    _, router = procs.router(None, healthy=False)
    nodes = {
        node_id: procs.node(node_id, None, "--join", router)[0] for node_id in ("n1", "n2", "n3")
    }

    def ring() -> list[str]:
        return [n["id"] for n in httpx.get(f"{router}/admin/ring", timeout=10.0).json()["nodes"]]

    assert wait_for(lambda: sorted(ring()) == ["n1", "n2", "n3"], 30.0), ring()
    removed = run([sys.executable, "-m", "router", "nodes", "remove", "n2", "--router", router])
    assert removed.returncode == 0, removed.stderr
    # The node says so (it ran on without a word, its /healthz "ok": a tester).
    assert wait_for(lambda: "out of the ring at epoch" in nodes["n2"].output(), 10.0)
    nodes["n2"].stop()
    # n3 leaves by itself; n1 is then the last.
    nodes["n3"].stop()
    assert "out of the ring" not in nodes["n3"].output()  # its own leave: no news
    assert ring() == ["n1"]
    refused = run([sys.executable, "-m", "router", "nodes", "remove", "n1", "--router", router])
    assert refused.returncode == 1
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "last_node" in refused.stderr and "--force" in refused.stderr, refused.stderr
    unclear = httpx.delete(f"{router}/admin/nodes/n1?force=yes", timeout=10.0)
    assert unclear.status_code == 400 and unclear.json()["error"] == "invalid_force"
    # Given twice, Starlette took the last: ?force=true&force=false was a leave.
    twice = httpx.delete(f"{router}/admin/nodes/n1?force=true&force=false", timeout=10.0)
    assert twice.status_code == 400 and twice.json()["error"] == "invalid_force"
    assert ring() == ["n1"]
    forced = run(
        [sys.executable, "-m", "router", "nodes", "remove", "n1", "--force", "--router", router]
    )
    assert forced.returncode == 0, forced.stderr
    assert ring() == []
    # A --join node alone in the ring leaves by itself all the same.
    alone, _ = procs.node("n4", None, "--join", router)
    assert wait_for(lambda: ring() == ["n4"], 30.0), ring()
    alone.stop()
    assert alone.popen.returncode == 0
    assert f"left the ring: router {router} answered 200" in alone.output(), alone.output()
    assert ring() == []


#: The documents whose tables list flags, and a default column where they have one.
FLAG_TABLE_DOCS = ("docs/configuration.md", "docs/redis.md")


def table_cells(line: str) -> list[str]:
    """A markdown table row's cells (``\\|`` is a ``|`` inside a cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def flag_table_rows(document: str) -> list[tuple[str, str | None]]:
    """(flag, documented default or None) of every table row naming a flag in its
    flag column: the column headed 'flag', else the first."""
    rows: list[tuple[str, str | None]] = []
    lines = (ROOT / document).read_text().splitlines()
    for at, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and lines[at + 1].startswith("|---")):
            continue
        header = table_cells(line)
        flag_column = next((i for i, h in enumerate(header) if "flag" in h), 0)
        default_column = header.index("default") if "default" in header else None
        for row in lines[at + 2 :]:
            if not row.startswith("|"):
                break
            cells = table_cells(row)
            found = re.match(r"`(--[a-z][a-z0-9-]*)", cells[flag_column])
            if found:
                default = cells[default_column] if default_column is not None else None
                rows.append((found.group(1), default))
    return rows


def parser_defaults() -> dict[str, object]:
    """Every flag of every command and its default (the first command's that has it)."""
    defaults: dict[str, object] = {}
    for command in COMMANDS:
        for action in command_actions(command):
            for flag in action.option_strings:
                defaults.setdefault(flag, action.default)
    return defaults


@pytest.mark.parametrize("document", FLAG_TABLE_DOCS)
def test_the_docs_flag_tables_match_the_parser(document: str) -> None:
    """Every flag a table of the operator's docs names is one the CLI takes, and a
    default the table gives as a number (``1 s``, ``0.5``, ``300``) is the parser's,
    as is an ``off`` switch. (Defaults the parser leaves to the config or computes
    at start, such as ``--lease``, are not compared.)"""
    defaults = parser_defaults()
    rows = flag_table_rows(document)
    assert rows, f"no flag table in {document}"
    for flag, documented in rows:
        assert flag in defaults, f"{document}: {flag} is not a flag of any command"
        actual = defaults[flag]
        if documented is None or actual is None:
            continue
        number = re.fullmatch(r"`?(\d+(?:\.\d+)?)`?(?: (?:s|µs|ms))?", documented)
        if number and not isinstance(actual, bool):
            assert float(str(actual)) == float(number.group(1)), (flag, documented, actual)
        elif documented == "off" and isinstance(actual, bool):
            assert actual is False, (flag, actual)
        elif isinstance(actual, str) and re.fullmatch(r"`[^`]+`", documented):
            assert documented.strip("`") == actual, (flag, documented, actual)
        elif documented in ("on", "off") and isinstance(actual, str):
            assert documented == actual, (flag, documented, actual)


@pytest.mark.parametrize(
    ("identity", "command"),
    [
        ({}, "curl -i -H 'X-User-Id: alice' http://r/hello"),
        ({"name": "X-Api-Key"}, "curl -i -H 'X-Api-Key: alice' http://r/hello"),
        ({"source": "query", "name": "user"}, "curl -i 'http://r/hello?user=alice'"),
        ({"source": "client"}, "curl -i http://r/hello"),
    ],
    ids=["default", "header", "query", "client"],
)
def test_the_banners_request_carries_the_user_id_where_the_config_says(
    identity: dict[str, str], command: str
) -> None:
    """`up`'s banner suggested `-H 'X-User-Id: alice'` whatever the identity: under
    a query parameter that request was a 400 missing_user_id (an exploratory tester)."""
    from node.config import ClusterConfig, Identity
    from router.supervisor import _try_command

    assert _try_command(ClusterConfig(identity=Identity(**identity)), "http://r") == command
