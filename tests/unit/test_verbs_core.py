"""The compiled verbs core (kvwired/transport/verbs/_ibv.c): built at install,
its errors typed and named, its objects closed with what they were made from.

The first tests run anywhere; those that open a device need one with a
RoCE v2 address (``test_lab.py`` runs this module inside a lab node, over
rdma_rxe, with the transport suite).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvwired.errors import FailureStatus, RemoteAccessError, TransportError
from kvwired.pool import SharedMemory
from kvwired.rdma import ROCE_V2, gid_table, rdma_available
from kvwired.transport.verbs import core
from kvwired.transport.verbs.completions import completion_error
from kvwired.transport.verbs.device import address_of

SIZE = 1 << 20


def test_the_core_is_built_by_the_projects_setup() -> None:
    # make setup installs libibverbs' headers and builds it; a build that
    # failed would leave the verbs transport saying what to install.
    assert core.QueuePair.__module__ == "kvwired.transport.verbs._ibv"
    assert core.IBV_WC_SUCCESS == 0 and core.IBV_QPS_RTS == 3


def test_a_device_that_is_not_there_is_an_oserror_naming_the_call() -> None:
    with pytest.raises(core.VerbsError) as caught:
        core.Context("no-such-rdma-device")
    assert isinstance(caught.value, OSError) and caught.value.errno
    assert "ibv_" in str(caught.value)


def test_a_failed_completion_reads_as_libibverbs_names_it() -> None:
    error = completion_error(core.IBV_WC_REM_ACCESS_ERR, 17, "RDMA write")
    assert isinstance(error, RemoteAccessError) and error.status == FailureStatus.REMOTE_ACCESS
    assert "RDMA write on QP 17 failed: remote access error" in str(error)
    unknown = completion_error(250, 17, "receive")
    assert type(unknown) is TransportError and unknown.status == "status_250"


# ------------------------------------------------------------- with a device


def roce_gid() -> tuple[str, int, int] | None:
    """A device, port and GID index carrying RoCE v2 here, if any."""
    if not rdma_available():
        return None
    for entry in gid_table():
        if entry.type == ROCE_V2 and entry.ipv4:
            return entry.device, entry.port, entry.index
    return None


needs_device = pytest.mark.skipif(
    roce_gid() is None, reason="no RDMA device with a RoCE v2 address here (test_lab.py runs "
    "this module inside a lab node)")


@dataclass
class Opened:
    context: core.Context
    pd: core.ProtectionDomain
    mr: core.MemoryRegion
    cq: core.CompletionQueue
    qp: core.QueuePair
    port: int
    gid_index: int
    memory: SharedMemory


@pytest.fixture
def opened() -> Iterator[Opened]:
    found = roce_gid()
    assert found is not None
    device, port, gid_index = found
    memory = SharedMemory(SIZE, "core")
    context = core.Context(device)
    pd = core.ProtectionDomain(context)
    mr = core.MemoryRegion(pd, address_of(memory), SIZE,
                           core.IBV_ACCESS_LOCAL_WRITE | core.IBV_ACCESS_REMOTE_WRITE)
    cq = core.CompletionQueue(context, 64)
    qp = core.QueuePair(pd, cq, 32, 32)
    yield Opened(context, pd, mr, cq, qp, port, gid_index, memory)
    context.close()
    memory.close()


@needs_device
def test_closing_the_device_closes_everything_made_from_it_first(opened: Opened) -> None:
    opened.context.close()
    for resource in (opened.qp, opened.cq, opened.mr, opened.pd, opened.context):
        assert resource.closed, resource
    opened.context.close()  # again: nothing left to do
    with pytest.raises(ValueError, match="QueuePair is closed"):
        opened.qp.post_receives(opened.mr.address, 1, opened.mr.lkey, 1)
    with pytest.raises(ValueError, match="Context is closed"):
        core.ProtectionDomain(opened.context)


@needs_device
def test_closing_a_completion_queue_takes_the_queue_pair_on_it_first(opened: Opened) -> None:
    opened.cq.close()
    assert opened.qp.closed and not opened.pd.closed and not opened.mr.closed


@needs_device
def test_a_spurious_wake_up_reads_no_event_and_an_idle_queue_polls_empty(
        opened: Opened) -> None:
    assert opened.cq.woken() is None  # the channel is non-blocking: no event, no wait
    assert opened.cq.poll() == [] and opened.cq.poll(4) == []


@needs_device
def test_a_queue_pair_checks_each_transition_and_names_the_step(opened: Opened) -> None:
    assert opened.qp.state() == core.IBV_QPS_RESET
    opened.qp.to_init(opened.port, core.IBV_ACCESS_REMOTE_WRITE | core.IBV_ACCESS_LOCAL_WRITE)
    assert opened.qp.state() == core.IBV_QPS_INIT
    with pytest.raises(ValueError, match="16 bytes"):
        opened.qp.to_rtr(opened.port, core.IBV_MTU_1024, 1, 0, b"short", opened.gid_index, 12)
    with pytest.raises(core.VerbsError, match=r"INIT->RTR"):  # no such GID index
        opened.qp.to_rtr(opened.port, core.IBV_MTU_1024, 1, 0, bytes(16), 255, 12)
    with pytest.raises(core.VerbsError, match=r"RTR->RTS"):  # never reached RTR
        opened.qp.to_rts(0, 14, 7, 6)


@needs_device
def test_writes_a_queue_pair_cannot_take_are_refused_before_any_is_posted(
        opened: Opened) -> None:
    # After the writes and their range: local base and key, remote base and
    # key, the immediate, the signalled ones.
    args: tuple[int, int, int, int, None, dict[int, int]] = (
        opened.mr.address, opened.mr.lkey, 0, opened.mr.rkey, None, {})
    malformed: Any = [(0, 0)]  # what an adversary's caller might hand in
    with pytest.raises(TypeError, match="a write is"):
        opened.qp.post_writes(malformed, 0, 1, *args)
    with pytest.raises(IndexError):
        opened.qp.post_writes([(0, 0, 8)], 0, 2, *args)
    with pytest.raises(core.VerbsError, match="ibv_post_send"):  # still in RESET
        opened.qp.post_writes([(0, 0, 8)], 0, 1, *args)
