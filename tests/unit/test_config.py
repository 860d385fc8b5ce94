from __future__ import annotations

from pathlib import Path

import pytest

from kvwired.addresses import DEFAULT_CONTROL_PORT, parse_address
from kvwired.cli import build_parser
from kvwired.config import ReceiverConfig, SenderConfig, load
from kvwired.errors import ConfigError
from kvwired.units import format_size, parse_size


def test_sizes() -> None:
    assert parse_size("512") == 512
    assert parse_size("12KiB") == 12288
    assert parse_size("2 MiB") == 2 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("1MB") == 1_000_000
    assert format_size(48 << 20) == "48 MiB"
    assert format_size(512) == "512 B"
    with pytest.raises(ConfigError, match="KiB"):
        parse_size("12 parsecs")


def test_addresses() -> None:
    assert parse_address("10.0.0.2:7000", 1) == ("10.0.0.2", 7000)
    assert parse_address("decode", DEFAULT_CONTROL_PORT) == ("decode", 7471)
    assert parse_address("[::1]:9", 1) == ("::1", 9)
    with pytest.raises(ConfigError):
        parse_address("host:99999", 1)


def test_toml_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "sender.toml"
    config.write_text('name = "p1"\nstaging_size = "64MiB"\nchunk = "per-layer"\n'
                      '[peers]\ndecode = "10.1.1.1:7471"\n')
    args = build_parser().parse_args(
        ["sender", "--config", str(config), "--chunk", "4KiB", "--peer", "other=10.1.1.2"])
    loaded = load(SenderConfig, args)
    assert loaded.name == "p1"
    assert loaded.staging_size == 64 << 20
    assert loaded.chunk_bytes == 4096  # the flag wins over the file
    assert loaded.peers == {"decode": "10.1.1.1:7471", "other": "10.1.1.2"}


def test_defaults_without_file() -> None:
    loaded = load(ReceiverConfig, build_parser().parse_args(["receiver"]))
    assert loaded.pool_size == 256 << 20
    assert loaded.listen == "0.0.0.0:7471"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pool_sise = 1\n", "unknown config key"),
        ('pool_size = "lots"\n', "cannot read"),
        ("credits = 0\n", "credits"),
        ('transport = "carrier-pigeon"\n', "unknown transport"),
        ("name = [\n", "not valid TOML"),
        ('discovery = "etcd://10.0.0.5:2379"\n', "etcd://HOST:PORT/CLUSTER"),
        ('discovery = "http://10.0.0.5:2379/prod"\n', "etcd://HOST:PORT/CLUSTER"),
        # Senders could not dial "0.0.0.0": the registry needs a real address.
        ('discovery = "etcd://10.0.0.5/prod"\nlisten = "0.0.0.0:7471"\n', "advertise"),
    ],
)
def test_config_mistakes_are_explained(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "receiver.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(ReceiverConfig, path=str(config))


def test_a_receiver_in_a_registry_advertises_a_dialable_address() -> None:
    config = load(ReceiverConfig, path=None)
    config.discovery, config.listen = "etcd://e/prod", "10.0.0.2:7471"
    assert config.advertised_control() == "10.0.0.2:7471"
    config.listen, config.advertise = "0.0.0.0:7471", "10.0.0.3:7000"
    assert config.advertised_control() == "10.0.0.3:7000"


def test_bad_peer_flag() -> None:
    args = build_parser().parse_args(["sender", "--peer", "nameless"])
    with pytest.raises(ConfigError, match="NAME=HOST:PORT"):
        load(SenderConfig, args)


def test_help_documents_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["receiver", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for key in ("pool_size", "listen", "socket", "lease_wait", "credits", "metrics"):
        assert f"TOML: {key}" in text


def test_shipped_example_configs_load() -> None:
    root = Path(__file__).resolve().parents[2] / "deploy" / "config"
    receiver = load(ReceiverConfig, path=str(root / "receiver.toml"))
    sender = load(SenderConfig, path=str(root / "sender.toml"))
    assert receiver.pool_size == 256 << 20
    assert sender.chunk_bytes == 12288
    assert "decode-0" in sender.peers


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("qps_per_peer = 0\n", r"qps_per_peer 0 is outside 1\.\.16"),
        ("qps_per_peer = 17\n", r"qps_per_peer 17 is outside 1\.\.16"),
        ('rails = ["auto", "mlx5_0"]\nqps_per_peer = 2\n', "auto stands alone"),
        ('rails = ["rxe0"]\ntransport = "tcp"\n', "transport is tcp"),
        ('rails = ["rxe0", "rxe1"]\n', "2 rails but qps_per_peer = 1"),
    ],
)
def test_channel_and_rail_mistakes_are_explained(tmp_path: Path, text: str,
                                                 message: str) -> None:
    config = tmp_path / "sender.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(SenderConfig, path=str(config))


def test_rails_as_a_list_or_a_flag(tmp_path: Path) -> None:
    config = tmp_path / "sender.toml"
    config.write_text('rails = ["rxe0", "rxe1"]\nqps_per_peer = 4\n')
    loaded = load(SenderConfig, path=str(config))
    assert (loaded.rails, loaded.qps_per_peer, loaded.rail_devices()) == (
        ["rxe0", "rxe1"], 4, ["rxe0", "rxe1"])
    args = build_parser().parse_args(["sender", "--rails", "rxe0,rxe1", "--qps-per-peer", "2"])
    assert load(SenderConfig, args).rails == ["rxe0", "rxe1"]
    assert load(SenderConfig).rails == [] and load(SenderConfig).qps_per_peer == 1


def test_configs_written_by_kvctl_keep_their_lists(tmp_path: Path) -> None:
    from kvctl.netns import write_toml

    write_toml(tmp_path / "sender.toml", {"rails": ["rxe0", "rxe1"], "qps_per_peer": 2,
                                          "peers": {"decode": "10.0.0.2:7471"}})
    loaded = load(SenderConfig, path=str(tmp_path / "sender.toml"))
    assert loaded.rails == ["rxe0", "rxe1"] and loaded.peers == {"decode": "10.0.0.2:7471"}
