"""The vLLM connector's plain-Python parts: its params, its plans, its seal.

No vLLM here (these run in the daemons' suite): the planners are driven the
way vLLM's scheduler drives them, step by step, and the seal is attacked
byte by byte.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire_vllm import stats
from kvwire_vllm.params import (
    DEFAULT_DEADLINE,
    ConnectorSettings,
    LoadOrder,
    PushOrder,
)
from kvwire_vllm.scheduling import (
    ConsumerPlanner,
    ProducerPlanner,
    blocks_of,
    tail_to_recompute,
)
from kvwire_vllm.seal import (
    SEAL_BYTES,
    LayerSeal,
    SealBroken,
    check_layer,
    layer_bytes,
    seal_layer,
    transfer_hash,
)
from kvwired.client import VERDICT_GRACE
from kvwired.errors import ConfigError, KvwireError, UsageError


@dataclass
class FakeRequest:
    """The three attributes of vLLM's Request the planners read."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None


def push_params(**extra: Any) -> dict[str, Any]:
    return {"do_remote_decode": True, "kvwire_transfer": "t-1", **extra}


# ------------------------------------------------------------------ params


def test_a_push_order_takes_the_proxys_transfer_receiver_and_deadline() -> None:
    order = PushOrder.from_params(push_params(kvwire_receiver="decode-1",
                                              kvwire_deadline=3), DEFAULT_DEADLINE)
    assert order == PushOrder("t-1", "decode-1", 3.0)
    answer = order.answer(tokens=256, seconds_left=2.5)
    assert answer == {"do_remote_prefill": True, "kvwire_transfer": "t-1",
                      "kvwire_tokens": 256, "kvwire_deadline": 2.5}
    load = LoadOrder.from_params(answer)
    assert load == LoadOrder("t-1", 256, 2.5)
    assert load.wait == 2.5 + VERDICT_GRACE


TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_the_requests_trace_travels_with_both_orders_and_the_answer() -> None:
    order = PushOrder.from_params(push_params(kvwire_trace=TRACE), DEFAULT_DEADLINE)
    assert order is not None and order.trace == TRACE
    answer = order.answer(tokens=8, seconds_left=1.0)
    assert answer["kvwire_trace"] == TRACE
    load = LoadOrder.from_params(answer)
    assert load is not None and load.trace == TRACE
    # The planner keeps it when it names the default receiver.
    planner = ProducerPlanner(ConnectorSettings(receiver="decode-0"), block_size=4)
    planner.on_new_request(FakeRequest("r", [1, 2, 3], push_params(kvwire_trace=TRACE)))
    [push] = planner.plan([("r", [[7]], 0)], [], {"r": 3}).pushes
    assert (push.order.receiver, push.order.trace) == ("decode-0", TRACE)


@pytest.mark.parametrize("trace", ["", "nonsense", 7, None, {"traceparent": TRACE},
                                   TRACE.upper(), TRACE + "-extra"])
def test_a_trace_kvwire_cannot_read_is_left_out_not_an_error(trace: object) -> None:
    order = PushOrder.from_params(push_params(kvwire_trace=trace), DEFAULT_DEADLINE)
    assert order is not None and order.trace is None
    assert "kvwire_trace" not in order.answer(tokens=8, seconds_left=1.0)
    load = LoadOrder.from_params({"do_remote_prefill": True, "kvwire_transfer": "t-1",
                                  "kvwire_deadline": 2, "kvwire_trace": trace})
    assert load is not None and load.trace is None


def test_requests_without_the_flags_ask_for_nothing() -> None:
    assert PushOrder.from_params(None, 1.0) is None
    assert PushOrder.from_params({"do_remote_decode": False}, 1.0) is None
    assert LoadOrder.from_params({"do_remote_decode": True}) is None


def test_a_push_order_without_a_transfer_id_gets_a_fresh_one() -> None:
    first = PushOrder.from_params({"do_remote_decode": True}, 5.0)
    second = PushOrder.from_params({"do_remote_decode": True}, 5.0)
    assert first is not None and second is not None
    assert first.transfer != second.transfer and first.deadline == 5.0


