"""Two hosts on one machine: network namespaces joined by a veth pair.

The harness runs each daemon in its own namespace as a separate process,
started the way a user starts it (``python -m kvwired ROLE --config FILE``),
so everything between them crosses a real (virtual) Ethernet link. Unix
sockets live in the shared filesystem, so engines in the initial namespace
reach both daemons.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwired.addresses import (
    DEFAULT_CONTROL_PORT,
    DEFAULT_DATA_PORT,
    RECEIVER_METRICS_PORT,
    SENDER_METRICS_PORT,
)
from kvwired.errors import KvwireError
from kvwired.localsock import accepts

from .keys import with_credentials
from .status import DaemonStatus

# RFC 2544's benchmarking range: never routed, never someone else's host.
SUBNET = "198.18.77"


@dataclass(frozen=True)
class Host:
    """One end of the harness: its namespace, its address on the veth, the veth."""

    netns: str
    address: str
    ifname: str


class HarnessError(KvwireError, code="harness",
                   hint="the namespaces need root and iproute2; the daemon logs are in "
                        "the work directory"):
    """The two-namespace harness could not be set up or run."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise HarnessError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def check_can_run() -> str | None:
    """Why the harness cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. sudo make test)"
    if shutil.which("ip") is None:
        return "`ip` is missing (apt-get install iproute2)"
    return None


class NetnsPair:
    """Namespaces ``prefill`` and ``decode`` joined by a veth pair."""

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or str(os.getpid())
        self.prefill = Host(f"kvw-{tag}-p", f"{SUBNET}.1", "kvw0")
        self.decode = Host(f"kvw-{tag}-d", f"{SUBNET}.2", "kvw0")

    def up(self) -> NetnsPair:
        reason = check_can_run()
        if reason:
            raise HarnessError(f"cannot build the two-namespace harness: {reason}")
        try:
            for host in (self.prefill, self.decode):
                _ip("netns", "add", host.netns)
                _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("link", "add", "kvwtmp0", "netns", self.prefill.netns, "type", "veth",
                "peer", "name", "kvwtmp1", "netns", self.decode.netns)
            for host, tmp in ((self.prefill, "kvwtmp0"), (self.decode, "kvwtmp1")):
                _ip("-n", host.netns, "link", "set", tmp, "name", host.ifname)
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
                _ip("-n", host.netns, "link", "set", host.ifname, "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        for host in (self.prefill, self.decode):
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)

    def argv(self, host: Host, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", host.netns, *command]

    def runner(self, host: Host) -> Callable[[list[str]], tuple[int, str]]:
        """Runs a command in ``host``: its exit code and error output."""
        def run(command: list[str]) -> tuple[int, str]:
            done = subprocess.run(self.argv(host, command), capture_output=True, text=True)
            return done.returncode, done.stderr
        return run

    def established_ports(self, host: Host, peer_port: int) -> list[int]:
        """``host``'s local ports of its established TCP connections to ``peer_port``."""
        out = subprocess.run(self.argv(host, [
            "ss", "-Htn", "state", "established", "dport", f"= :{peer_port}"]),
            capture_output=True, text=True, check=True).stdout
        return sorted(int(line.split()[2].rpartition(":")[2]) for line in out.splitlines()
                      if line.strip())

    def __enter__(self) -> NetnsPair:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(str(value))


def write_toml(path: Path, values: dict[str, Any]) -> None:
    lines = [f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict)]
    for key, table in values.items():
        if isinstance(table, dict):
            lines.append(f"\n[{key}]")
            lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")


class DaemonProcess:
    """One kvwired process in a namespace, with its config file and log."""

    def __init__(self, pair: NetnsPair, host: Host, role: str, config: dict[str, Any],
                 workdir: Path) -> None:
        self.pair, self.host, self.role = pair, host, role
        self.config = {"log_format": "json", **config}
        self.socket = str(config["socket"])
        self.config_path = workdir / f"{role}.toml"
        self.log_path = workdir / f"{role}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0, detach: bool = False) -> DaemonProcess:
        """Start it; returns once its socket accepts. ``detach``: in a session of
        its own, to outlive the caller (``kvctl netns up``)."""
        write_toml(self.config_path, self.config)
        command = [sys.executable, "-m", "kvwired", self.role, "--config", str(self.config_path)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.pair.argv(self.host, command), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=detach)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise HarnessError(f"{self.role} exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            if accepts(self.socket):
                return self
            time.sleep(0.05)
        self.kill()
        raise HarnessError(f"{self.role} not ready within {timeout:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        return "(no log)"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()



def receiver_config(pair: NetnsPair, workdir: Path, **overrides: Any) -> dict[str, Any]:
    """A receiver in the decode namespace, with credentials of ``workdir``'s cluster."""
    return with_credentials({
        "name": "decode",
        "listen": f"{pair.decode.address}:{DEFAULT_CONTROL_PORT}",
        "data_port": DEFAULT_DATA_PORT,
        "socket": str(workdir / "receiver.sock"),
        "metrics": f"{pair.decode.address}:{RECEIVER_METRICS_PORT}",
        **overrides,
    }, "receiver", workdir / "tls")


def sender_config(pair: NetnsPair, workdir: Path, **overrides: Any) -> dict[str, Any]:
    """A sender in the prefill namespace, with credentials of ``workdir``'s cluster."""
    return with_credentials({
        "name": "prefill",
        "socket": str(workdir / "sender.sock"),
        "metrics": f"{pair.prefill.address}:{SENDER_METRICS_PORT}",
        "peers": {"decode": f"{pair.decode.address}:{DEFAULT_CONTROL_PORT}"},
        **overrides,
    }, "sender", workdir / "tls")


_SCRAPE = """
import json, sys
from kvctl.status import scrape
status = scrape(sys.argv[1])
print(json.dumps([[name, list(map(list, labels)), value]
                  for (name, labels), value in status.samples.items()]))
"""


def scrape_in(pair: NetnsPair, host: Host, port: int) -> DaemonStatus:
    """A daemon's metrics, scraped from inside its namespace (the host has no route)."""
    out = subprocess.run(pair.argv(host, [sys.executable, "-c", _SCRAPE,
                                          f"{host.address}:{port}"]),
                         capture_output=True, text=True, check=True).stdout
    samples = {(name, tuple(tuple(label) for label in labels)): value
               for name, labels, value in json.loads(out)}
    return DaemonStatus(f"{host.address}:{port}", True, samples=samples)


@contextlib.contextmanager
def two_hosts(workdir: Path, receiver: dict[str, Any] | None = None,
              sender: dict[str, Any] | None = None,
              tag: str | None = None) -> Iterator[tuple[NetnsPair, DaemonProcess, DaemonProcess]]:
    """Namespaces up, a receiver and a sender running; all torn down on exit."""
    with NetnsPair(tag) as pair:
        rx = DaemonProcess(pair, pair.decode, "receiver",
                           receiver_config(pair, workdir, **(receiver or {})), workdir)
        tx = DaemonProcess(pair, pair.prefill, "sender",
                           sender_config(pair, workdir, **(sender or {})), workdir)
        try:
            rx.start()
            tx.start()
            yield pair, rx, tx
        finally:
            tx.stop()
            rx.stop()
