"""W3C trace context across the outbox, the broker and the inbox (docs/explanation/operations.md, "Tracing").

Built on the OpenTelemetry API alone: without an SDK its spans record nothing, yet a
context that came in still goes out (the API's no-op spans carry their parent's ids), so
a traced sender's trace survives an untraced txbox. With the SDK (the ``otel`` extra)
:func:`setup` makes the daemons record and export spans, configured from ``OTEL_*``.

The trace context travels as a carrier: a dict holding ``traceparent`` and, if any,
``tracestate``, stored as ``metadata->'trace'`` of outbox and inbox rows and sent as the
AMQP headers of those names.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from importlib import metadata as importlib_metadata
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from framework import names, redaction
from framework.errors import ConfigurationError

# The W3C propagator itself rather than the global one: the headers are fixed by name
# whatever OTEL_PROPAGATORS says (docs/explanation/operations.md, "Tracing").
_W3C = TraceContextTextMapPropagator()

# A version-00 traceparent has 55 characters; later versions may only append fields.
MAX_TRACEPARENT_CHARS = 256
# W3C asks to pass on at least 512 characters of tracestate; a longer one is dropped whole
# (cutting it could split a member), and the propagator never parses more than this.
MAX_TRACESTATE_CHARS = 1024

MESSAGING_SYSTEM = "rabbitmq"

# The SDK keeps at most this many links per span (OTEL_SPAN_LINK_COUNT_LIMIT, 128 by
# default) and drops the rest: a batch covering more traces gets one span per this many.
MAX_LINKS = 128

TRACER_NAME = "txbox"
tracer = trace.get_tracer(TRACER_NAME)

Carrier = dict[str, str]


def carrier_from(headers: Mapping[str, Any] | None) -> Carrier:
    """The trace headers of ``headers`` (AMQP headers, or a stored carrier) fit to parse.

    Anything else is dropped here: values that are not text, or longer than the limits,
    so the propagator only ever sees bounded strings; a malformed value it ignores itself.
    """
    out: Carrier = {}
    # Every delivery and every claimed row passes here, most with no headers or no trace:
    # a plain dict skips the abstract-class check.
    if type(headers) is dict:
        if not headers:
            return out
    elif not isinstance(headers, Mapping):
        return out
    parent = headers.get(names.HEADER_TRACEPARENT)
    if not (isinstance(parent, str) and len(parent) <= MAX_TRACEPARENT_CHARS):
        return out
    out[names.HEADER_TRACEPARENT] = parent
    state = headers.get(names.HEADER_TRACESTATE)
    # Printable ASCII only, as W3C allows: the SDK logs a member it cannot parse, and a
    # sender's line breaks must not reach our logs.
    if isinstance(state, str) and 0 < len(state) <= MAX_TRACESTATE_CHARS and state.isascii() and state.isprintable():
        out[names.HEADER_TRACESTATE] = state
    return out


def extract(headers: Mapping[str, Any] | None) -> Context:
    """The context whose span is the remote parent in ``headers`` (an empty context if none is valid)."""
    # Once per handler run: a stored carrier without tracestate (what a traced txbox
    # writes) needs no checked copy, only its traceparent's bound.
    if type(headers) is dict and len(headers) == 1:
        parent = headers.get(names.HEADER_TRACEPARENT)
        if type(parent) is str and len(parent) <= MAX_TRACEPARENT_CHARS:
            return _remote(parent, None)
    carrier = carrier_from(headers)
    if not carrier:
        return Context()
    return _remote(carrier[names.HEADER_TRACEPARENT], carrier.get(names.HEADER_TRACESTATE))


# Parsed contexts, by their header text: a business transaction's rows share their
# writer's context, so a worker meets the same one for a whole batch of messages, and
# parsing it is most of what making it current costs (docs/explanation/operations.md, "Tracing").
# A Context is immutable, so one object serves every message that carries the same text.
@functools.lru_cache(maxsize=256)
def _remote(traceparent: str, tracestate: str | None) -> Context:
    context = _parse(traceparent, tracestate)
    if context is None:
        return Context()
    return trace.set_span_in_context(trace.NonRecordingSpan(context), Context())


# The common form of a traceparent, version 00 exactly, read here; any other text (later
# versions, surrounding blanks, garbage) is left to the W3C propagator and its rules.
_VERSION_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def _parse(traceparent: str, tracestate: str | None) -> trace.SpanContext | None:
    """The remote span context the headers give, as the W3C propagator reads it; None if invalid.

    Most of the propagator's cost is its Context and span around the ids, which a batch's
    link does not need: the version-00 form is read directly, anything else by it.
    """
    match = _VERSION_00.fullmatch(traceparent)
    if match is None:
        carrier = {names.HEADER_TRACEPARENT: traceparent}
        if tracestate is not None:
            carrier[names.HEADER_TRACESTATE] = tracestate
        parsed = trace.get_current_span(_W3C.extract(carrier, context=Context())).get_span_context()
        return parsed if parsed.is_valid else None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    # A carrier's tracestate (MAX_TRACESTATE_CHARS at most) is within the propagator's limit.
    state = None if tracestate is None else trace.TraceState.from_header([tracestate])
    return trace.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(int(match[3], 16)), trace_state=state
    )


# The last span :func:`current` formatted and its carrier: a business transaction writes
# many rows under one span, and formatting its context once is enough.
_last_current: tuple[trace.SpanContext, Carrier] | None = None


def current() -> Carrier | None:
    """The carrier of the current span, or None when there is none (what an outbox row keeps)."""
    global _last_current
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    last = _last_current  # one read: other threads replace it whole
    if last is not None and last[0] is context:
        return dict(last[1])
    carrier = _format(context)
    _last_current = (context, carrier)
    return dict(carrier)


def _format(context: trace.SpanContext) -> Carrier:
    """The W3C carrier of a valid ``context``: what the propagator's ``inject`` writes,
    without the Context and the span it would need wrapped around it (a handler's every
    message is written under a span of its own, so this runs once per handler run)."""
    carrier: Carrier = {
        names.HEADER_TRACEPARENT: f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    }
    if context.trace_state:
        carrier[names.HEADER_TRACESTATE] = context.trace_state.to_header()
    return carrier


def recording() -> bool:
    """A tracer provider is set, so spans may record. Without one every span is the API's
    no-op, and a hot path may skip building it: making the incoming context current is
    all such a span does (docs/explanation/operations.md, "Tracing")."""
    return recording_tracer() is not None


# The set provider's own tracer, and that provider: ``tracer`` is the API's proxy, which
# forwards every call through a property and ``*args, **kwargs``; a per-message span
# asks the provider's tracer directly.
_provider_tracer: tuple[trace.TracerProvider, trace.Tracer] | None = None


def recording_tracer() -> trace.Tracer | None:
    """The set provider's tracer (what :data:`tracer` forwards to), or None when no
    provider is set and nothing records (see :func:`recording`)."""
    global _provider_tracer
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    known = _provider_tracer  # one read: other threads replace it whole
    if known is None or known[0] is not provider:
        known = (provider, provider.get_tracer(TRACER_NAME))
        _provider_tracer = known
    return known[1]


def failed(span: trace.Span, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc``; never raises, and the text is redacted and bounded.

    An exception's ``__str__`` is a handler's code and may fail, and its text may carry a
    secret (docs/explanation/operations.md, "Secrets"): spans leave the process with the exporter.
    """
    try:
        text = str(exc)
    except Exception:
        text = ""
    description = f"{type(exc).__name__}: {redaction.redact_text(text)}" if text else type(exc).__name__
    span.set_attribute("exception.type", type(exc).__name__)
    span.set_status(trace.StatusCode.ERROR, description[:1000])