@pytest.mark.parametrize("params, word", [
    (push_params(kvwire_transfer="has space"), "transfer id"),
    (push_params(kvwire_transfer=""), "transfer id"),
    (push_params(kvwire_deadline=0), "seconds"),
    (push_params(kvwire_deadline=float("nan")), "seconds"),
    (push_params(kvwire_deadline=True), "seconds"),
    (push_params(kvwire_receiver=""), "receiver name"),
    (push_params(kvwire_receiver=7), "receiver name"),
])
def test_a_bad_push_order_says_which_field_is_wrong(params: dict[str, Any], word: str) -> None:
    with pytest.raises(UsageError, match=word):
        PushOrder.from_params(params, DEFAULT_DEADLINE)


def test_a_load_asked_before_prefill_answered_expects_the_whole_prompt() -> None:
    planner = ConsumerPlanner(block_size=4)
    request = FakeRequest("r", list(range(10)), {
        "do_remote_prefill": True, "kvwire_transfer": "t", "kvwire_deadline": 3})
    assert planner.matched_tokens(request, 4) == (6, True)
    planner.allocated(request, ([20, 21, 22],), 6)
    [load] = planner.plan().loads
    assert (load.tokens, load.first, load.total, load.block_ids) == (10, 1, 3, [21, 22])


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True, "kvwire_transfer": "t", "kvwire_tokens": -1,
     "kvwire_deadline": 1},
    {"do_remote_prefill": True, "kvwire_transfer": "t", "kvwire_tokens": 1.5,
     "kvwire_deadline": 1},
    {"do_remote_prefill": True, "kvwire_tokens": 128, "kvwire_deadline": 1},
])
def test_a_bad_load_order_is_refused(params: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        LoadOrder.from_params(params)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3), max_leaves=8)


@given(st.dictionaries(st.sampled_from(["do_remote_decode", "do_remote_prefill",
                                        "kvwire_transfer", "kvwire_receiver",
                                        "kvwire_deadline", "kvwire_tokens", "other"]),
                       json_values))
def test_any_params_parse_or_are_refused_with_a_usage_error(params: dict[str, Any]) -> None:
    """What a proxy or a client sends is an adversary's input."""
    for parse in (lambda: PushOrder.from_params(params, DEFAULT_DEADLINE),
                  lambda: LoadOrder.from_params(params)):
        with contextlib.suppress(UsageError):
            parse()


def test_connector_settings_refuse_unknown_keys_and_bad_values() -> None:
    assert ConnectorSettings.from_extra(None) == ConnectorSettings()
    settings = ConnectorSettings.from_extra({"receiver": "d", "deadline": 4,
                                             "sender_socket": "/s"})
    assert (settings.receiver, settings.deadline, settings.sender_socket) == ("d", 4.0, "/s")
    with pytest.raises(ConfigError, match=r"unknown key.*recever"):
        ConnectorSettings.from_extra({"recever": "d"})
    with pytest.raises(ConfigError, match="deadline"):
        ConnectorSettings.from_extra({"deadline": -1})
    with pytest.raises(ConfigError, match="receiver_socket must be a string"):
        ConnectorSettings.from_extra({"receiver_socket": 3})


# --------------------------------------------------------------- planning


def test_a_chunked_prefill_pushes_once_in_its_last_chunk_with_all_its_blocks() -> None:
    planner = ProducerPlanner(ConnectorSettings(receiver="decode"), block_size=4)
    planner.on_new_request(FakeRequest("r", list(range(10)), push_params()))
    first = planner.plan([("r", ([7, 3],), 0)], [], {"r": 8})
    assert first.pushes == []  # 8 of 10 tokens computed: not the last chunk
    last = planner.plan([], [("r", ([9],), False, 8)], {"r": 2})
    assert [(p.req_id, p.blocks, p.order.receiver) for p in last.pushes] == \
        [("r", ([7, 3, 9],), "decode")]  # 10 tokens: 2 whole blocks and a partial one
    answer = planner.finished("r")
    assert answer is not None and answer["kvwire_tokens"] == 10
    assert planner.finished("r") is None  # once


