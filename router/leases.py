"""The router's quota leases for hot keys: the lease book, hot-key detection, asks.

``router/quotas.py`` is the pure book; this is its driver on the proxy path
(docs/hotkeys.md, "In the cluster"). For a request whose one rule says
``lease = "auto"``, :meth:`RouterLeases.decide` answers from the book:

* ``ADMIT``: a lease of the current epoch had the unit. The router still
  has to pass the request to the application, which only nodes front: it
  sends it to the next node in turn (not the owner, when there is another)
  marked ``X-Ringlimit-Leased``, which a node believes only from a router (the
  internal token, as every router-to-node field) and serves without deciding.
  So the owner's decision *and* its share of the hot key's proxying go away,
  spread over the cluster: the owner's load drops, which is the point.
* ``DENY``: the owner said it admits nothing before ``refill_at``: the router
  answers 429 itself, with the headers and body a node would give.
* ``FORWARD``: as without leases.

It counts each leased rule's keys at this router (``node.quota.HotKeys``) and
asks the owner for a lease (``POST /internal/quota``) once a key is hot, and
for the next block at the book's low-water mark: in a background task, never
blocking a request, one ask per key at a time. Spent leases are settled with
the next ask. A new view drops the leases of older epochs
(``LeaseBook.set_epoch``): their units are written off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Container, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from node.clock import boot_clock
from node.decision import COST_EXCEEDS_CAPACITY, Decision, Verdict
from node.leasing import definition, lease_from_dict
from node.quota import BUCKETS, HotKeys, LeasePolicy, OwnerAnswer
from node.rules import Rule
from node.topkeys import TopKeys, is_near_limit
from ring import Member
from router.forward import Forwarder
from router.quotas import ADMIT, DENY, FORWARD, LeaseBook

log = logging.getLogger("ringlimit.router.leases")

#: Requests per second of one key at this router before it asks for a lease.
DEFAULT_THRESHOLD = 20.0
#: How often the book lets go of leases whose time is up.
EXPIRE_EVERY = 1.0
#: Asks in flight at once (one per key): beyond, a hot key waits for the next request.
MAX_ASKS = 64

__all__ = ["ADMIT", "DENY", "FORWARD", "RouterLeases", "leased_rule", "with_unspent"]


def leased_rule(rules: Sequence[Rule]) -> Rule | None:
    """The rule a request may be decided by from the router's leases: its one
    rule, when that rule leases and is not a shadow rule (decided and counted
    by its owner, never denied: a denial lease answered 429 for it). None: the
    request goes to its owner as usual. The proxy path and the decision API
    ask the same."""
    if len(rules) != 1:
        return None
    rule = rules[0]
    return rule if rule.lease == "auto" and not rule.shadow else None


#: A Decision from a tuple without the NamedTuple's Python-level __new__ (as node/algorithms.py).
_decision = partial(tuple.__new__, Decision)


def owner_decision(
    rule: Rule, allowed: bool, answer: OwnerAnswer, elapsed: float, retry_after: float, left: int
) -> Decision:
    """What the owner would answer ``elapsed`` seconds after its last grant (which said
    ``answer``; ``retry_after`` after it, it admits again), with ``left`` units in this
    router's leases: they count as the key's, as they would had they never left the owner.

    Exact for one router and no other traffic of the key: ``remaining`` is the
    owner's units beyond its leases, plus what it regained since the grant
    (``answer.refill`` per second after ``available_after``: buckets, and the
    sliding window counter within its window), plus ``left``; the times are the
    owner's minus ``elapsed``, and a bucket is whole ``left`` units sooner
    (the reference still holds them). What the owner or other routers admitted
    since the grant is not seen (but for this router's requests sent to the
    owner while it asked, taken off ``answer.remaining`` before: see
    :meth:`RouterLeases.note`), and units other routers hold count as spent.
    """
    remaining = answer.remaining
    available = answer.available_after - elapsed
    reset = answer.reset_after - elapsed
    refill = answer.refill
    if available <= 0.0:
        if refill > 0.0:
            more = 1 + math.floor(-available * refill)
            remaining += more
            available += more / refill
        else:
            available = 0.0
    if left:
        remaining += left
        if refill > 0.0 and rule.algorithm in BUCKETS:
            reset -= left / refill
    if remaining >= rule.capacity:
        remaining, available, reset = rule.capacity, 0.0, 0.0
    elif reset < 0.0:
        reset = 0.0
    if allowed:
        return _decision((True, rule.limit, remaining, reset, None, rule.name, None, available))
    wait = retry_after - elapsed
    if wait < 0.0:
        wait = 0.0
    elif wait == math.inf:  # the owner never admits the cost (the engine's only "never")
        return _decision(
            (False, rule.limit, remaining, reset, None, rule.name, COST_EXCEEDS_CAPACITY, available)
        )
    return _decision((False, rule.limit, remaining, reset, wait, rule.name, None, available))


def with_unspent(rule: Rule, result: dict[str, Any], left: int) -> dict[str, Any]:
    """A read's answer (cost 0) from the owner, with the ``left`` units this
    router's leases hold counted as the key's, as this router's own answers
    count them (:func:`owner_decision`): allowed, ``remaining`` up by them, a
    bucket's ``reset_after`` sooner by them, no ``retry_after``.

    The owner counts units out on lease as spent: asked for a read of a key
    whose units sat in this router's leases, it said ``allowed: false,
    retry_after: 883`` while the next five checks through this router were
    admitted (an exploratory tester). A read says whether one more unit
    would pass, and through this router it would. A result with an error or
    a reason (an unreachable owner, a refusal) is not a decision: left as it is.
    """
    if left <= 0 or "error" in result or result.get("reason") is not None:
        return result
    remaining = result.get("remaining")
    if type(remaining) is not int:
        return result
    adjusted = dict(result)
    adjusted["allowed"] = True
    adjusted["retry_after"] = None
    remaining += left
    reset = adjusted.get("reset_after")
    if remaining >= rule.capacity:
        # Whole: nothing more to come. Otherwise ``available_after`` (the next
        # unit beyond ``remaining``) stays the owner's, as owner_decision keeps
        # it: it said 0 whatever the wait (the day's-end tester).
        remaining, reset = rule.capacity, 0.0
        adjusted["available_after"] = 0.0
    elif isinstance(reset, int | float) and rule.algorithm in BUCKETS and rule.rate > 0.0:
        reset = max(0.0, reset - left / rule.rate)  # the units are still the bucket's
    adjusted["remaining"] = remaining
    adjusted["reset_after"] = reset
    return adjusted


class RouterLeases:
    """One router's leases, per ``(rule name, key)``.

    Its clock keeps counting while the host sleeps (``boot_clock``): a lease
    must end at the router no later than at its owner, and a router that woke
    from a suspend on ``time.monotonic`` (stopped meanwhile) spent units the
    owner had counted in a window long gone, on top of the new window's.
    """

    def __init__(
        self,
        forwarder: Callable[[], Forwarder | None],
        token_header: list[tuple[str, str]],
        *,
        threshold: float = DEFAULT_THRESHOLD,
        clock: Callable[[], float] = boot_clock,
        rule_names: Callable[[], Container[str]] | None = None,
    ) -> None:
        self.forwarder = forwarder
        self.token_header = token_header
        #: The names of the rules in force (the router's config; None: every name
        #: seen is kept): see :meth:`note`.
        self.rule_names = rule_names
        self.threshold = threshold
        self.clock = clock
        self.book: LeaseBook[tuple[str, str]] = LeaseBook()
        self.policy = LeasePolicy("auto", threshold=threshold)
        self._hot: dict[str, HotKeys] = {}
        #: keys asked for, each with the requests this router sent to the owner meanwhile
        #: (from the one that prompted the ask): the owner may decide them after its
        #: grant, which then did not count them
        self._asking: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_expiry = 0.0
        #: Each leased rule as this router last decided it: a rule redefined at
        #: runtime (PUT /admin/rules) revokes its leases (:meth:`_redefined`).
        self._rules: dict[str, Rule] = {}
        self.counts = {"admitted": 0, "denied": 0, "asks": 0, "granted": 0, "units": 0}
        #: The users this router denied, or admitted near the limit, from its leases.
        #: Their owners never see those decisions (most of a hot user's traffic), so
        #: ``GET /admin/top`` adds this router's sketch to the nodes' (router/top.py).
        self.top = TopKeys(now=clock())

    def decide(self, rule: Rule, key: str, epoch: int, now: float) -> str:
        """``ADMIT``, ``DENY`` or ``FORWARD`` for one request of cost 1."""
        book = self.book
        if epoch != book.epoch:
            book.set_epoch(epoch)  # a new view: older leases are revoked (written off)
        if self._rules.get(rule.name) is not rule:
            self._redefined(rule)
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRE_EVERY
            book.expire(now)
            self.top.rotate(now)
        entry = (rule.name, key)
        outcome = book.decide(entry, now, 1)
        if outcome == ADMIT:
            self.counts["admitted"] += 1
        elif outcome == DENY:
            self.counts["denied"] += 1
        elif entry in self._asking:
            self._asking[entry] += 1  # sent to the owner while it may be granting
        return outcome

    def unspent(self, rule: Rule, key: str, epoch: int) -> int:
        """Units this router's leases hold for ``key`` now under ``epoch`` and
        ``rule``'s definition as the book knows it; 0 under any other.

        A lookup only: a read's rule may be older than the book's (the rules
        changed while the read was out), and revoking here, as :meth:`decide`
        does, wrote off the leases taken under the new definition (the
        review). Compared by definition, as :meth:`_redefined` keeps leases:
        by identity, every rules apply (the same file again) made reads say
        "denied" until a check of the rule came through (a tester)."""
        known = self._rules.get(rule.name)
        if epoch != self.book.epoch or known is None:
            return 0
        if known is not rule and definition(known) != definition(rule):
            return 0
        return self.book.left((rule.name, key), self.clock())

    def _redefined(self, rule: Rule) -> None:
        """``rule`` is not the object last seen under its name: the first request
        under it, or new rules. Redefined (another limit, period, burst or
        algorithm), the leases taken under the old definition are revoked, their
        units written off as on a ring change (its denials go too): a lowered
        limit was outrun by up to a block of the old one's units per key and
        router (34 admitted after a 100/day rule became 10/day)."""
        known = self._rules.get(rule.name)
        if known is None:
            self._forget_gone_rules(self._rules)
        self._rules[rule.name] = rule
        # What the units are measured in, as the owner compares it: a change of
        # on_error or shadow alone leaves the leases as they are.
        if known is not None and definition(known) == definition(rule):
            return
        # Not known: the first request under the name, or the rule was removed
        # (and forgotten) and is back. Its leases, if any, were taken under a
        # definition this router no longer knows: revoked as a redefined rule's
        # are (an independent review: a rule removed, then added again at 10/day
        # instead of 100/day, admitted 34 on the old definition's leases).
        revoked = [entry for entry in self.book if entry[0] == rule.name]
        for entry in revoked:
            self.book.release(entry)
        if revoked:
            log.info("rule %r redefined: its leases on %d key(s) revoked", rule.name, len(revoked))

    def _forget_gone_rules(self, table: dict[str, Any]) -> None:
        """Drop ``table``'s entries of rules no longer in force (when known)."""
        if self.rule_names is not None:
            names = self.rule_names()
            for name in [n for n in table if n not in names]:
                del table[name]

    def note(
        self, rule: Rule, key: str, owner: Member, epoch: int, now: float, forwarded: bool
    ) -> None:
        """After a decision (``forwarded``: this request goes to ``owner``): ask
        ``owner`` for a lease when the key is hot here, or for the next block at the
        low-water mark (in the background)."""
        entry = (rule.name, key)
        hot = self._hot.get(rule.name)
        if hot is None:
            # A rule seen for the first time: the rates of rules no longer in force
            # (renamed or removed at runtime) go, up to 4,096 keys each.
            self._forget_gone_rules(self._hot)
            hot = self._hot[rule.name] = HotKeys(self.threshold)
        block = self.policy.block(rule)
        if entry in self.book:
            want = self.book.want(entry, now, block)
            if not want:
                return
        elif not hot.observe(key, now):
            return
        else:
            want = block
        if entry in self._asking or len(self._asking) >= MAX_ASKS:
            return
        self._asking[entry] = int(forwarded)
        task = asyncio.get_running_loop().create_task(self._ask(rule, key, owner, epoch, want, now))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ask(
        self, rule: Rule, key: str, owner: Member, epoch: int, want: int, asked_at: float
    ) -> None:
        entry = (rule.name, key)
        try:
            forwarder = self.forwarder()
            if forwarder is None:
                return
            settle = [{"lease": q.lease_id, "unused": 0} for q in self.book.take_spent(entry)]
            payload = json.dumps(
                {
                    "epoch": epoch,
                    "rule": rule.name,
                    # The rule as this router decides it: an owner that holds
                    # another definition (the new rules are on their way to one
                    # of the two) grants nothing (node/app.py, rule_changed).
                    "definition": definition(rule),
                    "key": key,
                    "want": want,
                    "cost": 1,
                    "settle": settle,
                }
            ).encode()
            self.counts["asks"] += 1
            answer = await forwarder.post_json(
                owner.url + "/internal/quota", payload, self.token_header
            )
            if answer.status != 200:
                return  # not the owner any more, another epoch, lease off: ask later
            data: Any = json.loads(answer.body)
            if type(data) is not dict or data.get("lease") is None:
                return
            current = self._rules.get(rule.name)
            if current is not rule and (current is None or definition(current) != definition(rule)):
                return  # redefined while asked: its units are written off
            lease = lease_from_dict(data["lease"], entry)
            said = lease.answer
            if said is not None and self._asking.get(entry):
                # Never more than the owner may have: as if it decided them all after.
                unseen = min(said.remaining, self._asking[entry])
                lease = replace(lease, answer=replace(said, remaining=said.remaining - unseen))
            if not self.book.add(entry, lease, asked_at, self.clock()) and lease.units:
                self.counts["granted"] += 1
                self.counts["units"] += lease.units
        except Exception as exc:  # a failed ask only means no lease
            log.debug("quota ask for %s failed: %s", entry, exc)
        finally:
            self._asking.pop(entry, None)

    def verdict(self, rule: Rule, key: str, allowed: bool, now: float) -> Verdict:
        """What a node would answer, as far as the lease tells: for the headers and
        the decision API (docs/hotkeys.md, "What a lease's answers say")."""
        decision = self._decision(rule, key, allowed, now)
        if not allowed or is_near_limit(decision.remaining, decision.limit):
            self.top.record(rule.name, key, not allowed)  # as the owner would have
        return Verdict(allowed, decision, (decision,))

    def _decision(self, rule: Rule, key: str, allowed: bool, now: float) -> Decision:
        entry = (rule.name, key)
        found = self.book.owner_answer(entry, now)
        if found is not None:
            return owner_decision(rule, allowed, *found)
        # A grant from a node that does not send its answer: the lease's own figures.
        if allowed:
            left = self.book.left(entry, now)
            return Decision(True, rule.limit, left, rule.period, None, rule.name)
        wait = max(self.book.denied_for(entry, now), 0.001)
        return Decision(False, rule.limit, 0, max(wait, rule.period), wait, rule.name, None, wait)

    def top_report(self, rules: Sequence[str] | None, n: int) -> dict[str, Any]:
        """This router's lease decisions for ``GET /admin/top``, as a node reports its own."""
        self.top.rotate(self.clock())
        return {"top": self.top.report(rules, n)}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._tasks.clear()
