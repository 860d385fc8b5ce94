"""A real Prometheus server (Debian's package) scrapes both daemons while they
work and fail; every Grafana panel's query and every alert's query returns
data, every rule evaluates cleanly, and promtool accepts the shipped files."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvctl.keys import with_credentials
from kvctl.netns import write_toml
from kvwired.addresses import free_port
from kvwired.client import SenderClient
from kvwired.errors import KvwireError

from ..waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/kvwire-rules.yml"
DASHBOARD = ROOT / "deploy/grafana/kvwire-dashboard.json"
# The receiver is killed and restarted, and a request is refused.
EXPECTED_FIRING = {"KvwireCompletionErrors", "KvwireRestarted", "KvwireRequestsRefused"}
COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.]+\s*$")


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} missing: scripts/install-system-packages.sh installs it"
    return path


class Process:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv, self.log_path = argv, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _answers(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2):
        return True


def _wait_http(url: str, timeout: float = 60) -> None:
    wait_until(lambda: _answers(url), timeout, f"{url} answering", every=0.2,
               ignoring=(OSError,))


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _api(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=10) as r:
        return json.loads(r.read())["data"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("prometheus")
    ports = {name: free_port() for name in ("control", "rx_metrics", "tx_metrics", "prom",
                                            "etcd", "etcd_peer")}
    # Both daemons in a real etcd registry, so the membership panel and the
    # registry alert have data; the sender's [peers] names the same receiver.
    etcd = Process([_tool("etcd"), "--data-dir", str(tmp / "etcd"),
                    "--listen-client-urls", f"http://127.0.0.1:{ports['etcd']}",
                    "--advertise-client-urls", f"http://127.0.0.1:{ports['etcd']}",
                    "--listen-peer-urls", f"http://127.0.0.1:{ports['etcd_peer']}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{ports['etcd_peer']}",
                    "--initial-cluster", f"default=http://127.0.0.1:{ports['etcd_peer']}"],
                   tmp / "etcd.log")
    discovery = f"etcd://127.0.0.1:{ports['etcd']}/prometheus-test"
    write_toml(tmp / "rx.toml", with_credentials({
        "name": "decode", "transport": "tcp", "listen": f"127.0.0.1:{ports['control']}",
        "data_port": 0, "socket": str(tmp / "rx.sock"),
        "metrics": f"127.0.0.1:{ports['rx_metrics']}", "pool_size": "32MiB",
        "lease_wait": 0.2, "discovery": discovery}, "receiver", tmp / "tls"))
    write_toml(tmp / "tx.toml", with_credentials({
        "name": "prefill", "transport": "tcp", "socket": str(tmp / "tx.sock"),
        "metrics": f"127.0.0.1:{ports['tx_metrics']}", "staging_size": "64MiB",
        "peers": {"decode": f"127.0.0.1:{ports['control']}"}, "discovery": discovery},
        "sender", tmp / "tls"))
    kvwired = [sys.executable, "-m", "kvwired"]
    receiver = Process([*kvwired, "receiver", "--config", str(tmp / "rx.toml")],
                       tmp / "rx.log")
    sender = Process([*kvwired, "sender", "--config", str(tmp / "tx.toml")], tmp / "tx.log")
    shutil.copy(RULES, tmp / "kvwire-rules.yml")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["kvwire-rules.yml"],
        "scrape_configs": [
            {"job_name": "kvwire-receiver",
             "static_configs": [{"targets": [f"127.0.0.1:{ports['rx_metrics']}"]}]},
            {"job_name": "kvwire-sender",
             "static_configs": [{"targets": [f"127.0.0.1:{ports['tx_metrics']}"]}]},
        ]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = Process([_tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp / 'data'}",
                          f"--web.listen-address=127.0.0.1:{ports['prom']}", "--log.level=warn"],
                         tmp / "prometheus.log")
    started = [etcd, receiver, sender, prometheus]
    try:
        _wait_http(f"http://127.0.0.1:{ports['etcd']}/health")
        for port in ("rx_metrics", "tx_metrics"):
            _wait_http(f"http://127.0.0.1:{ports[port]}/metrics")
        # Prometheus serves /metrics before its storage is open, and its
        # query API answers 503 until then (seen by CI on a loaded host):
        # /-/ready says 200 only once queries can be answered.
        _wait_http(f"http://127.0.0.1:{ports['prom']}/-/ready")
        _wait_scraped(ports["prom"])  # the idle state is on record before any work
        _work_and_fail(ports["prom"], tmp / "tx.sock", receiver)
        yield {"port": ports["prom"], "tmp": tmp}
    finally:
        for process in reversed(started):
            process.stop()


def _wait_scraped(port: int, timeout: float = 60) -> None:
    wait_until(lambda: len(_query(port, 'up{job=~"kvwire-.*"} == 1')) == 2
               and bool(_query(port, 'kvwire_requests_total{job="kvwire-receiver"}')),
               timeout, "Prometheus scraping both daemons", every=0.5)


def _eventually(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    wait_until(check, timeout, what, every=0.2)


def _value(port: int, expr: str) -> float:
    result = _query(port, expr)
    return sum(float(sample["value"][1]) for sample in result)


def _work_and_fail(prom: int, sender_socket: Path, receiver: Process) -> None:
    """Pushes of several sizes over a few scrapes, a refusal, a receiver crash."""
    delivered = 'kvwire_requests_total{job="kvwire-sender",outcome="delivered"}'

    async def pushes() -> None:
        async with await SenderClient.connect(str(sender_socket)) as client:
            for n in range(12):
                await client.push_bytes(f"ok-{n}", "decode", os.urandom(2 << 20),
                                        chunk=[512 << 4, 65536, 1 << 20][n % 3])
                if n % 3 == 2:  # spread over scrapes: rates need more than one sample
                    def scraped(pushed: int = n + 1) -> bool:
                        return _value(prom, delivered) >= pushed
                    await asyncio.to_thread(_eventually, scraped, "Prometheus scraping pushes")
            with pytest.raises(KvwireError):  # larger than the 32 MiB receive pool
                await client.push_bytes("too-big", "decode", bytes(48 << 20))

    async def push_once(req: str) -> None:
        async with await SenderClient.connect(str(sender_socket)) as client:
            await client.push_bytes(req, "decode", b"z" * 65536)

    asyncio.run(pushes())
    _eventually(lambda: _value(prom, 'kvwire_requests_total{outcome="refused"}') > 0,
                "the refusal scraped while healthy")
    receiver.kill()  # the data connection drops: a completion error, peer down
    _eventually(lambda: bool(_query(prom, 'up{job="kvwire-receiver"} == 0'))
                and _value(prom, "kvwire_completion_errors_total") > 0,
                "the crash scraped")
    receiver.start()  # a restart: new process start time, the sender reconnects
    deadline = time.monotonic() + 30
    while True:
        try:
            asyncio.run(push_once(f"after-{time.monotonic()}"))
            break
        except KvwireError:
            assert time.monotonic() < deadline, "sender never reconnected"
            time.sleep(0.5)
    # What the tests below ask of Prometheus, awaited here once: every query
    # has data and the crash's alerts fire.
    queries = [expr for _, expr in _dashboard_queries()] + [
        COMPARISON.sub("", rule["expr"]) for rule in _alert_rules()]
    _eventually(lambda: all(_query(prom, expr) for expr in queries),
                "every dashboard and alert query returning data")
    _eventually(lambda: _firing(prom) >= EXPECTED_FIRING, "the crash's alerts firing")


def _firing(port: int) -> set[str]:
    return {alert["labels"]["alertname"] for alert in _api(port, "alerts")["alerts"]
            if alert["state"] == "firing"}


def _dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel["targets"]]


def _alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_accepts_the_shipped_rules_and_config() -> None:
    promtool = _tool("promtool")
    for args in (["check", "rules", str(RULES)],
                 ["check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60,
                              cwd=ROOT / "deploy/prometheus")
        assert done.returncode == 0, done.stdout + done.stderr


def test_prometheus_scrapes_both_daemons(stack: dict[str, Any]) -> None:
    targets = _api(stack["port"], "targets")["activeTargets"]
    assert {t["labels"]["job"] for t in targets} == {"kvwire-receiver", "kvwire-sender"}
    assert all(t["health"] == "up" for t in targets), targets


@pytest.mark.parametrize(("title", "expr"), _dashboard_queries())
def test_every_dashboard_query_returns_data(stack: dict[str, Any], title: str,
                                            expr: str) -> None:
    assert _query(stack["port"], expr), f"panel {title!r}: no data for {expr}"


@pytest.mark.parametrize("rule", _alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_query_returns_data(stack: dict[str, Any], rule: dict[str, Any]) -> None:
    query = COMPARISON.sub("", rule["expr"])
    assert query != rule["expr"], "alert expressions end in a comparison with a number"
    assert _query(stack["port"], query), f"{rule['alert']}: no data for {query}"


def test_rules_evaluate_and_the_crash_fires_its_alerts(stack: dict[str, Any]) -> None:
    groups = _api(stack["port"], "rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(_alert_rules())
    assert all(rule["health"] == "ok" for rule in rules), rules
    # The receiver was killed and restarted, and a request was refused.
    assert _firing(stack["port"]) >= EXPECTED_FIRING
