"""OpenTelemetry spans for one proxied request, recorded cheaply on the loop and exported by the SDK's
BatchSpanProcessor on its own thread (OTLP/HTTP protobuf, otlp.py, when `proxy.otlp_endpoint` or OTEL_EXPORTER_OTLP_* is set).

Owns the span tree (kvroute.request > route, queue, upstream), W3C traceparent in and out, and the export
settings. Not when to call it: proxy/observability/request_watch.py does that for the data plane. Spans are built
as plain tuples (no SDK tracer, locks or attribute checks: the tracer's own path cost ~50 us a span here)
and queued once per request when it ends; encoding and sending happen on the export thread.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

SERVICE_NAME = "kvroute-proxy"
TRACEPARENT = b"traceparent"
# version-traceid-parentid-flags (W3C Trace Context, level 1); a future version may append fields
_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)
_ERROR = Status(StatusCode.ERROR)
# Candidates listed on a route span: the best ones by the policy's score (lower is better).
ROUTE_CANDIDATES = 16


def parse_traceparent(value: bytes | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a valid W3C traceparent header value; None otherwise."""
    if not value:
        return None
    match = _TRACEPARENT.fullmatch(value.strip().lower())
    if match is None:
        return None
    version, trace_hex, span_hex, flags = match.group(1, 2, 3, 4)
    if version == b"ff" or (version == b"00" and match.group(5)):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


def best_candidates(scores: Mapping[str, float] | None, limit: int) -> list[tuple[str, float]]:
    """The `limit` lowest-scored (worker id, score) pairs, best first."""
    if not scores:
        return []
    items = sorted(scores.items(), key=lambda kv: kv[1]) if len(scores) <= 4 * limit else None
    if items is None:
        import heapq

        items = heapq.nsmallest(limit, scores.items(), key=lambda kv: kv[1])
    return items[:limit]


# span kinds as OTLP numbers them (the SDK's SpanKind enum starts at INTERNAL = 0)
INTERNAL, SERVER, CLIENT = 1, 2, 3
_SDK_KIND = {INTERNAL: SpanKind.INTERNAL, SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT}


class RequestTrace:
    """The spans of one request, kept as plain tuples until the request ends; then handed to the processor
    whole (one queue entry: the OTLP exporter encodes the tuples) or as SDK ReadableSpans (any other exporter).
    Times given are time.monotonic() seconds. Every method may be called in any order; a phase never
    reported is simply left out.

    A span: (name, span id, parent span id or None for the root, kind, start ns, end ns, attributes,
    events as (name, ns, attributes or None), error)."""

    __slots__ = ("tracing", "trace_id", "root_id", "context", "remote_parent_id", "offset_ns", "start_ns",
                 "attributes", "events", "spans", "up_id", "up_start_ns", "up_attributes", "attempts")

    def __init__(self, tracing: Tracing, trace_id: int, remote_parent_id: int | None, started: float,
                 attributes: dict[str, Any]) -> None:
        self.tracing = tracing
        self.trace_id = trace_id
        self.root_id = tracing.rng.getrandbits(64) or 1
        self.context = SpanContext(trace_id, self.root_id, False, _SAMPLED)  # what a span processor checks
        self.remote_parent_id = remote_parent_id
        # monotonic -> wall clock, once per request: OTLP wants Unix nanoseconds
        self.offset_ns = time.time_ns() - time.monotonic_ns()
        self.start_ns = int(started * 1e9) + self.offset_ns
        self.attributes = attributes
        self.events: list[tuple[str, int, dict[str, Any] | None]] = []
        self.spans: list[tuple] = []
        self.up_id = 0
        self.up_start_ns = 0
        self.up_attributes: dict[str, Any] | None = None
        self.attempts = 0

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.offset_ns

    def event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        """A point in the request's life on its root span ("parsed", ...)."""
        self.events.append((name, time.monotonic_ns() + self.offset_ns, attributes))

    def route(self, started: float, ended: float, worker: str | None, reason: str, policy: str,
              scores: Mapping[str, float] | None, held: bool, plan: str | None = None) -> None:
        """The decision as a `route` span: the best candidates with their scores, the pick, why, the policy (and
        a disaggregated model's plan: its stages and why); and a `queue` span over the time the request was held
        in admission."""
        start_ns, end_ns = self._ns(started), self._ns(ended)
        best = best_candidates(scores, ROUTE_CANDIDATES)
        attributes: dict[str, Any] = {"kvroute.policy": policy, "kvroute.reason": reason,
                                      "kvroute.candidates": [w for w, _ in best],
                                      "kvroute.candidate_scores": [float(s) for _, s in best]}
        if scores:
            attributes["kvroute.candidates_scored"] = len(scores)
        if worker is not None:
            attributes["kvroute.worker"] = worker
        if plan is not None:
            attributes["kvroute.plan"] = plan
        rng = self.tracing.rng
        root = self.root_id
        if held:
            self.spans.append(("queue", rng.getrandbits(64) or 1, root, INTERNAL, start_ns, end_ns,
                               {"kvroute.policy": policy}, (), False))
        self.spans.append(("route", rng.getrandbits(64) or 1, root, INTERNAL, start_ns, end_ns, attributes, (),
                           False))

    def upstream_start(self, worker: str, url: str, stage: str | None = None) -> bytes:
        """Open the attempt's `upstream` span (`stage`: encode, prefill or decode of a split request); the header
        line that carries its traceparent to the worker."""
        self.attempts += 1
        self.up_id = span_id = self.tracing.rng.getrandbits(64) or 1
        self.up_start_ns = time.monotonic_ns() + self.offset_ns
        self.up_attributes = {"kvroute.worker": worker, "server.address": url, "kvroute.attempt": self.attempts}
        if stage is not None:
            self.up_attributes["kvroute.stage"] = stage
        return b"traceparent: 00-%032x-%016x-01\r\n" % (self.trace_id, span_id)

    def upstream_end(self, status: int | None, first_byte_at: float | None, error: str | None) -> None:
        """Close the attempt's span: first byte as an event, last byte as its end, the worker's status."""
        attributes = self.up_attributes
        if attributes is None:
            return
        self.up_attributes = None
        if status:
            attributes["http.response.status_code"] = status
        if error:
            attributes["error.type"] = error
        events = (("first_byte", self._ns(first_byte_at), None),) if first_byte_at is not None else ()
        self.spans.append(("upstream", self.up_id, self.root_id, CLIENT, self.up_start_ns,
                           time.monotonic_ns() + self.offset_ns, attributes, events, bool(error)))

    def end(self, status: int, attributes: dict[str, Any]) -> None:
        """Close the request's root span (and an attempt left open by a cancellation); hand the trace over."""
        if self.up_attributes is not None:
            self.upstream_end(None, None, "cancelled")
        root_attributes = self.attributes
        root_attributes.update(attributes)
        if status:
            root_attributes["http.response.status_code"] = status
        self.spans.append(("kvroute.request", self.root_id, None, SERVER, self.start_ns,
                           time.monotonic_ns() + self.offset_ns, root_attributes, self.events, status >= 500))
        tracing = self.tracing
        if tracing.whole_requests:
            tracing.processor.on_end(self)  # type: ignore[arg-type]  # the exporter takes RequestTraces
        else:
            for span in self.readable_spans():
                tracing.processor.on_end(span)

    def readable_spans(self) -> list[ReadableSpan]:
        """The spans as the SDK's ReadableSpans, for any SDK exporter."""
        tracing = self.tracing
        trace_id = self.trace_id
        remote = (SpanContext(trace_id, self.remote_parent_id, True, _SAMPLED)
                  if self.remote_parent_id is not None else None)
        out = []
        for name, span_id, parent_id, kind, start_ns, end_ns, attributes, events, error in self.spans:
            parent = remote if parent_id is None else SpanContext(trace_id, parent_id, False, _SAMPLED)
            out.append(ReadableSpan(
                name, SpanContext(trace_id, span_id, False, _SAMPLED), parent, tracing.resource, attributes,
                [Event(n, a, ts) for n, ts, a in events], (), _SDK_KIND[kind], None, _ERROR if error else _OK,
                start_ns, end_ns, tracing.scope))
        return out


