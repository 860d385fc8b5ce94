"""kvwire against vLLM's own connectors, in one run: TTFT and what moving KV adds.

Two network namespaces joined by a veth (kvwire's daemons between them over
TCP with mutual TLS, as in ``make demo-vllm``), the ``bench`` model made
locally (8 layers, 8 KV heads x 64, float32: 32 KiB of KV per token). For
each way of serving, one after the other, a prefill ``vllm serve`` in one
namespace and a decode one in the other, ``kvctl proxy`` in front (it
passes any connector's ``kv_transfer_params``):

- beside each, one engine with no connector (the reference), asked each
  prompt just before: the added TTFT is the median of the paired
  differences, which a drift of the machine cannot fake; it is asked once
  more, a prompt of the same length (not the same: it would come from the
  engine's prefix cache), through a plain HTTP pass-through
  (benchmarks/passthrough.py) on the proxy's host, so that what any proxy's
  hop costs is measured too;
- ``kvwire``: kvwire's connector and daemons (``kvwire-sequential``: the
  same through the proxy's sequential flow, decode asked after prefill;
  ``kvwire-spin``: its decode engine stepped without pause while it waits,
  ``idle_wait`` 0, as before kvwire waited in idle steps);
- ``nixl``: vLLM's NixlConnector over UCX on TCP, as shipped;
- ``nixl-tuned``: the same with NIXL's progress thread polling every
  100 µs instead of spinning (benchmarks/vllm_peers.py);
- ``mooncake``: vLLM's MooncakeConnector over TCP (with the device index
  answered on a CPU-only machine).

Per prompt length (about 256, 1,000 and 4,000 tokens), ``--repeat`` prompts
each: the TTFT a client sees; the added TTFT (paired, as above); the
decode side's part (after prefill answered: the pull connectors' whole
transfer, kvwire's wait for what is left of its push); kvwire's transfer and
the part of it after the last layer; and each engine's CPU use while idle.

Engine shapes (``--shapes``): ``tp1`` (one worker each side, the default),
``tp2-tp2`` and ``tp2-tp1`` (tensor parallel, the prefill engine at TP 2),
and ``mla`` (a DeepSeek-V2-shaped model made locally, 16-token blocks).
Per request it also counts the bytes that crossed the veth between the
two hosts (both directions, everything: KV, control, HTTP), and a connector
that refuses a shape is reported with its error.

    python -m benchmarks.vllm_connectors [--connectors kvwire,nixl] [--repeat 5] \
        [--shapes tp1,tp2-tp2,tp2-tp1,mla]

It needs root (namespaces), ``make vllm-env``, and for the peers
``.venv-vllm/bin/pip install nixl nixl-cu12 mooncake-transfer-engine-non-cuda``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvctl import table, timeline
from kvctl.netns import DaemonProcess, NetnsPair, two_hosts
from kvctl.vllm.demo import prompts_of, send, transfers
from kvctl.vllm.engines import (
    EngineError,
    ServeProcess,
    kv_transfer_config,
    start_proxy,
    start_until_it_says,
)
from kvwire_vllm.model import make_model
from kvwired import tracing
from kvwired.analysis import percentile
from kvwired.errors import KvwireError

REPO = Path(__file__).resolve().parents[1]
CONNECTORS = ["kvwire", "nixl-tuned", "nixl", "mooncake"]
# kvwire run otherwise, beside itself in the same run: name -> (connector,
# the proxy's flow, more decode connector settings).
VARIANTS: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "kvwire-sequential": ("kvwire", "sequential", {}),
    "kvwire-spin": ("kvwire", None, {"idle_wait": 0}),  # vLLM's idle steps not slowed
}


@dataclass(frozen=True)
class Shape:
    """Both engines' parallel sizes and the model they run."""

    model: str  # a kvwire_vllm.model shape
    prefill_tp: int = 1
    decode_tp: int = 1
    block_size: int = 128

    def args(self, side: str) -> list[str]:
        tp = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(side, 1)
        return ["--tensor-parallel-size", str(tp), "--block-size", str(self.block_size)]


