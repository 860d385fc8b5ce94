"""The systemd notification protocol (sd_notify), without libsystemd.

Under ``Type=notify`` systemd hands the service a datagram socket in
``NOTIFY_SOCKET``; the daemon sends ``READY=1`` once it can serve,
``STATUS=...`` lines that ``systemctl status`` shows, ``STOPPING=1`` when it
begins to shut down, and, with ``WatchdogSec=``, ``WATCHDOG=1`` at least every
``WATCHDOG_USEC``. The keep-alives come from a task on the daemon's event
loop, so a loop that stops turning stops them, and systemd restarts the
daemon. Outside systemd every call does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import structlog

log = structlog.get_logger("kvwired.systemd")


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # An address starting with "@" is in the abstract namespace.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket: socket.socket | None = None
        if self._address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watched = usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_seconds = int(usec) / 1e6 if watched else 0.0

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, *lines: str) -> None:
        if self._socket is None:
            return
        try:
            self._socket.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:  # systemd gone or the socket full: never fatal
            log.warning("systemd notification failed", error=str(exc))

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    async def keep_alive(self) -> None:
        """Send WATCHDOG=1 at half the interval systemd expects, for ever."""
        if not self.watchdog_seconds:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_seconds / 2)

    def close(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
            self._socket = None
