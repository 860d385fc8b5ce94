"""An RC queue pair, driven RESET -> INIT -> RTR -> RTS with a check after each step."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QPAttr, QPCap, QPEx, QPInitAttrEx

from ...errors import TransportError
from ...rdma import GidEntry
from .completions import CompletionQueue
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
MTU_BYTES = {e.IBV_MTU_256: 256, e.IBV_MTU_512: 512, e.IBV_MTU_1024: 1024,
             e.IBV_MTU_2048: 2048, e.IBV_MTU_4096: 4096}
STATE_NAMES = {e.IBV_QPS_RESET: "RESET", e.IBV_QPS_INIT: "INIT", e.IBV_QPS_RTR: "RTR",
               e.IBV_QPS_RTS: "RTS", e.IBV_QPS_ERR: "ERR"}


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
                 on_completions: Callable[[list[Any]], None], spin_seconds: float,
                 windows: bool = False, own_pd: bool = False,
                 ack_timeout: int = QP_TIMEOUT) -> None:
        self.device = device
        self.ack_timeout = ack_timeout
        self.gid = gid
        # A protection domain of its own (a lease MR's key then answers to
        # this QP alone), with a one-page MR for the receives to point at.
        self.pd = PD(device.context) if own_pd else device.pd
        self.receive_mr = (MR(self.pd, 4096, e.IBV_ACCESS_LOCAL_WRITE, address=device.base)
                           if own_pd else None)
        self.receive_lkey = int(self.receive_mr.lkey if self.receive_mr else device.mr.lkey)
        self.mtu = device.port_mtu(gid.port)
        self.cq = CompletionQueue(device, SQ_DEPTH + recv_depth + 1, on_completions,
                                   spin_seconds)
        try:
            init = QPInitAttrEx(
                qp_type=e.IBV_QPT_RC, pd=self.pd, scq=self.cq.cq, rcq=self.cq.cq,
                cap=QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=max(recv_depth, 1),
                          max_send_sge=1, max_recv_sge=1),
                comp_mask=e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
                send_ops_flags=e.IBV_QP_EX_WITH_RDMA_WRITE
                | e.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
                | (e.IBV_QP_EX_WITH_BIND_MW | e.IBV_QP_EX_WITH_LOCAL_INV if windows else 0),
                sq_sig_all=0)
            self.qp = QPEx(device.context, init)
        except PyverbsError as exc:
            self.cq.close()
            self._close_pd()
            raise TransportError(f"creating a queue pair on {device.name} failed: {exc}") from exc
        self.psn = random.randrange(1 << 24)
        self._to_init()

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.qp.qp_num, self.psn, self.gid.gid.exploded, self.mtu)

    def _modify(self, attr: Any, mask: int, step: str, expected: int, detail: str) -> None:
        try:
            self.qp.modify(attr, mask)
        except PyverbsError as exc:
            raise TransportError(f"QP {self.qp.qp_num} {step} failed: {exc}",
                                 hint=f"attributes: {detail} (mask {mask:#x})") from exc
        state = self.qp.query(e.IBV_QP_STATE)[0].qp_state
        if state != expected:
            raise TransportError(
                f"QP {self.qp.qp_num} {step}: state is {STATE_NAMES.get(state, state)} after "
                f"the transition, expected {STATE_NAMES[expected]}",
                hint=f"attributes: {detail} (mask {mask:#x})")

    def _to_init(self) -> None:
        attr = QPAttr()
        attr.qp_state = e.IBV_QPS_INIT
        attr.pkey_index = 0
        attr.port_num = self.gid.port
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
        mask = e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS
        self._modify(attr, mask, "RESET->INIT", e.IBV_QPS_INIT,
                     f"port {self.gid.port}, pkey index 0, access remote write")

    def connect(self, remote: Endpoint) -> None:
        """INIT -> RTR -> RTS towards ``remote``."""
        mtu = min(self.mtu, remote.mtu)
        try:
            route = GlobalRoute(dgid=GID(remote.gid), sgid_index=self.gid.index, hop_limit=64)
        except PyverbsError as exc:
            raise TransportError(f"peer GID {remote.gid!r} is unusable: {exc}") from exc
        attr = QPAttr()
        attr.qp_state = e.IBV_QPS_RTR
        attr.path_mtu = mtu
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = MIN_RNR_TIMER
        attr.ah_attr = AHAttr(gr=route, is_global=1, port_num=self.gid.port)
        mask = (e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
                | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
        self._modify(attr, mask, "INIT->RTR", e.IBV_QPS_RTR,
                     f"remote QPN {remote.qpn}, remote PSN {remote.psn}, remote GID "
                     f"{remote.gid}, local GID index {self.gid.index}, path MTU "
                     f"{MTU_BYTES.get(mtu, mtu)}")
        attr = QPAttr()
        attr.qp_state = e.IBV_QPS_RTS
        attr.sq_psn = self.psn
        attr.timeout = self.ack_timeout
        attr.retry_cnt = RETRY_COUNT
        attr.rnr_retry = RNR_RETRY
        attr.max_rd_atomic = 1
        mask = (e.IBV_QP_STATE | e.IBV_QP_SQ_PSN | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT
                | e.IBV_QP_RNR_RETRY | e.IBV_QP_MAX_QP_RD_ATOMIC)
        self._modify(attr, mask, "RTR->RTS", e.IBV_QPS_RTS,
                     f"local PSN {self.psn}, timeout {self.ack_timeout}, retry {RETRY_COUNT}, "
                     f"rnr retry {RNR_RETRY}")

    def close(self) -> None:
        with contextlib.suppress(PyverbsError):
            self.qp.close()
        self.cq.close()
        self._close_pd()

    def _close_pd(self) -> None:
        if self.pd is not self.device.pd:
            # Closing the PD closes what was registered in it (the lease MRs).
            with contextlib.suppress(PyverbsError):
                self.pd.close()


class QueuePairs(Protocol):
    """Where an initiator or a responder gets its queue pair (the transport)."""

    per_lease_keys: bool

    @property
    def memory_size(self) -> int: ...

    def queue_pair(self, local_host: str, recv_depth: int,
                   on_completions: Callable[[list[Any]], None],
                   per_lease_keys: bool = False, rail: str = "") -> QueuePair: ...