def distinct_contexts(carriers: Iterable[Mapping[str, Any] | None]) -> Iterator[trace.SpanContext]:
    """The distinct valid contexts among ``carriers``, in order: each carrier a
    :func:`carrier_from` result (or headers holding one's values, as the relay's outgoing
    headers do), so not checked again here.

    Each distinct ``traceparent`` is parsed once: the rows of one business transaction
    share their writer's context, and one link to it says all there is to say. Lazy, so
    a caller that stops early has read no further.
    """
    seen: set[tuple[str, str | None]] = set()
    for carrier in carriers:
        if not carrier:
            continue
        parent = carrier.get(names.HEADER_TRACEPARENT)
        if parent is None:
            continue
        key = (parent, carrier.get(names.HEADER_TRACESTATE))
        if key in seen:
            continue
        seen.add(key)
        context = _parse(*key)
        if context is not None:
            yield context


def _batch_tracer() -> trace.Tracer | None:
    """What starts batch spans: :data:`tracer`'s provider's own tracer (the proxy forwards
    to it), None if nothing can record."""
    if isinstance(tracer, trace.ProxyTracer):
        return recording_tracer()
    return None if isinstance(tracer, trace.NoOpTracer) else tracer  # a test's own tracer


def batch_spans(
    name: str,
    kind: trace.SpanKind,
    attributes: dict[str, Any],
    carriers: Iterable[Mapping[str, Any] | None],
) -> list[trace.Span]:
    """The spans of one batch that covers many traces, linked to each distinct context of
    ``carriers`` (:func:`carrier_from` results, see :func:`distinct_contexts`;
    docs/explanation/operations.md, "Tracing"); the caller ends them.

    One span per :data:`MAX_LINKS` contexts (at least one), so no link is built that the
    SDK would drop. Each is given its links at start, as the OpenTelemetry specification
    prefers (the sampler sees them; adding them one by one afterwards costs the SDK more
    per link: docs/explanation/operations.md, "Tracing"). An empty list when nothing records: with
    no SDK not one carrier is looked at; when the sampler says no to the first span, they
    were read only as far as that span's links.
    """
    active = _batch_tracer()
    if active is None:
        return []
    contexts = distinct_contexts(carriers)
    links = [trace.Link(context) for context in itertools.islice(contexts, MAX_LINKS)]
    first = active.start_span(name, kind=kind, attributes=attributes, links=links)
    if not first.is_recording():
        return []
    spans = [first]
    while len(links) == MAX_LINKS:
        links = [trace.Link(context) for context in itertools.islice(contexts, MAX_LINKS)]
        if links:
            spans.append(active.start_span(name, kind=kind, attributes=attributes, links=links))
    return spans