SHAPES = {"tp1": Shape("bench"), "tp2-tp2": Shape("bench", 2, 2),
          "tp2-tp1": Shape("bench", 2, 1), "mla": Shape("mla", block_size=16)}
LENGTHS = [256, 1000, 4000]
DEADLINE = 30.0
IDLE_SECONDS = 5.0
KV_CACHE = 1 << 30
BATCH = 2048


def server_settings(name: str, pair: NetnsPair, receiver: DaemonProcess,
                    sender: DaemonProcess, decode_extra: dict[str, Any] | None = None
                    ) -> list[tuple[str, dict[str, Any] | None, dict[str, str]]]:
    """Per server to start: its host, its --kv-transfer-config, its environment.
    ``decode_extra``: more of kvwire's decode connector settings."""
    hosts = {"prefill": pair.prefill.address, "decode": pair.decode.address}
    if name == "kvwire":
        return [("prefill", kv_transfer_config("prefill", {"sender_socket": sender.socket,
                                                           "deadline": DEADLINE}), {}),
                ("decode", kv_transfer_config("decode", {"receiver_socket": receiver.socket,
                                                         **(decode_extra or {})}), {})]
    peers = {"PYTHONPATH": str(REPO)}
    if name in ("nixl", "nixl-tuned"):
        connector = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                     "kv_buffer_device": "cpu"}
        if name == "nixl-tuned":
            connector |= {"kv_connector": "TunedNixlConnector",
                          "kv_connector_module_path": "benchmarks.vllm_peers"}
        return [(side, connector, {**peers, "UCX_TLS": "tcp",
                                   "VLLM_NIXL_SIDE_CHANNEL_HOST": hosts[side],
                                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(5600 + n),
                                   "VLLM_HOST_IP": hosts[side]})
                for n, side in enumerate(("prefill", "decode"))]
    if name == "mooncake":
        return [(side, {"kv_connector": "CpuMooncakeConnector",
                        "kv_connector_module_path": "benchmarks.vllm_peers",
                        "kv_role": "kv_producer" if side == "prefill" else "kv_consumer",
                        "engine_id": f"mooncake-{side}",
                        "kv_connector_extra_config": {"mooncake_protocol": "tcp"}},
                 {**peers, "VLLM_HOST_IP": hosts[side], "VLLM_MOONCAKE_BOOTSTRAP_PORT": "8998"})
                for side in ("prefill", "decode")]
    raise SystemExit(f"unknown connector {name!r}; choose from {', '.join(CONNECTORS)}")


def wire_bytes(pair: NetnsPair) -> int:
    """Bytes the decode host's end of the veth sent and received so far."""
    counts = []
    for direction in ("rx_bytes", "tx_bytes"):
        done = subprocess.run(pair.argv(pair.decode, [
            "cat", f"/sys/class/net/{pair.decode.ifname}/statistics/{direction}"]),
            capture_output=True, text=True, check=True)
        counts.append(int(done.stdout))
    return sum(counts)


