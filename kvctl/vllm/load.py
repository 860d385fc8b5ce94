"""Prompts through an OpenAI endpoint, as a client sees them: tokens and TTFT.

Each prompt is one streamed ``/v1/completions`` request (token ids in, token
ids out, greedy); the time to first token is from sending the request to the
first streamed chunk that carries a token. Prompts go out ``concurrency`` at
a time. Runnable where the endpoint is reachable (the demo runs it inside
a network namespace):

    python -m kvctl.vllm.load URL < prompts.json > results.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

MODEL = "kvwire-demo"  # the name the demo's servers answer to


@dataclass
class Answer:
    tokens: list[int] = field(default_factory=list)
    ttft: float | None = None  # seconds
    seconds: float = 0.0
    status: int = 0
    error: str | None = None
    transfer: str | None = None
    prefill_ms: float | None = None


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int],
                   max_tokens: int, extra: dict[str, Any] | None = None) -> Answer:
    """One streamed completion; ``extra``: more fields of the request body."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **(extra or {})}
    answer = Answer()
    started = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            answer.status = response.status
            answer.transfer = response.headers.get("x-kvwire-transfer")
            if "x-kvwire-prefill-ms" in response.headers:
                answer.prefill_ms = float(response.headers["x-kvwire-prefill-ms"])
            if response.status != 200:
                answer.error = (await response.text())[:500]
                return answer
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and answer.ttft is None:
                        answer.ttft = time.perf_counter() - started
                    answer.tokens += ids
    except (aiohttp.ClientError, TimeoutError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.seconds = time.perf_counter() - started
    return answer


async def run(url: str, prompts: list[list[int]], max_tokens: int,
              concurrency: int, timeout: float = 300.0) -> list[Answer]:
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async def one(prompt: list[int]) -> Answer:
            async with gate:
                return await complete(session, url, prompt, max_tokens)
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    prompts: list[list[int]] = json.load(sys.stdin)
    answers = asyncio.run(run(args.url, prompts, args.max_tokens, args.concurrency,
                              args.timeout))
    print(json.dumps([asdict(a) for a in answers]))


def answers_from(text: str) -> list[dict[str, Any]]:
    return list(json.loads(text.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
