"""The GID table asked of the devices reads as the sysfs one does.

The queries themselves need a device: the lab runs this file in a node
(beside the transport suite), and every verbs test there picks its GIDs
through ``GidReader``. Here: what a returned entry becomes, for any GID.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import pyverbs.enums as e
from hypothesis import given
from hypothesis import strategies as st

from kvwired.rdma import ROCE_V2, GidEntry, gid_table, pick_gid
from kvwired.transport.verbs.gids import GidReader, entry_of


@dataclass
class Raw:
    """Shaped as pyverbs' GIDEntry."""

    gid: str
    gid_index: int = 1
    port_num: int = 1
    gid_type: int = int(e.IBV_GID_TYPE_ROCE_V2)
    ndev_ifindex: int = 0

    def gid_str(self) -> str:
        return self.gid  # pyverbs writes all eight groups, zeros included


def _full(address: ipaddress.IPv6Address) -> str:
    return ":".join(address.exploded.split(":"))


def test_an_ipv4_mapped_roce_v2_entry_is_what_pick_gid_chooses() -> None:
    loopback = socket.if_nametoindex("lo")
    entry = entry_of("rxe0", Raw("0000:0000:0000:0000:0000:ffff:c612:4e01",
                                 ndev_ifindex=loopback))
    assert entry == GidEntry("rxe0", 1, 1, ipaddress.IPv6Address("::ffff:198.18.78.1"),
                             ROCE_V2, "lo")
    assert pick_gid("198.18.78.1", table=[entry]) == entry


def test_the_zero_gid_is_skipped_and_other_types_named_as_sysfs_names_them() -> None:
    assert entry_of("rxe0", Raw("0000:0000:0000:0000:0000:0000:0000:0000")) is None
    for gid_type in (e.IBV_GID_TYPE_IB, e.IBV_GID_TYPE_ROCE_V1):
        entry = entry_of("mlx5_0", Raw("fe80:0000:0000:0000:0000:0000:0000:0001",
                                       gid_type=int(gid_type)))
        assert entry is not None and entry.type == "IB/RoCE v1"


def test_a_netdev_gone_meanwhile_reads_as_none() -> None:
    free = max(index for index, _ in socket.if_nameindex()) + 1000
    entry = entry_of("rxe0", Raw("fe80:0000:0000:0000:0000:0000:0000:0001",
                                 ndev_ifindex=free))
    assert entry is not None and entry.netdev == ""


@given(st.ip_addresses(v=6), st.integers(0, 4095), st.integers(1, 2),
       st.sampled_from([int(t) for t in (e.IBV_GID_TYPE_IB, e.IBV_GID_TYPE_ROCE_V1,
                                          e.IBV_GID_TYPE_ROCE_V2)] + [7]))
def test_any_entry_keeps_its_gid_index_and_port(
        address: ipaddress.IPv6Address, index: int, port: int, gid_type: int) -> None:
    entry = entry_of("dev", Raw(_full(address), index, port, gid_type))
    if address == ipaddress.IPv6Address(0):
        assert entry is None
        return
    assert entry is not None
    assert (entry.gid, entry.index, entry.port, entry.device) == (address, index, port, "dev")
    assert (entry.type == ROCE_V2) == (gid_type == int(e.IBV_GID_TYPE_ROCE_V2))
    assert entry.type != "?" or gid_type == 7


def test_the_devices_answer_what_sysfs_lists() -> None:
    # Here (and on CI) there is no device: both are empty. The lab runs this
    # file in a node, where rxe0 and rxe1 answer with their populated entries.
    reader = GidReader()
    try:
        assert reader.table() == gid_table()
    finally:
        reader.close()