def run_one(name: str, pair: NetnsPair, receiver: DaemonProcess, sender: DaemonProcess,
            model: Path, work: Path, prompts: dict[int, list[list[int]]],
            shape: Shape = SHAPES["tp1"], flow: str | None = None,
            variant: str | None = None) -> dict[str, Any]:
    """``flow``: the proxy's, for kvwire (parallel by default); the pull
    connectors always go sequential. ``variant``: one of VARIANTS' names."""
    ports = {"prefill": 8100, "decode": 8200, "colocated": 8300}
    # The proxy and both engines trace each request (kvwired.tracing): where
    # its time went, step by step (the peers' engines record nothing).
    traces = Path(tempfile.mkdtemp(prefix=f"traces-{name}-", dir=work))
    traced = {tracing.ENV: str(traces)}
    with ExitStack() as stack:
        servers: dict[str, ServeProcess] = {}
        # Each way of serving is measured against a plain engine running beside
        # it, prompt by prompt: a drift of the machine hits both alike.
        settings = [*server_settings(name, pair, receiver, sender,
                                     VARIANTS[variant][2] if variant else None),
                    ("colocated", None, {})]
        for side, kv, env in settings:
            env = {**env, **traced} if kv is not None else env
            host = pair.prefill if side == "prefill" else pair.decode  # colocated: decode
            server = ServeProcess(model, host.address, ports[side],
                                  work / f"{name}-{side}.log", prefix=pair.argv(host, []),
                                  kv_cache_bytes=KV_CACHE, max_batched_tokens=BATCH,
                                  kv_transfer=kv, env=env, extra_args=shape.args(side))
            stack.callback(server.stop)
            servers[side] = server.start()
        for server in servers.values():
            server.wait_ready(timeout=600)
        plain = servers.pop("colocated")
        passthrough = start_passthrough(stack, pair, plain.url, work / f"{name}-pass.log")
        if name == "mooncake":
            def ask(batch: list[list[int]]) -> list[dict[str, Any]]:
                return _route(pair, servers)(batch)
        else:
            url = servers["decode"].url
            if "prefill" in servers:
                # kvctl proxy: parallel for kvwire, sequential for NIXL (it
                # pulls with the params the prefill answer carries).
                url = start_proxy(stack, pair.argv(pair.prefill, []), servers["prefill"].url,
                                  f"decode={servers['decode'].url}",
                                  f"{pair.prefill.address}:8000", DEADLINE,
                                  work / f"{name}-proxy.log",
                                  (flow or "parallel") if name == "kvwire"
                                  else "sequential", env=traced)

            def ask(batch: list[list[int]]) -> list[dict[str, Any]]:
                return send(pair, url, batch)
        ask(prompts_of([64, 1000], seed=11))  # warm-up
        send(pair, plain.url, prompts_of([64, 1000], seed=11))
        send(pair, passthrough, prompts_of([64], seed=12))
        idle = _idle_cores(servers)
        rows: dict[int, list[dict[str, Any]]] = {}
        for length, batch in prompts.items():
            rows[length] = []
            # The pass-through is asked a prompt of its own, of the same
            # length: the plain engine caches prefixes, and the one it was
            # just asked would come back from that cache.
            siblings = prompts_of([length] * len(batch), seed=900 + length)
            for prompt, sibling in zip(batch, siblings, strict=True):
                [alone] = send(pair, plain.url, [prompt])
                [relayed] = send(pair, passthrough, [sibling])
                before = wire_bytes(pair)
                decode_cpu = servers["decode"].cpu_seconds()
                [answer] = ask([prompt])
                decode_cpu = servers["decode"].cpu_seconds() - decode_cpu
                crossed = wire_bytes(pair) - before
                push = transfers(sender).get(answer["transfer"] or "", {}) \
                    if name == "kvwire" else {}
                rows[length].append({
                    "ttft": answer["ttft"], "prefill_ms": answer["prefill_ms"],
                    "tokens": answer["tokens"], "ttft_colocated": alone["ttft"],
                    "ttft_passthrough": relayed["ttft"],
                    "same": answer["tokens"] == alone["tokens"],
                    "transfer_seconds": push.get("transfer_seconds"),
                    "drain_seconds": push.get("drain_seconds"),
                    "kv_bytes": push.get("bytes"), "wire_bytes": crossed,
                    "transfer": answer["transfer"],
                    # The decode engine's cores while the request was in it.
                    "decode_cores": decode_cpu / answer["seconds"]})
        found = timeline.collect(traces, [r["transfer"] for runs in rows.values()
                                          for r in runs if r["transfer"]])
        for runs in rows.values():
            for r in runs:
                line = found.get(r["transfer"] or "")
                r["timeline"] = line.steps if line is not None else None
        label = variant or (f"{name} ({flow})" if name == "kvwire" and flow else name)
        return {"connector": label, "idle_cores": idle, "lengths": rows}


