"""What the router asks every node for operators: top limited keys, rates, totals.

Each node keeps its own sketch of denied and near-limit keys
(node/topkeys.py) and answers ``GET /internal/top``. The router asks the
members of its view in parallel, each within a short timeout (a slow or
dead node is reported as such, it never holds the answer up), and merges
the lists by summing per key: under sticky routing a key is decided by one
node, so the sum is that node's count; during a handoff the old and the new
owner may both report it, and each counted decisions it really made.

Keys leave the router plain or as a keyed hash (``privacy.show_keys``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from node.config import Privacy
from node.topkeys import KINDS, Entry, merge_disjoint, rank
from ring import Member

#: What a node report looks like after validation: its answer, or None (no answer).
Report = dict[str, Any] | None


async def ask_nodes(
    client: httpx.AsyncClient,
    members: Sequence[Member],
    headers: Mapping[str, str],
    params: Mapping[str, str],
    each_within: float,
) -> dict[str, Report]:
    """Every member's ``/internal/top`` answer (None for one that gave none in time)."""

    async def ask(member: Member) -> Report:
        try:
            response = await client.get(
                member.url.rstrip("/") + "/internal/top",
                params=dict(params),
                headers=dict(headers),
                timeout=each_within,
            )
            data = response.json()
        except (httpx.HTTPError, ValueError):
            return None
        if response.status_code != 200 or not isinstance(data, dict):
            return None
        return data

    answers = await asyncio.gather(*(ask(m) for m in members))
    return {m.id: a for m, a in zip(members, answers, strict=True)}


def _entries(raw: Any) -> list[Entry]:
    """A node's ``[[key, hits, error], ...]``; anything malformed is skipped."""
    if not isinstance(raw, list):
        return []
    out = []
    for item in raw:
        if (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[0], str)
            and all(type(v) is int and v >= 0 for v in item[1:])
        ):
            out.append(Entry(item[0], item[1], item[2]))
    return out


class KeyHider:
    """Shows a key as it may leave the cluster: itself, or ``h:`` + 16 hex digits
    of HMAC-SHA256 keyed by the configured salt (or this router's random one)."""

    def __init__(self, privacy: Privacy, fallback_salt: bytes) -> None:
        self.hashed = privacy.show_keys == "hashed"
        self.salt = privacy.salt.encode() if privacy.salt else fallback_salt

    def __call__(self, key: str) -> str:
        if not self.hashed:
            return key
        return "h:" + hmac.new(self.salt, key.encode(), hashlib.sha256).hexdigest()[:16]


def random_salt() -> bytes:
    return secrets.token_bytes(32)


def merge_top(
    reports: Mapping[str, Report],
    rules: Iterable[str] | None,
    n: int,
    hide: KeyHider,
    leased: Report = None,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Per rule and kind, the ``n`` keys with the most events across the nodes
    and this router's quota leases (``leased``: ``RouterLeases.top_report``).

    A lease's decisions are the owner's, made here on its behalf: the owner
    never counted them, so they add to its count as another node's would
    (``leased`` in an entry says how many of ``count`` they are).
    ``rules`` None: every rule some node, or this router's leases, reported.
    """
    by_rule: dict[str, dict[str, list[tuple[str | None, list[Entry]]]]] = {}
    sources: list[tuple[str | None, Report]] = [*reports.items(), (None, leased)]
    for node_id, report in sources:
        top = report.get("top") if report is not None else None
        if not isinstance(top, dict):
            continue
        for rule, kinds in top.items():
            if not isinstance(kinds, dict) or (rules is not None and rule not in rules):
                continue
            for kind in KINDS:
                entries = _entries(kinds.get(kind))
                if entries:
                    by_rule.setdefault(rule, {}).setdefault(kind, []).append((node_id, entries))
    names = sorted(by_rule) if rules is None else list(rules)
    merged: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for rule in names:
        merged[rule] = {}
        for kind in KINDS:
            lists = by_rule.get(rule, {}).get(kind, [])
            holders: dict[str, list[str]] = {}
            here: dict[str, int] = {}
            for node_id, entries in lists:
                for entry in entries:
                    if node_id is None:
                        here[entry.key] = entry.hits
                    else:
                        holders.setdefault(entry.key, []).append(node_id)
            merged[rule][kind] = [
                {
                    "key": hide(e.key),
                    "count": e.hits,
                    "error": e.error,
                    "nodes": sorted(holders.get(e.key, ())),
                    "leased": here.get(e.key, 0),
                }
                for e in rank(merge_disjoint(entries for _, entries in lists), n)
            ]
    return merged


def node_status(reports: Mapping[str, Report]) -> dict[str, str]:
    return {node_id: "ok" if r is not None else "no_answer" for node_id, r in reports.items()}


def number(report: Report, *path: str) -> float | None:
    """A finite number at ``path`` in a node's report, else None."""
    value: Any = report
    for name in path:
        if not isinstance(value, dict):
            return None
        value = value.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None
