"""Local unix-socket APIs: the handshake that hands a pool's fd to an engine.

The daemon answers a client's ``hello`` with a ``welcome`` frame carrying
the pool's memfd as SCM_RIGHTS ancillary data; after that the connection is
an ordinary stream of frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from .errors import DaemonUnavailable, InvalidRequest, KvwireError, ProtocolError, from_wire
from .protocol import (
    MAX_FRAME,
    Channel,
    Error,
    Failed,
    FrameDecoder,
    LocalHello,
    Message,
    encode,
    error_message,
)
from .protocol import receiver_local as decode_api
from .protocol import sender_local as prefill_api
from .stream import MessageStream

# A daemon's answer to an engine's hello: its pool's size (and, a sender's, its peers).
Welcome = prefill_api.Welcome | decode_api.Welcome

log = structlog.get_logger("kvwired.local")

ClientHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def send_with_fd(writer: asyncio.StreamWriter, msg: Message, fd: int) -> None:
    """Send one frame with ``fd`` attached (the stream's buffer must be empty)."""
    transport_socket = writer.get_extra_info("socket")
    # asyncio exposes no sendmsg on its sockets; a dup of the descriptor
    # shares the connection. It stays non-blocking, and a first small frame
    # on an empty socket buffer is always taken whole.
    with socket.socket(fileno=os.dup(transport_socket.fileno())) as raw:
        sent = socket.send_fds(raw, [encode(msg)], [fd])
    if sent != len(encode(msg)):
        raise ProtocolError("the welcome frame was cut short by the socket")


HELLO_TIMEOUT = 10.0
CONNECT_PATIENCE = 10.0  # seconds a client retries a full backlog
BACKLOG = 1024  # engines connecting at once (the kernel caps it at somaxconn)


async def local_session(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    channel: Channel,
    welcome: Message,
    fd: int,
    dispatch: Callable[[Message], object],
) -> None:
    """A daemon's side of one engine connection.

    Handshake (``hello`` -> ``welcome`` with the pool fd), then every frame to
    ``dispatch`` until the engine leaves. Raises ``KvwireError`` on a
    protocol violation; returns quietly when the engine closes, including
    one that connected and left without a word (a readiness probe).
    """
    stream = MessageStream(reader, writer, channel)
    try:
        hello = await asyncio.wait_for(stream.receive(), HELLO_TIMEOUT)
    except TimeoutError:
        raise ProtocolError(f"no hello within {HELLO_TIMEOUT:g} s") from None
    if hello is None:
        return
    if not isinstance(hello, LocalHello):
        raise ProtocolError(f"expected hello, got {hello.kind!r}")
    send_with_fd(writer, welcome, fd)
    while True:
        try:
            msg = await stream.receive()
        except InvalidRequest as exc:
            # That request fails; the engine's connection and its other work go on.
            log.info("request refused: invalid fields", req=exc.req, reason=exc.message)
            stream.send(Failed(req=exc.req, error=exc.to_wire()))
            continue
        if msg is None:
            return
        dispatch(msg)


def reject(writer: asyncio.StreamWriter, error: KvwireError) -> None:
    """Tell a local client why it is being cut off (best effort)."""
    with contextlib.suppress(Exception):
        writer.write(encode(error_message(error)))


async def serve_unix(path: str, handler: ClientHandler) -> asyncio.AbstractServer:
    """Listen on ``path`` (replacing a stale socket file, refusing anything else)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise DaemonUnavailable(
                f"{path} exists and is not a socket", hint="choose another socket path"
            )
        if accepts(path):
            raise DaemonUnavailable(
                f"another daemon is already listening on {path}",
                hint="stop it first, or give this one another socket path",
            )
        target.unlink()
    server = await asyncio.start_unix_server(handler, path, backlog=BACKLOG)
    os.chmod(path, 0o660)
    return server


def accepts(path: str) -> bool:
    """Whether something listens on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


def _connect_through_a_burst(sock: socket.socket, path: str) -> None:
    """Connect, retrying while the daemon's listen backlog is full.

    A unix socket whose backlog is full refuses a connect with EAGAIN at once
    (it does not wait as TCP would): a burst of engines starting together
    can meet that. Retried with backoff up to CONNECT_PATIENCE seconds.
    """
    deadline = time.monotonic() + CONNECT_PATIENCE
    pause = 0.005
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError as exc:
            if time.monotonic() + pause > deadline:
                raise DaemonUnavailable(
                    f"the kvwire daemon at {path} did not accept a connection for "
                    f"{CONNECT_PATIENCE:g} s: its backlog stayed full",
                    hint="it is taking a burst of engines; retry, or start engines in "
                         "smaller waves") from exc
            time.sleep(pause)
            pause = min(pause * 2, 0.25)
        except OSError as exc:
            raise DaemonUnavailable(
                f"cannot reach the kvwire daemon at {path}: {exc.strerror or exc}",
                hint="is the daemon running, and may this user open its socket?",
            ) from exc


def _handshake(path: str, role: str,
               channel: Channel) -> tuple[socket.socket, Welcome, int, FrameDecoder]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.settimeout(10)
        _connect_through_a_burst(sock, path)
        sock.sendall(encode(LocalHello(role=role)))
        decoder = FrameDecoder(channel)
        # The welcome's first bytes carry the pool fd; whatever follows it in
        # the stream stays in the decoder, which the async side takes over.
        data, fds, _, _ = socket.recv_fds(sock, MAX_FRAME + 4, 1)
        while True:
            if not data:
                decoder.end_of_stream()
                raise DaemonUnavailable(f"the daemon at {path} closed the connection at once")
            decoder.feed(data)
            if (msg := decoder.next_message()) is not None:
                break
            data = sock.recv(MAX_FRAME + 4)
        if isinstance(msg, Error):
            raise from_wire(msg.error)
        if not isinstance(msg, Welcome) or len(fds) != 1:
            raise ProtocolError(f"expected a welcome with the pool fd, got {msg.kind!r}")
        sock.settimeout(None)
        sock.setblocking(False)
        return sock, msg, fds[0], decoder
    except OSError as exc:
        # Accepted, then gone mid-handshake (the daemon killed, or timed out).
        for fd in fds:
            os.close(fd)
        sock.close()
        raise DaemonUnavailable(
            f"the daemon at {path} broke off the handshake: {exc.strerror or exc}",
            hint="is it stopping or restarting? its log says why") from exc
    except BaseException:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise


async def connect_local(path: str, role: str,
                        channel: Channel) -> tuple[MessageStream, Welcome, int]:
    """Connect to a daemon's unix socket: (message stream, welcome, pool fd)."""
    sock, welcome, fd, decoder = await asyncio.to_thread(_handshake, path, role, channel)
    try:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        os.close(fd)
        sock.close()
        raise
    return MessageStream(reader, writer, channel, decoder), welcome, fd


def close_quietly(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()
