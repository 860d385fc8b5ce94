"""``kvctl lab``: two QEMU guests with Soft-RoCE, joined by a virtual wire.

Each node boots the distribution kernel under software emulation (TCG:
nested KVM hangs on the machines this was built on), mounts the host's root
read-only over virtio 9p with a tmpfs overlay of its own, and binds
``rdma_rxe`` to its wire NIC, which sits behind a PCIe root port so the
probe finds a PCIe link under it. A second NIC (QEMU user networking,
restricted: no way out) carries the agent and the forwarded management
ports, reachable from the host on loopback. ``kvctl lab up --rails N``
gives each node N wire NICs, each with its own Soft-RoCE device and subnet
(wire0/rxe0 on 198.18.78.0/24, wire1/rxe1 on 198.18.80.0/24, ...): the
rails a multi-NIC node stripes over.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvwired.addresses import (
    DEFAULT_CONTROL_PORT,
    RECEIVER_METRICS_PORT,
    SENDER_METRICS_PORT,
)
from kvwired.errors import KvwireError

from ..processes import alive
from . import initramfs, wire

STATE_DIR = Path(os.environ.get("KVWIRE_LAB_DIR", "/var/tmp/kvwire-lab"))
# Shared read-write with both nodes, at the same path inside them.
SHARED_DIR = STATE_DIR / "shared"
BOOT_TIMEOUT = float(os.environ.get("KVWIRE_LAB_BOOT_TIMEOUT", "240"))
NODE_MEMORY_MIB = 2048
WIRE_SUBNET = "198.18.78"  # RFC 2544 benchmarking range: nobody else's
MGMT_NET = "198.18.79"
# Rail r's subnet; rail 0 is the wire every lab has (WIRE_SUBNET).
RAIL_SUBNETS = (WIRE_SUBNET, "198.18.80", "198.18.81", "198.18.82")
MAX_RAILS = len(RAIL_SUBNETS)
# Receive buffer for the wire's UDP sockets (see _wire_socket_buffers).
WIRE_SOCKET_BUFFER = 4 << 20
RMEM_DEFAULT = Path("/proc/sys/net/core/rmem_default")
AGENT_PORT = 7400
# Guest ports forwarded to host loopback: the agent, then what an operator
# or Prometheus would reach on a real node.
FORWARDED = {"agent": AGENT_PORT, "control": DEFAULT_CONTROL_PORT,
             "metrics_receiver": RECEIVER_METRICS_PORT, "metrics_sender": SENDER_METRICS_PORT}


class LabError(KvwireError, code="lab",
               hint="`kvctl lab status` shows the nodes; their consoles are in "
                    "/var/tmp/kvwire-lab"):
    """The QEMU lab could not be brought up, reached or taken down."""


@dataclass
class NodeSpec:
    name: str
    index: int

    @property
    def wire_address(self) -> str:
        return self.rail_address(0)

    def rail_address(self, rail: int) -> str:
        return f"{RAIL_SUBNETS[rail]}.{self.index}"

    def rail_mac(self, rail: int) -> str:
        # 0x57 ('W') for rail 0, as before rails existed; 0x58.. for the others.
        return f"52:54:00:4b:{0x57 + rail:02x}:{self.index:02x}"

    @property
    def mgmt_mac(self) -> str:
        return f"52:54:00:4b:4d:{self.index:02x}"


NODES = (NodeSpec("prefill", 1), NodeSpec("decode", 2))


@dataclass
class NodeState:
    name: str
    pid: int
    wire_address: str
    ports: dict[str, int]
    console: str
    rail_addresses: list[str] = field(default_factory=list)  # wire0, wire1, ...


@dataclass
class LabState:
    kernel: str
    started: float
    booted_seconds: float = 0.0
    nodes: dict[str, NodeState] = field(default_factory=dict)
    rails: int = 1

    def save(self) -> None:
        (STATE_DIR / "state.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls) -> LabState | None:
        try:
            raw = json.loads((STATE_DIR / "state.json").read_text())
        except (OSError, ValueError):
            return None
        nodes = {name: NodeState(**node) for name, node in raw.pop("nodes").items()}
        return cls(**raw, nodes=nodes)


# ------------------------------------------------------------ requirements


@dataclass(frozen=True)
class Requirement:
    what: str
    package: str
    present: Callable[[], bool]


def find_kernel() -> str | None:
    """The newest /boot kernel whose modules include rdma_rxe."""
    for image in sorted(Path("/boot").glob("vmlinuz-*"), reverse=True):
        version = image.name.removeprefix("vmlinuz-")
        modules = Path("/lib/modules") / version / "kernel/drivers/infiniband/sw/rxe"
        if modules.is_dir():
            return version
    return None


def _package_installed(package: str) -> bool:
    result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package],
                            capture_output=True, text=True)
    return result.stdout.endswith("install ok installed")


BUSYBOX = Path("/bin/busybox")


REQUIREMENTS = (
    Requirement("QEMU (qemu-system-x86_64)", "qemu-system-x86",
                lambda: shutil.which("qemu-system-x86_64") is not None),
    Requirement("a kernel image with rdma_rxe", "linux-image-amd64",
                lambda: find_kernel() is not None),
    # Debian's plain busybox is dynamically linked: useless in an initramfs.
    Requirement("a static busybox", "busybox-static",
                lambda: _package_installed("busybox-static")),
    Requirement("the rdma tool (iproute2)", "iproute2", lambda: shutil.which("rdma") is not None),
    Requirement("rdma-core userspace (libibverbs, rxe provider)", "rdma-core",
                lambda: Path("/etc/libibverbs.d/rxe.driver").exists()),
    Requirement("ibv_devinfo", "ibverbs-utils", lambda: shutil.which("ibv_devinfo") is not None),
    Requirement("perftest (ib_write_bw, ib_write_lat)", "perftest",
                lambda: shutil.which("ib_write_bw") is not None),
)


def missing_requirements() -> list[Requirement]:
    return [r for r in REQUIREMENTS if not r.present()]


def why_lab_cannot_run() -> str | None:
    """A reason QEMU cannot run here at all, or None."""
    if os.geteuid() != 0:
        return "the lab needs root (to read the kernel image and share the root filesystem)"
    missing = missing_requirements()
    if missing:
        packages = " ".join(sorted({r.package for r in missing}))
        return (f"missing: {', '.join(r.what for r in missing)} "
                f"(apt-get install {packages})")
    return None


# --------------------------------------------------------------- the lab


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Where the lab's host ports are drawn from when the kernel does not say.
LAB_PORTS_FALLBACK = (20000, 32767)
# QEMU failed to bind a port that was free a moment before: draw again.
PORT_TAKEN = "Could not set up host forwarding rule"
BOOT_ATTEMPTS = 3


def _lab_port_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range.

    A port is free when probed and QEMU binds it a moment later. Inside the
    ephemeral range any outgoing connection (a test polling a daemon, a DNS
    lookup) can take it in between: CI saw QEMU fail to forward a port that
    way. Below the range only an explicit bind can.
    """
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LAB_PORTS_FALLBACK
    return (max(1024, low - 12768), low - 1) if low > 2048 else LAB_PORTS_FALLBACK


