"""The RDMA data path: pyverbs, RC queue pairs, RoCE v2 (Soft-RoCE included).

What the code must respect (docs/DESIGN.md, "RDMA facts"):

- memlock is checked before the pool is registered (``rdma.check_memlock``);
- the GID is the RoCE v2 entry of the address the control connection uses,
  so data follows the control path's netdev; port state and MTU are checked
  and the path MTU is the smaller active MTU of the two ends;
- every QP transition is followed by a query of the state, and a mismatch is
  an error naming the step and the attributes;
- receives are posted before the peer learns the QP, and one is re-posted for
  every one consumed, before the credit for it goes back;
- receiver-not-ready retries are bounded (``rnr_retry`` 6: 7 is endless), so a
  missing receive is a completion error within seconds; ``retry_cnt`` is 7
  (endless on rxe) and a dead peer is bounded by the link's progress check;
- writes are posted as lists through the QPEx ``wr_*`` API, one signalled
  work request per post (and every ``SIGNAL_EVERY``), completions polled in
  batches;
- completions wake the event loop through the completion channel's file
  descriptor: no thread, no spinning while idle, no polling interval added
  while busy. pyverbs 44 does not expose that descriptor, so it is found as
  the ``[infinibandevent]`` descriptor that creating the channel opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import ipaddress
import os
import random
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyverbs.enums as e
import structlog
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ, CompChannel, cqe_status_to_str
from pyverbs.device import Context
from pyverbs.mr import MR, MW, MWBindInfo
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QPAttr, QPCap, QPEx, QPInitAttrEx
from pyverbs.wr import SGE, RecvWR

from ..errors import FailureStatus, RemoteAccessError, TransportError
from ..pool import SharedMemory
from ..rdma import (
    GidEntry,
    NoRdmaPath,
    check_memlock,
    devices,
    pick_gid,
    rail_gid,
    roce_devices,
    source_address,
)
from ..units import format_size
from .base import (
    DataChannel,
    ErrorHandler,
    ImmediateHandler,
    Initiator,
    Responder,
    Transport,
    Write,
)

log = structlog.get_logger("kvwired.transport.verbs")

SQ_DEPTH = 1024
SIGNAL_EVERY = SQ_DEPTH // 4
POLL_BATCH = 64
QP_TIMEOUT = 14  # 4.096 us x 2^14 = 67 ms before a retry (``ack_timeout`` sets it)
# 7, the most the field holds: a lossy, reordering or briefly dark wire is
# ridden out by the queue pair's own retransmissions. rxe treats 7 as "retry
# forever" (rxe_comp.c: `if (qp->comp.retry_cnt != 7) qp->comp.retry_cnt--`),
# and a hardware RNIC as seven retries: either way a dead path is bounded by
# the link's progress check (a channel that places nothing for the stall
# bound fails: kvwired.sender.link), and a channel that fails sooner is
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
HINTS = {
    e.IBV_WC_RETRY_EXC_ERR: "the peer did not acknowledge: it is gone, or the GID/network "
    "between the nodes is wrong",
    e.IBV_WC_RNR_RETRY_EXC_ERR: "the receiver had no receive posted (its queue ran dry)",
    e.IBV_WC_REM_ACCESS_ERR: "the write fell outside what its key grants: outside its "
    "lease, or under a key revoked when the lease ended",
    e.IBV_WC_WR_FLUSH_ERR: "flushed after an earlier error on the same queue pair",
}


def _address_of(memory: SharedMemory) -> int:
    # The temporary ctypes view is dropped at once, so the mmap stays closable.
    return ctypes.addressof(ctypes.c_char.from_buffer(memory.map))


def _infiniband_event_fds() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[infinibandevent]":
                found.add(int(name))
    return found


STATUS_NAMES = {
    e.IBV_WC_RETRY_EXC_ERR: FailureStatus.RETRY_EXCEEDED,
    e.IBV_WC_RNR_RETRY_EXC_ERR: FailureStatus.RNR_RETRY_EXCEEDED,
    e.IBV_WC_REM_ACCESS_ERR: FailureStatus.REMOTE_ACCESS,
    e.IBV_WC_REM_OP_ERR: FailureStatus.REMOTE_OPERATION,
    e.IBV_WC_REM_INV_REQ_ERR: FailureStatus.REMOTE_INVALID_REQUEST,
    e.IBV_WC_LOC_PROT_ERR: FailureStatus.LOCAL_PROTECTION,
    e.IBV_WC_LOC_LEN_ERR: FailureStatus.LOCAL_LENGTH,
    e.IBV_WC_LOC_QP_OP_ERR: FailureStatus.LOCAL_QP_OPERATION,
    e.IBV_WC_WR_FLUSH_ERR: FailureStatus.FLUSHED,
    e.IBV_WC_GENERAL_ERR: FailureStatus.GENERAL,
}


def completion_error(status: int, qp_num: int, what: str) -> TransportError:
    text = cqe_status_to_str(status)
    kind = RemoteAccessError if status == e.IBV_WC_REM_ACCESS_ERR else TransportError
    return kind(f"{what} on QP {qp_num} failed: {text} (status {status})",
                          hint=HINTS.get(status, "the queue pair is torn down and rebuilt on "
                                         "the next request"),
                          status=STATUS_NAMES.get(status, f"status_{status}"))


class _Device:
    """One opened RDMA device: context, protection domain, the pool's MR."""

    def __init__(self, name: str, memory: SharedMemory, per_lease_keys: bool) -> None:
        self.name = name
        self.context = Context(name=name)
        self.pd = PD(self.context)
        # Per-lease keys: the MR itself grants no remote access, only the
        # memory windows bound over it do, each to one lease's bytes.
        access = e.IBV_ACCESS_LOCAL_WRITE | (
            e.IBV_ACCESS_MW_BIND if per_lease_keys else e.IBV_ACCESS_REMOTE_WRITE)
        self.base = _address_of(memory)
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


