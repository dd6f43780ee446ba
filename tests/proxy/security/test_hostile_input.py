"""Hostile or careless callers: odd bodies, odd headers, bad registrations. Clear errors, nothing crashes, nothing hangs."""

from __future__ import annotations

import sys

import httpx
import orjson
import pytest

from proxy.errors import ProxyError
from proxy.observability.metrics import MAX_MODEL_LABELS
from proxy.request import CHAT, parse_request
from proxy.workers.engine_metrics import parse_engine_metrics
from tests.support.procs import free_port, wait_http_ok, wait_until

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- parsing, in process -------------------------------------------------------------------------
@pytest.mark.parametrize("part_type", [5, ["image_url"], {"a": 1}, None])
def test_a_content_part_whose_type_is_not_a_string_is_a_400(part_type):
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [{"type": part_type}]}]})
    with pytest.raises(ProxyError) as err:
        parse_request(body, CHAT)
    assert err.value.status == 400 and err.value.param == "messages[0].content"


@pytest.mark.parametrize("field", [b'"name"', b'"tool_calls"'])
def test_deep_nesting_orjson_reads_but_cannot_write_back_is_a_400(field):
    # orjson parses up to 1024 levels but writes at most 255: re-encoding used to raise past the handler.
    body = b'{"model":"m","messages":[{"role":"user","content":"x",' + field + b":" + nested(500) + b"}]}"
    with pytest.raises(ProxyError) as err:
        parse_request(body, CHAT)
    assert err.value.status == 400


def test_an_alias_request_with_deep_nesting_elsewhere_is_a_400_not_a_crash():
    body = b'{"model":"alias","messages":[{"role":"user","content":"x"}],"tools":' + nested(500) + b"}"
    routed = parse_request(body, CHAT)
    assert routed.body_for_model("alias") == body  # the served name itself: bytes untouched
    with pytest.raises(ProxyError) as err:
        routed.body_for_model("served")
    assert err.value.status == 400


def test_a_bad_max_completion_tokens_is_named_in_the_error():
    body = orjson.dumps({"model": "m", "messages": HELLO, "max_completion_tokens": "many"})
    with pytest.raises(ProxyError) as err:
        parse_request(body, CHAT)
    assert err.value.param == "max_completion_tokens"


