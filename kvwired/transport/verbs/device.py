"""One opened RDMA device: its context, protection domain and the pool's MR."""

from __future__ import annotations

import contextlib
import ctypes
import os

from ...errors import TransportError
from ...pool import SharedMemory
from ...rdma import NoRdmaPath
from . import core
from .core import VerbsError


def address_of(memory: SharedMemory) -> int:
    # The temporary ctypes view is dropped at once, so the mmap stays closable.
    return ctypes.addressof(ctypes.c_char.from_buffer(memory.map))


class Device:
    """One opened RDMA device: context, protection domain, the pool's MR."""

    def __init__(self, name: str, memory: SharedMemory, per_lease_keys: bool) -> None:
        self.name = name
        try:
            self.context = core.Context(name)
            self.pd = core.ProtectionDomain(self.context)
        except VerbsError as exc:
            raise TransportError(f"opening RDMA device {name} failed: {exc}",
                                 hint="`kvctl probe` lists the devices and their ports") from exc
        # Per-lease keys: the MR itself grants no remote access, only the
        # memory windows bound over it do, each to one lease's bytes.
        access = core.IBV_ACCESS_LOCAL_WRITE | (
            core.IBV_ACCESS_MW_BIND if per_lease_keys else core.IBV_ACCESS_REMOTE_WRITE)
        self.base = address_of(memory)
        # rdma_rxe (kernel 6.1) checks a write through a memory window against
        # the MR under it, not the window's own range: on a software device a
        # lease gets an MR of its own instead (registered over pages the pool
        # already pinned: ~9 ms for 48 MiB on an emulated lab node). Hardware
        # RNICs, which have a PCI device, bound windows as the spec says.
        self.bounds_windows = os.path.exists(f"/sys/class/infiniband/{name}/device")
        try:
            self.mr = core.MemoryRegion(self.pd, self.base, memory.size, access)
        except VerbsError as exc:
            self.context.close()
            raise TransportError(
                f"registering the {memory.size} B pool with {name} failed: {exc}",
                hint="check the locked-memory limit (ulimit -l / LimitMEMLOCK=)") from exc

    def port_mtu(self, port: int) -> int:
        state, mtu, _ = self._port(port)
        if state != core.IBV_PORT_ACTIVE:
            raise NoRdmaPath(f"{self.name} port {port} is not ACTIVE (state {state})",
                             hint="check the link under the device (ip link, rdma link)")
        return mtu

    def max_message(self, port: int) -> int:
        return self._port(port)[2]

    def _port(self, port: int) -> tuple[int, int, int]:
        try:
            return self.context.query_port(port)
        except VerbsError as exc:
            raise TransportError(f"querying {self.name} port {port} failed: {exc}") from exc

    def close(self) -> None:
        """Close the device and, first, everything opened on it (its queue
        pairs, completion queues, protection domains and registrations)."""
        with contextlib.suppress(VerbsError):
            self.context.close()