def _free_ports(count: int, kind: socket.SocketKind) -> list[int]:
    """``count`` distinct loopback ports of ``kind`` (TCP or UDP) free right now,
    drawn from below the ephemeral range (all held until all are found)."""
    low, high = _lab_port_range()
    candidates = random.sample(range(low, high + 1), min(high - low + 1, count * 64))
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for port in candidates:
            probe = held.enter_context(socket.socket(socket.AF_INET, kind))
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise LabError(f"found only {len(ports)} of {count} free loopback ports in "
                   f"{low}-{high}", hint="stop what holds them, or free the range")


def _qemu_command(node: NodeSpec, kernel: str, ports: dict[str, int], python: str,
                  checkout: str, wire_ports: Sequence[tuple[int, int]]) -> list[str]:
    """QEMU for ``node``; ``wire_ports`` holds (local, remote) UDP ports per rail."""
    stage2 = Path(__file__).with_name("node-init.sh")
    rails = [f"kvwire.rail{rail}={node.rail_address(rail)}/24,{node.rail_mac(rail)}"
             for rail in range(len(wire_ports))]
    append = " ".join([
        "console=ttyS0", "panic=-1", "quiet", "loglevel=4",
        f"kvwire.node={node.name}", f"kvwire.init={stage2}",
        f"kvwire.rails={len(wire_ports)}", *rails,
        f"kvwire.mgmt={MGMT_NET}.15/24", f"kvwire.mgmtmac={node.mgmt_mac}",
        f"kvwire.gateway={MGMT_NET}.2", f"kvwire.python={python}",
        f"kvwire.checkout={checkout}", f"kvwire.agentport={AGENT_PORT}",
        f"kvwire.shared={SHARED_DIR}",
    ])
    forwards = ",".join(f"hostfwd=tcp:127.0.0.1:{ports[name]}-:{guest}"
                        for name, guest in FORWARDED.items())
    return [
        "qemu-system-x86_64", "-name", f"kvwire-lab-{node.name}",
        "-machine", "q35", "-accel", "tcg", "-cpu", "max", "-smp", "1",
        "-m", str(NODE_MEMORY_MIB), "-nodefaults", "-nographic", "-no-reboot",
        "-kernel", f"/boot/vmlinuz-{kernel}", "-initrd", str(STATE_DIR / "initramfs.cpio"),
        "-append", append,
        "-serial", f"file:{STATE_DIR / f'{node.name}.console'}",
        "-monitor", "none",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                   "multidevs=remap",
        # Read-write: where nodes leave logs and results for the host.
        "-virtfs", f"local,path={SHARED_DIR},mount_tag=labshare,security_model=none",
        *(arg for rail, ports in enumerate(wire_ports)
          for arg in _rail_devices(node, rail, *ports)),
        "-netdev", f"user,id=mgmt,net={MGMT_NET}.0/24,host={MGMT_NET}.2,restrict=on,{forwards}",
        "-device", f"virtio-net-pci,netdev=mgmt,mac={node.mgmt_mac},romfile=",
    ]


