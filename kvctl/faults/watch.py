"""``PushWatch``: one verified push of the fault campaign, as its two engines'
events tell it. Fed events and clock ticks, it says what to do (let an
engine go on, strike the fault, kill a decode engine never told), and
keeps how each side ended, when the fault struck and whether the push hung.
No processes and no clock of its own: the campaign carries out its actions.

The prefill engine is held at its gate until the decode engine has
subscribed (or died), so a push never starts before its reader. A fault
strikes either when the gate opens (a wire scenario: from the push's start)
or when an engine reaches its hold point (that engine waits there until the
fault has struck).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

GATE = "connected"  # the phase the prefill engine waits at until decode subscribed
# How a side's push ends, as its engine says it: the events that end a side.
ENDINGS = frozenset({"finished", "released", "failed", "exit"})


class Release(NamedTuple):
    """Let ``role``'s engine go on from ``phase`` (None: its hold point)."""

    role: str
    phase: str | None = None


class Strike(NamedTuple):
    """``role``'s engine reached its hold point: strike the fault now."""

    role: str


class Kill(NamedTuple):
    """``role``'s engine waits for news that will not come: end it."""

    role: str


Action = Release | Strike | Kill


@dataclass
class PushWatch:
    holds: Mapping[str, str | None]  # each engine's hold point, if it has one
    strikes_at_hold: bool  # the fault strikes at a hold point (else at the gate)
    hang: float  # silence from both engines that counts as a hang
    last: float  # when an engine last said anything
    decode_grace: float  # how long a refused push's decode engine may wait to be told
    struck: float | None = None
    endings: dict[str, dict[str, Any]] = field(default_factory=dict)
    hung: bool = False
    _gate_open: bool = False
    _opened: bool = False
    _verified: dict[str, Any] | None = None
    # A push that fails inside the sender before its lease (its staging
    # full, say) is withdrawn at the receiver, which tells the decode engine.
    # If that does not arrive within the grace, it counts as "not told".
    _not_told_after: float | None = None

    @property
    def done(self) -> bool:
        return self.hung or len(self.endings) == len(self.holds)

    def event(self, role: str, at: float, event: dict[str, Any], now: float,
              killed: bool = False) -> list[Action]:
        """``role``'s engine said ``event`` at ``at`` (``killed``: its exit was
        the campaign's doing)."""
        self.last = at
        actions: list[Action] = []
        kind = event["e"]
        if role == "decode" and kind in ("subscribed", "exit") and not self._gate_open:
            actions.append(Release("prefill", GATE))  # exit: nobody to wait for
            self._gate_open = True
            if not self.strikes_at_hold:
                self.struck = now
        if kind == self.holds[role]:
            if self.strikes_at_hold and self.struck is None:
                self.struck = now
                actions.append(Strike(role))
            else:
                actions.append(Release(role))
        if kind == "verified":
            self._verified = event
        if kind == "opened":
            self._opened = True
        if role == "prefill" and kind == "failed" and not self._opened:
            self._not_told_after = at + self.decode_grace
        if kind in ENDINGS and role not in self.endings:
            if kind == "exit":
                event = {"e": "killed" if killed else "exit"}
            self.endings[role] = {**event, "at": at}
            if role == "decode" and self._verified is not None:
                self.endings[role]["corrupt"] = self._verified["corrupt"]
        return actions

    def tick(self, now: float) -> list[Action]:
        """No event for a while: a decode engine never told, or a hang."""
        if (self._not_told_after is not None and now > self._not_told_after
                and "decode" not in self.endings):
            self.endings["decode"] = {"e": "not-told", "at": now}
            return [Kill("decode")]
        if now - self.last > self.hang:
            self.hung = True
        return []
