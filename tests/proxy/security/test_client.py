"""Client API keys and limits against hostile callers, through a real proxy process.

401 / 403 / 429 with OpenAI bodies and Retry-After, client credentials never reaching a worker,
per-key limits shared by two proxies on one Redis, each request/header/body/connection limit.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import socket
import struct
import threading
import time
import zlib

import httpx
import orjson
import pytest

from proxy.config import ApiKey, parse_config
from proxy.errors import ProxyError
from proxy.security.clientauth import ANONYMOUS, ClientAuth, load_keys
from tests.support.fleet import Fleet
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)

ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789"
KEYS_CONFIG = f"""
proxy:
  queue: {{max_wait_s: 0.1}}  # a model without workers answers 503 at once
  metrics_token: scrape-me
  api_keys:
    - {{key: {ALICE}, name: alice}}
    - {{key_sha256: {hashlib.sha256(BOB.encode()).hexdigest()}, name: bob, models: [m2]}}
    - {{key: {CAROL}, name: carol, requests_per_s: 0.2}}
models:
  - {{name: m1, engine: sim, replicas: 0}}
  - {{name: m2, engine: sim, replicas: 0, aliases: [m2-alias]}}
"""
HELLO = [{"role": "user", "content": "hi"}]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


class RecordingWorker:
    """A tiny OpenAI-shaped worker in this process that keeps the headers of every request it gets."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                seen.append({k.lower(): v for k, v in self.headers.items()})
                body = orjson.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m1",
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": "ok"}}],
                                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                body = b'{"object":"list","data":[{"id":"m1","object":"model"}]}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recording_worker():
    worker = RecordingWorker()
    yield worker
    worker.close()


# --- through a real proxy --------------------------------------------------------------------------

def test_keys_guard_v1_and_metrics_and_client_credentials_never_reach_the_worker(fleet, recording_worker):
    fleet.start_proxy(config=KEYS_CONFIG)
    fleet.register("rec-0", recording_worker.url, model="m1")
    chat = fleet.url + "/v1/chat/completions"
    body = {"model": "m1", "messages": HELLO, "max_tokens": 4}

    missing = httpx.post(chat, json=body)
    assert missing.status_code == 401 and error_of(missing)["code"] == "invalid_api_key"
    assert missing.headers["www-authenticate"].startswith("Bearer")
    wrong = httpx.post(chat, json=body, headers=bearer("sk-nobody"))
    assert wrong.status_code == 401 and error_of(wrong)["code"] == "invalid_api_key"
    not_utf8 = httpx.post(chat, json=body, headers=[(b"Authorization", b"Bearer \xff\xfe\xfd")])
    assert not_utf8.status_code == 401 and error_of(not_utf8)["code"] == "invalid_api_key"
    assert recording_worker.seen == []  # nothing unauthenticated went upstream

    ok = httpx.post(chat, json=body, headers={**bearer(ALICE), "Cookie": "session=secret", "X-Api-Key": "k",
                                              "api-key": "k2", "X-Custom": "kept"})
    assert ok.status_code == 200, ok.text
    (seen,) = recording_worker.seen
    assert not {"authorization", "cookie", "x-api-key", "api-key", "proxy-authorization"} & set(seen)
    assert seen["x-custom"] == "kept"

    # the hashed key is allowed m2 only (its alias included), and says so with a 403
    denied = httpx.post(chat, json=body, headers=bearer(BOB))
    assert denied.status_code == 403 and error_of(denied)["code"] == "model_not_allowed"
    alias = httpx.post(chat, json={**body, "model": "m2-alias"}, headers=bearer(BOB))
    assert alias.status_code == 503 and error_of(alias)["code"] == "no_healthy_worker"  # admitted; no worker

    assert httpx.get(fleet.url + "/v1/models").status_code == 401
    assert httpx.get(fleet.url + "/v1/models", headers=bearer(BOB)).status_code == 200
    assert httpx.get(fleet.url + "/metrics").status_code == 401
    assert httpx.get(fleet.url + "/metrics", headers=bearer("sk-nobody")).status_code == 401
    assert httpx.get(fleet.url + "/metrics", headers=bearer(ALICE)).status_code == 200
    assert httpx.get(fleet.url + "/metrics", headers=bearer("scrape-me")).status_code == 200
    assert httpx.get(fleet.url + "/health").status_code == 200  # liveness stays open


