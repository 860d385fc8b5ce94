"""An RC queue pair, driven RESET -> INIT -> RTR -> RTS with a check after each step."""

from __future__ import annotations

import contextlib
import ipaddress
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import TransportError
from ...rdma import GidEntry
from . import core
from .completions import Completion, CompletionQueue
from .core import VerbsError
from .device import Device
from .send_queue import SQ_DEPTH

QP_TIMEOUT = 14  # 4.096 us x 2^14 = 67 ms before a retry (``ack_timeout`` sets it)
# 7, the most the field holds: a lossy, reordering or briefly dark wire is
# ridden out by the queue pair's own retransmissions. rxe treats 7 as "retry
# forever" (rxe_comp.c: `if (qp->comp.retry_cnt != 7) qp->comp.retry_cnt--`),
# and a hardware RNIC as seven retries: either way a dead path is bounded by
# the link's progress check (a channel that places nothing for the stall
# bound fails: kvwired.sender.channels), and a channel that fails sooner is
# replaced under the live control connection (DataChannels._replace). With 6,
# rxe spent its budget under 5 % loss within 1.5 s (0.1 to 0.9 s at ack
# timeout 10), each queue pair placing about one 512 KiB layer before it
# failed, and a replacement costs 1.6 s on the lab's emulated nodes.
RETRY_COUNT = 7
RNR_RETRY = 6  # bounded; 7 would mean "retry forever", a silent hang
MIN_RNR_TIMER = 12
MTU_BYTES = {core.IBV_MTU_256: 256, core.IBV_MTU_512: 512, core.IBV_MTU_1024: 1024,
             core.IBV_MTU_2048: 2048, core.IBV_MTU_4096: 4096}
STATE_NAMES = {core.IBV_QPS_RESET: "RESET", core.IBV_QPS_INIT: "INIT", core.IBV_QPS_RTR: "RTR",
               core.IBV_QPS_RTS: "RTS", core.IBV_QPS_ERR: "ERR"}


@dataclass
class Endpoint:
    """What one side tells the other to connect their queue pairs."""

    qpn: int
    psn: int
    gid: str
    mtu: int

    def to_wire(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "gid": self.gid, "mtu": self.mtu}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Endpoint:
        try:
            return cls(int(data["qpn"]), int(data["psn"]), str(data["gid"]), int(data["mtu"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"peer sent unusable verbs parameters: {data!r}") from exc


class QueuePair:
    """An RC QP and its CQ, driven RESET -> INIT -> RTR -> RTS with checks."""

    def __init__(self, device: Device, gid: GidEntry, recv_depth: int,
                 on_completions: Callable[[list[Completion]], None], spin_seconds: float,
                 own_pd: bool = False, ack_timeout: int = QP_TIMEOUT) -> None:
        self.device = device
        self.ack_timeout = ack_timeout
        self.gid = gid
        self.mtu = device.port_mtu(gid.port)
        try:
            # A protection domain of its own (a lease MR's key then answers to
            # this QP alone), with a one-page MR for the receives to point at.
            self.pd = core.ProtectionDomain(device.context) if own_pd else device.pd
            self.receive_mr = (core.MemoryRegion(self.pd, device.base, 4096,
                                                 core.IBV_ACCESS_LOCAL_WRITE)
                               if own_pd else None)
        except VerbsError as exc:
            self._close_pd()
            raise TransportError(f"a protection domain for a queue pair on {device.name} "
                                 f"failed: {exc}") from exc
        self.receive_lkey = (self.receive_mr or device.mr).lkey
        self.cq = CompletionQueue(device, SQ_DEPTH + recv_depth + 1, on_completions,
                                  spin_seconds)
        try:
            self.qp = core.QueuePair(self.pd, self.cq.cq, SQ_DEPTH, max(recv_depth, 1))
        except VerbsError as exc:
            self.cq.close()
            self._close_pd()
            raise TransportError(f"creating a queue pair on {device.name} failed: {exc}") from exc
        self.psn = random.randrange(1 << 24)
        try:
            self._to_init()
        except TransportError:
            self.close()
            raise

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.qp.qp_num, self.psn, self.gid.gid.exploded, self.mtu)

    def _step(self, change: Callable[[], None], step: str, expected: int, detail: str) -> None:
        """One transition, then the state read back: a device that took the
        attributes and did not move is named with them."""
        try:
            change()
            state = self.qp.state()
        except VerbsError as exc:
            raise TransportError(f"QP {self.qp.qp_num} {step} failed: {exc}",
                                 hint=f"attributes: {detail}") from exc
        if state != expected:
            raise TransportError(
                f"QP {self.qp.qp_num} {step}: state is {STATE_NAMES.get(state, state)} after "
                f"the transition, expected {STATE_NAMES[expected]}",
                hint=f"attributes: {detail}")

    def _to_init(self) -> None:
        access = core.IBV_ACCESS_REMOTE_WRITE | core.IBV_ACCESS_LOCAL_WRITE
        self._step(lambda: self.qp.to_init(self.gid.port, access), "RESET->INIT",
                   core.IBV_QPS_INIT, f"port {self.gid.port}, pkey index 0, access remote write")

    def connect(self, remote: Endpoint) -> None:
        """INIT -> RTR -> RTS towards ``remote``."""
        mtu = min(self.mtu, remote.mtu)
        try:
            dgid = ipaddress.IPv6Address(remote.gid).packed
        except ValueError as exc:
            raise TransportError(f"peer GID {remote.gid!r} is unusable: {exc}") from exc
        self._step(lambda: self.qp.to_rtr(self.gid.port, mtu, remote.qpn, remote.psn, dgid,
                                          self.gid.index, MIN_RNR_TIMER),
                   "INIT->RTR", core.IBV_QPS_RTR,
                   f"remote QPN {remote.qpn}, remote PSN {remote.psn}, remote GID "
                   f"{remote.gid}, local GID index {self.gid.index}, path MTU "
                   f"{MTU_BYTES.get(mtu, mtu)}")
        self._step(lambda: self.qp.to_rts(self.psn, self.ack_timeout, RETRY_COUNT, RNR_RETRY),
                   "RTR->RTS", core.IBV_QPS_RTS,
                   f"local PSN {self.psn}, timeout {self.ack_timeout}, retry {RETRY_COUNT}, "
                   f"rnr retry {RNR_RETRY}")

    def close(self) -> None:
        with contextlib.suppress(VerbsError):
            self.qp.close()
        self.cq.close()
        self._close_pd()

    def _close_pd(self) -> None:
        pd = getattr(self, "pd", None)
        if pd is not None and pd is not self.device.pd:
            # Closing the PD closes what was registered in it (the lease MRs).
            with contextlib.suppress(VerbsError):
                pd.close()


class QueuePairs(Protocol):
    """Where an initiator or a responder gets its queue pair (the transport)."""

    per_lease_keys: bool

    @property
    def memory_size(self) -> int: ...

    def queue_pair(self, local_host: str, recv_depth: int,
                   on_completions: Callable[[list[Completion]], None],
                   per_lease_keys: bool = False, rail: str = "") -> QueuePair: ...
