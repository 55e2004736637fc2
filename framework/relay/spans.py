"""The PRODUCER spans of the relay's publishes (docs/explanation/operations.md, "Tracing")."""

from __future__ import annotations

from opentelemetry import trace

from framework import tracing
from framework.confirms.channel import Outgoing


class PublishSpans:
    """The PRODUCER spans of one claimed batch, linked to the contexts its rows were written
    in (docs/explanation/operations.md, "Tracing"). They end with the batch's last confirm, marked
    failed if any publish of it failed. The relay's loop thread owns them."""

    def __init__(self, spans: list[trace.Span], count: int) -> None:
        self._spans = spans
        self._left = count
        self._failures = 0
        self._error = ""

    def done(self, error: str | None) -> None:
        """One publish of the batch is settled; ``error`` if it failed."""
        self._left -= 1
        if error is not None:
            self._failures += 1
            self._error = self._error or error
        if self._left:
            return
        for span in self._spans:
            if self._failures:
                span.set_attribute("txbox.failed", self._failures)
                span.set_status(trace.StatusCode.ERROR, f"{self._failures} failed, first: {self._error}"[:1000])
            span.end()


def publish_spans(service: str, items: list[Outgoing]) -> PublishSpans | None:
    """The publish spans of a batch, or None when nothing records (no work per message then)."""
    spans = tracing.batch_spans(
        f"publish {service}",
        trace.SpanKind.PRODUCER,
        {
            "messaging.system": tracing.MESSAGING_SYSTEM,
            "messaging.operation.type": "publish",
            "messaging.batch.message_count": len(items),
        },
        # The outgoing headers hold the row's carrier, bounded (``outgoing``); a row whose
        # message could not be built has none, and its stored carrier is bounded here.
        (item.properties.headers or tracing.carrier_from(item.token.trace) for item in items),
    )
    return PublishSpans(spans, len(items)) if spans else None
