"""kvwire: move LLM KV cache between prefill and decode nodes over RDMA."""

import sys

__version__ = "0.1.0"

# structlog imports rich, wherever rich is installed (kvctl's extra brings
# it), for console tracebacks that kvwire never shows: kvwired.logs formats
# exceptions before any renderer sees them. On the lab's emulated nodes that
# import was 2.5 of the 7 s a daemon or a `kvctl push` spent before its first
# line of its own; on a host, half of structlog's import. So structlog is
# imported here, once, with rich hidden from it; rich stays importable for
# what does use it (kvctl's progress bars and tables).
if "structlog" not in sys.modules and "rich" not in sys.modules:
    sys.modules["rich"] = None  # type: ignore[assignment]  # import rich -> ImportError
    try:
        import structlog  # noqa: F401
    finally:
        del sys.modules["rich"]
