"""GID tables asked of the devices themselves, one verbs call per device.

Every queue pair, on either side, picks its GID from the table, so a link of
four channels reads it eight times. kvwired.rdma's sysfs reader opens a
file per entry, populated or not (rdma_rxe has 1,024 a port): on an
emulated lab node one scan took 1 to 2.6 s, on the event loop, and a
sender's handshake waited 17 to 52 s for its channels while a push ran
beside it. ``ibv_query_gid_table`` returns the populated entries only: 1 to
9 ms for the same table on the same node.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from typing import Any, Protocol

import pyverbs.enums as e
from pyverbs.device import Context
from pyverbs.pyverbs_error import PyverbsError

from ...rdma import ROCE_V2, GidEntry, devices

# sysfs names both the IB and RoCE v1 types "IB/RoCE v1"; listings read alike.
GID_TYPE_NAMES = {int(e.IBV_GID_TYPE_IB): "IB/RoCE v1",
                  int(e.IBV_GID_TYPE_ROCE_V1): "IB/RoCE v1",
                  int(e.IBV_GID_TYPE_ROCE_V2): ROCE_V2}


class RawGid(Protocol):
    """What pyverbs' ``GIDEntry`` carries that kvwire reads."""

    gid_index: int
    port_num: int
    gid_type: int
    ndev_ifindex: int

    def gid_str(self) -> str: ...


def entry_of(device: str, raw: RawGid) -> GidEntry | None:
    """pyverbs' entry as kvwire's (None for an all-zero GID, as sysfs skips it)."""
    gid = ipaddress.IPv6Address(raw.gid_str())
    if gid == ipaddress.IPv6Address(0):
        return None
    netdev = ""
    if raw.ndev_ifindex:
        with contextlib.suppress(OSError):  # the netdev went away meanwhile
            netdev = socket.if_indextoname(raw.ndev_ifindex)
    return GidEntry(device, int(raw.port_num), int(raw.gid_index), gid,
                    GID_TYPE_NAMES.get(int(raw.gid_type), "?"), netdev)


class GidReader:
    """Every device's populated GIDs, each device's context kept open between
    reads (opening one took 0.27 s on a lab node; querying it, milliseconds).
    Devices are listed afresh each time, so one added later is found, and
    addresses added to a netdev show at the next read."""

    def __init__(self) -> None:
        self._opened: dict[str, tuple[Any, int]] = {}  # device -> (context, table size)

    def table(self) -> list[GidEntry]:
        entries: list[GidEntry] = []
        for name in devices():
            try:
                context, size = self._open(name)
                raws = context.query_gid_table(size)
            except PyverbsError:
                self._forget(name)  # gone or not answering: as sysfs, it has no entries
                continue
            entries.extend(entry for raw in raws if (entry := entry_of(name, raw)))
        return sorted(entries, key=lambda entry: (entry.device, entry.port, entry.index))

    def _open(self, name: str) -> tuple[Any, int]:
        if name not in self._opened:
            context = Context(name=name)
            ports = range(1, context.query_device().phys_port_cnt + 1)
            self._opened[name] = (context, sum(context.query_port(port).gid_tbl_len
                                               for port in ports))
        return self._opened[name]

    def _forget(self, name: str) -> None:
        opened = self._opened.pop(name, None)
        if opened is not None:
            with contextlib.suppress(PyverbsError):
                opened[0].close()

    def close(self) -> None:
        for name in list(self._opened):
            self._forget(name)
