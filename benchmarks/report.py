"""The report of ``ringlimit bench``: summaries, ratios, targets and tables (pure).

Every function here takes the report dictionary (or parts of it) and returns
numbers or lines, so the table and the targets can be tested without starting
anything. Medians over rounds; ratios are medians of per-round ratios (rows
measured side by side in a round: this machine is shared and noisy).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.deployments import BATCH, ROLES, ROWS


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise_row(key: str, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of one row (``runs``: :meth:`Run.to_dict` values)."""
    loads = [r["load"] for r in runs]
    per = [r.get("decisions_per_request", 1) for r in runs]
    cpu = {
        role: median([r["cpu_us_per_request"].get(role) for r in runs])
        for role in ROLES
        if any(role in r["cpu_us_per_request"] for r in runs)
    }
    total = None
    if cpu:
        totals = [sum(v for v in r["cpu_us_per_request"].values() if v is not None) for r in runs]
        total = median(totals)
    return {
        "key": key,
        "label": ROWS.get(key, key),
        "rounds": len(runs),
        "rps": median([x["rps"] for x in loads]),
        "rps_runs": [x["rps"] for x in loads],
        "decisions_per_s": median([x["rps"] * d for x, d in zip(loads, per, strict=True)]),
        "p50_ms": median([x["p50_ms"] for x in loads]),
        "p99_ms": median([x["p99_ms"] for x in loads]),
        "cpu_us": cpu,
        "cpu_total_us": total,
        "allowed": sum(x["allowed"] for x in loads),
        "denied": sum(x["denied"] for x in loads),
        "errors": sum(x["status_errors"] + x["socket_errors"] for x in loads),
    }


