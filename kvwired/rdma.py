"""RDMA facts read from the system: devices, GID tables, memlock.

Everything here reads sysfs, resource limits and the routing table only (no
verbs calls), so it works, and is tested, on machines without RDMA. The
choices (``pick_gid``, ``rail_gid``) also take a table read another way.
"""

from __future__ import annotations

import ipaddress
import resource
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, TransportError
from .units import format_size

SYSFS = Path("/sys/class/infiniband")
ROCE_V2 = "RoCE v2"
# Queue pairs, completion queues and receive rings pin a little memory of
# their own on top of the pools.
MEMLOCK_SLACK = 16 << 20


class MemlockTooLow(ConfigError, code="memlock",
                   hint="raise the locked-memory limit (LimitMEMLOCK=infinity in the unit, "
                        "or ulimit -l)"):
    """RLIMIT_MEMLOCK is below what the pools must pin."""


class NoRdmaPath(TransportError, code="no_rdma_path",
                 hint="`kvctl probe --to PEER` shows the devices and GIDs; or use "
                      "transport = \"tcp\""):
    """No usable device, port or GID for the address at hand."""


@dataclass(frozen=True)
class GidEntry:
    """One row of a port's GID table, with the netdev it belongs to."""

    device: str
    port: int
    index: int
    gid: ipaddress.IPv6Address
    type: str
    netdev: str

    @property
    def ipv4(self) -> str | None:
        mapped = self.gid.ipv4_mapped
        return None if mapped is None else str(mapped)

    def __str__(self) -> str:
        return (f"{self.device} port {self.port} index {self.index}: {self.gid} "
                f"({self.type}, {self.netdev or 'no netdev'})")


def devices(root: Path = SYSFS) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def roce_devices(root: Path = SYSFS, table: Sequence[GidEntry] | None = None) -> list[str]:
    """Devices with a RoCE v2 GID: those a kvwire data path can run over."""
    entries = gid_table(root) if table is None else table
    return sorted({entry.device for entry in entries if entry.type == ROCE_V2})


def active_roce_devices(root: Path = SYSFS) -> list[str]:
    """Devices with a RoCE v2 GID on a port that is ACTIVE: ``rails = ["auto"]``."""
    active = set()
    for entry in gid_table(root):
        state = _read(root / entry.device / "ports" / str(entry.port) / "state") or ""
        if entry.type == ROCE_V2 and state.endswith("ACTIVE"):
            active.add(entry.device)
    return sorted(active)


def rail_gid(device: str, root: Path = SYSFS, table: Sequence[GidEntry] | None = None
             ) -> GidEntry:
    """The GID a data channel on rail ``device`` uses: its first IPv4 RoCE v2 entry
    (the address the rail's netdev holds), else its first RoCE v2 entry. From
    ``table`` when given (the transport asks the devices), else sysfs."""
    table = gid_table(root) if table is None else table
    entries = [e for e in table if e.device == device and e.type == ROCE_V2]
    if not entries:
        found = ", ".join(roce_devices(table=table)) or "none"
        raise NoRdmaPath(f"rail {device} has no RoCE v2 GID",
                         hint=f"devices with one: {found}; give its netdev an address, or "
                              "leave the device out of `rails`")
    with_ipv4 = [e for e in entries if e.ipv4 is not None]
    return (with_ipv4 or entries)[0]


def source_address(peer: str) -> str:
    """The local address this host's routes reach ``peer`` from (no packet is sent)."""
    family = socket.AF_INET6 if ipaddress.ip_address(peer).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 4791))  # the RoCE v2 port; connect() on UDP only routes
        return str(probe.getsockname()[0])


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # unpopulated GID entries answer EINVAL
        return None


def gid_table(root: Path = SYSFS) -> list[GidEntry]:
    """Every populated GID entry of every port of every device.

    This opens a file per entry, populated or not: rdma_rxe has 1,024 a port,
    and a scan took 1 to 2.6 s on an emulated lab node. The verbs transport,
    which needs the table for every queue pair, asks the devices instead
    (kvwired.transport.verbs.gids); this reader serves everything that runs
    once, or where verbs cannot (kvctl probe, tests on a fake sysfs)."""
    entries = []
    for device in devices(root):
        for port_dir in sorted((root / device / "ports").iterdir()):
            for gid_file in sorted((port_dir / "gids").iterdir(), key=lambda p: int(p.name)):
                raw = _read(gid_file)
                if raw is None:
                    continue
                gid = ipaddress.IPv6Address(raw)
                if gid == ipaddress.IPv6Address(0):
                    continue
                gid_type = _read(port_dir / "gid_attrs" / "types" / gid_file.name) or "?"
                netdev = _read(port_dir / "gid_attrs" / "ndevs" / gid_file.name) or ""
                entries.append(GidEntry(device, int(port_dir.name), int(gid_file.name), gid,
                                        gid_type, netdev))
    return entries


def pick_gid(local_ip: str, device: str = "", gid_index: int = -1,
             root: Path = SYSFS, table: Sequence[GidEntry] | None = None) -> GidEntry:
    """The RoCE v2 GID through which ``local_ip`` reaches its peer.

    By default: the RoCE v2 entry whose address is ``local_ip`` (the address
    the control connection uses, so the data path follows the same netdev).
    ``device`` and ``gid_index`` override the choice. From ``table`` when
    given, else sysfs.
    """
    table = gid_table(root) if table is None else table
    if not table:
        raise NoRdmaPath(
            "no RDMA device with a populated GID table on this host",
            hint="load a driver, or for Soft-RoCE: rdma link add rxe0 type rxe netdev IFACE; "
            "or use transport = \"tcp\"")
    listing = "; ".join(str(e) for e in table)
    if gid_index >= 0:
        chosen = [e for e in table if e.index == gid_index and (not device or e.device == device)]
        if not chosen:
            raise NoRdmaPath(f"no GID index {gid_index}{' on ' + device if device else ''}",
                             hint=f"populated entries: {listing}")
        if chosen[0].type != ROCE_V2:
            raise NoRdmaPath(f"GID {chosen[0]} is {chosen[0].type}, not {ROCE_V2}",
                             hint=f"pick a RoCE v2 entry: {listing}")
        return chosen[0]
    wanted = ipaddress.ip_address(local_ip)
    for entry in table:
        if entry.type != ROCE_V2 or (device and entry.device != device):
            continue
        address = entry.gid.ipv4_mapped if wanted.version == 4 else entry.gid
        if address == wanted:
            return entry
    raise NoRdmaPath(
        f"no RoCE v2 GID for local address {local_ip}"
        f"{' on device ' + device if device else ''}",
        hint=f"the data path must use the netdev the control connection uses; "
        f"bind rxe/the RNIC to it or set rdma_device and gid_index. Entries: {listing}")


def check_memlock(needed: int, what: str) -> None:
    """Refuse early, and say how to fix it, when pinning ``needed`` bytes would fail."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = needed + MEMLOCK_SLACK
    if soft != resource.RLIM_INFINITY and soft < need:
        raise MemlockTooLow(
            f"the locked-memory limit (RLIMIT_MEMLOCK) is {format_size(soft)}, but {what} "
            f"must pin {format_size(need)} for RDMA",
            hint="under systemd set LimitMEMLOCK=infinity in the unit (limits.conf does not "
            "apply to services); by hand run `ulimit -l unlimited` (as root) first; or "
            "shrink the pool")


def rdma_available(root: Path = SYSFS) -> bool:
    """Whether the verbs transport can run here: a device and pyverbs."""
    if not devices(root):
        return False
    try:
        import pyverbs.device  # noqa: F401
    except ImportError:
        return False
    return True
