"""The responder's end: receives kept posted, immediates handed up, lease keys.

Receives are posted before the peer learns the queue pair, and one is
re-posted for every one consumed, before the credit for it goes back.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from ...errors import TransportError
from ...rdma import NoRdmaPath, source_address
from ..base import ErrorHandler, ImmediateHandler, Responder
from . import core
from .completions import Completion, completion_error
from .core import VerbsError
from .keys import LeaseKeys, SendWork
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
            self._post_receives(self._depth)
        except VerbsError as exc:
            self.close()
            raise TransportError(f"posting {self._depth} receives failed: {exc}") from exc
        try:
            qp.connect(remote)
        except TransportError:
            self.close()
            raise
        return {**qp.endpoint.to_wire(), "rkey": qp.device.mr.rkey, "addr": qp.device.base,
                "size": self._owner.memory_size}

    def _post_receives(self, count: int) -> None:
        # A WRITE_WITH_IMM consumes a receive but writes nothing into its
        # buffer: every receive points at the same byte of the pool.
        assert self._qp is not None
        self._qp.qp.post_receives(self._qp.device.base, 1, self._qp.receive_lkey, count)

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

    def _post_send(self, work: SendWork, done: Callable[[Exception | None], None],
                   what: str) -> None:
        """One signalled work request on the send queue; ``done`` hears its end."""
        assert self._qp is not None
        wr_id = self._next_wr_id
        self._next_wr_id += 1
        self._waiting[wr_id] = done
        try:
            work(self._qp.qp, wr_id)
        except VerbsError as exc:
            self._fail(TransportError(f"{what} failed: {exc}"))  # ``done`` hears it closed
            return
        self._qp.cq.kick()

    def _on_completions(self, completions: list[Completion]) -> None:
        assert self._qp is not None
        # Immediates are handed up a batch at a time, after one call re-posts
        # their receives; a failure after some hands those up first.
        immediates: list[int] = []
        for wr_id, status, opcode, imm in completions:
            if self._closed:
                return
            # A failed completion's opcode is undefined: its wr_id says what it was.
            if wr_id in self._waiting and (
                    status != core.IBV_WC_SUCCESS
                    or opcode in (core.IBV_WC_BIND_MW, core.IBV_WC_LOCAL_INV)):
                done = self._waiting.pop(wr_id)
                if status != core.IBV_WC_SUCCESS:
                    error = completion_error(status, self._qp.qp.qp_num,
                                             "a memory window operation")
                    self._hand_up(immediates)
                    done(error)
                    self._fail(error)
                    return
                done(None)
            elif status != core.IBV_WC_SUCCESS:
                self._hand_up(immediates)
                self._fail(completion_error(status, self._qp.qp.qp_num, "receive"))
                return
            elif opcode == core.IBV_WC_RECV_RDMA_WITH_IMM:
                immediates.append(imm)
        self._hand_up(immediates)

    def _hand_up(self, immediates: list[int]) -> None:
        if not immediates or self._closed:
            return
        try:
            self._post_receives(len(immediates))  # before the credits go back
        except VerbsError as exc:
            self._fail(TransportError(f"re-posting {len(immediates)} receives failed: {exc}"))
            return
        for imm in immediates:
            if self._closed:
                return
            self.writes_received += 1
            self._on_immediate(imm)

    def _fail(self, error: TransportError) -> None:
        if not self._closed:
            self.close()
            self._on_error(error)

    def close(self) -> None:
        self._closed = True
        self._keys.close()  # the windows and lease MRs, before the QP and PD they are on
        if self._qp is not None:
            self._qp.close()
        waiting, self._waiting = self._waiting, {}
        for done in waiting.values():
            done(TransportError("the data connection closed"))


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