def round_ratios(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Median of per-round ratios a[i] / b[i] (rows measured side by side in a round)."""
    pairs = [x / y for x, y in zip(a, b, strict=False) if y]
    return statistics.median(pairs) if pairs else None


def add_ratios(rows: dict[str, dict[str, Any]]) -> None:
    for reference, name in (("direct", "vs_direct"), ("redis", "vs_redis")):
        ref = rows.get(reference)
        for row in rows.values():
            row[name] = round_ratios(row["rps_runs"], ref["rps_runs"]) if ref is not None else None


def check_exactness(
    key: str, result: dict[str, Any], factor: int, users: int, limit: int
) -> dict[str, Any]:
    """Does a tight run agree with the rule? ``result``: the tight run's LoadResult dict."""
    expected = users * limit
    allowed = int(result["allowed"])
    decided = allowed + int(result["denied"])
    enough = decided >= 3 * expected
    if factor == 1:
        ok = allowed == expected and enough
        note = "exact" if ok else ("too few requests" if not enough else "WRONG")
    else:
        ok = expected <= allowed <= factor * expected and enough
        note = f"{allowed / expected:.2f}x the limit (each of {factor} nodes counts alone)"
    return {
        "key": key,
        "allowed": allowed,
        "denied": int(result["denied"]),
        "expected": expected,
        "max_expected": expected * factor,
        "ok": ok,
        "note": note,
    }


@dataclass
class Target:
    name: str
    measured: float | None
    goal: float
    at_most: bool = False
    unit: str = "x"
    detail: str = ""

    @property
    def ok(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured <= self.goal if self.at_most else self.measured >= self.goal

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measured": self.measured,
            "goal": self.goal,
            "at_most": self.at_most,
            "unit": self.unit,
            "detail": self.detail,
            "pass": self.ok,
        }


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(report: dict[str, Any]) -> list[Target]:
    """The goals the run is judged by, in the order the table shows them."""
    return [
        *_throughput_targets(report.get("rows", {})),
        *_engine_targets(report.get("engine", {})),
        *_memory_and_handoff_targets(report),
        *_exactness_targets(report.get("exactness", {})),
    ]


def _throughput_targets(rows: dict[str, dict[str, Any]]) -> list[Target]:
    out: list[Target] = []
    sticky, redis, direct = rows.get("sticky"), rows.get("redis"), rows.get("direct")
    for key, how in (
        ("sticky", ""),
        ("sticky_pipe", " (pipelined)"),
        ("sticky_unix", " (Unix)"),
        ("sticky_pipe_unix", " (pipelined, Unix)"),
    ):
        out += _proxy_targets(rows.get(key), direct, how)
    limited = rows.get("direct_limited")
    if limited and direct:
        # The node target at equal load: both nodes straight from wrk, no router.
        out.append(
            _node_vs_floor(
                "node CPU per limited request vs the floor's, both straight from wrk (equal load)",
                limited,
                direct,
            )
        )
    if sticky and redis:
        out.append(Target("sticky vs Redis baseline, req/s", sticky["vs_redis"], 1.25))
        out.append(
            Target(
                "sticky vs Redis, total CPU per request (ratio)",
                _div(sticky["cpu_total_us"], redis["cpu_total_us"]),
                1.0,
                at_most=True,
                detail=f"{_fmt(sticky['cpu_total_us'])} vs {_fmt(redis['cpu_total_us'])} us",
            )
        )
        out.append(
            Target(
                "sticky vs Redis, p99 latency (ratio)",
                _div(sticky["p99_ms"], redis["p99_ms"]),
                1.0,
                at_most=True,
                detail=f"{_fmt(sticky['p99_ms'], 1)} vs {_fmt(redis['p99_ms'], 1)} ms",
            )
        )
    if sticky and rows.get("slowapi"):
        out.append(
            Target(
                "sticky vs slowapi/limits + Redis, req/s",
                round_ratios(sticky["rps_runs"], rows["slowapi"]["rps_runs"]),
                1.5,
            )
        )
    if rows.get("api_batch"):
        # "Stable across rounds": the slowest round must reach the goal, not the median.
        rounds = [rps * BATCH for rps in rows["api_batch"]["rps_runs"]]
        out.append(
            Target(
                "decision API, batches of 100: decisions/s in the slowest round",
                min(rounds) if rounds else None,
                200_000,
                unit="/s",
                detail=f"rounds: {', '.join(_fmt(r) for r in rounds)}",
            )
        )
    if rows.get("api_single") and rows.get("api_single_nc"):
        out.append(
            Target(
                "single checks: coalesced vs not, decisions/s",
                round_ratios(rows["api_single"]["rps_runs"], rows["api_single_nc"]["rps_runs"]),
                1.1,
            )
        )
    return out


def _proxy_targets(
    sticky: dict[str, Any] | None, direct: dict[str, Any] | None, how: str
) -> list[Target]:
    """Goals of the second performance step (issue 15) for one sticky row: sticky
    >= 0.5x the floor, node <= 1.3x the floor's CPU per request, router <= 0.8x
    the node's."""
    out: list[Target] = []
    if sticky and direct:
        out.append(
            Target(f"router+sticky{how} req/s vs direct-to-node floor", sticky["vs_direct"], 0.5)
        )
        out.append(
            _node_vs_floor(
                f"node CPU per limited, proxied request{how} vs the direct floor's", sticky, direct
            )
        )
    if sticky:
        cpu = sticky["cpu_us"]
        out.append(
            Target(
                f"router CPU / node CPU per forwarded request{how}",
                _div(cpu.get("router"), cpu.get("nodes")),
                0.8,
                at_most=True,
                detail=f"{_fmt(cpu.get('router'))} vs {_fmt(cpu.get('nodes'))} us",
            )
        )
    return out


def _node_vs_floor(name: str, row: dict[str, Any], direct: dict[str, Any]) -> Target:
    """Issue 15's node goal: ``row``'s node CPU per request <= 1.3x the floor's."""
    ours, floor = row["cpu_us"].get("nodes"), direct["cpu_us"].get("nodes")
    return Target(
        name, _div(ours, floor), 1.3, at_most=True, detail=f"{_fmt(ours)} vs {_fmt(floor)} us"
    )


def _engine_targets(engine: dict[str, Any]) -> list[Target]:
    out: list[Target] = []
    for comparison in engine.get("ratios", []):
        if comparison["target"] > 1.0:
            out.append(
                Target(
                    f"engine: {comparison['ours']} vs {comparison['theirs']}",
                    comparison["ratio"],
                    comparison["target"],
                )
            )
    return out


def _memory_and_handoff_targets(report: dict[str, Any]) -> list[Target]:
    out: list[Target] = []
    memory = report.get("memory")
    if memory:
        # A real node's RSS when the handoff run measured it; else the store's estimate.
        rss = memory.get("node_rss_bytes_per_key")
        out.append(
            Target(
                f"node RSS per token-bucket key at {memory['keys']:,} keys"
                if rss is not None
                else f"memory per token-bucket key at {memory['keys']:,} keys (store estimate)",
                rss if rss is not None else memory["bytes_per_key"],
                150.0,
                at_most=True,
                unit=" B",
                detail=memory.get("detail", ""),
            )
        )
    handoff = report.get("handoff")
    if handoff:
        out.append(
            Target(
                f"handoff of {handoff['keys']:,} keys, node A -> B",
                handoff["seconds"] if handoff.get("complete") else None,
                5.0,
                at_most=True,
                unit=" s",
                detail=handoff.get("detail", ""),
            )
        )
    return out


def _exactness_targets(exactness: dict[str, dict[str, Any]]) -> list[Target]:
    out: list[Target] = []
    for check in exactness.values():
        if check["max_expected"] == check["expected"]:
            out.append(
                Target(
                    f"exactness, {check['key']}: allowed == users x limit",
                    float(check["allowed"]) if check["ok"] else None,
                    float(check["expected"]),
                    unit="",
                    detail=check["note"]
                    if check["ok"]
                    else f"{check['allowed']:,} allowed: " + check["note"],
                )
            )
    return out


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table_lines(report: dict[str, Any]) -> list[str]:
    """The table as markdown rows (also printed as is)."""
    head = (
        "| configuration | req/s | decisions/s | p50 ms | p99 ms | router us/req | nodes us/req "
        "| redis us/req | allowed / denied | tight rule: allowed (expected) | vs 1 | vs 3 |"
    )
    lines = [head, "|" + "---|" * 12]
    exact = report.get("exactness", {})
    for key, row in report["rows"].items():
        cpu = row["cpu_us"]
        check = exact.get(key)
        if check is None:
            tight = "-"
        elif check["max_expected"] == check["expected"]:
            tight = (
                f"{check['allowed']:,} ({check['expected']:,}) {'ok' if check['ok'] else 'WRONG'}"
            )
        else:
            tight = f"{check['allowed']:,} ({check['expected']:,}; {check['note']})"
        limited = row.get("limited", True)
        label = row["label"]
        if cpu.get("owner") is not None:
            label += f" (hot user's owner: {_fmt(cpu.get('owner'))} us/req)"
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    _fmt(row["rps"]),
                    _fmt(row["decisions_per_s"]) if limited else "- (off)",
                    _fmt(row["p50_ms"], 2),
                    _fmt(row["p99_ms"], 2),
                    _fmt(cpu.get("router")),
                    _fmt(cpu.get("nodes")),
                    _fmt(cpu.get("redis")),
                    f"{row['allowed']:,} / {row['denied']:,}" if limited else "- (off)",
                    tight,
                    _ratio(row.get("vs_direct")),
                    _ratio(row.get("vs_redis")),
                ]
            )
            + " |"
        )
    return lines


