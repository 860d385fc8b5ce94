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
leaves. ``served`` is the sender's side of that exchange, for perftest (in
the chunk sweep) and for the socket loop (``measure_socket_loop``, and the
``socket-loop`` experiment, ``run_socket_loop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from .. import analysis, immediate
from ..addresses import control_address, free_port
from ..errors import ConfigError, ExperimentFailed, KvwireError, UsageError
from ..ports import PeerHandle, ReceiverHost, Report, SenderHost, SessionHandle
from ..protocol import Message
from ..protocol import control as ctl
from ..protocol import sender_local as local
from ..rdma import pick_gid
from ..units import format_size, parse_size
from . import perftest, socket_loop

log = structlog.get_logger("kvwired.experiments.baseline")

SOCKET = "socket"
# How long a server waits for its client before giving up on its own.
SERVER_LINGER = 120.0
# How long a server may take to exit once its client is done before it is stopped.
SERVER_EXIT_GRACE = 5.0
# The socket loop receives into one buffer of the whole payload: bounded, so
# a sender cannot make the receiver allocate what it likes.
SOCKET_LOOP_MAX_BYTES = 256 << 20


# --------------------------------------------------------- receiver side


class BaselineService:
    """A ``ReceiverService``: the server half of one measurement per ``baseline``."""

    messages: tuple[type[Message], ...] = (ctl.Baseline, ctl.BaselineStop)

    def __init__(self) -> None:
        self._host: ReceiverHost | None = None
        # req -> (the session that asked, how to stop its server)
        self._servers: dict[str, tuple[SessionHandle, Callable[[], None]]] = {}

    def bind(self, receiver: ReceiverHost) -> None:
        self._host = receiver

    def handle(self, session: SessionHandle, msg: Message) -> None:
        if isinstance(msg, ctl.Baseline):
            serve = self._serve_socket if msg.tool == SOCKET else self._serve_perftest
            session.tasks.spawn(serve(session, msg), f"baseline-{msg.req}")
        elif isinstance(msg, ctl.BaselineStop):
            entry = self._servers.get(msg.req)
            if entry is not None and entry[0] is session:
                asyncio.get_running_loop().call_later(SERVER_EXIT_GRACE, entry[1])

    def on_immediate(self, session: SessionHandle, lease_id: int,
                     layer: int) -> immediate.Taken:
        return immediate.Taken.NOT_OURS

    def session_closed(self, session: SessionHandle) -> None:
        for owner, stop in list(self._servers.values()):
            if owner is session:
                stop()

    async def _serve_perftest(self, session: SessionHandle, msg: ctl.Baseline) -> None:
        req = msg.req
        assert self._host is not None, "service not bound to a receiver"
        cfg = self._host.config
        try:
            if msg.tool not in perftest.TOOLS:
                raise UsageError(f"unknown baseline tool {msg.tool!r}",
                                 hint=f"use one of {', '.join((*perftest.TOOLS, SOCKET))}")
            if self._host.transport.name != "verbs":
                raise ExperimentFailed(
                    "the perftest baseline needs RDMA; this receiver runs over tcp",
                    hint="run the daemons with transport = verbs, or use the socket baseline")
            gid = pick_gid(session.conn.local_host, cfg.rdma_device, cfg.gid_index)
            port = free_port("")
            proc = await perftest.start_server(
                perftest.command(msg.tool, gid, msg.size, msg.iters, port), port)
        except KvwireError as exc:
            session.conn.send(ctl.Refused(req=req, error=exc.to_wire()))
            return
        self._servers[req] = (session, lambda: perftest.kill(proc))
        session.conn.send(ctl.BaselineReady(req=req, port=port))
        try:
            await asyncio.wait_for(proc.wait(), SERVER_LINGER)
        except TimeoutError:
            perftest.kill(proc)
        finally:
            self._servers.pop(req, None)

    async def _serve_socket(self, session: SessionHandle, msg: ctl.Baseline) -> None:
        req = msg.req
        try:
            spec = socket_loop.LoopSpec(msg.size, msg.iters, rounds=1)
            if not 1 <= spec.total <= SOCKET_LOOP_MAX_BYTES or spec.size < 1:
                raise UsageError(
                    f"a socket-loop baseline of {spec.chunks} x {spec.size} B is outside "
                    f"1 B..{format_size(SOCKET_LOOP_MAX_BYTES)}")
            server = socket_loop.LoopServer(session.conn.local_host, spec.total)
        except (KvwireError, OSError) as exc:
            error = exc if isinstance(exc, KvwireError) else ExperimentFailed(
                f"cannot listen for the socket-loop baseline: {exc}")
            session.conn.send(ctl.Refused(req=req, error=error.to_wire()))
            return
        self._servers[req] = (session, server.stop)
        session.conn.send(ctl.BaselineReady(req=req, port=server.port))
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


# ----------------------------------------------------------- sender side


@contextlib.asynccontextmanager
async def served(link: PeerHandle, req: str, tool: str, size: int,
                 iters: int) -> AsyncIterator[tuple[str, int]]:
    """The receiver of ``link`` serving one run of ``tool``: the host and port
    to run the client against. The receiver hears ``baseline_stop`` after."""
    ready = await link.request(
        ctl.Baseline(req=req, tool=tool, size=size, iters=iters), ctl.BaselineReady,
        undo=lambda answer: ctl.BaselineStop(req=answer.req))
    try:
        yield control_address(link.address)[0], ready.port
    finally:
        link.send(ctl.BaselineStop(req=req))


async def measure_socket_loop(link: PeerHandle, req: str,
                              spec: socket_loop.LoopSpec) -> list[float]:
    """One socket-loop measurement against ``link``'s receiver: seconds per round."""
    await link.ensure()
    async with served(link, req, SOCKET, spec.size, spec.chunks) as (host, port):
        return await asyncio.to_thread(socket_loop.send, host, port, spec)


@dataclass(frozen=True)
class LoopParams:
    """What ``kvctl`` asks of the ``socket-loop`` experiment."""

    peer: str
    sizes: tuple[int, ...]
    total: int = 48 << 20
    rounds: int = 3

    @classmethod
    def from_wire(cls, params: dict[str, Any]) -> LoopParams:
        try:
            built = cls(peer=str(params.get("peer") or ""),
                        sizes=tuple(parse_size(s) for s in params["sizes"]),
                        total=parse_size(params.get("bytes", cls.total)),
                        rounds=int(params.get("rounds", cls.rounds)))
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise UsageError(f"bad socket-loop parameters: {exc}") from exc
        if not built.sizes or any(s < 1 or built.total % s for s in built.sizes):
            raise UsageError("socket-loop sizes must be positive and divide the payload",
                             hint=f"the payload is {format_size(built.total)}")
        if not 1 <= built.rounds <= 100:
            raise UsageError("socket-loop rounds must be 1 to 100")
        return built


async def run_socket_loop(daemon: SenderHost, req: str, params: dict[str, Any],
                          report: Report) -> dict[str, Any]:
    """``socket-loop``: the plain loop at each size, ``rounds`` times, against a receiver."""
    loop = LoopParams.from_wire(params)
    link = daemon.link(loop.peer)
    rows = []
    for size in loop.sizes:
        spec = socket_loop.LoopSpec(size, loop.total // size, loop.rounds)
        seconds = await measure_socket_loop(link, f"{req}-{size}", spec)
        median = statistics.median(seconds)
        row = {"size": size, "bytes": spec.total, "seconds": seconds,
               "median_seconds": median, "gbps": analysis.gbps(spec.total, median)}
        rows.append(row)
        report(local.Row(req=req, row=row))
        log.info("socket loop measured", peer=link.name, size=size,
                 median_ms=round(median * 1e3, 2))
    return {"peer": link.name, "sender": daemon.config.name, "bytes": loop.total,
            "rounds": loop.rounds, "rows": rows}
