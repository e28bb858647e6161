"""A node's lease: the time window in which it may decide for the keys it owns.

A router removes an unresponsive node as crashed and promotes a replica on
another node. If the node was only paused (SIGSTOP, a GC or VM pause, a
partition that heals), it would wake up and answer the requests already in
its socket buffers from the state it held before the pause: two nodes would
have decided the same key. The lease closes that window. A node in a ring
decides only while its lease is valid, and the router removes a member only
after every lease it may have granted must have expired.

The protocol anchors every lease at a time the *node* read on its own
monotonic clock, so a delayed message can never extend it:

1. The router probes the node; the node answers with an **offer** token
   carrying ``r``, the node's clock when it handled the probe.
2. On its next probe the router **grants** that token for ``seconds``.
   The node extends its lease to ``r + seconds`` (never further).
3. The router receives the offer at ``a >= r`` (real time), so the lease it
   granted ends no later than ``a + seconds`` on the router's clock, give or
   take the clocks' rate difference (``drift``). It removes the member only
   after that bound: :func:`lease_bound`.

A grant that arrives late (the node was paused while it travelled) extends
the lease to a point already in the past: no effect. Clock assumptions: the
node's monotonic clock runs no slower than ``1 / (1 + drift)`` of the
router's (``drift`` is 1% by default, far above what NTP-disciplined or
free-running quartz clocks differ by); a faster node clock only shortens its
lease. The clocks need not agree on the time. The node's clock must advance
while the process or host is paused (``CLOCK_BOOTTIME`` does across a
suspend; see :func:`node.clock.boot_clock`).

Everything here is pure: the clock is an argument.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

#: The longest lease a router may grant (seconds): bounds a bogus grant.
MAX_LEASE = 300.0
#: The clocks' rate difference the router allows for (a fraction).
DEFAULT_DRIFT = 0.01


def lease_bound(offered_at: float, seconds: float, drift: float = DEFAULT_DRIFT) -> float:
    """On the router's clock, when a lease granted for an offer received at
    ``offered_at`` has certainly ended at the node."""
    return offered_at + seconds * (1.0 + drift)


class LeaseError(ValueError):
    """A grant that cannot be honoured (malformed, from another incarnation, too long)."""


@dataclass
class Lease:
    """The node's side: offers tokens, takes grants, says whether it may decide.

    ``required`` is off for a node that is not part of a leased ring (a
    standalone node, a node under a router without health checks): only a
    router that removes members on its own probes needs leases.
    """

    incarnation: str = field(default_factory=lambda: secrets.token_hex(6))
    required: bool = False
    until: float = -math.inf

    def offer(self, now: float) -> str:
        """A token for the router to grant later; it carries ``now``."""
        return f"{self.incarnation}:{now!r}"

    def grant(self, token: str, seconds: float, now: float) -> float:
        """Extend the lease to the token's anchor + ``seconds``; returns the time left."""
        if not isinstance(token, str):
            raise LeaseError("the lease token must be a string")
        incarnation, _, anchor_text = token.partition(":")
        if incarnation != self.incarnation:
            # Offered by an earlier process (this one restarted): it carries
            # nothing this process may rely on.
            raise LeaseError("the lease token was offered by another incarnation of this node")
        try:
            anchor = float(anchor_text)
        except ValueError:
            raise LeaseError(f"malformed lease token {token!r}") from None
        if not (math.isfinite(anchor) and anchor <= now):
            raise LeaseError("the lease token's time is not one this node offered")
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise LeaseError("lease seconds must be a number")
        if not (math.isfinite(seconds) and 0 < seconds <= MAX_LEASE):
            raise LeaseError(f"lease seconds must be in (0, {MAX_LEASE:g}]")
        self.until = max(self.until, anchor + float(seconds))
        return self.left(now)

    def left(self, now: float) -> float:
        return max(0.0, self.until - now)

    def valid(self, now: float) -> bool:
        return not self.required or now < self.until

    def revoke(self) -> None:
        """The node learned it was removed: nothing it held before may be decided on."""
        self.until = -math.inf
