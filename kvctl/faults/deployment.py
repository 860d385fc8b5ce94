"""Where a fault campaign runs: what it can do to the two nodes.

``NetnsDeployment``: a receiver and a sender in two network namespaces
joined by a veth pair (TCP), and a supervisor that restarts a daemon that
died, as systemd's ``Restart=on-failure`` does on a real node. The engines
run in the host namespace: the daemons' unix sockets live in the shared
filesystem.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from ..netns import DaemonProcess, Host, NetnsPair, receiver_config, scrape_in, sender_config
from .reference import REFERENCE_LIMIT, WireReference
from .wire import WireFaults, drop_inbound, undo_drop_inbound

ROLES = ("receiver", "sender")


class EngineHandle(Protocol):
    """An engine process wherever it runs: its output lines, its hold, its end."""

    def lines(self) -> Iterator[str]: ...

    def release(self, phase: str) -> None: ...

    def alive(self) -> bool: ...

    def kill(self) -> None: ...


class Deployment(Protocol):
    name: str
    transport: str

    @property
    def sockets(self) -> dict[str, str]: ...

    @property
    def stop_pause(self) -> float: ...

    def engine(self, role: str, argv: list[str], hold: str | None) -> EngineHandle: ...

    def wire(self, netem: str | None) -> None: ...

    def cut_data(self, cut: bool) -> None: ...

    def can_emulate(self, netem: str) -> str | None: ...

    def wire_reference(self, write_bytes: int, writes: int,
                       limit: float = REFERENCE_LIMIT) -> WireReference: ...

    def supports(self, action: str) -> str | None: ...

    def signal(self, role: str, signum: signal.Signals) -> None: ...

    def stall(self, role: str) -> None: ...

    def lower_memlock(self, role: str) -> None: ...

    def starve_memlock(self, role: str) -> str | None: ...

    def restart(self, role: str) -> None: ...

    def supervise(self) -> None: ...

    def restarts(self) -> int: ...

    def pool_used(self) -> dict[str, int]: ...

    def log_tail(self, role: str) -> str: ...


class ProcessHandle:
    """An engine that is a child process here; held engines wait on its stdin."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process

    def lines(self) -> Iterator[str]:
        assert self.process.stdout is not None
        yield from self.process.stdout

    def release(self, phase: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.write("\n")
            self.process.stdin.flush()

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()


class NetnsDeployment:
    """Two namespaces over TCP, a supervisor standing in for systemd."""

    name = "netns"
    transport = "tcp"

    def __init__(self, workdir: Path, receiver: dict[str, Any] | None = None,
                 sender: dict[str, Any] | None = None) -> None:
        self.workdir = workdir
        self.pair = NetnsPair(f"f{int(time.time()) % 100000}")
        self.daemons: dict[str, DaemonProcess] = {}
        self._overrides = {"receiver": receiver or {}, "sender": sender or {}}
        self._restarts = 0
        self._wire = WireFaults()

    def __enter__(self) -> NetnsDeployment:
        self.pair.up()
        try:
            for role, host, config in (
                    ("receiver", self.pair.decode, receiver_config(
                        self.pair, self.workdir, **self._overrides["receiver"])),
                    ("sender", self.pair.prefill, sender_config(
                        self.pair, self.workdir, **self._overrides["sender"]))):
                self.daemons[role] = DaemonProcess(self.pair, host, role, config,
                                                   self.workdir).start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for daemon in reversed(list(self.daemons.values())):
            daemon.stop()
        self.pair.down()

    @property
    def sockets(self) -> dict[str, str]:
        return {role: daemon.socket for role, daemon in self.daemons.items()}

    @property
    def stop_pause(self) -> float:
        """Long enough a SIGSTOP for the peer to be declared lost (heartbeat x 4)."""
        return 4 * 1.0 + 1.0

    def engine(self, role: str, argv: list[str], hold: str | None) -> EngineHandle:
        return ProcessHandle(subprocess.Popen(
            [sys.executable, "-m", "kvctl.faults.engine", role, *argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1))

    def _hosts(self) -> tuple[Host, ...]:
        return (self.pair.prefill, self.pair.decode)

    def can_emulate(self, netem: str) -> str | None:
        return self._wire.can_emulate(netem)

    def wire(self, netem: str | None) -> None:
        """The fault on both ends of the wire (None: a clean wire again)."""
        for host in self._hosts():
            self._wire.apply(functools.partial(self.pair.argv, host), host.ifname, netem)

    def wire_reference(self, write_bytes: int, writes: int,
                       limit: float = REFERENCE_LIMIT) -> WireReference:
        """A plain socket loop's time for ``writes`` sends of ``write_bytes``
        from prefill's namespace to decode's, on the wire as it is now (given
        ``limit`` seconds)."""
        total = write_bytes * writes
        module = [sys.executable, "-m", "kvctl.faults.reference"]
        server = subprocess.Popen(
            self.pair.argv(self.pair.decode, [*module, "serve", self.pair.decode.address,
                                              str(total)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            if not port.isdigit():
                return WireReference("socket loop", total, None,
                                     f"its receiving half did not start: {port}")
            try:
                done = subprocess.run(
                    self.pair.argv(self.pair.prefill, [*module, "send",
                                                       self.pair.decode.address, port,
                                                       str(write_bytes), str(writes)]),
                    capture_output=True, text=True, timeout=limit)
            except subprocess.TimeoutExpired:
                return WireReference("socket loop", total, None, f"not done in {limit:g} s")
            if done.returncode != 0:
                # Its last line of error output says why (a traceback's ends with it).
                why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
                return WireReference("socket loop", total, None, why)
            return WireReference("socket loop", total, float(done.stdout))
        finally:
            server.kill()
            server.wait()

    def cut_data(self, cut: bool) -> None:
        """Drop the data streams' packets as they reach decode (no reset), or stop."""
        run = self.pair.runner(self.pair.decode)
        if cut:
            drop_inbound(run, [f"tcp dport {self.daemons['receiver'].config['data_port']}"])
        else:
            undo_drop_inbound(run)

    def supports(self, action: str) -> str | None:
        if action == "stall":
            return "no watchdog between namespaces: the daemons run without systemd (the lab " \
                   "runs this scenario)"
        if action == "memlock":
            return "the TCP transport pins no memory: a memlock limit matters to verbs (the " \
                   "lab runs this scenario)"
        return None

    def stall(self, role: str) -> None:
        raise NotImplementedError(self.supports("stall"))

    def lower_memlock(self, role: str) -> None:
        raise NotImplementedError(self.supports("memlock"))

    def starve_memlock(self, role: str) -> str | None:
        raise NotImplementedError(self.supports("memlock"))

    def signal(self, role: str, signum: signal.Signals) -> None:
        process = self.daemons[role].process
        if process is not None and process.poll() is None:
            process.send_signal(signum)

    def restart(self, role: str) -> None:
        """As ``systemctl restart``: a clean stop, then a start."""
        self.daemons[role].stop()
        self.daemons[role].start()
        self._restarts += 1

    def supervise(self) -> None:
        """Start again whatever died (``Restart=on-failure``)."""
        for daemon in self.daemons.values():
            if not daemon.running:
                daemon.start()
                self._restarts += 1

    def restarts(self) -> int:
        return self._restarts

    def pool_used(self) -> dict[str, int]:
        """Bytes the receive pool and the staging pool hold, from the daemons' metrics."""
        used: dict[str, int] = {}
        for role, daemon in self.daemons.items():
            port = int(str(daemon.config["metrics"]).rpartition(":")[2])
            status = scrape_in(self.pair, daemon.host, port)
            used[role] = int(sum(value for (name, labels), value in status.samples.items()
                                 if name == "kvwire_pool_bytes" and ("state", "used") in labels))
        return used

    def log_tail(self, role: str) -> str:
        return self.daemons[role].log_tail()
