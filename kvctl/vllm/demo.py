"""``kvctl demo vllm``: vLLM disaggregated through kvwire, against one engine.

Two network namespaces joined by a veth (the two hosts of ``demo netns``),
a receiver daemon in one and a sender daemon in the other (TCP, mutual TLS).
In the prefill host a ``vllm serve`` with kvwire's connector as
``kv_producer``; in the decode host one as ``kv_consumer``, and beside it a
plain ``vllm serve`` (one engine, prefill and decode: the reference). The
proxy (``kvctl proxy``) takes the OpenAI requests. The model is made locally
(kvwire_vllm.model, ``bench``: 8 layers, 8 KV heads x 64; no hub).

Prompts go one at a time, first to the plain engine, then through the proxy,
and then a concurrent burst through the proxy. It prints, per prompt: the
tokens identical or not, time to first token both ways, and the KV transfer
(bytes, time from the first layer committed to delivered, and the part after
the last layer: what computing the next layers did not hide). The figures go
to ``results/demo-vllm.json``.
"""

from __future__ import annotations

import datetime
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TextIO

from kvwire_vllm.model import SHAPES, make_model
from kvwire_vllm.shards import transfer_of
from kvwired import tracing
from kvwired.analysis import percentile
from kvwired.errors import KvwireError

from .. import table, timeline
from ..netns import DaemonProcess, NetnsPair, two_hosts
from .engines import ServeProcess, start_proxy

LENGTHS = [256, 1000, 2000] * 3  # one at a time
BURST = [300, 700, 1100, 1500, 500, 900, 1300, 1700]  # at once
MAX_TOKENS = 16
DEADLINE = 20.0
PORTS = {"prefill": 8100, "decode": 8200, "colocated": 8300, "proxy": 8000}


class DemoFailed(KvwireError, code="demo_failed",
                 hint="the servers' logs are in the work directory it names"):
    """The vLLM demo could not run to the end."""


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SHAPES["bench"].vocab) for _ in range(n)] for n in lengths]


@contextmanager
def servers(pair: NetnsPair, model: Path, work: Path, receiver: DaemonProcess,
            sender: DaemonProcess, traces: Path) -> Iterator[dict[str, str]]:
    """The three vLLM servers and the proxy; their URLs. The proxy and the two
    disaggregated engines trace each request into ``traces``."""
    on_prefill, on_decode = pair.argv(pair.prefill, []), pair.argv(pair.decode, [])
    memory = 1 << 30
    traced = {tracing.ENV: str(traces)}
    serve = [
        ("prefill", ServeProcess(model, pair.prefill.address, PORTS["prefill"],
                                 work / "serve-prefill.log", "prefill",
                                 {"sender_socket": sender.socket, "deadline": DEADLINE},
                                 on_prefill, kv_cache_bytes=memory, env=traced)),
        ("decode", ServeProcess(model, pair.decode.address, PORTS["decode"],
                                work / "serve-decode.log", "decode",
                                {"receiver_socket": receiver.socket}, on_decode,
                                kv_cache_bytes=memory, env=traced)),
        ("colocated", ServeProcess(model, pair.decode.address, PORTS["colocated"],
                                   work / "serve-colocated.log", None, None, on_decode,
                                   kv_cache_bytes=memory))]
    urls = {name: server.url for name, server in serve}
    with ExitStack() as stack:
        for _, server in serve:
            stack.callback(server.stop)
            server.start()
        started = time.monotonic()
        for name, server in serve:
            server.wait_ready(timeout=600)
            print(f"  {name} server ready after {time.monotonic() - started:.0f} s", flush=True)
        urls["proxy"] = start_proxy(
            stack, on_prefill, urls["prefill"], f"decode={urls['decode']}",
            f"{pair.prefill.address}:{PORTS['proxy']}", DEADLINE, work / "proxy.log",
            env=traced)
        yield urls


