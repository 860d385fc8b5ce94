"""One-sided write semantics over a TCP stream: the baseline and the fallback.

The responder checks every write against what its key grants (a lease's
range on the receiver, the whole region on a sender answering an echo), as
an RDMA NIC checks an rkey against a memory window, and lands the payload in
the pool. A signalled write is acknowledged once placed, which is the
initiator's completion.

Its parts, bottom to top (mirrored by name in ``kvwired.transport.verbs``):
``frames`` (the 32-byte header and its one decoder, I/O-free),
``write_receiver`` (I/O-free: a connection's bytes in, landed and refused
writes out), ``keys`` (per-lease keys), ``socket_options``, ``channel``
(the initiator's end), ``responder`` and ``transport``.
"""

from .transport import TcpTransport

__all__ = ["TcpTransport"]
