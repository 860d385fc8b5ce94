"""The fault campaign in the two-node lab: verbs over Soft-RoCE, the daemons
under the nodes' systemd (installed and started as ``make demo`` does), the
engines in the nodes, ``tc netem`` on the wire."""

from __future__ import annotations

import contextlib
import io
import json
import queue
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvwired.addresses import DEFAULT_DATA_PORT

from ..lab.daemons import ServiceDaemon, receiver_config, sender_config
from ..lab.link_perftest import write_bw
from ..lab.machine import SHARED_DIR, LabError, LabState, exec_in, run_in
from ..status import scrape
from .deployment import EngineHandle
from .reference import REFERENCE_LIMIT, WireReference
from .wire import drop_inbound, undo_drop_inbound

ENGINE_NODE = {"prefill": "prefill", "decode": "decode"}
DAEMON_NODE = {"receiver": "decode", "sender": "prefill"}
METRICS_PORT = {"receiver": "metrics_receiver", "sender": "metrics_sender"}
BACK_WITHIN = 120.0  # systemd restarts a dead daemon after RestartSec=2; TCG is slow


def _runtime_dropin(daemon: ServiceDaemon) -> str:
    """The campaign's drop-in directory for a unit: in /run, so a node's
    reboot would drop it, and apart from the lab's own in /etc."""
    return f"/run/systemd/system/{daemon.unit}.d"


class _Child:
    """An engine forked by a node's fork server: its lines, its pid, its end."""

    def __init__(self) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.pid: int | None = None
        self.ended = threading.Event()


class ForkServer:
    """A node's warm engine server (``kvctl.faults.forkserver``), run through
    the node's agent for the whole campaign; its stdout carries every
    child's lines, each after the child's id."""

    READY_WITHIN = 180.0  # Python and numpy imported on an emulated CPU

    def __init__(self, state: LabState, node: str) -> None:
        self.state, self.node = state, node
        self.directory = SHARED_DIR / "faults" / f"{node}-{uuid.uuid4().hex[:8]}"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._children: dict[str, _Child] = {}
        self._partial = b""
        self._ready = threading.Event()
        self._errors = io.BytesIO()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ForkServer:
        self._thread.start()
        deadline = time.monotonic() + self.READY_WITHIN
        while not self._ready.wait(0.5):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise LabError(f"the engine server in {self.node} did not start: "
                               f"{self._errors.getvalue().decode(errors='replace')[-2000:]}")
        return self

    def stop(self) -> None:
        (self.directory / "stop").touch()
        self._thread.join(timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)

    def spawn(self, argv: list[str]) -> _Child:
        child_id = uuid.uuid4().hex[:12]
        child = self._children[child_id] = _Child()
        staged = self.directory / f"{child_id}.tmp"
        staged.write_text(json.dumps(argv))
        staged.rename(self.directory / f"{child_id}.cmd")  # whole, or not there yet
        return child

    def _run(self) -> None:
        try:
            exec_in(self.node, [sys.executable, "-m", "kvctl.faults.forkserver",
                                str(self.directory)],
                    stdout=self, stderr=self._errors, state=self.state)
        finally:
            for child in list(self._children.values()):  # spawn() may add one meanwhile
                child.lines.put(None)
                child.ended.set()

    def write(self, data: bytes) -> int:  # the server's stdout, as it arrives
        self._partial += data
        *complete, self._partial = self._partial.split(b"\n")
        for raw in complete:
            child_id, _, line = raw.decode(errors="replace").partition(" ")
            if child_id == "server":
                self._ready.set()
            elif (child := self._children.get(child_id)) is not None:
                self._deliver(child, line)
        return len(data)

    def flush(self) -> None:
        pass

    @staticmethod
    def _deliver(child: _Child, line: str) -> None:
        event: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            event = json.loads(line)
        if not isinstance(event, dict):
            event = {}
        if event.get("e") == "pid":
            child.pid = int(event["pid"])
        if event.get("e") == "exit":
            child.lines.put(None)
            child.ended.set()
        else:
            child.lines.put(line)


