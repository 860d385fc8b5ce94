"""One opened RDMA device: its context, protection domain and the pool's MR."""

from __future__ import annotations

import contextlib
import ctypes
import os

import pyverbs.enums as e
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError

from ...errors import TransportError
from ...pool import SharedMemory
from ...rdma import NoRdmaPath


def address_of(memory: SharedMemory) -> int:
    # The temporary ctypes view is dropped at once, so the mmap stays closable.
    return ctypes.addressof(ctypes.c_char.from_buffer(memory.map))



class Device:
    """One opened RDMA device: context, protection domain, the pool's MR."""

    def __init__(self, name: str, memory: SharedMemory, per_lease_keys: bool) -> None:
        self.name = name
        self.context = Context(name=name)
        self.pd = PD(self.context)
        # Per-lease keys: the MR itself grants no remote access, only the
        # memory windows bound over it do, each to one lease's bytes.
        access = e.IBV_ACCESS_LOCAL_WRITE | (
            e.IBV_ACCESS_MW_BIND if per_lease_keys else e.IBV_ACCESS_REMOTE_WRITE)
        self.base = address_of(memory)
        # rdma_rxe (kernel 6.1) checks a write through a memory window against
        # the MR under it, not the window's own range: on a software device a
        # lease gets an MR of its own instead (registered over pages the pool
        # already pinned: ~9 ms for 48 MiB on an emulated lab node). Hardware
        # RNICs, which have a PCI device, bound windows as the spec says.
        self.bounds_windows = os.path.exists(f"/sys/class/infiniband/{name}/device")
        try:
            self.mr = MR(self.pd, memory.size, access, address=self.base)
        except PyverbsError as exc:
            raise TransportError(
                f"registering the {memory.size} B pool with {name} failed: {exc}",
                hint="check the locked-memory limit (ulimit -l / LimitMEMLOCK=)") from exc

    def port_mtu(self, port: int) -> int:
        attr = self.context.query_port(port)
        if attr.state != e.IBV_PORT_ACTIVE:
            raise NoRdmaPath(f"{self.name} port {port} is not ACTIVE (state {attr.state})",
                             hint="check the link under the device (ip link, rdma link)")
        return int(attr.active_mtu)

    def max_message(self, port: int) -> int:
        return int(self.context.query_port(port).max_msg_sz)

    def close(self) -> None:
        for resource in (self.mr, self.pd, self.context):
            with contextlib.suppress(PyverbsError):
                resource.close()