def timeline_table(result: dict[str, Any]) -> str:
    """Where one way of serving's requests spent their time, per prompt length,
    and beside it the plain engine's time to first token."""
    groups = {f"{length} tokens": [timeline.Timeline(r["transfer"], r["timeline"], [])
                                   for r in runs if r.get("timeline")]
              for length, runs in result["lengths"].items()}
    alone = " / ".join(f"{p50([r['ttft_colocated'] for r in runs]) * 1e3:.1f}"
                       for runs in result["lengths"].values())
    hop = " / ".join(f"{p50(hops):+.1f}" if hops else "-"
                     for hops in (_passthrough_hops(runs)
                                  for runs in result["lengths"].values()))
    return (f"{result.get('shape', 'tp1')}/{result['connector']}: where a request's time went\n"
            + timeline.render(groups)
            + f"\none engine's time to first token (p50 ms, at the client): {alone}"
            + f"\nthe same through a plain pass-through proxy (p50 ms added): {hop}")


def _passthrough_hops(runs: list[dict[str, Any]]) -> list[float]:
    """Per prompt: what a plain proxy's hop added to the plain engine's TTFT (ms)."""
    return [(r["ttft_passthrough"] - r["ttft_colocated"]) * 1e3 for r in runs
            if r.get("ttft_passthrough") is not None]


def start_passthrough(stack: ExitStack, pair: NetnsPair, upstream: str, log: Path) -> str:
    """benchmarks.passthrough in front of ``upstream``, on the proxy's host; its URL."""
    listen = f"{pair.prefill.address}:8001"
    start_until_it_says(
        stack, pair.argv(pair.prefill, [sys.executable, "-m", "benchmarks.passthrough",
                                        upstream, "--listen", listen]),
        log, "pass-through on", "the pass-through", cwd=REPO)
    return f"http://{listen}"


def _route(pair: NetnsPair, servers: dict[str, ServeProcess]
           ) -> Callable[[list[list[int]]], list[dict[str, Any]]]:
    """Mooncake's router flow (benchmarks/vllm_router.py), from the prefill host."""
    def ask(batch: list[list[int]]) -> list[dict[str, Any]]:
        done = subprocess.run(pair.argv(pair.prefill, [
            sys.executable, "-m", "benchmarks.vllm_router", servers["prefill"].url,
            servers["decode"].url, "--engine", "mooncake-prefill",
            "--bootstrap", f"http://{pair.prefill.address}:8998"]), input=json.dumps(batch),
            capture_output=True, text=True, timeout=600, cwd=REPO)
        if done.returncode != 0:
            raise EngineError(f"mooncake's router flow failed: {done.stderr[-1500:]}")
        answers = list(json.loads(done.stdout.strip().splitlines()[-1]))
        for answer in answers:
            if answer["status"] != 200 or not answer["tokens"]:
                raise EngineError(f"mooncake answered {answer['status']} with "
                                  f"{len(answer['tokens'])} tokens: {answer['error']}\n"
                                  f"decode: {servers['decode'].log_tail(15)}")
        answered: list[dict[str, Any]] = answers
        return answered
    return ask


def _idle_cores(servers: dict[str, ServeProcess]) -> dict[str, float]:
    before = {side: server.cpu_seconds() for side, server in servers.items()}
    time.sleep(IDLE_SECONDS)
    return {side: round((server.cpu_seconds() - before[side]) / IDLE_SECONDS, 3)
            for side, server in servers.items()}


def p50(values: list[float]) -> float:
    return percentile(values, 50)