def test_a_resumed_request_plans_with_its_new_blocks() -> None:
    planner = ProducerPlanner(ConnectorSettings(), block_size=4)
    planner.on_new_request(FakeRequest("r", list(range(12)), push_params()))
    planner.plan([("r", ([1, 2],), 0)], [], {"r": 8})
    plan = planner.plan([], [("r", ([5, 6, 7],), True, 0)], {"r": 12})  # preempted, resumed
    assert plan.pushes[0].blocks == ([5, 6, 7],)


def test_a_prompt_shorter_than_a_block_pushes_its_partial_block() -> None:
    """The decode engine then computes only the last token again (vLLM's rule
    for a prompt wholly in cache), not the whole block."""
    planner = ProducerPlanner(ConnectorSettings(), block_size=128)
    planner.on_new_request(FakeRequest("r", list(range(100)), push_params()))
    [push] = planner.plan([("r", ([0],), 0)], [], {"r": 100}).pushes
    assert push.blocks == ([0],)
    answer = planner.finished("r")
    assert answer is not None and answer["kvwire_tokens"] == 100
    consumer = ConsumerPlanner(128)
    request = FakeRequest("r", list(range(100)), answer)
    assert consumer.matched_tokens(request, 0) == (100, True)
    consumer.allocated(request, ([42],), 100)
    [load] = consumer.plan().loads
    assert (load.first, load.total, load.block_ids) == (0, 1, [42])


def test_a_request_aborted_before_its_prompt_was_computed_pushed_nothing() -> None:
    planner = ProducerPlanner(ConnectorSettings(), block_size=4)
    planner.on_new_request(FakeRequest("r", list(range(12)), push_params()))
    planner.plan([("r", ([1, 2],), 0)], [], {"r": 8})
    answer = planner.finished("r")
    assert answer is not None and answer["kvwire_tokens"] == 0


def test_bad_params_on_the_prefill_side_mean_no_push_not_a_crash() -> None:
    planner = ProducerPlanner(ConnectorSettings(), block_size=4)
    planner.on_new_request(FakeRequest("r", [1] * 8, push_params(kvwire_deadline=-1)))
    assert planner.plan([("r", ([1, 2],), 0)], [], {"r": 8}).pushes == []
    assert planner.finished("r") is None


def test_the_consumer_is_asked_twice_without_side_effects_then_loads_once() -> None:
    planner = ConsumerPlanner(block_size=4)
    request = FakeRequest("r", list(range(14)), {
        "do_remote_prefill": True, "kvwire_transfer": "t", "kvwire_tokens": 12,
        "kvwire_deadline": 3})
    assert planner.matched_tokens(request, 4) == (8, True)  # 4 tokens in the local cache
    assert planner.matched_tokens(request, 4) == (8, True)
    planner.allocated(request, ([10, 11, 12, 13],), 8)
    assert planner.matched_tokens(request, 12) == (0, False)  # asked after the load
    [load] = planner.plan().loads
    assert (load.first, load.total, load.block_ids) == (1, 3, [11, 12])
    assert planner.plan().loads == []
    planner.finished("r")


