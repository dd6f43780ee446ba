"""Forwarding through a real proxy process: byte-identical streams, failover, broken streams, disconnects."""

from __future__ import annotations

import re
import signal

import httpx
import openai
import orjson
import pytest

from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)

_VOLATILE = re.compile(rb'"id":"[^"]*"|"created":\d+')


def normalised(raw: bytes) -> bytes:
    """The sim's per-response id and creation time differ on every call; everything else may not."""
    return _VOLATILE.sub(b"<volatile>", raw)


def chat_body(stream: bool, max_tokens: int = 24) -> dict:
    return {"model": "m1", "stream": stream, "max_tokens": max_tokens, "seed": 7,
            "stream_options": {"include_usage": True} if stream else None,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]}


def test_a_streamed_answer_through_the_proxy_is_byte_identical_to_a_direct_one(fleet):
    fleet.start_proxy()
    (sim,) = fleet.start_sims(1)
    for stream in (True, False):
        body = chat_body(stream)
        direct = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=30)
        proxied = httpx.post(fleet.url + "/v1/chat/completions", json=body, timeout=30)
        assert proxied.status_code == direct.status_code == 200
        assert proxied.headers["content-type"] == direct.headers["content-type"]
        assert normalised(proxied.content) == normalised(direct.content)
        assert proxied.headers["x-kvroute-worker"] == sim.worker_id
        assert proxied.content.endswith(b"data: [DONE]\n\n") == stream


def test_the_request_id_is_honoured_and_each_decision_is_logged_with_its_scores(fleet, procs):
    fleet.start_proxy("--log-level", "debug")
    sims = fleet.start_sims(2)
    resp = fleet.http.post(fleet.url + "/v1/chat/completions", json=chat_body(False),
                           headers={"x-request-id": "my-id-42"})
    assert resp.headers["x-request-id"] == "my-id-42"
    generated = fleet.chat()
    assert len(generated.headers["x-request-id"]) >= 16
    proxy_log = next(p for p in procs.procs if p.name == "proxy").log()
    decision = next(line for line in proxy_log.splitlines() if "kvroute.routing.kv_aware" in line)
    for sim in sims:
        assert f"{sim.worker_id}: cost=" in decision
    assert f"-> {resp.headers['x-kvroute-worker']}" in decision


def test_the_openai_client_works_streaming_and_not(fleet):
    fleet.start_proxy()
    fleet.start_sims(2)
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    try:
        reply = client.chat.completions.create(model="m1", max_tokens=6,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
        assert reply.usage.completion_tokens == 6
        chunks = list(client.chat.completions.create(model="m1", max_tokens=6, stream=True,
                                                     messages=[{"role": "user", "content": "hi"}]))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].choices[0].finish_reason == "length"
        completion = client.completions.create(model="m1", prompt="Once upon a time", max_tokens=5)
        assert completion.choices[0].text
        assert [m.id for m in client.models.list().data] == ["m1"]
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert info.value.code == "model_not_found"
    finally:
        client.close()


def test_a_worker_that_is_down_before_the_request_is_invisible_to_the_client(fleet):
    fleet.start_proxy()
    dead, alive = fleet.start_sims(2)
    dead.proc.signal(signal.SIGKILL)  # no deregistration: the proxy still believes it is ready
    dead.proc.popen.wait(10)
    responses = [fleet.chat(f"question {i}") for i in range(12)]
    assert [r.status_code for r in responses] == [200] * 12
    assert {r.headers["x-kvroute-worker"] for r in responses} == {alive.worker_id}
    # and the proxy stops trying it: stale, then unhealthy once its /health probe fails
    fleet.wait_workers(lambda ws: any(w["worker_id"] == dead.worker_id and w["state"] == "unhealthy" for w in ws),
                       timeout=15, what="the dead worker to be marked unhealthy")
    metrics = fleet.http.get(fleet.url + "/metrics").text
    assert 'kvroute:retries_total{model="m1",reason="connect_error"}' in metrics


def sse_events(raw: bytes) -> list[bytes]:
    return [e[len(b"data: "):] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_event_and_done(fleet):
    fleet.start_proxy()
    (sim,) = fleet.start_sims(1, time_scale=1.0)
    received = b""
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=chat_body(True, max_tokens=2000),
                      timeout=httpx.Timeout(20.0)) as resp:
        assert resp.status_code == 200
        for chunk in resp.iter_raw():
            received += chunk
            if received.count(b"\n\n") == 5 and sim.proc.alive():
                sim.proc.signal(signal.SIGKILL)
    events = sse_events(received)
    assert events[-1] == b"[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == "worker_failed" and error["type"] == "server_error"
    assert len(events) < 1000  # it really was cut short, not finished
    fleet.wait_workers(lambda ws: ws[0]["in_flight"] == 0, what="in-flight back to 0")


