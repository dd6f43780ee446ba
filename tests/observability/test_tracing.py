"""Tracing: the span tree of one request through the default data plane, exported over OTLP to a collector
in this test process; the client's traceparent honoured and a new one passed on to the worker; and the
span recorder alone with the SDK's in-memory exporter.
"""

from __future__ import annotations

import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.observability.tracing import Tracing, otlp_traces_url, parse_traceparent, tracing_from_settings
from tests.support.fleet import Fleet
from tests.support.procs import free_port, wait_http_ok, wait_until

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


class Collector:
    """An OTLP/HTTP trace receiver (protobuf), as an OpenTelemetry Collector's otlp receiver on :4318."""

    def __init__(self) -> None:
        self.spans: list = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        collector.spans.extend(scope_spans.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fleet(procs, tmp_path):
    f = Fleet(procs, tmp_path)
    yield f
    f.close()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def _hex(raw: bytes) -> str:
    return raw.hex()


@pytest.mark.timeout(120)
def test_one_request_through_the_data_plane_makes_one_trace_under_the_clients(fleet, procs, collector):
    workers = []
    for _ in range(2):
        port = free_port()
        procs.start([sys.executable, "-m", "tests.support.raw_upstream", str(port)], name="raw-upstream")
        workers.append(f"http://127.0.0.1:{port}")
    for url in workers:
        wait_http_ok(url + "/health", timeout=20)
    config = f"proxy:\n  otlp_endpoint: {collector.url}\n"
    path = fleet.tmp_path / "config.yaml"
    path.write_text(config)
    port = free_port()
    procs.kvroute("proxy", "--port", str(port), "--policy", "kv_aware", "--config", str(path), name="proxy",
                  env={"OTEL_BSP_SCHEDULE_DELAY": "100"})  # a batch goes out after 100 ms, not 5 s
    fleet.url = f"http://127.0.0.1:{port}"
    wait_http_ok(fleet.url + "/health", timeout=30)
    for i, url in enumerate(workers):
        resp = fleet.http.post(fleet.url + "/workers", json={"worker_id": f"raw-{i}", "url": url, "models": ["m1"],
                                                             "reports": False})
        assert resp.status_code == 200, resp.text
    fleet.wait_workers(lambda ws: [w["state"] for w in ws] == ["ready", "ready"], what="both workers ready")

    resp = fleet.http.post(fleet.url + "/v1/chat/completions", headers={"traceparent": CLIENT_TRACEPARENT},
                           json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    worker_id = resp.headers["x-kvroute-worker"]
    received = {k.lower(): v for k, v in resp.json()["headers"]}  # raw_upstream echoes what the worker got

    spans = wait_until(lambda: (lambda s: s if {"kvroute.request", "route", "upstream"} <= {x.name for x in s}
                                else None)(list(collector.spans)), 20, 0.05, "the request's spans at the collector")
    by_name = {s.name: s for s in spans}
    root, route, upstream = by_name["kvroute.request"], by_name["route"], by_name["upstream"]
    # One trace: the client's. The client's span is the root's parent; route and upstream are its children.
    assert {_hex(s.trace_id) for s in spans} == {CLIENT_TRACE}
    assert _hex(root.parent_span_id) == CLIENT_SPAN
    assert route.parent_span_id == root.span_id and upstream.parent_span_id == root.span_id
    assert "queue" not in by_name  # nothing waited in admission
    attrs = {a.key: a.value for a in route.attributes}
    candidates = list(attrs["kvroute.candidates"].array_value.values)
    scores = [v.double_value for v in attrs["kvroute.candidate_scores"].array_value.values]
    assert sorted(c.string_value for c in candidates) == ["raw-0", "raw-1"]
    assert scores == sorted(scores)  # best (lowest) first
    assert attrs["kvroute.worker"].string_value == worker_id
    assert attrs["kvroute.policy"].string_value == "kv_aware" and attrs["kvroute.reason"].string_value
    up_attrs = {a.key: a.value for a in upstream.attributes}
    assert up_attrs["kvroute.worker"].string_value == worker_id
    assert up_attrs["http.response.status_code"].int_value == 200
    assert [e.name for e in upstream.events] == ["first_byte"]
    assert upstream.start_time_unix_nano <= upstream.events[0].time_unix_nano <= upstream.end_time_unix_nano
    assert root.start_time_unix_nano <= route.start_time_unix_nano <= upstream.start_time_unix_nano
    assert upstream.end_time_unix_nano <= root.end_time_unix_nano
    assert {a.key: a.value for a in root.attributes}["http.response.status_code"].int_value == 200
    # The worker got a traceparent of the same trace whose parent is the upstream span (not the client's span).
    version, trace_id, span_id, flags = received["traceparent"].split("-")
    assert (trace_id, span_id, flags) == (CLIENT_TRACE, _hex(upstream.span_id), "01")


def _tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing(SimpleSpanProcessor(exporter)), exporter


def test_a_held_request_gets_a_queue_span_and_a_failed_attempt_is_marked():
    tracing, exporter = _tracing()
    now = time.monotonic()
    trace = tracing.begin(None, now, {"kvroute.request_id": "r1"})
    trace.route(now, now + 0.2, "w-1", "lowest_cost", "kv_aware", {"w-1": 0.5, "w-0": 0.1}, held=True)
    trace.upstream_start("w-1", "http://10.0.0.1:8000")
    trace.upstream_end(503, None, "status_503")
    trace.upstream_start("w-0", "http://10.0.0.2:8000")
    trace.upstream_end(200, time.monotonic(), None)
    trace.end(200, {})
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["queue", "route", "upstream", "upstream", "kvroute.request"]
    root = spans[-1]
    assert root.parent is None  # no client traceparent: the request starts the trace
    assert list(spans[1].attributes["kvroute.candidates"]) == ["w-0", "w-1"]
    failed, served = spans[2], spans[3]
    assert not failed.status.is_ok and failed.attributes["error.type"] == "status_503"
    assert served.status.is_ok and served.attributes["kvroute.attempt"] == 2


def test_a_client_trace_that_is_not_sampled_is_left_to_the_worker():
    tracing, exporter = _tracing()
    assert tracing.begin(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00".encode(), time.monotonic(), {}) is None
    assert parse_traceparent(b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01") is None  # all-zero trace id
    assert parse_traceparent(b"garbage") is None
    assert parse_traceparent(CLIENT_TRACEPARENT.encode()) == (int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), True)


def test_endpoint_settings_follow_the_otel_conventions():
    assert tracing_from_settings(None, environ={}) is None  # nothing set: tracing off
    assert otlp_traces_url("http://collector:4318", {}) == "http://collector:4318/v1/traces"
    assert otlp_traces_url(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    assert otlp_traces_url(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom"}) == "http://c:4318/custom"
    assert otlp_traces_url(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                  "OTEL_SDK_DISABLED": "true"}) is None
    enabled = tracing_from_settings("http://127.0.0.1:9", environ={})
    assert enabled is not None
    enabled.shutdown()


def test_the_hand_written_otlp_encoding_is_what_the_sdk_encodes():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from proxy.observability.otlp import encode_request

    tracing, exporter = _tracing()
    now = time.monotonic()
    trace = tracing.begin(CLIENT_TRACEPARENT.encode(), now, {"kvroute.request_id": "r1", "kvroute.retries": -1})
    trace.event("parsed", {"kvroute.prompt_tokens": 812, "kvroute.stream": True, "x": 0.5})
    trace.route(now, now + 0.01, "w-ü", "lowest_cost", "kv_aware", {"w-ü": 0.25, "w-1": 1e9}, held=True)
    trace.upstream_start("w-ü", "http://10.0.0.1:8000")
    trace.upstream_end(503, now + 0.005, "status_503")
    trace.end(502, {"error.type": "x"})
    spans = exporter.get_finished_spans()
    expected = encode_spans(spans)
    for resource_spans in expected.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                span.flags = 0  # the SDK also says whether the parent is remote; receivers do not need it
    assert ExportTraceServiceRequest.FromString(encode_request(spans)) == expected
    # what the OTLP exporter gets from the batch processor: the whole request's trace, encoded from its tuples
    assert ExportTraceServiceRequest.FromString(encode_request([trace])) == expected
    cache: dict = {}  # as the exporter keeps it between batches: repeated attributes come from it
    for _ in range(2):
        assert ExportTraceServiceRequest.FromString(encode_request([trace], cache)) == expected
    assert cache


async def test_a_pick_that_waits_is_marked_held_and_one_that_does_not_is_not():
    import asyncio

    from proxy.observability.decision import DebugGate
    from proxy.observability.request_watch import Observer

    tracing, exporter = _tracing()
    observer = Observer(tracing, None, DebugGate(None, False))

    class Req:
        started = time.monotonic()
        principal = None

        def header(self, name: bytes) -> bytes | None:
            return None

    async def at_once() -> str:
        return "now"

    async def held() -> str:
        await asyncio.sleep(0)  # admission parks the request until a worker frees
        return "later"

    for pick, was_held in ((at_once, False), (held, True)):
        watch = observer.watch(Req(), b"127.0.0.1", "r")
        assert await watch.picking(pick()) in ("now", "later")
        assert watch.held is was_held
        watch.decided("w-0", "lowest_cost", None, "kv_aware")
        watch.finish()
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("queue") == 1 and names.count("route") == 2

    # a pick cancelled while held is cancelled inside, as a plain await would do
    watch = observer.watch(Req(), b"127.0.0.1", "r")
    cancelled = []

    async def parked() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def pick_then_await():
        return await watch.picking(parked())

    task = asyncio.ensure_future(pick_then_await())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled == [True]
