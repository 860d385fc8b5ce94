"""The seal at the end of every layer a prefill engine pushes.

A layer of a push is the request's KV blocks of that layer, as opaque bytes,
then a 64-byte seal the prefill side writes from what it read out of its own
KV cache:

    magic "KVWSEAL1" | layer, layers (u32) | blocks, block_size (u32) |
    block_bytes (u64) | transfer (u64, XXH3 of the transfer id) |
    layout (u64, XXH3 of dtype, heads, head size, block size and CPU ISA) |
    digest (u64, XXH3 of this layer's blocks) | 8 bytes reserved

The decode side checks every layer's seal before a byte of it reaches the
engine's cache: the digest catches a byte changed anywhere between the two
engines (wire, daemons, pools), the transfer and layer fields catch stale
bytes of another request or layer, and the layout catches two engines whose
KV blocks would not mean the same thing. It is the engine-to-engine check
that kvwire's own per-request checksum (daemon to daemon) cannot be: it
covers the staging and receive pools too.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvwired.errors import KvwireError

SEAL = struct.Struct("<8sIIIIQQQQ8x")
SEAL_BYTES = SEAL.size  # 64
MAGIC = b"KVWSEAL1"


class SealBroken(KvwireError, code="seal_broken",
                 hint="the decode engine computes this prompt itself; if it recurs, "
                      "check that both engines run the same model, dtype and block size "
                      "on the same CPU kind, and the receiver's memory"):
    """A pushed layer's seal does not match its bytes or this engine's layout."""


def transfer_hash(transfer: str) -> int:
    return xxhash.xxh3_64_intdigest(transfer.encode())


def layout_fingerprint(description: str) -> int:
    """Fingerprint of everything that must agree for a block to mean the same."""
    return xxhash.xxh3_64_intdigest(description.encode())


@dataclass(frozen=True)
class LayerSeal:
    layer: int
    layers: int
    blocks: int
    block_size: int
    block_bytes: int
    transfer: int
    layout: int
    digest: int

    def pack_into(self, buffer: memoryview) -> None:
        SEAL.pack_into(buffer, 0, MAGIC, self.layer, self.layers, self.blocks,
                       self.block_size, self.block_bytes, self.transfer, self.layout,
                       self.digest)

    @classmethod
    def unpack(cls, buffer: memoryview | bytes) -> LayerSeal:
        magic, *fields = SEAL.unpack_from(buffer, 0)
        if magic != MAGIC:
            raise SealBroken(f"no seal at the end of the layer (found {bytes(magic)!r}); "
                             "is the prefill engine running kvwire's connector of this "
                             "version?")
        return cls(*fields)


def layer_bytes(blocks: int, block_bytes: int) -> int:
    """A pushed layer's size: its blocks, then the seal."""
    return blocks * block_bytes + SEAL_BYTES


def seal_layer(layer: memoryview, expected: LayerSeal) -> None:
    """Write ``layer``'s seal (its last SEAL_BYTES) with the digest of its blocks."""
    kv = layer[: len(layer) - SEAL_BYTES]
    sealed = LayerSeal(expected.layer, expected.layers, expected.blocks, expected.block_size,
                       expected.block_bytes, expected.transfer, expected.layout,
                       xxhash.xxh3_64_intdigest(kv))
    sealed.pack_into(layer[len(layer) - SEAL_BYTES:])


def check_layer(layer: memoryview, expected: LayerSeal) -> memoryview:
    """The layer's blocks if its seal says they are ``expected``'s, intact.

    ``expected.digest`` is ignored: the blocks are hashed here."""
    if len(layer) != layer_bytes(expected.blocks, expected.block_bytes):
        raise SealBroken(f"layer {expected.layer} is {len(layer)} B; "
                         f"{layer_bytes(expected.blocks, expected.block_bytes)} B expected")
    kv = layer[: len(layer) - SEAL_BYTES]
    seal = LayerSeal.unpack(layer[len(layer) - SEAL_BYTES:])
    for name in ("layer", "layers", "blocks", "block_size", "block_bytes"):
        if getattr(seal, name) != getattr(expected, name):
            raise SealBroken(f"layer {expected.layer}: the seal says {name} "
                             f"{getattr(seal, name)}, this engine expects "
                             f"{getattr(expected, name)}")
    if seal.transfer != expected.transfer:
        raise SealBroken(f"layer {expected.layer} belongs to another transfer (stale bytes "
                         "in the slot)")
    if seal.layout != expected.layout:
        raise SealBroken("the prefill engine's KV layout differs from this engine's "
                         "(dtype, KV heads, head size, block size or CPU instruction set)")
    if xxhash.xxh3_64_intdigest(kv) != seal.digest:
        raise SealBroken(f"layer {expected.layer}'s bytes do not match its seal: changed "
                         "between the engines")
    return kv
