"""The sender daemon (prefill node), along its seams.

- ``link``: one receiver, wired from its parts below it: ``rails``, ``ledger``,
  ``credits``, ``requests``, ``holders``, ``dial`` and ``channels``.
- ``push``: one request: its state, and the driver that turns commits into writes.
- ``engines``: the unix API prefill engines (and ``kvctl run``) speak.
- ``daemon``: the wiring, life cycle and metrics.
"""

from .daemon import Experiment, Report, SenderDaemon

__all__ = ["Experiment", "Report", "SenderDaemon"]
