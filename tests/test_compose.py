"""docker-compose.yml agrees with the CLI (no Docker engine runs here).

Each ringlimit command in the compose file is parsed by the real argument
parser, so a renamed or removed flag breaks this test; ports, node URLs and
service names are checked against each other.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
ENV = {"RINGLIMIT_BACKEND": "memory", "RINGLIMIT_ADMIN_TOKEN": "a", "RINGLIMIT_INTERNAL_TOKEN": "i"}


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR:-default} and ${VAR:?error}, enough for this file."""
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, op, rest = match.group(1), match.group(2), match.group(3)
            if name in env:
                return env[name]
            if op == ":-":
                return rest
            raise KeyError(f"{name} must be set: {rest}")

        return re.sub(r"\$\{(\w+)(:-|:\?)?([^}]*)\}", sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), ENV)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]  # type: ignore[no-any-return]


def parse(command: list[str]) -> Any:
    return build_parser(command[0]).parse_args(command)


def published(service: dict[str, Any]) -> set[int]:
    return {int(p.split(":")[-1]) for p in service.get("ports", [])}


def exposed(service: dict[str, Any]) -> set[int]:
    return {int(p) for p in service.get("expose", [])} | published(service)


def test_the_services_are_there(services: dict[str, Any]) -> None:
    assert {"redis", "demo", "etcd", "router", "router2", "node1", "node2", "node3"} <= set(
        services
    )


def test_two_routers_share_one_ring_through_etcd(services: dict[str, Any]) -> None:
    """Both routers coordinate through the etcd service, advertise their own service
    name, carry the same rules and publish different host ports."""
    from router.coordinator import parse_endpoints

    etcd_ports = exposed(services["etcd"])
    commands = {}
    for name in ("router", "router2"):
        service = services[name]
        endpoints = parse_endpoints(service["environment"]["RINGLIMIT_COORDINATOR"])
        assert endpoints and all(h == "etcd" and p in etcd_ports for h, p in endpoints)
        assert "etcd" in service["depends_on"]
        args = parse(service["command"])
        assert args.run.__name__ == "_run_router"
        assert args.advertise == f"http://{name}:{args.port}"
        assert args.port in {int(p.split(":")[-1]) for p in service["ports"]}
        commands[name] = args
    assert commands["router"].rule == commands["router2"].rule
    hosts = [
        {int(p.split(":")[0]) for p in services[name]["ports"]} for name in ("router", "router2")
    ]
    assert not hosts[0] & hosts[1], "each router needs a host port of its own"
    # Only the first router seeds the ring; etcd's view wins over seeds anyway.
    assert commands["router"].node and not commands["router2"].node


def test_the_ring_record_in_etcd_outlives_its_container(
    services: dict[str, Any], compose: dict[str, Any]
) -> None:
    etcd = services["etcd"]
    command = etcd["command"]
    data_dir = command[command.index("--data-dir") + 1]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in etcd.get("volumes", [])}
    assert data_dir in volumes, "etcd's --data-dir is not on a volume"
    assert volumes[data_dir] in compose.get("volumes", {}), "a named volume, declared"


def test_every_node_command_parses_and_matches_its_service(services: dict[str, Any]) -> None:
    for name in ("node1", "node2", "node3"):
        args = parse(services[name]["command"])
        assert args.run.__name__ == "_run_node"
        assert args.port in exposed(services[name])
        assert not published(services[name]), "nodes must not be published beyond the network"
        assert args.url == f"http://{name}:{args.port}"
        assert args.fenced, "a cluster node must not decide before the router's first view"
        assert args.upstream == f"http://demo:{next(iter(exposed(services['demo'])))}"
        assert args.redis_url.startswith("redis://redis:")
        assert args.backend in ("memory", "redis")


def test_the_router_seeds_every_node_by_service_name(services: dict[str, Any]) -> None:
    args = parse(services["router"]["command"])
    assert args.run.__name__ == "_run_router"
    assert args.port in published(services["router"])
    nodes = {}
    for seed in args.node:
        node_id, url = seed.split("=", 1)
        nodes[node_id] = url
    for name in ("node1", "node2", "node3"):
        node = parse(services[name]["command"])
        assert nodes[node.id] == node.url
    assert args.rule, "the router carries the cluster's rules"


def test_tokens_are_required_beyond_loopback(services: dict[str, Any]) -> None:
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    assert ":?" in raw["router"]["environment"]["RINGLIMIT_ADMIN_TOKEN"]
    for name in ("router", "node1", "node2", "node3"):
        token = raw[name]["environment"]["RINGLIMIT_INTERNAL_TOKEN"]
        assert ":?" in token, f"{name} must refuse to start without an internal token"
    with pytest.raises(KeyError):
        interpolate(raw["router"]["environment"], {})


def test_the_redis_backend_switch_reaches_every_ringlimit_service() -> None:
    data = yaml.safe_load(COMPOSE.read_text())["services"]
    env = {**ENV, "RINGLIMIT_BACKEND": "redis"}
    for name in ("router", "node1", "node2", "node3"):
        args = parse(interpolate(data[name]["command"], env))
        assert args.backend == "redis"


def test_the_demo_upstream_imports() -> None:
    from node.demo import app

    assert callable(app)


def test_the_dockerfile_installs_the_cli() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install" in dockerfile and 'ENTRYPOINT ["ringlimit"]' in dockerfile
    # Every package of the wheel (simulate and bench are commands of the same CLI).
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    assert {"simulations", "benchmarks"} <= set(packages)
    ignored = (ROOT / ".dockerignore").read_text().split()
    for package in packages:
        assert f"COPY {package} ./{package}" in dockerfile
        assert package not in ignored


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="docker compose is not available on this machine",
)
def test_docker_compose_config_accepts_the_file() -> None:
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        env={**os.environ, **ENV},
        text=True,
    )
    assert result.returncode == 0, result.stderr
