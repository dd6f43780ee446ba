"""Fuzzing a real proxy (and a sim worker behind it): bodies, headers, control-plane payloads, and
Schemathesis against its own /openapi.json. Never a 500, never a crash, never a traceback in its log.

Example counts are fixed and small (the module runs in well under a minute on two cores); the
examples are derandomized so a failure reproduces.
"""

from __future__ import annotations

import json
import string

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy import identifiers as ids
from proxy.api.openapi import build_document
from proxy.protocol import INT64_MAX, MAX_KV_CAPACITY_TOKENS, MAX_REQUESTS, MAX_STEP_TOKENS, MAX_UNIX_TIME
from tests.support.procs import ProcessGroup, free_port, wait_http_ok, wait_until

pytestmark = pytest.mark.timeout(180)

CONFIG = """
proxy:
  queue: {max_wait_s: 0.1}
  limits: {max_tokens: 8, max_workers: 64}
models:
  - {name: m1, engine: sim, replicas: 0, aliases: [m1-alias]}
"""
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class Proxy:
    def __init__(self, group: ProcessGroup, url: str, proc) -> None:
        self.group, self.url, self.proc = group, url, proc
        self.http = httpx.Client(timeout=15.0)
        self.secrets: dict[str, str] = {}

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(self.url + path, **kwargs)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    group = ProcessGroup(tmp)
    try:
        (tmp / "config.yaml").write_text(CONFIG)
        port = free_port()
        proc = group.kvroute("proxy", "--port", str(port), "--config", str(tmp / "config.yaml"), name="proxy")
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/health", timeout=30)
        sim_port = free_port()
        group.kvroute("worker", "--engine", "sim", "--port", str(sim_port), "--served-model-name", "m1",
                      "--time-scale", "50", "--proxy-url", url, "--worker-id", "fz-sim", name="sim")
        wait_until(lambda: any(w["worker_id"] == "fz-sim" and w["state"] == "ready"
                               for w in httpx.get(url + "/workers").json()["workers"]), 30, what="sim ready")
        p = Proxy(group, url, proc)
        yield p
        p.http.close()
        log = proc.log()
        assert proc.alive(), "the proxy died during fuzzing:\n" + log[-4000:]
        assert "Traceback" not in log, "the proxy logged a traceback:\n" + log[-6000:]
    finally:
        group.stop_all()


def assert_sane(proxy: Proxy, resp: httpx.Response) -> None:
    assert resp.status_code != 500 and resp.status_code < 600, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400 and resp.headers.get("content-type", "").startswith("application/json"):
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str)


# --- strategies ----------------------------------------------------------------------------------------

text = st.text(max_size=40)
json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | text
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(text, inner, max_size=4), max_leaves=12)
media_urls = st.sampled_from(["http://127.0.0.1:9/cat.png", "data:image/png;base64,iVBORw0KGgo=", "data:,",
                              "data:image/jpeg;base64,/9j/4AAQ", "", "file:///etc/passwd"]) | text
content_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text | json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "video_url", "input_audio", "image"])},
                          optional={"image_url": st.fixed_dictionaries({"url": media_urls}) | json_values,
                                    "video_url": st.fixed_dictionaries({"url": media_urls}) | json_values}),
    json_values,
)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | json_values},
    optional={"content": text | st.lists(content_parts, max_size=4) | json_values, "name": json_values,
              "tool_calls": json_values}), max_size=5) | json_values
common = {"model": st.sampled_from(["m1", "m1-alias", "nope", ""]) | json_values,
          "stream": st.booleans() | json_values,
          "max_tokens": st.integers(0, 12) | json_values,
          "user": text | json_values, "n": st.integers(-1, 3) | json_values}
chat_bodies = st.fixed_dictionaries({"model": common["model"], "messages": messages},
                                    optional={**{k: v for k, v in common.items() if k != "model"},
                                              "max_completion_tokens": json_values})
prompts = text | st.lists(text, max_size=3) | st.lists(st.integers(-5, 2**40), max_size=6) | json_values
completion_bodies = st.fixed_dictionaries({"model": common["model"], "prompt": prompts},
                                          optional={k: v for k, v in common.items() if k != "model"})
raw_bodies = st.binary(max_size=200) | st.sampled_from([b"{", b"[]", b"null", b'{"model":', b"\xff\xfe",
                                                        b'{"model":"m1","messages":' + b"[" * 600])


# --- the OpenAI surface ----------------------------------------------------------------------------------

@FUZZ
@given(body=chat_bodies)
def test_fuzzed_chat_bodies_never_get_a_500(proxy, body):
    try:
        content = orjson.dumps(body)
    except orjson.JSONEncodeError:
        return  # an integer past 64 bits: not JSON orjson can write, nothing to send
    assert_sane(proxy, proxy.post("/v1/chat/completions", content=content,
                                  headers={"Content-Type": "application/json"}))


