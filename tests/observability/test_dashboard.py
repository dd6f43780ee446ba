"""The dashboard's feed and routes, in process: what a frame says, that it holds no secrets, and that the
event stream is bounded and lets go of a page that leaves. The page in a real browser: test_dashboard_browser.py.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp.test_utils import TestClient, TestServer

from proxy.api.dashboard import FEED_KEY
from proxy.app import METRICS_KEY, REGISTRY_KEY, build_app
from proxy.config import parse_config
from proxy.observability.dashboard_feed import DashboardFeed, _quantile
from proxy.observability.metrics import ProxyMetrics
from proxy.observability.worker_states import explain_state
from proxy.protocol import LoadReport, WorkerRegistration
from proxy.workers.registry import Registry

ADMIN_TOKEN = "s3cret-admin-token"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _register(registry: Registry, wid: str, model: str = "m", **extra) -> None:
    registry.register(WorkerRegistration(worker_id=wid, url=f"http://10.0.0.{len(registry) + 1}:8000", models=[model],
                                         engine="turbomind", gpus=["0", "1"], labels={"api_key": "label-secret"},
                                         **extra))


def _report(registry: Registry, wid: str, seq: int, kv: float, engine: str = "pytorch", state: str = "ready") -> None:
    registry.record_report(wid, LoadReport(worker_id=wid, url="http://x", models=["m"], engine=engine, state=state,
                                           kv_cache_usage=kv, kv_capacity_tokens=1000, num_running=3, num_waiting=1,
                                           prefix_cache_hit_rate=0.5, seq=seq))


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = {0.1: 50.0, 0.5: 100.0, float("inf"): 100.0}
    assert _quantile(buckets, 0.5) == 0.1
    assert _quantile(buckets, 0.75) == 0.3  # halfway through the 0.1..0.5 bucket
    assert _quantile({0.1: 0.0, float("inf"): 0.0}, 0.5) is None


def test_worker_state_reasons_say_why():
    assert explain_state({"state": "ready"}) == ""
    assert explain_state({"state": "stale", "reading_age_s": 7.2}) == "last load report 7s ago"
    assert explain_state({"state": "stale", "last_report": {"state": "starting"}}) == \
        "the worker reports its engine is starting"
    assert explain_state({"state": "unhealthy", "breaker_open": True, "last_error": "connect refused"}) == \
        "circuit open after failures: connect refused"
    assert explain_state({"state": "unhealthy", "last_error": "timeout"}) == "health probe failed: timeout"
    assert explain_state({"state": "draining"}) == "drain requested"


def test_frame_shows_rates_ttft_errors_and_each_workers_load():
    clock = Clock()
    registry = Registry(clock=clock)
    metrics = ProxyMetrics(registry)
    feed = DashboardFeed(registry, metrics, lambda: {"m": 4}, clock=clock)
    _register(registry, "w-0")
    _register(registry, "w-1", role="decode")
    _report(registry, "w-0", 1, 0.25)
    feed.sample()
    for _ in range(20):
        metrics.requests.labels("m", "w-0", "200").inc()
        metrics.ttft.labels("m").observe(0.2)
    metrics.requests.labels("m", "w-0", "500").inc()
    metrics.rejections.labels("m", "queue_full").inc()
    clock.t += 10.0
    feed.sample()
    frame = feed.frame()

    (model,) = frame["models"]
    assert model["name"] == "m" and model["queued"] == 4 and model["workers"] == 2
    assert model["req_per_s"] == 2.1  # 21 finished in 10 s
    assert 0.1 < model["ttft_p50_s"] <= 0.25 and model["errors"] == 1 and model["rejected"] == 1
    rows = {w["id"]: w for w in frame["workers"]}
    w0 = rows["w-0"]
    assert (w0["state"], w0["kv"], w0["running"], w0["waiting"], w0["prefix_hit_rate"]) == ("stale", 0.25, 3, 1, 0.5)
    assert w0["reason"] == "last load report 10s ago"
    assert (w0["engine"], w0["effective_engine"]) == ("turbomind", "pytorch")  # TurboMind fell back to PyTorch
    assert w0["host"] == "10.0.0.1:8000" and w0["gpus"] == ["0", "1"]
    assert rows["w-1"]["kv"] is None and rows["w-1"]["reason"] == "no load report yet"
    assert (w0["role"], rows["w-1"]["role"]) == ("both", "decode")  # shown beside the engine


def _config() -> str:
    return f"proxy:\n  admin_token: {ADMIN_TOKEN}\n  worker_token: worker-secret\nmodels: []\n"


async def _client() -> TestClient:
    app = build_app(parse_config(_config(), source="test"))
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_dashboard_routes_need_no_token_and_leak_no_secrets():
    client = await _client()
    try:
        registry = client.app[REGISTRY_KEY]
        _register(registry, "w-0")
        page = await client.get("/dashboard")
        assert page.status == 200 and "text/html" in page.headers["Content-Type"]
        html = await page.text()
        assert "/dashboard/static/dashboard.js" in html
        assert (await client.get("/dashboard/static/dashboard.js")).status == 200
        state = await client.get("/dashboard/state")
        assert state.status == 200
        body = await state.read()
        assert b'"w-0"' in body
        for secret in (ADMIN_TOKEN, "worker-secret", "label-secret"):
            assert secret.encode() not in body
        assert (await client.post("/workers/w-0/drain")).status == 401  # the control plane stays guarded
    finally:
        await client.close()


async def test_event_stream_sends_frames_and_lets_go_of_a_page_that_leaves():
    client = await _client()
    try:
        feed: DashboardFeed = client.app[FEED_KEY]
        feed.interval_s = 0.05
        client.app[METRICS_KEY].requests.labels("m", "w", "200").inc()
        resp = await client.get("/dashboard/events")
        assert resp.headers["Content-Type"] == "text/event-stream"
        frames = []
        while len(frames) < 2:  # the current frame at once, then one per tick
            line = await asyncio.wait_for(resp.content.readline(), 5)
            if line.startswith(b"data: "):
                frames.append(orjson.loads(line[6:]))
        assert {"models", "workers", "at"} <= set(frames[-1])
        assert feed.listeners == 1
        resp.close()
        for _ in range(100):  # the handler notices the closed connection at its next write (<= 5 s)
            if not feed.listeners:
                break
            await asyncio.sleep(0.05)
        assert feed.listeners == 0
    finally:
        await client.close()


async def test_event_stream_refuses_pages_beyond_its_limit():
    client = await _client()
    try:
        feed: DashboardFeed = client.app[FEED_KEY]
        feed.max_listeners = 1
        first = await client.get("/dashboard/events")
        await asyncio.wait_for(first.content.readline(), 5)
        second = await client.get("/dashboard/events")
        assert second.status == 503 and (await second.json())["error"]["code"] == "too_many_dashboards"
        first.close()
    finally:
        await client.close()


def test_a_thousand_workers_make_one_frame_grouped_by_model():
    registry = Registry()
    feed = DashboardFeed(registry, ProxyMetrics(registry), dict)
    for i in range(1000):
        registry.register(WorkerRegistration(worker_id=f"w-{i:04d}", url=f"http://10.1.{i // 250}.{i % 250}:8000",
                                             models=[f"model-{i % 4}"]))
    frame = feed.frame()
    assert len(frame["workers"]) == 1000 and [m["workers"] for m in frame["models"]] == [250] * 4
    assert [w["model"] for w in frame["workers"]] == sorted(w["model"] for w in frame["workers"])
