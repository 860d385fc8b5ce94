"""Data paths behind one interface (see ``base``): ``tcp`` now, ``verbs`` next."""

from __future__ import annotations

from .base import DataChannel, Initiator, RemoteRegion, Responder, Transport, Write

__all__ = ["DataChannel", "Initiator", "RemoteRegion", "Responder", "Transport", "Write"]
