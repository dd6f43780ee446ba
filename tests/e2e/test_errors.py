"""Every error the proxy itself answers, in OpenAI's error body, from a real proxy process."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.fleet import FakeReports
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)

CONFIG = """
proxy:
  max_body_bytes: 4096
  queue:
    max_length: 1
    max_wait_s: 1.0
models:
  - name: m1
    engine: sim
    aliases: [m1-alias, tiny]
  - name: ghost
    engine: sim
"""


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_each_error_case_answers_with_the_right_status_and_openai_body(fleet):
    fleet.start_proxy(config=CONFIG)
    fleet.start_sims(1)
    url = fleet.url + "/v1/chat/completions"

    unknown = fleet.chat(model="no-such-model")
    assert unknown.status_code == 404 and error_of(unknown)["code"] == "model_not_found"

    malformed = fleet.http.post(url, content=b'{"model": "m1", "messages": [', headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and error_of(malformed)["type"] == "invalid_request_error"

    missing = fleet.http.post(url, json={"model": "m1"})
    assert missing.status_code == 400 and error_of(missing)["param"] == "messages"

    too_big = fleet.chat("x" * 5000)
    assert too_big.status_code == 413 and error_of(too_big)["code"] == "request_too_large"

    nobody = fleet.chat(model="ghost")  # configured, but no worker serves it
    assert nobody.status_code == 503 and error_of(nobody)["code"] == "no_healthy_worker"
    assert "retry-after" in nobody.headers

    no_route = fleet.http.get(fleet.url + "/v1/nothing-here")
    assert no_route.status_code == 404 and error_of(no_route)["code"] == "not_found"
    wrong_method = fleet.http.get(url)
    assert wrong_method.status_code == 405 and "POST" in wrong_method.headers["allow"]
    assert error_of(wrong_method)["type"] == "invalid_request_error"

    for resp in (unknown, malformed, missing, too_big, nobody):
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.headers["x-request-id"]


def test_aliases_from_the_config_reach_the_served_model_and_are_listed(fleet):
    fleet.start_proxy(config=CONFIG)
    fleet.start_sims(1)
    resp = fleet.chat(model="m1-alias")
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "m1"  # the worker only knows its served name
    models = {m["id"]: m for m in fleet.http.get(fleet.url + "/v1/models").json()["data"]}
    assert set(models) == {"m1", "ghost", "m1-alias", "tiny"}
    assert models["tiny"]["parent"] == "m1" and models["m1"]["max_model_len"] == 4096
    assert models["m1"]["owned_by"] == "sim"


def _queued(fleet, model: str) -> int:
    """Requests of `model` held in the proxy's admission queue (GET /workers `queues`)."""
    return fleet.http.get(fleet.url + "/workers").json()["queues"].get(model, 0)


def test_while_every_engine_is_queueing_the_proxy_holds_then_429_when_full_and_503_after_the_wait(fleet):
    fleet.start_proxy(config=CONFIG)
    sim, sim2 = fleet.start_sims(2, register=False)
    fleet.register("busy", sim.url)
    fleet.register("busy2", sim2.url)

    async def two_requests() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": "m1", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            first = asyncio.create_task(client.post(fleet.url + "/v1/chat/completions", json=body))
            # the first one holds the only queue slot
            await asyncio.to_thread(wait_until, lambda: _queued(fleet, "m1") == 1, 10, 0.02, "the first one queued")
            second = await client.post(fleet.url + "/v1/chat/completions", json=body)
            return [await first, second]

    # both engines say 4 requests wait for room: the proxy holds, to bind late to the first that frees
    with FakeReports(fleet, {"busy": (sim.url, 0.95, 4), "busy2": (sim2.url, 0.95, 4)}):
        started = time.monotonic()
        waited, rejected = asyncio.run(two_requests())
        elapsed = time.monotonic() - started
    assert rejected.status_code == 429 and error_of(rejected)["code"] == "queue_full"
    assert waited.status_code == 503 and error_of(waited)["code"] == "queue_timeout"
    assert waited.headers["retry-after"] and rejected.headers["retry-after"]
    assert elapsed >= 1.0  # the first one really waited for the configured max_wait_s


def test_a_queued_request_is_served_once_a_worker_has_room_again(fleet):
    fleet.start_proxy(config=CONFIG)
    sim, sim2 = fleet.start_sims(2, register=False)
    fleet.register("busy", sim.url)
    fleet.register("busy2", sim2.url)
    fleet.report("busy", sim.url, 0.95, waiting=4)
    fleet.report("busy2", sim2.url, 0.95, waiting=4)

    async def request_then_free_room() -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as client:
            pending = asyncio.create_task(client.post(fleet.url + "/v1/chat/completions", json={
                "model": "m1", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}))
            await asyncio.to_thread(wait_until, lambda: _queued(fleet, "m1") == 1, 10, 0.02, "the request queued")
            assert not pending.done()
            await asyncio.to_thread(fleet.report, "busy", sim.url, 0.2)
            return await pending

    resp = asyncio.run(request_then_free_room())
    assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "busy"


def test_the_control_plane_needs_the_admin_token_when_one_is_configured(fleet):
    fleet.start_proxy(config="proxy:\n  admin_token: s3cret\n  worker_token: w0rker\n")
    assert fleet.http.get(fleet.url + "/workers").status_code == 200  # reading, on this machine
    assert fleet.http.get(fleet.url + "/workers", headers={"Authorization": "Bearer guess"}).status_code == 401
    admin = {"Authorization": "Bearer s3cret"}
    assert fleet.http.get(fleet.url + "/workers", headers=admin).status_code == 200
    registration = {"url": "http://127.0.0.1:9", "models": ["m1"]}
    assert fleet.http.post(fleet.url + "/workers", json=registration).status_code == 401
    ok = fleet.http.post(fleet.url + "/workers", json=registration, headers={"Authorization": "Bearer w0rker"})
    assert ok.status_code == 200
    # the worker token registers, but does not administer (a valid credential without the right: 403)
    assert fleet.http.post(f"{fleet.url}/workers/{ok.json()['worker_id']}/drain",
                           headers={"Authorization": "Bearer w0rker"}).status_code == 403
    assert fleet.http.post(fleet.url + "/nodes/add", json={"url": "http://x"}).status_code == 401
    assert fleet.http.get(fleet.url + "/health").status_code == 200  # not guarded


def test_kvroute_proxy_refuses_an_unknown_policy_or_a_bad_config(procs, tmp_path):
    bad_policy = procs.kvroute("proxy", "--port", "0", "--policy", "fastest", name="bad-policy")
    assert bad_policy.popen.wait(30) == 2
    assert "unknown policy 'fastest'" in bad_policy.log()
    config = tmp_path / "bad.yaml"
    config.write_text("proxy:\n  retries: -1\n")
    bad_config = procs.kvroute("proxy", "--port", "0", "--config", str(config), name="bad-config")
    assert bad_config.popen.wait(30) == 2
    assert "proxy.retries (line 2)" in bad_config.log()
