"""The router's view log: membership transitions without I/O.

Every membership change the router makes is a transition of this log: it
makes the next view (with an epoch never used before), and says, as plain
data, which pushes carry the change to the nodes and in what order. The
async driver (router/membership.py) sends them, waits for readiness and
leases, talks to etcd, and reports back what happened (who did not take a
view), in the style of h11 or httpx's I/O-free core: no sockets, no sleeps,
no clock reads here; where time matters (a lease still running) ``now`` is
an argument.

The order of a plan is what keeps a single authority per key:

* the members that lose keys take the new view first (they stop deciding
  those keys and hand their states off before answering),
* then the members that only gain keys,
* and only then does the router adopt the view and route by it.

A change that half-failed (some members did not take the view while others
already hold it) is not undone: it is adopted, then the members that failed
are removed as crashed, each under a newer epoch (:meth:`ViewLog.unresponsive`).
Epochs only grow, even past views that were pushed to some nodes but never
adopted: a node ignores a view whose epoch it has seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from ring import Member, RingView
from ring.errors import given

#: Views and crashes remembered for nodes that missed pushes.
MAX_HISTORY = 32

#: How many crashed members the router keeps probing, to let them rejoin.
MAX_REMOVED = 256

#: What a push is for: ``config`` gives a newcomer the cluster config with a view
#: in which it owns nothing; ``losers`` and ``gainers`` are the two steps of a
#: change; ``survivors`` carries a crash (nobody loses keys to another member);
#: ``notify`` tells a removed member, best effort; ``refresh`` resends a view.
Role = Literal["config", "losers", "gainers", "survivors", "notify", "refresh"]


class MembershipError(Exception):
    """A change that cannot be made; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


@dataclass(frozen=True)
class Push:
    """One step of a plan: send ``view`` (with ``previous`` and ``crashed``) to ``members``.

    ``tolerate``: members that do not take it are reported, not raised (the
    change goes on); ``ready``: the push carries no handoff, so the driver
    bounds it by its readiness timeout rather than the push timeout;
    ``established``: its members hold their states (router/nodeclient.py
    ``push_body``).
    """

    members: tuple[Member, ...]
    view: RingView
    previous: RingView | None
    crashed: tuple[str, ...]
    role: Role
    tolerate: bool = True
    ready: bool = False
    established: bool = False


@dataclass(frozen=True)
class Change:
    """A transition from ``previous`` to ``view``: what to push, in order.

    ``welcome`` (if any) goes first, to the newcomers, before their leases;
    then ``pushes`` one step after the other; the view is adopted after them;
    ``afterwards`` are sent once it is adopted, and not waited for.
    """

    previous: RingView
    view: RingView
    crashed: tuple[str, ...]
    pushes: tuple[Push, ...]
    welcome: Push | None = None
    afterwards: tuple[Push, ...] = ()


@dataclass(frozen=True)
class Unresponsive:
    """What to do with members that did not take a committed view.

    ``crash`` is empty when there is nothing to do; with ``defer_quorum`` the
    router suspects itself and keeps them; otherwise it waits ``wait`` seconds
    (until every lease granted to them has certainly ended) and then crashes
    them one by one.
    """

    crash: tuple[str, ...]
    defer_quorum: bool = False
    wait: float = 0.0


