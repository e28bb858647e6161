"""The terminal table and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Top-level report keys that vary from run to run (timings); left out of comparisons.
VOLATILE_KEYS = ("run",)

_SHORT = {
    "global": "global",
    "handoff": "handoff",
    "reset": "reset",
    "conservative": "conservative",
    "replica": "replica",
    "round_robin": "round_robin",
    "leases": "leases",
}
_POLICY = {
    "none": "-",
    "handoff": "handoff",
    "reset": "reset",
    "conservative": "consv",
    "replica": "replica",
    "local": "local",
}


def stable(report: dict[str, Any]) -> dict[str, Any]:
    """The report without its run-dependent parts (what golden files compare)."""
    return {k: v for k, v in report.items() if k not in VOLATILE_KEYS}


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1, sort_keys=False, ensure_ascii=False) + "\n"


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(report), encoding="utf-8")
    return path


def _n(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def _r(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _t(seconds: float | None, agreed: bool) -> str:
    if not agreed or seconds is None:
        return "never"
    return f"{seconds:g}s"


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def fmt(cells: list[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def format_report(report: dict[str, Any]) -> str:
    sc = report["scenario"]
    totals = report["totals"]
    users = sc["users"]
    arrivals = sc["arrivals"]
    pop = users["popularity"] + (f" {users['exponent']:g}" if users["popularity"] == "zipf" else "")
    if users["hot_users"]:
        pop += f", {users['hot_users']} hot user(s) with {users['hot_share']:.0%} of requests"
    rules = ", ".join(f"{r['name']} {r['algorithm']}" for r in sc["rules"])
    lines = [
        f"scenario {sc['name']} ({sc['source']}), seed {sc['seed']}: {len(sc['nodes'])} nodes, "
        f"{users['count']:,} users ({pop}), {sc['duration_s']:g}s at {arrivals['rate']:,.0f} req/s "
        f"({arrivals['process']})",
        f"rules: {rules}; replication every {sc['replication_interval_s'] * 1000:g} ms",
        f"requests {totals['requests']:,} from {totals['users_active']:,} active users; reference "
        f"allowed {totals['reference_allowed']:,} "
        f"({totals['reference_allowed'] / max(1, totals['requests']):.1%}); "
        f"{totals['users_throttled']:,} users throttled by the reference",
        "",
    ]
    headers = [
        "mode",
        "join/leave/crash",
        "allowed",
        "over-admit",
        "(per-win)",
        "worst user",
        "false-deny",
        "(per-win)",
        "worst user",
        "req max/mean",
        "keys max/mean",
        "keys held",
        "slowest agree",
    ]
    outages = any(m.get("unavailable", {}).get("requests") for m in report["modes"].values())
    if outages:
        headers.append("on_error")
    rows = []
    for mode, m in report["modes"].items():
        pol = m["policy"]
        over, false = m["over_admission"], m["false_denials"]
        agrees = [(e["time_to_agree_s"], e["agreed"]) for e in m["events"]]
        if agrees and any(not a for _, a in agrees):
            slowest = "never"
        elif agrees:
            slowest = f"{max(t for t, _ in agrees):g}s"
        else:
            slowest = "-"
        rows.append(
            [
                _SHORT.get(mode, mode),
                "/".join(_POLICY.get(pol[k], pol[k]) for k in ("join", "leave", "crash")),
                _n(m["allowed"]),
                f"{_n(over['total'])} ({over['relative']:.2%})",
                _n(over["per_window"]),
                _n(over["worst_user"]["count"]) if over["worst_user"] else "0",
                f"{_n(false['total'])} ({false['relative']:.2%})",
                _n(false["per_window"]),
                _n(false["worst_user"]["count"]) if false["worst_user"] else "0",
                _r(m["load"]["requests_max_over_mean"]),
                _r(m["load"]["keys_max_over_mean"]),
                _n(m["load"]["keys_total_end"]),
                slowest,
            ]
        )
        if outages:
            down = m["unavailable"]
            rows[-1].append(f"+{down['admitted']:,}/-{down['denied']:,}")
    lines += _table(headers, rows, right=set(range(2, 14)))
    detection = report.get("detection")
    if detection:
        deferred = ", ".join(f"{k} {v}" for k, v in detection["deferred"].items() if v)
        lines.append("")
        lines.append(
            f"detection ({'removal budget' if detection['budget'] else 'no budget'}): "
            f"{detection['removals']} removal(s), {detection['rejoins']} return(s) "
            f"(returning members: {report['scenario']['returning']}); "
            f"deferred: {deferred or 'none'}; "
            f"{detection['suspect_self_rounds']} round(s) suspecting itself"
        )
        if outages:
            lines.append(
                "on_error: requests whose owner could not decide (paused, lease lapsed, "
                "empty ring), +admitted/-denied"
            )
    network = report["scenario"].get("network")
    if network is not None:
        cuts = ", ".join(
            " | ".join("{" + ",".join(g) + "}" for g in p["groups"])
            + f" cut off {p['at_s']:g}s-{p['until_s']:g}s"
            for p in network["partitions"]
        )
        lines.append("")
        lines.append(
            f"network: delay {network['delay_s'] * 1000:g} ms + jitter up to "
            f"{network['jitter_s'] * 1000:g} ms, loss {network['loss']:g}"
            + (f"; {cuts}" if cuts else "")
        )
        for mode, m in report["modes"].items():
            stats = m.get("network")
            if stats is not None:
                lines.append(
                    f"  {mode}: {stats['messages_sent']:,} message(s) sent, "
                    f"{stats['messages_lost']:,} lost; {stats['pulls']:,} pull(s), "
                    f"{stats['pull_failures']:,} failed"
                )
    if report["events"]:
        lines.append("")
        modes = [m for m in report["modes"] if m != "global"]
        headers = ["#", "t", "event", "moved", "frac", "ideal", *modes]
        rows = []
        for ev in report["events"]:
            label = f"{ev['type']} {ev['node']}" + (" (restart)" if ev["restart"] else "")
            cause = ev.get("cause", "event")
            if cause != "event":
                label += " (probes)" if cause == "probe" else " (returns)"
            cells = [
                str(ev["index"]),
                f"{ev['at_s']:g}s",
                label,
                _n(ev["keys_moved"]),
                f"{ev['moved_fraction']:.3f}",
                f"{ev['ideal_fraction']:.3f}",
            ]
            for mode in modes:
                me = report["modes"][mode]["events"][ev["index"]]
                cells.append(
                    f"+{me['over_admission']:,}/-{me['false_denials']:,} "
                    f"{_t(me['time_to_agree_s'], me['agreed'])}"
                )
            rows.append(cells)
        lines.append(
            "per event: +over-admitted/-falsely denied requests charged to the event, and the time"
        )
        lines.append(
            "until the admitted rate of the keys it moved agrees with the reference again "
            "('never': not within the run)"
        )
        lines += _table(headers, rows, right={0, 1, 3, 4, 5})
    run = report.get("run")
    if run:
        lines.append("")
        lines.append(
            f"simulated {run['decisions']:,} decisions ({run['verdicts']:,} verdicts) in "
            f"{run['modes_s']:.1f}s with {run['workers']} worker(s): "
            f"{run['decisions_per_s'] or 0:,} decisions/s "
            f"(arrivals {run['arrivals_s']:.1f}s, ring {run['ring_s']:.1f}s, "
            f"scoring {run.get('metrics_s', 0):.1f}s, total {run.get('total_s', 0):.1f}s)"
        )
    return "\n".join(lines)
