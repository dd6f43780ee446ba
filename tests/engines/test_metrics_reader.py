"""Workers read only the /metrics samples they parse, and read everything from an engine that cannot filter.

The engine side is prometheus_client's own exposition server (what vLLM and LMDeploy mount at /metrics),
holding vLLM's metric names beside the many series vLLM exports that the worker does not read.
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from backends.engines.vllm import VllmAdapter
from tests.support.procs import free_port


def _vllm_like_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "running", labels, registry=registry).labels("tiny", "0").set(5)
    Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry).labels("tiny", "0").set(2)
    Gauge("vllm:kv_cache_usage_perc", "usage", labels, registry=registry).labels("tiny", "0").set(0.5)
    Counter("vllm:prefix_cache_queries", "queries", labels, registry=registry).labels("tiny", "0").inc(100)
    Counter("vllm:prefix_cache_hits", "hits", labels, registry=registry).labels("tiny", "0").inc(40)
    info = Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks", "engine"], registry=registry)
    info.labels("16", "256", "0").set(1)
    prefill = Histogram("vllm:request_prefill_time_seconds", "prefill", labels, registry=registry)
    prefill.labels("tiny", "0").observe(0.1)
    for i in range(60):  # what vLLM exports beside them: bucketed latency histograms the worker never reads
        Histogram(f"vllm:unread_histogram_{i}", "unread", labels, registry=registry,
                  buckets=[0.001 * 2 ** k for k in range(20)]).labels("tiny", "0").observe(0.01)
    return registry


@pytest.fixture
def exposition() -> Iterator[tuple[str, CollectorRegistry]]:
    registry = _vllm_like_registry()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"http://127.0.0.1:{port}", registry
    server.shutdown()
    server.server_close()
    thread.join(5)


async def test_the_vllm_adapter_reads_only_its_samples_from_a_prometheus_client_server(exposition):
    url, registry = exposition
    full = generate_latest(registry)
    adapter = VllmAdapter()
    async with aiohttp.ClientSession() as session:
        load = await adapter.read_load(session, url)
        text = await adapter._metrics.read(session, url)
    assert (load.num_running, load.num_waiting, load.kv_cache_usage, load.kv_capacity_tokens) == (5, 2, 0.5, 4096)
    assert adapter._metrics.filtered
    assert "unread_histogram" not in text and "vllm:num_requests_running" in text
    assert len(text) * 20 < len(full), (len(text), len(full))


@pytest.mark.parametrize("mounted", [True, False], ids=["filter-answers-nothing", "no-metrics-mount"])
async def test_an_engine_whose_filtered_answer_lacks_the_samples_is_read_in_full(mounted):
    registry = _vllm_like_registry()
    asked: list[str] = []

    async def metrics(request: web.Request) -> web.Response:
        # as prometheus_client < 0.20 in multiprocess mode (vLLM with several API servers): its collector
        # names nothing, so a `name[]` filter answers no samples at all
        asked.append(request.path + ("?filtered" if "name[]" in request.query else ""))
        body = b"" if "name[]" in request.query else generate_latest(registry)
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    if mounted:
        app.router.add_get("/metrics/", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        adapter = VllmAdapter()
        url = str(server.make_url("")).rstrip("/")
        async with aiohttp.ClientSession() as session:
            first = await adapter.read_load(session, url)
            second = await adapter.read_load(session, url)
        assert (first.num_running, second.num_running, second.kv_cache_usage) == (5, 5, 0.5)
        # read in full from then on: one request per reading, not two
        assert not adapter._metrics.filtered
        assert asked == (["/metrics/?filtered"] if mounted else []) + ["/metrics", "/metrics"]
    finally:
        await server.close()
