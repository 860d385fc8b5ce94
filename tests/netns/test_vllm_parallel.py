"""Tensor-parallel engines through kvwire: any prefill TP to any decode TP.

Each prefill rank pushes the KV heads it holds, each decode rank loads the
heads it holds from whichever pushes carry them (kvwire_vllm.shards). Greedy
tokens must equal one plain engine's (the tiny Llama gives the same tokens
at TP 1 and TP 2), and every decode rank's counters must show it loaded
the prompt, not computed it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvctl.netns import check_can_run
from kvctl.vllm import engines
from kvwire_vllm.params import new_transfer_id
from kvwired.client import SyncReceiverClient, SyncSenderClient
from kvwired.pool import align_up

from ..waiting import wait_until
from .conftest import MAX_TOKENS, POOL, Hosts, make_prompts, plain_engine_tokens

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.vllm,
              pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]

# Not block-aligned; 777 and 1300 are longer than the engines' 512-token
# batches, so their prefill is chunked; one batch: concurrent requests.
LENGTHS = [5, 300, 777, 1300]
HEADS = 2  # the tiny model's KV heads
HEAD_BYTES = 128 * 2 * 32 * 4  # one head of one block of one layer: 128 tokens of K and V
SEAL = 64
# Two TP 2 engines' processes share 2 cores here: a batch's last prompt waits
# for the others, and its deadline counts from when the engine took it.
DEADLINE = 60.0


def tp(size: int) -> dict[str, Any]:
    return {"tensor_parallel_size": size} if size > 1 else {}


def pushed_bytes(prompt: list[int], heads: int = HEADS) -> int:
    """One copy of a prompt's KV: every block, each head once, two layers, sealed."""
    return heads * 2 * (-(-len(prompt) // 128) * HEAD_BYTES + SEAL)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=21)


@pytest.fixture(scope="module")
def colocated(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return plain_engine_tokens(model, prompts)


def prefill(hosts: Hosts, model: Path, prompts: list[list[int]], size: int,
            transfers: list[str]) -> dict[str, Any]:
    return engines.offline({
        "model": str(model), "role": "prefill", "prompts": prompts, "engine": tp(size),
        "connector": {**hosts.connector("prefill"), "deadline": DEADLINE},
        "params": [{"do_remote_decode": True, "kvwire_transfer": t} for t in transfers]})


def decode(hosts: Hosts, model: Path, prompts: list[list[int]], size: int,
           params: list[dict[str, Any]]) -> dict[str, Any]:
    return engines.offline({
        "model": str(model), "role": "decode", "prompts": prompts, "engine": tp(size),
        "max_tokens": MAX_TOKENS, "connector": hosts.connector("decode"), "params": params,
        "failure_policy": "recompute"})


@pytest.fixture(scope="module")
def pushed_at_tp2(hosts: Hosts, model: Path, prompts: list[list[int]]
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One TP 2 prefill engine pushing the prompts twice (for a TP 2 and a TP 1
    decode engine): its result, and the params each copy's decode gets."""
    transfers = [new_transfer_id() for _ in range(2 * len(prompts))]
    result = prefill(hosts, model, prompts + prompts, 2, transfers)
    return result, [o["kv_transfer_params"] for o in result["outputs"]]


def decoded_like_one_engine(hosts: Hosts, model: Path, prompts: list[list[int]], size: int,
                            params: list[dict[str, Any]], reference: list[list[int]]) -> None:
    """A TP ``size`` decode engine loads the pushes and answers with one engine's
    tokens, every rank having loaded every prompt."""
    loaded = decode(hosts, model, prompts, size, params)
    assert [o["tokens"] for o in loaded["outputs"]] == reference
    assert_loaded_everywhere(loaded, prompts, size)


def assert_loaded_everywhere(result: dict[str, Any], prompts: list[list[int]],
                             size: int) -> None:
    """Every decode rank loaded every prompt, none failed."""
    ranks = result["counters"]["ranks"]
    assert sorted(ranks) == [f"decode-rank{r}" for r in range(size)]
    for name, counters in ranks.items():
        assert counters["load_failures"] == 0, (name, counters["failures"])
        assert counters["loads"] == len(prompts), name
        assert counters["loaded_tokens"] == sum(map(len, prompts)), name


def test_a_tp2_prefill_engine_pushes_each_head_once_from_the_rank_that_holds_it(
        pushed_at_tp2: tuple[dict[str, Any], list[dict[str, Any]]],
        prompts: list[list[int]]) -> None:
    result, params = pushed_at_tp2
    ranks = result["counters"]["ranks"]
    assert sorted(ranks) == ["prefill-rank0", "prefill-rank1"]
    for counters in ranks.values():
        assert counters["push_failures"] == 0, counters["failures"]
        assert counters["pushes"] == 2 * len(prompts)  # its one head, of each copy
    assert result["counters"]["pushed_bytes"] == 2 * sum(map(pushed_bytes, prompts))
    layout = params[0]["kvwire_layout"]
    assert (layout["tp"], layout["kv_heads"], layout["block_size"]) == (2, HEADS, 128)


def test_tp2_prefill_to_tp2_decode_gives_one_engines_tokens(
        hosts: Hosts, model: Path, prompts: list[list[int]], colocated: list[list[int]],
        pushed_at_tp2: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    _, params = pushed_at_tp2
    decoded_like_one_engine(hosts, model, prompts, 2, params[: len(prompts)], colocated)


def test_tp2_prefill_to_tp1_decode_gathers_both_shards(
        hosts: Hosts, model: Path, prompts: list[list[int]], colocated: list[list[int]],
        pushed_at_tp2: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    _, params = pushed_at_tp2
    decoded_like_one_engine(hosts, model, prompts, 1, params[len(prompts):], colocated)
    wait_until(lambda: hosts.pool_used() == 0, 30, "the receive pool to be free")


def test_tp1_prefill_to_tp2_decode_each_rank_takes_its_slice_of_one_shard(
        hosts: Hosts, model: Path, prompts: list[list[int]],
        colocated: list[list[int]]) -> None:
    transfers = [new_transfer_id() for _ in prompts]
    pushed = prefill(hosts, model, prompts, 1, transfers)
    assert pushed["counters"]["pushes"] == HEADS * len(prompts)
    # The same bytes on the wire as from TP 2: each head once.
    assert pushed["counters"]["pushed_bytes"] == sum(map(pushed_bytes, prompts))
    decoded_like_one_engine(hosts, model, prompts, 2,
                            [o["kv_transfer_params"] for o in pushed["outputs"]], colocated)
    wait_until(lambda: hosts.pool_used() == 0, 30, "the receive pool to be free")


def test_one_shards_lease_refused_under_tp2_recomputes_and_leaks_no_slot(
        hosts: Hosts, model: Path, prompts: list[list[int]],
        colocated: list[list[int]]) -> None:
    """The receive pool has room for one head's push of the prompt, not two: one
    prefill rank's lease is refused (pool_full), the other's delivered. The
    decode rank whose head never came fails its load, so vLLM recomputes the
    prompt on both ranks (never decoding on one shard); both slots come back."""
    prompt = prompts[-1]
    one_push = align_up(pushed_bytes(prompt) // HEADS)
    filler = align_up(POOL - one_push - one_push // 2)
    with SyncSenderClient(hosts.sender.socket) as holder:
        holder.push_bytes("leaves-room-for-one-head", None, bytes(filler))
    try:
        pushed = prefill(hosts, model, [prompt], 2, [new_transfer_id()])
        counters = pushed["counters"]
        assert (counters["pushes"], counters["push_failures"]) == (1, 1), counters
        assert counters["failures"] == {"push:pool_full": 1}
        loaded = decode(hosts, model, [prompt], 2,
                        [o["kv_transfer_params"] for o in pushed["outputs"]])
        assert [o["tokens"] for o in loaded["outputs"]] == colocated[-1:]
        by_rank = loaded["counters"]["ranks"].values()
        assert sorted((c["loads"], c["load_failures"]) for c in by_rank) == [(0, 1), (1, 0)]
        assert loaded["counters"]["failures"] == {"load:pool_full": 1}
    finally:
        with SyncReceiverClient(hosts.receiver.socket) as decode_engine:
            decode_engine.wait_delivered("leaves-room-for-one-head", timeout=10)
            decode_engine.release("leaves-room-for-one-head")
    wait_until(lambda: hosts.pool_used() == 0, 30, "the receive pool to be free")
