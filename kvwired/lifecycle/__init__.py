"""Request lifecycles as explicit, I/O-free state machines.

One machine per thing that lives: a push at the sender (``push``) and its
staging (``staging``), a lease at the receiver (``lease``), its keys
(``key``) and who holds it (``claim``). Each is an enum of states and one transition
table; ``apply(event)`` moves the machine and returns the actions the
daemon must carry out (messages to send, bytes to free, outcomes to
report), or raises ``IllegalTransition``. No sockets, tasks or clocks: the
daemons feed events in and carry actions out, and the tests drive the
machines directly (h11's ``_state.py`` and asyncpg's ``_set_state`` are the
models).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Generic, TypeVar

from ..errors import ProtocolError

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)
A = TypeVar("A", bound=Enum)


class IllegalTransition(ProtocolError, code="illegal_transition",
                        hint="a message arrived that this request's state does not allow; "
                             "this is a bug in one of the two daemons"):
    """An event that the protocol does not allow in the state it came in."""


@dataclass(frozen=True)
class Transition(Generic[S, A]):
    target: S
    actions: tuple[A, ...] = ()


class StateMachine(Generic[S, E, A]):
    """A state, a table, and the one method that moves it."""

    TABLE: ClassVar[Mapping[tuple[Enum, Enum], Transition[Enum, Enum]]]
    INITIAL: ClassVar[Enum]
    what: ClassVar[str] = "state machine"

    def __init__(self, name: str) -> None:
        self.state: S = self.INITIAL  # type: ignore[assignment]
        self.name = name

    def can(self, event: E) -> bool:
        return (self.state, event) in self.TABLE

    def apply(self, event: E) -> tuple[A, ...]:
        transition = self.TABLE.get((self.state, event))
        if transition is None:
            raise IllegalTransition(
                f"{self.what} {self.name}: {event.name.lower()} is not allowed when "
                f"{self.state.name.lower()}",
                hint="the peer broke the protocol, or this is a bug in kvwire")
        before = self.state
        self.state = transition.target  # type: ignore[assignment]
        self.entered(before, event)
        return transition.actions  # type: ignore[return-value]

    def entered(self, before: S, event: E) -> None:
        """Hook: the machine has just moved (outcome bookkeeping)."""
