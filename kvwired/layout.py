"""KV cache shape, byte offsets, named granularities and chunk plans.

The cache of one request is stored layer-major: layer n occupies
``[n * layer_bytes, (n + 1) * layer_bytes)`` and inside a layer each token's K
and V for all KV heads sit together (token-major). That is the order a
prefill engine produces it in, so a layer can be shipped as soon as it is
computed.

Granularities are transfer sizes named after the KV unit of that size for
the model shape: ``per-token-per-layer`` is one token's K and V in one layer
(512 B for Qwen2.5-0.5B), ``per-token`` the same across all layers (12 KiB),
``per-layer`` one layer (2 MiB), ``whole`` the request. Chunks are
contiguous byte ranges of that size. A chunk no larger than a layer is cut
inside its layer (a layer's last chunk may be short, e.g. 170 x 12 KiB +
8 KiB per 2 MiB layer), so each layer ships the moment it is committed; a
larger chunk spans layers and is sent once every layer it touches is in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from .errors import ConfigError, UsageError
from .units import parse_size

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8": 1, "int8": 1}

GRANULARITIES = ("per-token-per-layer", "per-token", "per-layer", "whole")


@dataclass(frozen=True)
class RequestShape:
    """What the data path needs to know of a request: layers and their size."""

    layers: int
    layer_bytes: int

    def __post_init__(self) -> None:
        if self.layers < 1 or self.layer_bytes < 1:
            raise ConfigError(
                f"a request needs at least one layer of at least one byte "
                f"(got {self.layers} layers of {self.layer_bytes} B)"
            )

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes

    def layer_span(self, layer: int) -> tuple[int, int]:
        """Byte offset and length of one layer inside the request."""
        if not 0 <= layer < self.layers:
            raise UsageError(f"layer {layer} is outside 0..{self.layers - 1}")
        return layer * self.layer_bytes, self.layer_bytes

    def to_wire(self) -> dict[str, int]:
        return {"layers": self.layers, "layer_bytes": self.layer_bytes}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RequestShape:
        return cls(int(data["layers"]), int(data["layer_bytes"]))


@dataclass(frozen=True)
class KVLayout:
    """The model-side shape of a KV cache (defaults: Qwen2.5-0.5B, 4,096 tokens)."""

    layers: int = 24
    tokens: int = 4096
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "fp16"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"unknown dtype {self.dtype!r}", hint=f"use one of {', '.join(DTYPE_BYTES)}"
            )
        for name in ("layers", "tokens", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"layout field {name} must be at least 1")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def token_layer_bytes(self) -> int:
        """One token's K and V in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """One token's K and V across all layers."""
        return self.token_layer_bytes * self.layers

    @property
    def layer_bytes(self) -> int:
        return self.token_layer_bytes * self.tokens

    @property
    def total_bytes(self) -> int:
        return self.layer_bytes * self.layers

    def shape(self) -> RequestShape:
        return RequestShape(self.layers, self.layer_bytes)

    def offset(self, layer: int, token: int, kv: int, head: int) -> int:
        """Byte offset of one head's K (kv=0) or V (kv=1) vector."""
        per_head = self.head_dim * self.dtype_bytes
        return (
            layer * self.layer_bytes
            + token * self.token_layer_bytes
            + (kv * self.kv_heads + head) * per_head
        )

    def granularity_bytes(self, name: str) -> int:
        sizes = {
            "per-token-per-layer": self.token_layer_bytes,
            "per-token": self.token_bytes,
            "per-layer": self.layer_bytes,
            "whole": self.total_bytes,
        }
        if name not in sizes:
            raise ConfigError(
                f"unknown granularity {name!r}",
                hint=f"use one of {', '.join(GRANULARITIES)} or a byte size like 64KiB",
            )
        return sizes[name]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_chunk_bytes(spec: str | int, layout: KVLayout | RequestShape | None = None) -> int:
    """A granularity name or an explicit size, in bytes.

    Names resolve against the request's own layout: a ``RequestShape`` knows
    its layers (per-layer, whole) but not its tokens; with no layout at all
    (a daemon's default chunk) they mean the reference Qwen2.5-0.5B cache.
    """
    if isinstance(spec, str) and spec in GRANULARITIES:
        if isinstance(layout, RequestShape):
            if spec == "per-layer":
                return layout.layer_bytes
            if spec == "whole":
                return layout.total_bytes
            raise UsageError(
                f"{spec!r} needs the request's tokens, which a RequestShape does not carry",
                hint="open with a KVLayout, or give the chunk in bytes")
        return (layout or KVLayout()).granularity_bytes(spec)
    size = parse_size(spec)
    if size < 1:
        raise ConfigError(f"chunk size must be at least 1 byte (got {spec!r})")
    return size


class Chunk(NamedTuple):
    # A NamedTuple, not a dataclass: a 48 MiB request at 512 B makes 98,304.
    offset: int
    length: int


@dataclass(frozen=True)
class Batch:
    """Chunks that became sendable after a commit, and the layer the last one completes."""

    chunks: list[Chunk]
    completes_layer: int


class ChunkCursor:
    """Walks a request's chunk plan as layers are committed, in order.

    ``commit(n)`` returns the chunks that layer n made sendable; the last of
    them carries the immediate naming the highest layer now fully written.
    """

    def __init__(self, shape: RequestShape, chunk_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ConfigError("chunk size must be at least 1 byte")
        self.shape = shape
        self.chunk_bytes = chunk_bytes
        self._next_offset = 0
        self._next_layer = 0

    @property
    def done(self) -> bool:
        return self._next_offset >= self.shape.total_bytes

    def commit(self, layer: int) -> Batch | None:
        if layer != self._next_layer:
            raise UsageError(
                f"layer {layer} committed out of order",
                hint=f"commit layers in order; layer {self._next_layer} is next",
            )
        if layer >= self.shape.layers:
            raise UsageError(f"layer {layer} is outside 0..{self.shape.layers - 1}")
        self._next_layer += 1
        if self.chunk_bytes <= self.shape.layer_bytes:
            # Chunks stay inside their layer (the last one of a layer may be
            # short) so a layer's event never waits for the next layer.
            start, length = self.shape.layer_span(layer)
            chunks = [
                Chunk(start + c.offset, c.length) for c in plan_chunks(length, self.chunk_bytes)
            ]
            self._next_offset = start + length
            return Batch(chunks, layer)
        ready_end = self._next_layer * self.shape.layer_bytes
        total = self.shape.total_bytes
        chunks = []
        while self._next_offset < total:
            end = min(self._next_offset + self.chunk_bytes, total)
            if end > ready_end:
                break
            chunks.append(Chunk(self._next_offset, end - self._next_offset))
            self._next_offset = end
        if not chunks:
            return None
        # A chunk spanning layers completes every layer it fully covers.
        return Batch(chunks, self._next_offset // self.shape.layer_bytes - 1)


def plan_chunks(total_bytes: int, chunk_bytes: int) -> Iterator[Chunk]:
    """Contiguous chunks covering ``total_bytes`` (the last may be short)."""
    for offset in range(0, total_bytes, chunk_bytes):
        yield Chunk(offset, min(chunk_bytes, total_bytes - offset))
