"""Which rails a sender's link may use now: a failed rail is left out, then tried again.

A rail (an RDMA device, one NIC) that fails mid-push fails that push, and
the link is rebuilt at once. It is rebuilt without the failed rail, so the
next push runs on the rails that are left; the rail is left out for a
backoff (5 s, doubling to 60 s while it keeps failing). Once the backoff
has passed, an idle link is rebuilt with the rail again, and every rail's
first channel proves its path with a zero-length write before the link
counts as up: a rail still dead is left out again, without failing a push.

I/O-free: the link feeds it failures and the time, and asks.
"""

from __future__ import annotations

FIRST_BACKOFF = 5.0  # seconds a rail is left out after it failed
MAX_BACKOFF = 60.0


class RailHealth:
    """Failed rails of one link, and until when each is left out."""

    def __init__(self) -> None:
        self._left_out: dict[str, tuple[float, float]] = {}  # rail -> (until, backoff)

    def failed(self, rail: str, now: float) -> None:
        """``rail`` failed: left out for longer each time it fails again."""
        _, previous = self._left_out.get(rail, (0.0, 0.0))
        backoff = min(previous * 2, MAX_BACKOFF) if previous else FIRST_BACKOFF
        self._left_out[rail] = (now + backoff, backoff)

    def proven(self, rail: str) -> None:
        """``rail`` carried a channel's probe: healthy again."""
        self._left_out.pop(rail, None)

    def usable(self, rails: list[str], now: float) -> list[str]:
        """The rails to build a link on: those not left out, or every one if
        all are (a link on a rail that may be back beats no link)."""
        return [rail for rail in rails if self._until(rail) <= now] or list(rails)

    def worth_retrying(self, rails: list[str], in_use: list[str], now: float) -> list[str]:
        """Rails left out of the link in use whose backoff has passed."""
        return [rail for rail in rails
                if rail not in in_use and rail in self._left_out and self._until(rail) <= now]

    @property
    def left_out_any(self) -> bool:
        """Whether any rail failed and has not been proven since."""
        return bool(self._left_out)

    def left_out(self, now: float) -> dict[str, float]:
        """Rails left out now, with the seconds until each is tried again."""
        return {rail: until - now for rail, (until, _) in self._left_out.items() if until > now}

    def _until(self, rail: str) -> float:
        return self._left_out.get(rail, (0.0, 0.0))[0]


def replacement_rail(rail: str, usable: list[str], number: int) -> str:
    """Channel ``number``'s ``rail``, unless that rail has just been left out
    (its writes were not acknowledged) and another is ``usable``: then the
    replacement moves to one of those."""
    if not rail or rail in usable or not usable:
        return rail
    return usable[number % len(usable)]
