"""Mooncake's router flow, for the benchmark: a transfer id to both engines.

vLLM's MooncakeConnector does not answer the prefill request with the
params a decode engine needs (as NIXL and kvwire do): its router gives both
engines one ``transfer_id`` and tells the decode engine where the prefill
engine registered (its engine id, its bootstrap server). This does that, one
prompt at a time, and prints what ``kvctl.vllm.load`` prints; the time to
first token runs from the prefill request.

    python -m benchmarks.vllm_router PREFILL_URL DECODE_URL --engine ID \
        --bootstrap HOST:PORT < prompts.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from dataclasses import asdict

import aiohttp

from kvctl.vllm.load import MODEL, Answer, complete


async def one(session: aiohttp.ClientSession, args: argparse.Namespace,
              prompt: list[int]) -> Answer:
    transfer = uuid.uuid4().hex
    started = time.perf_counter()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer}}
    async with session.post(f"{args.prefill}/v1/completions", json=body) as response:
        if response.status != 200:
            return Answer(status=response.status, error=(await response.text())[:500])
        await response.read()
    prefilled = time.perf_counter() - started
    answer = await complete(session, args.decode, prompt, args.max_tokens, {
        "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer,
                               "remote_engine_id": args.engine,
                               "remote_bootstrap_addr": args.bootstrap}})
    if answer.ttft is not None:
        answer.ttft += prefilled
    answer.prefill_ms = prefilled * 1e3
    answer.transfer = transfer
    return answer


async def run(args: argparse.Namespace, prompts: list[list[int]]) -> list[Answer]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return [await one(session, args, prompt) for prompt in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefill")
    parser.add_argument("decode")
    parser.add_argument("--engine", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    answers = asyncio.run(run(args, json.load(sys.stdin)))
    print(json.dumps([asdict(a) for a in answers]))


if __name__ == "__main__":
    main()