class Tracing:
    """Request traces into one span processor: a BatchSpanProcessor over otlp.py's exporter, which takes a
    whole RequestTrace per queue entry (`whole_requests`), or any SDK processor and exporter, which get
    ReadableSpans (tests use the SDK's in-memory exporter)."""

    def __init__(self, processor: SpanProcessor, resource: Resource | None = None,
                 rng: random.Random | None = None, whole_requests: bool = False) -> None:
        self.processor = processor
        self.resource = resource or Resource.create({"service.name": SERVICE_NAME})
        self.scope = InstrumentationScope("kvroute")
        self.rng = rng or random.Random()
        self.whole_requests = whole_requests

    def begin(self, traceparent: bytes | None, started: float, attributes: dict[str, Any]) -> RequestTrace | None:
        """A request's trace, a child of the client's span when it sent a traceparent. None when the client's
        trace is not sampled: then its traceparent goes to the worker unchanged."""
        parent = parse_traceparent(traceparent)
        if parent is None:
            return RequestTrace(self, self.rng.getrandbits(128) or 1, None, started, attributes)
        trace_id, span_id, sampled = parent
        if not sampled:
            return None
        return RequestTrace(self, trace_id, span_id, started, attributes)

    def shutdown(self) -> None:
        """Export what is queued and stop the export thread (blocking: call it off the loop)."""
        self.processor.shutdown()


def otlp_traces_url(configured: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """Where to send spans: proxy.otlp_endpoint, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (used as is), else
    OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/traces); None when nothing is set or OTEL_SDK_DISABLED=true."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    base = configured or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not configured and env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if not base:
        return None
    base = base.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def tracing_from_settings(otlp_endpoint: str | None, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """Tracing that exports over OTLP/HTTP in batches when an endpoint is set; None (tracing off) otherwise.
    The batch processor reads OTEL_BSP_* (queue size, delay), the exporter OTEL_EXPORTER_OTLP_* (headers,
    compression, timeout) as the SDK documents."""
    url = otlp_traces_url(otlp_endpoint, environ)
    if url is None:
        return None
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from proxy.observability.otlp import OtlpHttpExporter

    return Tracing(BatchSpanProcessor(OtlpHttpExporter(url, environ)), whole_requests=True)
