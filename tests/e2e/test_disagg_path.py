"""A disaggregated model's requests through a real proxy and real sim workers in vLLM's NIXL protocol.

The proxy sends a split request to a prefill worker (one token, do_remote_decode), hands the params of its answer
to a decode worker, and relays that worker's answer: the client sees one ordinary answer naming both workers. A
prefill worker that dies is replaced unseen; a decode worker that dies before its first byte is replaced, with the
same KV when nobody can have pulled it, else after a fresh prefill; one that dies mid-stream hands the rest over
by migration. Conditional disaggregation keeps a short prompt on one worker. Every test ends with no KV held for
transfer on any prefill worker, and none freed by a lease running out: the proxy released what it abandoned.
"""

from __future__ import annotations

import json
import signal

import httpx
import orjson
import pytest

from tests.e2e.test_forwarding import sse_events
from tests.observability.test_tracing import Collector
from tests.proxy.dataplane.test_migration import migrations_metric
from tests.sim.conftest import png_data_url
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)

KV = ("--kv-transfer", json.dumps({"connector": "NixlConnector", "kv_role": "kv_both", "link": "rdma-400g"}))
ALWAYS = "proxy: {routing: {disagg: {split: always}}}\n"
LONG = " ".join(f"line {i} of a long report on the harbour's boats and tides" for i in range(60))


def sim_state(sim) -> dict:
    return httpx.get(sim.url + "/sim/state", timeout=10).json()


def start(fleet, config: str, prefill: tuple = ((),), decode: tuple = ((),), time_scale: float = 20.0) -> tuple:
    """A proxy and sims started in order (each registers before the next starts, so ties in the decision go
    to the first): prefill workers p0.., decode workers d0.., each with its own extra flags."""
    fleet.start_proxy(config=config)
    ps = [fleet.start_sims(1, time_scale=time_scale, extra=("--role", "prefill", *KV, *extra), prefix=f"p{i}")[0]
          for i, extra in enumerate(prefill)]
    ds = [fleet.start_sims(1, time_scale=time_scale, extra=("--role", "decode", *KV, *extra), prefix=f"d{i}")[0]
          for i, extra in enumerate(decode)]
    return ps, ds


def nothing_held(prefill_sims) -> None:
    """No prefill worker holds KV for a transfer any more, and none was freed by its lease (30 s): pulled or
    released by the proxy."""
    for sim in prefill_sims:
        if not sim.proc.alive():
            continue
        state = wait_until(lambda s=sim: (st := sim_state(s))["blocks_held_for_transfer"] == 0 and st, 15,
                           what=f"{sim.worker_id} to hold no KV for transfer")
        assert state["kv_transfer"]["lease_timeouts"] == 0 and state["used_blocks"] == 0


