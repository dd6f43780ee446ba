"""proxy/observability/tracing.py with the OpenTelemetry SDK's in-memory exporter: the span tree of one
request, the client's traceparent honoured and passed on to the worker, and tracing off costing nothing.
"""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.observability.tracing import NO_TRACING, Tracing, otlp_traces_url, tracing_from_settings

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def _one_request(tracing: Tracing) -> dict[str, str]:
    trace = tracing.begin({"Traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, **{"kvroute.model": "q"})
    with trace.phase("receive"):
        pass
    with trace.phase("parse", **{"kvroute.prompt_tokens": 812}):
        pass
    trace.route([("w-0", 0.042), ("w-1", 0.310)], "w-0", "kv_cost", policy="kv_aware")
    with trace.phase("queue"):
        pass
    headers = trace.upstream_start("w-0", "http://10.0.0.1:8000")
    trace.upstream_sent()
    trace.upstream_first_byte()
    trace.upstream_end(status=200)
    trace.end(200, **{"kvroute.retries": 0})
    return headers


def test_one_request_makes_the_span_tree_under_the_clients_trace():
    tracing, exporter = _tracing()
    headers = _one_request(tracing)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"kvroute.request", "receive", "parse", "route", "queue", "upstream", "upstream.connect",
                          "upstream.first_byte", "upstream.last_byte"}
    root = spans["kvroute.request"]
    # The client's traceparent is honoured: same trace, the client's span is the parent.
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN
    for name in ("receive", "parse", "route", "queue", "upstream"):
        assert spans[name].parent.span_id == root.context.span_id, name
    for name in ("upstream.connect", "upstream.first_byte", "upstream.last_byte"):
        assert spans[name].parent.span_id == spans["upstream"].context.span_id, name
    # Phases follow each other in time.
    assert spans["upstream.connect"].end_time <= spans["upstream.first_byte"].start_time
    assert spans["upstream.first_byte"].end_time <= spans["upstream.last_byte"].start_time
    # The decision is explained: every candidate with its predicted cost.
    route = spans["route"].attributes
    assert list(route["kvroute.candidates"]) == ["w-0", "w-1"]
    assert list(route["kvroute.candidate_costs_s"]) == [0.042, 0.31]
    assert route["kvroute.worker"] == "w-0" and route["kvroute.reason"] == "kv_cost"
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["kvroute.model"] == "q"
    # The worker gets a traceparent in the same trace, whose parent is the upstream span.
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert trace_id == CLIENT_TRACE and span_id == format(spans["upstream"].context.span_id, "016x")


def test_without_a_client_traceparent_the_request_starts_a_trace():
    tracing, exporter = _tracing()
    trace = tracing.begin({})
    trace.end(503)
    (root,) = exporter.get_finished_spans()
    assert root.parent is None and not root.status.is_ok


def test_with_no_endpoint_tracing_is_off_and_does_nothing():
    assert tracing_from_settings(None, environ={}) is NO_TRACING
    trace = NO_TRACING.begin({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    with trace.phase("parse"):
        pass
    trace.route([("w", 1.0)], "w", "x")
    assert trace.upstream_start("w", "http://x") == {}
    trace.end(200)


def test_endpoint_settings_follow_the_otel_conventions():
    assert otlp_traces_url("http://collector:4318", {}) == "http://collector:4318/v1/traces"
    assert otlp_traces_url(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    assert otlp_traces_url(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom"}) == "http://c:4318/custom"
    assert otlp_traces_url(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                  "OTEL_SDK_DISABLED": "true"}) is None
    enabled = tracing_from_settings("http://127.0.0.1:9", environ={})
    assert enabled.enabled
    enabled.provider.shutdown()
