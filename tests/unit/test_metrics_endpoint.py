"""The daemons' scrape endpoint: it serves the registry, starts without a
resolver, and a taken port is a clear error."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from kvwired.addresses import free_port
from kvwired.errors import ConfigError
from kvwired.metrics import Metrics


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        body: bytes = response.read()
    return body.decode()


def test_the_endpoint_serves_the_daemons_registry_and_logs_no_scrape(
        capfd: pytest.CaptureFixture[str]) -> None:
    metrics = Metrics("receiver")
    port = metrics.serve("127.0.0.1", free_port())
    page = scrape(f"http://127.0.0.1:{port}/metrics")
    assert 'kvwire_build_info{role="receiver"' in page
    # http.server writes a line per request to stderr unless told not to.
    assert capfd.readouterr().err == ""


def test_binding_asks_no_resolver_for_the_name_of_its_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # http.server's own bind looks the address up (socket.getfqdn); on a node
    # whose resolver cannot be reached that took 10 s before a daemon started.
    def no_resolver(*_: object) -> str:
        raise AssertionError("the metrics endpoint asked DNS for a name")

    monkeypatch.setattr(socket, "getfqdn", no_resolver)
    monkeypatch.setattr(socket, "gethostbyaddr", no_resolver)
    port = Metrics("sender").serve("0.0.0.0", free_port())
    assert "kvwire_build_info" in scrape(f"http://127.0.0.1:{port}/metrics")


def test_an_ipv6_listen_address_is_served() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    port = Metrics("sender").serve("::1", free_port())
    assert "kvwire_build_info" in scrape(f"http://[::1]:{port}/metrics")


def test_a_taken_port_says_how_to_pick_another() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError, match="cannot serve metrics") as caught:
            Metrics("receiver").serve("127.0.0.1", port)
    assert "--metrics HOST:PORT" in str(caught.value)
