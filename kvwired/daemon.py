"""What both daemons share: serving, readiness, draining, stopping, reloading.

``Daemon`` is the base of the receiver and the sender; ``run`` carries one
through its life under systemd or in a terminal. Under systemd
(Type=notify) a daemon reports READY=1 once serving, STATUS= lines and
STOPPING=1, and the watchdog is fed from the same event loop as the data
path, so a keep-alive proves the loop turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar, Protocol

import structlog

from .addresses import parse_address
from .config import CommonConfig
from .discovery.presence import Presence
from .errors import KvwireError
from .localsock import ClientHandler, close_quietly, local_session, reject, serve_unix
from .metrics import LiveSample, Metrics
from .pool import Pool
from .protocol import Channel, Message
from .systemd import Notifier
from .tasks import TaskSet
from .trust import Trust

log = structlog.get_logger("kvwired")

STATUS_EVERY = 10.0  # seconds between STATUS= updates to systemd



class Server(Protocol):
    """A listener the daemon closes when it drains or stops."""

    def close(self) -> None: ...


class Daemon(ABC):
    """One daemon process: its config, metrics, listeners and drain."""

    role: ClassVar[str]

    def __init__(self, config: CommonConfig, socket_path: str) -> None:
        self.config = config
        self.socket_path = socket_path
        self.metrics = Metrics(self.role)
        self.metrics.live.sources.append(self.live_metrics)
        self.metrics.live.sources.append(self._loop_samples)
        self.loop: asyncio.AbstractEventLoop | None = None  # once serving
        self.metrics_port = 0
        self.draining = False
        self._servers: list[Server] = []
        self._local_server: asyncio.AbstractServer | None = None
        self.trust: Trust | None = None
        self._load_trust()
        self.presence: Presence | None = None  # in the registry (discovery) or not
        # What the daemon itself started (not a session's or a link's own).
        self.tasks = TaskSet(self.role)
        # Set whenever in-flight work may have ended: a drain waits on it.
        self._work_ended = asyncio.Event()
        self._pools: list[Pool] = []  # freed last by stop(), once peers are gone

    def _load_trust(self) -> None:
        """The credentials, before any port opens (``auth = "none"``: none, loudly)."""
        if self.config.auth == "none":
            log.warning("authentication is off", role=self.role,
                        risk="anyone who reaches this daemon's ports can lease and write "
                             "its pool", hint="set auth = \"tls\" with `kvctl keys` "
                                              "credentials")
            return
        self.trust = Trust(self.config.tls_dir, self.config.name)
        self.metrics.certificate_expiry.set(self.trust.expires_at)

    # ------------------------------------------------------ for subclasses

    @abstractmethod
    async def start(self) -> None:
        """Pools, transport, listeners; ``serve_local`` last (readiness)."""

    @abstractmethod
    def in_flight(self) -> int:
        """Requests a drain waits for; each one's end calls ``work_ended``."""

    def work_ended(self) -> None:
        """A request counted by ``in_flight`` has ended: a drain looks again."""
        self._work_ended.set()

    @abstractmethod
    def status_line(self) -> str: ...

    @abstractmethod
    def live_metrics(self) -> Iterator[LiveSample]:
        """Gauges read at scrape time."""

    def _loop_samples(self) -> Iterator[LiveSample]:
        """The event loop's live tasks: what a soak watches for growth per
        session or request (read from the metrics thread; ``all_tasks`` copies
        its set, retrying if the loop changes it meanwhile)."""
        if self.loop is not None:
            yield ("kvwire_event_loop_tasks", "asyncio tasks alive in the daemon's event loop",
                   [], [], float(len(asyncio.all_tasks(self.loop))))

    @abstractmethod
    def stop_accepting(self) -> None:
        """Refuse new work: close the listeners a drain closes."""

    @abstractmethod
    async def say_goodbye(self) -> None:
        """Tell every peer this daemon is stopping, and drop the connections."""

    def reload(self, fresh: CommonConfig) -> None:
        """Apply a re-read configuration (SIGHUP)."""
        log.info("SIGHUP: nothing to reload", role=self.role,
                 hint="the receiver's settings take effect on restart")

    # ------------------------------------------------------------- shared

    def join_registry(self, presence: Presence) -> None:
        self.presence = presence
        self.metrics.live.sources.append(presence.samples)
        presence.start()

    def leave_registry(self) -> None:
        """A receiver's record goes as it stops taking senders (a drain)."""
        if self.presence is not None:
            self.tasks.spawn(self.presence.leave(), "registry-leave")

    def own(self, pool: Pool) -> Pool:
        """``pool`` goes back to the system when the daemon stops: a daemon run
        in-process (tests, benchmarks) frees its memory, not only one that exits."""
        self._pools.append(pool)
        return pool

    def serve_metrics(self) -> None:
        self.metrics_port = self.metrics.serve(*parse_address(self.config.metrics, 0))

    def add_server(self, server: Server) -> None:
        self._servers.append(server)

    async def serve_local(self, handler: ClientHandler) -> None:
        """The unix socket for engines. It comes last: once it accepts, the
        daemon is ready (pools, transport and listeners are up)."""
        self.loop = asyncio.get_running_loop()
        self._local_server = await serve_unix(self.socket_path, handler)
        self._servers.append(self._local_server)

    async def serve_engine(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           channel: Channel, welcome: Message, fd: int,
                           dispatch: Callable[[Message], object], who: str) -> None:
        """One local engine's session: counted, served, and told why if cut off."""
        self.metrics.clients.inc()
        try:
            await local_session(reader, writer, channel, welcome, fd, dispatch)
        except KvwireError as exc:
            self.metrics.protocol_errors.labels(f"{self.role}_local").inc()
            log.warning(f"{who} connection rejected", error=str(exc))
            reject(writer, exc)
        except (ConnectionError, OSError):
            pass  # the engine left mid-frame: its session ends like a clean close
        finally:
            self.metrics.clients.dec()
            close_quietly(writer)

    async def drain(self, timeout: float) -> int:
        """Refuse new work; let what is in flight finish within ``timeout``.

        Returns how much was still in flight when the time ran out (it fails
        when the daemon stops).
        """
        self.draining = True
        self.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight() and (remaining := deadline - loop.time()) > 0:
            self._work_ended.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._work_ended.wait()
        left = self.in_flight()
        if left:
            log.warning("drain timed out", role=self.role, in_flight=left, timeout=timeout)
        return left

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        if self.presence is not None:
            await self.presence.close()
        await self.say_goodbye()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        for pool in self._pools:
            pool.close()