def report(results: list[dict[str, Any]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for result in results:
        for length, runs in result["lengths"].items():
            ttft = p50([r["ttft"] for r in runs]) * 1e3
            alone = p50([r["ttft_colocated"] for r in runs]) * 1e3
            added = p50([(r["ttft"] - r["ttft_colocated"]) * 1e3 for r in runs])
            decode_part = [r["ttft"] * 1e3 - r["prefill_ms"] for r in runs
                           if r["prefill_ms"] is not None]
            transfer = [r["transfer_seconds"] * 1e3 for r in runs
                        if r["transfer_seconds"] is not None]
            drain = [r["drain_seconds"] * 1e3 for r in runs if r["drain_seconds"] is not None]
            wire = p50([r["wire_bytes"] for r in runs if r.get("wire_bytes") is not None]
                       or [0])
            rows.append([
                result.get("shape", "tp1"), result["connector"], length, f"{alone:.0f}",
                f"{ttft:.0f}", f"{added:+.0f}",
                f"{p50(hops):+.0f}" if (hops := _passthrough_hops(runs)) else "-",
                f"{p50(decode_part):.0f}" if decode_part else "-",
                f"{p50(transfer):.0f}" if transfer else "-",
                f"{p50(drain):.1f}" if drain else "-",
                f"{(1 - sum(drain) / sum(transfer)) * 100:.0f} %" if transfer else "-",
                f"{wire / 2**20:.1f}",
                " / ".join(f"{v:.2f}" for v in result["idle_cores"].values()),
                f"{p50([r['decode_cores'] for r in runs if 'decode_cores' in r] or [0]):.2f}",
                "yes" if all(r["same"] for r in runs) else "NO"])
    return rows


HEADERS = ["shape", "connector", "tokens", "TTFT one engine ms", "TTFT ms",
           "added ms (paired p50)", "a plain proxy adds ms", "decode side ms", "transfer ms",
           "after last layer ms",
           "hidden", "wire MiB", "idle cores (prefill / decode)",
           "decode engine cores while asked", "same tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connectors", default=",".join(CONNECTORS))
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shapes", default="tp1",
                        help=f"engine shapes, of {', '.join(SHAPES)}")
    parser.add_argument("--flow", choices=["parallel", "sequential"], default=None,
                        help="the proxy's flow for kvwire (default: parallel)")
    parser.add_argument("--out", type=Path, default=Path("results/bench-vllm.json"))
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = {n: prompts_of([n] * args.repeat, seed=100 + n) for n in lengths}
    results: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    started = time.monotonic()
    shapes = args.shapes.split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        raise SystemExit(f"unknown shape(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(SHAPES)}")
    with tempfile.TemporaryDirectory(prefix="kvwire-bench-vllm-") as tmp:
        work = Path(tmp)
        with two_hosts(work, receiver={"pool_size": "512MiB"},
                       sender={"staging_size": "512MiB"}) as (pair, receiver, sender):
            for shape_name in shapes:
                shape = SHAPES[shape_name]
                model = make_model(work / shape.model, shape.model)
                for name in args.connectors.split(","):
                    key = f"{shape_name}/{name}"
                    print(f"{key}: starting its servers", flush=True)
                    connector, flow, _ = VARIANTS.get(name, (name, args.flow, {}))
                    try:
                        result = run_one(connector, pair, receiver, sender, model, work,
                                         prompts, shape, flow,
                                         name if name in VARIANTS else None)
                    except (KvwireError, OSError) as exc:
                        failures[key] = str(exc)[-1500:]
                        print(f"{key}: did not run: {failures[key]}", flush=True)
                    else:
                        results.append({**result, "shape": shape_name})
                        print(table.render(HEADERS, report(results)[-len(lengths):]),
                              flush=True)
    print("\n" + table.render(HEADERS, report(results)))
    for result in results:
        print("\n" + timeline_table(result))
    for name, why in failures.items():
        print(f"\n{name} did not run:\n{why}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"experiment": "bench-vllm", "results": results,
                                    "failures": failures,
                                    "seconds": round(time.monotonic() - started)},
                                   indent=2) + "\n")
    print(f"\nfigures: {args.out} ({(time.monotonic() - started) / 60:.1f} min)")


if __name__ == "__main__":
    main()