class _CompletionQueue:
    """A CQ whose completion channel wakes the event loop.

    With ``spin_seconds`` > 0 it also polls on every turn of the event loop
    while its owner has work outstanding (``busy``) and for ``spin_seconds``
    after the last completion, so a stream of completions does not pay a
    wake-up each; once quiet it sleeps on the descriptor again.
    """

    def __init__(self, device: _Device, depth: int,
                 on_completions: Callable[[list[Any]], None],
                 spin_seconds: float = 0.0) -> None:
        before = _infiniband_event_fds()
        self.channel = CompChannel(device.context)
        created = _infiniband_event_fds() - before
        if len(created) != 1:
            self.channel.close()
            raise TransportError("cannot find the completion channel's file descriptor")
        self.fd = created.pop()
        # Non-blocking, so a spurious wake-up can never block the loop in
        # ibv_get_cq_event (which pyverbs calls holding the GIL).
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.cq = CQ(device.context, depth, None, self.channel, 0)
        self._on_completions = on_completions
        self._loop = asyncio.get_running_loop()
        self.cq.req_notify()
        self._loop.add_reader(self.fd, self._woken)
        self.closed = False
        self.busy: Callable[[], bool] = lambda: False
        self._spin_seconds = spin_seconds
        self._spinning = False
        self._last_activity = 0.0

    def _woken(self) -> None:
        try:
            self.channel.get_cq_event(self.cq)
        except PyverbsError:
            return  # nothing pending after all
        self.cq.ack_events(1)
        # Re-arm before draining: a completion arriving meanwhile still wakes us.
        self.cq.req_notify()
        self.drain()
        self.kick()

    def drain(self) -> None:
        while not self.closed:
            count, completions = self.cq.poll(POLL_BATCH)
            if not count:
                return
            self._last_activity = time.perf_counter()
            self._on_completions(completions)

    def kick(self) -> None:
        """Work was just posted or completed: poll for a while before sleeping."""
        if self._spin_seconds <= 0 or self.closed:
            return
        self._last_activity = max(self._last_activity, time.perf_counter())
        if not self._spinning:
            self._spinning = True
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        if self.closed:
            self._spinning = False
            return
        self.drain()
        if self.busy() or time.perf_counter() - self._last_activity < self._spin_seconds:
            self._loop.call_soon(self._spin)
        else:
            self._spinning = False

    def close(self) -> None:
        """Destroy the CQ and its channel; the QP on it must be gone already.

        ibv_destroy_cq waits until every completion event the channel has
        delivered is read and acknowledged. An event still pending (a QP that
        failed flushes its work requests, and the loop has not woken yet)
        would make it wait for ever, inside the event loop: read and ack the
        pending ones first. Found by the systemd watchdog in the lab, which
        killed a sender stuck exactly there after its receiver was killed.
        """
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self.fd)
        while True:
            try:
                self.channel.get_cq_event(self.cq)  # non-blocking: fails when none is left
            except PyverbsError:
                break
            self.cq.ack_events(1)
        for resource in (self.cq, self.channel):
            with contextlib.suppress(PyverbsError):
                resource.close()


