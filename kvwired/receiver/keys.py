"""The sender's remote keys for a lease's slot: granted per channel, ended once.

Each data channel's responder grants its own key for the slot
(``per_lease_keys``), so a write under a key can reach only that slot. The
keys are revoked when no legitimate write is left (kvwired.lifecycle.key);
the slot goes back to the pool only after that.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import KvwireError, TransportError
from ..lifecycle.key import KeyAction, KeyEvent, KeyMachine
from ..transport.base import Responder
from .session import SenderSession

GRANT_ATTEMPTS = 3


class LeaseKeys:
    """One lease's keys (one per data channel) and their revocation."""

    def __init__(self, name: str, session: SenderSession, keys: list[int]) -> None:
        self.session = session
        self.keys = keys
        self.machine = KeyMachine(name)
        self._waiting: list[Callable[[], None]] = []

    @property
    def takes_writes(self) -> bool:
        return self.machine.takes_writes

    def revoke(self, then: Callable[[], None] | None = None) -> None:
        """End the keys (once); ``then`` runs when no write under them can land."""
        if then is not None:
            self._waiting.append(then)
        self._apply(KeyEvent.REVOKE)

    def _apply(self, event: KeyEvent) -> None:
        for action in self.machine.apply(event):
            if action is KeyAction.REVOKE_ON_RESPONDERS:
                revoke_keys(self.session.responders, self.keys,
                            lambda: self._apply(KeyEvent.ALL_REVOKED))
            elif action is KeyAction.RUN_WAITERS:
                waiting, self._waiting = self._waiting, []
                for callback in waiting:
                    callback()


async def grant_keys(session: SenderSession, offset: int, length: int) -> list[int]:
    """A key per data channel for ``length`` bytes at ``offset``, all from the
    session's current responders: a channel replaced while they were being
    granted leaves a dead key, so they are granted again (a few times)."""
    for _ in range(GRANT_ATTEMPTS):
        responders = list(session.responders)
        assert responders, "a session has its first responder from the handshake"
        keys: list[int] = []
        try:
            for responder in responders:
                keys.append(await responder.grant(offset, length))
        except KvwireError:
            revoke_keys(responders, keys, lambda: None)
            if session.is_current(responders):
                raise
            continue  # granted on a responder replaced meanwhile
        if session.is_current(responders):
            return keys
        revoke_keys(responders, keys, lambda: None)  # never disclosed
    raise TransportError(f"the data channels of sender {session.name} kept being "
                         "replaced while a lease was granted")


def revoke_keys(responders: list[Responder], keys: list[int],
                then: Callable[[], None]) -> None:
    """End each channel's key; ``then`` runs once no write under any can land."""
    left = len(keys)
    if not left:
        then()
        return

    def one_revoked() -> None:
        nonlocal left
        left -= 1
        if left == 0:
            then()
    for responder, key in zip(responders, keys, strict=False):
        responder.revoke(key, one_revoked)
