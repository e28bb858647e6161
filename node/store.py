"""The in-memory store: one node's states, keyed by (rule, key).

States live in one plain dict per rule (key -> state): a dict lookup is the
cheapest index Python has, and keeping the rule out of the dict key saves a
tuple per entry (about 60 bytes at a million keys).

Eviction. Every state knows the time from which it is indistinguishable from a
fresh one (``fresh_at``). Such states are dropped by :meth:`MemoryStore.sweep`,
which the node runs periodically in small slices so the event loop never
stalls, and by an immediate sweep when the key cap is reached.

The cap. ``max_keys`` bounds the number of states. When it is reached, a new
key first makes the store sweep every state (a full sweep), which also notes
the earliest time any state left will be fresh (``_floor``, lowered by every
state written since): until then another full sweep could free nothing, and
is not made. (Without it, a full store of active keys scanned every state for
every new key: a stream of one-off keys cost O(max_keys) each.) When a
sweep frees nothing, *existing* keys keep being decided normally (an active
key never loses its state, so nobody gets a fresh quota from memory
pressure), and a *new* key is not stored: it is decided on a fresh state
without being remembered only if its rule says ``on_error="open"``, and
denied otherwise. Either way the decision carries ``reason="store_full"``,
the node counts it in a metric and logs it: never silent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

from node.algorithms import REGISTRY, Algorithm, State
from node.decision import STORE_FULL, Decision, Verdict, most_restrictive
from node.limiter import decide_all
from node.rules import MAX_NAME, Rule

#: Builds a Verdict without the NamedTuple's Python-level __new__ (hot path).
_verdict = partial(tuple.__new__, Verdict)

#: One exported state: [rule name, algorithm, key, state relative to the exporter's now].
#: Received over msgpack it is a tuple of the same four (node/peers.py
#: ``decode_records``); nothing mutates a record, so either serves.
Record = list[Any]


def check_records(records: Any, *, max_key_length: int = 1024) -> list[Record]:
    """``records`` if every one is a valid exported state, else ``ValueError``
    naming the first bad record and what is wrong with it.

    A transfer is all or nothing: the caller refuses it whole (4xx) rather than
    store a state no decision could be made on (a NaN time, a key that is not a
    string, a state of the wrong shape), which would fail that user's every
    request, or the node's next handoff. Pure: it reads nothing but its input.
    """
    if type(records) is not list:
        raise ValueError(f"records must be a list, got {type(records).__name__}")
    checks = _CHECKS
    for index, record in enumerate(records):
        try:
            if type(record) is not list or len(record) != 4:
                raise ValueError("must be a list [rule, algorithm, key, state]")
            name, algorithm, key, relative = record
            if type(name) is not str or not 0 < len(name) <= MAX_NAME:
                raise ValueError(f"rule name must be a string of 1..{MAX_NAME} characters")
            if type(key) is not str or not 0 < len(key) <= max_key_length:
                raise ValueError(f"key must be a string of 1..{max_key_length} characters")
            if not key.isascii():
                key.encode()  # a lone surrogate cannot be sent on (UnicodeEncodeError)
            check = checks.get(algorithm) if type(algorithm) is str else None
            if check is None:
                raise ValueError(f"unknown algorithm {algorithm!r}"[:120])
            check(relative)
        except ValueError as exc:
            raise ValueError(f"record {index}: {exc}") from None
    return records


_CHECKS = {name: algorithm.check for name, algorithm in REGISTRY.items()}


def check_record_states(records: Sequence[Sequence[Any]]) -> None:
    """What :func:`check_records` checks beyond a record's shape and its strings'
    types and lengths: a known algorithm, a valid state for it, a key that can
    be sent on. For records whose shape a typed decoder checked already
    (node/peers.py :func:`~node.peers.decode_records`); ``ValueError`` as
    :func:`check_records` says it."""
    checks = _CHECKS
    for index, record in enumerate(records):
        key = record[2]
        check = checks.get(record[1])
        try:
            if not key.isascii():
                key.encode()  # a lone surrogate cannot be sent on (UnicodeEncodeError)
            if check is None:
                raise ValueError(f"unknown algorithm {record[1]!r}"[:120])
            check(record[3])
        except ValueError as exc:
            raise ValueError(f"record {index}: {exc}") from None


class Table:
    """The states of one rule."""

    __slots__ = ("algorithm", "decide", "fresh_at", "rule", "states")

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.algorithm: Algorithm = REGISTRY[rule.algorithm]
        self.decide = self.algorithm.decide
        self.fresh_at = self.algorithm.fresh_at
        self.states: dict[str, State] = {}


class MemoryStore:
    """States of every rule held by one node, with eviction and a key cap."""

    def __init__(self, *, max_keys: int | None = None) -> None:
        if max_keys is not None and max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.max_keys = max_keys
        self._tables: dict[str, Table] = {}
        self._sweep_cursor: Iterator[tuple[Table, str]] | None = None
        #: With a cap: no state is fresh before this time (a lower bound, from the
        #: last full sweep and every state written since; -inf: unknown).
        self._floor = -math.inf
        self.store_full_events = 0
        self.on_store_full: Callable[[Rule, str], None] | None = None
        #: Records the last :meth:`import_` refused for want of its ``room``.
        self.refused = 0
        #: Keys whose state changed since the set was last taken (replication reads it);
        #: ``None`` switches tracking off and keeps it off the hot path.
        self.dirty: set[str] | None = None

    # ------------------------------------------------------------------ tables

    def table(self, rule: Rule) -> Table:
        """The table for ``rule``, rebuilt if the rule changed.

        A rule whose algorithm changed cannot reuse its states (their shapes
        differ), so they are dropped; a changed limit or period keeps them:
        every algorithm reads its parameters from the rule at decision time.
        """
        table = self._tables.get(rule.name)
        if table is None or table.rule is not rule:
            # A new rule may read its states as fresh sooner (a lower limit).
            self._floor = -math.inf
            if table is None or table.rule.algorithm != rule.algorithm:
                table = Table(rule)
            else:
                kept = table.states
                table = Table(rule)
                table.states = kept
            self._tables[rule.name] = table
        return table

    def __len__(self) -> int:
        return sum(len(t.states) for t in self._tables.values())

    def get(self, rule: Rule, key: str) -> State:
        return self.table(rule).states.get(key)

    def put(self, rule: Rule, key: str, state: State) -> None:
        """Set ``key``'s state, as a decision would: the change is tracked for
        replication like one (a quota lease's grant took units from a hot key's
        state that its replica never saw: a crash of the owner promoted the
        replica and the leased units were admitted twice)."""
        table = self.table(rule)
        if state is None:
            table.states.pop(key, None)
        else:
            table.states[key] = state
            if self.max_keys is not None:
                self._lower(table, state)
        if self.dirty is not None:
            self.dirty.add(key)

    def keys(self) -> set[str]:
        found: set[str] = set()
        for table in self._tables.values():
            found.update(table.states)
        return found

    # ------------------------------------------------------------------ deciding

    def check(self, key: str, rules: Sequence[Rule], now: float, cost: int = 1) -> Verdict:
        """Decide one request against ``rules`` (all must pass; none consumes on denial)."""
        if len(rules) == 1:
            rule = rules[0]
            table = self._tables.get(rule.name)
            if table is None or table.rule is not rule:
                table = self.table(rule)
            states = table.states
            state = states.get(key)
            if state is None and self.max_keys is not None and not self._has_room(now):
                return self._store_full(rule, key, now, cost)
            new, decision = table.decide(state, now, rule, cost)
            if new is not state:
                states[key] = new
                if self.dirty is not None:
                    self.dirty.add(key)
                if self.max_keys is not None:
                    self._lower(table, new)
            return _verdict((decision[0], decision, (decision,)))
        tables = [self.table(rule) for rule in rules]
        old = [t.states.get(key) for t in tables]
        if self.max_keys is not None and any(s is None for s in old) and not self._has_room(now):
            return self._store_full_many(rules, key, now, cost, old)
        new_states, verdict = decide_all(old, now, rules, cost)
        if verdict.allowed and cost:
            for table, before, after in zip(tables, old, new_states, strict=True):
                if after is not before:
                    table.states[key] = after
                    if self.max_keys is not None:
                        self._lower(table, after)
            if self.dirty is not None:
                self.dirty.add(key)
        return verdict

    def check_many(
        self, checks: Iterable[tuple[str, Sequence[Rule], int]], now: float
    ) -> list[Verdict]:
        """:meth:`check` for each ``(key, rules, cost)``, in order, at ``now``.

        The same decisions; a run of checks on the same one rule (a batch of the
        decision API) looks its table up once, not once per check.
        """
        out: list[Verdict] = []
        append = out.append
        dirty = self.dirty
        capped = self.max_keys is not None
        last: object = None
        table: Table | None = None
        for key, rules, cost in checks:
            if rules is not last:
                last = rules
                table = self.table(rules[0]) if len(rules) == 1 else None
                if table is not None:
                    # The run's table, as locals: no attribute read per check.
                    states, decide, rule = table.states, table.decide, table.rule
            if table is None:
                append(self.check(key, rules, now, cost))
                continue
            state = states.get(key)
            if state is None and capped and not self._has_room(now):
                append(self._store_full(rule, key, now, cost))
                continue
            new, decision = decide(state, now, rule, cost)
            if new is not state:
                states[key] = new
                if dirty is not None:
                    dirty.add(key)
                if capped:
                    self._lower(table, new)
            append(_verdict((decision[0], decision, (decision,))))
        return out

    def has_room_for(self, rule: Rule, key: str, now: float) -> bool:
        """Whether ``key`` may hold a state under ``rule``: it has one already, or
        the store is below its cap (after a sweep, as for a decision). For writers
        other than a decision (a quota lease's grant), which the cap binds too."""
        if self.max_keys is None or self.get(rule, key) is not None:
            return True
        return self._has_room(now)

    def _has_room(self, now: float) -> bool:
        assert self.max_keys is not None
        if len(self) < self.max_keys:
            return True
        if now < self._floor:
            return False  # no state is fresh yet: a full sweep would free nothing
        self.sweep(now, budget=None)
        return len(self) < self.max_keys

    def _lower(self, table: Table, state: State) -> None:
        """``state`` was written into ``table``: the floor is at most its fresh time."""
        fresh = table.fresh_at(state, table.rule)
        if fresh < self._floor:
            self._floor = fresh

    def _store_full(self, rule: Rule, key: str, now: float, cost: int) -> Verdict:
        self.store_full_events += 1
        if self.on_store_full is not None:
            self.on_store_full(rule, key)
        _, decision = REGISTRY[rule.algorithm].decide(None, now, rule, cost)
        if rule.on_error == "open" or not decision.allowed:
            decision = decision._replace(reason=decision.reason or STORE_FULL)
        else:
            decision = _refused(rule)
        return Verdict(decision.allowed, decision, (decision,))

    def _store_full_many(
        self, rules: Sequence[Rule], key: str, now: float, cost: int, old: list[State]
    ) -> Verdict:
        """Some rules have no state for ``key`` and there is no room to add one.

        The rules that already have a state are decided (and keep counting) as usual;
        the missing ones follow their ``on_error``: decided on a fresh state and not
        stored ("open"), or refusing the request ("closed").
        """
        tables = [self.table(rule) for rule in rules]
        new_states, verdict = decide_all(old, now, rules, cost)
        decisions = list(verdict.decisions)
        allowed = verdict.allowed
        for i, (rule, state) in enumerate(zip(rules, old, strict=True)):
            if state is not None:
                continue
            self.store_full_events += 1
            if self.on_store_full is not None:
                self.on_store_full(rule, key)
            if rule.on_error == "closed" and decisions[i].allowed:
                allowed = False
                decisions[i] = _refused(rule)
        if allowed and cost:
            for table, before, after in zip(tables, old, new_states, strict=True):
                if before is not None and after is not before:
                    table.states[key] = after
                    self._lower(table, after)
        elif not allowed and verdict.allowed and cost:
            # A closed rule refused: nothing was consumed, so show what is really left.
            for i, (rule, state) in enumerate(zip(rules, old, strict=True)):
                if decisions[i].allowed:
                    decisions[i] = REGISTRY[rule.algorithm].decide(state, now, rule, 0)[1]
        for i, state in enumerate(old):
            if state is None:
                decisions[i] = decisions[i]._replace(reason=decisions[i].reason or STORE_FULL)
        return Verdict(allowed, most_restrictive(decisions), tuple(decisions))

    # ------------------------------------------------------------------ eviction

    def sweep(self, now: float, budget: int | None = 10_000) -> int:
        """Drop states that are fresh again at ``now``; look at most ``budget`` entries.

        Successive calls continue where the last one stopped, so a periodic
        small sweep covers every key without ever blocking for long.
        """
        if budget is None:
            evicted = 0
            floor = math.inf
            for table in list(self._tables.values()):
                fresh_at, rule, states = table.fresh_at, table.rule, table.states
                stale = []
                for k, s in states.items():
                    fresh = fresh_at(s, rule)
                    if fresh <= now:
                        stale.append(k)
                    elif fresh < floor:
                        floor = fresh
                for k in stale:
                    del states[k]
                evicted += len(stale)
            self._sweep_cursor = None
            self._floor = floor
            return evicted
        evicted = 0
        looked = 0
        while looked < budget:
            if self._sweep_cursor is None:
                self._sweep_cursor = self._snapshot()
            try:
                table, key = next(self._sweep_cursor)
            except StopIteration:
                self._sweep_cursor = None
                break
            looked += 1
            state = table.states.get(key)
            if state is not None and table.fresh_at(state, table.rule) <= now:
                del table.states[key]
                evicted += 1
        return evicted

    def forget_rules(self, rules: Container[str], *, keep_states: bool = True) -> int:
        """Drop the tables of rules not in ``rules`` once they hold no state (the
        sweep empties them as their states refill); returns how many went.

        Without it a node whose rules are renamed at runtime kept an empty table
        per name it ever decided. A table with states is kept: the rule may come
        back (a rename undone), and its states are still right for it; but not
        in a full store (:meth:`_full`), where they would keep every new user of
        the rules in force out (``store_full``) until they refill, a day for a
        daily rule. Nor with ``keep_states=False``: a store of replicas, whose
        states of a rule no longer in force would never be promoted (a crash
        takes only the rules in force), only held until they refill.
        """
        drop = not keep_states or self._full()
        gone = [
            name
            for name, table in self._tables.items()
            if (drop or not table.states) and name not in rules
        ]
        for name in gone:
            del self._tables[name]
        return len(gone)

    def _full(self) -> bool:
        """Whether the store holds as many states as its cap (never, without one)."""
        return self.max_keys is not None and len(self) >= self.max_keys

    def _snapshot(self) -> Iterator[tuple[Table, str]]:
        for table in list(self._tables.values()):
            for key in list(table.states):
                yield table, key

    # ------------------------------------------------------------------ handoff

    def export(
        self,
        now: float,
        select: Callable[[str], bool] | None = None,
        *,
        remove: bool = False,
    ) -> list[Record]:
        """Every (selected) live state, with times relative to ``now``; with
        ``remove``, the selected states leave the store.

        Fresh states are not exported (and, with ``remove``, dropped all the
        same): a missing state and a fresh one decide alike. ``select=None``
        takes every state and empties the tables at once: a leaving node's
        export, with no selector to call per key.
        """
        records: list[Record] = []
        for table in self._tables.values():
            rule, fresh_at, to_relative = table.rule, table.fresh_at, table.algorithm.to_relative
            name, algorithm, states = rule.name, rule.algorithm, table.states
            chosen = (
                states.items()
                if select is None
                else [(key, state) for key, state in states.items() if select(key)]
            )
            records += [
                [name, algorithm, key, to_relative(state, now)]
                for key, state in chosen
                if fresh_at(state, rule) > now
            ]
            if not remove:
                continue
            if select is None:
                states.clear()
            else:
                for key, _ in chosen:
                    del states[key]
        return records

    def export_keys(self, keys: Iterable[str], now: float) -> list[Record]:
        """:meth:`export` of the named keys: looked up one by one (a few keys of a
        large store cost a few lookups, not a scan of every state)."""
        wanted = keys if isinstance(keys, set | frozenset) else set(keys)
        records: list[Record] = []
        for table in self._tables.values():
            rule, fresh_at, to_relative = table.rule, table.fresh_at, table.algorithm.to_relative
            name, algorithm, states = rule.name, rule.algorithm, table.states
            if len(wanted) < len(states):
                found = [(k, states[k]) for k in wanted if k in states]
            else:
                found = [(k, v) for k, v in states.items() if k in wanted]
            for key, state in found:
                if fresh_at(state, rule) > now:
                    records.append([name, algorithm, key, to_relative(state, now)])
        return records

    def import_(
        self,
        records: Iterable[Record],
        now: float,
        rules: Mapping[str, Rule],
        *,
        replace: bool = False,
        room: int | None = None,
    ) -> int:
        """Rebase exported states onto this node's clock and keep them, each as
        this node's rule can hold it (``Algorithm.clamp``: a bucket sent with more
        tokens than the rule's burst, lowered since, arrives full, not fuller).

        A record for a rule neither in ``rules`` nor kept here from when it was
        in force, or whose algorithm differs, is skipped (its states could not
        be interpreted). When a
        state is already held, the more restrictive of the two is kept (the one
        with fewer units remaining), so a late or repeated transfer can never
        hand out quota twice. ``replace=True`` keeps the incoming state instead
        (replicas: the newest copy is the right one, even if it refilled).

        ``room``: at most this many keys not held already are taken (a node's
        replicas are capped: node/shardcore.py); the rest are skipped, and
        counted in :attr:`refused`. States already held are updated all the same.
        """
        taken = 0
        self.refused = 0
        self._floor = -math.inf  # states that may be fresh sooner than any held
        # A transfer is long runs of one rule: look its table up once per run.
        last_name = last_algorithm = None
        table: Table | None = None
        for name, algorithm, key, relative in records:
            if name != last_name or algorithm != last_algorithm:
                last_name, last_algorithm = name, algorithm
                rule = rules.get(name)
                if rule is None and (held := self._tables.get(name)) is not None:
                    # A rule no longer in force whose states this store keeps for
                    # its return: states handed to it join them. Skipped, a ring
                    # change gave their users a fresh quota on the rule's return
                    # (an exploratory tester: 36 of 60 users).
                    rule = held.rule
                table = None if rule is None or rule.algorithm != algorithm else self.table(rule)
                if table is not None:
                    states, from_relative = table.states, table.algorithm.from_relative
                    clamp = table.algorithm.clamp
            if table is None:
                continue
            current = states.get(key)
            if current is None and room is not None:
                if room <= 0:
                    self.refused += 1
                    continue
                room -= 1
            incoming = from_relative(relative, now)
            if clamp is not None:
                incoming = clamp(incoming, table.rule)
            if current is not None and not replace:
                incoming = more_restrictive(table, current, incoming, now)
            states[key] = incoming
            taken += 1
        return taken


def _refused(rule: Rule) -> Decision:
    """A closed rule's refusal of a key the store has no room for: the store, not
    the count, refused, so nothing is said to be left and no time to retry (a
    fresh quota's figures, ``remaining: 99`` on a denial, told the client it had
    used a quota it never had). The shape of a closed rule's refusal in a Redis
    outage (node/redis_backend.py), which the node answers 503 too."""
    return Decision(False, rule.limit, 0, 0.0, None, rule.name, STORE_FULL)


def more_restrictive(table: Table, a: State, b: State, now: float) -> State:
    decide, rule = table.decide, table.rule
    da = decide(a, now, rule, 0)[1]
    db = decide(b, now, rule, 0)[1]
    if (db.remaining, -db.reset_after) < (da.remaining, -da.reset_after):
        return b
    return a
