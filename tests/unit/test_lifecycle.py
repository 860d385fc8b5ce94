"""The daemons' life cycle as a service manager sees it, with the daemons as
real processes: sd_notify readiness, STATUS and watchdog keep-alives,
SIGTERM draining requests in flight, SIGHUP reloading the sender's peers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.keys import with_credentials
from kvctl.netns import write_toml
from kvwired.addresses import free_port
from kvwired.client import SenderClient
from kvwired.errors import RequestRefused, UnknownPeer
from kvwired.layout import RequestShape
from kvwired.systemd import Notifier


class Daemon:
    """``kvwired ROLE --config FILE`` with a notify socket of its own."""

    def __init__(self, tmp: Path, role: str, config: dict[str, Any],
                 watchdog_usec: int = 0) -> None:
        config = with_credentials(config, role, tmp / "tls")
        self.role, self.config = role, config
        self.path = tmp / f"{config['name']}.toml"
        write_toml(self.path, config)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify_path = tmp / f"{config['name']}.notify"
        self.notify.bind(str(self.notify_path))
        self.notify.settimeout(0.2)
        env = dict(os.environ, NOTIFY_SOCKET=str(self.notify_path))
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        self.log = (tmp / f"{config['name']}.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvwired", role, "--config", str(self.path)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.messages: list[str] = []

    def receive(self, timeout: float) -> list[str]:
        """Notifications until ``timeout`` passes with none new."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.messages.append(self.notify.recv(4096).decode())
            except TimeoutError:
                continue
        return self.messages

    def wait_for(self, line: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in self.messages:
                if line in msg.splitlines():
                    return msg
            with contextlib.suppress(TimeoutError):
                self.messages.append(self.notify.recv(4096).decode())
        raise AssertionError(f"no {line} from {self.role} within {timeout} s: {self.messages}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self.notify.close()
        self.log.close()
        return code


def _wait_for_log(daemon: Daemon, text: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in Path(daemon.log.name).read_text():
        assert time.monotonic() < deadline, f"{text!r} not in the {daemon.role} log"
        time.sleep(0.05)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[dict[str, Daemon]]:
    started: dict[str, Daemon] = {}
    ports = {"decode": free_port(), "decode2": free_port()}
    for name in ("decode", "decode2"):
        started[name] = Daemon(tmp_path, "receiver", {
            "name": name, "transport": "tcp", "listen": f"127.0.0.1:{ports[name]}",
            "data_port": 0, "socket": str(tmp_path / f"{name}.sock"), "metrics": "127.0.0.1:0",
            "pool_size": "32MiB"})
    started["prefill"] = Daemon(tmp_path, "sender", {
        "name": "prefill", "transport": "tcp", "socket": str(tmp_path / "prefill.sock"),
        "metrics": "127.0.0.1:0", "staging_size": "32MiB", "drain_timeout": 20.0,
        "peers": {"decode": f"127.0.0.1:{ports['decode']}"}}, watchdog_usec=300_000)
    for daemon in started.values():
        daemon.wait_for("READY=1")
    yield started
    for daemon in started.values():
        daemon.stop()


def test_ready_only_once_serving_then_status_and_watchdog(daemons: dict[str, Daemon]) -> None:
    sender = daemons["prefill"]
    ready = sender.wait_for("READY=1")
    assert f"MAINPID={sender.proc.pid}" in ready.splitlines()
    assert any(line.startswith("STATUS=ready: 0/1 receivers connected")
               for line in ready.splitlines())
    # READY came after the socket was bound: an engine can connect right away.
    assert Path(str(sender.config["socket"])).exists()
    pings = [m for m in sender.receive(1.0) if m == "WATCHDOG=1"]
    assert len(pings) >= 4  # every 150 ms for a 300 ms watchdog
    # The receivers were given no watchdog: they send none.
    assert "WATCHDOG=1" not in daemons["decode"].receive(0.5)


def test_sigterm_finishes_the_push_in_flight_refuses_new_ones_and_exits_0(
        daemons: dict[str, Daemon]) -> None:
    sender = daemons["prefill"]

    async def scenario() -> None:
        async with await SenderClient.connect(str(sender.config["socket"])) as client:
            push = await client.open("in-flight", "decode", RequestShape(8, 1 << 20),
                                     discard=True)
            for layer in range(4):
                push.commit(layer)
            sender.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(sender.wait_for, "STOPPING=1", 10)
            with pytest.raises(RequestRefused, match="shutting down"):
                await client.open("too-late", "decode", RequestShape(1, 4096))
            for layer in range(4, 8):
                push.commit(layer)
            result = await asyncio.wait_for(push.finish(), 20)
            assert result.bytes == 8 << 20

    asyncio.run(scenario())
    assert sender.proc.wait(20) == 0
    log = Path(sender.log.name).read_text()
    assert '"unfinished": 0' in log and '"event": "stopped"' in log
    # The receiver heard a goodbye, not a broken connection.
    _wait_for_log(daemons["decode"], "said goodbye: the sender is shutting down")


def test_sighup_adds_and_removes_peers_keeping_the_others(daemons: dict[str, Daemon],
                                                         tmp_path: Path) -> None:
    sender = daemons["prefill"]
    socket_path = str(sender.config["socket"])
    decode2 = daemons["decode2"].config["listen"]

    async def push(peer: str, req: str) -> None:
        async with await SenderClient.connect(socket_path) as client:
            await client.push_bytes(req, peer, b"x" * 4096)

    asyncio.run(push("decode", "before"))
    with pytest.raises(UnknownPeer):
        asyncio.run(push("decode2", "not-yet"))

    write_toml(sender.path, {**sender.config, "peers": {
        "decode": sender.config["peers"]["decode"], "decode2": decode2}})
    sender.proc.send_signal(signal.SIGHUP)
    sender.wait_for("RELOADING=1")
    asyncio.run(push("decode2", "added"))
    asyncio.run(push("decode", "kept"))
    receiver_log = Path(daemons["decode"].log.name).read_text()
    assert receiver_log.count('"event": "sender connected"') == 1  # never reconnected

    write_toml(sender.path, {**sender.config, "peers": {"decode2": decode2}})
    sender.messages.clear()
    sender.proc.send_signal(signal.SIGHUP)
    sender.wait_for("RELOADING=1")
    sender.wait_for("READY=1")
    with pytest.raises(UnknownPeer):
        asyncio.run(push("decode", "removed"))
    asyncio.run(push("decode2", "still-there"))
    _wait_for_log(daemons["decode"], "removed from the sender's configuration")


def test_notifier_does_nothing_outside_systemd() -> None:
    notifier = Notifier({})
    assert not notifier.enabled and notifier.watchdog_seconds == 0.0
    notifier.ready("ready")  # no socket: no error
    assert Notifier({"NOTIFY_SOCKET": "@abstract", "WATCHDOG_USEC": "2000000",
                     "WATCHDOG_PID": str(os.getpid())}).watchdog_seconds == 2.0
    # A watchdog meant for another process is not ours to feed.
    assert Notifier({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}).watchdog_seconds == 0.0
