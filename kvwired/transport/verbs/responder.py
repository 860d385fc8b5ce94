"""The responder's end: receives kept posted, immediates handed up, lease keys.

Receives are posted before the peer learns the queue pair, and one is
re-posted for every one consumed, before the credit for it goes back.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import pyverbs.enums as e
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.wr import SGE, RecvWR

from ...errors import TransportError
from ...rdma import NoRdmaPath, source_address
from ..base import ErrorHandler, ImmediateHandler, Responder
from .completions import completion_error
from .keys import LeaseKeys
from .queue_pair import Endpoint, QueuePair, QueuePairs


class VerbsResponder(Responder):
    """Receives immediates; keeps ``depth`` receives posted, one re-posted per one consumed.

    With per-lease keys it also grants a key per lease (kvwired.transport.verbs.keys):
    a memory window bound on its own QP (a type 2 window answers only to that
    QP, so the key is useless to any other connection), invalidated on revoke.
    """

    def __init__(self, owner: QueuePairs, local_host: str, on_immediate: ImmediateHandler,
                 on_error: ErrorHandler, depth: int) -> None:
        self._keys = LeaseKeys(self._post_send)
        self._waiting: dict[int, Callable[[Exception | None], None]] = {}  # by wr_id
        self._next_wr_id = 1
        self._owner = owner
        self._local_host = local_host
        self._on_immediate = on_immediate
        self._on_error = on_error
        self._depth = depth
        self._qp: QueuePair | None = None
        self._receive: Any = None
        self._closed = False

    async def accept(self, offer: dict[str, Any]) -> dict[str, Any]:
        remote = Endpoint.from_wire(offer)
        local_host = self._local_host
        if offer.get("rail"):
            local_host = rail_source(remote)
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

    def poll_now(self) -> None:
        """Read whatever completions are there (see ``VerbsDataChannel.poll_now``)."""
        if self._qp is not None:
            self._qp.cq.drain()

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
        return await self._keys.grant(qp, offset, length)

    def revoke(self, key: int, then: Callable[[], None]) -> None:
        self._keys.revoke(key, then, qp_gone=self._closed)

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
        waiting, self._waiting = self._waiting, {}
        for done in waiting.values():
            done(TransportError("the data connection closed"))
        self._keys.close()


def rail_source(remote: Endpoint) -> str:
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
