"""A sender's link to one receiver: connection up, down, and retired.

The link holds its connection up between requests. ``DOWN`` links are
connected on demand or by the keeper; a failure of either connection fails
everything that holds a lease on the link (``FAIL_HOLDERS``) and leaves it
``DOWN`` for the next attempt. A link removed from the configuration (or
stopping with the daemon) is ``RETIRING`` until the last lease on it ends,
then says ``bye`` and is ``RETIRED`` for good.
"""

from __future__ import annotations

from enum import Enum, auto

from . import StateMachine, Transition


class LinkState(Enum):
    DOWN = auto()
    CONNECTING = auto()
    UP = auto()
    RETIRING = auto()  # no new requests; the ones holding leases finish
    RETIRED = auto()


class LinkEvent(Enum):
    CONNECT = auto()  # a request, or the keeper, wants the connection
    CONNECTED = auto()  # hello/welcome and the data channel are done
    CONNECT_FAILED = auto()
    LOST = auto()  # the control or data connection broke, or the peer said bye
    RETIRE = auto()  # removed from the peers, or the daemon stops
    LAST_HOLDER_DONE = auto()  # no lease is held on the link any more


# FAIL_HOLDERS: every lease holder and every request waiting for an answer fails.
# Opening the connection is not an action: it takes awaits, so ``PeerLink.ensure``
# does it between CONNECT and CONNECTED (or CONNECT_FAILED), holding its lock.
LinkAction = Enum("LinkAction", "START_READING FAIL_HOLDERS CLOSE_CONNECTION SEND_BYE")


S, E, A = LinkState, LinkEvent, LinkAction

_LOST = Transition(S.DOWN, (A.CLOSE_CONNECTION, A.FAIL_HOLDERS))
_GOODBYE = Transition(S.RETIRED, (A.SEND_BYE, A.CLOSE_CONNECTION, A.FAIL_HOLDERS))

LINK_TABLE: dict[tuple[LinkState, LinkEvent], Transition[LinkState, LinkAction]] = {
    (S.DOWN, E.CONNECT): Transition(S.CONNECTING),
    (S.CONNECTING, E.CONNECTED): Transition(S.UP, (A.START_READING,)),
    (S.CONNECTING, E.CONNECT_FAILED): Transition(S.DOWN, (A.CLOSE_CONNECTION,)),
    (S.UP, E.LOST): _LOST,
    (S.DOWN, E.LOST): Transition(S.DOWN),
    (S.UP, E.RETIRE): Transition(S.RETIRING),
    (S.DOWN, E.RETIRE): Transition(S.RETIRED, (A.FAIL_HOLDERS,)),
    (S.CONNECTING, E.RETIRE): Transition(S.RETIRING),
    # The connection being built when the link was retired finishes: the
    # requests already waiting on it may still use it.
    (S.RETIRING, E.CONNECTED): Transition(S.RETIRING, (A.START_READING,)),
    (S.RETIRING, E.CONNECT_FAILED): Transition(S.RETIRED, (A.CLOSE_CONNECTION, A.FAIL_HOLDERS)),
    (S.RETIRING, E.LAST_HOLDER_DONE): _GOODBYE,
    (S.RETIRING, E.LOST): Transition(S.RETIRED, (A.CLOSE_CONNECTION, A.FAIL_HOLDERS)),
    (S.RETIRING, E.RETIRE): Transition(S.RETIRING),
    (S.RETIRED, E.RETIRE): Transition(S.RETIRED),
    (S.RETIRED, E.LOST): Transition(S.RETIRED),
}


class LinkMachine(StateMachine[LinkState, LinkEvent, LinkAction]):
    """One receiver as its sender sees it. Whether it may be used is its state
    alone: a retired link never connects again."""

    what = "link"
    INITIAL = LinkState.DOWN
    TABLE = LINK_TABLE  # type: ignore[assignment]

    @property
    def usable(self) -> bool:
        """New requests may use it (connecting first if need be)."""
        return self.state in (LinkState.DOWN, LinkState.CONNECTING, LinkState.UP)
