"""The receiver's memory of how requests ended, for senders that missed it.

A sender that loses its connection after posting a request's last layer
cannot tell whether the receiver delivered it: the ``delivered`` message may
have been in flight, or lost with the connection (a sender stopped past the
heartbeat finds its connection reset, unread frames and all). Guessing
either way splits the outcome between the two engines. So the receiver
keeps each request's verdict for a while, under the sender's name (certified
by TLS where it is on), and a sender that reconnects asks for it.

No I/O and no clock of its own: the caller says what time it is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import KvwireError, RequestAborted, from_wire
from .protocol import control as ctl

VERDICT_TTL = 600.0  # seconds a verdict is kept: far past any reconnect and deadline
MAX_VERDICTS = 65536  # at most this many are kept; the oldest go first


@dataclass(frozen=True, slots=True)  # up to MAX_VERDICTS of them are kept
class Verdict:
    """How one lease ended: delivered (with its checksum) or aborted (with why)."""

    lease: int
    delivered: bool
    checksum: int = 0
    error: KvwireError | None = None


def outcome(verdict: Verdict | None) -> str:
    """The ``verdict`` message's ``outcome`` for it (None: not known here)."""
    if verdict is None:
        return "unknown"
    return "delivered" if verdict.delivered else "aborted"


def to_message(req: str, lease: int, verdict: Verdict | None) -> ctl.Verdict:
    """The receiver's answer to ``ask``."""
    if verdict is None:
        return ctl.Verdict(req=req, lease=lease, outcome="unknown")
    if verdict.delivered:
        return ctl.Verdict(req=req, lease=lease, outcome="delivered",
                           checksum=verdict.checksum)
    assert verdict.error is not None, "an aborted verdict keeps its reason"
    return ctl.Verdict(req=req, lease=lease, outcome="aborted", error=verdict.error.to_wire())


def from_message(msg: ctl.Verdict) -> Verdict | None:
    """A ``verdict`` message as a Verdict; None for ``unknown``."""
    if msg.outcome == "unknown":
        return None
    if msg.outcome == "delivered":
        return Verdict(msg.lease, True, checksum=msg.checksum or 0)
    return Verdict(msg.lease, False, error=from_wire(msg.error) if msg.error is not None
                   else RequestAborted(f"request {msg.req} was aborted"))


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TimedMemory(Generic[K, V]):
    """Values by key, each kept ``ttl`` seconds, at most ``limit`` (the oldest go)."""

    def __init__(self, ttl: float = VERDICT_TTL, limit: int = MAX_VERDICTS) -> None:
        self.ttl, self.limit = ttl, limit
        self._kept: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def record(self, key: K, value: V, now: float) -> None:
        self._kept.pop(key, None)
        self._kept[key] = (now, value)
        self._expire(now)

    def lookup(self, key: K, now: float) -> V | None:
        self._expire(now)
        kept = self._kept.get(key)
        return None if kept is None else kept[1]

    def forget(self, key: K) -> None:
        self._kept.pop(key, None)

    def _expire(self, now: float) -> None:
        while self._kept:
            key, (recorded, _) = next(iter(self._kept.items()))
            if now - recorded <= self.ttl and len(self._kept) <= self.limit:
                return
            del self._kept[key]


class VerdictBook(TimedMemory[tuple[str, str], Verdict]):
    """Verdicts by (sender, request)."""

    def lookup_lease(self, sender: str, req: str, lease: int, now: float) -> Verdict | None:
        """The verdict on ``lease`` of ``sender``'s ``req``; None if not known (never
        leased here, forgotten, or the request id was leased again since)."""
        verdict = self.lookup((sender, req), now)
        return verdict if verdict is not None and verdict.lease == lease else None


class MissedFailures(TimedMemory[str, KvwireError]):
    """Requests that ended without delivery, by request id, for decode engines
    that subscribe later.

    In disaggregated serving the decode engine hears of a request only after
    its prefill engine answered; by then the push may have been refused (pool
    full) or aborted (deadline, the prefill side gone). A subscriber that came
    late is told at once why, instead of waiting out its own timeout for a
    request that will not come. A request opened again under the same id
    starts afresh (``forget``).
    """
