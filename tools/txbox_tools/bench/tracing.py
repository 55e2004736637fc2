"""`txbox bench e2e --tracing`: spans recorded by the SDK and thrown away.

The daemons (processes of their own) set the SDK up themselves from ``OTEL_*``
(framework/tracing.py) with a BatchSpanProcessor; :data:`EXPORTER` names this module's
exporter, registered in the entry-point group the SDK looks exporters up in, so the
bench measures recording and batching spans, not a collector's speed. Nor an exporter's
encoding: a real OTLP exporter also turns each span into protobuf on the processor's
thread, which this one skips, so ``tracing_ratio`` leaves that cost out
(docs/explanation/operations.md, "Tracing").
"""

from __future__ import annotations

from collections.abc import Sequence

from framework.errors import ConfigurationError

try:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
except ImportError as exc:  # pragma: no cover - the otel extra is part of the development set-up
    raise ConfigurationError("--tracing needs the OpenTelemetry SDK: pip install 'txbox[otel]'") from exc

EXPORTER = "txbox_bench_discard"  # its name in tools/pyproject.toml


class DiscardExporter(SpanExporter):
    """Accepts every batch of spans and keeps nothing (encodes nothing either)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def driver_provider() -> TracerProvider:
    """The bench process's own provider (its business spans), shaped as the daemons' are."""
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(DiscardExporter()))
    return provider