def target_lines(items: Sequence[Target]) -> list[str]:
    lines = ["| target | measured | goal | result |", "|---|---|---|---|"]
    for t in items:
        if t.unit == "x":
            measured, goal = _ratio(t.measured), f"{'<=' if t.at_most else '>='} {t.goal:g}x"
        elif t.unit == "":
            measured, goal = _fmt(t.measured), f"== {t.goal:,.0f}"
        else:
            digits = 1 if t.unit == " s" or t.unit == " B" else 0
            measured = _fmt(t.measured, digits) + t.unit if t.measured is not None else "-"
            goal = f"{'<=' if t.at_most else '>='} {t.goal:,g}{t.unit}"
        if t.detail:
            measured += f" ({t.detail})"
        result = "pass" if t.ok else "SHORT"
        lines.append(f"| {t.name} | {measured} | {goal} | {result} |")
    return lines


def engine_lines(engine: dict[str, Any]) -> list[str]:
    lines = ["| engine | decisions/s |", "|---|---|"]
    for name, value in engine.get("medians", {}).items():
        lines.append(f"| {name} | {_fmt(value)} |")
    return lines


def placed(meta: dict[str, Any]) -> str:
    """How the run placed its processes (``--pin``), as part of a sentence; "" unpinned."""
    placement = meta.get("placement")
    if not placement:
        return ""
    front, back = (",".join(map(str, placement[tier])) for tier in ("front", "back"))
    return (
        f", pinned: load generator and routers on CPU {front}, "
        f"nodes, Redis and applications on CPU {back}"
    )


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    parts = [
        "# Benchmark results",
        "",
        f"Generated by `{meta['command']}` on {meta['date']}: Python {meta['python']}, "
        f"{meta['cpus']} CPUs, load by {meta['tool']} ({meta['connections']} connections, "
        f"{meta['users']:,} users), {meta['nodes']} nodes per cluster, {meta['repeats']} "
        f"interleaved rounds of {meta['duration']:g} s per row (medians){placed(meta)}. "
        "Ratios are medians "
        "of per-round ratios against row 1 (direct) and row 3 (Redis, pipelined: the best "
        "version of the Redis design).",
        "",
        *table_lines(report),
        "",
        "## Targets",
        "",
        *target_lines(targets(report)),
    ]
    if report.get("envoy"):
        from benchmarks.envoy import lines as envoy_lines

        parts += [
            "",
            "## Envoy's rate limit service (gRPC ShouldRateLimit, one descriptor per call)",
            "",
            *envoy_lines(report["envoy"]),
        ]
    if report.get("engine", {}).get("medians"):
        parts += ["", "## Engine (in-process, one rule)", "", *engine_lines(report["engine"])]
    if report.get("notes"):
        parts += ["", "## Notes", ""] + [f"* {n}" for n in report["notes"]]
    return "\n".join(parts) + "\n"