def _rail_devices(node: NodeSpec, rail: int, local: int, remote: int) -> list[str]:
    """One wire NIC: behind a PCIe root port of its own, so the probe finds a
    PCIe link under its rxe device. The wire is UDP on host loopback, one
    datagram per frame: like Ethernet it drops under overload (RoCE
    retransmits) and never blocks. A stream socket here deadlocked both
    QEMUs under heavy small-write traffic, each blocked writing to the other."""
    port = f"rp{rail + 1}"
    return [
        "-device", f"pcie-root-port,id={port},slot={rail + 1},chassis={rail + 1}",
        "-netdev", f"dgram,id=wire{rail},local.type=inet,local.host=127.0.0.1,"
                   f"local.port={local},remote.type=inet,remote.host=127.0.0.1,"
                   f"remote.port={remote}",
        "-device", f"virtio-net-pci,bus={port},netdev=wire{rail},mac={node.rail_mac(rail)},"
                   "romfile=",
    ]


def _venv_python() -> str:
    return sys.executable


def _checkout() -> str:
    return str(Path(__file__).resolve().parents[2])


def up(out: Any = sys.stdout, rails: int = 1) -> LabState:
    """Boot both nodes, each with ``rails`` wires; return once both agents answer."""
    if not 1 <= rails <= MAX_RAILS:
        raise LabError(f"the lab has 1 to {MAX_RAILS} rails, not {rails}",
                       hint="kvctl lab up --rails 2")
    existing = LabState.load()
    if existing is not None:
        running = [n.name for n in existing.nodes.values() if alive(n.pid)]
        if running:
            raise LabError(f"a lab is already up (nodes {', '.join(running)})",
                           hint="use it, or `kvctl lab down` first")
        print("kvctl lab: cleaning up after a lab that did not shut down", file=out)
        down(quiet=True)
    reason = why_lab_cannot_run()
    if reason:
        raise LabError(f"cannot start the lab: {reason}")
    kernel = find_kernel()
    assert kernel is not None
    for attempt in range(1, BOOT_ATTEMPTS + 1):
        try:
            return _boot(kernel, rails)
        except LabError as error:
            # Only a port taken between probe and bind is worth another draw.
            if PORT_TAKEN not in str(error) or attempt == BOOT_ATTEMPTS:
                raise
            print(f"kvctl lab: a forwarded port was taken while QEMU started "
                  f"(attempt {attempt} of {BOOT_ATTEMPTS}); drawing new ones", file=out)
    raise AssertionError("unreachable")


