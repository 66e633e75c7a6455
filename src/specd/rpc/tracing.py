"""OpenTelemetry tracing shared by the three services.

Configured the standard way (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME,
OTEL_TRACES_SAMPLER[_ARG], read by the SDK) plus `--otlp-endpoint` and
`--trace-file` (spans in OTLP JSON, the collector file format, for machines
without a collector). With
neither, `Tracing.enabled` is False and callers create no spans at all, so
tracing off costs nothing.

Round messages carry each sequence's trace context themselves (W3C
traceparent): the gRPC streams live for many rounds, so stream-level
propagation would tie every round to whichever request opened the stream.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


class OtlpJsonFileExporter(SpanExporter):
    """Appends spans to a file in OTLP JSON, the OpenTelemetry collector file exporter's format.

    Each export is one ``ExportTraceServiceRequest`` on one line (ids in hex, enums
    as integers, as the OTLP JSON encoding asks), so a collector's ``otlpjsonfile``
    receiver, Jaeger or Tempo can import the file, and ``specd traces`` reads it. Each
    line is one write() on an O_APPEND descriptor, so the three services of ``specd
    up --trace-file`` can share one file without interleaving lines.
    """

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = json.dumps(otlp_json(spans), separators=(",", ":")) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            os.close(self._fd)


def otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """One ExportTraceServiceRequest in OTLP JSON."""
    request = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for resource_spans in request.get("resourceSpans", []):
        for scope in resource_spans.get("scopeSpans", []):
            for span in scope.get("spans", []):
                _hex_ids(span)
                for link in span.get("links", []):
                    _hex_ids(link)
    return request


def _hex_ids(obj: dict[str, Any]) -> None:
    # Protobuf's JSON writes bytes as base64; OTLP JSON wants trace and span ids in hex.
    for key in ("traceId", "spanId", "parentSpanId"):
        if obj.get(key):
            obj[key] = base64.b64decode(obj[key]).hex()


class Tracing:
    """A service's tracer, or a disabled stand-in when no exporter is configured."""

    def __init__(self, service_name: str, otlp_endpoint: str = "", trace_file: str = "") -> None:
        endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        self.enabled = bool(endpoint or trace_file)
        self._provider: TracerProvider | None = None
        if not self.enabled:
            self.tracer = trace.NoOpTracer()
            return
        name = os.environ.get("OTEL_SERVICE_NAME") or service_name
        # The sampler comes from OTEL_TRACES_SAMPLER[_ARG] (default: parent-based always-on).
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        if trace_file:
            provider.add_span_processor(BatchSpanProcessor(OtlpJsonFileExporter(trace_file)))
        if endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._provider = provider
        self.tracer = provider.get_tracer("specd")

    def start(
        self,
        name: str,
        parent: Span | Context | None = None,
        start_ns: int | None = None,
        attributes: Mapping[str, Any] | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        links: Sequence[Link] = (),
    ) -> Span:
        context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
        return self.tracer.start_span(
            name, context=context, kind=kind, attributes=attributes, start_time=start_ns, links=links
        )

    def record(
        self,
        name: str,
        parent: Span | Context | None,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
    ) -> Span:
        """A span for work already done (engines time their phases; spans are made afterwards)."""
        span = self.start(name, parent, start_ns, attributes)
        span.end(end_time=end_ns)
        return span

    def record_opens(
        self,
        name: str,
        contexts: Sequence[Mapping[str, str]],
        attributes: Sequence[Mapping[str, Any]],
        start_ns: int,
        end_ns: int,
    ) -> None:
        """A span (`<service>.open`) in each traced sequence's request trace for the open that
        prefilled it: its prompt tokens, those it prefilled, and the batch's forward time."""
        for carrier, attrs in zip(contexts, attributes, strict=True):
            parent = self.extract(carrier)
            if parent is not None:
                self.start(name, parent, start_ns, attrs, kind=SpanKind.SERVER).end(end_time=end_ns)

    @staticmethod
    def inject(span: Span) -> dict[str, str]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    @staticmethod
    def extract(carrier: Mapping[str, str]) -> Context | None:
        if not carrier:
            return None
        return _PROPAGATOR.extract(dict(carrier))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