def sim_running(sim_url: str) -> float:
    text = httpx.get(sim_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def test_a_client_disconnect_returns_in_flight_to_zero_and_cancels_the_worker_request(fleet):
    fleet.start_proxy()
    (sim,) = fleet.start_sims(1, time_scale=1.0)
    # streaming: read a little, then hang up
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=chat_body(True, max_tokens=2000),
                      timeout=20) as resp:
        chunks = resp.iter_raw()
        assert next(chunks).startswith(b"data: ")
        assert fleet.workers()[0]["in_flight"] == 1
    fleet.wait_workers(lambda ws: ws[0]["in_flight"] == 0, what="in-flight back to 0 after a stream disconnect")
    wait_until(lambda: sim_running(sim.url) == 0, 10, what="the sim to stop generating")
    # not streaming: give up while the worker is still generating
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fleet.url + "/v1/chat/completions", json=chat_body(False, max_tokens=2000), timeout=1.0)
    fleet.wait_workers(lambda ws: ws[0]["in_flight"] == 0, what="in-flight back to 0 after a disconnect")
    wait_until(lambda: sim_running(sim.url) == 0, 10, what="the sim to stop generating")


def test_500s_before_the_first_byte_move_to_another_worker(fleet):
    fleet.start_proxy()
    fleet.start_sims(1, extra=("--fail-rate", "1.0"), prefix="failing")
    (good,) = fleet.start_sims(1, prefix="good")
    responses = [fleet.chat(f"q{i}") for i in range(10)]
    assert [r.status_code for r in responses] == [200] * 10
    assert {r.headers["x-kvroute-worker"] for r in responses} == {good.worker_id}


def test_lmdeploy_nodes_add_registers_a_worker_and_its_metrics_are_scraped(fleet):
    fleet.start_proxy()
    with_status, url_only = fleet.start_sims(2, register=False)
    lmdeploy_payload = {"url": with_status.url, "status": {"models": ["m1"], "role": "Hybrid"}}
    assert fleet.http.post(fleet.url + "/nodes/add", json=lmdeploy_payload).status_code == 200
    added = fleet.http.post(fleet.url + "/nodes/add", json={"url": url_only.url})
    assert added.status_code == 200 and added.json()["models"] == ["m1"]  # probed from its /v1/models
    workers = fleet.wait_workers(lambda ws: len(ws) == 2 and all(w["reading_source"] == "metrics" for w in ws),
                                 what="both nodes scraped")
    assert {w["url"] for w in workers} == {with_status.url, url_only.url}
    assert {w["reports"] for w in workers} == {False}
    served = {fleet.chat(f"q{i}").headers["x-kvroute-worker"] for i in range(6)}
    assert served <= {w["worker_id"] for w in workers}
    status = fleet.http.get(fleet.url + "/nodes/status").json()
    assert status[with_status.url]["models"] == ["m1"]
    assert fleet.http.post(fleet.url + "/nodes/remove", params={"node_url": url_only.url},
                           headers=fleet.admin()).status_code == 200
    assert [w["url"] for w in fleet.workers()] == [with_status.url]
    refused = fleet.http.post(fleet.url + "/nodes/add", json={"url": "http://127.0.0.1:9"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "worker_unreachable"


def test_a_sim_that_stops_deregisters_and_a_drained_worker_takes_no_new_work(fleet):
    fleet.start_proxy()
    first, second = fleet.start_sims(2)
    assert fleet.http.post(f"{fleet.url}/workers/{first.worker_id}/drain", headers=fleet.admin()).json()["state"] == "draining"
    assert {fleet.chat(f"q{i}").headers["x-kvroute-worker"] for i in range(5)} == {second.worker_id}
    second.proc.signal(signal.SIGTERM)
    fleet.wait_workers(lambda ws: [w["worker_id"] for w in ws] == [first.worker_id], what="deregistration")
    assert fleet.chat().status_code == 503


def test_a_worker_that_crashes_on_arrival_is_invisible_to_a_streaming_client(fleet):
    fleet.start_proxy("--policy", "round_robin")  # deterministic: the crashing worker gets its turn
    (crashing,) = fleet.start_sims(1, extra=("--crash-after", "0"), prefix="crashing")
    (good,) = fleet.start_sims(1, prefix="good")
    for i in range(6):
        resp = fleet.http.post(fleet.url + "/v1/chat/completions", json={**chat_body(True), "seed": i})
        assert resp.status_code == 200
        assert resp.headers["x-kvroute-worker"] == good.worker_id
        assert sse_events(resp.content)[-1] == b"[DONE]" and b'"error"' not in resp.content
    assert not crashing.proc.alive()  # it did get (and drop) a request
