"""Dialling a receiver: TCP, TLS, the hello/welcome handshake and its identity.

``connect`` returns the control connection with the receiver's typed
``welcome``, or raises what went wrong in words a user can act on: nobody
listening, a port that takes connections but never answers TLS, a
certificate from another CA or expired, or a receiver that is not the one
configured under this name.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import TypeVar

from ..addresses import control_address
from ..config import SenderConfig
from ..control import ControlConnection
from ..errors import AuthenticationFailed, PeerLost, ProtocolError, from_wire
from ..protocol import Error, Message
from ..protocol import control as ctl
from ..trust import Trust

A = TypeVar("A", bound=Message)


async def connect(peer: str, address: str, config: SenderConfig, transport: str,
                  trust: Trust | None) -> tuple[ControlConnection, ctl.Welcome]:
    """The control connection to receiver ``peer`` at ``address``, handshaken."""
    host, port = control_address(address)
    reader, writer = await dial(peer, host, port, trust, config.connect_timeout)
    conn = ControlConnection(reader, writer, config.heartbeat, f"receiver {peer}")
    try:
        conn.send(ctl.Hello(role="sender", name=config.name, transports=[transport]))
        welcome = await expect(conn, ctl.Welcome, peer, config.connect_timeout)
        check_identity(conn, trust, peer, address, welcome.name)
    except BaseException:
        conn.close()
        raise
    return conn, welcome


async def dial(peer: str, host: str, port: int, trust: Trust | None, timeout: float
               ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The TCP connection, then its TLS handshake: two steps, so that a port
    that takes connections and never answers TLS is told apart from one that
    cannot be reached, each within ``timeout``."""
    where = f"receiver {peer} at {host}:{port}"
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError) as exc:
        raise PeerLost(
            f"cannot reach {where}: "
            f"{getattr(exc, 'strerror', None) or f'no answer within {timeout:g} s'}",
            hint="is kvwired receiver running there, and is the port reachable?",
        ) from exc
    if trust is None:
        return reader, writer
    try:
        await asyncio.wait_for(writer.start_tls(trust.client, server_hostname=host), timeout)
    except ssl.SSLError as exc:
        writer.close()
        verify = str(getattr(exc, "verify_message", "") or "")
        raise AuthenticationFailed(
            f"{where} failed the TLS handshake: {verify or exc.reason or exc}",
            hint=("a certificate in the handshake has expired: reissue it with `kvctl "
                  "keys issue` and send SIGHUP to the daemon that holds it"
                  if "expired" in verify else
                  "its certificate must come from this cluster's CA and be a receiver's; "
                  "a receiver with auth = \"none\" fails this way too")) from exc
    except TimeoutError as exc:
        writer.close()
        raise PeerLost(
            f"{where} took the connection but completed no TLS handshake within "
            f"{timeout:g} s",
            hint="is a kvwire receiver with auth = \"tls\" on that port? Another service "
                 "there, or an overloaded receiver, answers this way") from exc
    except OSError as exc:
        writer.close()
        raise PeerLost(f"{where} closed the connection during the TLS handshake: "
                       f"{exc.strerror or exc}",
                       hint="its log says why (kvwire_auth_failures_total counts it)"
                       ) from exc
    return reader, writer


async def expect(conn: ControlConnection, kind: type[A], peer: str, timeout: float) -> A:
    """The receiver's next message, which must be a ``kind`` (an ``error`` raises it)."""
    msg = await conn.recv(timeout)
    if isinstance(msg, Error):
        raise from_wire(msg.error)
    if not isinstance(msg, kind):
        raise ProtocolError(f"receiver {peer} sent {msg.kind!r}, expected {kind.kind!r}")
    return msg


def check_identity(conn: ControlConnection, trust: Trust | None, peer: str, address: str,
                   claimed: str) -> None:
    """The receiver at the address must be the one configured under this name:
    a mis-wired address must not receive another receiver's KV cache."""
    if trust is None:
        return
    certified = conn.certified_name
    if certified != peer or claimed != certified:
        raise AuthenticationFailed(
            f"the receiver at {address} is {certified!r} by its certificate "
            f"(it says {claimed!r}), not {peer!r}",
            hint="name each peer in [peers] as its receiver's certificate does, and "
                 "check the address")