@FUZZ
@given(body=completion_bodies)
def test_fuzzed_completion_bodies_never_get_a_500(proxy, body):
    try:
        content = orjson.dumps(body)
    except orjson.JSONEncodeError:
        return
    assert_sane(proxy, proxy.post("/v1/completions", content=content, headers={"Content-Type": "application/json"}))


@settings(FUZZ, max_examples=30)
@given(body=raw_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/workers", "/nodes/add",
                                              "/workers/fz-x/report"]))
def test_junk_bytes_never_get_a_500(proxy, body, path):
    assert_sane(proxy, proxy.post(path, content=body, headers={"Content-Type": "application/json"}))


header_names = st.text(string.ascii_letters + string.digits + "-_!#$%&'*+.^`|~", min_size=1, max_size=30)
header_values = st.binary(max_size=60).map(lambda b: bytes(c for c in b if c not in b"\r\n\x00"))


@settings(FUZZ, max_examples=40)
@given(headers=st.lists(st.tuples(header_names, header_values), max_size=12),
       authorization=st.none() | st.binary(max_size=40).map(lambda b: bytes(c for c in b if c not in b"\r\n\x00")),
       session=st.none() | header_values, request_id=st.none() | header_values)
def test_fuzzed_headers_never_get_a_500(proxy, headers, authorization, session, request_id):
    sent = [(k.encode(), v) for k, v in headers if k.lower() not in ("content-length", "transfer-encoding", "host")]
    for name, value in (("authorization", authorization), ("x-session-id", session), ("x-request-id", request_id)):
        if value is not None:
            sent.append((name.encode(), value))
    sent.append((b"content-type", b"application/json"))
    body = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    try:
        resp = proxy.post("/v1/chat/completions", content=body, headers=sent)
    except httpx.LocalProtocolError:
        return  # httpx itself refuses to send it
    assert_sane(proxy, resp)


# --- the control plane (after the data plane: fuzzed registrations change the fleet) -------------------------

registrations = st.fixed_dictionaries(
    {"url": st.sampled_from(["http://127.0.0.1:9", "http://127.0.0.1:1/x?y=1", "http://10.0.0.1:80",
                             "ftp://x", "", "http://[::1]:9"]) | text,
     "models": st.lists(st.sampled_from(["m1", "m9"]) | text, max_size=3) | json_values},
    optional={"worker_id": st.sampled_from(["fz-a", "fz-b"]) | text | json_values,
              "engine": st.sampled_from(["sim", "vllm", "x"]) | json_values,
              "kv_capacity_tokens": st.integers(-1, 2**40) | json_values, "reports": st.booleans() | json_values,
              "labels": json_values})
reports = st.fixed_dictionaries(
    {"worker_id": st.just("fz-a") | text, "url": st.just("http://127.0.0.1:9") | text, "models": st.just(["m9"]),
     "kv_cache_usage": st.floats(-1, 2) | json_values, "kv_capacity_tokens": st.integers(-1, 2**40) | json_values,
     "num_running": st.integers(-1, 10) | json_values, "num_waiting": st.integers(-1, 10) | json_values,
     "seq": st.integers(-1, 2**63) | json_values, "sent_at": st.floats(allow_nan=False) | json_values},
    optional={"state": st.sampled_from(["ready", "draining", "failed", "x"]) | json_values})


@settings(FUZZ, max_examples=30)
@given(payload=registrations | json_values, report=reports | json_values,
       node=st.fixed_dictionaries({"url": text | st.just("http://127.0.0.1:9")}) | json_values)
def test_fuzzed_control_plane_payloads_never_get_a_500(proxy, payload, report, node):
    for path, body in (("/workers", payload), ("/workers/fz-a/report", report), ("/nodes/add", node),
                       ("/nodes/remove", node)):
        try:
            content = orjson.dumps(body)
        except orjson.JSONEncodeError:
            continue
        assert_sane(proxy, proxy.post(path, content=content, headers={"Content-Type": "application/json"}))


# --- at the limits: integers and strings at, just past and far past each bound (issue 33, items 2 and 7) ------

def _around(*bounds: int) -> list[int]:
    return sorted({v for b in bounds for v in (b - 1, b, b + 1)})


limit_ints = st.sampled_from(_around(0, MAX_REQUESTS, MAX_STEP_TOKENS, MAX_KV_CAPACITY_TOKENS, INT64_MAX, 2**64)
                             + [-(2**63) - 1, 10**30]) | st.integers(-(2**70), 2**70)
limit_floats = st.sampled_from([0.0, -0.0, 1.0, 1.0000001, -1e-300, 1e-300, 1e308, float("inf"), float("nan"),
                                MAX_UNIX_TIME + 1.0, 2.0**63]) | st.floats()