class CurrentSpan:
    """Makes ``span`` current while the ``with`` block runs, and ends it after.

    The per-message form of ``trace.use_span`` (docs/explanation/operations.md, "Tracing"): one
    attach and one detach, no generator-based context managers. An exception out of the
    block marks the span failed through :func:`failed` (never the SDK's own recording,
    which calls ``str()`` on the exception: one whose ``__str__`` raises would replace
    the handler's failure); the span must be started with ``record_exception=False`` and
    ``set_status_on_exception=False``.
    """

    __slots__ = ("_token", "span")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self._token: contextvars.Token[Context] | None = None

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            if exc is not None:
                failed(self.span, exc)
        finally:
            if self._token is not None:
                otel_context.detach(self._token)
            self.span.end()


# ---- SDK set-up at daemon start -------------------------------------------------------

_setup_lock = threading.Lock()
_set_up = False

_EXPORTER_GROUP = "opentelemetry_traces_exporter"
_EXPORTER_HINTS = {
    "otlp": "opentelemetry-exporter-otlp-proto-grpc",
    "otlp_proto_grpc": "opentelemetry-exporter-otlp-proto-grpc",
    "otlp_proto_http": "opentelemetry-exporter-otlp-proto-http",
    "zipkin": "opentelemetry-exporter-zipkin",
}


def setup(service: str) -> bool:
    """Record and export spans if ``OTEL_TRACES_EXPORTER`` names exporters; True if this call did.

    Once per process, and never over a tracer provider the application set itself (a
    test, ``txbox bench e2e --tracing``). The SDK reads the rest of ``OTEL_*`` itself:
    sampler, resource attributes, batch processor and exporter settings. Unlike the
    SDK's auto-configuration, an unset ``OTEL_TRACES_EXPORTER`` means no export (not
    OTLP to localhost): installing the extra changes nothing until asked.
    A misconfiguration fails here, at start, saying what to install or set.
    """
    global _set_up
    with _setup_lock:
        if _set_up:
            return False
        wanted = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
        disabled = os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        if disabled or not wanted or wanted == ["none"]:
            _set_up = True
            return False
        try:
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ConfigurationError(
                f"OTEL_TRACES_EXPORTER={','.join(wanted)} but the OpenTelemetry SDK is not installed: "
                "pip install 'txbox[otel]' (or unset OTEL_TRACES_EXPORTER)"
            ) from None
        exporters = [_exporter(name) for name in wanted if name != "none"]  # a wrong name fails first
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            _set_up = True
            return False  # configured by the application: keep its choice
        resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: service}))
        provider = TracerProvider(resource=resource)
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter()))
        trace.set_tracer_provider(provider)
        _set_up = True
        return True


def _exporter(name: str) -> Any:
    """The exporter class registered as ``name`` (the SDK's own way to find them by name)."""
    found = importlib_metadata.entry_points(group=_EXPORTER_GROUP, name=name)
    if not found:
        known = sorted(ep.name for ep in importlib_metadata.entry_points(group=_EXPORTER_GROUP))
        package = _EXPORTER_HINTS.get(name)
        fix = f"pip install {package}" if package else f"install the package providing it (installed: {known})"
        raise ConfigurationError(f"OTEL_TRACES_EXPORTER names {name!r}, which no installed exporter provides: {fix}")
    return next(iter(found)).load()