# --- against a real proxy ------------------------------------------------------------------------
def test_malformed_bodies_get_openai_errors_from_a_running_proxy(fleet):
    fleet.start_proxy()
    fleet.start_sims(1)
    url = fleet.url + "/v1/chat/completions"
    cases = {
        "part type": orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": [{"type": 7}]}]}),
        "deep name": b'{"model":"m1","messages":[{"role":"user","content":"x","name":' + nested(400) + b"}]}",
        "too deep": b'{"model":"m1","messages":' + nested(5000) + b"}",
    }
    for what, body in cases.items():
        resp = fleet.http.post(url, content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400, (what, resp.text)
        assert error_of(resp)["type"] == "invalid_request_error"
    assert fleet.chat().status_code == 200


def test_unknown_model_names_are_counted_as_other_however_many_and_however_long(fleet):
    # Issue 33, item 5: 8 requests with 8 MiB model names made /metrics 288 MiB (the label cap bounded how
    # many names, not how long). Unknown names, which clients choose, now never become a label.
    fleet.start_proxy()
    fleet.start_sims(1)
    for i in range(MAX_MODEL_LABELS + 6):
        assert fleet.chat(model=f"made-up-{i}").status_code == 404
    for i in range(8):
        assert fleet.chat(model=f"{i}" + "x" * (1 << 20), max_tokens=1).status_code == 404
    assert fleet.chat().status_code == 200
    served = 'kvroute:requests_total{model="m1",status="200",worker="sim-0"} 1.0'  # recorded as the answer ends
    metrics = wait_until(lambda: (lambda text: text if served in text else None)(
        fleet.http.get(fleet.url + "/metrics").text), 10, what="the served request in /metrics")
    assert "made-up" not in metrics and "xxxxxxxx" not in metrics and len(metrics) < 256 * 1024
    assert f'kvroute:rejections_total{{model="other",reason="model_not_found"}} {MAX_MODEL_LABELS + 14}.0' in metrics


def test_a_plain_request_id_is_kept_and_an_unusable_one_replaced(fleet):
    fleet.start_proxy()
    fleet.start_sims(1)
    kept = fleet.http.post(
        fleet.url + "/v1/chat/completions", json={"model": "m1", "messages": HELLO, "max_tokens": 2},
        headers={"x-request-id": "trace-42.a"})
    assert kept.status_code == 200 and kept.headers["x-request-id"] == "trace-42.a"
    for bad in ("r" * 5000, "two words", "caf\u00e9".encode().decode("latin-1")):
        resp = fleet.http.post(fleet.url + "/v1/chat/completions",
                               json={"model": "m1", "messages": HELLO, "max_tokens": 2},
                               headers={"x-request-id": bad.encode("latin-1")})
        assert resp.status_code == 200
        replaced = resp.headers["x-request-id"]
        assert replaced != bad and 0 < len(replaced) <= 128 and replaced.isalnum()


def test_a_worker_url_pointing_at_the_proxy_itself_is_refused_at_registration(fleet):
    fleet.start_proxy()
    fleet.start_sims(1)
    # (A loop through a chain of proxies is still cut at request time: 508 loop_detected.)
    resp = fleet.http.post(fleet.url + "/workers", json={"worker_id": "itself", "url": fleet.url,
                                                         "models": ["looped"], "reports": False})
    assert resp.status_code == 403 and error_of(resp)["code"] == "url_not_allowed"
    assert "itself" not in {w["worker_id"] for w in fleet.workers()}
    assert fleet.chat().status_code == 200  # the real worker is unaffected


def test_nodes_add_with_models_as_a_string_asks_the_worker_instead_of_splitting_letters(fleet):
    fleet.start_proxy()
    (sim,) = fleet.start_sims(1, register=False)
    resp = fleet.http.post(fleet.url + "/nodes/add", json={"url": sim.url, "status": {"models": "m1"}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["models"] == ["m1"]


# A worker that answers every POST with a 500 whose body breaks off, and GETs with 200 so it looks healthy.
BROKEN_500 = r"""
import asyncio, sys
async def serve(reader, writer):
    head = await reader.readuntil(b"\r\n\r\n")
    length = [int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")]
    if length:
        await reader.readexactly(length[0])
    if head.startswith(b"POST"):
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"error\": ")
    else:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]))
    print("listening", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def test_a_5xx_whose_body_breaks_off_is_retried_on_another_worker(fleet, procs):
    fleet.start_proxy("--policy", "round_robin")
    (sim,) = fleet.start_sims(1, register=False)
    port = free_port()
    procs.start([sys.executable, "-c", BROKEN_500, str(port)], name="broken500")
    broken = f"http://127.0.0.1:{port}"
    wait_http_ok(broken + "/health", timeout=20)
    fleet.register("broken", broken)
    fleet.register("good", sim.url)
    fleet.wait_workers(lambda ws: len(ws) == 2, what="two workers")
    served_by = set()
    for _ in range(4):  # round robin: at least two of these try the broken worker first
        resp = fleet.chat(max_tokens=2)
        assert resp.status_code == 200, resp.text
        served_by.add(resp.headers["x-kvroute-worker"])
    assert served_by == {"good"}


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "not a url", "http://[::1", "ftp://host:21", "http://"])
def test_a_worker_url_that_cannot_work_is_refused_at_registration(fleet, url):
    fleet.start_proxy()
    resp = fleet.http.post(fleet.url + "/workers", json={"url": url, "models": ["m1"], "worker_id": "w"})
    assert resp.status_code == 400 and error_of(resp)["param"] == "url"
    resp = fleet.http.post(fleet.url + "/nodes/add", json={"url": url, "status": {"models": ["m1"]}})
    assert resp.status_code == 400 and error_of(resp)["param"] == "url"
    assert fleet.workers() == []


def test_nan_or_inf_samples_in_a_workers_metrics_are_skipped_not_raised():
    text = ("vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n"
            "vllm:num_requests_running{model_name=\"m\"} NaN\n"
            "vllm:num_requests_waiting{model_name=\"m\"} +Inf\n")
    reading = parse_engine_metrics(text)
    assert reading is not None and reading.kv_usage == 0.25
    assert (reading.num_running, reading.num_waiting) == (0, 0)
