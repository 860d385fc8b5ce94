"""What the vLLM suites of the two-namespace harness share: the engines'
environment, the daemons between the engines, the models made here."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvctl.netns import DaemonProcess, NetnsPair, receiver_config, scrape_in
from kvctl.netns import sender_config as netns_sender_config
from kvctl.vllm import engines
from kvctl.vllm.engines import EngineError
from kvwire_vllm.model import make_model

DEADLINE = 8.0  # seconds a push may take
POOL = 64 << 20  # the receiver's pool: tests fill it
MAX_TOKENS = 12  # tokens each prompt is decoded to


@pytest.fixture(scope="module")
def engine_python() -> str:
    try:
        return engines.engine_python()
    except EngineError as exc:
        if os.environ.get("KVWIRE_REQUIRE_VLLM"):
            raise  # make test builds the environment: its absence is a failure there
        pytest.skip(exc.message)


@dataclass
class Hosts:
    pair: NetnsPair
    receiver: DaemonProcess
    sender: DaemonProcess
    workdir: Path

    def connector(self, role: str) -> dict[str, Any]:
        if role == "prefill":
            return {"sender_socket": self.sender.socket, "deadline": DEADLINE}
        return {"receiver_socket": self.receiver.socket}

    def receiver_total(self, name: str, **labels: str) -> float:
        return scrape_in(self.pair, self.pair.decode, 9471).total(name, **labels)

    def pool_used(self) -> float:
        return self.receiver_total("kvwire_pool_bytes", pool="receive", state="used")


@pytest.fixture(scope="module")
def hosts(engine_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    workdir = tmp_path_factory.mktemp("vllm-hosts")
    with NetnsPair(f"v{os.getpid() % 100000}") as pair:
        rx = DaemonProcess(pair, pair.decode, "receiver",
                           receiver_config(pair, workdir, lease_wait=1.0, pool_size=POOL),
                           workdir)
        tx = DaemonProcess(pair, pair.prefill, "sender",
                           netns_sender_config(pair, workdir), workdir)
        rx.start()
        tx.start()
        try:
            yield Hosts(pair, rx, tx, workdir)
        finally:
            tx.stop()
            rx.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny", "tiny")


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


def plain_engine_tokens(model: Path, prompts: list[list[int]],
                        engine: dict[str, Any] | None = None) -> list[list[int]]:
    """The reference: one engine, prefill and decode, no connector. The model's
    outputs must differ from prompt to prompt, or equal tokens prove nothing."""
    result = engines.offline({"model": str(model), "role": "colocated", "prompts": prompts,
                              "max_tokens": MAX_TOKENS, "engine": engine or {}})
    tokens = [o["tokens"] for o in result["outputs"]]
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert len({tuple(t) for t in tokens}) == len(tokens), "the model's outputs must differ"
    return tokens
