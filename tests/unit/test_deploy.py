"""The shipped systemd units and ``make install`` (staged into a DESTDIR)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ("kvwired-receiver.service", "kvwired-sender.service")


def _install(destdir: Path, *roles: str) -> subprocess.CompletedProcess[str]:
    # PREFIX is this venv, staged under DESTDIR: nothing is created or downloaded.
    staged_bin = destdir / sys.prefix.lstrip("/") / "bin"
    staged_bin.mkdir(parents=True, exist_ok=True)
    if not (staged_bin / "kvwired").exists():
        (staged_bin / "kvwired").symlink_to(Path(sys.prefix) / "bin" / "kvwired")
    return subprocess.run([str(ROOT / "scripts" / "install.sh"), *roles],
                          env=dict(os.environ, DESTDIR=str(destdir), PREFIX=sys.prefix),
                          capture_output=True, text=True, timeout=60)


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def test_install_places_units_and_configs_and_keeps_edited_configs(tmp_path: Path) -> None:
    done = _install(tmp_path)
    assert done.returncode == 0, done.stderr
    for role in ("receiver", "sender"):
        unit = (tmp_path / "etc/systemd/system" / f"kvwired-{role}.service").read_text()
        assert f"ExecStart={sys.prefix}/bin/kvwired {role} --config /etc/kvwire/{role}.toml" \
            in unit
        assert (tmp_path / "etc/kvwire" / f"{role}.toml").read_text() == \
            (ROOT / "deploy/config" / f"{role}.toml").read_text()
    edited = tmp_path / "etc/kvwire/receiver.toml"
    edited.write_text('name = "decode-7"\n')
    assert _install(tmp_path, "receiver").returncode == 0
    assert edited.read_text() == 'name = "decode-7"\n'
    assert _install(tmp_path, "nonsense").returncode == 2


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is part of systemd, which Debian always has"
    assert _install(tmp_path).returncode == 0
    units = [str(tmp_path / "etc/systemd/system" / name) for name in UNITS]
    done = subprocess.run([analyze, "verify", *units], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


@pytest.mark.parametrize("name", UNITS)
def test_units_notify_watchdog_memlock_and_harden_without_hiding_verbs(name: str) -> None:
    service = _unit(ROOT / "deploy/systemd" / name)["Service"]
    assert service["Type"] == "notify"
    assert int(service["WatchdogSec"]) > 0
    assert service["LimitMEMLOCK"] == "infinity"
    assert service["Restart"] == "on-failure"
    assert service["RuntimeDirectory"] == "kvwire"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges"):
        assert key in service
    assert service["ProtectSystem"] == "strict"
    families = service["RestrictAddressFamilies"].split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"} <= set(families)
    # PrivateDevices would hide /dev/infiniband; the verbs devices are allowed instead.
    assert "PrivateDevices" not in service
    assert "char-infiniband_verbs rw" in (ROOT / "deploy/systemd" / name).read_text()
    # Stopping waits for the drain (drain_timeout, 10 s by default) and more.
    assert int(service["TimeoutStopSec"]) > 10


# Modules only kvctl's experiments, lab, demos and proxy import (the ctl extra).
BLOCK_CTL = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Blocker())
"""


def test_a_daemon_node_needs_none_of_the_ctl_extra() -> None:
    import tomllib

    from kvctl.cli import CTL_EXTRA

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {dep.split(">")[0].split("=")[0] for dep in project["dependencies"]}
    ctl = {dep.split(">")[0] for dep in project["optional-dependencies"]["ctl"]}
    assert ctl == CTL_EXTRA and not base & CTL_EXTRA
    # Without them, the daemons start and kvctl's node commands parse; a
    # command that needs them says what to install.
    script = BLOCK_CTL.format(blocked=set(CTL_EXTRA)) + """
import kvwired.cli, kvwired.receiver, kvwired.sender
from kvctl.cli import build_parser, main
build_parser().parse_args(["status"])
sys.exit(main(["run", "chunk-sweep", "--socket", "/nonexistent.sock"]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "comes with kvwire's ctl extra" in done.stderr
    assert "pip install 'kvwire[ctl]'" in done.stderr
