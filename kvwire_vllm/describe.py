"""An engine's KV cache as kvwire moves it, read off vLLM's configuration.

The scheduler and every worker describe their engine the same way, from the
same configuration, so the layout a prefill engine announces is the one its
workers push, and a decode engine compares it with its own before it plans a
load. Shapes kvwire cannot carry are refused here, at engine start, naming
the field and what is supported: never in the middle of a request.

Read through attributes (vLLM's ``VllmConfig`` and ``KVCacheConfig``), with
no vLLM import, so the refusals are tested with the daemons' suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvwired.errors import ConfigError

from .shards import EngineLayout, HeadPlacement, push_name


@dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group: layers sharing a block table (vLLM's ``KVCacheGroupSpec``)."""

    index: int
    kind: str  # "full", "mla" or "sliding"
    window: int | None  # sliding: the tokens a layer attends to
    layer_names: tuple[str, ...]
    local_heads: int  # heads of this rank's cache
    head_bytes: int  # one head of one block of one layer

    @property
    def label(self) -> str:
        kind = f"sliding{self.window}" if self.kind == "sliding" else self.kind
        return f"{kind}:{len(self.layer_names)}"


@dataclass(frozen=True)
class HeadPush:
    """One push of a request as a rank sees it: a KV head of one group."""

    name: str  # the daemons' request id
    group: CacheGroup
    head: int  # on this rank's head axis
    readers: int  # decode ranks that read it


@dataclass(frozen=True)
class EngineCache:
    """What one engine (or one of its ranks) moves."""

    layout: EngineLayout
    groups: tuple[CacheGroup, ...]

    @property
    def placement(self) -> HeadPlacement:
        return self.layout.placement

    def head_pushes(self, transfer: str, heads: range, rank: int) -> list[HeadPush]:
        """``transfer``'s pushes of ``heads`` (some of those rank ``rank`` holds),
        every group's: the names both engines' ranks agree on."""
        held = self.placement.held(rank)
        return [HeadPush(push_name(transfer, head, group.index, len(self.groups)), group,
                         head - held.start, self.placement.readers(head))
                for group in self.groups for head in heads]


def describe(vllm_config: Any, kv_cache_config: Any, block_format: str) -> EngineCache:
    """The engine's layout and cache groups; ``ConfigError`` for a shape kvwire
    cannot carry, saying what can. ``block_format``: the attention kernel's
    private layout inside a block (kvwire_vllm.cache.block_format)."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            f"pipeline_parallel_size {parallel.pipeline_parallel_size}: kvwire's connector "
            "carries tensor-parallel engines, not pipeline-parallel ones",
            hint="run the engine with pipeline_parallel_size 1 (vLLM's CPU build cannot "
                 "run pipeline stages either); tensor_parallel_size may be any size")
    model = vllm_config.model_config
    mla = bool(getattr(model, "use_mla", False))
    groups = tuple(_group(n, group) for n, group in
                   enumerate(kv_cache_config.kv_cache_groups))
    if not groups:
        raise ConfigError("vLLM gave the connector no KV-cache group")
    kinds = {g.kind for g in groups}
    if mla and kinds != {"mla"}:
        raise ConfigError(f"an MLA model with KV-cache groups {sorted(kinds)}: kvwire "
                          "carries MLA caches whose every layer is MLA")
    first = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    layout = EngineLayout(
        attention="mla" if mla else "mha",
        dtype=str(first.dtype).removeprefix("torch."),
        layers=sum(len(g.layer_names) for g in groups),
        kv_heads=1 if mla else int(model.get_total_num_kv_heads()),
        head_size=int(first.head_size),
        block_size=int(first.block_size),
        head_bytes=groups[0].head_bytes,
        block_format=block_format,
        groups="+".join(g.label for g in groups),
        tp=int(parallel.tensor_parallel_size))
    for group in groups:
        if group.local_heads != layout.placement.per_rank:
            raise ConfigError(f"KV-cache group {group.index} holds {group.local_heads} heads "
                              f"per rank; {layout.placement.per_rank} were expected of "
                              f"{layout.kv_heads} heads over tensor_parallel_size {layout.tp}")
    return EngineCache(layout, groups)


def _group(index: int, group: Any) -> CacheGroup:
    spec = group.kv_cache_spec
    name = type(spec).__name__
    kind = {"FullAttentionSpec": "full", "MLAAttentionSpec": "mla",
            "SlidingWindowSpec": "sliding"}.get(name)
    # A FullAttentionSpec may carry a sliding_window: vLLM's hybrid manager is
    # off and the sliding layers keep every block. They are full here too.
    if kind is None:
        raise ConfigError(
            f"KV-cache group {index} is a {name}: kvwire's connector carries full "
            "attention, MLA and sliding-window caches",
            hint="other kinds (Mamba, chunked local attention, ...) are not supported yet")
    heads = int(spec.num_kv_heads)
    page = int(spec.page_size_bytes)
    if page % heads:
        raise ConfigError(f"KV-cache group {index}: a block of {page} B does not split "
                          f"into {heads} heads")
    return CacheGroup(index, kind, int(spec.sliding_window) if kind == "sliding" else None,
                      tuple(group.layer_names), heads, page // heads)
