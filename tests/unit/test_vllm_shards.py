"""Heads over tensor-parallel ranks, and the layout two engines agree on."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire_vllm.shards import EngineLayout, HeadPlacement, push_name, transfer_of
from kvwired.errors import ConfigError, UsageError


@st.composite
def placements(draw: st.DrawFn) -> HeadPlacement:
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    tp = draw(st.sampled_from([n for n in (1, 2, 4, 8, 16, 32)
                               if heads % n == 0 or n % heads == 0]))
    return HeadPlacement(heads, tp)


@given(placements())
def test_every_head_is_pushed_exactly_once_whatever_the_tp(placement: HeadPlacement) -> None:
    pushed = [h for rank in range(placement.tp) for h in placement.pushes(rank)]
    assert sorted(pushed) == list(range(placement.heads))


@given(placements())
def test_each_head_is_held_by_as_many_ranks_as_read_it(placement: HeadPlacement) -> None:
    holders = {h: 0 for h in range(placement.heads)}
    for rank in range(placement.tp):
        held = placement.held(rank)
        assert len(held) == placement.per_rank
        for head in held:
            holders[head] += 1
    assert all(count == placement.readers(head) for head, count in holders.items())


@given(placements(), st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_any_decode_tp_finds_every_head_it_holds_among_any_prefill_tps_pushes(
        prefill: HeadPlacement, decode_tp: int) -> None:
    if prefill.heads % decode_tp and decode_tp % prefill.heads:
        return  # a TP vLLM itself refuses
    decode = HeadPlacement(prefill.heads, decode_tp)
    pushed = {push_name("t", h) for rank in range(prefill.tp) for h in prefill.pushes(rank)}
    for rank in range(decode.tp):
        assert {push_name("t", h) for h in decode.held(rank)} <= pushed


def test_vllms_placements_for_the_cases_of_the_guide() -> None:
    assert [list(HeadPlacement(2, 2).held(r)) for r in range(2)] == [[0], [1]]
    assert list(HeadPlacement(2, 1).held(0)) == [0, 1]
    # TP 4 over 2 heads: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1.
    four = HeadPlacement(2, 4)
    assert [list(four.held(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(four.pushes(r)) for r in range(4)] == [[0], [], [1], []]
    # MLA: one latent cache that every rank holds; rank 0 pushes it.
    mla = HeadPlacement(1, 2)
    assert [list(mla.pushes(r)) for r in range(2)] == [[0], []] and mla.readers(0) == 2


def test_a_tp_vllm_could_not_run_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 neither divides the "
                                          "model's 2 KV heads"):
        HeadPlacement(2, 3)


LAYOUT = EngineLayout(attention="mha", dtype="float32", layers=2, kv_heads=2, head_size=32,
                      block_size=128, head_bytes=32768, block_format="cpu/AVX512", groups="full:2",
                      tp=2)


def test_layouts_that_differ_only_in_tp_agree() -> None:
    other = EngineLayout(**{**LAYOUT.to_params(), "tp": 1})
    assert LAYOUT.differences(other) == [] and LAYOUT.key() == other.key()


def _at(block_size: int, **changes: object) -> EngineLayout:
    return EngineLayout(**{**LAYOUT.to_params(), **changes}).with_block_size(block_size)


@pytest.mark.parametrize(("prefill", "decode"), [(128, 32), (32, 128), (64, 128), (128, 128)])
def test_block_sizes_that_divide_each_other_are_bridged_not_refused(prefill: int,
                                                                    decode: int) -> None:
    assert _at(decode).bridges(_at(prefill)) and _at(decode).differences(_at(prefill)) == []
    assert _at(decode).head_bytes == 32768 // 128 * decode


def test_a_block_size_the_copy_cannot_bridge_names_both_sides_values() -> None:
    assert _at(96).differences(_at(128)) == ["block_size: prefill 128, decode 96",
                                             "head_bytes: prefill 32768, decode 24576"]
    # An MLA cache is not regrouped (vLLM fixes its block size on both sides).
    mla = {"attention": "mla", "kv_heads": 1}
    assert _at(32, **mla).differences(_at(128, **mla))[0] == "block_size: prefill 128, decode 32"


def test_a_block_size_and_another_difference_name_both() -> None:
    assert _at(32, dtype="bfloat16").differences(_at(128)) == [
        "dtype: prefill float32, decode bfloat16", "block_size: prefill 128, decode 32",
        "head_bytes: prefill 32768, decode 8192"]


def test_a_layout_survives_the_params_round_trip() -> None:
    assert EngineLayout.from_params(LAYOUT.to_params(), "here") == LAYOUT


@given(st.dictionaries(st.sampled_from([*LAYOUT.to_params(), "extra"]),
                       st.one_of(st.integers(-5, 1 << 41), st.text(max_size=3), st.none(),
                                 st.booleans(), st.lists(st.integers(), max_size=2))))
def test_any_params_layout_is_a_layout_or_a_usage_error(raw: dict[str, object]) -> None:
    try:
        layout = EngineLayout.from_params({**LAYOUT.to_params(), **raw}, "here")
    except UsageError as exc:
        assert exc.message.startswith("here: kvwire_layout")
    else:
        assert layout.differences(layout) == []


@pytest.mark.parametrize("value", [None, 3, "mha", [1, 2]])
def test_a_layout_that_is_not_a_mapping_is_a_usage_error(value: object) -> None:
    with pytest.raises(UsageError, match="is not a layout"):
        EngineLayout.from_params(value, "here")


@given(st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True), st.integers(0, 1023),
       st.integers(0, 7), st.integers(1, 8))
def test_a_push_name_leads_back_to_its_transfer(transfer: str, head: int, group: int,
                                                groups: int) -> None:
    assert transfer_of(push_name(transfer, head, min(group, groups - 1), groups)) == transfer
