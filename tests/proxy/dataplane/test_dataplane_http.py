"""HTTP/1.1 at the proxy's port, byte by byte: raw sockets against a real proxy and a hand-written worker.

Keep-alive and pipelining, chunked bodies, 100-continue, HTTP/1.0, limits (413, 431), slow senders
(408), each upstream framing and 1xx, hop-by-hop headers both ways, and back-pressure: a client that
does not read holds the worker's writes back instead of the proxy buffering them.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import httpx
import orjson
import pytest

from tests.support.fleet import Fleet
from tests.support.procs import ProcessGroup, free_port, wait_http_ok, wait_until

pytestmark = pytest.mark.timeout(120)

CONFIG = """
proxy:
  max_body_bytes: 65536
  limits:
    header_read_timeout_s: 1.0
    body_read_timeout_s: 1.0
    max_headers: 50
    max_header_bytes: 8192
"""


class Response:
    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes, raw_head: bytes) -> None:
        self.status = status
        self.header_list = headers
        self.headers = {k.lower(): v for k, v in headers}
        self.body = body
        self.raw_head = raw_head

    def json(self) -> dict:
        return orjson.loads(self.body)


class RawClient:
    """One TCP connection to the proxy; reads responses by their framing, as a client must."""

    def __init__(self, url: str, rcvbuf: int | None = None) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(20)
        self.sock.connect((host, int(port)))
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            if not self._fill():
                raise EOFError(f"connection closed before {marker!r}; got {self.buf[:200]!r}")
        head, self.buf = self.buf.split(marker, 1)
        return head + marker

    def read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise EOFError("connection closed mid-body")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def read_response(self, head_request: bool = False) -> Response:
        raw_head = self.read_until(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = [(k.strip(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)]
        lower = {k.lower(): v for k, v in headers}
        if head_request or status in (204, 304) or 100 <= status < 200:
            body = b""
        elif "chunked" in lower.get("transfer-encoding", ""):
            body = b""
            while True:
                size = int(self.read_until(b"\r\n")[:-2].split(b";")[0], 16)
                if size == 0:
                    self.read_until(b"\r\n")
                    break
                body += self.read_exactly(size)
                assert self.read_exactly(2) == b"\r\n"
        elif "content-length" in lower:
            body = self.read_exactly(int(lower["content-length"]))
        else:
            while self._fill():
                pass
            body, self.buf = self.buf, b""
        return Response(status, headers, body, raw_head)

    def closed_by_peer(self, within: float = 5.0) -> bool:
        self.sock.settimeout(within)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
                self.buf += data
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True


def chat(mode: str = "length", stream: bool = False, extra_headers: bytes = b"", version: bytes = b"HTTP/1.1",
         content: str = "hi") -> bytes:
    body = orjson.dumps({"model": "m1", "stream": stream, "max_tokens": 4,
                         "messages": [{"role": "user", "content": content}]})
    return (b"POST /v1/chat/completions " + version + b"\r\nHost: proxy\r\nContent-Type: application/json\r\n"
            b"x-test-mode: " + mode.encode() + b"\r\n" + extra_headers
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.fixture(scope="module")
def _pair(tmp_path_factory, request):
    """One proxy (short client deadlines) in front of the hand-written worker for the whole module: each test
    opens its own client connections, so they do not see each other. Stopped by PID at the module's end."""
    group = ProcessGroup(tmp_path_factory.mktemp("dataplane-http"))
    failed_before = request.session.testsfailed
    fleet = Fleet(group, group.log_dir)
    try:
        port = free_port()
        group.start([sys.executable, "-m", "tests.support.raw_upstream", str(port)], name="raw-upstream")
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/health", timeout=20)
        fleet.start_proxy("--policy", "round_robin", config=CONFIG)
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
def fleet(_pair):
    return _pair[0]


@pytest.fixture
def raw(_pair):
    """The hand-written worker's URL."""
    return _pair[1]


def client(fleet, **kw) -> RawClient:
    return RawClient(fleet.url, **kw)


