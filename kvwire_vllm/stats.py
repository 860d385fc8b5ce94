"""What the connector did, counted: pushes and loads, their bytes and times.

vLLM collects a connector's stats every step and logs them (and the
offline tests read them: the proof that the decode engine's tokens came
over kvwire and were not recomputed). Counters only grow between resets;
``merge`` adds another worker's.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from kvwired.analysis import percentile

COUNTERS = ("pushes", "push_failures", "pushed_bytes", "loads", "load_failures",
            "loaded_tokens", "loaded_bytes")


class ConnectorCounters:
    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self.data: dict[str, Any] = data if data is not None else self.empty()

    @staticmethod
    def empty() -> dict[str, Any]:
        return {**dict.fromkeys(COUNTERS, 0), "failures": {}, "push_seconds": [],
                "load_seconds": []}

    def pushed(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.data["pushes"] += 1
            self.data["pushed_bytes"] += nbytes
            self.data["push_seconds"].append(seconds)

    def loaded(self, tokens: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.data["loads"] += 1
            self.data["loaded_tokens"] += tokens
            self.data["loaded_bytes"] += nbytes
            self.data["load_seconds"].append(seconds)

    def failed(self, what: str, reason: str) -> None:
        """``what``: push or load; ``reason``: the error's code (pool_full, seal, ...)."""
        with self._lock:
            self.data[f"{what}_failures"] += 1
            key = f"{what}:{reason}"
            self.data["failures"][key] = self.data["failures"].get(key, 0) + 1

    def take(self) -> dict[str, Any]:
        """Everything counted since the last take, and a fresh start."""
        with self._lock:
            data, self.data = self.data, self.empty()
            return data

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {**self.data, "failures": dict(self.data["failures"]),
                    "push_seconds": list(self.data["push_seconds"]),
                    "load_seconds": list(self.data["load_seconds"])}


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {key: a.get(key, 0) + b.get(key, 0) for key in COUNTERS}
    out["failures"] = dict(Counter(a.get("failures", {})) + Counter(b.get("failures", {})))
    out["push_seconds"] = [*a.get("push_seconds", []), *b.get("push_seconds", [])]
    out["load_seconds"] = [*a.get("load_seconds", []), *b.get("load_seconds", [])]
    return out


def summary(data: dict[str, Any]) -> dict[str, int | float]:
    """The figures vLLM's logger prints per interval."""
    out: dict[str, int | float] = {key: data.get(key, 0) for key in COUNTERS}
    for key in ("push_seconds", "load_seconds"):
        values = sorted(data.get(key, []))
        if values:
            out[f"{key}_p50"] = round(percentile(values, 50), 4)
            out[f"{key}_max"] = round(values[-1], 4)
    return out