def test_a_cpu_mla_engine_leaves_the_prompts_last_two_tokens_to_compute() -> None:
    """vLLM's CPU MLA decode kernel disagrees with its prefill path, so the
    decode engine computes the last two tokens (a prefill over the loaded
    context), not one, and gets their blocks' pushed bytes back after; the
    push and the blocks loaded stay whole."""
    from kvwire_vllm.shards import EngineLayout

    mla = EngineLayout(attention="mla", dtype="float32", layers=2, kv_heads=1,
                       head_size=576, block_size=16, head_bytes=36864,
                       block_format="cpu/AVX512", groups="full:2")
    assert tail_to_recompute(mla) == 2
    assert tail_to_recompute(replace(mla, block_format="cuda")) == 1
    assert tail_to_recompute(replace(mla, attention="mha", kv_heads=2)) == 1
    assert tail_to_recompute(None) == 1
    planner = ConsumerPlanner(block_size=16, layout=mla)
    request = FakeRequest("r", list(range(40)), {
        "do_remote_prefill": True, "kvwire_transfer": "t", "kvwire_tokens": 40,
        "kvwire_deadline": 3})
    assert planner.matched_tokens(request, 16) == (22, True)  # 38 loaded, 2 computed
    planner.allocated(request, ([7, 8, 9],), 22)
    step = planner.plan(scheduled=["another"])
    [load] = step.loads
    assert (load.first, load.total, load.block_ids, load.loaded) == (1, 3, [8, 9], 22)
    # Tokens 38 and 39 lie in the third block: its pushed bytes go back in
    # after the step that computes them, the request's first.
    assert load.groups[0].kept == [9] and step.restores == []
    assert planner.plan(scheduled=["r"]).restores == ["r"]
    assert planner.plan(scheduled=["r"]).restores == []
    across = FakeRequest("x", list(range(33)), {
        "do_remote_prefill": True, "kvwire_transfer": "v", "kvwire_tokens": 33,
        "kvwire_deadline": 3})
    assert planner.matched_tokens(across, 0) == (31, True)
    planner.allocated(across, ([4, 5, 6],), 31)
    assert planner.plan().loads[0].groups[0].kept == [5, 6]  # tokens 31 and 32
    planner.finished("x")
    assert planner.plan(scheduled=["x"]).restores == []  # ended before it ran
    short = FakeRequest("s", [1, 2], {"do_remote_prefill": True, "kvwire_transfer": "u",
                                      "kvwire_tokens": 2, "kvwire_deadline": 3})
    assert planner.matched_tokens(short, 0) == (0, False)  # nothing left to load


@given(prompt=st.integers(1, 2000), block=st.sampled_from([16, 32, 128]),
       chunk=st.integers(1, 700), local_blocks=st.integers(0, 20))