# --- connections ----------------------------------------------------------------------------------
def test_keep_alive_and_pipelined_requests_are_answered_in_order_on_one_connection(fleet, raw):
    c = client(fleet)
    try:
        c.send(chat(extra_headers=b"x-request-id: first\r\n"))
        first = c.read_response()
        c.send(chat(extra_headers=b"x-request-id: second\r\n"))
        second = c.read_response()
        assert (first.status, second.status) == (200, 200)
        assert [first.headers["x-request-id"], second.headers["x-request-id"]] == ["first", "second"]
        # three at once, one of them streamed, the last one for the control plane
        c.send(chat(extra_headers=b"x-request-id: p1\r\n") + chat("chunked", stream=True,
                                                                    extra_headers=b"x-request-id: p2\r\n")
               + b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
        answers = [c.read_response() for _ in range(3)]
        assert [a.status for a in answers] == [200, 200, 200]
        assert [a.headers.get("x-request-id") for a in answers[:2]] == ["p1", "p2"]
        assert answers[1].body.endswith(b"data: [DONE]\n\n")
        assert answers[2].json() == {"status": "ok"}
        assert not c.closed_by_peer(within=0.3)  # still open for more
    finally:
        c.close()


def test_http_10_and_connection_close_get_their_answer_and_then_the_connection_closes(fleet, raw):
    for request in (chat(version=b"HTTP/1.0"), chat(extra_headers=b"Connection: close\r\n"),
                    chat("chunked", stream=True, version=b"HTTP/1.0")):
        c = client(fleet)
        try:
            c.send(request)
            resp = c.read_response()
            assert resp.status == 200
            assert "chunked" not in resp.headers.get("transfer-encoding", "")  # HTTP/1.0 knows no chunks
            assert resp.body.endswith(b"data: [DONE]\n\n") or resp.json()["body_len"] > 0
            assert c.closed_by_peer()
        finally:
            c.close()


# --- request bodies ------------------------------------------------------------------------------
def test_a_chunked_request_body_arrives_whole_at_the_worker(fleet, raw):
    body = orjson.dumps({"model": "m1", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 3000}]})
    pieces = [body[i:i + 700] for i in range(0, len(body), 700)]
    c = client(fleet)
    try:
        c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n"
               b"x-test-mode: length\r\n\r\n")
        for piece in pieces:
            c.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            time.sleep(0.01)
        c.send(b"0\r\n\r\n")
        echo = c.read_response().json()
        assert echo["body_len"] == len(body)
        names = [k.lower() for k, _ in echo["headers"]]
        assert "transfer-encoding" not in names and names.count("content-length") == 1
    finally:
        c.close()


def test_expect_100_continue_is_answered_before_the_body_and_refused_early_when_too_large(fleet, raw):
    request = chat(extra_headers=b"Expect: 100-continue\r\n")
    head, body = request.split(b"\r\n\r\n", 1)
    c = client(fleet)
    try:
        c.send(head + b"\r\n\r\n")
        interim = c.read_response()
        assert interim.status == 100
        c.send(body)
        assert c.read_response().status == 200
    finally:
        c.close()
    c = client(fleet)
    try:
        c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nExpect: 100-continue\r\n"
               b"Content-Length: 10000000\r\n\r\n")
        refused = c.read_response()  # without sending a byte of the body
        assert refused.status == 413 and refused.json()["error"]["code"] == "request_too_large"
        assert c.closed_by_peer()
    finally:
        c.close()


def test_too_many_or_too_large_headers_get_a_431(fleet, raw):
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(60))
    large = b"x-big: " + b"v" * 9000 + b"\r\n"
    for extra in (many, large):
        c = client(fleet)
        try:
            c.send(chat(extra_headers=extra))
            resp = c.read_response()
            assert resp.status == 431 and resp.json()["error"]["code"] == "request_header_fields_too_large"
            assert c.closed_by_peer()
        finally:
            c.close()


def test_slow_senders_get_a_408_for_the_head_and_for_the_body(fleet, raw):
    c = client(fleet)
    try:
        c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\n")  # and nothing more
        resp = c.read_response()
        assert resp.status == 408 and resp.json()["error"]["code"] == "header_timeout"
        assert c.closed_by_peer()
    finally:
        c.close()
    c = client(fleet)
    try:
        c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 100\r\n\r\n{\"model\"")
        resp = c.read_response()
        assert resp.status == 408 and resp.json()["error"]["code"] == "body_timeout"
        assert c.closed_by_peer()
    finally:
        c.close()
    assert fleet.workers()[0]["in_flight"] == 0


