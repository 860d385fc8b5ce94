"""The 32-bit immediate that tells a receiver "layers up to n of lease L landed".

The lease id makes a late write of an aborted request harmless: the
receiver looks the lease up and drops an immediate whose lease is no longer
live, so stale bytes are never announced as a delivered layer.
"""

from __future__ import annotations

import enum

LAYER_BITS = 10
MAX_LAYERS = 1 << LAYER_BITS
LEASE_BITS = 32 - LAYER_BITS
LEASE_SPACE = 1 << LEASE_BITS


def pack(lease: int, layer: int) -> int:
    if not 0 <= layer < MAX_LAYERS:
        raise ValueError(f"layer {layer} does not fit the immediate (max {MAX_LAYERS - 1})")
    return (lease % LEASE_SPACE) << LAYER_BITS | layer


def unpack(imm: int) -> tuple[int, int]:
    return imm >> LAYER_BITS, imm & (MAX_LAYERS - 1)


class Taken(enum.Enum):
    """What a receiver's service did with an immediate naming one of its leases.

    Each immediate spends one of the sender's credits (one posted receive).
    The receiver hands it back with a ``credits`` message, unless the
    service's answer on the data path does: an echo's reply tells the sender
    the receive was re-posted, one control message per ping fewer (with TLS,
    the largest cost of a ping on the lab's emulated nodes).
    """

    NOT_OURS = enum.auto()
    TAKEN = enum.auto()  # the receiver returns the credit
    ANSWERED = enum.auto()  # the answer written back returns it
