"""MLA and hybrid engines through kvwire, and a layout two engines cannot share.

- MLA (a DeepSeek-V2-shaped model made here): the latent cache is the same on
  every rank, so it crosses the wire once, whatever the TP sizes; every
  decode rank reads that one push.
- Hybrid (a Gemma-3-shaped model: a sliding-window layer and a full one):
  vLLM's hybrid KV-cache manager stays on, and the sliding group moves only
  the blocks inside the window; a second prompt that extends the first hits
  the decode engine's prefix cache.
- Block sizes that divide each other: the decode engine's copy regroups the
  prefill engine's blocks into its own.
- Engines whose layouts differ otherwise (dtype): the decode engine refuses
  the load when it plans it, naming both values; the answer is recomputed,
  or the request fails, as kv_load_failure_policy says.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvctl.netns import check_can_run
from kvctl.vllm import engines
from kvctl.vllm.engines import OfflineProcess
from kvwire_vllm.model import make_model
from kvwire_vllm.params import new_transfer_id
from kvwire_vllm.shards import push_name, transfer_of
from kvwired.client import SyncReceiverClient

from ..waiting import wait_until
from .conftest import MAX_TOKENS, Hosts, make_prompts, plain_engine_tokens

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.vllm,
              pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]

DEADLINE = 60.0  # TP 2 engines share 2 cores here
SEAL = 64
# vLLM's CPU MLA kernel takes 16-token blocks only; the latent cache is
# 512 + 64 floats per token. One request a step: with others in its batch,
# vLLM 0.32's CPU MLA gives a request other tokens (one engine too: a 193-token
# prompt alone and beside a 305-token one continue differently), and a
# connector that loads asynchronously batches requests otherwise than one
# that loads at once.
MLA_ENGINE = {"block_size": 16, "max_num_seqs": 1}
MLA_ROW = 576  # floats per token
MLA_BLOCK_BYTES = 16 * MLA_ROW * 4


def run(hosts: Hosts, model: Path, role: str, prompts: list[list[int]],
        params: list[dict[str, Any]], engine: dict[str, Any],
        policy: str = "recompute") -> dict[str, Any]:
    connector = ({**hosts.connector("prefill"), "deadline": DEADLINE} if role == "prefill"
                 else hosts.connector("decode"))
    return engines.offline({"model": str(model), "role": role, "prompts": prompts,
                            "params": params, "engine": engine, "max_tokens": MAX_TOKENS,
                            "connector": connector, "failure_policy": policy})


def orders(count: int) -> tuple[list[str], list[dict[str, Any]]]:
    transfers = [new_transfer_id() for _ in range(count)]
    return transfers, [{"do_remote_decode": True, "kvwire_transfer": t} for t in transfers]


def delivered_pushes(hosts: Hosts, transfers: list[str]) -> dict[str, int]:
    """Bytes the sender delivered per push name, of these transfers (its log)."""
    wanted = set(transfers)
    found = {}
    for line in hosts.sender.log_path.read_text(errors="replace").splitlines():
        if '"push delivered"' in line:
            entry = json.loads(line)
            if transfer_of(entry["req"]) in wanted:
                found[entry["req"]] = entry["bytes"]
    return found


# ---------------------------------------------------------------------- MLA


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "mla", "mla")


def saved_by_vllms_example_connector(model: Path, prompt: list[int], folder: Path
                                     ) -> dict[str, np.ndarray]:
    """Per layer, the latent cache of ``prompt``'s tokens (all but the last) as
    vLLM's own ExampleConnector saves it from the prefill engine."""
    engines.offline({"model": str(model), "role": "prefill", "prompts": [prompt],
                     "max_tokens": 1, "engine": MLA_ENGINE, "kv_transfer_config": {
                         "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
                         "kv_connector_extra_config": {"shared_storage_path": str(folder)}}})
    return {path.stem: load_file(str(path))["kv_cache"].reshape(-1, MLA_ROW)
            for path in folder.rglob("*.safetensors")}