def default_notes(report: dict[str, Any]) -> list[str]:
    meta = report["meta"]
    notes = [
        f"Rules: `bench` = {meta['load_rate']} per user (token bucket; the load rows), "
        f"`tight` = {meta['tight']} (the exactness runs: fresh users, many requests each).",
        "Row 5 runs `benchmarks/slowapi_app.py` as one uvicorn process with 2 workers "
        "(slowapi's default fixed window, Redis storage); its CPU is in the nodes column.",
        f"Crash policy of the ringlimit clusters: {meta['crash_policy']}"
        + (
            " - a sticky node streams every changed state to a second node every 0.1 s, "
            "which costs node CPU in rows 2 and 6 (the Redis and round-robin nodes have no "
            "shard and replicate nothing)."
            if meta["crash_policy"].startswith("replica")
            else "."
        ),
        "Routers run with `--no-health-checks` (no background probes during the runs); "
        "nodes and routers otherwise use the defaults of `ringlimit node` / `ringlimit router`.",
        f"The machine's load average was {meta['loadavg_before']} before and "
        f"{meta.get('loadavg_after', '?')} after the run (other work shares the machine).",
    ]
    redis, naive = report["rows"].get("redis"), report["rows"].get("redis_naive")
    if redis and naive:
        notes.append(
            "Redis rows: the nodes parse replies with "
            + (f"hiredis {meta['hiredis']}" if meta.get("hiredis") else "redis-py's Python parser")
            + "; row 3 coalesces concurrent checks into pipelined EVALSHA round trips "
            f"(median per-round ratio vs row 3b: "
            f"{_ratio(round_ratios(redis['rps_runs'], naive['rps_runs']))} req/s), "
            "row 3b sends one EVALSHA round trip per check. Their nodes run with "
            "`--redis-timeout 2` (default 0.1 s: a saturated machine's late reply would "
            "send a check to the local fallback, which counts per node)."
        )
    handoff = report.get("handoff")
    if handoff:
        notes.append(
            f"Handoff: {handoff['keys']:,} states created on node A through its decision API "
            f"in {handoff['fill_seconds']:.1f} s; `DELETE /admin/nodes/A` on the router returned "
            f"after {handoff['seconds']:.2f} s ({handoff['detail']})."
        )
    return notes


def print_report(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print(
        f"\nringlimit bench: {meta['repeats']} round(s) x {meta['duration']:g} s per row, "
        f"{meta['tool']}, {meta['connections']} connections, {meta['users']:,} users, "
        f"{meta['nodes']} nodes{placed(meta)}; took {meta['seconds']:.0f} s\n"
    )
    for line in table_lines(report):
        print(line)
    if report.get("envoy"):
        from benchmarks.envoy import lines as envoy_lines

        print()
        for line in envoy_lines(report["envoy"]):
            print(line)
    if report.get("engine", {}).get("medians"):
        print()
        for line in engine_lines(report["engine"]):
            print(line)
    print()
    for line in target_lines(targets(report)):
        print(line)
    print()
    for note in report["notes"]:
        print(f"* {note}")