# --- upstream framings ---------------------------------------------------------------------------
def test_each_upstream_framing_reaches_the_client_whole_and_the_connection_stays_usable(fleet, raw):
    c = client(fleet)
    try:
        for mode, stream in (("length", False), ("chunked", True), ("close", True), ("close-json", False),
                             ("interim", False)):
            c.send(chat(mode, stream=stream))
            resp = c.read_response()
            assert resp.status == 200, (mode, resp.raw_head)  # no 103 passed on, and the real answer follows
            assert resp.headers["x-kvroute-worker"] == "raw"
            if stream:
                assert resp.headers["content-type"] == "text/event-stream"
                assert resp.body == b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n', mode
            elif mode == "close-json":
                assert resp.json() == {"whole": "answer"}
            else:
                assert resp.json()["body_len"] > 0
    finally:
        c.close()


def test_the_proxy_reuses_its_connection_to_the_worker_across_requests(fleet, raw):
    def post_connections() -> int:
        return httpx.get(raw + "/progress", timeout=5).json()["post_connections"]

    before = post_connections()  # the module's earlier tests may have left pooled connections
    c = client(fleet)
    try:
        for mode, stream in [("length", False), ("chunked", True)] * 4:
            c.send(chat(mode, stream=stream))
            assert c.read_response().status == 200
    finally:
        c.close()
    assert post_connections() - before <= 1  # eight requests, at most one new connection to the worker


# --- headers -------------------------------------------------------------------------------------
def test_hop_by_hop_headers_and_client_credentials_are_not_forwarded_either_way(fleet, raw):
    c = client(fleet)
    try:
        c.send(chat(extra_headers=b"Connection: keep-alive, x-conn-named\r\nx-conn-named: 1\r\nKeep-Alive: 5\r\n"
                                  b"TE: trailers\r\nProxy-Authorization: Basic eA==\r\nAuthorization: Bearer user-key\r\n"
                                  b"x-api-key: k\r\nCookie: s=1\r\nx-kvroute-client-addr: 6.6.6.6\r\n"
                                  b"x-keep-me: yes\r\n"))
        echo = c.read_response().json()
        sent = {k.lower(): v for k, v in echo["headers"]}
        for name in ("x-conn-named", "keep-alive", "te", "proxy-authorization", "authorization", "x-api-key",
                     "cookie", "x-kvroute-client-addr"):
            assert name not in sent, name
        assert sent["x-keep-me"] == "yes" and sent["x-request-id"] and sent["x-kvroute-via"]
        assert sent["host"] == raw.removeprefix("http://")
        c.send(chat("hop"))
        resp = c.read_response()
        assert resp.status == 200 and resp.headers["x-keep"] == "yes"
        for name in ("x-drop-me", "keep-alive", "proxy-authenticate"):
            assert name not in resp.headers, name
    finally:
        c.close()


# --- back-pressure -------------------------------------------------------------------------------
FLOOD_BYTES = 96 * 1024 * 1024


def test_a_client_that_reads_slowly_holds_back_the_workers_writes_instead_of_being_buffered(fleet, raw):
    c = client(fleet, rcvbuf=16384)
    try:
        c.send(chat("flood", stream=True, extra_headers=b"x-flood-bytes: %d\r\n" % FLOOD_BYTES))
        c.read_until(b"\r\n\r\n")

        def written() -> int:
            return httpx.get(raw + "/progress", timeout=5).json()["flood_bytes"]

        # the worker writes until every buffer on the way is full, then waits on the proxy
        samples = [written()]

        def settled() -> bool:
            samples.append(written())
            return len(samples) > 10 and samples[-1] == samples[-10]

        wait_until(settled, 30, 0.1, "the worker's writes to stall")
        held_back = samples[-1]
        assert 0 < held_back < FLOOD_BYTES // 3, held_back  # socket buffers, not the whole answer
        # reading on lets the rest through, every byte of it
        received = len(c.buf)
        while not c.buf.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            data = c.sock.recv(1 << 20)
            assert data, "the stream ended early"
            received += len(data)
            c.buf = c.buf[-64:] + data
        assert received > FLOOD_BYTES
        assert json.loads(httpx.get(raw + "/progress", timeout=5).text)["flood_done"]
    finally:
        c.close()
