"""framework.tracing: bounded carriers, malformed headers ignored, the SDK set-up from OTEL_*."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler, SamplingResult
from opentelemetry.trace import StatusCode

from framework import names, tracing
from framework.errors import ConfigurationError
from framework.receiver.intake import Delivery
from framework.relay.messages import outgoing, unbuildable
from framework.relay.spans import PublishSpans, publish_spans
from tests.unit.test_publisher import claimed

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# A tracer of its own provider: these tests need recording spans without touching the global one.
TRACER = TracerProvider().get_tracer("test")


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {},
        {"traceparent": 7},
        {"traceparent": b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
        {"traceparent": "00-" + "a" * 10_000},
        {"traceparent": "garbage"},
        {"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"},  # all-zero trace id
        {"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},  # forbidden version
        "not a mapping",
    ],
)
def test_a_malformed_traceparent_gives_no_parent(headers: Any) -> None:
    assert not trace.get_current_span(tracing.extract(headers)).get_span_context().is_valid


def test_a_valid_traceparent_is_the_remote_parent() -> None:
    context = trace.get_current_span(tracing.extract({"traceparent": PARENT, "tracestate": "v=1"})).get_span_context()
    assert context.is_remote
    assert format(context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert context.trace_state.get("v") == "1"


def test_the_carrier_keeps_only_bounded_text() -> None:
    long_state = "v=" + "x" * tracing.MAX_TRACESTATE_CHARS
    assert tracing.carrier_from({"traceparent": PARENT, "tracestate": long_state, "other": "x"}) == {
        "traceparent": PARENT
    }
    assert tracing.carrier_from({"tracestate": "v=1"}) == {}  # no state without a parent


def test_an_outbox_row_keeps_the_current_span() -> None:
    assert tracing.current() is None
    with TRACER.start_as_current_span("business") as span:
        carrier = tracing.current()
    assert carrier is not None
    ids = span.get_span_context()
    assert carrier[names.HEADER_TRACEPARENT].startswith(f"00-{ids.trace_id:032x}-{ids.span_id:016x}-")


def test_the_outbox_row_metadata_holds_the_writers_span() -> None:
    from examples.orders.app import service
    from framework.outbox import Outbox

    outbox = Outbox(None, service.registry)  # type: ignore[arg-type]  # build() writes nothing
    spec = service.registry.get("PlaceOrder")
    payload = {"customer": "ada", "sku": "BOOK-1", "quantity": 1}
    assert names.METADATA_TRACE not in outbox.build(spec, aggregate_id="o-1", payload=payload).metadata
    with TRACER.start_as_current_span("business"):
        row = outbox.build(spec, aggregate_id="o-1", payload=payload)
        assert row.metadata[names.METADATA_TRACE] == tracing.current()


def test_the_inbox_row_keeps_the_senders_context() -> None:
    delivery = Delivery(delivery_tag=1, body=b"{}", trace={"traceparent": PARENT})
    assert delivery.metadata(None)[names.METADATA_TRACE] == {"traceparent": PARENT}
    assert names.METADATA_TRACE not in Delivery(delivery_tag=1, body=b"{}").metadata(None)


def test_current_formats_each_span_once(monkeypatch: pytest.MonkeyPatch) -> None:
    formatted: list[Any] = []
    format_ = tracing._format
    monkeypatch.setattr(tracing, "_format", lambda context: (formatted.append(1), format_(context))[1])
    with TRACER.start_as_current_span("business"):
        first = tracing.current()
        assert first is not None
        first["traceparent"] = "changed by the caller"
        assert tracing.current() == tracing.current() != first  # each caller gets a copy
    with TRACER.start_as_current_span("another") as other:
        carrier = tracing.current()
    assert carrier is not None and f"{other.get_span_context().span_id:016x}" in carrier["traceparent"]
    assert len(formatted) == 2  # one per span, not one per row


def parent(n: int) -> dict[str, str]:
    return {"traceparent": f"00-4bf92f3577b34da6a3ce929d0e0e4736-{n + 1:016x}-01"}


def test_a_batch_records_nothing_per_message_when_nothing_records(monkeypatch: pytest.MonkeyPatch) -> None:
    def carriers() -> Iterator[dict[str, str]]:
        raise AssertionError("a carrier was looked at")
        yield {}

    monkeypatch.setattr(tracing, "tracer", trace.NoOpTracer())
    assert tracing.batch_spans("store q", trace.SpanKind.CONSUMER, {}, carriers()) == []


def test_a_batch_links_each_distinct_valid_context_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "tracer", TRACER)
    carriers = [parent(1), parent(1), parent(2), None, {"traceparent": "garbage"}, {**parent(1), "tracestate": "v=1"}]
    (span,) = tracing.batch_spans("store q", trace.SpanKind.CONSUMER, {"messaging.batch.message_count": 6}, carriers)
    span.end()
    assert [(link.context.span_id, link.context.trace_state.get("v")) for link in span.links] == [  # type: ignore[attr-defined]
        (2, None),
        (3, None),
        (2, "1"),
    ]


def test_a_batch_of_more_contexts_than_one_span_keeps_gets_more_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "tracer", TRACER)
    spans = tracing.batch_spans("publish s", trace.SpanKind.PRODUCER, {}, [parent(n) for n in range(130)])
    linked = [len(span.links) for span in spans]  # type: ignore[attr-defined]
    assert linked == [tracing.MAX_LINKS, 130 - tracing.MAX_LINKS]


class _Seen(Sampler):
    """Samples every span, keeping how many links each was shown."""

    def __init__(self) -> None:
        self.links: list[int] = []

    def should_sample(self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any) -> SamplingResult:
        links = kwargs.get("links", args[2] if len(args) > 2 else None)
        self.links.append(len(links or ()))
        return ALWAYS_ON.should_sample(parent_context, trace_id, name)

    def get_description(self) -> str:
        return "seen"


def test_a_batch_span_is_given_its_links_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = _Seen()
    monkeypatch.setattr(tracing, "tracer", TracerProvider(sampler=sampler).get_tracer("test"))
    spans = tracing.batch_spans("store q", trace.SpanKind.CONSUMER, {}, [parent(n) for n in range(130)])
    assert sampler.links == [tracing.MAX_LINKS, 2]  # what the sampler saw is what each span keeps
    assert [len(span.links) for span in spans] == sampler.links  # type: ignore[attr-defined]


def test_a_batch_the_sampler_drops_reads_no_more_than_its_first_spans_share(monkeypatch: pytest.MonkeyPatch) -> None:
    read = 0

    def carriers() -> Iterator[dict[str, str]]:
        nonlocal read
        for n in range(1000):
            read += 1
            yield parent(n)

    monkeypatch.setattr(tracing, "tracer", TracerProvider(sampler=ALWAYS_OFF).get_tracer("test"))
    assert tracing.batch_spans("store q", trace.SpanKind.CONSUMER, {}, carriers()) == []
    assert read == tracing.MAX_LINKS


def test_a_publish_batch_links_what_its_messages_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    # The links come from the outgoing headers (the stored carrier, bounded once), and from
    # the stored carrier of a row whose message could not be built (it has no headers).
    monkeypatch.setattr(tracing, "tracer", TRACER)
    too_long = {"traceparent": "00-" + "a" * tracing.MAX_TRACEPARENT_CHARS}
    items = [
        outgoing(claimed(trace=parent(1))),
        outgoing(claimed(trace=too_long)),
        outgoing(claimed(trace=None)),
        unbuildable(claimed(trace=parent(2)), ValueError("bad"))[0],
    ]
    batch = publish_spans("s", items)
    assert batch is not None
    (span,) = batch._spans
    assert [link.context.span_id for link in span.links] == [2, 3]  # type: ignore[attr-defined]


def test_a_publish_batch_ends_with_its_last_confirm_and_fails_with_any() -> None:
    spans = [TRACER.start_span("publish s"), TRACER.start_span("publish s")]
    batch = PublishSpans(spans, 3)
    batch.done(None)
    batch.done("nacked")
    assert all(span.is_recording() for span in spans)
    batch.done(None)
    assert not any(span.is_recording() for span in spans)
    assert all(span.status.status_code is StatusCode.ERROR for span in spans)  # type: ignore[attr-defined]
    assert spans[0].attributes["txbox.failed"] == 1  # type: ignore[attr-defined]

    ok = TRACER.start_span("publish s")
    PublishSpans([ok], 1).done(None)
    assert ok.status.status_code is StatusCode.UNSET  # type: ignore[attr-defined]


@pytest.fixture
def fresh_setup(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(tracing, "_set_up", False)
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.mark.usefixtures("fresh_setup")
def test_setup_does_nothing_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracing.setup("order-service") is False
    monkeypatch.setattr(tracing, "_set_up", False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.setup("order-service") is False


@pytest.mark.usefixtures("fresh_setup")
def test_an_unknown_exporter_fails_at_start_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp_proto_http")
    with pytest.raises(ConfigurationError, match="pip install opentelemetry-exporter-otlp-proto-http"):
        tracing.setup("order-service")


@pytest.mark.usefixtures("fresh_setup")
def test_setup_installs_a_provider_with_the_named_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to: list[Any] = []
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    monkeypatch.setattr(trace, "set_tracer_provider", set_to.append)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert tracing.setup("order-service") is True
    (provider,) = set_to
    assert isinstance(provider, TracerProvider)
    assert provider.resource.attributes["service.name"] == "order-service"
    assert tracing.setup("order-service") is False  # once per process


def test_a_tracestate_with_line_breaks_or_non_ascii_is_dropped() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for state in ("a=1\nforged log line", "a=\u00e9t\u00e9", "a=1\x00"):
        assert tracing.carrier_from({names.HEADER_TRACEPARENT: parent, names.HEADER_TRACESTATE: state}) == {
            names.HEADER_TRACEPARENT: parent
        }
    assert tracing.carrier_from({names.HEADER_TRACEPARENT: parent, names.HEADER_TRACESTATE: "a=1,b=2"}) == {
        names.HEADER_TRACEPARENT: parent,
        names.HEADER_TRACESTATE: "a=1,b=2",
    }


@pytest.mark.parametrize("state", [None, "v=1", "a=1,b=2"])
@pytest.mark.parametrize("flags", ["00", "01"])
def test_the_carrier_is_what_the_w3c_propagator_writes(state: str | None, flags: str) -> None:
    headers = {"traceparent": f"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}"}
    if state:
        headers["tracestate"] = state
    context = trace.get_current_span(tracing.extract(headers)).get_span_context()
    injected: dict[str, str] = {}
    tracing._W3C.inject(injected, context=trace.set_span_in_context(trace.NonRecordingSpan(context)))
    assert tracing._format(context) == injected == headers


def test_a_parsed_context_is_reused_only_for_the_same_headers() -> None:
    first = tracing.extract({"traceparent": PARENT})
    assert tracing.extract({"traceparent": PARENT}) is first  # parsed once
    with_state = trace.get_current_span(tracing.extract({"traceparent": PARENT, "tracestate": "v=2"}))
    assert with_state.get_span_context().trace_state.get("v") == "2"
    assert not trace.get_current_span(first).get_span_context().trace_state
    other = f"00-4bf92f3577b34da6a3ce929d0e0e4736-{7:016x}-01"
    assert trace.get_current_span(tracing.extract({"traceparent": other})).get_span_context().span_id == 7


def test_a_current_span_ends_and_is_marked_failed_by_an_exception() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    span = TRACER.start_span("handle X", record_exception=False, set_status_on_exception=False)
    with pytest.raises(Unprintable), tracing.CurrentSpan(span):
        assert trace.get_current_span() is span
        raise Unprintable
    assert trace.get_current_span() is not span
    assert not span.is_recording()  # ended
    assert span.status.status_code is StatusCode.ERROR  # type: ignore[attr-defined]
    assert span.status.description == "Unprintable"  # type: ignore[attr-defined]


# A valid tracestate of many members, longer than W3C asks to pass on.
LONG_STATE = ",".join(f"k{i}={'x' * 16}" for i in range(30))


@pytest.mark.parametrize(
    "traceparent",
    [
        PARENT,
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case: not W3C
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\t",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\n",
        "garbage",
    ],
)
@pytest.mark.parametrize("tracestate", [None, "v=1,w=2", LONG_STATE, "v=" + "x" * 600, "not a list member"])
def test_a_context_is_read_as_the_w3c_propagator_reads_it(traceparent: str, tracestate: str | None) -> None:
    carrier = {"traceparent": traceparent} | ({"tracestate": tracestate} if tracestate is not None else {})
    expected = trace.get_current_span(tracing._W3C.extract(carrier)).get_span_context()
    parsed = tracing._parse(traceparent, tracestate)
    assert parsed == (expected if expected.is_valid else None)
    assert trace.get_current_span(tracing._remote(traceparent, tracestate)).get_span_context() == expected
