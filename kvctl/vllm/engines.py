"""vLLM engines as processes of the engine's environment.

``offline``: one batch through vLLM's offline API (``kvwire_vllm.offline``),
JSON in, JSON out; the tests and the benchmark use it. ``ServeProcess``: a
``vllm serve``, the OpenAI server, in a network namespace or not; the proxy,
the demo and the user-path test use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvwired.errors import KvwireError

REPO = Path(__file__).resolve().parents[2]
PYTHON_VARIABLE = "KVWIRE_VLLM_PYTHON"
# Settings for small machines (2 cores, no GPU): one OpenMP thread, no CPU
# pinning (other processes share the cores), no torch compilation.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
              "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class EngineError(KvwireError, code="engine",
                  hint="the engine's output above says why; `make vllm-env` builds its "
                       "environment"):
    """A vLLM engine process could not be started or failed."""


def engine_python() -> str:
    """The engine environment's python: $KVWIRE_VLLM_PYTHON, else .venv-vllm."""
    named = os.environ.get(PYTHON_VARIABLE)
    path = Path(named) if named else REPO / ".venv-vllm" / "bin" / "python"
    if not path.exists():
        raise EngineError(f"no vLLM environment at {path}",
                          hint="run `make vllm-env` (about 2.5 GB, once per machine), or "
                               f"point ${PYTHON_VARIABLE} at a python with vllm and "
                               "kvwire[vllm] installed")
    return str(path)


def engine_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **ENGINE_ENV, **extra}


def offline(job: dict[str, Any], timeout: float = 300.0,
            prefix: Sequence[str] = ()) -> dict[str, Any]:
    """Run one offline engine job (see kvwire_vllm.offline); its result."""
    done = subprocess.run([*prefix, engine_python(), "-m", "kvwire_vllm.offline"],
                          input=json.dumps(job), capture_output=True, text=True,
                          timeout=timeout, env=engine_env())
    # The result is the job's one JSON line; a TP engine's workers may log after it.
    results = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not results:
        raise EngineError(f"the {job.get('role')} engine exited with {done.returncode}:\n"
                          + "\n".join(done.stderr.splitlines()[-25:]))
    return dict(json.loads(results[-1]))


class OfflineProcess:
    """An offline job running, not waited for: a test acts between its steps
    (``kvwire-offline: ...`` lines on its stderr) or kills it."""

    def __init__(self, job: dict[str, Any], log: Path, prefix: Sequence[str] = ()) -> None:
        self.out, self.err = log.with_suffix(".out"), log.with_suffix(".err")
        self.process = subprocess.Popen(
            [*prefix, engine_python(), "-m", "kvwire_vllm.offline"], stdin=subprocess.PIPE,
            stdout=self.out.open("w"), stderr=self.err.open("w"), text=True, env=engine_env())
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(job))
        self.process.stdin.close()

    def wait_mark(self, mark: str, timeout: float = 300.0) -> None:
        """Until the job says ``kvwire-offline: MARK``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"kvwire-offline: {mark}" in self.err.read_text(errors="replace"):
                return
            if self.process.poll() is not None:
                raise EngineError(f"the engine exited ({self.process.returncode}) before "
                                  f"{mark!r}:\n{self.tail()}")
            time.sleep(0.02)
        raise EngineError(f"the engine did not reach {mark!r} in {timeout:g} s:\n{self.tail()}")

    def result(self, timeout: float = 300.0) -> dict[str, Any]:
        self.process.wait(timeout)
        lines = self.out.read_text().strip().splitlines()
        if self.process.returncode != 0 or not lines:
            raise EngineError(f"the engine exited with {self.process.returncode}:\n"
                              + self.tail())
        return dict(json.loads(lines[-1]))

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.err.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def kv_transfer_config(role: str, extra: dict[str, Any],
                       failure_policy: str = "recompute") -> dict[str, Any]:
    return {"kv_connector": "KvwireConnector",
            "kv_connector_module_path": "kvwire_vllm.connector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_load_failure_policy": failure_policy,
            "kv_connector_extra_config": extra}


_HEALTH = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=2) as response:
    sys.exit(0 if response.status == 200 else 1)
"""


