"""The receiver's half of a baseline: the other program on the same link.

A sender running an experiment asks for one with ``baseline`` on the control
connection (``tool``, ``size``, ``iters``); the receiver starts the server
side and answers ``baseline_ready`` with its port, and the sender runs the
client side against it:

- ``ib_write_lat``/``ib_write_bw`` (``kvwired.experiments.perftest``): the
  RDMA baseline, over the device and GID the receiver's data path uses;
- ``socket`` (``kvwired.experiments.socket_loop``): a plain socket loop, the
  TCP transport's baseline.

``baseline_stop`` says the client is done: a server that has not exited by
itself a moment later is stopped, and so is every server of a sender that
leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from ..config import free_port
from ..errors import ExperimentFailed, KvwireError, UsageError
from ..protocol import Message, message
from ..rdma import pick_gid
from ..tasks import spawn
from ..units import format_size
from . import perftest, socket_loop
from .host import ReceiverHost, SessionHandle

log = structlog.get_logger("kvwired.experiments.baseline")

SOCKET = "socket"
# How long a server waits for its client before giving up on its own.
SERVER_LINGER = 120.0
# How long a server may take to exit once its client is done before it is stopped.
SERVER_EXIT_GRACE = 5.0
# The socket loop receives into one buffer of the whole payload: bounded, so
# a sender cannot make the receiver allocate what it likes.
SOCKET_LOOP_MAX_BYTES = 256 << 20


class BaselineService:
    """A ``ReceiverService``: the server half of one measurement per ``baseline``."""

    messages = frozenset({"baseline", "baseline_stop"})

    def __init__(self) -> None:
        self._host: ReceiverHost | None = None
        # req -> (the session that asked, how to stop its server)
        self._servers: dict[str, tuple[SessionHandle, Callable[[], None]]] = {}

    def bind(self, receiver: ReceiverHost) -> None:
        self._host = receiver

    def handle(self, session: SessionHandle, msg: Message) -> None:
        if msg["t"] == "baseline":
            serve = self._serve_socket if msg["tool"] == SOCKET else self._serve_perftest
            spawn(serve(session, msg), f"baseline-{msg['req']}")
            return
        entry = self._servers.get(msg["req"])
        if entry is not None and entry[0] is session:
            asyncio.get_running_loop().call_later(SERVER_EXIT_GRACE, entry[1])

    def on_immediate(self, session: SessionHandle, lease_id: int, layer: int) -> bool:
        return False

    def session_closed(self, session: SessionHandle) -> None:
        for owner, stop in list(self._servers.values()):
            if owner is session:
                stop()

    async def _serve_perftest(self, session: SessionHandle, msg: Message) -> None:
        req = msg["req"]
        assert self._host is not None, "service not bound to a receiver"
        cfg = self._host.config
        try:
            if msg["tool"] not in perftest.TOOLS:
                raise UsageError(f"unknown baseline tool {msg['tool']!r}",
                                 hint=f"use one of {', '.join((*perftest.TOOLS, SOCKET))}")
            if self._host.transport.name != "verbs":
                raise ExperimentFailed(
                    "the perftest baseline needs RDMA; this receiver runs over tcp",
                    hint="run the daemons with transport = verbs, or use the socket baseline")
            gid = pick_gid(session.conn.local_host, cfg.rdma_device, cfg.gid_index)
            port = free_port("")
            proc = await perftest.start_server(
                perftest.command(msg["tool"], gid, msg["size"], msg["iters"], port))
        except KvwireError as exc:
            session.conn.send(message("refused", req=req, error=exc.to_wire()))
            return
        self._servers[req] = (session, lambda: perftest.kill(proc))
        session.conn.send(message("baseline_ready", req=req, port=port))
        try:
            await asyncio.wait_for(proc.wait(), SERVER_LINGER)
        except TimeoutError:
            perftest.kill(proc)
        finally:
            self._servers.pop(req, None)

    async def _serve_socket(self, session: SessionHandle, msg: Message) -> None:
        req = msg["req"]
        try:
            spec = socket_loop.LoopSpec(msg["size"], msg["iters"], rounds=1)
            if not 1 <= spec.total <= SOCKET_LOOP_MAX_BYTES or spec.size < 1:
                raise UsageError(
                    f"a socket-loop baseline of {spec.chunks} x {spec.size} B is outside "
                    f"1 B..{format_size(SOCKET_LOOP_MAX_BYTES)}")
            server = socket_loop.LoopServer(session.conn.local_host, spec.total)
        except (KvwireError, OSError) as exc:
            error = exc if isinstance(exc, KvwireError) else ExperimentFailed(
                f"cannot listen for the socket-loop baseline: {exc}")
            session.conn.send(message("refused", req=req, error=error.to_wire()))
            return
        self._servers[req] = (session, server.stop)
        session.conn.send(message("baseline_ready", req=req, port=server.port))
        try:
            rounds = await asyncio.wait_for(asyncio.to_thread(server.run), SERVER_LINGER)
            log.info("socket-loop baseline served", req=req, rounds=rounds,
                     bytes=spec.total, chunk=spec.size)
        except (TimeoutError, OSError) as exc:
            server.stop()
            log.warning("socket-loop baseline ended early", req=req, error=str(exc))
        finally:
            self._servers.pop(req, None)
            with contextlib.suppress(OSError):
                server.stop()
