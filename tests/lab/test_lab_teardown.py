"""Runs after every other lab test (files run in name order): the lab goes
down through `kvctl lab down` and nothing of it may be left."""

from __future__ import annotations

import socket

import pytest

from kvctl.lab import machine
from kvctl.lab.machine import LabState
from kvctl.processes import alive

from .test_lab import _qemus_of, kvctl

pytestmark = pytest.mark.lab


def test_session_lab_down_leaves_nothing(lab: LabState) -> None:
    pids = [node.pid for node in lab.nodes.values()]
    ports = [port for node in lab.nodes.values() for port in node.ports.values()]
    result = kvctl("lab", "down")
    assert result.returncode == 0, result.stderr
    assert "powered off" in result.stdout
    assert not any(alive(pid) for pid in pids)
    assert not machine.STATE_DIR.exists()
    assert not _qemus_of(machine.STATE_DIR)
    for port in ports:
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert kvctl("lab", "status").returncode == 1