# Other spellings of a completion path: an escaped letter, a fragment, an absolute-form target, dot segments,
# doubled or trailing slashes. Only the data plane serves completions (and logs each); the control-plane app
# behind it decodes such targets, and once relayed them to a worker with no access-log line (issue 33, item 9).
ODD_TARGETS = [b"/v1/chat/%63ompletions", b"/v1/chat/completions#fragment", b"/v1/%63ompletions",
               b"http://127.0.0.1/v1/chat/completions", b"http://127.0.0.1/v1/completions", b"/v1/chat/./completions",
               b"/v1/x/../chat/completions", b"//v1/chat/completions", b"/v1/chat/completions/",
               b"/v1/chat/completions%3Fa=b", b"/V1/chat/completions"]


def test_other_spellings_of_a_completion_path_get_a_404_and_never_reach_a_worker(fleet, recording_worker):
    fleet.start_proxy()
    fleet.register("rec-0", recording_worker.url, model="m1")
    port = int(fleet.url.rsplit(":", 1)[1])
    body = orjson.dumps({"model": "m1", "messages": HELLO, "max_tokens": 4})
    for target in ODD_TARGETS:
        answer = raw_exchange(port, b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (target, len(body), body))
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404"), (target, answer[:200])
        assert orjson.loads(payload)["error"]["code"] == "not_found", target
    assert recording_worker.seen == []

    served = fleet.http.post(fleet.url + "/v1/chat/completions?a=b", content=body,
                             headers={"Content-Type": "application/json", "x-request-id": "req-canonical"})
    assert served.status_code == 200 and len(recording_worker.seen) == 1  # the worker was there all along
    lines = wait_until(lambda: [line for line in fleet.proxy.log().splitlines() if "kvroute.access: " in line]
                       or None, 10, what="the served request's access-log line")
    (line,) = [orjson.loads(line.split("kvroute.access: ", 1)[1]) for line in lines]
    assert (line["request_id"], line["status"], line["worker"]) == ("req-canonical", 200, "rec-0")


def test_a_key_over_its_request_rate_gets_a_429_with_retry_after(fleet):
    fleet.start_proxy(config=KEYS_CONFIG)
    chat = fleet.url + "/v1/chat/completions"
    body = {"model": "m1", "messages": HELLO}
    first = httpx.post(chat, json=body, headers=bearer(CAROL))
    assert first.status_code == 503  # admitted (no worker serves m1 here)
    limited = httpx.post(chat, json=body, headers=bearer(CAROL))
    assert limited.status_code == 429
    err = error_of(limited)
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert 1 <= int(limited.headers["retry-after"]) <= 5
    assert httpx.post(chat, json=body, headers=bearer(ALICE)).status_code == 503  # other keys unaffected


def test_two_proxies_on_one_redis_share_a_keys_rate_limit(procs, tmp_path, redis_url):  # noqa: F811
    config = KEYS_CONFIG.replace("requests_per_s: 0.2", "requests_per_s: 0.05")
    first, second = Fleet(procs, tmp_path), Fleet(procs, tmp_path)
    first.start_proxy("--state", redis_url, config=config)
    second.start_proxy("--state", redis_url, config=config)
    body = {"model": "m1", "messages": HELLO}
    try:
        assert httpx.post(first.url + "/v1/chat/completions", json=body, headers=bearer(CAROL)).status_code == 503
        limited = httpx.post(second.url + "/v1/chat/completions", json=body, headers=bearer(CAROL))
        assert limited.status_code == 429 and error_of(limited)["code"] == "rate_limit_exceeded"
        assert int(limited.headers["retry-after"]) >= 10  # one request per 20 s, shared
    finally:
        first.close()
        second.close()


def png_data_url(width: int, height: int) -> str:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    png = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return "data:image/png;base64," + base64.b64encode(png).decode()


LIMITS_CONFIG = """
proxy:
  queue: {max_wait_s: 0.1}
  limits: {max_messages: 4, max_images: 3, max_videos: 1, max_image_pixels: 2000000, max_tokens: 1000,
           max_headers: 20, max_header_bytes: 4096, max_workers: 2, header_read_timeout_s: 1,
           body_read_timeout_s: 1}
models:
  - {name: m1, engine: sim, replicas: 0}
  - {name: m2, engine: sim, replicas: 0, limits: {max_images: 1}}
"""


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


SHAPE_CASES = [
    ({"messages": HELLO * 5}, "too_many_messages"),
    ({"messages": [{"role": "user", "content": [image(f"http://x/{i}.png") for i in range(4)]}]}, "too_many_images"),
    ({"model": "m2", "messages": [{"role": "user", "content": [image("http://x/1"), image("http://x/2")]}]},
     "too_many_images"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://x/v"}}] * 2}]},
     "too_many_videos"),
    ({"messages": [{"role": "user", "content": [image(png_data_url(1500, 1000))] * 2}]}, "too_many_pixels"),
    ({"messages": HELLO, "max_tokens": 1001}, "max_tokens_exceeded"),
    ({"messages": HELLO, "max_completion_tokens": 5000}, "max_tokens_exceeded"),
]


