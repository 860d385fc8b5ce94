"""What the clients hand back: a push's result, and a decode engine's events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..layout import RequestShape


@dataclass(frozen=True)
class PushResult:
    req: str
    bytes: int
    checksum: int
    seconds: float  # open() to delivered, as the engine saw it
    timings: dict[str, float]

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds else 0.0


@dataclass(frozen=True)
class LayerLanded:
    """Layer ``layer`` of ``req`` is in the pool, at ``offset`` within the
    request's ``length`` bytes there (``view`` reads it before the rest lands;
    only ``Delivered`` says every byte is in and checked)."""

    req: str
    layer: int
    offset: int | None = None
    length: int | None = None


@dataclass(frozen=True)
class PushOpened:
    """``req`` has a slot at the receiver and its bytes are on the way; ``note``
    is what the prefill engine said about it with its open (its KV layout)."""

    req: str
    note: dict[str, Any] | None = None


@dataclass(frozen=True)
class Delivered:
    req: str
    offset: int
    length: int
    layers: int
    checksum: int  # kvwired.checksum of the request, as the receiver hashed it

    @property
    def shape(self) -> RequestShape:
        return RequestShape(self.layers, self.length // self.layers)

