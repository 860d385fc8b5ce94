"""``VerbsTransport``: the devices, and queue pairs on the right one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...pool import SharedMemory
from ...rdma import check_memlock, devices, pick_gid, rail_gid, roce_devices
from ...units import format_size
from ..base import ErrorHandler, ImmediateHandler, Initiator, Responder, Transport
from .channel import VerbsInitiator
from .completions import Completion
from .device import Device
from .gids import GidReader
from .queue_pair import QP_TIMEOUT, QueuePair
from .responder import VerbsResponder


class VerbsTransport(Transport):
    name = "verbs"

    def __init__(self, device: str = "", gid_index: int = -1, receive_depth: int = 64,
                 per_lease_keys: bool = False, spin_us: float = 0.0,
                 ack_timeout: int = QP_TIMEOUT) -> None:
        self.per_lease_keys = per_lease_keys
        self._ack_timeout = ack_timeout
        self._device_name = device
        self._spin_seconds = spin_us / 1e6
        self._gid_index = gid_index
        self._receive_depth = receive_depth
        self._memory: SharedMemory | None = None
        self._devices: dict[str, Device] = {}
        self._gids = GidReader()

    @property
    def memory_size(self) -> int:
        assert self._memory is not None
        return self._memory.size

    async def start(self, memory: SharedMemory) -> None:
        # Register now, so a registration problem stops the daemon at start
        # instead of failing the first request: with the configured device, or
        # with every device that carries RoCE v2, since a peer's control
        # address decides which one a connection's data takes (a node with
        # several rails has one per rail). Each registration pins the pool
        # again, and the kernel counts every one against RLIMIT_MEMLOCK.
        names = [self._device_name] if self._device_name else roce_devices(
            table=self._gids.table())
        pinned = memory.size * max(1, len(names))
        check_memlock(pinned, f"the {format_size(memory.size)} pool"
                      + (f", registered with each of {', '.join(names)}," if len(names) > 1
                         else ""))
        self._memory = memory
        for name in names:
            self._device(name)

    def _device(self, name: str) -> Device:
        if name not in self._devices:
            assert self._memory is not None, "transport not started"
            self._devices[name] = Device(name, self._memory, self.per_lease_keys)
        return self._devices[name]

    def queue_pair(self, local_host: str, recv_depth: int,
                   on_completions: Callable[[list[Completion]], None],
                   per_lease_keys: bool = False, rail: str = "") -> QueuePair:
        """A QP on ``rail``'s device when given, else on the device whose GID
        holds ``local_host`` (the control path's, unless configured)."""
        table = self._gids.table()
        gid = (rail_gid(rail, table=table) if rail else
               pick_gid(local_host, self._device_name, self._gid_index, table=table))
        device = self._device(gid.device)
        # Windows where the device bounds them; else a PD per QP for its lease MRs.
        own_pd = per_lease_keys and not device.bounds_windows
        return QueuePair(device, gid, recv_depth, on_completions, self._spin_seconds,
                         own_pd, self._ack_timeout)

    def initiator(self, local_host: str, rail: str = "") -> Initiator:
        return VerbsInitiator(self, local_host, rail)

    def responder(
        self, local_host: str, on_immediate: ImmediateHandler, on_error: ErrorHandler
    ) -> Responder:
        return VerbsResponder(self, local_host, on_immediate, on_error, self._receive_depth)

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"transport": self.name,
                                     "devices": sorted(self._devices) or devices()}
        if self.per_lease_keys:
            described["lease_keys"] = sorted({
                "memory windows" if device.bounds_windows else "an MR per lease"
                for device in self._devices.values()})
        return described

    async def stop(self) -> None:
        for device in self._devices.values():
            device.close()
        self._devices.clear()
        self._gids.close()

