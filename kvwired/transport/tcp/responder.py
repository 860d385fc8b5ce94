"""The responder's end: data connections bound to a session by its token,
their writes checked and landed by a ``WriteReceiver``, acknowledged.

Until a connection presents its session's token it holds a 16-byte buffer
and nothing else, and the door (``TransportOptions.door``) times it out,
caps how many there are and counts each refusal. A write outside what its
key grants is answered with a NAK (the initiator's remote access error)
and ends the connection.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Any, Protocol, cast

import structlog

from ...errors import PeerLost, TransportError
from ..base import Door, ErrorHandler, ImmediateHandler, RemoteRegion, Responder
from .frames import FLAG_IMM, FLAG_SIGNALED, TOKEN_BYTES, Op, encode_answer
from .keys import LeaseKeys
from .socket_options import tune
from .write_receiver import WriteReceiver

log = structlog.get_logger("kvwired.transport.tcp")


class Listener(Protocol):
    """The transport, as a responder and its connections see it."""

    per_lease_keys: bool
    door: Door | None

    @property
    def memory_view(self) -> memoryview: ...

    @property
    def region(self) -> RemoteRegion: ...

    @property
    def listening(self) -> bool: ...

    @property
    def port(self) -> int: ...

    async def listen(self) -> None: ...

    def check_access(self, key: int, offset: int, length: int) -> None: ...

    def expect(self, token: bytes, responder: TcpResponder) -> None: ...

    def claim(self, token: bytes) -> TcpResponder | None: ...

    def forget(self, token: bytes) -> None: ...


class ResponderProtocol(asyncio.BufferedProtocol):
    """One incoming data connection: its token, then its writes."""

    def __init__(self, owner: Listener) -> None:
        self._owner = owner
        # Before the token: room for the token alone, whatever the peer sends.
        self._token = bytearray(TOKEN_BYTES)
        self._token_got = 0
        self._writes: WriteReceiver | None = None
        self._responder: TcpResponder | None = None
        self._transport: asyncio.Transport | None = None
        self._address = "?"
        self._admitted = False  # counted by the door until bound or gone
        self._refused = False  # refused and counted already
        self._expiry: asyncio.TimerHandle | None = None
        # What waits for the write landing in place to end (a revocation:
        # its bytes must not land after the slot is reused).
        self._after_direct: list[Callable[[], None]] = []
        self._refused_told = False  # a refused write's NAK is sent once

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        tune(transport.get_extra_info("socket"))
        peer = transport.get_extra_info("peername")
        self._address = f"{peer[0]}:{peer[1]}" if peer else "?"
        door = self._owner.door
        if door is None:
            return
        if not door.admit(self._address):
            self._refused = True
            self._transport.abort()
            return
        self._admitted = True
        self._expiry = asyncio.get_running_loop().call_later(door.timeout, self._expire)

    def _settle(self) -> None:
        if self._admitted:
            self._admitted = False
            assert self._owner.door is not None
            self._owner.door.settled()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _refuse(self, reason: str, detail: str) -> None:
        self._settle()
        self._refused = True
        if self._owner.door is not None:
            self._owner.door.refuse(self._address, reason, detail)
        else:
            log.warning("data connection refused", address=self._address, reason=reason,
                        detail=detail)
        if self._transport is not None:
            self._transport.abort()

    def _expire(self) -> None:
        self._expiry = None
        if self._responder is None and not self._refused:
            door = self._owner.door
            self._refuse("timeout", f"no session token within {door.timeout if door else 0:g} s")

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._writes is None:
            return memoryview(self._token)[self._token_got:]
        return self._writes.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self._writes is None:
            self._token_got += nbytes
            if self._token_got == TOKEN_BYTES:
                self._bind(bytes(self._token))
            return
        writes = self._writes
        try:
            events = writes.received(nbytes)
        except TransportError as exc:
            self._fail(exc)
            return
        if not events and writes.refusal is None:
            return  # the common call: part of a payload, or of a header
        if self._after_direct and writes.landing_under is None:
            self._run_after_direct()
        responder, transport = self._responder, self._transport
        assert responder is not None and transport is not None
        responder.writes_received += len(events)
        for flags, imm, wr_id in events:
            if flags & FLAG_SIGNALED:
                transport.write(encode_answer(Op.ACK, wr_id))
            if flags & FLAG_IMM:
                responder.on_immediate(imm)
        if (refusal := writes.refusal) is not None and not self._refused_told:
            self._refused_told = True
            log.warning("write refused", address=self._address, error=refusal.error.message)
            transport.write(encode_answer(Op.NAK, refusal.wr_id))
            transport.close()  # after the NAK is out
            responder.on_error(refusal.error)

    def when_write_under(self, key: int, then: Callable[[], None]) -> bool:
        """If a write under ``key`` is still landing, run ``then`` once it has."""
        if self._writes is None or self._writes.landing_under != key:
            return False
        self._after_direct.append(then)
        return True

    def _run_after_direct(self) -> None:
        waiting, self._after_direct = self._after_direct, []
        for then in waiting:
            then()

    def _bind(self, token: bytes) -> None:
        responder = self._owner.claim(token)
        if responder is None:
            self._refuse("bad_token", "a data connection presented no live session's token")
            return
        self._settle()
        self._responder = responder
        self._writes = WriteReceiver(self._owner.memory_view, responder.check_access)
        responder.attached(self)

    def _fail(self, exc: TransportError) -> None:
        log.warning("data connection failed", error=str(exc))
        if self._responder is not None:
            self._responder.on_error(exc)
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._run_after_direct()
        if self._responder is None and not self._refused and self._admitted:
            self._refuse("incomplete", f"closed before its token ({exc or 'end of stream'})")
        self._settle()
        if self._responder is not None:
            self._responder.on_error(
                PeerLost(f"incoming data connection closed ({exc or 'end of stream'})")
            )

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class TcpResponder(Responder):
    def __init__(
        self,
        owner: Listener,
        advertise_host: str,
        on_immediate: ImmediateHandler,
        on_error: ErrorHandler,
    ) -> None:
        self._owner = owner
        self._host = advertise_host
        self.on_immediate = on_immediate
        self._on_error = on_error
        # Every data connection that presented this session's token.
        self._protocols: list[ResponderProtocol] = []
        self._token = b""
        self._closed = False
        self._keys = LeaseKeys(owner.region.key)

    async def grant(self, offset: int, length: int) -> int:
        return self._keys.grant(offset, length)

    def revoke(self, key: int, then: Callable[[], None]) -> None:
        # Writes are checked as their headers are parsed, in this loop: once
        # the key is gone, no new write under it can land.
        self._keys.revoke(key)
        # A large write checked against the key before it was revoked may
        # still be landing in place: the slot is free once it has.
        if any(protocol.when_write_under(key, then) for protocol in self._protocols):
            return
        then()

    def check_access(self, key: int, offset: int, length: int) -> None:
        if not self._owner.per_lease_keys:
            self._owner.check_access(key, offset, length)
            return
        self._keys.check(key, offset, length)

    async def accept(self, offer: dict[str, Any]) -> dict[str, Any]:
        if not self._owner.listening:
            await self._owner.listen()  # a sender answering an echo channel
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._owner.expect(self._token, self)
        return {"host": self._host, "port": self._owner.port, "token": self._token,
                "region": self._owner.region.to_wire()}

    def attached(self, protocol: ResponderProtocol) -> None:
        self._protocols.append(protocol)

    def on_error(self, exc: Exception) -> None:
        if not self._closed:
            self._closed = True
            self._on_error(exc)

    def close(self) -> None:
        self._closed = True
        self._keys.clear()
        self._owner.forget(self._token)
        for protocol in self._protocols:
            protocol.close()