def test_each_request_shape_limit_is_a_400_naming_it(fleet):
    fleet.start_proxy(config=LIMITS_CONFIG)
    for payload, code in SHAPE_CASES:
        resp = httpx.post(fleet.url + "/v1/chat/completions", json={"model": "m1", **payload})
        assert (resp.status_code, error_of(resp)["code"]) == (400, code), payload
    within = httpx.post(fleet.url + "/v1/chat/completions",
                        json={"model": "m1", "messages": [{"role": "user", "content": [image(png_data_url(1500, 1000))]}],
                              "max_tokens": 1000})
    assert within.status_code == 503  # past every limit check: only the worker is missing


def raw_exchange(port: int, data: bytes, *, pause_after: int | None = None, timeout: float = 10.0) -> bytes:
    """Send `data` (stopping after `pause_after` bytes, then idling) and return what the proxy answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data if pause_after is None else data[:pause_after])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused at once: its answer may still be there to read
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            out += chunk
        return out


def test_header_and_connection_limits_answer_431_408_and_503(fleet):
    fleet.start_proxy(config=LIMITS_CONFIG)
    port = int(fleet.url.rsplit(":", 1)[1])
    many = httpx.get(fleet.url + "/health", headers={f"x-h{i}": "v" for i in range(30)})
    assert many.status_code == 431 and error_of(many)["code"] == "request_header_fields_too_large"
    big = httpx.get(fleet.url + "/health", headers={"x-big": "v" * 5000})
    assert big.status_code == 431

    started = time.monotonic()
    slow_head = raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", pause_after=None)
    assert slow_head.startswith(b"HTTP/1.1 408") and b"header_timeout" in slow_head
    assert time.monotonic() - started < 8  # closed by the proxy's deadline, not by this test's socket timeout

    body = orjson.dumps({"model": "m1", "messages": HELLO})
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (len(body) + 100))
    slow_body = raw_exchange(port, head + body)  # 100 bytes short, forever
    assert slow_body.startswith(b"HTTP/1.1 408") and b"body_timeout" in slow_body


def test_a_registration_past_max_workers_is_refused_and_a_re_registration_is_not(fleet):
    fleet.start_proxy(config=LIMITS_CONFIG)
    fleet.register("w-0", "http://127.0.0.1:9", model="m1")
    fleet.register("w-1", "http://127.0.0.1:10", model="m1")
    third = fleet.http.post(fleet.url + "/workers", json={"worker_id": "w-2", "url": "http://127.0.0.1:11",
                                                          "models": ["m1"], "engine": "sim"})
    assert third.status_code == 503 and error_of(third)["code"] == "too_many_workers"
    fleet.register("w-1", "http://127.0.0.1:10", model="m1")  # replaces its own entry: allowed


def test_connections_over_the_cap_get_a_503_and_the_held_ones_still_work(fleet):
    fleet.start_proxy(config="proxy: {limits: {max_client_connections: 3, header_read_timeout_s: 30}}")
    port = int(fleet.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    for sock in idle:  # a head under way: held (a silent connection is closed in 2 s once the proxy is busy)
        sock.sendall(b"GET /health HTTP/1.1\r\n")
    try:
        wait_until(lambda: raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                                        timeout=2).startswith(b"HTTP/1.1 503"), 15, what="the 4th connection refused")
        refused = raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"too_many_connections" in refused
        idle[0].sendall(b"Host: x\r\n\r\n")
        assert idle[0].recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: httpx.get(fleet.url + "/health").status_code == 200, 10, what="room again")


def test_bodies_over_the_memory_budget_wait_then_get_503(fleet):
    mib = 1024 * 1024
    fleet.start_proxy(config="proxy: {queue: {max_wait_s: 0.1}, limits: {max_buffered_body_bytes: 1048576, buffered_body_wait_s: 0.5}}\n"
                             "models: [{name: m1, engine: sim, replicas: 0}]")
    port = int(fleet.url.rsplit(":", 1)[1])
    holder = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        holder.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n{" % mib)  # holds the whole budget while its body trickles
        time.sleep(0)  # the proxy reads the head asynchronously; the next request waits on the condition below

        def refused() -> httpx.Response | None:
            resp = httpx.post(fleet.url + "/v1/chat/completions", content=b"x" * 1000,
                              headers={"Content-Type": "application/json"})
            return resp if resp.status_code == 503 else None

        resp = wait_until(refused, 15, what="a body refused while the budget is held")
        assert error_of(resp)["code"] == "body_memory_full" and resp.headers["retry-after"] == "1"
    finally:
        holder.close()
    ok = wait_until(lambda: (lambda r: r if r.status_code == 503 and error_of(r)["code"] == "no_healthy_worker"
                             else None)(fleet.chat()), 15, what="budget released when the holder left")
    assert ok


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_memory_returns_to_baseline_after_a_burst_of_large_bodies(fleet):
    fleet.start_proxy(config="proxy: {queue: {max_wait_s: 0.1}}\nmodels: [{name: m1, engine: sim, replicas: 0}]")
    pid = fleet.proxy.pid
    for _ in range(3):
        fleet.chat("warm up " * 1000)
    baseline = rss_kib(pid)
    prompt = "y" * (24 * 1024 * 1024)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": prompt}]})
            resps = await asyncio.gather(*(client.post(fleet.url + "/v1/chat/completions", content=body,
                                                       headers={"Content-Type": "application/json"})
                                           for _ in range(12)))
            return [r.status_code for r in resps]

    assert set(asyncio.run(burst())) == {503}  # every body read and parsed; no worker for m1
    # back within 40 MiB of the baseline once the bodies are gone (it peaked at several hundred MiB)
    wait_until(lambda: rss_kib(pid) < baseline + 40 * 1024, 20,
               what=f"proxy RSS back near its baseline of {baseline} KiB")


# --- in process: keys, files, buckets -----------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_no_keys_means_anonymous_and_unlimited():
    auth = ClientAuth([])
    assert not auth.enabled and auth.authenticate(None) is ANONYMOUS
    assert auth.authenticate(b"Bearer \xff") is ANONYMOUS
    asyncio.run(auth.admit(ANONYMOUS, "any", 10**9))


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic abc", "bearer nope", b"Bearer \xff\xfe",
                                    "Bearer \udcff", "Bearer \ud800", b"\x00\x01", "Bearer sk-alice-012345678"])
def test_anything_but_a_known_bearer_key_is_a_401_and_nothing_else(header):
    auth = ClientAuth([ApiKey(key=ALICE)])
    with pytest.raises(ProxyError) as err:
        auth.authenticate(header)
    assert err.value.status == 401 and err.value.code == "invalid_api_key"


def test_a_key_is_found_as_str_or_bytes_and_case_insensitive_scheme():
    auth = ClientAuth([ApiKey(key=ALICE, name="alice")])
    assert auth.authenticate(f"Bearer {ALICE}").name == "alice"
    assert auth.authenticate(f"bearer  {ALICE} ".encode()).name == "alice"


def test_keys_from_a_file_lines_or_yaml_and_from_the_environment(tmp_path):
    lines = tmp_path / "keys.txt"
    lines.write_text(f"# ops keys\n{ALICE}\nsha256:{hashlib.sha256(BOB.encode()).hexdigest()}\n")
    entries = tmp_path / "keys.yaml"
    entries.write_text(f"- {{key: {CAROL}, models: [m1], tokens_per_min: 600}}\n- plain-key\n")
    assert [k.key or k.key_sha256[:4] for k in load_keys(str(lines))] == [ALICE, hashlib.sha256(BOB.encode()).hexdigest()[:4]]
    config = parse_config(f"proxy: {{api_keys: {entries}}}")
    auth = ClientAuth.from_config(config, env={"KVROUTE_API_KEYS": "env-key-1, env-key-2"})
    for key in (CAROL, "plain-key", "env-key-1", "env-key-2"):
        auth.authenticate(f"Bearer {key}")
    assert auth.authenticate(f"Bearer {CAROL}").models == frozenset({"m1"})
    with pytest.raises(ValueError, match="api keys file"):
        load_keys(str(tmp_path / "missing.txt"))


def test_token_bucket_refills_at_its_rate_and_charges_both_buckets_together():
    clock = FakeClock()
    auth = ClientAuth([ApiKey(key=ALICE, requests_per_s=2, tokens_per_min=600)], clock=clock)
    alice = auth.authenticate(f"Bearer {ALICE}")

    async def admit(tokens: int) -> int | None:
        try:
            await auth.admit(alice, "m", tokens)
            return None
        except ProxyError as exc:
            assert exc.status == 429 and exc.code == "rate_limit_exceeded"
            return int(exc.headers["Retry-After"])

    async def scenario() -> None:
        assert await admit(500) is None      # requests 2 -> 1, tokens 600 -> 100
        assert await admit(200) == 10        # 100 tokens short at 10/s; nothing charged
        assert await admit(50) is None       # requests 1 -> 0, tokens 100 -> 50
        assert await admit(1) == 1           # out of requests for 0.5 s
        clock.now += 0.5
        assert await admit(1) is None
        clock.now += 60
        assert await admit(10**6) is None    # a request larger than the whole minute passes on a full bucket

    asyncio.run(scenario())
