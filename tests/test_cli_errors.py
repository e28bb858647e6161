"""Expected failures of every ``ringlimit`` command end in one line on stderr
(what, where, what to check) and a non-zero exit, never a traceback."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.cli import ROUTER_NUMBERS
from tests.processes import (  # noqa: F401 (fixture)
    ROOT,
    Procs,
    free_block,
    free_port,
    procs,
    wait_for,
)
from tests.test_envoy_config import MONGO

pytestmark = pytest.mark.integration


def ringlimit(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_failure(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The failure's single stderr line, after checking the exit code and the absence
    of a traceback; every fragment must be in it."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 with ``handler``, for the block; its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def not_a_router() -> Iterator[str]:
    """An HTTP server on 127.0.0.1 that is not a ringlimit router (404 in HTML)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield url


@pytest.mark.parametrize(
    "argv",
    [["list"], ["remove", "n1"], ["add", "n4", "http://127.0.0.1:9"]],
    ids=["list", "remove", "add"],
)
def test_nodes_with_no_router_there(argv: list[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    one_line_failure(
        ringlimit("nodes", *argv, "--router", url),
        f"cannot reach the router at {url}",
        "connection refused",
        "check --router",
    )


def test_nodes_with_a_url_that_is_not_a_router(not_a_router: str) -> None:
    one_line_failure(
        ringlimit("nodes", "list", "--router", not_a_router),
        f"{not_a_router} answered HTTP 404",
        "check --router",
    )


def test_nodes_pointed_at_a_node_say_so(procs: Procs) -> None:  # noqa: F811
    """A node takes /admin/nodes as a request for the app it fronts and answers
    missing_user_id; the CLI said that, not that --router names a node."""
    _, node = procs.node("n1", None, "--rule", "10/minute")
    one_line_failure(
        ringlimit("nodes", "list", "--router", node),
        f"{node} answered HTTP 400, not as a ringlimit router's admin API",
        "check --router",
    )


def test_nodes_with_a_url_without_a_scheme() -> None:
    one_line_failure(
        ringlimit("nodes", "list", "--router", "127.0.0.1:8000"),
        "cannot reach the router at 127.0.0.1:8000",
        "not a usable URL",
    )


def test_nodes_with_a_url_httpx_cannot_parse() -> None:
    """httpx.InvalidURL is not an httpx.HTTPError: caught on its own."""
    one_line_failure(
        ringlimit("nodes", "list", "--router", "http://127.0.0.1:1\x01"),
        "cannot reach the router at",
        "not a usable URL",
    )
    # A port out of range: httpx tried it, and the CLI said "connection refused".
    one_line_failure(
        ringlimit("nodes", "list", "--router", "http://127.0.0.1:99999"),
        "not a usable URL: Port out of range",
    )


def test_an_environment_default_outside_its_choices_is_one_line() -> None:
    """argparse checks choices only of flags given: RINGLIMIT_REDIS_PIPELINE is checked too."""

    result = subprocess.run(
        [sys.executable, "-m", "router", "node", "--id", "n1", "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RINGLIMIT_REDIS_PIPELINE": "sideways"},
    )
    one_line_failure(result, "RINGLIMIT_REDIS_PIPELINE", "'sideways'")


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        (["--redis-timeout", "0"], {}, "got '0'"),
        (["--redis-timeout", "nan"], {}, "got 'nan'"),
        (["--redis-timeout", "61"], {}, "got '61'"),
        ([], {"RINGLIMIT_REDIS_TIMEOUT": "soon"}, "got 'soon'"),
    ],
)
def test_a_redis_timeout_that_is_not_seconds_is_one_line(
    flags: list[str], env: dict[str, str], expected: str
) -> None:

    result = subprocess.run(
        [sys.executable, "-m", "router", "node", "--id", "n1", "--port", str(free_port()), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    one_line_failure(result, "--redis-timeout (or RINGLIMIT_REDIS_TIMEOUT)", expected)


def test_a_node_joining_an_absent_router_gives_up_in_one_line() -> None:
    router = f"http://127.0.0.1:{free_port()}"
    port = str(free_port())
    result = ringlimit(
        "node", "--id", "n1", "--port", port, "--join", router, "--join-timeout", "1"
    )
    one_line_failure(result, "could not join the ring", router, "check --join")


def test_up_with_a_port_in_use(taken_port: int) -> None:
    one_line_failure(
        ringlimit("up", "--nodes", "2", "--port", str(taken_port)),
        f"cannot listen on 127.0.0.1:{taken_port} for the router",
        "--port",
    )
    router = str(free_port())
    one_line_failure(
        ringlimit("up", "--nodes", "2", "--port", router, "--node-port", str(taken_port)),
        f"cannot listen on 127.0.0.1:{taken_port} for node n1",
        "--node-port",
    )


@pytest.mark.parametrize("command", ["router", "node"])
def test_router_or_node_with_its_port_in_use(command: str, taken_port: int) -> None:
    argv = ["--port", str(taken_port)] + (["--id", "n1"] if command == "node" else [])
    one_line_failure(
        ringlimit(command, *argv), f"cannot listen on 127.0.0.1:{taken_port}", "--port"
    )


@pytest.mark.parametrize("command", ["up", "router", "node"])
def test_a_missing_config_file(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.toml"
    argv = [command, "--config", str(missing), "--port", str(free_port())]
    if command == "node":
        argv += ["--id", "n1"]
    result = ringlimit(*argv)
    assert result.returncode == 2
    one_line_failure(result, f"{missing}: no such file")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("rules = [\n", "not valid TOML"),
        ('[[rules]]\nname = "api"\nrate = "many/hour"\n', "rules[0]"),
        ("colour = 1\n", "colour"),
        ('[[rules]]\nname = "api"\nrate = "5/hour"\nburst = 0\n', "rules[0].burst"),
    ],
    ids=["syntax", "bad-value", "unknown-key", "zero-burst"],
)
def test_a_bad_config_file(text: str, problem: str, tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    one_line_failure(ringlimit("up", "--config", str(config)), str(config), problem)


def test_up_with_redis_backend_and_no_redis() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    port = str(free_block(4))
    one_line_failure(
        ringlimit("up", "--backend", "redis", "--redis-url", url, "--port", port),
        f"cannot reach Redis at {url}",
        "--redis-url",
    )


def test_up_names_no_password_of_a_redis_it_cannot_reach() -> None:
    """Neither one in the URL's userinfo nor one in its query (redis-py takes both),
    which the line showed whole."""
    where = f"127.0.0.1:{free_port()}/0"
    port = str(free_block(4))
    for url, shown in [
        (f"redis://:s3cret@{where}", f"redis://:***@{where}"),
        (f"redis://{where}?password=s3cret", f"redis://{where}?password=***"),
    ]:
        line = one_line_failure(
            ringlimit("up", "--backend", "redis", "--redis-url", url, "--port", port),
            f"cannot reach Redis at {shown}",
        )
        assert "s3cret" not in line


@pytest.mark.parametrize(
    ("url", "problem"),
    [("http://127.0.0.1:6379", "schemes"), ("redis://127.0.0.1:99999/0", "Port out of range")],
)
def test_up_with_a_redis_url_that_is_not_one(url: str, problem: str) -> None:
    """Said as such, not as "cannot reach Redis" (an exploratory tester)."""
    port = str(free_block(4))
    one_line_failure(
        ringlimit("up", "--backend", "redis", "--redis-url", url, "--port", port),
        f"--redis-url {url} is not a valid Redis URL",
        problem,
    )


@pytest.mark.parametrize("command", ["up", "node"])
@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/2147483648", "the database must be from 0"),
        ("/99999999999999999999", "the database must be from 0"),
        ("?db=99999999999", "the database must be from 0"),
        ("/²", "the database (the URL's path) must be a number"),
        ("/0?client_name=a%20b", "?client_name= must be printable ASCII without spaces"),
    ],
)
def test_a_redis_url_redis_would_refuse_at_every_connect(
    command: str, path: str, problem: str
) -> None:
    """A database past Redis's largest, or a connection name it refuses: before, a
    node's start ended with uvicorn's traceback of Redis's reply ("value is out of
    range", "Client names cannot contain spaces"), exit 3 (an exploratory tester);
    ``ringlimit node`` with a port out of range said "Port out of range" alone,
    which reads as its own ``--port``."""
    url = f"redis://127.0.0.1:{free_port()}{path}"
    port = str(free_block(4))
    argv = ["--backend", "redis", "--redis-url", url, "--port", port]
    if command == "node":
        argv = ["--id", "n1", *argv]
    one_line_failure(ringlimit(command, *argv), f"--redis-url {url}", problem)
    if command == "node":
        bad_port = ["--redis-url", "redis://127.0.0.1:99999/0"]
        one_line_failure(
            ringlimit(command, *argv, *bad_port),
            "--redis-url redis://127.0.0.1:99999/0 is not a valid Redis URL",
            "Port out of range",
        )


