"""Experiments that run inside the data path they measure (``kvctl run``).

- ``chunk_sweep``: latency, bandwidth and 48 MiB delivery per write size,
  run by the sender daemon;
- ``echo``: the ping-pong it measures latency with (both daemons' sides);
- ``perftest``: ib_write_lat/ib_write_bw on the same link, as the baseline;
- ``spec``: the parameters kvctl sends, shared with kvctl.

The daemons import nothing from here: ``kvwired.cli`` hands them the
experiments at wiring time, and the experiments use the daemons only through the
protocols in ``host``.
"""

