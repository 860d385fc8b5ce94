"""Who holds a lease at the receiver, and when nobody will: reclaim.

A delivered request stays in the pool until a decode engine releases it. An
engine may subscribe before the request is opened or after it is delivered,
let go without releasing (``unsubscribe``: kept for another engine), or
die. The receiver reclaims a delivered request nobody will release:

- **unclaimed**: no engine has held it for ``unclaimed_ttl`` since it was
  delivered, or since the last one let go;
- **engine gone**: every engine that held it died (left its socket without
  releasing), before or after delivery.

The caller keeps the set of holders and says when the last one left
(``LAST_LET_GO``, ``LAST_DIED``); this machine decides what that means. A
lease that ends otherwise (released, aborted) ends its claim (``ENDED``).
"""

from __future__ import annotations

from enum import Enum, auto

from . import StateMachine, Transition


class ClaimState(Enum):
    ARRIVING = auto()  # not delivered yet; no engine holds it
    ARRIVING_HELD = auto()  # not delivered yet; engines hold it
    ARRIVING_DESERTED = auto()  # not delivered yet; every engine that held it died
    UNCLAIMED = auto()  # delivered; nobody holds it; the TTL runs
    CLAIMED = auto()  # delivered; engines hold it
    RECLAIMED = auto()  # freed by the receiver: nobody was going to release it
    ENDED = auto()  # released, or aborted: its lease ended otherwise


class ClaimEvent(Enum):
    SUBSCRIBED = auto()  # an engine holds it (another may already)
    LAST_LET_GO = auto()  # the last holder unsubscribed
    LAST_DIED = auto()  # the last holder's connection ended without a release
    DELIVERED = auto()  # held for decode
    TTL_EXPIRED = auto()  # unclaimed_ttl passed with nobody holding it
    LEASE_ENDED = auto()  # released or aborted


# START_TTL / STOP_TTL: the unclaimed_ttl timer; RECLAIM_*: free it, saying why.
ClaimAction = Enum("ClaimAction", "START_TTL STOP_TTL RECLAIM_UNCLAIMED RECLAIM_DESERTED "
                   "RECLAIM_ENGINE_GONE")

S, E, A = ClaimState, ClaimEvent, ClaimAction

_ENDED: Transition[ClaimState, ClaimAction] = Transition(S.ENDED)

CLAIM_TABLE: dict[tuple[ClaimState, ClaimEvent], Transition[ClaimState, ClaimAction]] = {
    (S.ARRIVING, E.SUBSCRIBED): Transition(S.ARRIVING_HELD),
    (S.ARRIVING, E.DELIVERED): Transition(S.UNCLAIMED, (A.START_TTL,)),
    (S.ARRIVING, E.LEASE_ENDED): _ENDED,
    (S.ARRIVING_HELD, E.SUBSCRIBED): Transition(S.ARRIVING_HELD),
    # Let go before delivery: it waits for another engine, as if never claimed.
    (S.ARRIVING_HELD, E.LAST_LET_GO): Transition(S.ARRIVING),
    (S.ARRIVING_HELD, E.LAST_DIED): Transition(S.ARRIVING_DESERTED),
    (S.ARRIVING_HELD, E.DELIVERED): Transition(S.CLAIMED),
    (S.ARRIVING_HELD, E.LEASE_ENDED): _ENDED,
    (S.ARRIVING_DESERTED, E.SUBSCRIBED): Transition(S.ARRIVING_HELD),
    # Every engine that asked for it died while it arrived.
    (S.ARRIVING_DESERTED, E.DELIVERED): Transition(S.RECLAIMED, (A.RECLAIM_DESERTED,)),
    (S.ARRIVING_DESERTED, E.LEASE_ENDED): _ENDED,
    (S.UNCLAIMED, E.SUBSCRIBED): Transition(S.CLAIMED, (A.STOP_TTL,)),
    (S.UNCLAIMED, E.TTL_EXPIRED): Transition(S.RECLAIMED, (A.RECLAIM_UNCLAIMED,)),
    (S.UNCLAIMED, E.LEASE_ENDED): Transition(S.ENDED, (A.STOP_TTL,)),
    (S.CLAIMED, E.SUBSCRIBED): Transition(S.CLAIMED),
    (S.CLAIMED, E.LAST_LET_GO): Transition(S.UNCLAIMED, (A.START_TTL,)),
    (S.CLAIMED, E.LAST_DIED): Transition(S.RECLAIMED, (A.RECLAIM_ENGINE_GONE,)),
    (S.CLAIMED, E.LEASE_ENDED): _ENDED,
    # Its own RECLAIM ends the lease too.
    (S.RECLAIMED, E.LEASE_ENDED): Transition(S.RECLAIMED),
}


class ClaimMachine(StateMachine[ClaimState, ClaimEvent, ClaimAction]):
    TABLE = CLAIM_TABLE  # type: ignore[assignment]
    INITIAL = ClaimState.ARRIVING
    what = "claim"

    @property
    def over(self) -> bool:
        return self.state in (ClaimState.RECLAIMED, ClaimState.ENDED)
