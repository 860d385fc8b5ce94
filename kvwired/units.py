"""Byte sizes as people write them ("2MiB", "512", "48 MiB") and back; durations ("0.6ms")."""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse "512", "12KiB", "2 MiB", "1.5GiB" into bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(
            f"cannot read {text!r} as a size",
            hint="write a number of bytes, optionally with B, KiB, MiB, GiB, KB, MB or GB",
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """Binary-prefixed size, exact where it can be ("12 KiB", "48 MiB", "1000 B")."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)?\s*$")
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_seconds(text: str | float) -> float:
    """Parse "0.6ms", "600us", "2s" or a bare number of seconds."""
    if isinstance(text, int | float):
        return float(text)
    match = _DURATION.match(text)
    if not match:
        raise ConfigError(f"cannot read {text!r} as a duration",
                          hint="write seconds, optionally with s, ms, us or ns")
    return float(match.group(1)) * _SECONDS[match.group(2) or "s"]


def format_clock(seconds: float) -> str:
    """A duration as a clock reads: ``75`` -> ``1:15``; ``3725`` -> ``1:02:05``."""
    whole = round(max(0.0, seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"
