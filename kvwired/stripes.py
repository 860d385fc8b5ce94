"""A push over several data channels: how a batch is cut, and when a layer has landed.

A sender with ``qps_per_peer`` > 1 holds that many data channels (RC queue
pairs, or TCP streams) to each receiver. Writes on one channel land in the
order they were posted; writes on different channels are not ordered with
each other at all. So a layer's notification cannot ride the last write
posted: another channel may still be placing the layer's other chunks.

The rule, on both ends:

- **Sender** (``stripe``): each committed batch is cut into one contiguous
  group of chunks per channel, and *every* channel's group ends with the
  batch's immediate, as a zero-length write where the channel has no chunk
  of the batch. The group a batch starts with rotates, so batches of one
  chunk (a layer in one write) are spread over the channels too.
- **Receiver** (``LandingFence``): a channel's immediate for layer n says
  that channel has placed its part of every layer up to n (in order, on
  that channel). A layer has landed when every channel has said so for it:
  the lease's landed count is the minimum over its channels. Immediates
  out of order or out of range for their channel are refused as stale.

Each channel spends one of its own credits per immediate, so receives are
counted per channel as on one. With one channel this is exactly the
one-channel protocol: one group, one immediate, the landed count is that
channel's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

Item = TypeVar("Item")

MAX_CHANNELS = 16


def stripe(chunks: Sequence[Item], channels: int, first: int = 0) -> list[list[Item]]:
    """``chunks`` cut into ``channels`` contiguous groups, as even in count as
    they can be; group ``i`` goes to channel ``(first + i) % channels``.

    Returns one list per channel, in channel order; a channel with no chunk
    of this batch gets an empty list (it still sends the immediate).
    """
    if channels < 1:
        raise ValueError(f"at least one channel, not {channels}")
    base, extra = divmod(len(chunks), channels)
    groups: list[list[Item]] = [[] for _ in range(channels)]
    start = 0
    for position in range(channels):
        size = base + (1 if position < extra else 0)
        groups[(first + position) % channels] = list(chunks[start : start + size])
        start += size
    return groups


class LandingFence:
    """Which layers of one lease have landed, from its channels' immediates."""

    def __init__(self, channels: int, layers: int) -> None:
        if channels < 1 or layers < 1:
            raise ValueError(f"a fence needs channels and layers, not {channels}, {layers}")
        self.layers = layers
        # Channel c has placed its part of every layer below reported[c].
        self.reported = [0] * channels
        self.landed = 0

    @property
    def channels(self) -> int:
        return len(self.reported)

    def report(self, channel: int, layer: int) -> range | None:
        """Channel ``channel`` announced ``layer``: the layers that landed with
        it (often none yet), or None if the announcement is stale (a channel
        this lease does not have, a layer out of range or not after the
        channel's last)."""
        if not 0 <= channel < len(self.reported):
            return None
        if not self.reported[channel] <= layer < self.layers:
            return None
        self.reported[channel] = layer + 1
        before, self.landed = self.landed, min(self.reported)
        return range(before, self.landed)
