"""The RDMA data path: RC queue pairs over RoCE v2 (Soft-RoCE included),
posted to and polled by a compiled core over libibverbs (``_ibv.c``).

What the code must respect (docs/DESIGN.md, "RDMA facts"):

- memlock is checked before the pool is registered (``rdma.check_memlock``);
- the GID is the RoCE v2 entry of the address the control connection uses,
  so data follows the control path's netdev; port state and MTU are checked
  and the path MTU is the smaller active MTU of the two ends;
- every QP transition is followed by a query of the state, and a mismatch is
  an error naming the step and the attributes;
- receives are posted before the peer learns the QP, and one is re-posted for
  every one consumed, before the credit for it goes back;
- receiver-not-ready retries are bounded (``rnr_retry`` 6: 7 is endless), so a
  missing receive is a completion error within seconds; ``retry_cnt`` is 7
  (endless on rxe) and a dead peer is bounded by the link's progress check;
- writes are posted a burst per call into the core, chained into one
  ``ibv_post_send`` (one doorbell), one signalled work request per post
  (and every ``SIGNAL_EVERY``), completions polled in batches;
- completions wake the event loop through the completion channel's file
  descriptor: no thread, no spinning while idle, no polling interval added
  while busy. A wake-up is one call into the core (take the event,
  acknowledge, re-arm, reap);
- pyverbs is not on the data path: its objects hand out no verbs handles
  for compiled code to use. It reads the GID table (``gids``) and serves the
  probe.

Its parts, bottom to top (mirrored by name in ``kvwired.transport.tcp``):
``send_queue`` (I/O-free: which writes go next, which are signalled),
``core`` (the compiled objects), ``device``, ``completions``, ``queue_pair``,
``keys`` (per-lease keys), ``channel`` (the initiator's end), ``responder``
and ``transport``.
"""

from .transport import VerbsTransport

__all__ = ["VerbsTransport"]
