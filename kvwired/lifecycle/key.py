"""A lease's remote keys at the receiver: live, being revoked, revoked.

A lease is granted one key per data channel. The keys end once no legitimate
write is left: when every layer has landed, or when the lease is freed. Ending
them is asynchronous (each responder confirms that no write under its key can
land any more), and the slot may go back to the pool only after that. So the
revocation is asked for once, may be asked for again while it runs (the lease
freed while its landed keys are still being revoked), and what waits on it
runs once, when it is done, or at once if it is done already.
"""

from __future__ import annotations

from enum import Enum, auto

from . import StateMachine, Transition


class KeyState(Enum):
    LIVE = auto()  # the sender may write under the keys
    REVOKING = auto()  # asked of every responder; not all have confirmed
    REVOKED = auto()  # no write under any of the keys can land


class KeyEvent(Enum):
    REVOKE = auto()  # every layer landed, or the lease is freed
    ALL_REVOKED = auto()  # the last responder confirmed


# REVOKE_ON_RESPONDERS: ask each channel's responder to end its key.
# RUN_WAITERS: run what waited for the revocation (the slot's return).
KeyAction = Enum("KeyAction", "REVOKE_ON_RESPONDERS RUN_WAITERS")

S, E, A = KeyState, KeyEvent, KeyAction

KEY_TABLE: dict[tuple[KeyState, KeyEvent], Transition[KeyState, KeyAction]] = {
    (S.LIVE, E.REVOKE): Transition(S.REVOKING, (A.REVOKE_ON_RESPONDERS,)),
    # Asked again while it runs: what waits runs with the rest, when it ends.
    (S.REVOKING, E.REVOKE): Transition(S.REVOKING),
    (S.REVOKING, E.ALL_REVOKED): Transition(S.REVOKED, (A.RUN_WAITERS,)),
    (S.REVOKED, E.REVOKE): Transition(S.REVOKED, (A.RUN_WAITERS,)),
}


class KeyMachine(StateMachine[KeyState, KeyEvent, KeyAction]):
    TABLE = KEY_TABLE  # type: ignore[assignment]
    INITIAL = KeyState.LIVE
    what = "lease key"

    @property
    def takes_writes(self) -> bool:
        """Whether a replaced channel's responder grants this lease a new key."""
        return self.state is KeyState.LIVE
