"""Timeouts, static workers and the ops endpoints, against real processes."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.e2e.test_forwarding import sse_events

pytestmark = pytest.mark.timeout(120)

IDLE_TIMEOUT = "proxy:\n  timeouts:\n    first_byte_s: 30\n    idle_s: 1.0\n"
# a non-streamed answer has one deadline, total_s (its head comes with the whole answer)
FIRST_BYTE_TIMEOUT = "proxy:\n  timeouts:\n    connect_s: 1.0\n    first_byte_s: 2.0\n    total_s: 2.0\n"


def test_a_stream_that_stalls_ends_with_an_error_after_the_idle_timeout(fleet):
    fleet.start_proxy(config=IDLE_TIMEOUT)
    (sim,) = fleet.start_sims(1, time_scale=1.0, extra=("--stall-after", "1"))
    body = {"model": "m1", "stream": True, "max_tokens": 2000, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", timeout=30, json=body) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        raw = next(chunks)  # like vLLM, the sim's first chunk comes with the first token
        # a second request freezes the engine mid-stream (--stall-after 1): no more tokens for anyone
        with pytest.raises(httpx.TimeoutException):
            httpx.post(sim.url + "/v1/chat/completions", timeout=0.5, json=body | {"stream": False})
        raw += b"".join(chunks)
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    assert orjson.loads(events[-2])["error"]["message"].endswith("(idle_timeout).")
    fleet.wait_workers(lambda ws: ws[0]["in_flight"] == 0, what="in-flight back to 0")


def test_a_worker_that_never_answers_costs_a_504_not_a_rerun_and_its_breaker_opens(fleet):
    fleet.start_proxy(config=FIRST_BYTE_TIMEOUT)
    (stalled,) = fleet.start_sims(1, extra=("--stall-after", "0"), prefix="stalled")
    # it took the request and may still be running it: no second worker runs it again (retry_policy)
    alone = fleet.chat("q")
    assert alone.status_code == 504 and alone.json()["error"]["code"] == "worker_timeout"
    assert alone.headers["x-kvroute-worker"] == stalled.worker_id
    (good,) = fleet.start_sims(1, prefix="good")
    # idle twins tie, and a tie is broken at random: the stalled one keeps getting its share until its
    # breaker opens on the third timeout in a row (the one above and two more)
    responses = []
    for i in range(10):
        responses.append(fleet.chat(f"q{i}"))
        if sum(r.status_code == 504 for r in responses) == 2:
            break
    timeouts = [r for r in responses if r.status_code == 504]
    assert {r.status_code for r in responses} <= {200, 504}
    assert {r.headers["x-kvroute-worker"] for r in timeouts} <= {stalled.worker_id}  # never rerun on good
    assert {r.headers["x-kvroute-worker"] for r in responses if r.status_code == 200} <= {good.worker_id}
    if len(timeouts) == 2:  # (at 1 in 2 per request, fewer than two in ten is a 1% case: nothing to check)
        assert fleet.worker(stalled.worker_id)["breaker_open"]
        # while it is open (2 s at first) everything goes to the good worker
        after = [fleet.chat(f"after{i}") for i in range(4)]
        assert [(r.status_code, r.headers["x-kvroute-worker"]) for r in after] == [(200, good.worker_id)] * 4


def test_static_workers_from_the_config_are_scraped_and_served(fleet):
    sims = fleet.start_sims(2, register=False, prefix="static")
    config = "proxy:\n  static_workers:\n" + "".join(
        f"    - url: {s.url}\n" + ("      models: [m1]\n" if i == 0 else "") for i, s in enumerate(sims))
    fleet.start_proxy(config=config)
    workers = fleet.wait_workers(lambda ws: len(ws) == 2 and all(w["reading_source"] == "metrics" for w in ws),
                                 what="static workers added and scraped")
    assert {w["source"] for w in workers} == {"static"}
    assert {w["state"] for w in workers} == {"ready"}
    assert fleet.chat().status_code == 200
    sims[0].proc.stop()
    fleet.wait_workers(lambda ws: sorted(w["state"] for w in ws) == ["ready", "unhealthy"],
                       what="the stopped static worker marked unhealthy")
    assert [fleet.chat(f"q{i}").status_code for i in range(3)] == [200] * 3


def test_health_ready_and_metrics(fleet):
    fleet.start_proxy()
    assert fleet.http.get(fleet.url + "/health").status_code == 200
    assert fleet.http.get(fleet.url + "/ready").status_code == 503  # no worker yet
    (sim,) = fleet.start_sims(1)
    assert fleet.http.get(fleet.url + "/ready").json()["ready_workers"] == 1
    assert fleet.chat().status_code == 200
    assert fleet.chat(model="nope").status_code == 404
    text = fleet.http.get(fleet.url + "/metrics").text
    for needle in (f'kvroute:requests_total{{model="m1",status="200",worker="{sim.worker_id}"}} 1.0',
                   'kvroute:request_latency_seconds_bucket{le="0.005",model="m1"}',
                   'kvroute:time_to_first_byte_seconds_count{model="m1"} 1.0',
                   f'kvroute:routing_decisions_total{{policy="kv_aware",reason="lowest_cost",worker="{sim.worker_id}"}} 1.0',
                   'kvroute:rejections_total{model="other",reason="model_not_found"} 1.0',  # unknown names: other
                   f'kvroute:worker_in_flight{{worker="{sim.worker_id}"}} 0.0',
                   f'kvroute:worker_kv_usage{{worker="{sim.worker_id}"}}',
                   f'kvroute:worker_queue{{worker="{sim.worker_id}"}}',
                   f'kvroute:worker_state{{state="ready",worker="{sim.worker_id}"}} 1.0'):
        assert needle in text, needle


def test_a_client_that_stops_reading_a_stream_is_dropped_after_the_idle_timeout(fleet):
    """A stalled reader must not hold a worker's slot forever: after idle_s of blocked writes the proxy
    drops the client, cancels the upstream request and its in-flight count returns to 0."""
    import socket

    fleet.start_proxy(config=IDLE_TIMEOUT)
    (sim,) = fleet.start_sims(1, time_scale=50.0, extra=("--preset", "h100-qwen3-vl-8b"))
    body = orjson.dumps({"model": "m1", "stream": True, "max_tokens": 30000, "ignore_eos": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    host, port = fleet.url.removeprefix("http://").split(":")
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    try:
        reader.connect((host, int(port)))
        reader.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        fleet.wait_workers(lambda ws: ws[0]["in_flight"] == 1, what="the stream to start")
        # ~30000 SSE chunks (megabytes) cannot fit in the socket buffers; nobody reads them.
        fleet.wait_workers(lambda ws: ws[0]["in_flight"] == 0, timeout=60, what="the stalled client to be dropped")
        state = httpx.get(sim.url + "/sim/state", timeout=5).json()
        assert state["num_running"] == 0 and state["num_waiting"] == 0  # the worker stopped generating
    finally:
        reader.close()