def test_an_mla_cache_crosses_the_wire_once_and_any_tp_loads_it(
        hosts: Hosts, mla_model: Path, tmp_path: Path) -> None:
    """TP 1 -> TP 1, TP 2 -> TP 1 and TP 1 -> TP 2: one push per request (rank 0's;
    rank 1 of a TP 2 prefill engine pushes nothing), one copy of the latent
    cache on the wire, byte for byte what vLLM's own ExampleConnector takes
    from the prefill engine, every decode rank loading that one push with
    every layer's seal intact; TP 1 -> TP 1 gives one engine's tokens.

    The decode engine computes the prompt's last two tokens itself and then
    writes the pushed bytes of their blocks back (scheduling.tail_to_recompute):
    vLLM 0.32's CPU MLA computes a lone token over a cached context with its
    decode kernel, which disagrees with its prefill path (the first token
    differed at every length), and its prefill over a cached context writes
    latents that differ by rounding from one whole prefill's (later tokens
    parted at 2 of 3 lengths).

    Across TP sizes only the first token is compared: vLLM's CPU MLA itself
    gives other tokens at TP 2 than at TP 1 (two plain engines part at the
    first token for 2 of these 3 prompts), so no one engine's tokens exist
    for a TP 2 -> TP 1 pair. Each decode engine's first token is the prefill
    engine's, which is a plain engine's at the prefill engine's TP size."""
    prompts = make_prompts([193, 305, 609], seed=31)
    reference = plain_engine_tokens(mla_model, prompts, MLA_ENGINE)
    reference_tp2 = plain_engine_tokens(mla_model, prompts,
                                        {**MLA_ENGINE, "tensor_parallel_size": 2})
    at_tp1, params_tp1 = orders(2 * len(prompts))
    at_tp2, params_tp2 = orders(len(prompts))
    one = run(hosts, mla_model, "prefill", prompts + prompts, params_tp1, MLA_ENGINE)
    two = run(hosts, mla_model, "prefill", prompts, params_tp2,
              {**MLA_ENGINE, "tensor_parallel_size": 2})

    def latent_bytes(prompt: list[int]) -> int:  # two layers, one latent "head"
        return 2 * (-(-len(prompt) // 16) * MLA_BLOCK_BYTES + SEAL)

    assert one["counters"]["pushes"] == 2 * len(prompts)
    assert one["counters"]["pushed_bytes"] == 2 * sum(map(latent_bytes, prompts))
    ranks = two["counters"]["ranks"]
    assert (ranks["prefill-rank0"]["pushes"], ranks["prefill-rank1"]["pushes"]) == (3, 0)
    assert two["counters"]["pushed_bytes"] == sum(map(latent_bytes, prompts))
    assert list(delivered_pushes(hosts, at_tp2).values()) == \
        [latent_bytes(p) for p in prompts]
    layout = two["outputs"][0]["kv_transfer_params"]["kvwire_layout"]
    assert (layout["attention"], layout["kv_heads"], layout["head_size"]) == ("mla", 1, 576)

    # The bytes of the TP 1 engine's push of the 305-token prompt, in the
    # receive pool, against vLLM's own connector's copy from an engine of the
    # same shape.
    saved = saved_by_vllms_example_connector(mla_model, prompts[1], tmp_path / "example")
    rows = -(-len(prompts[1]) // 16) * 16
    with SyncReceiverClient(hosts.receiver.socket) as reader:
        name = push_name(at_tp1[len(prompts) + 1], 0)
        view = reader.view(reader.wait_delivered(name, timeout=10))
        pushed = np.frombuffer(bytes(view), dtype=np.float32).copy()
        reader.unsubscribe(name)  # left for the decode engine below
    per_layer = rows * MLA_ROW + SEAL // 4
    for n in range(2):
        theirs = saved[f"model.layers.{n}.self_attn.attn"]
        mine = pushed[n * per_layer : n * per_layer + rows * MLA_ROW].reshape(rows, MLA_ROW)
        assert np.array_equal(mine[: len(theirs)], theirs), f"layer {n}"

    answers_tp1 = [o["kv_transfer_params"] for o in one["outputs"]]
    answers_tp2 = [o["kv_transfer_params"] for o in two["outputs"]]
    # TP 1 and TP 2 prefill into one TP 1 decode engine.
    decoded = run(hosts, mla_model, "decode", prompts + prompts,
                  answers_tp1[: len(prompts)] + answers_tp2, MLA_ENGINE)
    assert decoded["counters"]["loads"] == 2 * len(prompts)
    assert decoded["counters"]["load_failures"] == 0, decoded["counters"]["failures"]
    assert decoded["counters"]["loaded_tokens"] == 2 * sum(len(p) - 2 for p in prompts)
    prefill_first = [o["tokens"][0] for o in one["outputs"][: len(prompts)] + two["outputs"]]
    assert prefill_first == [t[0] for t in reference + reference_tp2]
    tokens = [o["tokens"] for o in decoded["outputs"]]
    assert tokens[: len(prompts)] == reference
    assert [t[0] for t in tokens[len(prompts):]] == [t[0] for t in reference_tp2]
    # TP 1 prefill into a TP 2 decode engine: both ranks read the one push.
    both = run(hosts, mla_model, "decode", prompts, answers_tp1[len(prompts):],
               {**MLA_ENGINE, "tensor_parallel_size": 2})
    for name, counters in both["counters"]["ranks"].items():
        assert (counters["loads"], counters["load_failures"]) == (3, 0), name
    assert [o["tokens"][0] for o in both["outputs"]] == [t[0] for t in reference]
    wait_until(lambda: hosts.pool_used() == 0, 30, "the receive pool to be free")


# ------------------------------------------------------------------- hybrid


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "hybrid", "hybrid")


def test_a_hybrid_engine_moves_the_sliding_window_only_and_hits_its_prefix_cache(
        hosts: Hosts, hybrid_model: Path) -> None:
    """A 700-token prompt, window 64, 128-token blocks: the full group moves 6
    blocks, the sliding group the 2 that hold the window. A second prompt that
    extends the first finds its first 5 blocks in the decode engine's prefix
    cache (loaded by the first), and loads only the rest."""
    [first] = make_prompts([700], seed=41)
    second = first + make_prompts([200], seed=42)[0]
    reference = plain_engine_tokens(hybrid_model, [first, second])
    transfers, params = orders(2)
    pushed = run(hosts, hybrid_model, "prefill", [first, second], params, {})
    answers = [o["kv_transfer_params"] for o in pushed["outputs"]]
    assert answers[0]["kvwire_layout"]["groups"] in ("sliding64:1+full:1",
                                                     "full:1+sliding64:1")
    sliding = answers[0]["kvwire_layout"]["groups"].split("+").index("sliding64:1")
    head_bytes = 128 * 2 * 32 * 4

    def expected(blocks: int) -> int:  # one head's push: one layer, sealed
        return blocks * head_bytes + SEAL

    sent = delivered_pushes(hosts, transfers[:1])
    by_group = Counter({name.split(".")[-2]: 0 for name in sent})
    for name, size in sent.items():
        by_group[name.split(".")[-2]] += size
    assert by_group[f"g{sliding}"] == 2 * expected(2)  # 2 heads, 2 of 6 blocks
    assert by_group[f"g{1 - sliding}"] == 2 * expected(6)

    engine = OfflineProcess({
        "model": str(hybrid_model), "role": "decode", "max_tokens": MAX_TOKENS,
        "connector": hosts.connector("decode"),
        "rounds": [{"prompts": [first], "params": answers[:1]},
                   {"prompts": [second], "params": answers[1:]}]},
        hosts.workdir / "hybrid-decode")
    try:
        decoded = engine.result()
    finally:
        engine.kill()
    assert [o["tokens"] for o in decoded["outputs"]] == reference
    counters = decoded["counters"]
    assert counters["load_failures"] == 0, counters["failures"]
    assert counters["loads"] == 2
    # The second prompt's first 5 blocks (640 tokens) came from the decode
    # engine's own cache: only the rest was loaded.
    assert counters["loaded_tokens"] == len(first) + len(second) - 640
    assert decoded["outputs"][1]["num_cached_tokens"] >= 640
    wait_until(lambda: hosts.pool_used() == 0, 30, "the receive pool to be free")


# ------------------------------------------- block sizes bridged, and a mismatch


def decode_engine(hosts: Hosts, model: Path, prompts: list[list[int]],
                  answers: list[dict[str, Any]], engine: dict[str, Any], policy: str,
                  name: str) -> tuple[dict[str, Any], str]:
    """The decode engine's result and its log (vLLM logs to stdout)."""
    process = OfflineProcess({
        "model": str(model), "role": "decode", "prompts": prompts, "max_tokens": MAX_TOKENS,
        "params": answers, "connector": hosts.connector("decode"), "failure_policy": policy,
        "engine": engine}, hosts.workdir / name)
    try:
        decoded = process.result()
    finally:
        process.kill()
    return decoded, process.out.read_text(errors="replace") + process.err.read_text(
        errors="replace")


def unannounced(transfers: list[str]) -> list[dict[str, Any]]:
    """What the proxy's parallel flow asks the decode engine: no layout yet."""
    return [{"do_remote_prefill": True, "kvwire_transfer": t, "kvwire_deadline": 20}
            for t in transfers]


@pytest.mark.parametrize(("prefill_block", "decode_block", "flow"),
                         [(128, 32, "sequential"), (32, 128, "parallel")])
def test_block_sizes_that_divide_each_other_are_regrouped_by_the_copy(
        hosts: Hosts, model: Path, prefill_block: int, decode_block: int, flow: str) -> None:
    """The prefill engine's blocks regrouped into the decode engine's, inside the
    kernel's own block format: one engine's tokens, every prompt loaded over
    kvwire (announced in the answer, or read off the push's open when the
    decode engine was asked first)."""
    prompts = make_prompts([300, 700, 1300], seed=53)
    transfers, params = orders(len(prompts))
    pushed = run(hosts, model, "prefill", prompts, params, {"block_size": prefill_block})
    assert pushed["counters"]["pushes"] == 2 * len(prompts)
    answers = ([o["kv_transfer_params"] for o in pushed["outputs"]] if flow == "sequential"
               else unannounced(transfers))
    decoded, log = decode_engine(hosts, model, prompts, answers,
                                 {"block_size": decode_block}, "fail",
                                 f"bridge-{prefill_block}-{decode_block}")
    counters = decoded["counters"]
    assert counters["failures"] == {}, log[-3000:]
    assert counters["loads"] == len(prompts)
    assert counters["loaded_tokens"] == sum(len(p) for p in prompts), counters
    assert [o["tokens"] for o in decoded["outputs"]] == \
        plain_engine_tokens(model, prompts, {"block_size": decode_block})
    wait_until(lambda: hosts.pool_used() == 0, 30, "the receive pool to be free")


@pytest.mark.parametrize(("policy", "flow"), [("recompute", "sequential"),
                                              ("fail", "sequential"),
                                              ("recompute", "parallel")])
def test_a_dtype_mismatch_is_refused_naming_both_sides(
        hosts: Hosts, model: Path, policy: str, flow: str) -> None:
    """Sequential (the decode engine gets the prefill engine's answer): refused
    when the load is planned. Parallel (the proxy's default: asked at the same
    time, before any layout is announced): refused from the layout the
    prefill engine sent with each push's open, before a layer is read."""
    prompts = make_prompts([300, 700], seed=51)
    transfers, params = orders(len(prompts))
    pushed = run(hosts, model, "prefill", prompts, params, {})  # float32
    assert pushed["counters"]["pushes"] == 2 * len(prompts)
    answers = ([o["kv_transfer_params"] for o in pushed["outputs"]] if flow == "sequential"
               else unannounced(transfers))
    decoded, log = decode_engine(hosts, model, prompts, answers, {"dtype": "bfloat16"},
                                 policy, f"mismatch-{policy}-{flow}")
    assert "dtype: prefill float32, decode bfloat16" in log
    counters = decoded["counters"]
    # Refused by the plan or the push's open, never by a seal.
    assert counters["failures"] == {"load:layout_mismatch": len(prompts)}, counters
    if policy == "recompute":
        assert [o["tokens"] for o in decoded["outputs"]] == \
            plain_engine_tokens(model, prompts, {"dtype": "bfloat16"})
    else:
        assert all(o["finish_reason"] == "error" and o["tokens"] == []
                   for o in decoded["outputs"])
    # The refused pushes were released as they opened: nothing waits in the pool.
    wait_until(lambda: hosts.pool_used() == 0, 30, "the receive pool to be free")
