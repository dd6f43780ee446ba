"""What a registrant or a worker says is bounded before it reaches a header, a log line, a metric or a view
(issue 33, items 2, 5, 7, 10, 12): each test is the attack, against the proxy app in process.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy import identifiers as ids
from proxy.app import REGISTRY_KEY, build_app
from proxy.config import parse_config
from proxy.errors import ProxyError
from proxy.protocol import INT64_MAX, MAX_KV_CAPACITY_TOKENS, MAX_REQUESTS, MAX_STEP_TOKENS
from proxy.security.clientauth import ClientAuth
from proxy.security.networks import canonical_url
from proxy.workers.engine_metrics import parse_engine_metrics
from proxy.workers.monitor import PROBE_MODELS_DEADLINE_S
from tests.support.procs import free_port

WORKER_TOKEN = "w0rker-t0ken"
CONFIG = f"proxy:\n  worker_token: {WORKER_TOKEN}\n  admin_token: adm1n\nmodels:\n  - {{name: m1, engine: sim}}\n"
AUTH = {"Authorization": f"Bearer {WORKER_TOKEN}"}
ADMIN = {"Authorization": "Bearer adm1n"}
VIEWS = ("/workers", "/v1/models", "/dashboard/state", "/nodes/status")


@pytest.fixture
async def proxy() -> AsyncIterator[TestClient]:
    client = TestClient(TestServer(build_app(parse_config(CONFIG, env={})), host="127.0.0.1"))
    await client.start_server()
    yield client
    await client.close()


def registration(**extra: object) -> dict[str, object]:
    return {"worker_id": "w1", "url": "http://127.0.0.1:9001", "models": ["m1"], "reports": True, **extra}


def report(**extra: object) -> dict[str, object]:
    return {"worker_id": "w1", "url": "http://127.0.0.1:9001", "models": ["m1"], "kv_cache_usage": 0.1,
            "kv_capacity_tokens": 1000, "num_running": 0, "num_waiting": 0, "seq": 1, "sent_at": time.time(),
            **extra}


async def post(client: TestClient, path: str, body: object, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, dict]:
    # json, not orjson: the attack sends integers past 64 bits, which orjson cannot write
    resp = await client.post(path, data=raw if raw is not None else json.dumps(body),
                             headers={"Content-Type": "application/json", **(headers or AUTH)})
    return resp.status, await resp.json(content_type=None)


async def views_answer(client: TestClient) -> None:
    for path in (*VIEWS, "/workers/w1"):
        resp = await client.get(path, headers=ADMIN)
        assert resp.status in (200, 404), (path, resp.status, await resp.text())
        orjson.loads(await resp.read())


# --- item 2: identifiers that reach headers and logs ------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("worker_id", "w1\r\nSet-Cookie: session=evil"), ("worker_id", "w1\nx"), ("worker_id", "w\x1b[31m"),
    ("worker_id", "a" * (ids.MAX_WORKER_ID_CHARS + 1)), ("worker_id", "../admin"), ("worker_id", "a/b"),
    ("models", ["m1\r\nX-Injected: 1"]), ("models", ["m" * (ids.MAX_MODEL_NAME_CHARS + 1)]),
    ("models", [f"m{i}" for i in range(ids.MAX_MODELS_PER_WORKER + 1)]),
    ("labels", {"role\r\n": "x"}), ("labels", {"role": "x\r\nSet-Cookie: a=b"}),
    ("labels", {f"k{i}": "v" for i in range(ids.MAX_LABELS + 1)}),
    ("url", "http://127.0.0.1:9001/\r\nHost: evil"), ("api_key", "k\r\nX-Injected: 1"), ("boot_id", "b\nx"),
])
async def test_a_registration_carrying_control_characters_or_too_long_an_identifier_is_a_clear_400(
        proxy, field, value):
    status, body = await post(proxy, "/workers", registration(**{field: value}))
    assert status == 400, body
    message = body["error"]["message"]
    assert message.startswith("Invalid body") and field in message and "\r" not in message and "\n" not in message
    assert proxy.server.app[REGISTRY_KEY].workers() == []


async def test_a_worker_id_with_crlf_is_refused_with_a_message_that_says_why(proxy):
    status, body = await post(proxy, "/workers", registration(worker_id="w1\r\nSet-Cookie: session=evil"))
    assert status == 400 and "control character" in body["error"]["message"]
    assert body["error"]["param"] == "worker_id"


async def test_identifiers_at_their_limits_are_accepted_and_every_view_serves_them(proxy):
    longest = "w" * ids.MAX_WORKER_ID_CHARS
    status, body = await post(proxy, "/workers", registration(
        worker_id=longest, models=["Qwen/Qwen3-VL-8B-Instruct", "m" * ids.MAX_MODEL_NAME_CHARS, "qwen3-vl:8b"],
        labels={"role": "décodé ✓", "k" * ids.MAX_LABEL_KEY_CHARS: "v" * ids.MAX_LABEL_VALUE_CHARS}))
    assert status == 200 and body["worker_id"] == longest
    await views_answer(proxy)


async def test_a_report_cannot_smuggle_what_registration_refuses(proxy):
    _, reg = await post(proxy, "/workers", registration())
    own = {"Authorization": f"Bearer {reg['worker_secret']}"}
    status, _ = await post(proxy, "/workers/w1/report", report(models=["m1\r\nX: y"]), own)
    assert status == 400
    status, _ = await post(proxy, "/workers/w1/report", report(url="http://127.0.0.1:9001/\n"), own)
    assert status == 400


async def test_lmdeploy_node_status_with_crlf_is_refused_before_any_probe(proxy):
    for status_body in ({"models": ["m1\r\nX: y"]}, {"role": "Hybrid\r\nSet-Cookie: a=b"}):
        started = time.monotonic()
        status, body = await post(proxy, "/nodes/add", {"url": "http://127.0.0.1:9", "status": status_body})
        assert status == 400 and body["error"]["code"] == "invalid_identifier", body
        assert time.monotonic() - started < 1.0  # refused on its face: nothing was probed
    assert proxy.server.app[REGISTRY_KEY].workers() == []


def test_caller_text_in_a_log_line_cannot_forge_lines_or_grow_them():
    assert ids.for_log("GET /\r\n[fake] line\x1b[2J") == "GET /\\x0d\\x0a[fake] line\\x1b[2J"
    assert ids.for_log("x" * 500, 10) == "x" * 10 + "..."


# --- item 7: numbers a view must be able to serialise ------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("kv_capacity_tokens", 2**64), ("kv_capacity_tokens", MAX_KV_CAPACITY_TOKENS + 1), ("max_model_len", 2**64),
    ("max_model_len", MAX_STEP_TOKENS + 1), ("kv_capacity_tokens", -1),
])
async def test_a_registration_with_an_integer_past_its_bound_is_refused_and_views_stay_up(proxy, field, value):
    status, body = await post(proxy, "/workers", registration(**{field: value}))
    assert status == 400 and field in body["error"]["message"], body
    await views_answer(proxy)


@pytest.mark.parametrize("field,value", [
    ("seq", 2**64), ("seq", INT64_MAX + 1), ("num_running", 2**64), ("num_running", MAX_REQUESTS + 1),
    ("num_waiting", 2**63), ("kv_capacity_tokens", 2**64), ("max_num_batched_tokens", 2**64),
    ("max_num_batched_tokens", MAX_STEP_TOKENS + 1), ("prefill_tokens_per_s", 1e300), ("decode_step_s", 1e9),
    ("sent_at", 1e300), ("kv_cache_usage", 1.5),
])
async def test_a_report_with_a_number_past_its_bound_is_refused_and_every_view_still_answers(proxy, field, value):
    _, reg = await post(proxy, "/workers", registration())
    own = {"Authorization": f"Bearer {reg['worker_secret']}"}
    status, body = await post(proxy, "/workers/w1/report", report(**{field: value}), own)
    assert status == 400 and field in body["error"]["message"], body
    await views_answer(proxy)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
async def test_non_finite_floats_in_a_report_are_refused(proxy, literal):
    _, reg = await post(proxy, "/workers", registration())
    own = {"Authorization": f"Bearer {reg['worker_secret']}"}
    raw = orjson.dumps(report(kv_cache_usage=0.25)).replace(b"0.25", literal)
    status, _ = await post(proxy, "/workers/w1/report", None, own, raw=raw)
    assert status == 400
    await views_answer(proxy)


async def test_numbers_at_their_bounds_are_taken_and_every_view_serialises_them(proxy):
    _, reg = await post(proxy, "/workers", registration(kv_capacity_tokens=MAX_KV_CAPACITY_TOKENS,
                                                         max_model_len=MAX_STEP_TOKENS))
    own = {"Authorization": f"Bearer {reg['worker_secret']}"}
    status, body = await post(proxy, "/workers/w1/report", report(
        seq=INT64_MAX, num_running=MAX_REQUESTS, num_waiting=MAX_REQUESTS, kv_capacity_tokens=MAX_KV_CAPACITY_TOKENS,
        max_num_batched_tokens=MAX_STEP_TOKENS, kv_cache_usage=1.0), own)
    assert status == 200, body
    await views_answer(proxy)
    models = await (await proxy.get("/v1/models")).json()
    assert {m["id"]: m["max_model_len"] for m in models["data"]}["m1"] == MAX_STEP_TOKENS


def test_an_engines_metrics_with_absurd_numbers_read_within_the_report_bounds():
    reading = parse_engine_metrics("vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_running 1e300\n"
                                   "vllm:num_requests_waiting -7\n"
                                   'vllm:cache_config_info{num_gpu_blocks="99999999999999999",block_size="16"} 1\n')
    assert reading is not None
    assert (reading.num_running, reading.num_waiting, reading.capacity_tokens) == (MAX_REQUESTS, 0, None)


# --- item 10: one canonical form per worker address ---------------------------------------------------------

@pytest.mark.parametrize("spelling", ["http://127.1:9001", "http://2130706433:9001", "http://0x7f.0.0.1:9001",
                                      "http://[::ffff:127.0.0.1]:9001", "http://017700000001:9001",
                                      "http://127.0.0.1:9001/"])
async def test_one_endpoint_cannot_register_twice_through_another_spelling_of_its_address(proxy, spelling):
    status, _ = await post(proxy, "/workers", registration(worker_id="w1"))
    assert status == 200
    status, body = await post(proxy, "/workers", registration(worker_id="w2", url=spelling))
    assert status == 409 and body["error"]["code"] == "worker_conflict", body
    urls = [w.url for w in proxy.server.app[REGISTRY_KEY].workers()]
    assert urls == ["http://127.0.0.1:9001"]


def test_canonical_urls():
    assert canonical_url("http://[0:0:0:0:0:0:0:1]:9/") == "http://[::1]:9"
    assert canonical_url("http://Worker-A.Example.:8101/v/") == "http://worker-a.example:8101/v"
    assert canonical_url("https://10.0.0.5") == "https://10.0.0.5:443"


# --- item 12: API keys as users type them --------------------------------------------------------------------

def test_api_keys_may_be_plain_strings_beside_entries():
    # `api_keys: [sk-abc]` was refused ("Input should be a valid dictionary"); vLLM users pass keys as strings
    config = parse_config("proxy:\n  api_keys: [sk-abc, {key: sk-def, models: [m1]}, 12345]\n", env={})
    assert [(k.key, k.models) for k in config.proxy.api_keys] == [("sk-abc", []), ("sk-def", ["m1"]), ("12345", [])]
    auth = ClientAuth.from_config(config, env={})
    assert auth.authenticate("Bearer sk-abc").models is None
    with pytest.raises(ProxyError) as refused:
        auth.authenticate("Bearer sk-nope")
    assert refused.value.status == 401


async def test_a_failed_node_probe_answers_at_one_fixed_time_whether_the_port_is_closed_or_silent(proxy):
    # Issue 33, item 10: /nodes/add answered in 2 ms for a closed port and after 4 s for an open, silent one.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes connections; nothing ever answers
    closed = free_port()

    async def timed(port: int) -> tuple[float, int, str]:
        started = time.monotonic()
        status, body = await post(proxy, "/nodes/add", {"url": f"http://127.0.0.1:{port}"})
        return time.monotonic() - started, status, body["error"]["code"]

    try:
        (t_closed, *closed_answer), (t_silent, *silent_answer) = await asyncio.gather(
            timed(closed), timed(silent.getsockname()[1]))
    finally:
        silent.close()
    assert closed_answer == silent_answer == [400, "worker_unreachable"]
    assert t_closed >= PROBE_MODELS_DEADLINE_S - 0.05 and t_silent >= PROBE_MODELS_DEADLINE_S - 0.05
    assert abs(t_closed - t_silent) < 0.5, (t_closed, t_silent)
