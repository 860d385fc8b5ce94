"""One request's timeline as OpenTelemetry spans: off unless ``KVWIRE_TRACES`` asks.

A disaggregated request crosses four processes (the proxy, the prefill
engine, the decode engine, and between them the daemons), so no one of them
can say where its time to first token went. Each records its part as spans
of one trace: the proxy starts it and hands its W3C ``traceparent`` on in
``kv_transfer_params`` (``kvwire_trace``) and as the HTTP ``traceparent``
header (so vLLM's own tracing, where it is on, joins the same trace).

``KVWIRE_TRACES`` says where finished spans go:

- unset or empty: nowhere. No span is made and OpenTelemetry is not even
  imported; a call site costs one attribute read and a no-op call.
- a folder: each process appends its spans there as JSON lines, one file
  per process (``SERVICE-PID.jsonl``); kvctl.timeline reads them back.
- ``otlp``: OTLP over HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a collector,
  Jaeger, Tempo ...); needs ``opentelemetry-exporter-otlp-proto-http``.

The tracer is OpenTelemetry's SDK (kvwire's ``trace`` extra); this module only
chooses the exporter and keeps call sites free of ``if tracing`` tests.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

ENV = "KVWIRE_TRACES"
# W3C trace context, version 00: the only form a trace crosses processes in.
_TRACEPARENT = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")

Attribute = str | int | float | bool


class Span(Protocol):
    """What a call site does with a span (OpenTelemetry's, or the null one)."""

    def add_event(self, name: str, attributes: dict[str, Attribute] | None = None
                  ) -> None: ...

    def set_attribute(self, key: str, value: Attribute) -> None: ...

    def end(self) -> None: ...


class _NoSpan:
    """The span of a process that traces nothing: every call does nothing."""

    def add_event(self, name: str, attributes: dict[str, Attribute] | None = None) -> None:
        pass

    def set_attribute(self, key: str, value: Attribute) -> None:
        pass

    def end(self) -> None:
        pass


NO_SPAN: Span = _NoSpan()
_tracer: Tracer | None = None
_lock = threading.Lock()


def is_traceparent(value: object) -> bool:
    """Whether ``value`` is a W3C traceparent this module can continue."""
    return isinstance(value, str) and _TRACEPARENT.match(value) is not None


def configure(service: str, destination: str | None = None) -> bool:
    """This process's tracer, from ``destination`` (default: ``$KVWIRE_TRACES``).

    Once per process: later calls keep the first one's choice (an engine's
    scheduler and worker both configure; a process has one exporter).
    Returns whether spans are recorded."""
    global _tracer
    where = os.environ.get(ENV, "") if destination is None else destination
    with _lock:
        if _tracer is not None or not where:
            return _tracer is not None
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            raise ConfigError(f"{ENV} is set, but OpenTelemetry's SDK is not installed",
                              hint="pip install 'kvwire[trace]' into this environment, "
                                   f"or unset {ENV}") from None

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if where == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError:
                raise ConfigError(f"{ENV}=otlp, but the OTLP exporter is not installed",
                                  hint="pip install opentelemetry-exporter-otlp-proto-http, "
                                       f"or set {ENV} to a folder") from None
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            folder = Path(where)
            if not folder.is_dir():
                raise ConfigError(f"{ENV}={where}: no such folder",
                                  hint="make the folder first, or set it to 'otlp'")
            # Written as each span ends: an engine killed at the end of a run
            # has still written every span it finished.
            provider.add_span_processor(SimpleSpanProcessor(
                _json_lines(folder / f"{service}-{os.getpid()}.jsonl")))
        _tracer = provider.get_tracer("kvwire")
        return True


def recording() -> bool:
    return _tracer is not None


def start(name: str, parent: str | None = None,
          attributes: dict[str, Attribute] | None = None) -> Span:
    """A span begun now, a child of the trace ``parent`` names (a traceparent;
    None or one this module cannot read: a new trace). It ends when ``end``
    is called; nothing is recorded when tracing is off."""
    tracer = _tracer
    if tracer is None:
        return NO_SPAN
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = (TraceContextTextMapPropagator().extract({"traceparent": parent})
               if is_traceparent(parent) else None)
    span: Span = tracer.start_span(name, context=context, attributes=attributes)
    return span


def traceparent(span: Span) -> str | None:
    """``span``'s W3C traceparent, for the next process; None when not traced."""
    if span is NO_SPAN:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(
        carrier, context=trace.set_span_in_context(span))  # type: ignore[arg-type]
    return carrier.get("traceparent")


def fail(span: Span, why: str) -> None:
    """Marks ``span`` failed (OpenTelemetry's error status); its owner ends it."""
    if span is NO_SPAN:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, why))  # type: ignore[attr-defined]


def _json_lines(path: Path) -> SpanExporter:
    """OpenTelemetry's exporter interface over one append-only file (made
    here: the SDK is imported only once tracing is on)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonLines(SpanExporter):
        def __init__(self) -> None:
            # O_APPEND, one write per span: spans ended on several threads
            # never interleave their lines.
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            for span in spans:
                os.write(self._fd, (span.to_json(indent=None) + "\n").encode())
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            os.close(self._fd)

    return JsonLines()
