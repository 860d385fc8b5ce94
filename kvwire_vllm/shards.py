"""Which KV heads each tensor-parallel rank holds, which pushes carry them,
and the layout two engines must agree on before a byte moves.

A push carries one KV head of a request: every layer's blocks of that head,
named ``{transfer}.h{head}`` (``{transfer}.g{group}.h{head}`` for each
KV-cache group of a hybrid engine). Heads are what both engines can name without
knowing the other's tensor-parallel size, so any prefill TP meets any decode
TP, and the regrouping between them happens inside the copies into staging
and out of the receive pool, which happen anyway:

- prefill rank ``p`` pushes the heads it holds (``HeadPlacement.pushes``);
  where TP exceeds the heads, vLLM replicates each head over ``tp / heads``
  ranks, and only the first of them pushes it: a head crosses the wire once;
- decode rank ``d`` loads the pushes of the heads it holds, with
  ``HeadPlacement.readers`` ranks reading each one (the receiver frees it
  once that many have released it).

An MLA cache is one latent "head" that every rank holds whole: rank 0 pushes
it, every decode rank reads that one push.

No vLLM import: tested with the daemons' suite (tests/unit/test_vllm_shards.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from kvwired.errors import ConfigError, KvwireError, UsageError

MAX_HEADS = 1024


def push_name(transfer: str, head: int, group: int = 0, groups: int = 1) -> str:
    """The daemons' request id of ``transfer``'s push of KV head ``head`` (of
    KV-cache group ``group``, for an engine with several)."""
    return f"{transfer}.h{head}" if groups == 1 else f"{transfer}.g{group}.h{head}"


_PUSH_SUFFIX = re.compile(r"(\.g\d+)?\.h\d+$")


def transfer_of(push: str) -> str:
    """The transfer a push belongs to (``push_name``'s inverse)."""
    return _PUSH_SUFFIX.sub("", push)


@dataclass(frozen=True)
class HeadPlacement:
    """vLLM's placement of ``heads`` KV heads over ``tp`` ranks.

    ``tp`` at most ``heads``: rank r holds ``heads / tp`` consecutive heads.
    ``tp`` above ``heads``: each rank holds one head, head h on ranks
    ``h * tp / heads`` up to the next head's (vLLM's ``num_kv_head_replicas``).
    """

    heads: int
    tp: int

    def __post_init__(self) -> None:
        if not 1 <= self.heads <= MAX_HEADS or self.tp < 1:
            raise ConfigError(f"{self.heads} KV heads over tensor_parallel_size {self.tp}: "
                              "both must be positive")
        if self.heads % self.tp and self.tp % self.heads:
            raise ConfigError(
                f"tensor_parallel_size {self.tp} neither divides the model's {self.heads} "
                "KV heads nor is a multiple of them",
                hint="vLLM itself needs one or the other; pick a size that does")

    @property
    def replicas(self) -> int:
        """Ranks holding each head."""
        return max(1, self.tp // self.heads)

    @property
    def per_rank(self) -> int:
        """Heads each rank holds."""
        return max(1, self.heads // self.tp)

    def held(self, rank: int) -> range:
        """The heads rank ``rank`` holds, in the order of its cache's head axis."""
        self._check(rank)
        first = rank // self.replicas * self.per_rank
        return range(first, first + self.per_rank)

    def pushes(self, rank: int) -> range:
        """The heads rank ``rank`` pushes: those it holds, unless an earlier
        replica pushes them."""
        return self.held(rank) if rank % self.replicas == 0 else range(0)

    def readers(self, head: int) -> int:
        """Decode ranks that read head ``head``'s push."""
        return self.replicas

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.tp:
            raise UsageError(f"rank {rank} is not one of tensor_parallel_size {self.tp}")


# Fields a layout must agree on, in the order a mismatch names them. The TP
# size and rank are carried too, but differ freely: heads are regrouped.
_AGREED = ("attention", "dtype", "layers", "kv_heads", "head_size", "block_size",
           "head_bytes", "groups", "block_format")
# Fields that differ when only the block size does, which the copy bridges.
_BRIDGED = ("block_size", "head_bytes")


@dataclass(frozen=True)
class EngineLayout:
    """What shapes a pushed (layer, block, head): both engines' must agree.

    ``head_bytes`` is one head of one block of one layer; ``block_format`` is
    the attention kernel's private layout inside a block (on the CPU backend
    it depends on the instruction set), so blocks move as opaque bytes and
    only between engines that format them alike.
    """

    attention: str  # "mha" (K and V per head) or "mla" (one latent cache)
    dtype: str
    layers: int
    kv_heads: int  # the model's, not the rank's; 1 for MLA
    head_size: int
    block_size: int
    head_bytes: int
    block_format: str
    # The KV-cache groups as "kind:layers" joined by "+": "full:2", or
    # "sliding64:1+full:1" for a hybrid model (kvwire_vllm.groups).
    groups: str = "full"
    tp: int = 1

    def __post_init__(self) -> None:
        HeadPlacement(self.kv_heads, self.tp)  # raises on a TP vLLM cannot run

    @property
    def placement(self) -> HeadPlacement:
        return HeadPlacement(self.kv_heads, self.tp)

    def key(self) -> str:
        """Everything that must agree, as text (the seals' fingerprint hashes it)."""
        return "|".join(f"{name}={getattr(self, name)}" for name in _AGREED)

    def differences(self, prefill: EngineLayout) -> list[str]:
        """What keeps this (decode) engine from taking ``prefill``'s pushes, one
        phrase each: "block_size: prefill 128, decode 16". A block size the
        copy bridges (``bridges``) is not one."""
        differing = [name for name in _AGREED if getattr(prefill, name) != getattr(self, name)]
        if self.bridges(prefill):
            differing = [name for name in differing if name not in _BRIDGED]
        return [f"{name}: prefill {getattr(prefill, name)}, decode {getattr(self, name)}"
                for name in differing]

    def bridges(self, prefill: EngineLayout) -> bool:
        """Whether this engine's copy regroups ``prefill``'s blocks into its own:
        the same layout at a block size that divides this one's or that this
        one's divides (kvwire_vllm.blockmap), for K and V heads (an MLA cache's
        block size is fixed by vLLM on both sides)."""
        small, large = sorted((prefill.block_size, self.block_size))
        # The CPU backend's kernel is the one whose format kvwire can ask.
        return (self.attention == "mha" and self.block_format.startswith("cpu/")
                and large % small == 0
                and prefill.with_block_size(self.block_size).key() == self.key())

    def with_block_size(self, block_size: int) -> EngineLayout:
        """This layout at another block size: a head's block grows with its tokens."""
        return replace(self, block_size=block_size,
                       head_bytes=self.head_bytes // self.block_size * block_size)

    def to_params(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_params(cls, value: object, where: str) -> EngineLayout:
        """A layout as ``kv_transfer_params`` carry it, checked field by field."""
        if not isinstance(value, Mapping):
            raise UsageError(f"{where}: kvwire_layout {value!r} is not a layout",
                             hint="pass the prefill engine's kv_transfer_params unchanged")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        missing = sorted(set(_AGREED) - set(value))
        if unknown or missing:
            raise UsageError(f"{where}: kvwire_layout has unknown fields {unknown} or lacks "
                             f"{missing}", hint="do both engines run the same kvwire release?")
        values: dict[str, Any] = {}
        for name, raw in value.items():
            text = known[name].type in ("str", str)
            if text and not (isinstance(raw, str) and 0 < len(raw) <= 200):
                raise UsageError(f"{where}: kvwire_layout {name} {raw!r} is not a name")
            if not text and (not isinstance(raw, int) or isinstance(raw, bool)
                             or not 0 < raw < 1 << 40):
                raise UsageError(f"{where}: kvwire_layout {name} {raw!r} is not a size")
            values[name] = raw
        try:
            return cls(**values)
        except ConfigError as exc:
            raise UsageError(f"{where}: kvwire_layout: {exc.message}") from None


class LayoutMismatch(KvwireError, code="layout_mismatch",
                     hint="run both engines with the same model, dtype, block size and "
                          "attention backend on the same CPU kind (their TP sizes may "
                          "differ); vLLM's kv_load_failure_policy decides meanwhile"):
    """The prefill engine's pushes cannot mean the same thing in this engine."""
