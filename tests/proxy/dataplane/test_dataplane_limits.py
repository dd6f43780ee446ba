"""The data plane under attack, each test the attack itself against a real `kvroute proxy` process: huge header
values both ways, connection floods from one address and from several, file descriptors running out, an
endless stream, `Connection: Upgrade`, and worker headers the proxy must not relay. Memory is read from
/proc/PID/status; a duration appears only as a bound far from what the attack cost before the fix."""

from __future__ import annotations

import re
import resource
import socket
import sys
import threading
import time

import httpx
import orjson
import pytest
from httptools import HttpRequestParser

from proxy.dataplane import http
from proxy.dataplane.gate import client_key
from proxy.dataplane.heads import HeadBound, feed_bounded
from proxy.errors import ProxyError
from tests.support.fleet import Fleet
from tests.support.procs import ProcessGroup, free_port, wait_http_ok, wait_until

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20


@pytest.fixture(scope="module")
def _pair(tmp_path_factory, request):
    """A proxy with the default limits in front of the hand-written worker, for the whole module."""
    group = ProcessGroup(tmp_path_factory.mktemp("dataplane-limits"))
    failed_before = request.session.testsfailed
    fleet = Fleet(group, group.log_dir)
    try:
        port = free_port()
        group.start([sys.executable, "-m", "tests.support.raw_upstream", str(port)], name="raw-upstream")
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/health", timeout=20)
        fleet.start_proxy()
        resp = fleet.http.post(fleet.url + "/workers", json={"worker_id": "raw", "url": url, "models": ["m1"],
                                                             "reports": False})
        assert resp.status_code == 200, resp.text
        fleet.wait_workers(lambda ws: [w["state"] for w in ws] == ["ready"], what="the raw worker ready")
        yield fleet, url
    finally:
        if request.session.testsfailed > failed_before:
            print(group.logs())
        fleet.close()
        group.stop_all()


@pytest.fixture
def fleet(_pair) -> Fleet:
    return _pair[0]


