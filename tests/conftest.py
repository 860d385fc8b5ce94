from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvctl.keys import local_cluster
from kvctl.lab.machine import LabState
from kvwired.cli import build_daemon
from kvwired.config import ReceiverConfig, SenderConfig, build
from kvwired.receiver import ReceiverDaemon
from kvwired.sender import SenderDaemon
from kvwired.trust import Trust

from .hangs import pytest_timeout_cancel_timer as pytest_timeout_cancel_timer
from .hangs import pytest_timeout_set_timer as pytest_timeout_set_timer
from .leftovers import MARK, reap_leftovers
from .waiting import until as until  # the tests' one wait, re-exported

# Property tests judge inputs, not speed: hypothesis's default 200 ms deadline
# per example failed a validator's test on a 2-core host busy with a demo.
settings.register_profile("kvwire", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvwire")


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(MARK, uuid.uuid4().hex)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = reap_leftovers(os.environ[MARK])
    if left:
        listing = "\n".join(f"  {pid}: {command}" for pid, command in sorted(left.items()))
        print(f"\nthe run left {len(left)} process(es) behind (now killed):\n{listing}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@dataclass
class LocalDaemons:
    receiver: ReceiverDaemon
    sender: SenderDaemon
    tls_root: Path

    def credentials(self, name: str, role: str = "sender") -> Trust:
        """TLS contexts of a node ``name`` of these daemons' cluster (issued on demand)."""
        return Trust(str(local_cluster(self.tls_root, {name: role})[name]), name)

    async def control(self, name: str = "prefill"
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A control connection to the receiver, authenticated as sender ``name``."""
        return await asyncio.open_connection("127.0.0.1", self.receiver.control_port,
                                             ssl=self.credentials(name).client)

    @property
    def sender_socket(self) -> str:
        return self.sender.config.socket

    @property
    def receiver_socket(self) -> str:
        return self.receiver.config.socket


async def start_local(tmp: Path, receiver: dict[str, Any] | None = None,
                      sender: dict[str, Any] | None = None) -> LocalDaemons:
    """Both daemons in this event loop, on loopback, with ephemeral ports, wired
    as ``kvwired`` wires them (experiments included), authenticated by
    credentials of a cluster CA of their own."""
    rx_name = str((receiver or {}).get("name", "decode"))
    tx_name = str((sender or {}).get("name", "prefill"))
    tls = local_cluster(tmp / "tls", {rx_name: "receiver", tx_name: "sender"})
    rx = build_daemon(build(ReceiverConfig, {
        "listen": "127.0.0.1:0", "data_port": 0, "socket": str(tmp / "rx.sock"),
        "metrics": "127.0.0.1:0", "pool_size": "64MiB", "lease_wait": 0.5,
        "tls_dir": str(tls[rx_name]), **(receiver or {})}))
    assert isinstance(rx, ReceiverDaemon)
    await rx.start()
    tx = build_daemon(build(SenderConfig, {
        "socket": str(tmp / "tx.sock"), "metrics": "127.0.0.1:0", "staging_size": "64MiB",
        "peers": {rx_name: f"127.0.0.1:{rx.control_port}"}, "connect_timeout": 2.0,
        "tls_dir": str(tls[tx_name]), **(sender or {})}))
    assert isinstance(tx, SenderDaemon)
    await tx.start()
    return LocalDaemons(rx, tx, tmp / "tls")


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[LocalDaemons]:
    daemons = await start_local(tmp_path)
    yield daemons
    await daemons.sender.stop()
    await daemons.receiver.stop()
    await asyncio.sleep(0)


@pytest.fixture
async def roomy(tmp_path: Path) -> AsyncIterator[LocalDaemons]:
    # Room for an echo lease and the 48 MiB cache delivered beside it.
    daemons = await start_local(tmp_path, receiver={"pool_size": "128MiB"},
                                sender={"staging_size": "128MiB"})
    yield daemons
    await daemons.sender.stop()
    await daemons.receiver.stop()


@pytest.fixture(scope="session")
def lab() -> Iterator[LabState]:
    """The two-node Soft-RoCE lab, up once for every test that needs it.

    With two rails: what runs over one of them (rail 0, the default wire)
    runs as on a one-rail lab, and the rail tests have their second.
    """
    from kvctl.lab import machine

    reason = machine.why_lab_cannot_run()
    if reason:
        pytest.skip(f"QEMU lab cannot run here: {reason}")
    result = subprocess.run([sys.executable, "-m", "kvctl", "lab", "up", "--rails", "2"],
                            capture_output=True, text=True)
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stderr
    state = machine.require_state()
    yield state
    subprocess.run([sys.executable, "-m", "kvctl", "lab", "down"], capture_output=True)