class ViewLog:
    """The current view, the epochs used, recent history and crashed members."""

    def __init__(self, view: RingView | None = None) -> None:
        self.view = view if view is not None else RingView.empty()
        #: The highest epoch ever made or seen: new views always go above it.
        self.highest = self.view.epoch
        self.history: dict[int, RingView] = {}
        self.crashed_at: dict[int, tuple[str, ...]] = {}
        #: Members removed as crashed: still probed, and made to rejoin (as new
        #: members, their old state discarded) when they answer again.
        self.removed: dict[str, Member] = {}

    # ------------------------------------------------------------------ epochs

    def saw(self, epoch: int) -> None:
        """An epoch was pushed or seen elsewhere (etcd, the leader): never reuse it."""
        self.highest = max(self.highest, epoch)

    def next_view(self, members: Iterable[Member]) -> RingView:
        """A view after the current one, with an epoch never used before."""
        self.highest = max(self.highest, self.view.epoch) + 1
        return RingView.of(members, epoch=self.highest)

    # ------------------------------------------------------------------ transitions

    def welcome(self, member: Member) -> Push:
        """A newcomer's first push: the cluster's config with the current view.

        It owns nothing in that view, so the states the old members are about
        to hand it are kept only for rules it knows (a node started with
        --join has no rules of its own). If it was removed as crashed before,
        this also makes it hand back what it held to the current owners. Its
        own step, before the new epoch is made: the newcomer's lease comes
        between the two.
        """
        crashed = (member.id,) if member.id in self.removed else ()
        return Push((member,), self.view, None, crashed, "config", tolerate=False, ready=True)

    def join(self, member: Member) -> Change:
        """Add (or replace) ``member``: old members lose keys to it, so they go first."""
        previous = self.view
        new = self.next_view([*(m for m in previous if m.id != member.id), member])
        return Change(
            previous,
            new,
            (),
            (
                Push(previous.members, new, previous, (), "losers"),
                Push((member,), new, previous, (), "gainers"),
            ),
        )

    def leave(self, member_id: str, *, force: bool = False) -> Change:
        """A graceful leave: the leaving member hands everything off first.

        Its push is not tolerated: a member that does not take its leave is
        removed as a crash instead (the driver's call), under a newer epoch.

        The ring's last member leaves only when ``force``d: its states have
        nowhere to go, and every request after it is answered ``503
        no_nodes``, which an operator's slip (a wrong id, a script run twice)
        should not cause. A node leaving by itself (SIGTERM on a ``--join``
        node) forces: it is going either way, and a refused leave would only
        become a crash.
        """
        if member_id not in self.view:
            raise MembershipError(404, "unknown_node", f"no node {given(member_id)} in the ring")
        previous = self.view
        if len(previous) == 1 and not force:
            raise MembershipError(
                409,
                "last_node",
                f"node {member_id!r} is the ring's last node: without it every request is "
                "answered 503 no_nodes and its states are lost; to remove it anyway, "
                f"DELETE /admin/nodes/{member_id}?force=true "
                f"(ringlimit nodes remove {member_id} --force)",
            )
        leaving = previous.member(member_id)
        new = self.next_view(m for m in previous if m.id != member_id)
        return Change(
            previous,
            new,
            (),
            (
                Push((leaving,), new, previous, (), "losers", tolerate=False),
                Push(new.members, new, previous, (), "gainers"),
            ),
        )

    def fold_crashes(self, change: Change, crashed: Iterable[str]) -> Change | None:
        """A leave under way whose view also drops ``crashed`` (members whose
        removal was decided while the leaving member delivered its states).

        The leave's view (pushed to the leaving member only) is replaced by one
        without the crashed members, from the same previous view: the leaving
        member first (it sends what it was still delivering to a crashed member
        to that key's owner under the new view, with its final marks), then
        the members left (their crash policy applies to the crashed members'
        keys), then the crashed members are told, best effort. Without it the
        leave waited for the leaving member's delivery to a paused member (3
        tries of 5 s), holding the lock the crash removal waited for.

        None when nothing would be left: a leave leaves a ring (:meth:`leave`
        refuses the last node), and the removal waits for it as before.
        """
        gone = set(crashed) | set(change.crashed)  # a fold folded again: both
        if not any(m.id not in gone for m in change.view):
            return None
        previous = change.previous
        new = self.next_view(m for m in change.view if m.id not in gone)
        dropped = tuple(m for m in previous if m.id in gone)
        leaving = tuple(m for m in previous if m.id not in change.view and m.id not in gone)
        ids = tuple(m.id for m in dropped)
        return Change(
            previous,
            new,
            ids,
            (
                Push(leaving, new, previous, ids, "losers", tolerate=False),
                Push(new.members, new, previous, ids, "gainers"),
            ),
            afterwards=(Push(dropped, new, previous, ids, "notify"),) if dropped else (),
        )

    def crash(self, member_id: str) -> Change | None:
        """Drop a member that stopped answering (None: not in the view).

        The survivors get the view with the crash (their crash policy applies);
        the crashed member is told afterwards, best effort: if it is only slow
        or cut off from this router, it must stop deciding.
        """
        if member_id not in self.view:
            return None
        previous = self.view
        new = self.next_view(m for m in previous if m.id != member_id)
        crashed = (member_id,)
        gone = previous.member(member_id)
        return Change(
            previous,
            new,
            crashed,
            (Push(new.members, new, previous, crashed, "survivors"),),
            afterwards=(Push((gone,), new, previous, crashed, "notify"),),
        )

    def roll_forward(
        self, view: RingView, previous: RingView | None, crashed: tuple[str, ...]
    ) -> Change:
        """Finish a change another router committed but left half-done.

        The order of a join: newcomers learn the config first, then whoever
        loses keys, then the newcomers get the view.
        """
        self.saw(view.epoch)
        before = previous if previous is not None else RingView.empty()
        newcomers = tuple(m for m in view if m.id not in before)
        return Change(
            before,
            view,
            crashed,
            (
                Push(before.members, view, before, crashed, "losers"),
                Push(newcomers, view, before, (), "gainers"),
            ),
            welcome=Push(newcomers, before, None, (), "config", ready=True),
        )

    def refresh(self, member: Member, node_epoch: int) -> Push:
        """Resend the current view to a member behind it, with its own previous
        view and every crash it missed, so its crash policy (replica promotion,
        conservative) still applies."""
        previous = self.history.get(node_epoch)
        missed = tuple(
            m for epoch, ids in sorted(self.crashed_at.items()) if epoch > node_epoch for m in ids
        )
        return Push((member,), self.view, previous, missed, "refresh", established=True)

    def lost_state(self, member: Member, node_epoch: int) -> bool:
        """A member at epoch 0 while the ring is older restarted and lost its state."""
        return node_epoch == 0 and self.view.epoch > 0 and member.id in self.view

    def registered(self, member: Member) -> bool:
        """True if ``member`` is in the view as itself (a repeated registration,
        or a restart: the driver asks its epoch to tell); raises when the id is
        in the view with another url or weight."""
        if member.id not in self.view:
            return False
        if self.view.member(member.id) != member:
            raise MembershipError(
                409,
                "already_member",
                f"node {member.id!r} is already in the ring with another url or weight",
            )
        return True

    def unresponsive(
        self,
        failed: Iterable[str],
        *,
        quorum: float,
        lease_until: Mapping[str, float],
        now: float,
        budgeted: bool = True,
    ) -> Unresponsive:
        """Members that did not take a committed view: crash them, or not yet.

        Within the removal budget's quorum (router/removal.py): when so many
        failed that removing them would leave no majority, the router suspects
        itself and keeps them. And only once every lease granted to them has
        certainly ended (``lease_until``, on the same clock as ``now``).
        """
        ids = tuple(m for m in dict.fromkeys(failed) if m in self.view)
        if not ids:
            return Unresponsive(())
        size = len(self.view)
        if budgeted and size - len(ids) <= quorum * size:
            return Unresponsive(ids, defer_quorum=True)
        until = max((lease_until[m] for m in ids if m in lease_until), default=float("-inf"))
        return Unresponsive(ids, wait=max(0.0, until - now))

    # ------------------------------------------------------------------ outcomes

    def remember(self, previous: RingView, crashed: Iterable[str]) -> None:
        """Keep recent views and crashes, for nodes that miss a push (:meth:`refresh`)."""
        self.history[previous.epoch] = previous
        for member_id in crashed:
            self.crashed_at[self.highest] = (*self.crashed_at.get(self.highest, ()), member_id)
        for epoch in sorted(self.history)[:-MAX_HISTORY]:
            del self.history[epoch]
        for epoch in sorted(self.crashed_at)[:-MAX_HISTORY]:
            del self.crashed_at[epoch]

    def bury(self, member: Member) -> None:
        """Remember a member removed as crashed (bounded: the oldest go first)."""
        self.removed[member.id] = member
        while len(self.removed) > MAX_REMOVED:
            del self.removed[next(iter(self.removed))]

    def adopt(self, view: RingView) -> None:
        """Route by ``view`` from now on; removed members in it have rejoined."""
        self.view = view
        for member_id in [m for m in self.removed if m in view]:
            del self.removed[member_id]