@pytest.fixture
def raw(_pair) -> str:
    return _pair[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def connect(url: str, source: str = "127.0.0.1", timeout: float = 20.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(timeout)
    sock.connect((host, int(port)))
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the proxy closes the connection."""
    out = b""
    try:
        while data := sock.recv(65536):
            out += data
    except ConnectionResetError:
        pass
    return out


def closed_by_peer(sock: socket.socket) -> bool:
    """Without waiting: the proxy closed `sock` (EOF or reset); False while it is open and quiet."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def client_from(source: str, timeout: float = 20.0) -> httpx.Client:
    """An HTTP client whose connections come from `source` (another loopback address is another client)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=timeout,
                        limits=httpx.Limits(max_keepalive_connections=0))


def metric(text: str, line_start: str) -> float:
    values = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line_start)]
    return sum(values)


def chat_body(stream: bool = False) -> bytes:
    return orjson.dumps({"model": "m1", "stream": stream, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]})


def raise_own_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= need, "this test needs more open files"


# --- in process: the head bound and the header check ------------------------------------------------
class _Heads:
    """An httptools protocol that keeps a HeadBound informed, as connection.py does."""

    def __init__(self, limit: int) -> None:
        self.bound = HeadBound(limit)
        self.parser = HttpRequestParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.messages = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.bound.reading = False

    def on_chunk_header(self) -> None:
        self.bound.start()

    def on_body(self, body: bytes) -> None:
        self.bound.reading = False

    def on_message_complete(self) -> None:
        self.messages += 1
        self.bound.start()

    def feed(self, data: bytes) -> bool:
        return feed_bounded(self.parser, self.bound, data)


def test_a_header_value_is_refused_once_the_head_outgrows_its_bound_never_gathered_whole():
    heads = _Heads(4096)
    assert heads.feed(b"GET / HTTP/1.1\r\nx-big: ")
    fed = len(b"GET / HTTP/1.1\r\nx-big: ")
    piece = b"v" * 1000
    while heads.feed(piece):
        fed += len(piece)
        assert fed <= 4096
    assert heads.headers == []  # httptools never handed the value over: it was cut before it ended


def test_many_small_pipelined_requests_and_trailers_within_the_bound_pass():
    heads = _Heads(4096)
    one = b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n"
    assert heads.feed(one * 500)  # far more than the bound in one read, but every head is small
    assert heads.messages == 500
    chunked = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"4000\r\n" + b"b" * 0x4000 + b"\r\n"
    assert heads.feed(chunked)  # a body is not a head
    assert heads.feed(b"0\r\n")
    assert not heads.feed(b"x-trailer: " + b"t" * 8192)  # trailers are


def test_header_values_the_proxy_writes_are_escaped_and_bounded():
    assert http.safe_value("gpu-node-3.worker_1") == b"gpu-node-3.worker_1"
    assert http.safe_value("evil\r\nSet-Cookie: x") == b"evil%0D%0ASet-Cookie: x"
    assert len(http.safe_value(b"a\x00" * 10000)) == http.MAX_VALUE_BYTES
    answer = http.error_response(ProxyError(503, "no"), {"x-kvroute-worker": "w\n\u2603"}, True)
    head = answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    assert b"x-kvroute-worker: w%0A\xe2\x98\x83" in head and all(b"\n" not in line for line in head)
    assert http.invalid_field([(b"ok", b"fine\tvalue\x80")]) is None
    assert http.invalid_field([(b"ok", b"1"), (b"bad name", b"1")]) == b"bad name"
    assert http.invalid_field([(b"x", b"v" * (http.MAX_VALUE_BYTES + 1))]) == b"x"


def test_a_client_is_its_ipv4_address_or_its_ipv6_slash_64():
    assert client_key(b"10.1.2.3") == b"10.1.2.3"
    assert client_key(b"2001:db8::1") == client_key(b"2001:db8:0:0:ffff::2") != client_key(b"2001:db8:0:1::1")
    assert client_key(b"::ffff:10.1.2.3") == b"10.1.2.3"


# --- item 3: a huge header value, both ways ----------------------------------------------------------
def test_a_64_mib_header_value_gets_431_at_once_and_stalls_nobody(fleet, raw):
    pid = fleet.proxy.pid
    with client_from("127.0.0.2") as health:
        assert health.get(fleet.url + "/health").status_code == 200
        before = rss_mib(pid)
        attacker = connect(fleet.url)
        attacker.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nx-big: ")

        def send_value() -> None:
            piece = b"v" * MIB
            try:
                for _ in range(64):
                    attacker.sendall(piece)
            except OSError:  # the proxy gave up on the connection: what it should do
                pass

        sender = threading.Thread(target=send_value, daemon=True)
        sender.start()
        slowest = 0.0
        while sender.is_alive() or slowest == 0.0:  # /health on another connection while the value arrives
            started = time.monotonic()
            assert health.get(fleet.url + "/health").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
        sender.join(30)
        answer = read_all(attacker)
        attacker.close()
        after = rss_mib(pid)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"request_header_fields_too_large" in answer
    assert answer.count(b"HTTP/1.1 ") == 1
    # before the fix: 5.8 s of proxy CPU, /health stalled up to 8 s, RSS 64-95 MiB higher
    assert slowest < 2.0, f"/health took {slowest:.2f}s during the attack"
    assert after - before < 8, f"RSS grew {after - before:.1f} MiB"


def test_a_worker_sending_a_64_mib_header_value_gets_a_502_and_costs_no_memory(fleet, raw):
    pid = fleet.proxy.pid
    before = rss_mib(pid)
    resp = fleet.http.post(fleet.url + "/v1/chat/completions", content=chat_body(),
                           headers={"content-type": "application/json", "x-test-mode": "huge-header",
                                    "x-head-bytes": str(64 * MIB)})
    after = rss_mib(pid)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "bad_upstream_response"
    assert "x-big" not in resp.headers and resp.headers["x-kvroute-worker"] == "raw"
    assert after - before < 8, f"RSS grew {after - before:.1f} MiB"


# --- item 2, write side: nothing a worker sends can split or grow a head ------------------------------
@pytest.mark.parametrize("bad", ["control", "long", "name"])
def test_a_worker_header_the_proxy_may_not_relay_makes_its_answer_a_counted_502(fleet, raw, bad):
    resp = fleet.http.post(fleet.url + "/v1/chat/completions", content=chat_body(),
                           headers={"content-type": "application/json", "x-test-mode": "bad-header",
                                    "x-bad-header": bad})
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "bad_upstream_response", resp.text
    assert "x-injected" not in resp.headers and "x-long" not in resp.headers
    metrics = fleet.http.get(fleet.url + "/metrics").text
    assert metric(metrics, 'kvroute:bad_upstream_responses_total{worker="raw"}') >= 1
    assert fleet.chat().status_code == 200  # the worker's good answers still pass


def test_a_worker_id_with_crlf_never_splits_a_response(fleet, procs):
    """Registration may refuse such an id (proxy/security/); if one gets in, the header written is escaped."""
    port = free_port()
    procs.start([sys.executable, "-m", "tests.support.raw_upstream", str(port)], name="evil-upstream")
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(url + "/health", timeout=20)
    evil = "evil\r\nSet-Cookie: session=stolen"
    resp = fleet.http.post(fleet.url + "/workers", headers=fleet.admin(),
                           json={"worker_id": evil, "url": url, "models": ["m-evil"], "reports": False})
    if resp.status_code >= 400:
        return  # refused where it came in: nothing to split
    try:
        wait_until(lambda: fleet.http.post(fleet.url + "/v1/chat/completions", content=orjson.dumps(
            {"model": "m-evil", "messages": [{"role": "user", "content": "hi"}]}),
            headers={"content-type": "application/json"}).status_code == 200, 20, what="the evil worker serving")
        answer = fleet.http.post(fleet.url + "/v1/chat/completions", content=orjson.dumps(
            {"model": "m-evil", "messages": [{"role": "user", "content": "hi"}]}),
            headers={"content-type": "application/json"})
        assert "set-cookie" not in answer.headers
        assert answer.headers["x-kvroute-worker"] == "evil%0D%0ASet-Cookie: session=stolen"
    finally:
        fleet.http.delete(fleet.url + "/workers/" + evil.replace("\r\n", "%0D%0A"), headers=fleet.admin())


# --- item 10: Connection: Upgrade --------------------------------------------------------------------
def test_an_upgrade_request_gets_one_answer_and_nothing_is_served_without_its_body(fleet, raw):
    posts = httpx.get(raw + "/progress", timeout=5).json()["posts"]
    body = chat_body()
    sock = connect(fleet.url)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                     b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%sGET /health HTTP/1.1\r\nHost: p\r\n\r\n" % (len(body), body))
        answer = read_all(sock)
    finally:
        sock.close()
    assert answer.count(b"HTTP/1.1 ") == 1, answer
    assert answer.startswith(b"HTTP/1.1 501 ") and b"upgrade_not_supported" in answer
    assert httpx.get(raw + "/progress", timeout=5).json()["posts"] == posts  # the worker got nothing


# --- item 6: an endless stream -----------------------------------------------------------------------
def test_an_endless_stream_keeps_the_proxys_memory_bounded(fleet, raw):
    pid = fleet.proxy.pid
    body = chat_body(stream=True)
    sock = connect(fleet.url)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
                     b"x-test-mode: chat-flood\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        before = rss_mib(pid)
        received = len(first)
        while received < 192 * MIB:  # before the fix, the proxy kept all of its text
            data = sock.recv(MIB)
            assert data, "the stream ended"
            received += len(data)
        after = rss_mib(pid)
    finally:
        sock.close()
    assert after - before < 40, f"RSS grew {after - before:.1f} MiB while 192 MiB streamed"
    wait_until(lambda: metric(fleet.http.get(fleet.url + "/metrics").text,
                              'kvroute:migrations_total{model="m1",outcome="text_limit"}') >= 1, 10,
               what="the stream counted as too long to move")


# --- item 4: connections -----------------------------------------------------------------------------
ATTACK_CONNECTIONS = 4100


def test_4100_idle_connections_from_one_address_leave_room_for_everyone_else(fleet, raw):
    raise_own_fd_limit(ATTACK_CONNECTIONS + 512)
    idle: list[socket.socket] = []
    try:
        for _ in range(ATTACK_CONNECTIONS):
            idle.append(connect(fleet.url))
        served = 0
        with client_from("127.0.0.2") as other:
            for i in range(100):
                try:
                    resp = other.post(fleet.url + "/v1/chat/completions", content=chat_body(stream=i % 2 == 1),
                                      headers={"content-type": "application/json",
                                               "x-test-mode": "chunked" if i % 2 else "length"})
                    served += resp.status_code == 200
                except httpx.HTTPError:
                    pass
            metrics = other.get(fleet.url + "/metrics").text
        refused = [s for s in idle[-100:] if closed_by_peer(s)]
    finally:
        for sock in idle:
            sock.close()
    assert served >= 99, f"{served} of 100 requests from another address were served"
    # the attacker kept max_connections_per_client (1024), no more: the rest were answered 429 and closed
    assert metric(metrics, 'kvroute:client_connections_shed_total{reason="per_client_cap"}') >= \
        ATTACK_CONNECTIONS - 1024
    assert len(refused) == 100


BUSY_CONFIG = """
proxy:
  limits:
    max_client_connections: 40
    max_connections_per_client: 16
    header_read_timeout_s: 30
"""


def test_a_busy_proxy_closes_idle_connections_within_seconds_and_caps_each_client(procs, tmp_path):
    fleet = Fleet(procs, tmp_path)
    try:
        fleet.start_proxy(config=BUSY_CONFIG)
        keeper = connect(fleet.url, "127.0.0.2")
        keeper.sendall(b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n")
        assert keeper.recv(65536).startswith(b"HTTP/1.1 200 ")
        time.sleep(3)  # not busy: an idle keep-alive connection outlives the busy keep-alive (2 s)
        assert not closed_by_peer(keeper)
        flood = [connect(fleet.url, "127.0.0.3") for _ in range(16)]
        over = connect(fleet.url, "127.0.0.3")
        assert read_all(over).startswith(b"HTTP/1.1 429 ")  # the 17th from one client: refused at once
        flood += [connect(fleet.url, f"127.0.0.{4 + i % 2}") for i in range(8)]  # 25 open of 40: busy
        started = time.monotonic()
        # idle ones are closed until fewer than 40% of the cap (16) are open; then the long keep-alive is back
        wait_until(lambda: sum(closed_by_peer(s) for s in [keeper, *flood]) >= 25 - 16, 20, 0.2,
                   "idle connections closed while the proxy is busy")
        # before: 75 s for an idle keep-alive connection, header_read_timeout_s (30 here) for a silent one
        assert time.monotonic() - started < 15
        with client_from("127.0.0.2") as other:
            assert other.get(fleet.url + "/health").status_code == 200
            metrics = other.get(fleet.url + "/metrics").text
        assert metric(metrics, 'kvroute:client_connections_shed_total{reason="idle_under_pressure"}') >= 25 - 16
        assert metric(metrics, 'kvroute:client_connections_shed_total{reason="per_client_cap"}') >= 1
        for sock in [keeper, over, *flood]:
            sock.close()
    finally:
        fleet.close()


FD_CONFIG = """
proxy:
  limits:
    max_connections_per_client: 2000
"""


def test_accepting_pauses_near_the_fd_limit_and_resumes_without_a_crash(procs, tmp_path):
    (tmp_path / "config.yaml").write_text(FD_CONFIG)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # soft 200, hard 256: the proxy raises its soft limit to 256 itself
    launcher = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (200, 256)); "
                "os.execv(sys.executable, [sys.executable, '-m', 'proxy.cli', *sys.argv[1:]])")
    proxy = procs.start([sys.executable, "-c", launcher, "proxy", "--port", str(port), "--config",
                         str(tmp_path / "config.yaml")], name="proxy")
    wait_http_ok(url + "/health", timeout=30)
    limits = open(f"/proc/{proxy.pid}/limits").read()
    assert re.search(r"Max open files\s+256\s+256", limits), limits
    raise_own_fd_limit(1024)
    flood: list[socket.socket] = []
    try:
        for _ in range(300):  # connect() completes in the kernel's backlog while the proxy does not accept
            flood.append(connect(url))
        wait_until(lambda: "accepting new connections paused" in proxy.log(), 20, 0.2, "accepting to pause")
        wait_until(lambda: "accepting new connections again" in proxy.log(), 30, 0.2, "accepting to resume")
        assert proxy.alive()
        with client_from("127.0.0.2") as other:
            wait_until(lambda: other.get(url + "/health").status_code == 200, 20, 0.2, "a new connection served")
            metrics = other.get(url + "/metrics").text
        assert metric(metrics, "kvroute:accept_pauses_total") >= 1
    finally:
        for sock in flood:
            sock.close()