limit_strings = st.sampled_from(["w", "a" * ids.MAX_WORKER_ID_CHARS, "a" * (ids.MAX_WORKER_ID_CHARS + 1),
                                 "m" * ids.MAX_MODEL_NAME_CHARS, "m" * (ids.MAX_MODEL_NAME_CHARS + 1),
                                 "x\r\nSet-Cookie: a=b", "x\n", "\x00", "\x1b[2J", "..", "a/b", "caf\u00e9", "",
                                 " ", "Qwen/Qwen3-VL-8B", "\ud800"]) | st.text(max_size=300)


def _send(proxy: Proxy, path: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    # json, not orjson: integers past 64 bits, NaN and Infinity are what is being sent
    content = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return proxy.post(path, content=content, headers={"Content-Type": "application/json", **(headers or {})})


def assert_views_answer(proxy: Proxy) -> None:
    """Whatever was accepted, every view of the fleet still serialises (it answered 500 before)."""
    for path in ("/workers", "/v1/models", "/dashboard/state", "/nodes/status"):
        resp = proxy.http.get(proxy.url + path)
        assert resp.status_code == 200, (path, resp.status_code, resp.text[:300])
        resp.json()


limit_registrations = st.fixed_dictionaries(
    {"url": st.sampled_from(["http://127.0.0.1:9", "http://127.1:9", "http://[::ffff:127.0.0.1]:9"]) | limit_strings,
     "models": st.lists(limit_strings, max_size=3) | st.just([f"m{i}" for i in range(ids.MAX_MODELS_PER_WORKER + 1)])},
    optional={"worker_id": limit_strings, "kv_capacity_tokens": limit_ints, "max_model_len": limit_ints,
              "labels": st.dictionaries(limit_strings, limit_strings, max_size=3), "boot_id": limit_strings,
              "api_key": limit_strings, "gpus": st.lists(limit_strings, max_size=3), "reports": st.booleans()})


@settings(FUZZ, max_examples=40)
@given(body=limit_registrations)
def test_registrations_at_the_limits_never_get_a_500_and_every_view_still_answers(proxy, body):
    resp = _send(proxy, "/workers", body)
    assert_sane(proxy, resp)
    if resp.status_code == 200:
        worker_id = resp.json()["worker_id"]
        assert ids.worker_id(worker_id) == worker_id and len(worker_id) <= ids.MAX_WORKER_ID_CHARS
    assert_views_answer(proxy)


limit_reports = st.fixed_dictionaries(
    {"worker_id": st.just("fz-limits") | limit_strings, "url": st.just("http://127.0.0.1:7") | limit_strings,
     "models": st.just(["m1"]) | st.lists(limit_strings, max_size=2),
     "kv_cache_usage": limit_floats, "kv_capacity_tokens": limit_ints, "num_running": limit_ints,
     "num_waiting": limit_ints, "seq": limit_ints},
    optional={"sent_at": limit_floats, "prefix_cache_hit_rate": limit_floats, "prefill_tokens_per_s": limit_floats,
              "decode_step_s": limit_floats, "max_num_batched_tokens": limit_ints, "boot_id": limit_strings,
              "state": st.sampled_from(["ready", "draining", "failed", "starting"]) | limit_strings})


@settings(FUZZ, max_examples=40)
@given(report=limit_reports)
def test_reports_at_the_limits_never_get_a_500_and_every_view_still_answers(proxy, report):
    registered = _send(proxy, "/workers", {"worker_id": "fz-limits", "url": "http://127.0.0.1:7", "models": ["m1"],
                                           "reports": True}, {"Authorization": f"Bearer {proxy.secrets.get('fz')}"}
                       if proxy.secrets.get("fz") else None)
    if registered.status_code == 200:
        proxy.secrets["fz"] = registered.json()["worker_secret"]
    resp = _send(proxy, "/workers/fz-limits/report", report, {"Authorization": f"Bearer {proxy.secrets.get('fz')}"})
    assert_sane(proxy, resp)
    assert_views_answer(proxy)


# --- Schemathesis against the proxy's own OpenAPI document -------------------------------------------------

schema = schemathesis.openapi.from_dict(build_document())


def test_the_served_document_is_the_one_fuzzed(proxy):
    assert httpx.get(proxy.url + "/openapi.json").json() == orjson.loads(orjson.dumps(build_document()))


@schema.parametrize()
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_documented_operation_survives_schemathesis(case, proxy):
    resp = case.call(base_url=proxy.url, timeout=15)
    assert resp.status_code != 500, (case.method, case.path, resp.status_code, resp.text[:300])
    if resp.status_code < 300 and case.path == "/health":
        assert resp.json() == {"status": "ok"}
