"""One engine run through vLLM's offline API, as JSON in and JSON out.

The tests and the benchmark drive engines as separate processes (vLLM
allows one KV-transfer group per process), each in the engine's own
environment:

    python -m kvwire_vllm.offline < job.json > result.json

A job: ``{"model": DIR, "role": "colocated" | "prefill" | "decode",
"prompts": [[token ids], ...], "max_tokens": N, "params": [kv_transfer_params
or null per prompt], "connector": {extra config}, "failure_policy":
"recompute" | "fail", "engine": {more LLM() arguments}, "kv_transfer_config":
{another connector's, in place of kvwire's: a reference}}``; or, instead of
prompts and params, ``"rounds": [{"prompts", "params", "wait_for": PATH}]``:
batches one engine runs in turn, each once PATH exists (a test acts between
them). Progress lines (``kvwire-offline: built``, ``... round N generated``)
go to stderr as they happen.

The result: per prompt its output tokens, finish reason, ``num_cached_tokens``
and the ``kv_transfer_params`` the engine returned; the connector's counters;
the engine's build and generate times.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Before vLLM is imported: one process (no engine-core subprocess), and the
# two cores of a small machine not fought over by OpenMP.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

ENGINE_DEFAULTS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "kv_cache_memory_bytes": 256 << 20,
    "gpu_memory_utilization": 0.05,
    "max_num_batched_tokens": 512,
    "max_model_len": 8192,
    "block_size": 128,
    "seed": 0,
    # The model's own dtype. vLLM's CPU default (bfloat16) rounds enough that
    # two runs of one prompt (a prefix-cache hit, another batch) can pick
    # different greedy tokens; float32 keeps one engine equal to itself.
    "dtype": "float32",
}


def kv_transfer_config(role: str, connector: dict[str, Any] | None,
                       failure_policy: str = "recompute") -> dict[str, Any] | None:
    if role == "colocated":
        return None
    return {"kv_connector": "KvwireConnector",
            "kv_connector_module_path": "kvwire_vllm.connector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_load_failure_policy": failure_policy,
            "kv_connector_extra_config": connector or {}}


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from .connector import COUNTERS_FOLDER

    role = job["role"]
    os.environ[COUNTERS_FOLDER] = tempfile.mkdtemp(prefix="kvwire-counters-")
    started = time.perf_counter()
    transfer = job.get("kv_transfer_config") or kv_transfer_config(
        role, job.get("connector"), job.get("failure_policy", "recompute"))
    llm = LLM(model=job["model"], **{**ENGINE_DEFAULTS, **job.get("engine", {})},
              kv_transfer_config=transfer)
    built = time.perf_counter() - started
    _mark("built")
    max_tokens = 1 if role == "prefill" else int(job.get("max_tokens", 16))
    rounds = job.get("rounds") or [{"prompts": job["prompts"], "params": job.get("params")}]
    results: list[dict[str, Any]] = []
    seconds = 0.0
    for number, batch in enumerate(rounds):
        if batch.get("wait_for"):
            _wait_for_file(batch["wait_for"])
        prompts = batch["prompts"]
        params = batch.get("params") or [None] * len(prompts)
        sampling = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                   extra_args={"kv_transfer_params": p} if p else None)
                    for p in params]
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                               use_tqdm=False)
        seconds += time.perf_counter() - started
        _mark(f"round {number} generated")
        for output in outputs:
            completion = output.outputs[0]
            results.append({"tokens": list(completion.token_ids),
                            "finish_reason": completion.finish_reason,
                            "num_cached_tokens": output.num_cached_tokens,
                            "kv_transfer_params": output.kv_transfer_params})
    counters = None
    if role != "colocated":
        # The engine and its workers stop: each worker's connector ends its
        # pushes in flight first, then writes its counters (at TP above 1 the
        # workers are processes of their own).
        llm.llm_engine.engine_core.shutdown()
        counters = _workers_counters(Path(os.environ[COUNTERS_FOLDER]))
    # The folder was this run's alone: a suite of runs leaves nothing in /tmp.
    shutil.rmtree(os.environ.pop(COUNTERS_FOLDER), ignore_errors=True)
    return {"role": role, "outputs": results, "seconds": seconds, "build_seconds": built,
            "counters": counters}


def _workers_counters(folder: Path) -> dict[str, Any]:
    """Every worker's counters, added up, and each worker's under "ranks"."""
    from .stats import ConnectorCounters, merge

    total = ConnectorCounters.empty()
    ranks = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        ranks[path.stem] = data
        total = merge(total, data)
    return {**total, "ranks": ranks}


def _mark(what: str) -> None:
    """A progress line on stderr, for a caller that acts between the steps."""
    print(f"kvwire-offline: {what}", file=sys.stderr, flush=True)


def _wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.01)


def main() -> None:
    job = json.load(sys.stdin)
    result = run(job)
    sys.stdout.flush()
    # vLLM prints to stdout too: the result is the last line.
    print("\n" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
