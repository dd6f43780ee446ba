"""Retry classes against a real proxy: a request whose own media cannot be fetched is the client's 4xx,
tried once, and does not take the workers down for everyone else."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.fleet import FakeReports
from tests.support.procs import free_port, wait_http_ok

pytestmark = pytest.mark.timeout(120)


def _bad_image_chat(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=30, json={"model": "m1", "max_tokens": 4, "messages": [
        # a public address (the proxy lets it through) the engine fails to fetch from
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://93.184.215.14/unreachable.invalid/a.png"}},
                                     {"type": "text", "text": "what is this?"}]}]})


def test_unreachable_image_urls_get_a_400_each_and_valid_requests_meanwhile_are_served(fleet, procs):
    fleet.start_proxy()
    engines = []
    for i in range(2):
        port = free_port()
        procs.start([sys.executable, "-m", "tests.support.fake_engine", str(port), "m1"], name=f"fake-{i}")
        engines.append(f"http://127.0.0.1:{port}")
    for url in engines:
        wait_http_ok(url + "/health")
        assert fleet.http.post(fleet.url + "/nodes/add", json={"url": url}).status_code == 200

    with ThreadPoolExecutor(16) as pool:
        bad = [pool.submit(_bad_image_chat, fleet.url) for _ in range(8)]
        good = [pool.submit(fleet.chat, f"q{i}") for i in range(40)]
        bad_responses = [f.result() for f in bad]
        good_responses = [f.result() for f in good]

    assert [r.status_code for r in bad_responses] == [400] * 8
    assert {r.json()["error"]["code"] for r in bad_responses} == {"invalid_media"}
    assert "unreachable.invalid" in bad_responses[0].json()["error"]["message"]
    assert [r.status_code for r in good_responses] == [200] * 40
    # each bad request ran on one engine only, and neither worker's circuit opened
    assert sum(httpx.get(url + "/hits").json()["media_failures"] for url in engines) == 8
    assert {w["state"] for w in fleet.workers()} == {"ready"}
    assert not any(w["breaker_open"] for w in fleet.workers())


def test_workers_that_refuse_connections_cost_no_retry_while_a_live_one_remains(fleet):
    """Three of four registered workers are gone (connection refused) and `retries: 1`: moving past a worker
    that ran nothing is free, so every request reaches the live one instead of 503 after two dead picks."""
    fleet.start_proxy(config="proxy:\n  retries: 1\n  policy: round_robin\n")
    (live,) = fleet.start_sims(1, prefix="live")
    dead = {f"dead-{i}": f"http://127.0.0.1:{free_port()}" for i in range(3)}  # nothing listens there
    for worker_id, url in dead.items():
        fleet.register(worker_id, url)
    with FakeReports(fleet, {worker_id: (url, 0.0) for worker_id, url in dead.items()}):
        fleet.wait_workers(lambda ws: sum(w["state"] == "ready" for w in ws) == 4, what="4 workers ready")
        responses = [fleet.chat(f"q{i}") for i in range(8)]
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses if r.status_code != 200]
    assert {r.headers["x-kvroute-worker"] for r in responses} == {live.worker_id}
