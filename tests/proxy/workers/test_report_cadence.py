"""Workers report as often as the proxy asks, and the proxy asks less often as its fleet grows.

A real ProxyReporter against an in-process proxy app: the registration's answer sets the cadence,
every report's answer keeps it in step with the fleet's size (protocol.report_interval_for).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from backends.reporter import Load, ProxyReporter
from proxy import protocol
from proxy.app import REGISTRY_KEY, build_app
from proxy.config import parse_config
from proxy.protocol import WorkerRegistration


def test_the_interval_is_fastest_for_small_fleets_and_never_slower_than_4_hz():
    assert protocol.report_interval_for(1) == protocol.REPORT_INTERVAL_S == 0.05
    assert protocol.report_interval_for(10) == 0.05  # 200 reports/s in all
    assert protocol.report_interval_for(30) == pytest.approx(0.15)
    assert protocol.report_interval_for(50) == pytest.approx(0.25)
    assert protocol.report_interval_for(5000) == protocol.REPORT_INTERVAL_MAX_S == 0.25


@pytest.fixture
async def proxy_server() -> AsyncIterator[TestServer]:
    server = TestServer(build_app(parse_config("", env={})), host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


async def _idle_load() -> Load:
    return Load(kv_cache_usage=0.0, num_running=0, num_waiting=0)


async def _until(predicate, within_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not predicate():  # the reporter's own loop changes it: nothing to wait on but time
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)  # noqa: ASYNC110


async def test_a_worker_follows_the_interval_the_proxy_asks_as_the_fleet_grows(proxy_server):
    url = str(proxy_server.make_url("")).rstrip("/")
    registration = WorkerRegistration(worker_id="w0", url="http://127.0.0.1:9", models=["m"], engine="sim",
                                      kv_capacity_tokens=1000)
    reporter = ProxyReporter(url, registration, _idle_load)
    await reporter.start()
    try:
        await asyncio.wait_for(reporter.registered.wait(), 5)
        assert reporter.interval_s == 0.05  # one worker: 20 Hz
        registry = proxy_server.app[REGISTRY_KEY]
        for i in range(1, 30):  # the fleet grows to 30 workers: 0.15 s each keeps 200 reports/s in all
            registry.register(WorkerRegistration(worker_id=f"w{i}", url=f"http://127.0.0.1:{10000 + i}",
                                                 models=["m"], engine="sim", kv_capacity_tokens=1000))
        await _until(lambda: reporter.interval_s == pytest.approx(0.15), within_s=5)
        for i in range(1, 30):
            registry.remove(f"w{i}")
        await _until(lambda: reporter.interval_s == 0.05, within_s=5)
    finally:
        await reporter.stop()


async def test_a_worker_never_reports_slower_than_it_was_told_to(proxy_server):
    url = str(proxy_server.make_url("")).rstrip("/")
    registration = WorkerRegistration(worker_id="w0", url="http://127.0.0.1:9", models=["m"], engine="sim")
    reporter = ProxyReporter(url, registration, _idle_load, interval_s=0.02)
    await reporter.start()
    try:
        await asyncio.wait_for(reporter.registered.wait(), 5)
        assert reporter.interval_s == 0.02  # its own bound wins over the proxy's 0.05
    finally:
        await reporter.stop()


async def test_a_worker_keeps_registering_through_answers_it_cannot_read(proxy_server):
    """Whatever answers first at the proxy's address (a stray server, a proxy mid-restart), the reporter
    must go on trying: before, an unreadable 200 ended its task and the worker never registered."""
    from aiohttp import web

    real = str(proxy_server.make_url("")).rstrip("/")
    answers = {"n": 0}

    async def register(request: web.Request) -> web.StreamResponse:
        answers["n"] += 1
        if answers["n"] == 1:
            return web.Response(status=200, text="<html>not a proxy</html>", content_type="application/json")
        if answers["n"] == 2:
            return web.json_response({"unexpected": True})
        async with aiohttp.ClientSession() as session:  # then the real proxy answers
            async with session.post(real + "/workers", data=await request.read(),
                                    headers={"Content-Type": "application/json"}) as resp:
                return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/workers", register)
    front = TestServer(app, host="127.0.0.1")
    await front.start_server()
    registration = WorkerRegistration(worker_id="w0", url="http://127.0.0.1:9", models=["m"], engine="sim")
    reporter = ProxyReporter(str(front.make_url("")).rstrip("/"), registration, _idle_load)
    await reporter.start()
    try:
        await asyncio.wait_for(reporter.registered.wait(), 10)
        assert answers["n"] == 3 and reporter.worker_id == "w0"
        assert proxy_server.app[REGISTRY_KEY].get("w0") is not None
    finally:
        await reporter.stop(deregister=False)
        await front.close()
