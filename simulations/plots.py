"""PNG plots from a report (matplotlib, imported only here, with the Agg backend).

Everything is drawn from the JSON report alone, so plots can be redrawn from
a saved file: ``write_plots(json.load(open(path)), out_dir)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_COLORS = {
    "global": "#222222",
    "handoff": "#1f77b4",
    "reset": "#d62728",
    "conservative": "#2ca02c",
    "replica": "#9467bd",
    "round_robin": "#ff7f0e",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def _rate_panels(
    plt: Any,
    title: str,
    t0: float,
    bucket: float,
    requests: list[int],
    allowed: dict[str, list[int]],
    marks: list[tuple[float, str]],
) -> Any:
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    xs = [t0 + (i + 0.5) * bucket for i in range(len(requests))]
    top.plot(xs, [r / bucket for r in requests], color="#bbbbbb", lw=1, label="arrivals")
    ref = allowed["global"]
    for mode, series in allowed.items():
        style = {"lw": 2.5, "alpha": 0.5} if mode == "global" else {"lw": 1.2}
        label = "reference (global)" if mode == "global" else mode
        top.plot(xs, [v / bucket for v in series], color=_COLORS.get(mode), label=label, **style)
        if mode != "global":
            bottom.plot(
                xs,
                [(v - r) / bucket for v, r in zip(series, ref, strict=True)],
                color=_COLORS.get(mode),
                lw=1.2,
                label=mode,
            )
    bottom.axhline(0, color="#222222", lw=0.8)
    for at, label in marks:
        for ax in (top, bottom):
            ax.axvline(at, color="#888888", ls="--", lw=0.8)
        top.annotate(
            label,
            (at, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="#555555",
        )
    top.set_ylabel("admitted requests/s")
    top.set_title(title)
    top.legend(fontsize=8, ncol=3, loc="lower left")
    bottom.set_ylabel("mode - reference (req/s)")
    bottom.set_xlabel("time (s)")
    bottom.legend(fontsize=8, ncol=3, loc="upper right")
    fig.tight_layout()
    return fig


def write_plots(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write every plot for ``report`` into ``out_dir``; return the files written."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = report["scenario"]["name"]
    written: list[Path] = []
    marks = [(ev["at_s"], f"{ev['type']} {ev['node']}") for ev in report["events"]]

    def save(fig: Any, filename: str) -> None:
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    tl = report["timeline"]
    fig = _rate_panels(
        plt,
        f"{name}: admitted rate vs the exact global limiter",
        0.0,
        tl["bucket_s"],
        tl["requests"],
        tl["allowed"],
        marks,
    )
    save(fig, "timeline.png")

    for window, ev in zip(report["event_windows"], report["events"], strict=True):
        label = f"{ev['type']} {ev['node']}"
        fig = _rate_panels(
            plt,
            f"{name}: event {ev['index']} ({label} at {ev['at_s']:g}s), "
            f"{ev['keys_moved']:,} keys moved ({ev['moved_fraction']:.1%}, "
            f"ideal {ev['ideal_fraction']:.1%})",
            window["start_s"],
            window["bucket_s"],
            window["requests"],
            window["allowed"],
            [(ev["at_s"], label)],
        )
        save(fig, f"event_{ev['index']:02d}_{_slug(label)}.png")

    save(_load_figure(plt, report), "load.png")
    save(_over_figure(plt, report), "over_admission.png")
    return written


def _load_figure(plt: Any, report: dict[str, Any]) -> Any:
    modes = [m for m in report["modes"] if m != "global"]
    nodes: list[str] = []
    for m in modes:
        for row in report["modes"][m]["load"]["per_node"]:
            if row["node"] not in nodes:
                nodes.append(row["node"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.5 * len(nodes) + 4), 7), sharex=True)
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        rows = {r["node"]: r for r in report["modes"][mode]["load"]["per_node"]}
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(nodes))]
        rates = [
            rows[n]["requests"] / rows[n]["member_s"] if n in rows and rows[n]["member_s"] else 0
            for n in nodes
        ]
        keys = [rows[n]["keys_end"] or 0 if n in rows else 0 for n in nodes]
        top.bar(xs, rates, width, color=_COLORS.get(mode), label=mode)
        bottom.bar(xs, keys, width, color=_COLORS.get(mode), label=mode)
    top.set_ylabel("requests/s while a member")
    top.set_title(f"{report['scenario']['name']}: per-node load")
    top.legend(fontsize=8, ncol=3)
    bottom.set_ylabel("live states held at the end")
    bottom.set_xticks(range(len(nodes)))
    bottom.set_xticklabels(nodes, rotation=90 if len(nodes) > 12 else 0, fontsize=8)
    fig.tight_layout()
    return fig


def _over_figure(plt: Any, report: dict[str, Any]) -> Any:
    modes = list(report["modes"])
    events = report["events"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 3]})
    over = [report["modes"][m]["over_admission"]["total"] for m in modes]
    false = [report["modes"][m]["false_denials"]["total"] for m in modes]
    xs = range(len(modes))
    left.bar([x - 0.2 for x in xs], over, 0.4, color="#d62728", label="over-admitted")
    left.bar([x + 0.2 for x in xs], false, 0.4, color="#1f77b4", label="falsely denied")
    left.set_xticks(list(xs))
    left.set_xticklabels(modes, rotation=30, ha="right")
    left.set_ylabel("requests (per-user totals)")
    left.set_title("over-admission and false denials per mode")
    left.legend(fontsize=8)
    if any(over) or any(false):
        left.set_yscale("symlog", linthresh=1)
    sticky = [m for m in modes if m != "global"]
    width = 0.8 / max(1, len(sticky))
    for j, mode in enumerate(sticky):
        values = [e["over_admission"] for e in report["modes"][mode]["events"]]
        xs2 = [i + (j - (len(sticky) - 1) / 2) * width for i in range(len(events))]
        right.bar(xs2, values, width, color=_COLORS.get(mode), label=mode)
    right.set_xticks(range(len(events)))
    right.set_xticklabels(
        [f"{e['index']}: {e['type']} {e['node']}\n@{e['at_s']:g}s" for e in events], fontsize=8
    )
    right.set_ylabel("over-admitted requests charged to the event")
    right.set_title("over-admission per event")
    if events:
        right.set_yscale("symlog", linthresh=1)
        right.legend(fontsize=8, ncol=2)
    fig.suptitle(report["scenario"]["name"])
    fig.tight_layout()
    return fig