@pytest.mark.parametrize("command", ["up", "node"])
def test_a_redis_url_whose_query_would_override_the_nodes_settings(command: str) -> None:
    """redis-py lets a URL's query win over what the client sets: a node given
    ``?socket_timeout=30`` waited 30 s on a paused Redis while --redis-timeout
    said otherwise, and ``?max_connections=`` resized the pool the node sizes
    to its call slots, without a word. Refused in one line, password hidden."""
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0?socket_timeout=30&max_connections=5"
    port = str(free_block(4))
    argv = ["--backend", "redis", "--redis-url", url, "--port", port]
    if command == "node":
        argv = ["--id", "n1", *argv]
    line = one_line_failure(
        ringlimit(command, *argv),
        "remove ?max_connections&socket_timeout from the URL",
        "socket_timeout is set by --redis-timeout",
    )
    assert "s3cret" not in line


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("/0?foo=bar", "redis-py takes no ?foo in a redis:// URL"),
        ("/0?ssl_cert_reqs=none", "redis-py takes no ?ssl_cert_reqs in a redis:// URL"),
        ("/0?protocol=9", "protocol must be either 2 or 3"),
        ("/abc", "the database (the URL's path) must be a number, got '/abc'"),
        ("/0?retry=1", "redis-py cannot use its options (AttributeError"),
    ],
    ids=["unknown", "tls-option-on-plain", "bad-protocol", "database-not-a-number", "retry"],
)
@pytest.mark.parametrize("command", ["up", "node"])
def test_a_redis_url_redis_py_cannot_use_is_refused_at_start(
    command: str, query: str, said: str
) -> None:
    """redis-py hands a query parameter it does not parse to the connection class:
    ``?foo=bar`` stopped the node's start at its first connect with a 46-line
    traceback, ``?protocol=9`` started a node that answered every check by
    ``on_error`` for good, and a database path that is not a number was quietly
    database 0 (an exploratory tester). Each is one line at start now."""
    url = f"redis://:s3cret@127.0.0.1:{free_port()}{query}"
    argv = ["--backend", "redis", "--redis-url", url, "--port", str(free_block(4))]
    if command == "node":
        argv = ["--id", "n1", *argv]
    line = one_line_failure(ringlimit(command, *argv), said)
    assert "s3cret" not in line and "Traceback" not in line


def test_a_router_whose_seed_node_never_answers() -> None:
    seed = f"http://127.0.0.1:{free_port()}"
    result = ringlimit("router", "--port", str(free_port()), "--node", f"n1={seed}")
    one_line_failure(
        result, "the router could not start", f"node n1 at {seed}", "check the --node seeds"
    )


def test_a_router_with_an_unreadable_state_file(tmp_path: Path) -> None:
    state = tmp_path / "ring.json"
    state.write_text("{ not json")
    result = ringlimit("router", "--port", str(free_port()), "--state-file", str(state))
    one_line_failure(result, "the router could not start", str(state), "check --state-file")


