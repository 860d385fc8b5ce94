"""Where the registry is: ``discovery = "etcd://HOST:PORT/CLUSTER"``.

Kept apart from the etcd client so that reading a configuration never
imports gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import ConfigError


@dataclass(frozen=True)
class RegistryAddress:
    host: str
    port: int
    cluster: str

    @classmethod
    def parse(cls, url: str) -> RegistryAddress:
        """``etcd://HOST:PORT/CLUSTER`` (port 2379 when left out)."""
        parts = urlsplit(url)
        cluster = parts.path.strip("/")
        try:
            port = parts.port or 2379
        except ValueError:
            port = -1
        if (parts.scheme != "etcd" or not parts.hostname or port <= 0 or not cluster
                or "/" in cluster or parts.query or parts.fragment):
            raise ConfigError(f"discovery {url!r} is not etcd://HOST:PORT/CLUSTER",
                              hint="e.g. discovery = \"etcd://10.0.0.5:2379/prod\"; leave it "
                                   "empty to use [peers] only")
        return cls(parts.hostname, port, cluster)

    @property
    def prefix(self) -> bytes:
        return f"/kvwire/{self.cluster}/receivers/".encode()

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def name_of(self, key: bytes) -> str:
        """The receiver's name in a key under ``prefix``."""
        return key[len(self.prefix):].decode(errors="replace")

    def __str__(self) -> str:
        return f"etcd://{self.host}:{self.port}/{self.cluster}"