def send(pair: NetnsPair, url: str, prompts: list[list[int]],
         concurrency: int = 1) -> list[dict[str, Any]]:
    """Prompts through ``url``, from the prefill host (where the proxy listens)."""
    done = subprocess.run(pair.argv(pair.prefill, [
        sys.executable, "-m", "kvctl.vllm.load", url, "--max-tokens", str(MAX_TOKENS),
        "--concurrency", str(concurrency)]), input=json.dumps(prompts),
        capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise DemoFailed(f"requests to {url} failed:\n{done.stderr[-2000:]}")
    answers = list(json.loads(done.stdout.strip().splitlines()[-1]))
    for answer in answers:
        if answer["status"] != 200:
            raise DemoFailed(f"{url} answered {answer['status']}: {answer['error']}")
    return answers


def transfers(sender: DaemonProcess) -> dict[str, dict[str, Any]]:
    """Each request the sender delivered, by transfer id, from its log: its
    pushes (one per KV head) added up, timed by the last one to land."""
    found: dict[str, dict[str, Any]] = {}
    for line in sender.log_path.read_text(errors="replace").splitlines():
        if '"push delivered"' in line:
            entry = json.loads(line)
            seen = found.setdefault(transfer_of(entry["req"]), {
                "pushes": 0, "bytes": 0, "transfer_seconds": 0.0, "drain_seconds": 0.0})
            seen["pushes"] += 1
            seen["bytes"] += entry["bytes"]
            for key in ("transfer_seconds", "drain_seconds"):
                seen[key] = max(seen[key], entry[key])
    return found


def vllm_demo(out: TextIO = sys.stdout, results: Path | None = Path("results")) -> dict[str, Any]:
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    began = time.monotonic()
    shape = SHAPES["bench"]
    print(f"model: a Llama made here (no hub): {shape.layers} layers, {shape.kv_heads} KV heads "
          f"x {shape.head_dim}; {shape.kv_bytes_per_token() // 1024} KiB of KV per token "
          "(float32)", file=out, flush=True)
    with tempfile.TemporaryDirectory(prefix="kvwire-vllm-demo-") as tmp:
        work = Path(tmp)
        model = make_model(work / "model", "bench")
        with two_hosts(work) as (pair, receiver, sender):
            print(f"hosts: prefill {pair.prefill.address}, decode {pair.decode.address} "
                  "(two namespaces, a veth; daemons over TCP with mutual TLS)", file=out)
            print("starting three vLLM servers (prefill, decode, and one engine for "
                  "reference), then the proxy: a minute or two on 2 cores", file=out,
                  flush=True)
            traces = work / "traces"
            traces.mkdir()
            with servers(pair, model, work, receiver, sender, traces) as urls:
                report = _measure(pair, urls, sender, out, traces)
    report |= {"experiment": "demo-vllm", "started": started_at,
               "seconds": round(time.monotonic() - began, 1)}
    print(f"\nthe demo took {report['seconds'] / 60:.1f} min", file=out)
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        path = results / "demo-vllm.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures: {path}", file=out)
    if not report["identical"]:
        raise DemoFailed("disaggregated tokens differed from the one engine's")
    return report