def test_a_router_that_cannot_keep_its_state_file_sends_nothing(
    procs: Procs,  # noqa: F811
) -> None:
    """The state file is checked before the router takes the ring from its seeds:
    found at the first save, the router had already pushed its rules to the
    seed's nodes, a live cluster's (an exploratory tester: the algorithm changed
    twice under the users, 10 admissions under a limit of 5)."""
    proc, node = procs.node("n1", None, "--rule", "api=5/minute")
    live, _ = procs.router(None, "--node", f"n1={node}", "--rule", "api=5/minute")
    live.stop()  # the ring is the nodes' now; nothing would push the rules back
    before = httpx.get(f"{node}/internal/cluster", timeout=5.0).json()
    # Read, it is no file (a ring of none); written, its folder cannot be made.
    state = Path("/proc/ringlimit-no-such-folder/ring.json")
    result = ringlimit(
        "router",
        "--port",
        str(free_port()),
        "--node",
        f"n1={node}",
        "--state-file",
        str(state),
        "--rule",
        "other=7/minute",
        "--algorithm",
        "fixed_window",
    )
    one_line_failure(result, "the router could not start", str(state), "check --state-file")
    config = httpx.get(f"{node}/internal/cluster", timeout=5.0).json()
    assert [rule["name"] for rule in config["config"]["rules"]] == ["api"], config
    assert config["ring"] == before["ring"], config
    proc.stop()


def test_bench_with_a_node_that_cannot_start_is_one_line() -> None:
    """A process of the benchmark that exits at start (here: a bad setting in the
    environment its nodes read) ends the run in one line, everything stopped."""

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "router",
            "bench",
            "--quick",
            "--rows",
            "direct,sticky",
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RINGLIMIT_REDIS_PIPELINE": "sideways"},
    )
    line = one_line_failure(result, "ringlimit bench:")
    assert "exited" in line or "not ready" in line, line


