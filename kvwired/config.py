"""Daemon configuration: a TOML file, every key also settable by a flag.

The dataclasses below are the single source of truth: their fields are the
TOML keys, the flags (``pool_size`` -> ``--pool-size``) and the ``--help``
text, so the three cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import stripes
from .addresses import (
    DEFAULT_CONTROL_PORT,
    DEFAULT_DATA_PORT,
    RECEIVER_METRICS_PORT,
    SENDER_METRICS_PORT,
    control_address,
    parse_address,
)
from .discovery.address import RegistryAddress
from .errors import ConfigError
from .layout import resolve_chunk_bytes
from .rdma import active_roce_devices
from .units import parse_size


def _opt(default: Any, help: str, kind: str = "") -> Any:
    return field(default=default, metadata={"help": help, "kind": kind})


@dataclass
class CommonConfig:
    name: str = _opt("", "name of this node, shown to peers and in metrics")
    transport: str = _opt(
        "auto", "data path: verbs (RDMA, RoCE v2), tcp, or auto (verbs where an RDMA "
        "device exists)")
    rdma_device: str = _opt("", "verbs: RDMA device (default: the one whose RoCE v2 GID "
                            "holds the control connection's address)")
    gid_index: int = _opt(-1, "verbs: GID table index to use (default -1: chosen by address)")
    poll_spin_us: float = _opt(
        0.0, "verbs: keep polling completions this long after activity before sleeping on "
        "the completion channel (0: never spin; see benchmarks/completion_path.py)")
    ack_timeout: int = _opt(
        14, "verbs: local ACK timeout of the queue pairs, 4.096 us x 2^n before an "
        "unacknowledged write is sent again (14: 67 ms). rdma_rxe recovers lost packets by "
        "this timer, so a lossy Soft-RoCE wire wants 12 (17 ms); hardware recovers them "
        "at once and keeps 14 or more")
    metrics: str = _opt(
        f"127.0.0.1:{RECEIVER_METRICS_PORT}",
        "host:port of the Prometheus endpoint (port 0: disabled)"
    )
    heartbeat: float = _opt(
        1.0, "seconds between control-connection pings; 4 missed pings drop the peer, and "
        "a data channel whose pending writes see no completion for 4 heartbeats is stalled"
    )
    drain_timeout: float = _opt(
        10.0, "on SIGTERM, seconds to let requests in flight finish before they are failed")
    auth: str = _opt(
        "tls", "tls: mutual TLS under the cluster CA (credentials from `kvctl keys`); none: "
        "no authentication, anyone who reaches the ports can lease and write the pool")
    tls_dir: str = _opt("/etc/kvwire/tls", "auth = tls: the directory holding ca.crt, "
                        "node.crt and node.key (re-read on SIGHUP)")
    handshake_timeout: float = _opt(
        10.0, "seconds a connection may take to authenticate (TLS, hello) before it is "
        "closed and counted in kvwire_auth_failures_total")
    discovery: str = _opt(
        "", "etcd://HOST:PORT/CLUSTER: receivers announce themselves there and senders "
        "find them there, beside [peers]; empty: [peers] only, no registry")
    log_level: str = _opt("info", "debug, info, warning or error")
    log_format: str = _opt("auto", "json, console, or auto (console on a terminal)")


@dataclass
class ReceiverConfig(CommonConfig):
    name: str = _opt("decode", "name of this node, shown to peers and in metrics")
    listen: str = _opt(f"0.0.0.0:{DEFAULT_CONTROL_PORT}",
                       "host:port of the control listener for senders")
    advertise: str = _opt(
        "", "with discovery: HOST:PORT senders dial for this receiver (default: listen, "
        "which must then name an address, not 0.0.0.0)")
    data_port: int = _opt(DEFAULT_DATA_PORT, "TCP transport: port of the data listener (0: any)")
    socket: str = _opt("/run/kvwire/receiver.sock", "unix socket for decode engines")
    pool_size: int = _opt(256 << 20, "receive pool size (e.g. 256MiB)", "size")
    lease_wait: float = _opt(
        5.0, "seconds a request waits for pool room before it is refused as pool full"
    )
    credits: int = _opt(
        64, "layer announcements (immediates) one sender may have in flight: the receive "
        "queue depth per sender")
    unclaimed_ttl: float = _opt(
        300.0, "seconds a delivered request waits for a decode engine to subscribe before "
        "it is reclaimed (an engine that disconnects frees what it held at once)")
    senders: list[str] = _opt(
        None, "names of the senders this receiver accepts, as in their certificates "
        "(comma-separated as a flag); empty: every sender of the cluster CA", "names")
    sender_quota: str = _opt(
        "100%", "the most of the pool one sender may hold at once: a share (50%) or a size "
        "(128MiB); over it, that sender's requests wait and then get pool full")
    metrics: str = _opt(f"127.0.0.1:{RECEIVER_METRICS_PORT}",
                        "host:port of the Prometheus endpoint (port 0: off)")

    def __post_init__(self) -> None:
        if self.senders is None:
            self.senders = []

    def advertised_control(self, bound_port: int = 0) -> str:
        """HOST:PORT the registry tells senders to dial for this receiver
        (``bound_port``: the port the control listener got, for ``listen`` port 0)."""
        host, port = control_address(self.advertise or self.listen)
        if not self.advertise and bound_port:
            port = bound_port
        if host in ("", "0.0.0.0", "::"):
            raise ConfigError(
                f"discovery needs an address senders can dial, and listen {self.listen!r} "
                "is every address", hint="set advertise = \"HOST:PORT\" (this node's address "
                "on the data network), or listen on that address")
        return f"{host}:{port}"

    def quota_bytes(self) -> int:
        """``sender_quota`` in bytes of this pool."""
        text = self.sender_quota.strip()
        if text.endswith("%"):
            try:
                share = float(text[:-1])
            except ValueError:
                share = float("nan")
            if not 0 < share <= 100:
                raise ConfigError(f"sender_quota {text!r} is not a share in (0, 100]%")
            return int(self.pool_size * share / 100)
        size = parse_size(text)
        if size <= 0:
            raise ConfigError("sender_quota must be positive")
        return size


@dataclass
class SenderConfig(CommonConfig):
    name: str = _opt("prefill", "name of this node, shown to peers and in metrics")
    socket: str = _opt("/run/kvwire/sender.sock", "unix socket for prefill engines")
    staging_size: int = _opt(256 << 20, "staging pool size (e.g. 256MiB)", "size")
    staging_wait: float = _opt(5.0, "seconds an open waits for staging room")
    chunk: str = _opt(
        "per-token",
        "default write size: per-token-per-layer, per-token, per-layer, whole or bytes",
    )
    connect_timeout: float = _opt(5.0, "seconds to reach a receiver before giving up")
    delivery_timeout: float = _opt(
        10.0, "seconds a receiver may take to confirm a request whose writes all landed")
    peers: dict[str, str] = _opt(
        None, "receivers by name: NAME=HOST:PORT (repeat the flag for more)", "peers"
    )
    metrics: str = _opt(f"127.0.0.1:{SENDER_METRICS_PORT}",
                        "host:port of the Prometheus endpoint (port 0: off)")
    qps_per_peer: int = _opt(
        1, "data channels (RC queue pairs, or TCP streams) to each receiver; a push's "
        "chunks are striped over them")
    rails: list[str] = _opt(
        None, "RDMA devices (rails) the data channels are spread over, channel i on rail "
        "i mod n (comma-separated as a flag); auto: every device with an active RoCE v2 "
        "port; empty: the device of the control connection's address", "names")

    def __post_init__(self) -> None:
        if self.peers is None:
            self.peers = {}
        if self.rails is None:
            self.rails = []

    def rail_devices(self) -> list[str]:
        """The rails as device names (``auto`` read off sysfs now); [] for none."""
        if self.rails == ["auto"]:
            found = active_roce_devices()
            if not found:
                raise ConfigError("rails = auto, but no device has an active RoCE v2 port",
                                  hint="`kvctl probe` lists the devices; or leave rails empty")
            return found
        return list(self.rails)

    @property
    def chunk_bytes(self) -> int:
        return resolve_chunk_bytes(self.chunk)


def add_flags(parser: argparse.ArgumentParser, cls: type[CommonConfig]) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of the keys below")
    for f in dataclasses.fields(cls):
        kind = f.metadata.get("kind", "")
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} [TOML: {f.name}; default: {_show(f)}]"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        if kind == "peers":
            parser.add_argument(flag[:-1], dest=f.name, action="append", metavar="NAME=ADDR",
                                help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, metavar=f.name.upper(), help=help_text)


def _show(f: dataclasses.Field[Any]) -> str:
    if f.metadata.get("kind") == "size":
        from .units import format_size

        return format_size(int(str(f.default)))
    return "none" if f.default is None else str(f.default)


def load(cls: type[CommonConfig], args: argparse.Namespace | None = None,
         path: str | None = None) -> Any:
    """Defaults, overlaid by the TOML file, overlaid by flags."""
    values: dict[str, Any] = {}
    file = path or (getattr(args, "config", None) if args else None)
    if file:
        try:
            values.update(tomllib.loads(Path(file).read_text()))
        except OSError as exc:
            raise ConfigError(f"cannot read config {file}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {file} is not valid TOML: {exc}") from exc
    if args is not None:
        for f in dataclasses.fields(cls):
            flag_value = getattr(args, f.name, None)
            if flag_value is None:
                continue
            if f.metadata.get("kind") == "peers":
                peers = dict(values.get("peers") or {})
                for item in flag_value:
                    name, sep, address = item.partition("=")
                    if not sep or not name:
                        raise ConfigError(f"--peer {item!r} is not NAME=HOST:PORT")
                    peers[name] = address
                values["peers"] = peers
            else:
                values[f.name] = flag_value
    return build(cls, values)


def build(cls: type[CommonConfig], values: dict[str, Any]) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config key(s): {', '.join(unknown)}",
            hint=f"known keys: {', '.join(sorted(known))}",
        )
    converted: dict[str, Any] = {}
    for name, value in values.items():
        converted[name] = _convert(known[name], value)
    config = cls(**converted)
    _check(config)
    return config


def _convert(f: dataclasses.Field[Any], value: Any) -> Any:
    kind = f.metadata.get("kind", "")
    try:
        if kind == "size":
            return parse_size(value)
        if kind == "names":
            names = value.split(",") if isinstance(value, str) else value
            if not isinstance(names, list):
                raise ConfigError(f"{f.name} must be a list of names")
            return [str(name).strip() for name in names if str(name).strip()]
        if kind == "peers":
            if not isinstance(value, dict):
                raise ConfigError("peers must be a table of NAME = \"HOST:PORT\"")
            return {str(k): str(v) for k, v in value.items()}
        if f.type in ("int", int):
            return int(value)
        if f.type in ("float", float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config key {f.name}: cannot read {value!r} as {f.type}") from None


def _check(config: CommonConfig) -> None:
    if config.transport not in ("auto", "verbs", "tcp"):
        raise ConfigError(
            f"unknown transport {config.transport!r}", hint="use verbs, tcp or auto"
        )
    if config.log_format not in ("auto", "json", "console"):
        raise ConfigError(f"log_format {config.log_format!r}: use auto, json or console")
    if config.drain_timeout < 0:
        raise ConfigError("drain_timeout must not be negative")
    if not config.handshake_timeout > 0:
        raise ConfigError("handshake_timeout must be a positive number of seconds")
    if config.heartbeat <= 0:
        raise ConfigError("heartbeat must be a positive number of seconds")
    if not 1 <= config.ack_timeout <= 31:
        raise ConfigError(f"ack_timeout {config.ack_timeout} is not an exponent in 1..31",
                          hint="the ACK timeout is 4.096 us x 2^ack_timeout: 14 is 67 ms")
    parse_address(config.metrics, 0)
    if config.auth not in ("tls", "none"):
        raise ConfigError(f"auth {config.auth!r}: use tls or none")
    if config.discovery:
        RegistryAddress.parse(config.discovery)
    if isinstance(config, ReceiverConfig):
        config.quota_bytes()
        control_address(config.listen)
        if config.credits < 1:
            raise ConfigError("credits must be at least 1")
        if not config.unclaimed_ttl > 0:
            raise ConfigError("unclaimed_ttl must be a positive number of seconds")
        if config.discovery:
            config.advertised_control()
    if isinstance(config, SenderConfig):
        config.chunk_bytes  # noqa: B018  (validates the granularity)
        if "auto" in config.rails and config.rails != ["auto"]:
            raise ConfigError(f"rails {config.rails}: auto stands alone",
                              hint='rails = ["auto"], or name the devices: ["mlx5_0", "mlx5_1"]')
        if config.rails and config.transport == "tcp":
            raise ConfigError("rails are RDMA devices, and this sender's transport is tcp",
                              hint="remove rails, or use transport = \"verbs\"")
        if len(config.rails) > config.qps_per_peer and config.rails != ["auto"]:
            raise ConfigError(
                f"{len(config.rails)} rails but qps_per_peer = {config.qps_per_peer}: "
                "some rails would carry nothing",
                hint=f"set qps_per_peer to at least {len(config.rails)} (a multiple of it "
                     "spreads the channels evenly)")
        if not 1 <= config.qps_per_peer <= stripes.MAX_CHANNELS:
            raise ConfigError(
                f"qps_per_peer {config.qps_per_peer} is outside 1..{stripes.MAX_CHANNELS}",
                hint="1 (the default) for one queue pair per receiver; more stripe each push")
        for name, address in config.peers.items():
            control_address(address)
            if not name:
                raise ConfigError("a peer needs a name")