def _measure(pair: NetnsPair, urls: dict[str, str], sender: DaemonProcess,
             out: TextIO, traces: Path) -> dict[str, Any]:
    warm = prompts_of([64], seed=1)
    send(pair, urls["colocated"], warm)
    send(pair, urls["proxy"], warm)
    prompts = prompts_of(LENGTHS, seed=2)
    print(f"\n{len(prompts)} prompts one at a time, {MAX_TOKENS} tokens each, greedy:",
          file=out, flush=True)
    rows, records = [], []
    for n, prompt in enumerate(prompts):
        [alone] = send(pair, urls["colocated"], [prompt])
        [split] = send(pair, urls["proxy"], [prompt])
        push = transfers(sender).get(split["transfer"] or "", {})
        record = {"tokens": len(prompt), "identical": alone["tokens"] == split["tokens"],
                  "ttft_colocated": alone["ttft"], "ttft_disaggregated": split["ttft"],
                  "prefill_ms": split["prefill_ms"], "bytes": push.get("bytes", 0),
                  "transfer_seconds": push.get("transfer_seconds"),
                  "drain_seconds": push.get("drain_seconds"), "transfer": split["transfer"]}
        records.append(record)
        rows.append([n, len(prompt), "yes" if record["identical"] else "NO",
                     f"{alone['ttft'] * 1e3:.0f}", f"{split['ttft'] * 1e3:.0f}",
                     f"{record['bytes'] / 2**20:.1f}",
                     _ms(record["transfer_seconds"]), _ms(record["drain_seconds"])])
        print(table.render(HEADERS, [rows[-1]]).splitlines()[-1] if n else
              table.render(HEADERS, [rows[-1]]), file=out, flush=True)
    burst = prompts_of(BURST, seed=3)
    alone_burst = send(pair, urls["colocated"], burst)
    split_burst = send(pair, urls["proxy"], burst, concurrency=len(burst))
    burst_identical = [a["tokens"] == s["tokens"]
                       for a, s in zip(alone_burst, split_burst, strict=True)]
    print(f"\na burst of {len(burst)} prompts at once through the proxy: "
          f"{sum(burst_identical)} of {len(burst)} identical to the one engine", file=out)
    summary = _summary(records)
    print("\n" + table.render(["", "p50 ms", "p99 ms", "spread (p99/p50)"], [
        ["TTFT, one engine", *summary["ttft_colocated"]],
        ["TTFT, disaggregated over kvwire", *summary["ttft_disaggregated"]],
        ["KV transfer (first layer -> delivered)", *summary["transfer"]],
        ["... after the last layer (not hidden)", *summary["drain"]]]), file=out)
    hidden = summary["hidden_share"]
    print(f"\noverlap: {hidden * 100:.0f} % of the transfer time ran while prefill was still "
          "computing later layers", file=out)
    steps = _timelines(records, traces, out)
    identical = all(r["identical"] for r in records) and all(burst_identical)
    print(f"tokens identical to one engine: {'yes' if identical else 'NO'} "
          f"({sum(r['identical'] for r in records) + sum(burst_identical)} of "
          f"{len(records) + len(burst_identical)} prompts)", file=out)
    return {"identical": identical, "prompts": records, "burst_identical": burst_identical,
            "summary": summary, "timeline": steps}


def _timelines(records: list[dict[str, Any]], traces: Path,
               out: TextIO) -> dict[str, dict[str, dict[str, float]]]:
    """Where the one-at-a-time requests' time went, per prompt length (their
    traces), printed beside one engine's time to first token."""
    found = timeline.collect(traces, [r["transfer"] for r in records if r["transfer"]])
    groups: dict[str, list[timeline.Timeline]] = {}
    alone: dict[str, list[float]] = {}
    for record in records:
        key = f"{record['tokens']} tokens"
        alone.setdefault(key, []).append(record["ttft_colocated"] * 1e3)
        if record["transfer"] in found:
            groups.setdefault(key, []).append(found[record["transfer"]])
    print("\nwhere a disaggregated request's time went (from its trace: the proxy's, "
          "both engines'):\n" + timeline.render(groups), file=out)
    print("one engine's time to first token (p50 ms, at the client): " + " / ".join(
        f"{percentile(alone[key], 50):.1f}" for key in groups), file=out)
    return {key: timeline.summary(requests) for key, requests in groups.items()}


HEADERS = ["#", "tokens", "same tokens", "TTFT one engine ms", "TTFT disaggregated ms",
           "KV MiB", "transfer ms", "after last layer ms"]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    def spread(values: list[float]) -> list[str]:
        p50, p99 = percentile(values, 50), percentile(values, 99)
        return [f"{p50 * 1e3:.1f}", f"{p99 * 1e3:.1f}", f"{p99 / p50:.2f}" if p50 else "-"]
    moved = [r for r in records if r["transfer_seconds"] is not None]
    transfer = sum(r["transfer_seconds"] for r in moved)
    drain = sum(r["drain_seconds"] for r in moved)
    return {
        "ttft_colocated": spread([r["ttft_colocated"] for r in records]),
        "ttft_disaggregated": spread([r["ttft_disaggregated"] for r in records]),
        "transfer": spread([r["transfer_seconds"] for r in moved]) if moved else ["-"] * 3,
        "drain": spread([r["drain_seconds"] for r in moved]) if moved else ["-"] * 3,
        "hidden_share": 1 - drain / transfer if transfer else 0.0,
        "added_ttft_ms_p50": percentile(
            [(r["ttft_disaggregated"] - r["ttft_colocated"]) * 1e3 for r in records], 50),
    }
