"""``kvctl probe``: what this node offers the data path, and what would stop it.

Devices and ports (state, active MTU), the GID table with the entry kvwire
would pick, the locked-memory limit against the configured pools, and the
PCIe link under each device: for a hardware RNIC its own PCI function, for
Soft-RoCE the function of the netdev it is bound to (rxe -> netdev -> PCI).
The PCIe payload ceiling bounds what any transfer can reach on this node.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import resource
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvwired.addresses import control_address
from kvwired.config import ReceiverConfig, SenderConfig, build
from kvwired.errors import KvwireError
from kvwired.rdma import MEMLOCK_SLACK, ROCE_V2, SYSFS, GidEntry, devices, gid_table, pick_gid
from kvwired.units import format_size

NET = Path("/sys/class/net")
BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# Line encoding per PCIe generation's transfer rate: 8b/10b up to 5 GT/s,
# 128b/130b from 8 GT/s, 1b/1b flits (FLIT mode, 242/256 usable) at 64 GT/s.
ENCODING = {2.5: 8 / 10, 5.0: 8 / 10, 8.0: 128 / 130, 16.0: 128 / 130, 32.0: 128 / 130,
            64.0: 242 / 256}
DEFAULT_CONFIGS = (Path("/etc/kvwire/receiver.toml"), Path("/etc/kvwire/sender.toml"))


@dataclass
class PortInfo:
    port: int
    state: str
    active_mtu: int | None
    link_layer: str
    rate: str


@dataclass
class PcieLink:
    bdf: str
    speed_gts: float | None
    width: int | None
    max_speed_gts: float | None
    max_width: int | None
    numa_node: int | None
    ceiling_gbps: float | None


@dataclass
class DeviceInfo:
    name: str
    kind: str  # "hardware" or "soft (rxe, on NETDEV)"
    netdev: str
    ports: list[PortInfo]
    pcie: PcieLink | None
    pcie_note: str


@dataclass
class Probe:
    devices: list[DeviceInfo]
    gids: list[dict[str, Any]]
    picked: dict[str, Any] | None
    picked_note: str
    memlock_bytes: int | None  # None: unlimited
    memlock_needed: int
    memlock_ok: bool
    memlock_note: str
    pools: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _gts(text: str | None) -> float | None:
    # "8.0 GT/s PCIe" (newer kernels) or "8 GT/s"; "Unknown" on virtual links.
    if not text:
        return None
    try:
        return float(text.split()[0])
    except ValueError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def pcie_ceiling_gbps(speed_gts: float | None, width: int | None) -> float | None:
    """Raw data rate of the link after line encoding (before TLP overheads)."""
    if speed_gts is None or not width:
        return None
    return speed_gts * width * ENCODING.get(speed_gts, 128 / 130)


def pcie_link(function: Path) -> PcieLink:
    # A function without link attributes of its own (some emulated NICs)
    # shares its link with the port above it, which reports it.
    link = function
    while not (link / "current_link_speed").exists() and BDF.match(link.parent.name):
        link = link.parent
    speed, width = _gts(_read(link / "current_link_speed")), _int(
        _read(link / "current_link_width"))
    numa = _int(_read(function / "numa_node"))
    return PcieLink(
        bdf=function.name, speed_gts=speed, width=width,
        max_speed_gts=_gts(_read(link / "max_link_speed")),
        max_width=_int(_read(link / "max_link_width")),
        numa_node=None if numa is None or numa < 0 else numa,
        ceiling_gbps=pcie_ceiling_gbps(speed, width))


def _pci_function(path: Path) -> Path | None:
    """The PCI function under a sysfs ``device`` link.

    The link may point below the function (virtio-net: .../0000:01:00.0/virtio3),
    so the nearest ancestor named like a PCI address is the function.
    """
    device = path / "device"
    if not device.exists():
        return None
    for candidate in (device.resolve(), *device.resolve().parents):
        if BDF.match(candidate.name):
            return candidate
    return None


def _port_mtu(name: str, port: int) -> int | None:
    try:
        from pyverbs.device import Context

        context = Context(name=name)
        try:
            mtu = int(context.query_port(port).active_mtu)
        finally:
            context.close()
        return {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}.get(mtu)
    except Exception:  # no pyverbs, or the device refuses: report unknown
        return None


def device_info(name: str, root: Path = SYSFS, net: Path = NET) -> DeviceInfo:
    base = root / name
    ports = []
    netdev = ""
    for port_dir in sorted((base / "ports").iterdir(), key=lambda p: int(p.name)):
        port = int(port_dir.name)
        ports.append(PortInfo(port, (_read(port_dir / "state") or "?").split(": ")[-1],
                              _port_mtu(name, port), _read(port_dir / "link_layer") or "?",
                              _read(port_dir / "rate") or "?"))
        netdev = netdev or _read(port_dir / "gid_attrs" / "ndevs" / "0") or ""
    netdev = _read(base / "parent") or netdev
    function = _pci_function(base)
    if function is not None:
        return DeviceInfo(name, "hardware", netdev, ports, pcie_link(function), "")
    kind = f"soft (on {netdev})" if netdev else "soft"
    function = _pci_function(net / netdev) if netdev else None
    if function is None:
        note = (f"no PCIe link: {netdev or name} is a virtual device" if netdev
                else "no PCIe link and no netdev under this device")
        return DeviceInfo(name, kind, netdev, ports, None, note)
    return DeviceInfo(name, kind, netdev, ports, pcie_link(function),
                      f"the PCIe link of {netdev}, the netdev {name} runs on")


def route_source(address: str) -> str:
    """The local address the kernel would use to reach ``address``."""
    host, port = control_address(address)
    family = socket.AF_INET6 if ipaddress.ip_address(socket.gethostbyname(host)).version == 6 \
        else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))  # a UDP connect only routes: nothing is sent
        return str(sock.getsockname()[0])


def _pools(config_paths: list[Path]) -> dict[str, int]:
    pools = {}
    for path in config_paths:
        if not path.exists():
            continue
        import tomllib

        data = tomllib.loads(path.read_text())
        if "pool_size" in data or path.name.startswith("receiver"):
            config = build(ReceiverConfig, data)
            pools[f"receive pool ({path})"] = config.pool_size
        else:
            sender = build(SenderConfig, data)
            pools[f"staging pool ({path})"] = sender.staging_size
    return pools or {"receive pool (default)": build(ReceiverConfig, {}).pool_size}


def probe(device: str = "", to: str | None = None, configs: list[Path] | None = None,
          root: Path = SYSFS, net: Path = NET) -> Probe:
    names = [d for d in devices(root) if not device or d == device]
    if device and not names:
        raise KvwireError(f"no RDMA device named {device!r}",
                          hint=f"devices here: {', '.join(devices(root)) or 'none'}")
    infos = [device_info(name, root, net) for name in names]
    table = [e for e in gid_table(root) if not device or e.device == device]
    picked, note = _pick(table, device, to, root)
    pools = _pools(configs if configs is not None else
                   [p for p in DEFAULT_CONFIGS if p.exists()])
    # One daemon per node pins its own pool; the largest decides.
    needed = max(pools.values()) + MEMLOCK_SLACK
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = None if soft == resource.RLIM_INFINITY else soft
    ok = limit is None or limit >= needed or not names
    memlock_note = "not needed: without an RDMA device the daemons run over tcp" if not names \
        else "" if ok else (
        f"too low: the daemon must pin {format_size(needed)}; under systemd set "
        "LimitMEMLOCK=infinity (the shipped units do), by hand `ulimit -l unlimited` as root")
    return Probe(infos, [_gid_dict(e, picked) for e in table],
                 None if picked is None else _gid_dict(picked, picked), note, limit, needed, ok,
                 memlock_note, pools)


def _pick(table: list[GidEntry], device: str, to: str | None,
          root: Path) -> tuple[GidEntry | None, str]:
    if not table:
        return None, "no populated GID entries: no RDMA path on this node"
    if to:
        try:
            local = route_source(to)
            return pick_gid(local, device, root=root), f"for traffic from {local} to {to}"
        except (OSError, KvwireError) as exc:
            return None, f"no entry for traffic to {to}: {exc}"
    v2 = [e for e in table if e.type == ROCE_V2 and e.ipv4]
    if not v2:
        return None, "no RoCE v2 entry with an IPv4 address: give --to for IPv6 peers"
    return v2[0], (f"for traffic from {v2[0].ipv4}; kvwire picks the RoCE v2 entry of the "
                   "address its control connection uses (--to ADDRESS to check a peer)")


def _gid_dict(entry: GidEntry, picked: GidEntry | None) -> dict[str, Any]:
    return {"device": entry.device, "port": entry.port, "index": entry.index,
            "gid": str(entry.gid), "type": entry.type, "netdev": entry.netdev,
            "ipv4": entry.ipv4, "picked": entry == picked}


def render(result: Probe) -> str:
    from . import table

    lines = []
    if not result.devices:
        lines.append("RDMA devices: none (kvwire runs over TCP here; for Soft-RoCE: "
                     "rdma link add rxe0 type rxe netdev IFACE)")
    for dev in result.devices:
        lines.append(f"device {dev.name}: {dev.kind}")
        for port in dev.ports:
            mtu = f"{port.active_mtu} B" if port.active_mtu else "unknown (no pyverbs)"
            lines.append(f"  port {port.port}: {port.state}, active MTU {mtu}, "
                         f"{port.link_layer}, rate {port.rate}")
        link = dev.pcie
        if link is None:
            lines.append(f"  PCIe: {dev.pcie_note}")
        else:
            speed = f"{link.speed_gts:g} GT/s" if link.speed_gts else "unknown speed"
            width = f"x{link.width}" if link.width else "x?"
            best = (f" (device max {link.max_speed_gts:g} GT/s x{link.max_width})"
                    if link.max_speed_gts and link.max_width
                    and (link.max_speed_gts, link.max_width) != (link.speed_gts, link.width)
                    else "")
            ceiling = (f"{link.ceiling_gbps:.1f} Gb/s payload ceiling"
                       if link.ceiling_gbps else "no ceiling known")
            numa = f"NUMA node {link.numa_node}" if link.numa_node is not None else "no NUMA node"
            lines.append(f"  PCIe {link.bdf}: {speed} {width}{best}, {ceiling}, {numa}")
            if dev.pcie_note:
                lines.append(f"    ({dev.pcie_note})")
    if result.gids:
        lines.append("\nGID table:")
        lines.append(table.render(
            ["device", "port", "index", "gid", "type", "netdev", "kvwire"],
            [[g["device"], g["port"], g["index"], g["gid"], g["type"], g["netdev"],
              "<- picks" if g["picked"] else ""] for g in result.gids]))
    lines.append(f"GID choice: {result.picked_note}")
    limit = "unlimited" if result.memlock_bytes is None else format_size(result.memlock_bytes)
    pools = ", ".join(f"{name} {format_size(size)}" for name, size in result.pools.items())
    verdict = result.memlock_note or "ok"
    lines.append(f"\nmemlock (this shell): {limit}; needs {format_size(result.memlock_needed)} "
                 f"for {pools}: {verdict}")
    if os.geteuid() != 0 and not result.memlock_ok:
        lines.append("  (raising the hard limit needs root)")
    return "\n".join(lines)


# ------------------------------------------------------------- the command


def add_parser(commands: Any) -> None:
    probe = commands.add_parser("probe", help="RDMA devices, GIDs, memlock and the PCIe link")
    probe.set_defaults(handler=main)
    probe.add_argument("--dev", default="", help="only this RDMA device")
    probe.add_argument("--to", help="a peer address: show the GID kvwire would use towards it")
    probe.add_argument("--config", action="append", type=Path,
                       help="daemon config(s) whose pools memlock must cover (default: "
                       "/etc/kvwire/*.toml if present)")
    probe.add_argument("--json", action="store_true")
    probe.add_argument("--out", type=Path, help="also write probe.json into this directory")


def main(args: argparse.Namespace) -> int:
    result = probe(args.dev, args.to, args.config)
    document = json.dumps(result.to_dict(), indent=2)
    print(document if args.json else render(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe.json").write_text(document + "\n")
    return 0