def _boot(kernel: str, rails: int) -> LabState:
    """One attempt at booting both nodes; on any failure the lab is taken down."""
    SHARED_DIR.mkdir(parents=True, exist_ok=True)
    initramfs.build(kernel, BUSYBOX, STATE_DIR / "initramfs.cpio")
    state = LabState(kernel=kernel, started=time.time(), rails=rails)
    started = time.monotonic()
    # Per rail, one UDP port per node: each node sends to the other's.
    free = iter(_free_ports(rails * len(NODES), socket.SOCK_DGRAM))
    wire = [[next(free) for _ in NODES] for _ in range(rails)]
    forwarded = iter(_free_ports(len(FORWARDED) * len(NODES), socket.SOCK_STREAM))
    with _wire_socket_buffers():
        try:
            for position, node in enumerate(NODES):
                ports = {name: next(forwarded) for name in FORWARDED}
                console = STATE_DIR / f"{node.name}.console"
                console.unlink(missing_ok=True)
                with open(STATE_DIR / f"{node.name}.qemu.log", "wb") as log:
                    # Its own session: the node outlives this command until `down`.
                    process = subprocess.Popen(
                        _qemu_command(node, kernel, ports, _venv_python(), _checkout(),
                                      [(pair[position], pair[1 - position]) for pair in wire]),
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True)
                state.nodes[node.name] = NodeState(
                    node.name, process.pid, node.wire_address, ports, str(console),
                    [node.rail_address(rail) for rail in range(rails)])
                state.save()
            for node in NODES:
                _wait_for(functools.partial(_ping, state, node.name), BOOT_TIMEOUT, node.name,
                          state)
        except BaseException:
            down(quiet=True)
            raise
    state.booted_seconds = time.monotonic() - started
    state.save()
    return state