def test_pushed_and_loaded_blocks_cover_the_prompt_exactly(prompt: int, block: int,
                                                           chunk: int,
                                                           local_blocks: int) -> None:
    """Whatever the chunking and the decode side's own prefix hit, the decode
    engine loads exactly the pushed blocks it does not have, into the blocks
    that hold those tokens, and the prefill side pushed every block of the
    prompt (the last one perhaps partial) in order."""
    producer = ProducerPlanner(ConnectorSettings(), block_size=block)
    producer.on_new_request(FakeRequest("r", list(range(prompt)), push_params()))
    blocks_needed = -(-prompt // block)
    ids = [1000 + 7 * n for n in range(blocks_needed)]
    computed, given_ids, pushes = 0, 0, []
    while computed < prompt:
        step = min(chunk, prompt - computed)
        upto = -(-(computed + step) // block)
        new_ids, given_ids = ids[given_ids:upto], upto
        plan = (producer.plan([("r", (new_ids,), 0)], [], {"r": step}) if computed == 0 else
                producer.plan([], [("r", (new_ids,), False, computed)], {"r": step}))
        pushes += plan.pushes
        computed += step
    answer = producer.finished("r")
    assert answer is not None
    pushed = blocks_of(prompt, block)
    assert answer["kvwire_tokens"] == prompt
    assert [p.blocks for p in pushes] == [(ids,)]

    consumer = ConsumerPlanner(block_size=block)
    request = FakeRequest("d", list(range(prompt)), answer)
    # A local prefix hit is whole blocks, and never the prompt's last token.
    local = min(local_blocks, (prompt - 1) // block) * block
    tokens, load_async = consumer.matched_tokens(request, local)
    assert load_async and local + tokens == prompt
    decode_ids = [5000 + n for n in range(blocks_needed)]
    consumer.allocated(request, (decode_ids,), tokens)
    [load] = consumer.plan().loads
    assert load.total == pushed
    assert load.block_ids == decode_ids[local // block : pushed]
    assert load.first == local // block


def _skipped_blocks(computed: int, window: int, block: int) -> int:
    """vLLM's SlidingWindowManager: whole blocks before the window of the next
    token, which it frees and replaces with its null block."""
    return max(0, computed - window + 1) // block


@given(prompt=st.integers(1, 1500), block=st.sampled_from([16, 32, 128]),
       window=st.integers(1, 600), chunk=st.integers(1, 700))
def test_a_sliding_group_pushes_only_live_blocks_and_all_that_decode_reads(
        prompt: int, block: int, window: int, chunk: int) -> None:
    """With vLLM's hybrid manager on, a sliding-window group's blocks before the
    window are freed as prefill goes (and may be reused by another request):
    the push carries none of them, and every block the decode engine keeps
    for the window is loaded from the push."""
    producer = ProducerPlanner(ConnectorSettings(), block_size=block, windows=(window, None))
    producer.on_new_request(FakeRequest("r", list(range(prompt)), push_params()))
    total = -(-prompt // block)
    ids = [100 + n for n in range(total)]
    computed, given_ids, pushes, live_from = 0, 0, [], 0
    while computed < prompt:
        step = min(chunk, prompt - computed)
        live_from = _skipped_blocks(computed, window, block)  # freed before this step
        upto = -(-(computed + step) // block)
        new_ids, given_ids = ids[given_ids:upto], upto
        blocks = (new_ids, [n + 5000 for n in new_ids])
        plan = (producer.plan([("r", blocks, 0)], [], {"r": step}) if computed == 0 else
                producer.plan([], [("r", blocks, False, computed)], {"r": step}))
        pushes += plan.pushes
        computed += step
    [push] = pushes
    sliding, full = push.blocks
    assert full == [n + 5000 for n in ids]
    assert sliding == ids[-len(sliding):] and sliding[0] >= ids[live_from]
    answer = producer.finished("r")
    assert answer is not None

    consumer = ConsumerPlanner(block_size=block, windows=(window, None))
    request = FakeRequest("d", list(range(prompt)), answer)
    tokens, _ = consumer.matched_tokens(request, 0)
    skipped = _skipped_blocks(prompt, window, block)
    decode_sliding = [0] * skipped + [7000 + n for n in range(skipped, total)]
    decode_full = [9000 + n for n in range(total)]
    consumer.allocated(request, (decode_sliding, decode_full), tokens)
    [load] = consumer.plan().loads
    assert load.refusal is None
    span = load.groups[0]
    assert span.pushed_from == total - len(sliding)
    loaded = {span.load_from + n: b for n, b in enumerate(span.block_ids) if b != 0}
    assert loaded == {n: b for n, b in enumerate(decode_sliding) if b != 0}
    assert load.groups[1].block_ids == decode_full


def _planned_load(prefill: Any, decode: Any) -> Any:
    """The decode engine's plan for a 200-token prompt the prefill engine pushed."""
    producer = ProducerPlanner(ConnectorSettings(), block_size=prefill.block_size,
                               layout=prefill)
    producer.on_new_request(FakeRequest("r", list(range(200)), push_params()))
    producer.plan([("r", ([1, 2],), 0)], [], {"r": 200})
    answer = producer.finished("r")
    assert answer is not None and answer["kvwire_layout"]["block_size"] == prefill.block_size
    consumer = ConsumerPlanner(block_size=decode.block_size, layout=decode)
    request = FakeRequest("d", list(range(200)), answer)
    tokens, _ = consumer.matched_tokens(request, 0)
    consumer.allocated(request, (list(range(10, 17)),), tokens)
    [load] = consumer.plan().loads
    return load


def test_a_decode_engine_whose_layout_differs_refuses_at_plan_time_naming_both() -> None:
    from kvwire_vllm.shards import EngineLayout

    mine = EngineLayout(attention="mha", dtype="bfloat16", layers=2, kv_heads=2,
                        head_size=32, block_size=32, head_bytes=4096,
                        block_format="cpu/AVX512", groups="full:2")
    theirs = replace(mine, dtype="float32", head_bytes=8192, tp=2)
    load = _planned_load(theirs, mine)
    assert load.refusal is not None
    assert "dtype: prefill float32, decode bfloat16" in load.refusal
    assert "head_bytes: prefill 8192, decode 4096" in load.refusal
    assert "tp" not in load.refusal  # TP sizes differ freely


def test_a_block_size_the_copy_bridges_is_planned_not_refused() -> None:
    from kvwire_vllm.shards import EngineLayout

    mine = EngineLayout(attention="mha", dtype="float32", layers=2, kv_heads=2,
                        head_size=32, block_size=32, head_bytes=8192,
                        block_format="cpu/AVX512", groups="full:2")
    load = _planned_load(mine.with_block_size(128), mine)
    assert load.refusal is None and load.total == 7  # this engine's blocks
    assert load.order.layout is not None and load.order.layout.block_size == 128


# ------------------------------------------------------------------ seal


def sealed_layer(blocks: int = 3, block_bytes: int = 64, layer: int = 1,
                 transfer: str = "t-1") -> tuple[bytearray, LayerSeal]:
    data = bytearray(bytes(range(256)) * (blocks * block_bytes // 256 + 1))[
        : blocks * block_bytes] + bytearray(SEAL_BYTES)
    expected = LayerSeal(layer, 4, blocks, 16, block_bytes, transfer_hash(transfer), 99, 0)
    seal_layer(memoryview(data), expected)
    return data, expected


def test_a_sealed_layer_checks_and_gives_back_its_blocks() -> None:
    data, expected = sealed_layer()
    assert len(data) == layer_bytes(3, 64)
    assert bytes(check_layer(memoryview(data), expected)) == bytes(data[: 3 * 64])


@given(st.data())
def test_any_flipped_byte_of_a_layer_breaks_its_seal(data: st.DataObject) -> None:
    layer, expected = sealed_layer()
    position = data.draw(st.integers(0, len(layer) - 1))
    # The seal's 8 reserved bytes carry nothing: a flip there changes nothing.
    if position >= len(layer) - 8:
        return
    layer[position] ^= data.draw(st.integers(1, 255))
    with pytest.raises(SealBroken):
        check_layer(memoryview(layer), expected)


@pytest.mark.parametrize("change, word", [
    ({"transfer": transfer_hash("t-2")}, "another transfer"),
    ({"layout": 98}, "layout differs"),
    ({"layer": 2}, "layer 1"),
    ({"block_size": 32}, "block_size"),
])
def test_a_seal_of_another_transfer_layer_or_layout_is_refused(change: dict[str, int],
                                                                word: str) -> None:
    layer, expected = sealed_layer()
    with pytest.raises(SealBroken, match=word):
        check_layer(memoryview(layer), replace(expected, **change))


def test_a_layer_without_a_seal_says_which_connector_to_run() -> None:
    layer, expected = sealed_layer()
    layer[-SEAL_BYTES:] = bytes(SEAL_BYTES)
    with pytest.raises(SealBroken, match="kvwire's connector"):
        check_layer(memoryview(layer), expected)
    with pytest.raises(SealBroken, match="expected"):
        check_layer(memoryview(layer)[:-1], expected)


def test_a_broken_seal_is_a_kvwire_error_with_its_own_code() -> None:
    assert issubclass(SealBroken, KvwireError) and SealBroken.code == "seal_broken"


# ------------------------------------------------------------------ stats


def test_counters_add_up_across_workers_and_takes() -> None:
    counters = stats.ConnectorCounters()
    counters.pushed(100, 0.5)
    counters.failed("load", "seal")
    taken = counters.take()
    counters.loaded(128, 4096, 0.01)
    merged = stats.merge(taken, counters.snapshot())
    assert (merged["pushes"], merged["loads"], merged["load_failures"]) == (1, 1, 1)
    assert merged["failures"] == {"load:seal": 1}
    summary = stats.summary(merged)
    assert summary["loaded_tokens"] == 128 and summary["push_seconds_p50"] == 0.5