@pytest.mark.parametrize(
    "flag", [["--redis-url", "redis://127.0.0.1:1/0"], ["--redis-pipeline", "off"]]
)
def test_a_router_takes_no_redis_connection_flag(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A router never talks to Redis: a flag it would ignore is refused, not accepted."""
    from router.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["router", "--backend", "redis", *flag])
    assert exited.value.code == 2
    assert f"unrecognized arguments: {flag[0]}" in capsys.readouterr().err
    for command in (["node", "--id", "n1", "--port", "1"], ["up"]):  # the nodes take it
        assert build_parser().parse_args([*command, "--backend", "redis", *flag]).backend == "redis"


@pytest.mark.parametrize("number", ROUTER_NUMBERS, ids=lambda n: n[0])
def test_every_router_number_is_checked_against_its_range(
    number: tuple[str, float, float, str],
) -> None:
    """Each numeric router flag: its allowed ends pass, the others and NaN are refused
    naming the flag (a forward timeout of 0 used to let every decision-API check
    through as "owner_timeout")."""
    from router.cli import _check_router_numbers, build_parser

    flag, low, high, bounds = number
    parser = build_parser()

    def check(value: float) -> None:
        # Without health checks: no lease, so each range is seen alone (the lease's
        # own combination of flags is the next test's).
        _check_router_numbers(parser.parse_args(["router", "--no-health-checks", flag, str(value)]))

    _check_router_numbers(parser.parse_args(["router"]))  # the defaults
    is_int = isinstance(low, int)
    step = 1 if is_int else 1e-3
    for value, allowed in [
        (low, bounds[0] == "["),
        (low - step, False),
        (low + step, True),
        (high, bounds[1] == "]"),
        (high + step, False),
    ]:
        if allowed:
            check(value)
        else:
            with pytest.raises(ValueError, match=f"^{flag} must be .* got "):
                check(value)
    if not is_int:
        with pytest.raises(ValueError, match=f"^{flag} must be"):
            check(float("nan"))


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--lease", "300"], None),
        (["--failure-threshold", "1"], None),  # a lease of exactly one probe round
        (["--lease", "300.5"], "--lease must be above 0 and at most 300"),
        (["--lease", "1.4"], "--lease (1.4 s) must outlast a probe round"),
        (["--health-interval", "100"], "the default lease, --failure-threshold x"),
        (["--health-interval", "100", "--lease", "200"], None),
        (["--health-interval", "100", "--no-health-checks"], None),
    ],
)
def test_the_lease_a_router_would_grant_is_one_a_node_accepts(
    flags: list[str], problem: str | None
) -> None:
    """Nodes refuse a lease over 300 s: a router granting one answered every check
    owner_unreachable (allowed, under on_error = open). A lease shorter than a
    probe round would lapse between probes."""
    from router.cli import _check_router_numbers, build_parser

    args = build_parser().parse_args(["router", *flags])
    if problem is None:
        _check_router_numbers(args)
    else:
        with pytest.raises(ValueError) as refused:
            _check_router_numbers(args)
        assert str(refused.value).startswith(problem), refused.value


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--forward-timeout", "0"], "--forward-timeout must be above 0"),
        (["--burst", "0"], "burst must be an integer 1..1000000000, got 0"),
        (["--replication-interval", "0"], "replication_interval must be between 0.001"),
    ],
)
def test_a_zero_that_used_to_mean_something_else_is_one_line(
    flags: list[str], expected: str
) -> None:
    """0 was taken as "the default" (burst, replication interval) or as a real
    timeout (every forward timed out at once)."""
    one_line_failure(ringlimit("router", "--port", str(free_port()), *flags), expected)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--header-timeout", "0"], "--header-timeout must be above 0"),
        (["--keep-alive", "nan"], "--keep-alive must be above 0"),
        (["--max-connections", "0"], "--max-connections must be at least 1"),
    ],
)
@pytest.mark.parametrize("command", [["router"], ["node", "--id", "n1", "--port", "1"]])
def test_connection_limits_are_refused_naming_their_flag(
    command: list[str], flags: list[str], expected: str
) -> None:
    """The errors named FrontDoor's fields (header_timeout), not the flags."""
    from router.cli import _front_door, build_parser

    with pytest.raises(ValueError, match=f"^{expected}"):
        _front_door(build_parser().parse_args([*command, *flags]))


@pytest.mark.parametrize("value", ["héllo", "a b", "tab\there", "new\nline"])
def test_a_token_that_cannot_travel_in_a_header_is_refused_at_start(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-latin-1 internal token crashed the router at start (UnicodeEncodeError);
    a UTF-8 admin or API token could never match a request (the security audit)."""
    from router.cli import _token

    monkeypatch.setenv("RINGLIMIT_INTERNAL_TOKEN", value)
    with pytest.raises(ValueError, match=r"^RINGLIMIT_INTERNAL_TOKEN must be visible ASCII"):
        _token("RINGLIMIT_INTERNAL_TOKEN")
    monkeypatch.setenv("RINGLIMIT_INTERNAL_TOKEN", "s3cret-._~+/=")
    assert _token("RINGLIMIT_INTERNAL_TOKEN") == "s3cret-._~+/="


def test_rules_failures_are_one_line(not_a_router: str, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    one_line_failure(
        ringlimit("rules", "--router", url), f"cannot reach the router at {url}", "refused"
    )
    one_line_failure(ringlimit("rules", "--router", not_a_router), "answered HTTP 404")
    one_line_failure(ringlimit("rules", str(tmp_path / "none.toml")), "none.toml: no such file")
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rules]]\nname = "api"\nrate = "often"\n')
    one_line_failure(ringlimit("rules", str(bad)), "bad.toml", "rules[0]")
    empty = tmp_path / "empty.toml"
    empty.write_text('[identity]\nname = "X-Api-Key"\n')
    one_line_failure(ringlimit("rules", str(empty)), "no [[rules]] to apply")
    # `rules list` reads; with a file named list here it refuses rather than
    # apply that file's rules to the cluster (./list does that).
    (tmp_path / "list").write_text('[[rules]]\nname = "api"\nrate = "1/hour"\n')
    listed = subprocess.run(
        [sys.executable, "-m", "router", "rules", "list", "--router", url],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60.0,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    one_line_failure(listed, "'list' names a file here too", "ringlimit rules ./list")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["router", "--port", "99999"], "argument --port: must be a port from 0 to 65535"),
        (["router", "--port", "-1"], "argument --port: must be a port from 0 to 65535"),
        (["node", "--id", "n1", "--port", "0"], "argument --port: must be a port from 1 to"),
        (["node", "--id", "n1", "--port", "65536"], "argument --port: must be a port from 1"),
        (["up", "--port", "0"], "argument --port: must be a port from 1 to 65535, got '0'"),
        (["up", "--node-port", "70000"], "argument --node-port: must be a port from 0 to"),
        (["router", "--grpc-port", "1e3"], "argument --grpc-port: must be a port from 0 to"),
        (["up", "--port", "65534", "--nodes", "2"], "node ports 65535..65536 go past 65535"),
        (["up", "--node-port", "65535", "--nodes", "2"], "node ports 65535..65536 go past"),
    ],
)
def test_a_port_out_of_range_is_one_line_naming_its_flag(argv: list[str], expected: str) -> None:
    """Ports were taken as any integer: socket.bind's OverflowError came out as a
    traceback (and `up` counted node ports past 65535)."""
    one_line_failure(ringlimit(*argv), expected)


@pytest.mark.parametrize("command", [["router"], ["up", "--nodes", "1"]], ids=["router", "up"])
def test_a_grpc_port_in_use_is_one_line(
    command: list[str], taken_port: int, tmp_path: Path
) -> None:
    """gRPC's RuntimeError ("Failed to bind to address") came out as a traceback
    (from `up`'s router, followed by "router exited with code 1")."""
    config = tmp_path / "envoy.yaml"
    config.write_text(MONGO)
    port = str(free_block(3))
    argv = [*command, "--port", port, "--grpc-port", str(taken_port), "--envoy-config", str(config)]
    one_line_failure(
        ringlimit(*argv),
        f"cannot listen on 127.0.0.1:{taken_port} for Envoy's rate limit service",
        "--grpc-port",
    )


def test_start_grpc_on_a_port_in_use_says_which(taken_port: int) -> None:
    """The port taken between the CLI's check and the bind: an error naming the
    port and the flag, which the CLI prints as its one line."""
    import asyncio

    from router.envoy import GrpcPortError, RateLimitServicer, start_grpc
    from router.envoy_config import EnvoyConfig

    async def start() -> None:
        servicer = RateLimitServicer(None, EnvoyConfig({}))  # type: ignore[arg-type]
        await start_grpc(servicer, "127.0.0.1", taken_port)

    with pytest.raises(GrpcPortError, match=f"127.0.0.1:{taken_port} .*--grpc-port"):
        asyncio.run(start())


def test_a_grpc_port_taken_after_the_check_is_one_line(
    taken_port: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Taken between the CLI's check and the bind: the router's start fails with
    the same one line (it was an OSError traceback from Router.start)."""
    from router import cli

    config = tmp_path / "envoy.yaml"
    config.write_text(MONGO)
    monkeypatch.setattr(cli, "_check_port", lambda *args, **kwargs: None)
    # In process: a server's start freezes the heap out of the GC (node.memory.tune_gc),
    # which stayed frozen for the worker's later tests (one asserts it is not).
    monkeypatch.setattr("node.server.tune_gc", lambda: None)
    argv = ["router", "--port", str(free_port()), "--grpc-port", str(taken_port)]
    assert cli.main([*argv, "--envoy-config", str(config)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ringlimit: the router could not start: cannot listen on"), err
    assert "--grpc-port" in err and len(err.splitlines()) == 1


@pytest.fixture
def odd_router() -> Iterator[tuple[str, Callable[[int, bytes], None]]]:
    """An HTTP server on 127.0.0.1 answering every request with the status and body
    set by the second item (a router whose errors are not {error, detail})."""
    answer: dict[str, Any] = {"status": 200, "body": b"{}"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            body = answer["body"]
            self.send_response(answer["status"])
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    def set_answer(status: int, body: bytes) -> None:
        answer.update(status=status, body=body)

    with serving(Handler) as url:
        yield url, set_answer


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (500, b'{"message": "boom"}', ["answered HTTP 500", '{"message": "boom"}']),
        (503, b"upstream\nconnect error", ["answered HTTP 503", "upstream connect error"]),
        (502, b"", ["answered HTTP 502", "empty body"]),
        (400, b'{"error": "bad\\nrule", "detail": "line 1\\nline 2"}', ["bad rule: line 1 line 2"]),
        (409, b'{"error": "ring_changed"}', ["ringlimit: ring_changed"]),
        (400, b'{"error": ["a"], "detail": 1}', ["answered HTTP 400", '{"error": ["a"]']),
        (200, b"[" * 100_000, ["answered HTTP 200, not as a ringlimit router's", "[[[["]),
        (404, b"\xff\xfe not utf-8", ["answered HTTP 404", "not utf-8"]),
        # `rules` printed it and exited 0.
        (200, b'{"rules": 7, "epoch": 1}', ["answered HTTP 200, not as a ringlimit router's"]),
        # python -m http.server: "(see the router's log)", of a router that was not one.
        (501, b"<!DOCTYPE HTML>", ["answered HTTP 501, not as a ringlimit router's"]),
    ],
    ids=[
        "500-json",
        "503-text",
        "502-empty",
        "newlines",
        "no-detail",
        "error-list",
        "deep",
        "bytes",
        "rules-junk",
        "501-html",
    ],
)
@pytest.mark.parametrize("command", [["nodes", "list"], ["rules"]], ids=["nodes", "rules"])
def test_an_admin_answer_of_another_shape_is_one_line(
    odd_router: tuple[str, Callable[[int, bytes], None]],
    command: list[str],
    status: int,
    body: bytes,
    expected: list[str],
) -> None:
    """A router's error not in {error, detail} printed "None: None" (or its
    JSON's newlines as lines, a deep array as a RecursionError traceback); a
    body that is no JSON at all did not say what it was. Now: one line with
    the status and a short excerpt of the body."""
    url, set_answer = odd_router
    set_answer(status, body)
    line = one_line_failure(ringlimit(*command, "--router", url), *expected)
    assert "None" not in line and len(line) < 400, line


def test_a_router_url_with_a_path_is_named(
    odd_router: tuple[str, Callable[[int, bytes], None]],
) -> None:
    """``--router http://host:port/admin`` said only "not_found: Not Found"."""
    url, set_answer = odd_router
    set_answer(404, b'{"error": "not_found", "detail": "Not Found"}')
    one_line_failure(
        ringlimit("nodes", "list", "--router", url + "/admin"),
        "not_found: Not Found (check --router: the router's URL, without a path)",
    )


def _unreadable(path: Path) -> None:
    path.write_text("{}")
    path.chmod(0)


#: A file of each kind that cannot be used: (how to make it at a path, the problem said).
BAD_FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "directory": (lambda p: p.mkdir(), "cannot read: a directory, not a"),
    "not-utf8": (
        lambda p: p.write_bytes(b"\xff\xfe[x]\n"),
        "not UTF-8 text (byte 0xff at offset 0)",
    ),
    "nested": (
        lambda p: p.write_text(
            "[" * 100_000 if p.suffix in (".json", ".yaml") else "a = " + "[" * 5000 + "]" * 5000
        ),
        "nested too deeply",
    ),
    "under-a-file": (lambda p: p.parent.write_text(""), "Not a directory"),
    "unreadable": (lambda p: _unreadable(p), "Permission denied"),
    # Read whole before: /dev/zero grew a command to 9.5 GB in 8 s.
    "endless": (lambda p: p.symlink_to("/dev/zero"), "more than 16 MiB: too large for a"),
}

#: Each command given such a file: (argv before the path, the file's name, what the line says).
FILE_COMMANDS: dict[str, tuple[list[str], str, str]] = {
    "rules": (["rules"], "rules.json", "ringlimit: error:"),
    "up-config": (["up", "--nodes", "1", "--config"], "cluster.toml", "ringlimit: error:"),
    "simulate": (["simulate", "--quiet"], "scenario.toml", "ringlimit simulate:"),
    "state-file": (["router", "--state-file"], "ring.json", "the router could not start"),
    "envoy-config": (
        ["router", "--grpc-port", "0", "--envoy-config"],
        "envoy.yaml",
        "ringlimit: error:",
    ),
}


@pytest.mark.parametrize("kind", BAD_FILES)
@pytest.mark.parametrize("command", FILE_COMMANDS)
def test_a_file_that_cannot_be_used_is_one_line_naming_it(
    command: str, kind: str, tmp_path: Path
) -> None:
    """A directory, an unreadable file, bytes that are not UTF-8 or a document
    nested past the parser's recursion: each a traceback (IsADirectoryError,
    RecursionError...) or a codec's message naming no file, for one command or
    another; a state file under a regular file failed at its first save."""
    make, problem = BAD_FILES[kind]
    if kind == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads any file")
    argv, name, says = FILE_COMMANDS[command]
    path = tmp_path / "sub" / name if kind == "under-a-file" else tmp_path / name
    make(path)
    if command == "state-file":
        argv = [*argv, str(path), "--port", str(free_port())]
    else:
        argv = [*argv, str(path)]
    line = one_line_failure(ringlimit(*argv), says, str(path), problem)
    if command == "state-file":
        assert line.endswith("check --state-file"), line


def test_a_state_file_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """Its folder cannot be made (not even by root, under /proc): the first save
    at start was an OSError traceback."""
    state = "/proc/ringlimit-no-such-dir/ring.json"
    result = ringlimit("router", "--port", str(free_port()), "--state-file", state)
    one_line_failure(
        result, "the router could not start", f"{state}: cannot write ring state", "--state-file"
    )


#: Outputs that cannot be written: (how to make the path, what the line says).
BAD_OUTPUTS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "directory": (lambda tmp: tmp, "a directory, not a file"),
    "under-a-file": (
        lambda tmp: _file(tmp / "plain") / "out.json",
        "a folder of its path is a file",
    ),
    "no-folder": (lambda tmp: Path("/proc/ringlimit-no-such-dir/out.json"), "cannot write"),
}


def _file(path: Path) -> Path:
    path.write_text("")
    return path


@pytest.mark.parametrize("kind", BAD_OUTPUTS)
def test_simulate_to_an_output_it_cannot_write_is_one_line_before_running(
    kind: str, tmp_path: Path
) -> None:
    """--json at a directory (or where no file can be made) was an IsADirectoryError
    traceback after the whole simulation, its results lost: now one line, before
    anything runs (no report printed)."""
    make, problem = BAD_OUTPUTS[kind]
    out = make(tmp_path)
    result = ringlimit("simulate", "tiny", "--quiet", "--json", str(out))
    one_line_failure(result, "ringlimit simulate:", f"--json {out}", problem)
    assert result.stdout == "", result.stdout


def test_simulate_plots_into_a_file_is_one_line_before_running(tmp_path: Path) -> None:
    plots = _file(tmp_path / "plots")
    result = ringlimit("simulate", "tiny", "--quiet", "--plots", str(plots))
    one_line_failure(result, f"--plots {plots}: not a directory")
    assert result.stdout == "", result.stdout


BENCH_DIRECT = [sys.executable, "-m", "router", "bench", "--quick", "--rows", "direct"]


def test_bench_to_an_output_it_cannot_write_is_one_line_before_running(tmp_path: Path) -> None:
    """--json (or --markdown) at a directory was a traceback after the whole
    benchmark. (A node that cannot start would end the run in its own line: the
    output is checked before that.)"""
    result = subprocess.run(
        [*BENCH_DIRECT, "--no-progress", "--json", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RINGLIMIT_REDIS_PIPELINE": "sideways"},
    )
    one_line_failure(result, f"--json {tmp_path}: a directory, not a file")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e9", "soon"])
def test_a_join_timeout_that_is_not_seconds_is_one_line(value: str) -> None:
    """0, negative, NaN and infinite timeouts were taken (NaN never ran out: the
    deadline comparison is always false)."""
    argv = ["node", "--id", "n1", "--port", str(free_port()), "--join-timeout", value]
    one_line_failure(
        ringlimit(*argv, "--join", "http://127.0.0.1:9"),
        "argument --join-timeout: must be seconds above 0 and at most 86400",
    )


def test_a_join_to_a_router_that_never_answers_ends_within_its_timeout() -> None:
    """Each join attempt waited up to a fixed 30 s for the answer: a router that
    took the connection and said nothing held a --join-timeout 1 for 30 s."""
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # connections complete in the backlog; none is answered
        router = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        result = ringlimit(
            "node", "--id", "n1", "--port", str(free_port()), "--join", router,
            "--join-timeout", "1",
        )  # fmt: skip
        elapsed = time.monotonic() - started
    one_line_failure(result, "could not join the ring", router)
    assert elapsed < 15, elapsed


def test_a_join_answered_200_by_something_else_is_not_taken_as_joined(
    odd_router: tuple[str, Callable[[int, bytes], None]],
) -> None:
    """Any 200 was taken as joined: a --join at a server that is not a ringlimit
    router left the node serving, fenced (refusing every key) for good."""
    url, set_answer = odd_router
    set_answer(200, b'{"ok": true}')
    argv = ["node", "--id", "n1", "--port", str(free_port()), "--join", url]
    one_line_failure(
        ringlimit(*argv, "--join-timeout", "5", timeout=30),
        "could not join the ring",
        f"{url} answered 200, not as a ringlimit router",
        "check --join",
    )


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5"])
def test_a_coordinator_ttl_that_is_not_seconds_is_one_line(value: str) -> None:
    """inf was an OverflowError traceback, NaN a line naming no flag ("cannot
    convert float NaN to integer"), 0 and negative ones quietly 2 s."""
    argv = ["router", "--port", str(free_port()), "--coordinator", "etcd://127.0.0.1:1"]
    one_line_failure(
        ringlimit(*argv, "--coordinator-ttl", value),
        "--coordinator-ttl",
        "whole number of seconds from 2 to 3600",
    )


@pytest.mark.parametrize("command", [["node", "--id", "n1"], ["up", "--nodes", "1"]])
@pytest.mark.parametrize("url", ["notaurl", "ftp://x", "http://", "http://h:99999"])
def test_an_upstream_that_is_not_an_http_url_is_one_line(command: list[str], url: str) -> None:
    """Taken as it was: the cluster started, and every allowed request failed."""
    argv = [*command, "--port", str(free_block(2)), "--upstream", url]
    one_line_failure(ringlimit(*argv, timeout=30), f"--upstream {url!r}", "http://")


@pytest.mark.parametrize("flag", ["--upstream-idle", "--upstream-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "3601"])
def test_upstream_seconds_that_are_not_seconds_are_refused(flag: str, value: str) -> None:
    from router.cli import _check_upstream_seconds, build_parser

    for command in (["node", "--id", "n1", "--port", "1"], ["up"]):
        args = build_parser().parse_args(
            [*command, "--upstream", "http://127.0.0.1:9", flag, value]
        )
        with pytest.raises(ValueError, match=f"^{flag} .*: must be above 0 and at most 3600"):
            _check_upstream_seconds(args)


def test_an_upstream_idle_that_is_not_seconds_is_one_line() -> None:
    argv = ["node", "--id", "n1", "--port", str(free_port()), "--upstream", "http://127.0.0.1:9"]
    one_line_failure(ringlimit(*argv, "--upstream-idle", "0"), "--upstream-idle 0", "at most 3600")


def test_an_upstream_timeout_that_is_not_seconds_is_one_line() -> None:
    argv = ["node", "--id", "n1", "--port", str(free_port()), "--upstream", "http://127.0.0.1:9"]
    one_line_failure(
        ringlimit(*argv, "--upstream-timeout", "nan"), "--upstream-timeout nan", "at most 3600"
    )


def test_a_keep_alive_routers_and_nodes_would_race_is_warned_of(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Within 1 s of REUSE_IDLE, routers and peers would write requests on
    connections this process is closing (tests/test_idle_reuse.py)."""
    from router.cli import _front_door, _warn_keep_alive, build_parser

    for keep_alive, warned in (("4", True), ("4.9", True), ("5", False), ("30", False)):
        args = build_parser().parse_args(["router", "--keep-alive", keep_alive])
        _warn_keep_alive(_front_door(args))
        said = capsys.readouterr().err
        assert ("ringlimit: warning: --keep-alive" in said) is warned, (keep_alive, said)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://127.0.0.1:9/?v=1", "a query or fragment"),
        ("http://127.0.0.1:9/app#top", "a query or fragment"),
        ("http://127.0.0.1:9/?", "a query or fragment"),
        ("http://ann:s3cret@127.0.0.1:9/", "credentials in the URL"),
        ("http://ann@127.0.0.1:9/", "credentials in the URL"),
        ("http://ann:s3cret@127.0.0.1:99999/", "port is not a number"),
        ("ftp://ann:s3cret@127.0.0.1:9/", "expected http://"),
        # A '#' or '/' in the password moves it out of what is parsed as user info.
        ("http://ann:s3c#ret@127.0.0.1:9/", "port is not a number"),
        ("http://ann:s3c/ret@127.0.0.1:80/", "port is not a number"),
        ("http://127.0.0.1:9/?api_key=s3cret", "a query or fragment"),
    ],
)
def test_an_upstream_url_that_would_garble_requests_is_refused(url: str, said: str) -> None:
    """A query in --upstream put every request's path inside it (GET /ok reached
    the upstream as /?v=1/ok); credentials in it made every request whose
    client sent its own Authorization a 500 (aiohttp refuses both). Refused
    at start, the credentials never repeated."""
    from router.cli import _check_upstream

    with pytest.raises(ValueError) as refused:
        _check_upstream(url)
    shown = str(refused.value)
    assert said in shown and "s3c" not in shown and "ret@" not in shown, shown


@pytest.mark.parametrize("where", ["body", "head"])
@pytest.mark.parametrize(
    "command",
    [["nodes", "list"], ["rules"], ["nodes", "add", "n9", "http://127.0.0.1:9"]],
    ids=["nodes", "rules", "add"],
)
def test_an_admin_answer_that_never_ends_is_cut_off_at_the_timeout(
    command: list[str], where: str
) -> None:
    """A router that sent its answer a byte at a time held `ringlimit nodes list`
    for minutes (httpx's 60 s is per read, and a paused router took 60 s):
    --timeout bounds the whole answer, its status line included, in one line.
    The router was reached, so the line does not say it could not be (it did,
    for a join the router was still waiting on: an exploratory tester); for a
    change, it says that the change may still be made."""

    class Drip(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            self.do_GET()

        def do_GET(self) -> None:
            head = (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
            )
            if where == "body":
                self.wfile.write(head)
                head = b" " * 100
            for byte in head[:40]:  # at most 12 s; over at once when the client goes
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.3)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Drip) as url:
        began = time.monotonic()
        result = ringlimit(*command, "--router", url, "--timeout", "1.5")
        took = time.monotonic() - began
    line = one_line_failure(result, "gave no whole answer within --timeout 1.5 s")
    assert "cannot reach" not in line, line
    if command[1:2] == ["add"]:
        assert "the change may still be made" in line, line
    assert took < 8.0, took


def test_an_admin_timeout_that_is_not_seconds_is_one_line() -> None:
    one_line_failure(ringlimit("nodes", "list", "--timeout", "0"), "--timeout 0: must be above 0")


def test_a_redis_timeout_the_router_would_not_wait_for_is_warned_of(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``up --backend redis --redis-timeout 5 --forward-timeout 1``: with Redis
    stopped (SIGSTOP) a request was answered 504 node_timeout after 1 s, where the
    node would have decided by on_error at 5 s; nothing said so at start. Now one
    line names both values and the consequence (only in Redis mode, only when the
    Redis timeout is not below the forward timeout, 3 s by default)."""
    from router.cli import _redis_timeout, _warn_redis_timeout, build_parser, cluster_config

    cases = (
        (["--redis-timeout", "5", "--forward-timeout", "1"], True),
        (["--redis-timeout", "3"], True),  # the default forward timeout
        (["--redis-timeout", "1", "--forward-timeout", "1"], True),
        (["--redis-timeout", "0.5", "--forward-timeout", "1"], False),
        (["--redis-timeout", "2.9"], False),
    )
    for flags, warned in cases:
        for backend in ("redis", "memory"):
            args = build_parser().parse_args(["up", "--backend", backend, *flags])
            _warn_redis_timeout(_redis_timeout(args), args.forward_timeout, cluster_config(args))
            said = capsys.readouterr().err
            expected = warned and backend == "redis"
            assert ("ringlimit: warning: --redis-timeout" in said) is expected, (flags, said)
            assert said.count("\n") == int(expected), said
    args = build_parser().parse_args(
        ["up", "--backend", "redis", "--redis-timeout", "5", "--forward-timeout", "1"]
    )
    _warn_redis_timeout(_redis_timeout(args), args.forward_timeout, cluster_config(args))
    said = capsys.readouterr().err
    assert "--redis-timeout 5 " in said and "--forward-timeout 1:" in said and "504" in said


def test_up_warns_of_a_redis_timeout_before_anything_starts() -> None:
    """The warning comes before `up` checks Redis (unreachable here: it then stops)."""
    result = ringlimit(
        *("up", "--backend", "redis", "--redis-url", f"redis://127.0.0.1:{free_port()}/0"),
        *("--redis-timeout", "5", "--forward-timeout", "1", "--nodes", "1"),
        *("--port", str(free_block(4))),  # not 8000, which a person may be using
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and len(lines) == 2, result.stderr
    assert lines[0].startswith("ringlimit: warning: --redis-timeout 5 is not below"), lines
    assert "cannot reach Redis" in lines[1], lines


def test_a_config_with_no_rules_is_said_at_start(
    procs: Procs,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An empty ``--config`` started a router (or a node of its own) that limited
    nothing, without a word (an exploratory tester); ``ringlimit rules FILE``
    refuses such a file."""
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    warning = f"warning: no rules: {empty} has no [[rules]]"
    router, _ = procs.router(None, "--config", str(empty), healthy=False)
    node, _ = procs.node("n1", None, "--config", str(empty))
    ruled, _ = procs.node("n2", None, "--config", str(empty), "--rule", "5/minute")
    assert wait_for(lambda: warning in router.output(), timeout=20.0), router.output()
    for proc in (router, node, ruled):
        proc.stop()
    assert warning in node.output()
    assert "no rules" not in ruled.output()
    # `up` says it once, naming the user's file (its router reads a copy of it).
    argv = ["up", "--port", str(free_block(2)), "--nodes", "1", "--config", str(empty)]
    up = procs.start("up", argv)
    assert wait_for(lambda: "ring epoch 1" in up.output(), timeout=30.0), up.output()
    up.stop()
    assert up.output().count("warning: no rules") == 1 and warning in up.output(), up.output()
    assert "rules: none (every request is admitted)" in up.output()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["list", "extra"], "usage: ringlimit nodes list (it takes no ID or URL)"),
        (["remove", "n1", "http://127.0.0.1:9"], "(it takes no URL)"),
        (["remove"], "usage: ringlimit nodes remove ID"),
        (["add", "n4"], "usage: ringlimit nodes add ID URL"),
        (["list", "--force"], "--force goes with ringlimit nodes remove"),
    ],
)
def test_nodes_words_an_action_does_not_take_are_refused(argv: list[str], said: str) -> None:
    """``nodes list extra`` listed the ring and dropped ``extra`` without a word
    (an exploratory tester); nothing is sent for a command that is not whole."""
    one_line_failure(ringlimit("nodes", *argv, "--router", f"http://127.0.0.1:{free_port()}"), said)


def test_a_rule_name_given_twice_says_which_flag(tmp_path: Path) -> None:
    """``rule name '5-per-minute' is used twice`` named neither the flag nor the
    file (an exploratory tester)."""
    config = tmp_path / "rules.toml"
    config.write_text('[[rules]]\nname = "5-per-minute"\nrate = "5/minute"\n')
    port = str(free_port())
    one_line_failure(
        ringlimit("router", "--port", port, "--config", str(config), "--rule", "5/minute"),
        "--rule 5/minute: rule name '5-per-minute' is used twice",
        f"also in {config}",
    )


def test_a_node_stopped_before_it_joined_makes_no_leave(procs: Procs) -> None:  # noqa: F811
    """SIGTERM to a ``--join`` node whose router never answered: it is in no
    ring, and it spent 20 s retrying a leave ("graceful leave: ... ConnectError;
    retrying": an exploratory tester). It exits at once now, saying why."""
    router = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    node = procs.start("n1", ["node", "--id", "n1", "--port", str(port), "--join", router])
    assert wait_for(lambda: _accepts(port), 20.0)  # serving, its join still retried
    started = time.monotonic()
    node.stop()
    assert time.monotonic() - started < 5.0
    output = node.output()
    assert "no leave to make" in output and "graceful leave" not in output, output


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("extra", "given", "says"),
    [
        (["requirepass"], "", "refused the credentials (AuthenticationError"),
        (["requirepass"], ":wrong@", "refused the credentials (AuthenticationError"),
        # A replica of a primary that is not there: PING answers, writes do not.
        (["--replicaof", "127.0.0.1", "1"], "", "takes no writes"),
        # A user whose ACL lacks SET: its ACL, not its password (the review).
        (["acl"], "reader:pw@", "refused the user a command or key"),
    ],
    ids=["no-password", "wrong-password", "replica", "acl"],
)
def test_up_says_what_a_redis_that_answers_refuses(
    tmp_path: Path, extra: list[str], given: str, says: str
) -> None:
    """A Redis that wants a password was said to be unreachable ("start
    redis-server"), and a read-only replica was taken: every check then fell to
    the nodes' local limiters, over the limit (an exploratory tester)."""
    from tests.redis_server import RedisServer, find_redis_server

    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server is not installed")
    password, acl = extra == ["requirepass"], extra == ["acl"]
    server = RedisServer(binary, tmp_path, extra_args=[] if password or acl else extra)
    server.start()  # (its readiness probe sends no password: set once it answers)
    try:
        if password:
            with contextlib.closing(server.client()) as client:
                client.config_set("requirepass", "s3cret")
        if acl:
            with contextlib.closing(server.client()) as client:
                client.acl_setuser(
                    "reader", enabled=True, passwords=["+pw"], commands=["+ping"], keys=["*"]
                )
        url = f"redis://{given}127.0.0.1:{server.port}/0"
        line = one_line_failure(
            ringlimit("up", "--backend", "redis", "--redis-url", url, "--port", str(free_block(4))),
            says,
        )
        assert "cannot reach" not in line and "wrong" not in line.replace(url, ""), line
    finally:
        server.stop()


def test_up_names_the_flag_of_a_redis_url_it_cannot_parse() -> None:
    """``redis://[::1`` said only "Invalid IPv6 URL"."""
    line = one_line_failure(
        ringlimit("up", "--backend", "redis", "--redis-url", "redis://[::1", "--port", "1"),
        "--redis-url redis://[::1: Invalid IPv6 URL",
    )
    assert line
