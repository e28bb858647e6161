"""``ringlimit up``: a router and N node processes on 127.0.0.1, stopped together.

Every node is its own process (a node is the single authority for its keys
and must not be split into workers). Nodes start fenced: they refuse every
key until the router, seeded with all of them, pushes the first ring view and
the cluster config, so no node ever decides with rules of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import httpx

from node.config import ClusterConfig


class Cluster:
    """Processes started together and stopped together."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        #: Secrets (the Redis URL may hold a password) go through the environment,
        #: not the command line, where any local user could read them.
        self.env = env

    def start(self, name: str, argv: list[str]) -> None:
        process = subprocess.Popen([sys.executable, "-m", "router", *argv], env=self.env)
        self.processes.append((name, process))

    def stop(self, timeout: float = 10.0) -> None:
        # The router first, so no request reaches a node that is going away.
        for _, process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, process in self.processes:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                process.wait(remaining)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def failed(self) -> str | None:
        for name, process in self.processes:
            if process.poll() is not None:
                return f"{name} exited with code {process.returncode}"
        return None


def run_cluster(args: argparse.Namespace, config: ClusterConfig) -> int:
    host = "127.0.0.1"
    first_node_port = args.node_port or args.port + 1
    workdir = Path(tempfile.mkdtemp(prefix="ringlimit-"))
    config_file = workdir / "cluster.json"
    config_file.write_text(json.dumps(config.to_dict()))
    cluster = Cluster(
        {
            **os.environ,
            "RINGLIMIT_REDIS_URL": args.redis_url,
            "RINGLIMIT_REDIS_PIPELINE": args.redis_pipeline,
        }
    )
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    nodes = []
    try:
        for i in range(args.nodes):
            node_id, port = f"n{i + 1}", first_node_port + i
            argv = ["node", "--id", node_id, "--port", str(port), "--host", host, "--fenced"]
            argv += ["--config", str(config_file), "--backend", config.backend]
            argv += ["--balance", config.balance]
            if args.upstream:
                argv += ["--upstream", args.upstream]
            if args.app:
                argv += ["--app", args.app]
            cluster.start(node_id, argv)
            nodes.append(f"{node_id}=http://{host}:{port}")
        router_argv = ["router", "--port", str(args.port), "--host", host]
        router_argv += ["--config", str(config_file), "--backend", config.backend]
        router_argv += ["--balance", config.balance]
        for seed in nodes:
            router_argv += ["--node", seed]
        if args.state_file:
            router_argv += ["--state-file", args.state_file]
        if getattr(args, "grpc_port", None) is not None:
            router_argv += ["--grpc-port", str(args.grpc_port)]
        for envoy_file in getattr(args, "envoy_config", ()):
            router_argv += ["--envoy-config", str(Path(envoy_file).resolve())]
        cluster.processes.insert(0, ("router", _popen(router_argv)))
        router_url = f"http://{host}:{args.port}"
        ring = _wait_for_ring(router_url, cluster, lambda: stopping)
        if ring is None:
            if stopping:
                return 0  # asked to stop while starting (Ctrl-C, SIGTERM): not a failure
            reason = cluster.failed() or "not ready within 30 s"
            print(f"ringlimit: the cluster did not start: {reason}", file=sys.stderr)
            return 1
        _print_banner(router_url, ring, config)
        while not stopping:
            problem = cluster.failed()
            if problem:
                print(f"ringlimit: {problem}; stopping the cluster", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        cluster.stop()
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()


def _popen(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "router", *argv], env=os.environ.copy())


def _wait_for_ring(url: str, cluster: Cluster, stopping: object) -> dict | None:
    deadline = time.monotonic() + 30.0
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline and not stopping():  # type: ignore[operator]
            if cluster.failed():
                return None
            try:
                if client.get(f"{url}/healthz").status_code == 200:
                    ring: dict = client.get(f"{url}/admin/ring").json()
                    return ring
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    return None


def _print_banner(url: str, ring: dict, config: ClusterConfig) -> None:
    rules = ", ".join(f"{s.rule.name} ({s.rule.algorithm})" for s in config.rules)
    print(f"ringlimit router: {url}   backend={config.backend} balance={config.balance}")
    print(f"rules: {rules}")
    print(f"ring epoch {ring['epoch']}:")
    for node in ring["nodes"]:
        print(f"  {node['id']}  {node['url']}  weight={node['weight']}")
    print(f"try:  curl -i -H 'X-User-Id: alice' {url}/hello     (Ctrl-C stops everything)")
    sys.stdout.flush()