def test_a_split_request_runs_prefill_then_decode_and_the_client_sees_one_answer(fleet):
    (p,), (d,) = start(fleet, ALWAYS)
    whole = fleet.chat(LONG, max_tokens=8)
    assert whole.status_code == 200, whole.text
    assert whole.headers["x-kvroute-worker"] == "p0-0,d0-0"
    body = whole.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["usage"]["completion_tokens"] == 8
    prompt = body["usage"]["prompt_tokens"]
    assert prompt > 512

    streamed = fleet.http.post(fleet.url + "/v1/chat/completions", json={
        "model": "m1", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": LONG + " again"}]})
    assert streamed.status_code == 200 and streamed.headers["x-kvroute-worker"] == "p0-0,d0-0"
    chunks = [orjson.loads(e) for e in sse_events(streamed.content) if e != b"[DONE]"]
    assert sse_events(streamed.content)[-1] == b"[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 6

    # the prefill worker computed each prompt once for one token, not streamed; the decode worker pulled the KV
    p_state, d_state = sim_state(p), sim_state(d)
    assert p_state["requests_received"] == 2 and p_state["generated_tokens"] == 2
    assert p_state["kv_transfer"]["transfers_sent"] == 2 == d_state["kv_transfer"]["transfers_received"]
    assert d_state["generated_tokens"] == 14
    assert d_state["kv_transfer"]["bytes_received"] == p_state["kv_transfer"]["bytes_sent"] > 0
    nothing_held([p])

    # an admin asking why sees the plan (debug header), and the access log names both workers
    debug = fleet.http.post(fleet.url + "/v1/chat/completions", headers={"x-kvroute-debug": "1", **fleet.admin()},
                            json={"model": "m1", "max_tokens": 2, "messages": [{"role": "user", "content": LONG}]})
    decision = debug.headers["x-kvroute-decision"]
    assert "policy=disagg" in decision and 'plan="prefill on p0-0, decode on d0-0' in decision
    log = wait_until(lambda: [json.loads(line.split("kvroute.access: ", 1)[1]) for line in fleet.proxy.log().splitlines()
                              if "kvroute.access: " in line], 10, what="access log lines")
    assert {entry["worker"] for entry in log} == {"p0-0,d0-0"} and {entry["retries"] for entry in log} == {0}
    nothing_held([p])


def test_conditional_disaggregation_keeps_a_short_prompt_where_it_decodes(fleet):
    (p,), (d,) = start(fleet, "proxy: {}\n")
    resp = fleet.chat("What time is it?", max_tokens=4)
    assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "d0-0"
    assert sim_state(p)["requests_received"] == 0
    nothing_held([p])


def test_a_prefill_worker_that_dies_before_answering_is_replaced_without_the_client_noticing(fleet):
    ps, (d,) = start(fleet, ALWAYS, prefill=(("--crash-after", "0"), ()))
    bad, good = ps
    resp = fleet.chat(LONG, max_tokens=5)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvroute-worker"] == "p1-0,d0-0"
    assert resp.json()["usage"]["completion_tokens"] == 5
    wait_until(lambda: not bad.proc.alive(), 10, what="the first prefill worker to have died")
    nothing_held([good])


def test_a_decode_worker_that_dies_before_its_first_byte_hands_the_same_kv_to_another(fleet):
    (p,), ds = start(fleet, ALWAYS, decode=(("--crash-after", "0"), ()))
    resp = fleet.http.post(fleet.url + "/v1/chat/completions", json={
        "model": "m1", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": LONG}]})
    assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "p0-0,d1-0"
    assert sse_events(resp.content)[-1] == b"[DONE]"
    assert not ds[0].proc.alive()
    # no byte came back from the first: nobody can have pulled the KV, so the second pulled it, no new prefill
    state = sim_state(p)
    assert state["requests_received"] == 1 and state["kv_transfer"]["transfers_sent"] == 1
    nothing_held([p])


def test_a_decode_failure_that_may_have_pulled_the_kv_releases_it_and_prefills_afresh(fleet):
    (p,), ds = start(fleet, ALWAYS, decode=(("--crash-after", "0"), ()))
    resp = fleet.chat(LONG, max_tokens=5)  # not streamed: a worker's silence says nothing about its pull
    assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "p0-0,d1-0"
    state = sim_state(p)
    assert state["requests_received"] == 2  # a fresh prefill for the second decode worker
    assert state["kv_transfer"]["transfers_sent"] == 1  # the first prefill's KV was released, never pulled
    nothing_held([p])


def test_kv_a_prefill_worker_holds_for_a_request_the_proxy_gives_up_on_is_released(fleet):
    (p,), ds = start(fleet, "proxy: {retries: 0, routing: {disagg: {split: always}}}\n",
                     decode=(("--crash-after", "0"), ()))
    resp = fleet.http.post(fleet.url + "/v1/chat/completions", json={
        "model": "m1", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": LONG}]})
    assert resp.status_code >= 500  # no retry allowed: the client gets the failure
    assert sim_state(p)["requests_received"] == 1
    nothing_held([p])  # released through the other decode worker at once, not after the 30 s lease


def test_a_decode_worker_that_dies_mid_stream_hands_the_rest_over_by_migration(fleet):
    (p,), ds = start(fleet, ALWAYS, decode=((), ()), time_scale=1.0)
    by_id = {s.worker_id: s for s in ds}
    received = b""
    body = {"model": "m1", "max_tokens": 80, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": LONG}]}
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        prefill_id, decode_id = resp.headers["x-kvroute-worker"].split(",")
        assert prefill_id == "p0-0"
        victim = by_id[decode_id]
        for piece in resp.iter_raw():
            received += piece
            if victim.proc.alive() and received.count(b"\n\n") >= 10:
                victim.proc.signal(signal.SIGKILL)
    events = sse_events(received)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 80  # one answer, whole, across two decode workers
    assert len({c["id"] for c in chunks}) == 1
    assert migrations_metric(fleet, "continued") == 1
    survivor = next(s for s in ds if s is not victim)
    assert sim_state(survivor)["requests_received"] == 1
    nothing_held([p])


def test_an_image_is_encoded_on_the_encode_worker_first_and_its_output_goes_to_the_prefill_worker(fleet):
    ec = ("--ec-transfer", json.dumps({"connector": "ECExampleConnector", "extra": {}, "options": {}}))
    (p,), (d,) = start(fleet, ALWAYS, prefill=(ec,), decode=(ec,))
    (e,) = fleet.start_sims(1, time_scale=20.0, extra=("--role", "encode", *KV, *ec), prefix="e0")
    image = {"type": "image_url", "image_url": {"url": png_data_url(256, 256)}}
    for question in ("What is in the picture?", "Which colour is it?"):  # one image, two prompts
        resp = fleet.chat([{"type": "text", "text": question}, image, {"type": "text", "text": LONG}], max_tokens=4)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvroute-worker"] == "e0-0,p0-0,d0-0"
        assert resp.json()["usage"]["completion_tokens"] == 4
    encoder = sim_state(e)["encoder"]
    assert (encoder["cache_misses"], encoder["cache_hits"]) == (1, 1)  # the same image: encoded once
    assert sim_state(p)["encoder"]["outputs_received"] == 2  # the prefill worker fetched it instead of encoding
    assert sim_state(d)["encoder"]["outputs_received"] == 0  # the decode worker got the image's KV with the rest
    nothing_held([p])


def test_the_trace_of_a_split_request_shows_the_plan_and_one_upstream_span_per_leg(fleet):
    collector = Collector()
    try:
        (p,), (d,) = start(fleet, ALWAYS.replace("proxy: {", f"proxy: {{otlp_endpoint: '{collector.url}', "))
        assert fleet.chat(LONG, max_tokens=3).status_code == 200
        spans = wait_until(lambda: (s := list(collector.spans)) and len([x for x in s if x.name == "upstream"]) == 2
                           and s, 20, what="the request's spans at the collector")
    finally:
        collector.close()
    attributes = [(s.name, {a.key: a.value for a in s.attributes}) for s in spans]
    legs = {(a["kvroute.stage"].string_value, a["kvroute.worker"].string_value) for name, a in attributes
            if name == "upstream"}
    assert legs == {("prefill", "p0-0"), ("decode", "d0-0")}
    attributes = dict(a for a in attributes if a[0] != "upstream")
    assert attributes["route"]["kvroute.plan"].string_value.startswith("prefill on p0-0, decode on d0-0")
    assert attributes["kvroute.request"]["kvroute.retries"].int_value == 0
    nothing_held([p])