@dataclass
class _Endpoint:
    """What one side tells the other to connect their queue pairs."""

    qpn: int
    psn: int
    gid: str
    mtu: int

    def to_wire(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "gid": self.gid, "mtu": self.mtu}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> _Endpoint:
        try:
            return cls(int(data["qpn"]), int(data["psn"]), str(data["gid"]), int(data["mtu"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"peer sent unusable verbs parameters: {data!r}") from exc


class _QueuePair:
    """An RC QP and its CQ, driven RESET -> INIT -> RTR -> RTS with checks."""

    def __init__(self, device: _Device, gid: GidEntry, recv_depth: int,
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
        self.cq = _CompletionQueue(device, SQ_DEPTH + recv_depth + 1, on_completions,
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
    def endpoint(self) -> _Endpoint:
        return _Endpoint(self.qp.qp_num, self.psn, self.gid.gid.exploded, self.mtu)

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

    def connect(self, remote: _Endpoint) -> None:
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


@dataclass
class _Post:
    writes: Sequence[Write]
    imm: int | None
    key: int
    future: asyncio.Future[None]
    next: int = 0


@dataclass
class _Signal:
    wr_id: int
    count: int  # work requests this completion accounts for
    future: asyncio.Future[None] | None


class VerbsDataChannel(DataChannel):
    """Posts writes on an RC QP; one completion per post tells they landed."""

    kind = "verbs"

    def __init__(self, qp: _QueuePair, remote: dict[str, Any]) -> None:
        self._qp = qp
        self._rkey = int(remote["rkey"])
        self._remote_base = int(remote["addr"])
        self._remote_size = int(remote["size"])
        self._local_base = qp.device.base
        # One SGE, refilled per work request: wr_set_sge copies it into the WQE.
        self._sge = SGE(qp.device.base, 1, qp.device.mr.lkey)
        self._max_message = qp.device.max_message(qp.gid.port)
        self._queue: deque[_Post] = deque()
        self._signals: deque[_Signal] = deque()
        self._outstanding = 0
        self._since_signal = 0
        self._next_wr_id = 1
        self._error: TransportError | None = None
        qp.cq.busy = lambda: self._outstanding > 0

    @property
    def alive(self) -> bool:
        return self._error is None

    def post(self, writes: Sequence[Write], imm: int | None = None,
             key: int | None = None) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._error is not None:
            future.set_exception(self._error)
            return future
        for w in writes:
            if w.remote_offset + w.length > self._remote_size:
                future.set_exception(TransportError(
                    f"write of {w.length} B at {w.remote_offset} is outside the remote "
                    f"{self._remote_size} B region"))
                return future
        self._posting()
        self._queue.append(_Post(self._split(writes), imm,
                                 self._rkey if key is None else key, future))
        self._post_some()
        self._qp.cq.kick()
        return future

    @property
    def pending_writes(self) -> int:
        return self._outstanding + sum(len(p.writes) - p.next for p in self._queue)

    def _split(self, writes: Sequence[Write]) -> Sequence[Write]:
        # A message may not exceed the port's max_msg_sz (8 MiB on rxe).
        if all(w.length <= self._max_message for w in writes):
            return writes
        pieces = []
        for w in writes:
            for start in range(0, w.length, self._max_message):
                length = min(self._max_message, w.length - start)
                pieces.append(Write(w.local_offset + start, w.remote_offset + start, length))
        return pieces

    def _post_some(self) -> None:
        qp = self._qp.qp
        sge = self._sge
        while self._queue and self._outstanding < SQ_DEPTH and self._error is None:
            post = self._queue[0]
            start = post.next
            end = min(len(post.writes), start + SQ_DEPTH - self._outstanding)
            last = len(post.writes) - 1
            try:
                qp.wr_start()
                for i in range(start, end):
                    w = post.writes[i]
                    self._since_signal += 1
                    # Signal the post's last write, every SIGNAL_EVERY, and the last
                    # of a burst cut short by a full send queue, so every posted
                    # work request is followed by one whose completion frees it.
                    signalled = i == last or i == end - 1 or self._since_signal >= SIGNAL_EVERY
                    qp.wr_id = self._next_wr_id
                    qp.wr_flags = e.IBV_SEND_SIGNALED if signalled else 0
                    remote = self._remote_base + w.remote_offset
                    if i == last and post.imm is not None:
                        qp.wr_rdma_write_imm(post.key, remote, post.imm)
                    else:
                        qp.wr_rdma_write(post.key, remote)
                    sge.addr = self._local_base + w.local_offset
                    sge.length = w.length
                    qp.wr_set_sge(sge)
                    if signalled:
                        self._signals.append(_Signal(self._next_wr_id, self._since_signal,
                                                     post.future if i == last else None))
                        self._next_wr_id += 1
                        self._since_signal = 0
                qp.wr_complete()
            except PyverbsError as exc:
                self.fail(TransportError(f"posting RDMA writes failed: {exc}"))
                return
            except BaseException:
                with contextlib.suppress(PyverbsError):
                    qp.wr_abort()
                raise
            self._outstanding += end - start
            post.next = end
            if end == len(post.writes):
                self._queue.popleft()

    def on_completions(self, completions: list[Any]) -> None:
        for wc in completions:
            if wc.status != e.IBV_WC_SUCCESS:
                self.fail(completion_error(wc.status, self._qp.qp.qp_num, "RDMA write"))
                return
            self._progressed()
            while self._signals:
                signal = self._signals.popleft()
                self._outstanding -= signal.count
                if signal.future is not None and not signal.future.done():
                    signal.future.set_result(None)
                if signal.wr_id == wc.wr_id:
                    break
        self._post_some()

    def _take_outstanding(self) -> list[asyncio.Future[None]]:
        pending = [s.future for s in self._signals if s.future is not None]
        pending += [p.future for p in self._queue]
        self._signals.clear()
        self._queue.clear()
        return pending

    def _tear_down(self) -> None:
        self._qp.close()


class VerbsInitiator(Initiator):
    def __init__(self, owner: VerbsTransport, local_host: str, rail: str = "") -> None:
        self._owner = owner
        self._local_host = local_host
        self._rail = rail
        self._qp: _QueuePair | None = None
        self._channel: VerbsDataChannel | None = None

    async def offer(self) -> dict[str, Any]:
        self._qp = self._owner.queue_pair(self._local_host, 0, self._on_completions,
                                          rail=self._rail)
        offer = self._qp.endpoint.to_wire()
        if self._rail:
            # The responder answers from its own end of this rail: the GID its
            # routes reach ours from, not its control connection's.
            offer["rail"] = self._rail
        return offer

    def _on_completions(self, completions: list[Any]) -> None:
        if self._channel is not None:
            self._channel.on_completions(completions)

    async def complete(self, answer: dict[str, Any]) -> DataChannel:
        assert self._qp is not None, "offer() first"
        self._qp.connect(_Endpoint.from_wire(answer))
        try:
            self._channel = VerbsDataChannel(self._qp, answer)
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"receiver sent no usable region: {answer!r}") from exc
        return self._channel

    def abandon(self) -> None:
        if self._qp is not None and self._channel is None:
            self._qp.close()


class _Window:
    """A type 2 memory window: bound to one lease's bytes on one QP at a time."""

    # The key's low byte is ours to change: a new one for every binding, so
    # a key revoked before is refused even by the window bound again. After
    # 255 bindings the byte would come round to an old key: the window is
    # retired instead, and a new one (a new index) takes its place.
    MAX_BINDINGS = 255

    def __init__(self, pd: PD) -> None:
        self.mw = MW(pd, e.IBV_MW_TYPE_2)
        self.rkey = int(self.mw.rkey)
        self.bindings = 0

    def next_key(self) -> int:
        self.bindings += 1
        self.rkey = (self.rkey & ~0xFF) | ((self.rkey + 1) & 0xFF)
        return self.rkey

    @property
    def worn_out(self) -> bool:
        return self.bindings >= self.MAX_BINDINGS


class VerbsResponder(Responder):
    """Receives immediates; keeps ``depth`` receives posted, one re-posted per one consumed.

    With per-lease keys it also binds a memory window per granted range on
    its own QP (a type 2 window answers only to that QP, so the key is
    useless to any other connection) and invalidates it on revoke; both are
    work requests on the QP's send queue, answered by completions.
    """

    def __init__(self, owner: VerbsTransport, local_host: str, on_immediate: ImmediateHandler,
                 on_error: ErrorHandler, depth: int) -> None:
        self._windows: dict[int, _Window] = {}  # bound, by key
        self._spare: list[_Window] = []  # invalidated, to bind again
        self._lease_mrs: dict[int, MR] = {}  # software devices: an MR per lease, by key
        self._used_keys: set[int] = set()
        self._waiting: dict[int, Callable[[Exception | None], None]] = {}  # by wr_id
        self._next_wr_id = 1
        self._owner = owner
        self._local_host = local_host
        self._on_immediate = on_immediate
        self._on_error = on_error
        self._depth = depth
        self._qp: _QueuePair | None = None
        self._receive: Any = None
        self._closed = False

    async def accept(self, offer: dict[str, Any]) -> dict[str, Any]:
        remote = _Endpoint.from_wire(offer)
        local_host = self._local_host
        if offer.get("rail"):
            local_host = _rail_source(remote)
        qp = self._owner.queue_pair(local_host, self._depth, self._on_completions,
                                    per_lease_keys=self._owner.per_lease_keys)
        self._qp = qp
        try:
            # A WRITE_WITH_IMM consumes a receive but writes nothing into its
            # buffer: every receive points at the same byte of the pool.
            sge = SGE(qp.device.base, 1, qp.receive_lkey)
            self._receive = RecvWR(wr_id=0, num_sge=1, sg=[sge])
            for _ in range(self._depth):
                qp.qp.post_recv(self._receive)
        except PyverbsError as exc:
            self.close()
            raise TransportError(f"posting {self._depth} receives failed: {exc}") from exc
        try:
            qp.connect(remote)
        except TransportError:
            self.close()
            raise
        return {**qp.endpoint.to_wire(), "rkey": qp.device.mr.rkey, "addr": qp.device.base,
                "size": self._owner.memory_size}

    @property
    def receives_posted(self) -> int:
        # Every consumed receive is re-posted before its immediate is handled.
        return 0 if self._closed or self._qp is None else self._depth

    async def grant(self, offset: int, length: int) -> int:
        qp = self._qp
        if not self._owner.per_lease_keys:
            assert qp is not None
            return int(qp.device.mr.rkey)
        if self._closed or qp is None:
            raise TransportError("the data connection closed before the lease was granted")
        if not qp.device.bounds_windows:
            return self._register_lease(qp, offset, length)
        window = self._spare.pop() if self._spare else _Window(qp.device.pd)
        key = window.next_key()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        bind = MWBindInfo(qp.device.mr, qp.device.base + offset, length,
                          e.IBV_ACCESS_REMOTE_WRITE)
        self._post_send(lambda q: q.wr_bind_mw(window.mw, key, bind),
                        lambda error: _settle(done, error), "binding a memory window")
        await done
        self._windows[key] = window
        return key

    def _register_lease(self, qp: _QueuePair, offset: int, length: int) -> int:
        """A software device's lease: an MR of its own in this QP's own PD, so
        its key reaches these bytes, from this QP, and nothing else. A key
        this session used before is never handed out again (rxe draws the
        key byte at random, and an index comes back once freed)."""
        for _ in range(16):
            try:
                mr = MR(qp.pd, length, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE,
                        address=qp.device.base + offset)
            except PyverbsError as exc:
                raise TransportError(f"registering a lease's {length} B failed: {exc}",
                                     hint="check the locked-memory limit") from exc
            key = int(mr.rkey)
            if key not in self._used_keys:
                self._used_keys.add(key)
                self._lease_mrs[key] = mr
                return key
            with contextlib.suppress(PyverbsError):
                mr.close()
        raise TransportError("no fresh remote key after 16 registrations")

    def revoke(self, key: int, then: Callable[[], None]) -> None:
        lease_mr = self._lease_mrs.pop(key, None)
        if lease_mr is not None:
            # Deregistered: the RNIC refuses the key from now on, in flight or not.
            with contextlib.suppress(PyverbsError):
                lease_mr.close()
            then()
            return
        window = self._windows.pop(key, None)
        if window is None or self._closed:
            then()  # never bound, or its QP is gone: no write can use it
            return

        def invalidated(error: Exception | None) -> None:
            if error is None and not window.worn_out:
                self._spare.append(window)
            elif error is None:
                with contextlib.suppress(PyverbsError):
                    window.mw.close()
            then()  # on an error the QP is torn down: no write can land either
        self._post_send(lambda q: q.wr_local_inv(key), invalidated,
                        "invalidating a memory window")

    def _post_send(self, build: Callable[[Any], None],
                   done: Callable[[Exception | None], None], what: str) -> None:
        """One signalled work request on the send queue; ``done`` hears its end."""
        assert self._qp is not None
        qp = self._qp.qp
        wr_id = self._next_wr_id
        self._next_wr_id += 1
        self._waiting[wr_id] = done
        try:
            qp.wr_start()
            qp.wr_id = wr_id
            qp.wr_flags = e.IBV_SEND_SIGNALED
            build(qp)
            qp.wr_complete()
        except PyverbsError as exc:
            with contextlib.suppress(PyverbsError):
                qp.wr_abort()
            self._fail(TransportError(f"{what} failed: {exc}"))
            return
        self._qp.cq.kick()

    def _on_completions(self, completions: list[Any]) -> None:
        assert self._qp is not None
        for wc in completions:
            if self._closed:
                return
            # A failed completion's opcode is undefined: its wr_id says what it was.
            if wc.wr_id in self._waiting and (
                    wc.status != e.IBV_WC_SUCCESS
                    or wc.opcode in (e.IBV_WC_BIND_MW, e.IBV_WC_LOCAL_INV)):
                done = self._waiting.pop(wc.wr_id)
                if wc.status != e.IBV_WC_SUCCESS:
                    error = completion_error(wc.status, self._qp.qp.qp_num,
                                             "a memory window operation")
                    done(error)
                    self._fail(error)
                    return
                done(None)
                continue
            if wc.status != e.IBV_WC_SUCCESS:
                self._fail(completion_error(wc.status, self._qp.qp.qp_num, "receive"))
                return
            if wc.opcode != e.IBV_WC_RECV_RDMA_WITH_IMM:
                continue
            try:
                self._qp.qp.post_recv(self._receive)  # before the credit goes back
            except PyverbsError as exc:
                self._fail(TransportError(f"re-posting a receive failed: {exc}"))
                return
            self.writes_received += 1
            # pyverbs converts the immediate to network order when posting but
            # hands the received one over raw.
            self._on_immediate(socket.ntohl(wc.imm_data))

    def _fail(self, error: TransportError) -> None:
        if not self._closed:
            self.close()
            self._on_error(error)

    def close(self) -> None:
        self._closed = True
        if self._qp is not None:
            self._qp.close()
        # The QP is gone, so no window bound to it answers any more.
        waiting, self._waiting = self._waiting, {}
        for done in waiting.values():
            done(TransportError("the data connection closed"))
        for window in [*self._windows.values(), *self._spare]:
            with contextlib.suppress(PyverbsError):
                window.mw.close()
        for lease_mr in self._lease_mrs.values():
            with contextlib.suppress(PyverbsError):
                lease_mr.close()
        self._windows.clear()
        self._spare.clear()
        self._lease_mrs.clear()


def _rail_source(remote: _Endpoint) -> str:
    """Our address on the rail the initiator's GID ``remote`` is on: the one our
    routes reach it from (rails are separate subnets, one per NIC)."""
    try:
        address = ipaddress.IPv6Address(remote.gid)
    except ValueError as exc:
        raise TransportError(f"peer sent an unusable GID {remote.gid!r}") from exc
    peer = address.ipv4_mapped or address
    try:
        return source_address(str(peer))
    except OSError as exc:
        raise NoRdmaPath(f"no route to the sender's rail address {peer}: {exc}",
                         hint="each rail needs an address on both nodes, in a subnet "
                              "they share") from exc


def _settle(future: asyncio.Future[None], error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


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
        self._devices: dict[str, _Device] = {}

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
        names = [self._device_name] if self._device_name else roce_devices()
        pinned = memory.size * max(1, len(names))
        check_memlock(pinned, f"the {format_size(memory.size)} pool"
                      + (f", registered with each of {', '.join(names)}," if len(names) > 1
                         else ""))
        self._memory = memory
        for name in names:
            self._device(name)

    def _device(self, name: str) -> _Device:
        if name not in self._devices:
            assert self._memory is not None, "transport not started"
            self._devices[name] = _Device(name, self._memory, self.per_lease_keys)
        return self._devices[name]

    def queue_pair(self, local_host: str, recv_depth: int,
                   on_completions: Callable[[list[Any]], None],
                   per_lease_keys: bool = False, rail: str = "") -> _QueuePair:
        """A QP on ``rail``'s device when given, else on the device whose GID
        holds ``local_host`` (the control path's, unless configured)."""
        gid = rail_gid(rail) if rail else pick_gid(local_host, self._device_name,
                                                   self._gid_index)
        device = self._device(gid.device)
        # Windows where the device bounds them; else a PD per QP for its lease MRs.
        windows = per_lease_keys and device.bounds_windows
        own_pd = per_lease_keys and not device.bounds_windows
        return _QueuePair(device, gid, recv_depth, on_completions, self._spin_seconds,
                          windows, own_pd, self._ack_timeout)

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

