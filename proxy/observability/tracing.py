"""OpenTelemetry spans for one proxied request: receive, parse, route (with each candidate's predicted
cost), queue, and the upstream attempt (connect, first byte, last byte); W3C traceparent in and out.

Owns the span tree and its export (OTLP over HTTP when `proxy.otlp_endpoint` or OTEL_EXPORTER_OTLP_*
is set). Not wired into the request path here: the data plane calls `Tracing.begin()` per request.
With no endpoint, `NO_TRACING` hands out one shared do-nothing trace, so tracing off costs a call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

SERVICE_NAME = "kvroute-proxy"


class RequestTrace:
    """The spans of one request; every method is safe to call in any order, and more than once."""

    def __init__(self, tracer: Any, propagator: Any, headers: Mapping[str, str], attributes: dict[str, Any]) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._tracer = tracer
        self._propagator = propagator
        parent = propagator.extract(carrier={k.lower(): v for k, v in headers.items()})
        self.root = tracer.start_span("kvroute.request", context=parent, kind=trace.SpanKind.SERVER,
                                      attributes=attributes)
        self._ctx = trace.set_span_in_context(self.root)
        self._upstream: Any = None
        self._upstream_ctx: Any = None
        self._waiting: Any = None  # the open upstream phase (connect, then first byte, then last byte)

    @contextlib.contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[Any]:
        """A child span of the request around a block: "receive", "parse", "queue", ..."""
        span = self._tracer.start_span(name, context=self._ctx, attributes=attributes)
        try:
            yield span
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            span.end()

    def route(self, candidates: Sequence[tuple[str, float]], chosen: str | None, reason: str,
              policy: str = "") -> None:
        """The routing decision as a span: every candidate's predicted cost (seconds), the pick and why."""
        attributes: dict[str, Any] = {"kvroute.policy": policy, "kvroute.reason": reason,
                                      "kvroute.candidates": [w for w, _ in candidates],
                                      "kvroute.candidate_costs_s": [float(c) for _, c in candidates]}
        if chosen is not None:
            attributes["kvroute.worker"] = chosen
        span = self._tracer.start_span("route", context=self._ctx, attributes=attributes)
        span.end()

    # --- the upstream attempt -----------------------------------------------------------------
    def upstream_start(self, worker: str, url: str) -> dict[str, str]:
        """Open the upstream span (and its connect phase); the headers carry its traceparent to the worker."""
        self._end_upstream()
        self._upstream = self._tracer.start_span("upstream", context=self._ctx, kind=self._trace.SpanKind.CLIENT,
                                                 attributes={"kvroute.worker": worker, "server.address": url})
        self._upstream_ctx = self._trace.set_span_in_context(self._upstream)
        self._waiting = self._tracer.start_span("upstream.connect", context=self._upstream_ctx)
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._upstream_ctx)
        return carrier

    def upstream_sent(self) -> None:
        """Connected and the request is written: now waiting for the first byte."""
        self._next_phase("upstream.first_byte")

    def upstream_first_byte(self) -> None:
        self._next_phase("upstream.last_byte")

    def upstream_end(self, status: int | None = None, error: str | None = None) -> None:
        if self._upstream is not None:
            if status is not None:
                self._upstream.set_attribute("http.response.status_code", status)
            if error:
                self._upstream.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        self._end_upstream()

    def _next_phase(self, name: str) -> None:
        if self._upstream_ctx is None:
            return
        if self._waiting is not None:
            self._waiting.end()
        self._waiting = self._tracer.start_span(name, context=self._upstream_ctx)

    def _end_upstream(self) -> None:
        if self._waiting is not None:
            self._waiting.end()
        if self._upstream is not None:
            self._upstream.end()
        self._waiting = self._upstream = self._upstream_ctx = None

    # --- the end ---------------------------------------------------------------------------------
    def end(self, status: int, **attributes: Any) -> None:
        self._end_upstream()
        self.root.set_attribute("http.response.status_code", status)
        for key, value in attributes.items():
            self.root.set_attribute(key, value)
        if status >= 500:
            self.root.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        self.root.end()


class _NoTrace:
    """Tracing off: every call does nothing."""

    @contextlib.contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[None]:
        yield None

    def route(self, *args: Any, **kwargs: Any) -> None:
        pass

    def upstream_start(self, worker: str, url: str) -> dict[str, str]:
        return {}

    def upstream_sent(self) -> None:
        pass

    def upstream_first_byte(self) -> None:
        pass

    def upstream_end(self, *args: Any, **kwargs: Any) -> None:
        pass

    def end(self, *args: Any, **kwargs: Any) -> None:
        pass


_NO_TRACE = _NoTrace()


class NoTracing:
    enabled = False

    def begin(self, headers: Mapping[str, str], **attributes: Any) -> _NoTrace:
        return _NO_TRACE

    def shutdown(self) -> None:
        pass


NO_TRACING = NoTracing()


class Tracing:
    """Spans through an OpenTelemetry TracerProvider (tests pass one with an in-memory exporter)."""

    enabled = True

    def __init__(self, provider: Any) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("kvroute")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, headers: Mapping[str, str], **attributes: Any) -> RequestTrace:
        """Start a request's trace, as a child of the client's `traceparent` when it sent one."""
        return RequestTrace(self.tracer, self.propagator, headers, attributes)

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what the batch processor holds


def otlp_traces_url(configured: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """Where to send spans: proxy.otlp_endpoint, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (used as is), else
    OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/traces); None when nothing is set."""
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


def tracing_from_settings(otlp_endpoint: str | None, environ: Mapping[str, str] | None = None) -> Tracing | NoTracing:
    """Tracing that exports over OTLP/HTTP in batches when an endpoint is set; NO_TRACING otherwise."""
    url = otlp_traces_url(otlp_endpoint, environ)
    if url is None:
        return NO_TRACING
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return Tracing(provider)
