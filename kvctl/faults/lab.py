"""The fault campaign in the two-node lab: verbs over Soft-RoCE, the daemons
under the nodes' systemd (installed and started as ``make demo`` does), the
engines in the nodes, ``tc netem`` on the wire."""

from __future__ import annotations

import contextlib
import io
import json
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from ..lab.daemons import EMULATED_NODE_SLACK, ServiceDaemon, receiver_config, sender_config
from ..lab.machine import SHARED_DIR, LabState, exec_in, run_in
from ..status import scrape
from .deployment import EngineHandle

ENGINE_NODE = {"prefill": "prefill", "decode": "decode"}
DAEMON_NODE = {"receiver": "decode", "sender": "prefill"}
METRICS_PORT = {"receiver": "metrics_receiver", "sender": "metrics_sender"}
BACK_WITHIN = 120.0  # systemd restarts a dead daemon after RestartSec=2; TCG is slow


class _Lines:
    """A binary sink that hands complete lines to a queue (a node's stdout)."""

    def __init__(self, lines: queue.Queue[str | None]) -> None:
        self._lines, self._partial = lines, b""
        self.pid: int | None = None

    def write(self, data: bytes) -> int:
        self._partial += data
        *complete, self._partial = self._partial.split(b"\n")
        for raw in complete:
            line = raw.decode(errors="replace")
            if self.pid is None:  # the engine's first line names its process
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    event = json.loads(line)
                    if event["e"] == "pid":
                        self.pid = int(event["pid"])
            self._lines.put(line)
        return len(data)

    def flush(self) -> None:
        pass


class NodeHandle:
    """An engine in a lab node, run through the node's agent. A held engine
    waits for a file in the lab's shared directory; a kill is a kill -9 there."""

    def __init__(self, state: LabState, node: str, argv: list[str]) -> None:
        self.state, self.node = state, node
        self.release_dir = SHARED_DIR / "faults" / uuid.uuid4().hex[:12]
        self.release_dir.mkdir(parents=True, exist_ok=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._sink = _Lines(self._lines)
        self._thread = threading.Thread(target=self._run, args=(
            [*argv, "--release-dir", str(self.release_dir)],), daemon=True)
        self._thread.start()

    def _run(self, argv: list[str]) -> None:
        try:
            exec_in(self.node, argv, stdout=self._sink,  # type: ignore[arg-type]
                    stderr=io.BytesIO(), state=self.state)
        finally:
            self._lines.put(None)

    def lines(self) -> Iterator[str]:
        while (line := self._lines.get()) is not None:
            yield line

    def release(self, phase: str) -> None:
        (self.release_dir / phase).touch()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def kill(self) -> None:
        if self._thread.is_alive() and self._sink.pid is not None:
            run_in(self.node, ["kill", "-9", str(self._sink.pid)], state=self.state)
        self._thread.join(timeout=30)
        for entry in self.release_dir.glob("*"):
            entry.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.release_dir.rmdir()


class LabDeployment:
    """Both daemons under the lab nodes' systemd, verbs over Soft-RoCE."""

    name = "lab"
    transport = "verbs"

    def __init__(self, state: LabState, receiver: dict[str, Any] | None = None,
                 sender: dict[str, Any] | None = None) -> None:
        self.state = state
        self.daemons = {
            "receiver": ServiceDaemon("decode", "receiver",
                                      receiver_config(transport="verbs", **(receiver or {})),
                                      state),
            "sender": ServiceDaemon("prefill", "sender",
                                    sender_config(transport="verbs", **(sender or {})), state),
        }
        self._explicit_restarts = 0
        self._base_restarts = 0

    def __enter__(self) -> LabDeployment:
        self.daemons["receiver"].start()
        self.daemons["sender"].start()
        self._base_restarts = self._systemd_restarts()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wire(None)
        for daemon in reversed(list(self.daemons.values())):
            daemon.stop()

    @property
    def sockets(self) -> dict[str, str]:
        return {role: daemon.socket for role, daemon in self.daemons.items()}

    @property
    def stop_pause(self) -> float:
        return 4 * float(EMULATED_NODE_SLACK["heartbeat"]) + 2.0

    def engine(self, role: str, argv: list[str], hold: str | None) -> EngineHandle:
        return NodeHandle(self.state, ENGINE_NODE[role],
                          [sys.executable, "-m", "kvctl.faults.engine", role, *argv])

    def can_emulate(self, netem: str) -> str | None:
        return None  # the nodes run Debian's kernel: netem is a module there

    def wire(self, netem: str | None) -> None:
        for node in ("prefill", "decode"):
            if netem is None:
                run_in(node, ["tc", "qdisc", "del", "dev", "wire0", "root"], state=self.state)
                continue
            code, _, err = run_in(node, ["tc", "qdisc", "replace", "dev", "wire0", "root",
                                         "netem", *netem.split()], state=self.state)
            if code != 0:
                raise RuntimeError(f"tc netem {netem} in {node}: {err.strip()}")

    def signal(self, role: str, signum: signal.Signals) -> None:
        self.daemons[role].signal(signum.name)

    def restart(self, role: str) -> None:
        daemon = self.daemons[role]
        code, out, err = run_in(daemon.node, ["systemctl", "restart", daemon.unit],
                                state=self.state)
        if code != 0:
            raise RuntimeError(f"systemctl restart {daemon.unit}: {out}{err}")
        self._explicit_restarts += 1

    def supervise(self) -> None:
        """systemd restarts what died; wait until both serve again."""
        deadline = time.monotonic() + BACK_WITHIN
        for daemon in self.daemons.values():
            while not daemon.running:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{daemon.unit} not back within {BACK_WITHIN:g} s:\n"
                                       f"{daemon.log_tail()}")
                time.sleep(0.5)

    def _systemd_restarts(self) -> int:
        return sum(int(d.show("NRestarts").get("NRestarts", "0") or 0)
                   for d in self.daemons.values())

    def restarts(self) -> int:
        return self._systemd_restarts() - self._base_restarts + self._explicit_restarts

    def pool_used(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for role, node in DAEMON_NODE.items():
            port = self.state.nodes[node].ports[METRICS_PORT[role]]
            status = scrape(f"127.0.0.1:{port}")
            used[role] = int(sum(value for (name, labels), value in status.samples.items()
                                 if name == "kvwire_pool_bytes" and ("state", "used") in labels))
        return used

    def log_tail(self, role: str) -> str:
        return self.daemons[role].log_tail()