async def run(daemon: Daemon, reload_config: Callable[[], CommonConfig] | None = None) -> None:
    """Run ``daemon`` until SIGTERM/SIGINT, then drain it and stop.

    SIGHUP re-reads the configuration through ``reload_config`` and hands it
    to the daemon.
    """
    config = daemon.config
    notifier = Notifier()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(daemon, reload_config, notifier))
    try:
        await daemon.start()
    except BaseException:
        notifier.notify("STATUS=failed to start")
        raise
    notifier.ready(daemon.status_line())
    background = [daemon.tasks.spawn(notifier.keep_alive(), "watchdog"),
                  daemon.tasks.spawn(_report_status(daemon, notifier), "status")]
    await stop.wait()
    log.info("stopping", role=daemon.role, drain_timeout=config.drain_timeout)
    notifier.stopping(f"draining: up to {config.drain_timeout:g} s for requests in flight")
    left = await daemon.drain(config.drain_timeout)
    notifier.stopping("stopping" + (f": {left} requests failed by the drain timeout"
                                    if left else ""))
    for task in background:
        task.cancel()
    await daemon.stop()
    log.info("stopped", role=daemon.role, unfinished=left)
    notifier.close()


async def _report_status(daemon: Daemon, notifier: Notifier) -> None:
    while True:
        await asyncio.sleep(STATUS_EVERY)
        notifier.status(daemon.status_line())


def _reload(daemon: Daemon, reload_config: Callable[[], CommonConfig] | None,
            notifier: Notifier) -> None:
    if daemon.trust is not None:
        # New handshakes use what is on disk now; sessions already up stay.
        daemon.trust.reload()
        daemon.metrics.certificate_expiry.set(daemon.trust.expires_at)
    if reload_config is None:
        daemon.reload(daemon.config)
        return
    notifier.notify("RELOADING=1")
    try:
        daemon.reload(reload_config())
    except KvwireError as exc:
        log.error("SIGHUP: configuration not reloaded", error=exc.message, hint=exc.hint)
    finally:
        notifier.notify("READY=1", f"STATUS={daemon.status_line()}")
