"""kvwired daemons inside the lab nodes, started as a user would start them.

Config files and logs live in the lab's shared directory, so the host can
write the one and read the other; the unix sockets live in the node's own
/run.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from kvwired.addresses import (
    DEFAULT_CONTROL_PORT,
    DEFAULT_DATA_PORT,
    RECEIVER_METRICS_PORT,
    SENDER_METRICS_PORT,
)

from ..keys import with_credentials
from ..netns import write_toml
from .machine import SHARED_DIR, LabError, LabState, run_in

DECODE_ADDRESS = "198.18.78.2"

# The lab's nodes are emulated (QEMU TCG, one vCPU each): a daemon that sets
# up a queue pair while another registers its pool, or while an engine's
# Python starts, can be descheduled for seconds. The defaults (ping every
# 1 s, 4 missed pings, 5 s to connect) are for real hosts; in the lab they
# dropped healthy links: while rdma_rxe moves 48 MiB in the kernel of a
# one-vCPU emulated node, a daemon there can get no CPU for 10 s. Real nodes
# keep the defaults.
#
# rdma_rxe resends a packet only when its queue pair's ACK timer fires, and
# on these nodes an ACK can take longer than a real NIC's: the decode node's
# one vCPU answers four queue pairs' writes in turn. At 17 ms (ack timeout
# 12) one 48 MiB push over four channels on one rail set the timers off
# 1,238 times; the decode node answered 159,437 duplicate packets, and the
# push failed its 20 s stall bound (over two rails: 26 s, where one channel
# takes 6). rxe's needless resends also broke clean pushes (its responder
# refused a resent message's sequence: remote invalid request, status 9).
# At 67 ms (14): 1 to 45 resends a push; at 268 ms (16): none in four, and
# 5.4 to 6.6 s a push on one rail or two. A wire that truly loses packets
# recovers more slowly at 16, so the fault campaign, whose scenarios are
# lossy wires, sets its own (kvctl/faults/cli.py).
#
# A sender's handshake (hello, welcome, its first queue pair) took 7 to 11 s
# there while `kvctl push` filled its 48 MiB on the same vCPU (the receiver
# logs each one's seconds). At the default 10 s, one full lab run refused
# twelve tries of five senders, and a second sender beside a push never got
# in. The lab gives it the sender's connect bound and more.
EMULATED_NODE_SLACK: dict[str, Any] = {"heartbeat": 5.0, "ack_timeout": 16,
                                       "handshake_timeout": 30.0}
EMULATED_CONNECT_TIMEOUT = 20.0
# For the same reason the units' watchdog (WatchdogSec=10 as shipped) gets
# 30 s in the lab: a loop starved for 10 s there is the emulation, not a
# stuck daemon.
EMULATED_WATCHDOG_SECONDS = 30


# The lab's cluster CA and every lab daemon's credentials (auth on, as deployed).
TLS_ROOT = SHARED_DIR / "tls"


def receiver_config(name: str = "decode", **overrides: Any) -> dict[str, Any]:
    return with_credentials(
        {"name": name, "listen": f"{DECODE_ADDRESS}:{DEFAULT_CONTROL_PORT}",
         "data_port": DEFAULT_DATA_PORT, "socket": f"/run/kvwire/{name}.sock",
         "metrics": f"0.0.0.0:{RECEIVER_METRICS_PORT}",
         "log_format": "json", **EMULATED_NODE_SLACK, **overrides}, "receiver", TLS_ROOT)


def sender_config(name: str = "prefill", peers: dict[str, str] | None = None,
                  **overrides: Any) -> dict[str, Any]:
    return with_credentials(
        {"name": name, "socket": f"/run/kvwire/{name}.sock",
         "metrics": f"0.0.0.0:{SENDER_METRICS_PORT}",
         "peers": peers or {"decode": f"{DECODE_ADDRESS}:{DEFAULT_CONTROL_PORT}"},
         "log_format": "json",
         "connect_timeout": EMULATED_CONNECT_TIMEOUT, **EMULATED_NODE_SLACK, **overrides},
        "sender", TLS_ROOT)


class NodeDaemon:
    """One ``kvwired`` process in a lab node."""

    def __init__(self, node: str, role: str, config: dict[str, Any],
                 state: LabState | None = None, memlock_kib: int | None = None) -> None:
        self.node, self.role, self.config = node, role, config
        self.name = str(config["name"])
        self.socket = str(config["socket"])
        self.state = state
        self.memlock_kib = memlock_kib
        folder = SHARED_DIR / "daemons"
        folder.mkdir(parents=True, exist_ok=True)
        self.config_path = folder / f"{self.name}.toml"
        self.log_path = folder / f"{self.name}.log"
        self.pid_path = folder / f"{self.name}.pid"
        self.exit_path = folder / f"{self.name}.exit"
        self.pid: int | None = None

    def _sh(self, script: str) -> tuple[int, str, str]:
        return run_in(self.node, ["sh", "-c", script], state=self.state)

    def start(self, timeout: float = 90.0, wait: bool = True) -> NodeDaemon:
        write_toml(self.config_path, self.config)
        self.log_path.write_text("")
        for stale in (self.pid_path, self.exit_path):
            stale.unlink(missing_ok=True)
        limit = f"ulimit -l {self.memlock_kib}; " if self.memlock_kib is not None else ""
        # A watcher shell records the exit code; the daemon's own pid goes to a file.
        inner = (f"{limit}{sys.executable} -m kvwired {self.role} --config {self.config_path} "
                 f">>{self.log_path} 2>&1 </dev/null & echo $! >{self.pid_path}; wait $!; "
                 f"echo $? >{self.exit_path}")
        # A socket left by a killed daemon would look ready: it goes first.
        code, _, err = self._sh(f"rm -f {self.socket}; "
                                f"setsid sh -c '{inner}' >/dev/null 2>&1 </dev/null &")
        if code != 0:
            raise LabError(f"cannot start {self.name} in {self.node}: {err}")
        deadline = time.monotonic() + 10
        while not self.pid_path.exists() or not self.pid_path.read_text().strip():
            if time.monotonic() > deadline:
                raise LabError(f"{self.name} did not start in {self.node}")
            time.sleep(0.1)
        self.pid = int(self.pid_path.read_text())
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise LabError(f"{self.name} exited in {self.node}:\n{self.log_tail()}")
            if self._sh(f"test -S {self.socket}")[0] == 0:
                return
            time.sleep(0.5)
        raise LabError(f"{self.name} not ready in {self.node} within {timeout:g} s:\n"
                       f"{self.log_tail()}")

    def exit_code(self, timeout: float = 60.0) -> int | None:
        """Wait for the daemon to end by itself; its exit code (None: still running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                return int(self.exit_path.read_text())
            time.sleep(0.2)
        return None

    @property
    def running(self) -> bool:
        return self.pid is not None and not self.exit_path.exists()

    def signal(self, name: str) -> None:
        if self.pid is not None:
            self._sh(f"kill -{name} {self.pid} 2>/dev/null")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit code."""
        if self.running:
            self.signal("TERM")
            if self.exit_code(timeout) is None:
                self.signal("KILL")
        code = self.exit_code(10)
        self._sh(f"rm -f {self.socket}")
        return code

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        return "(no log)"

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text()
        return ""



class ServiceDaemon:
    """``kvwired-<role>.service`` in a lab node, run by the node's systemd from
    the shipped unit, installed the way an operator would (``make install``,
    here with the checkout's venv as PREFIX)."""

    def __init__(self, node: str, role: str, config: dict[str, Any],
                 state: LabState | None = None) -> None:
        self.node, self.role = node, role
        # Credentials go where a deployment keeps them, readable by the
        # daemons' group only (``start`` copies them there).
        self.credentials = config.get("tls_dir")
        self.config = {**config, "socket": f"/run/kvwire/{role}.sock"}
        if self.credentials is not None:
            self.config["tls_dir"] = "/etc/kvwire/tls"
        self.name = str(config["name"])
        self.socket = str(self.config["socket"])
        self.unit = f"kvwired-{role}.service"
        self.state = state
        self.config_path = SHARED_DIR / "daemons" / f"{self.name}.service.toml"

    def _sh(self, script: str) -> tuple[int, str, str]:
        return run_in(self.node, ["sh", "-c", script], state=self.state)

    def install(self) -> None:
        prefix = str(Path(sys.executable).parent.parent)
        code, out, err = self._sh(f"PREFIX={prefix} scripts/install.sh {self.role}")
        if code != 0:
            raise LabError(f"make install failed in {self.node}: {out}{err}")
        hidden = sorted({path for path in (prefix, str(Path(__file__).resolve().parents[2]))
                         if path.startswith(("/tmp/", "/var/tmp/"))})
        lines = [f"WatchdogSec={EMULATED_WATCHDOG_SECONDS}"]
        if hidden:
            # The unit's PrivateTmp hides a checkout under /tmp, and with it
            # the venv and the sources its editable install points to; the
            # lab's drop-in binds them back in, read-only. Deployed daemons
            # live in /opt/kvwire and need none of this.
            lines.append(f"BindReadOnlyPaths={' '.join(hidden)}")
        dropin = f"/etc/systemd/system/{self.unit}.d"
        body = "\\n".join(["[Service]", *lines])
        code, out, err = self._sh(
            f"mkdir -p {dropin} && printf '{body}\\n' > {dropin}/lab.conf && "
            "systemctl daemon-reload")
        if code != 0:
            raise LabError(f"cannot add the lab drop-in in {self.node}: {out}{err}")

    def start(self) -> ServiceDaemon:
        """Install, configure, ``systemctl restart``: returns once READY=1 came."""
        self.install()
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        write_toml(self.config_path, self.config)
        credentials = "true"
        if self.credentials is not None:
            source = self.credentials
            credentials = (
                "install -d -m 0750 -g kvwire /etc/kvwire/tls && "
                f"install -m 0644 {source}/ca.crt {source}/node.crt /etc/kvwire/tls/ && "
                f"install -m 0640 -g kvwire {source}/node.key /etc/kvwire/tls/")
        code, out, err = self._sh(
            f"{credentials} && install -m 0644 {self.config_path} /etc/kvwire/{self.role}.toml && "
            f"systemctl reset-failed {self.unit} 2>/dev/null; systemctl restart {self.unit}")
        if code != 0:
            raise LabError(f"systemctl restart {self.unit} failed in {self.node}: {out}{err}\n"
                           f"{self.log_tail()}")
        return self

    def show(self, *properties: str) -> dict[str, str]:
        _, out, _ = self._sh(f"systemctl show {self.unit} "
                                + " ".join(f"-p {p}" for p in properties))
        pairs = (line.split("=", 1) for line in out.splitlines() if "=" in line)
        return {key: value for key, value in pairs}

    @property
    def pid(self) -> int:
        return int(self.show("MainPID")["MainPID"])

    @property
    def running(self) -> bool:
        return self._sh(f"systemctl is-active --quiet {self.unit}")[0] == 0

    def signal(self, name: str) -> None:
        self._sh(f"systemctl kill --kill-whom=main -s {name} {self.unit}")

    def stop(self, timeout: float = 15.0) -> int | None:
        """``systemctl stop``; the main process's exit status."""
        self._sh(f"systemctl stop {self.unit}")
        status = self.show("ExecMainStatus").get("ExecMainStatus", "")
        return int(status) if status.isdigit() else None

    def log_tail(self, lines: int = 30) -> str:
        return self._sh(f"journalctl -u {self.unit} -n {lines} --no-pager -o cat")[1]

    def log_text(self) -> str:
        return self._sh(f"journalctl -u {self.unit} --no-pager -o cat")[1]