class NodeHandle:
    """An engine in a lab node, forked by the node's engine server. A held
    engine waits for a file in the lab's shared directory; a kill is a kill -9
    in the node."""

    def __init__(self, server: ForkServer, argv: list[str]) -> None:
        self.server = server
        self.release_dir = SHARED_DIR / "faults" / uuid.uuid4().hex[:12]
        self.release_dir.mkdir(parents=True, exist_ok=True)
        self._child = server.spawn([*argv, "--release-dir", str(self.release_dir)])

    def lines(self) -> Iterator[str]:
        while (line := self._child.lines.get()) is not None:
            yield line

    def release(self, phase: str) -> None:
        (self.release_dir / phase).touch()

    def alive(self) -> bool:
        return not self._child.ended.is_set()

    def kill(self) -> None:
        if self.alive() and self._child.pid is not None:
            run_in(self.server.node, ["kill", "-9", str(self._child.pid)],
                   state=self.server.state)
        self._child.ended.wait(timeout=30)
        shutil.rmtree(self.release_dir, ignore_errors=True)


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
        self.servers: dict[str, ForkServer] = {}
        self._starved: set[str] = set()  # daemons restarted under a low memlock limit
        self._stalled: dict[str, int] = {}  # daemons stopped for the watchdog: their pid

    def __enter__(self) -> LabDeployment:
        try:
            # The two nodes install and start their daemon at once: each
            # start is a minute of Python on an emulated CPU.
            with ThreadPoolExecutor(max_workers=2) as pool:
                for started in [pool.submit(d.start) for d in self.daemons.values()]:
                    started.result()
            self._base_restarts = self._systemd_restarts()
            for node in ENGINE_NODE.values():
                self.servers[node] = ForkServer(self.state, node).start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self.servers.values():
            server.stop()
        self.wire(None)
        for daemon in reversed(list(self.daemons.values())):
            daemon.stop()

    @property
    def sockets(self) -> dict[str, str]:
        return {role: daemon.socket for role, daemon in self.daemons.items()}

    @property
    def stop_pause(self) -> float:
        """Long enough a SIGSTOP for the peer to be declared lost (heartbeat x 4)."""
        return 4 * float(self.daemons["sender"].config["heartbeat"]) + 1.0

    def engine(self, role: str, argv: list[str], hold: str | None) -> EngineHandle:
        return NodeHandle(self.servers[ENGINE_NODE[role]], [role, *argv])

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

    def wire_reference(self, write_bytes: int, writes: int,
                       limit: float = REFERENCE_LIMIT) -> WireReference:
        """ib_write_bw's time for ``writes`` writes of ``write_bytes`` from
        prefill to decode (rail 0, the wire the faults are put on), given
        ``limit`` seconds."""
        total = write_bytes * writes
        try:
            figures = write_bw(write_bytes, writes, self.state, timeout=limit, tries=1)
        except LabError as exc:
            return WireReference("ib_write_bw", total, None, exc.message.splitlines()[-1])
        if figures.gbps <= 0:
            return WireReference("ib_write_bw", total, None, "it reported no bandwidth")
        return WireReference("ib_write_bw", total, total * 8 / (figures.gbps * 1e9))

    def cut_data(self, cut: bool) -> None:
        """Drop the data path's packets as they reach decode, no reset: RoCE v2
        (UDP 4791) on every rail, and the TCP transport's data port."""
        def run(argv: list[str]) -> tuple[int, str]:
            code, _, err = run_in("decode", argv, state=self.state)
            return code, err

        if cut:
            port = self.daemons["receiver"].config.get("data_port", DEFAULT_DATA_PORT)
            drop_inbound(run, ["udp dport 4791", f"tcp dport {port}"])
        else:
            undo_drop_inbound(run)

    def supports(self, action: str) -> str | None:
        return None

    def signal(self, role: str, signum: signal.Signals) -> None:
        self.daemons[role].signal(signum.name)

    def stall(self, role: str) -> None:
        """Stop the daemon's loop from turning (SIGSTOP: no more WATCHDOG=1);
        ``supervise`` waits for systemd's watchdog to kill it and start it again."""
        daemon = self.daemons[role]
        daemon.signal("STOP")  # first: asking for its pid is another trip into the node
        self._stalled[role] = daemon.pid

    def lower_memlock(self, role: str) -> None:
        """Give the daemon a 64 KiB memlock limit from its next start (a drop-in
        in /run, gone at ``supervise``); the running one keeps its own.

        Before the push, not at its fault point: a daemon-reload is tens of
        seconds of PID 1 on the lab's emulated CPU, long enough for the push
        to stall on the node's busy CPU and fail on that instead."""
        daemon = self.daemons[role]
        dropin = _runtime_dropin(daemon)
        code, out, err = run_in(daemon.node, [
            "sh", "-c", f"mkdir -p {dropin} && printf '[Service]\\nLimitMEMLOCK=64K\\n' "
                        f"> {dropin}/memlock.conf && systemctl daemon-reload"],
            state=self.state)
        if code != 0:
            raise RuntimeError(f"a memlock drop-in for {daemon.unit}: {out}{err}")
        self._starved.add(role)

    def starve_memlock(self, role: str) -> str | None:
        """Restart the daemon under the limit ``lower_memlock`` set; the line
        in which it refused, if it did."""
        daemon = self.daemons[role]
        run_in(daemon.node, ["systemctl", "restart", daemon.unit],
               state=self.state)  # fails: the daemon exits before READY=1
        self._explicit_restarts += 1
        refusals = [line for line in daemon.log_tail(40).splitlines()
                    if "RLIMIT_MEMLOCK" in line]
        return refusals[-1].strip() if refusals else None

    def restart(self, role: str) -> None:
        daemon = self.daemons[role]
        code, out, err = run_in(daemon.node, ["systemctl", "restart", daemon.unit],
                                state=self.state)
        if code != 0:
            raise RuntimeError(f"systemctl restart {daemon.unit}: {out}{err}")
        self._explicit_restarts += 1

    def supervise(self) -> None:
        """systemd restarts what died; wait until both serve again."""
        for role in sorted(self._starved):  # the memlock limit back as shipped
            daemon = self.daemons[role]
            run_in(daemon.node, ["sh", "-c", f"rm -rf {_runtime_dropin(daemon)} && "
                                 f"systemctl daemon-reload && systemctl reset-failed "
                                 f"{daemon.unit}; systemctl restart {daemon.unit}"],
                   state=self.state)
        self._starved.clear()
        deadline = time.monotonic() + BACK_WITHIN
        for role, stalled in sorted(self._stalled.items()):
            daemon = self.daemons[role]
            while daemon.pid == stalled:
                if daemon.show("SubState").get("SubState") == "stop-watchdog":
                    # The watchdog fired and sent SIGABRT, which a stuck loop
                    # dies of at once; a stopped process only once continued
                    # (else systemd waits TimeoutAbortSec, then SIGKILLs).
                    daemon.signal("CONT")
                if time.monotonic() > deadline:
                    daemon.signal("CONT")
                    raise RuntimeError(f"the watchdog did not fire on the stalled {daemon.unit} "
                                       f"within {BACK_WITHIN:g} s:\n{daemon.log_tail()}")
                time.sleep(0.5)
        self._stalled.clear()
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
