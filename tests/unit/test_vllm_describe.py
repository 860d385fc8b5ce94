"""An engine described from vLLM's configuration, and the shapes refused at start.

vLLM's ``VllmConfig`` and ``KVCacheConfig`` are read through attributes, so
these run without vLLM: the fakes carry exactly what the connector reads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvwire_vllm.describe import describe
from kvwired.errors import ConfigError


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MLAAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def spec(kind: type[SimpleNamespace] = FullAttentionSpec, heads: int = 1, head_size: int = 32,
         block_size: int = 128, **extra: Any) -> SimpleNamespace:
    per_token = head_size if kind is MLAAttentionSpec else 2 * head_size
    return kind(num_kv_heads=heads, head_size=head_size, block_size=block_size,
                dtype="torch.float32", page_size_bytes=heads * block_size * per_token * 4,
                **extra)


def engine(*groups: tuple[list[str], SimpleNamespace], total_heads: int = 2, tp: int = 1,
           pp: int = 1, mla: bool = False) -> tuple[SimpleNamespace, SimpleNamespace]:
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=SimpleNamespace(use_mla=mla, get_total_num_kv_heads=lambda: total_heads))
    cache = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=names, kv_cache_spec=s) for names, s in groups])
    return config, cache


LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_a_tp2_engine_holds_one_of_two_heads_per_rank_and_says_so_in_its_layout() -> None:
    described = describe(*engine((LAYERS, spec(heads=1)), tp=2), "cpu/AVX512")
    layout = described.layout
    assert (layout.attention, layout.kv_heads, layout.tp, layout.groups) == \
        ("mha", 2, 2, "full:2")
    assert layout.head_bytes == 128 * 2 * 32 * 4 and layout.block_format == "cpu/AVX512"
    assert list(described.placement.held(1)) == [1]


def test_a_hybrid_engine_has_a_sliding_group_with_its_window() -> None:
    described = describe(*engine((LAYERS[:1], spec(SlidingWindowSpec, heads=2,
                                                   sliding_window=64)),
                                 (LAYERS[1:], spec(heads=2))), "cpu/AVX512")
    assert [(g.kind, g.window) for g in described.groups] == [("sliding", 64), ("full", None)]
    assert described.layout.groups == "sliding64:1+full:1"


def test_sliding_layers_of_a_disabled_hybrid_manager_are_full_and_move_whole() -> None:
    """vLLM without SupportsHMA promotes sliding layers to full attention that
    keeps a sliding_window field: never trimmed."""
    described = describe(*engine((LAYERS, spec(heads=2, sliding_window=64))), "cpu/AVX512")
    assert [(g.kind, g.window) for g in described.groups] == [("full", None)]


def test_an_mla_engine_is_one_latent_head_whatever_the_tp() -> None:
    described = describe(*engine((LAYERS, spec(MLAAttentionSpec, head_size=576,
                                               block_size=16)),
                                 total_heads=4, tp=2, mla=True), "cpu/AVX512")
    layout = described.layout
    assert (layout.attention, layout.kv_heads, layout.head_bytes) == ("mla", 1, 16 * 576 * 4)
    assert [list(described.placement.pushes(r)) for r in range(2)] == [[0], []]


def test_pipeline_parallel_is_refused_at_start_by_name() -> None:
    with pytest.raises(ConfigError, match="pipeline_parallel_size 2") as info:
        describe(*engine((LAYERS, spec(heads=2)), pp=2), "cpu/AVX512")
    assert "tensor_parallel_size may be any size" in (info.value.hint or "")


def test_a_cache_group_kvwire_cannot_carry_is_refused_naming_its_kind() -> None:
    with pytest.raises(ConfigError, match="KV-cache group 1 is a MambaSpec") as info:
        describe(*engine((LAYERS[:1], spec(heads=2)), (LAYERS[1:], MambaSpec())),
                 "cpu/AVX512")
    assert "full attention, MLA and sliding-window" in info.value.message


def test_a_tp_that_neither_divides_nor_multiplies_the_heads_is_refused() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 neither divides"):
        describe(*engine((LAYERS, spec(heads=1)), total_heads=2, tp=3), "cpu/AVX512")


def test_a_pushing_rank_and_a_reading_rank_name_a_head_alike() -> None:
    """TP 4 over 2 heads: rank 2 pushes head 1 (its first replica), rank 3 holds
    it too and pushes nothing; a TP 4 decode engine's ranks 2 and 3 both read
    that one push, at their own head 0."""
    described = describe(*engine((LAYERS, spec(heads=1)), total_heads=2, tp=4), "cpu/AVX512")
    placement = described.placement
    [pushed] = described.head_pushes("t", placement.pushes(2), rank=2)
    assert described.head_pushes("t", placement.pushes(3), rank=3) == []
    read = [described.head_pushes("t", placement.held(r), rank=r) for r in (2, 3)]
    assert read[0] == read[1] == [pushed]
    assert (pushed.name, pushed.head, pushed.readers) == ("t.h1", 0, 2)