@contextlib.contextmanager
def _wire_socket_buffers() -> Iterator[None]:
    """Give the wire's UDP sockets a 4 MiB receive buffer while QEMU makes them.

    QEMU's dgram backend takes the system default (208 KiB, about a hundred
    1 KiB frames). On the emulated nodes the receiving QEMU drains it in
    bursts, so a 2 MiB write overflowed it: measured, 26 RoCE retransmits
    (go-back-N, about 2,000 packets resent) in three 48 MiB pushes and a
    push 20 % slower than its neighbours. A RoCE fabric is lossless (PFC),
    and the lab should be closer to one. The default is restored once the
    nodes are up; without the right to change it, QEMU keeps the default.
    """
    try:
        previous = RMEM_DEFAULT.read_text().strip()
        RMEM_DEFAULT.write_text(str(max(WIRE_SOCKET_BUFFER, int(previous))))
    except (OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            RMEM_DEFAULT.write_text(previous)


def _wait_for(ready: Callable[[], bool], timeout: float, node: str, state: LabState) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        for other in state.nodes.values():
            if not alive(other.pid):
                raise LabError(f"node {other.name} stopped while booting:\n"
                               f"{console_tail(other)}",
                               hint="the console log above says why")
        time.sleep(0.25)
    raise LabError(f"node {node} not ready within {timeout:g} s:\n"
                   f"{console_tail(state.nodes[node])}",
                   hint="a loaded host boots slower under emulation; "
                   "KVWIRE_LAB_BOOT_TIMEOUT raises the limit")


def console_tail(node: NodeState, lines: int = 25) -> str:
    text = ""
    for path in (Path(node.console), STATE_DIR / f"{node.name}.qemu.log"):
        with contextlib.suppress(OSError):
            text += "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
    return text or "(no console output)"


def _connect(state: LabState, node: str, timeout: float = 2.0) -> socket.socket:
    if node not in state.nodes:
        raise LabError(f"no lab node named {node!r}", hint=f"nodes: {', '.join(state.nodes)}")
    return socket.create_connection(("127.0.0.1", state.nodes[node].ports["agent"]), timeout)


def _ping(state: LabState, node: str) -> bool:
    try:
        with _connect(state, node, 1.0) as sock:
            wire.send(sock, {"op": "ping"})
            reply = wire.recv(sock)
    except OSError:
        return False
    return reply is not None and reply.get("t") == "pong"


def require_state() -> LabState:
    state = LabState.load()
    if state is None or not any(alive(n.pid) for n in state.nodes.values()):
        raise LabError("no lab is up", hint="start one with `kvctl lab up`")
    return state


class Sink(Protocol):
    """Where a node's output goes as it arrives: a binary file, or a relay."""

    def write(self, data: bytes, /) -> object: ...

    def flush(self) -> None: ...


def exec_in(node: str, argv: Sequence[str], *, cwd: str | None = None,
            env: dict[str, str] | None = None, stdout: Sink | None = None,
            stderr: Sink | None = None, state: LabState | None = None) -> int:
    """Run ``argv`` in ``node``, streaming its output as it comes; its exit code."""
    state = state or require_state()
    bin_dir = str(Path(_venv_python()).parent)
    environment = {
        "PATH": f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root", "LANG": "C.UTF-8", "KVWIRE_LAB_NODE": node,
        **(env or {}),
    }
    out = stdout or sys.stdout.buffer
    err = stderr or sys.stderr.buffer
    try:
        sock = _connect(state, node)
    except OSError as exc:
        raise LabError(f"cannot reach the agent of node {node}: {exc}",
                       hint="`kvctl lab status` shows whether the node is up") from exc
    with sock:
        sock.settimeout(None)
        wire.send(sock, {"op": "exec", "argv": list(argv), "cwd": cwd or os.getcwd(),
                         "env": environment})
        while (msg := wire.recv(sock)) is not None:
            if msg["t"] == "out":
                out.write(msg["data"])
                out.flush()
            elif msg["t"] == "err":
                err.write(msg["data"])
                err.flush()
            elif msg["t"] == "exit":
                return int(msg["code"])
    raise LabError(f"node {node} went away while running {argv[0]}")


def run_in(node: str, argv: Sequence[str], **kwargs: Any) -> tuple[int, str, str]:
    """Like ``exec_in``, but collect stdout and stderr as text."""
    import io

    out, err = io.BytesIO(), io.BytesIO()
    code = exec_in(node, argv, stdout=out, stderr=err, **kwargs)
    return code, out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace")


def status() -> tuple[LabState | None, dict[str, str]]:
    """The lab's state and, per node, running / not answering / stopped."""
    state = LabState.load()
    if state is None:
        return None, {}
    health = {}
    for name, node in state.nodes.items():
        if not alive(node.pid):
            health[name] = "stopped"
        else:
            health[name] = "up" if _ping(state, name) else "not answering"
    return state, health


def down(quiet: bool = False, timeout: float = 15.0) -> list[str]:
    """Power the nodes off (or kill them) and remove every trace of the lab."""
    state = LabState.load()
    report: list[str] = []
    pids = [n.pid for n in state.nodes.values()] if state else []
    pids += _stray_qemus()
    if state is not None:
        for name in state.nodes:
            with contextlib.suppress(OSError), _connect(state, name, 1.0) as sock:
                wire.send(sock, {"op": "poweroff"})
                report.append(f"{name}: powered off")
    deadline = time.monotonic() + timeout
    for pid in set(pids):
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            report.append(f"pid {pid}: killed")
            gone_by = time.monotonic() + 10  # a killed QEMU takes a moment to exit
            while alive(pid) and time.monotonic() < gone_by:
                time.sleep(0.05)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    return report


def _stray_qemus() -> list[int]:
    """QEMU processes of this lab directory's lab, state file or not."""
    marker = str(STATE_DIR / "initramfs.cpio").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if cmdline and cmdline[0].endswith(b"qemu-system-x86_64") and marker in cmdline:
                pids.append(int(entry.name))
    return pids
