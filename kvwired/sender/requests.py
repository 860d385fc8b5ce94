"""``Requests``: what a link asked its receiver, matched to the answers.

Every request names a ``req`` and every answer names the one it answers.
A caller that stops waiting (a deadline, a cancellation) does not orphan
what the receiver grants meanwhile: its ``undo`` says what to send back
when the answer comes (a lease: its abort), so no grant outlives the
request that asked for it.

No I/O: it is handed ``send``, and fed the answers the link reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import DuplicateRequest, KvwireError, ProtocolError, from_wire
from ..protocol import Message
from ..protocol import control as ctl

# What to send back for an answer nobody waits for any more (a lease: its abort).
Undo = Callable[[Any], Message | None]
A = TypeVar("A", bound=Message)


def req_of(msg: Message) -> str:
    """The request a message is about: every request and answer names one."""
    req = getattr(msg, "req", None)
    assert isinstance(req, str), f"{msg.kind!r} names no request"
    return req


class Requests:
    """Requests to one receiver awaiting their answer, by request id."""

    def __init__(self, peer: str, send: Callable[[Message], None]) -> None:
        self.peer = peer
        self._send = send
        self._waiting: dict[str, tuple[asyncio.Future[Message], Undo | None]] = {}
        self._abandoned: dict[str, Undo] = {}

    @property
    def pending(self) -> bool:
        """Whether any request waits for its answer."""
        return bool(self._waiting)

    async def ask(self, msg: Message, answer: type[A],
                  undo: Callable[[A], Message | None] | None = None) -> A:
        """Send ``msg`` and wait for the answer to its ``req``, an ``answer``
        (a ``refused`` raises its error). If the caller stops waiting, the
        answer is still taken when it comes, and ``undo``'s message sent."""
        req = req_of(msg)
        if req in self._waiting:
            raise DuplicateRequest(f"request {req} is already being opened")
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[req] = (future, undo)
        self._send(msg)
        try:
            result = await future
        except asyncio.CancelledError:
            # Three ways to be cancelled: before the answer (it will be undone
            # when it comes), after ``answered`` took an answer for a waiter
            # already cancelled (undone there), or with the answer in hand in
            # the turn of the cancellation (undone here).
            if undo is not None:
                if self._waiting.get(req, (None,))[0] is future:
                    self._abandoned[req] = undo
                elif future.done() and not future.cancelled() and future.exception() is None:
                    self._undo(undo, future.result())
            raise
        finally:
            if self._waiting.get(req, (None,))[0] is future:
                del self._waiting[req]
        if not isinstance(result, answer):
            raise ProtocolError(f"receiver {self.peer} answered {req} with {result.kind!r}, "
                                f"expected {answer.kind!r}")
        return result

    def answered(self, msg: Message) -> None:
        """An answer came: to its waiter, or undone if nobody waits for it."""
        req = req_of(msg)
        refused = msg if isinstance(msg, ctl.Refused) else None
        waiting = self._waiting.pop(req, None)
        if waiting is not None:
            future, undo = waiting
            if not future.done():
                if refused is not None:
                    future.set_exception(from_wire(refused.error))
                else:
                    future.set_result(msg)
                return
            # Its waiter was cancelled in this very loop turn and will never
            # take the answer.
        else:
            undo = self._abandoned.pop(req, None)
        if undo is not None and refused is None:
            self._undo(undo, msg)

    def _undo(self, undo: Undo, answer: Message) -> None:
        # Nobody waits for this answer any more: give back at once what it
        # holds. No write of ours can reach it.
        reply = undo(answer)
        if reply is not None:
            self._send(reply)

    def fail_all(self, error: KvwireError) -> None:
        """The connection is gone: every waiter fails with ``error``, and the
        receiver frees by itself whatever the abandoned requests were granted."""
        for future, _ in self._waiting.values():
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()
        self._abandoned.clear()