class ServeProcess:
    """``vllm serve MODEL`` on ``host:port``, with kvwire's connector or without."""

    def __init__(self, model: Path, host: str, port: int, log: Path,
                 role: str | None = None, connector: dict[str, Any] | None = None,
                 prefix: Sequence[str] = (), kv_cache_bytes: int = 256 << 20,
                 max_batched_tokens: int = 512, kv_transfer: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, extra_args: Sequence[str] = ()) -> None:
        """``role`` and ``connector``: kvwire's connector as the prefill or decode
        engine, with that extra config; ``kv_transfer``: any other connector's
        whole --kv-transfer-config (the benchmark's peers); ``env``: more
        environment for the server."""
        self.url = f"http://{host}:{port}"
        self.log = log
        self.prefix = list(prefix)
        # `vllm serve`'s own module: vllm-cpu's `vllm` command looks up the version
        # of a distribution named vllm, which vllm-cpu is not, and stops.
        command = [engine_python(), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(model), "--host", host, "--port", str(port),
                   "--served-model-name", "kvwire-demo", "--dtype", "float32",
                   "--skip-tokenizer-init", "--enforce-eager", "--block-size", "128",
                   "--kv-cache-memory-bytes", str(kv_cache_bytes),
                   "--gpu-memory-utilization", "0.05",
                   "--max-num-batched-tokens", str(max_batched_tokens),
                   "--max-model-len", "8192", "--seed", "0", "--disable-log-stats"]
        if role is not None:
            kv_transfer = kv_transfer_config(role, connector or {})
        if kv_transfer is not None:
            command += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.command = [*command, *extra_args]
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ServeProcess:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen([*self.prefix, *self.command], stdout=log,
                                            stderr=subprocess.STDOUT,
                                            env=engine_env(**self.env),
                                            start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until /health answers (asked from the server's namespace)."""
        probe = self.prefix
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise EngineError(f"vllm serve exited with {self.process.returncode}:\n"
                                  + self.log_tail())
            if self._healthy(probe):
                return
            time.sleep(0.5)
        raise EngineError(f"vllm serve not ready within {timeout:g} s:\n{self.log_tail()}")

    def _healthy(self, probe: Sequence[str]) -> bool:
        if probe:  # asked from inside the server's namespace
            check = subprocess.run([*probe, sys.executable, "-c", _HEALTH, self.url],
                                   capture_output=True)
            return check.returncode == 0
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, 15)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of every process of the server so far."""
        assert self.process is not None
        return process_group_cpu(self.process.pid)


def process_group_cpu(group: int) -> float:
    """User + system seconds of the live processes in process group ``group``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        # After the name: state, ppid, pgrp, ... utime and stime are the 12th and 13th.
        if int(fields[2]) == group:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def start_proxy(stack: contextlib.ExitStack, prefix: Sequence[str], prefill: str,
                decode: str, listen: str, deadline: float, log: Path,
                flow: str = "parallel", timeout: float = 30.0,
                env: dict[str, str] | None = None) -> str:
    """``kvctl proxy`` started (behind ``prefix``, e.g. a namespace) and
    stopped with ``stack``; its URL once it listens. ``env``: more environment
    (``KVWIRE_TRACES``, to trace its requests)."""
    start_until_it_says(
        stack, [*prefix, sys.executable, "-m", "kvctl", "proxy", "--prefill", prefill,
                "--decode", decode, "--listen", listen, "--deadline", str(deadline),
                "--flow", flow],
        log, "kvctl proxy on", "the proxy", timeout, env=env)
    return f"http://{listen}"


def start_until_it_says(stack: contextlib.ExitStack, argv: Sequence[str], log: Path,
                        ready: str, what: str, timeout: float = 30.0,
                        env: dict[str, str] | None = None,
                        cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """``argv`` started, its output into ``log``, and stopped with ``stack``;
    returned once ``log`` holds ``ready`` (its line saying it listens).
    ``env``: more environment than this process's."""
    process = subprocess.Popen(list(argv), stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})}, cwd=cwd)
    stack.callback(process.wait)
    stack.callback(process.terminate)
    ends = time.monotonic() + timeout
    while ready not in log.read_text():
        if process.poll() is not None or time.monotonic() > ends:
            raise EngineError(f"{what} did not start:\n{log.read_text()}")
        time.sleep(0.1)
    return process
