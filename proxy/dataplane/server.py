"""The proxy's public port: client connections parsed with httptools, answered one request at a time.

Owns HTTP/1.1 on the client side: keep-alive and pipelining, request limits (413, 414, 431), read
deadlines (408), 100-continue, back-pressure signals, and handing each request to the journey
(/v1 completions), answering a worker's own load report itself (reports.py), or handing the request, byte
for byte, to the aiohttp control-plane app on an internal socket.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque

from httptools import HttpParserCallbackError, HttpParserError, HttpParserUpgrade, HttpRequestParser

from proxy.dataplane import http
from proxy.dataplane.exchange import PASS, Exchange, Retryable
from proxy.dataplane.identity import new_instance_id
from proxy.dataplane.journey import Journey
from proxy.dataplane.pool import Endpoint, UpstreamPool
from proxy.dataplane.reports import answer_report, report_worker_id
from proxy.errors import ProxyError, shutting_down
from proxy.live import LiveConfig
from proxy.metrics import ProxyMetrics
from proxy.registry import Registry
from proxy.request import CHAT, COMPLETIONS
from proxy.routing.service import RoutingService
from proxy.security.clientauth import ClientAuth

log = logging.getLogger("kvroute.dataplane")

COMPLETION_ROUTES = {b"/v1/chat/completions": CHAT, b"/v1/completions": COMPLETIONS}
MAX_URL_BYTES = 8192
# An idle keep-alive connection is closed after this long (nginx's and aiohttp's default is 75 s).
KEEPALIVE_S = 75.0
# After refusing a request whose body was not read, its bytes are read and dropped this long.
LINGER_S = 2.0
# The internal hop to the control-plane app: local, and it serves a long-lived event stream.
INTERNAL_IDLE_S = 24 * 3600.0

# What a connection waits for, and so which deadline applies.
_NOTHING, _OPENED, _IDLE, _HEAD, _BODY = range(5)


class IncomingRequest:
    """One client request, as parsed: head fields, body pieces, and a refusal if it cannot be served."""

    __slots__ = ("url", "headers", "method", "http11", "keep_alive", "kind", "parts", "size", "started",
                 "refusal", "refusal_direct", "principal", "header_bytes", "index", "reserved", "expect_continue")

    def __init__(self) -> None:
        self.url = b""
        self.headers: http.Headers = []
        self.method = b""
        self.http11 = True
        self.keep_alive = True
        self.kind: str | None = None
        self.parts: list[bytes | bytearray] = []  # one item: the body so far
        self.size = 0
        self.started = time.monotonic()
        self.refusal: ProxyError | None = None
        self.refusal_direct = False  # answered by the server itself, not counted by the journey
        self.principal = None
        self.header_bytes = 0
        self.index: dict[bytes, bytes] | None = None
        self.reserved = 0  # body bytes held against proxy.limits.max_buffered_body_bytes
        self.expect_continue = False

    def header(self, lower_name: bytes) -> bytes | None:
        index = self.index
        if index is None:  # built once, on the first question (the last value of a repeated name wins)
            index = self.index = {name.lower(): value for name, value in self.headers}
        return index.get(lower_name)

    def body(self) -> bytes:
        """The whole body (once: a body that came in pieces is handed over and its buffer let go)."""
        parts = self.parts
        if not parts:
            return b""
        body = parts[0]
        if isinstance(body, bytearray):
            body = parts[0] = bytes(body)
        return body


class BodyBudget:
    """Bytes of request bodies held at once, all connections together (proxy.limits.max_buffered_body_bytes).
    A body that does not fit waits, FIFO, up to `wait_s` with its connection's reading paused; then 503."""

    def __init__(self, capacity: int, wait_s: float) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.held = 0
        self.waiting: deque[tuple[ClientConnection, asyncio.TimerHandle]] = deque()

    def take(self, nbytes: int) -> bool:
        nbytes = min(nbytes, self.capacity)
        if self.waiting or self.held + nbytes > self.capacity:
            return False
        self.held += nbytes
        return True

    def wait(self, conn: ClientConnection) -> None:
        timer = conn.loop.call_later(self.wait_s, self._timed_out, conn)
        self.waiting.append((conn, timer))

    def give_back(self, nbytes: int) -> None:
        self.held -= min(nbytes, self.capacity)
        while self.waiting:
            conn, timer = self.waiting[0]
            need = min(conn.budget_need, self.capacity)
            if self.held + need > self.capacity:
                return
            self.waiting.popleft()
            timer.cancel()
            self.held += need
            conn.budget_granted()

    def forget(self, conn: ClientConnection) -> None:
        for entry in list(self.waiting):
            if entry[0] is conn:
                entry[1].cancel()
                self.waiting.remove(entry)

    def _timed_out(self, conn: ClientConnection) -> None:
        self.forget(conn)
        conn.budget_timed_out()


class _Refused(Exception):
    def __init__(self, error: ProxyError, direct: bool) -> None:
        self.error = error
        self.direct = direct


class DataPlane:
    """The public server: client connections, the upstream pool, the journey and the internal hop."""

    def __init__(self, live: LiveConfig, routing: RoutingService, registry: Registry, metrics: ProxyMetrics,
                 client_auth: ClientAuth, internal_socket: str, hop_secret: str) -> None:
        proxy_cfg = live.proxy  # limits and timeouts of the internal hop: read once (not live keys)
        self.loop = asyncio.get_running_loop()
        self.limits = proxy_cfg.limits
        self.max_body = proxy_cfg.max_body_bytes
        self.client_auth = client_auth
        self.registry = registry
        self.pool = UpstreamPool(self.loop)
        self.journey = Journey(live, routing, client_auth, registry, metrics, self.pool, new_instance_id())
        self.internal = Endpoint.unix(internal_socket)
        self.internal_timeouts = proxy_cfg.timeouts.model_copy(update={"idle_s": INTERNAL_IDLE_S, "total_s": None})
        self.hop_secret = hop_secret.encode()
        self.connections: set[ClientConnection] = set()
        self.body_budget = BodyBudget(self.limits.max_buffered_body_bytes, self.limits.buffered_body_wait_s)
        self.server: asyncio.Server | None = None
        self.shutting_down = False  # set by begin_shutdown(): new completions get 503 shutting_down
        self.shutting_down_response = http.error_response(shutting_down(), {}, False)
        self.refused = http.error_response(
            ProxyError(503, "The proxy has as many client connections open as it may.", "service_unavailable",
                       code="too_many_connections", headers={"Retry-After": "1"}), {}, False)
        self.header_timeout = http.error_response(
            ProxyError(408, f"The request headers did not arrive within {self.limits.header_read_timeout_s:g}s.",
                       code="header_timeout"), {}, False)
        self.body_timeout = http.error_response(
            ProxyError(408, f"The request body did not arrive within {self.limits.body_read_timeout_s:g}s.",
                       code="body_timeout"), {}, False)

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port; the bound port."""
        self.server = await self.loop.create_server(lambda: ClientConnection(self), host, port, backlog=1024,
                                                    reuse_address=True)
        return self.server.sockets[0].getsockname()[1]

    def begin_shutdown(self) -> None:
        """From now on new completions are refused (503 shutting_down, connection closed); those in flight
        go on. The listener stays open so a client learns why instead of seeing a refused connection."""
        self.shutting_down = True

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.abort()
        self.pool.close()
        await asyncio.to_thread(self.journey.observer.close)  # spans still queued go to the collector

    async def passthrough(self, client: ClientConnection, req: IncomingRequest) -> None:
        """Hand a non-completion request to the control-plane app, as sent, and relay its answer."""
        try:
            head = b"".join((
                req.method, b" ", req.url, b" HTTP/1.1\r\n",
                http.filtered(req.headers, http.HOP_BY_HOP, http.connection_named(req.headers) | http.INTERNAL_HOP),
                b"x-kvroute-client-addr: ", client.peer, b"\r\nx-kvroute-hop-secret: ", self.hop_secret,
                b"\r\nContent-Length: %d\r\n\r\n" % req.size))
            exchange = Exchange(client, PASS, b"", self.internal_timeouts, head_request=req.method == b"HEAD")
            outcome = await exchange.send(self.pool, self.internal, head + req.body())
            if isinstance(outcome, Retryable):
                log.error("the control-plane app did not answer: %s", outcome.detail)
                client.write(http.error_response(
                    ProxyError(502, "The proxy's control plane did not answer.", "server_error",
                               code="control_plane_unavailable"), {}, client.keep_alive))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error relaying %s", req.url.decode("latin-1"))
            client.abort()
            return
        client.response_done()


class ClientConnection(asyncio.Protocol):
    """One client connection: parses requests as bytes arrive and answers them in order."""

    __slots__ = ("plane", "loop", "transport", "parser", "request", "pending", "busy", "task", "exchange",
                 "http11", "keep_alive", "closed", "write_blocked_since", "reading_paused", "broken", "peer",
                 "timer", "timer_at", "wait_kind", "wait_since", "counted", "current", "reserved", "budget_need")

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.loop = plane.loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = HttpRequestParser(self)
        self.request: IncomingRequest | None = None   # being parsed
        self.pending: deque[IncomingRequest] = deque()  # parsed, waiting for their turn
        self.busy = False
        self.task: asyncio.Task[None] | None = None
        self.exchange: Exchange | None = None
        self.http11 = True
        self.keep_alive = True
        self.closed = False
        self.write_blocked_since: float | None = None
        self.reading_paused = False
        self.broken = False  # the byte stream cannot be parsed further: answer what is queued, then close
        self.peer = b""
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.wait_kind = _NOTHING
        self.wait_since = 0.0
        self.counted = False
        self.current: IncomingRequest | None = None  # being answered
        self.reserved = 0      # body bytes this connection holds against the budget
        self.budget_need = 0   # waiting for this much room in the budget

    # --- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        plane = self.plane
        if len(plane.connections) >= plane.limits.max_client_connections:
            self.closed = self.broken = True
            transport.write(plane.refused)  # type: ignore[attr-defined]
            transport.close()
            return
        plane.connections.add(self)
        self.counted = True
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peername = transport.get_extra_info("peername")
        if isinstance(peername, tuple) and peername:
            self.peer = str(peername[0]).encode()
        self._wait(_OPENED, self.loop.time())

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            self.parser.feed_data(data)
        except HttpParserCallbackError as exc:  # httptools wraps what a callback raised
            refused = exc.__context__
            if isinstance(refused, _Refused):
                self._refuse(refused.error, refused.direct)
                return
            log.error("failed parsing a request", exc_info=refused)
            self._refuse(ProxyError(500, "The proxy failed to read this request.", "server_error",
                                    code="internal_error"), True)
        except HttpParserUpgrade:
            self._refuse(ProxyError(501, "This proxy does not switch protocols.", code="upgrade_not_supported"),
                         True)
        except HttpParserError as exc:
            self._refuse(ProxyError(400, f"Malformed HTTP request ({exc}).", code="malformed_request"), True)

    def eof_received(self) -> bool:
        return False  # the client is gone: close, and cancel whatever it asked for

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.counted:
            self.counted = False
            self.plane.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.exchange is not None:
            self.exchange.client_lost()
        elif self.task is not None:
            self.task.cancel()
        if self.reserved:  # bodies of requests never answered
            self.plane.body_budget.give_back(self.reserved)
            self.reserved = 0
        if self.budget_need:
            self.plane.body_budget.forget(self)
            self.budget_need = 0

    def pause_writing(self) -> None:
        self.write_blocked_since = self.loop.time()
        if self.exchange is not None:
            self.exchange.client_paused()

    def resume_writing(self) -> None:
        self.write_blocked_since = None
        if self.exchange is not None:
            self.exchange.client_resumed()

    # --- httptools callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.request = IncomingRequest()
        if self.wait_kind == _OPENED:  # the first request's head is due counting from the connection's start
            self.wait_kind = _HEAD
        else:
            self._wait(_HEAD, self.loop.time())

    def on_url(self, url: bytes) -> None:
        req = self.request
        req.url += url
        if len(req.url) > MAX_URL_BYTES:
            raise _Refused(ProxyError(414, f"The request URL is longer than {MAX_URL_BYTES} bytes.",
                                      code="uri_too_long"), True)

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self.request
        limits = self.plane.limits
        req.header_bytes += len(name) + len(value) + 4
        if len(req.headers) >= limits.max_headers:
            raise _Refused(ProxyError(431, f"More than {limits.max_headers} header fields; at most "
                                           f"{limits.max_headers} are accepted.",
                                      code="request_header_fields_too_large"), True)
        if req.header_bytes > limits.max_header_bytes:
            raise _Refused(ProxyError(431, f"The headers hold more than {limits.max_header_bytes} bytes; at most "
                                           f"{limits.max_header_bytes} are accepted.",
                                      code="request_header_fields_too_large"), True)
        req.headers.append((name, value))

    def on_headers_complete(self) -> None:
        req = self.request
        parser = self.parser
        plane = self.plane
        req.method = parser.get_method()
        req.http11 = parser.get_http_version() == "1.1"
        req.keep_alive = req.http11 and parser.should_keep_alive()
        path = req.url.split(b"?", 1)[0]
        kind = COMPLETION_ROUTES.get(path) if req.method == b"POST" else None
        req.kind = kind
        if kind is not None and plane.client_auth.enabled:  # an unknown caller costs no body read
            try:
                req.principal = plane.client_auth.authenticate(req.header(b"authorization"))
            except ProxyError as exc:
                raise _Refused(exc, True) from None
        length = req.header(b"content-length")
        if length is not None and int(length) > plane.max_body:
            raise _Refused(_too_large(plane.max_body), kind is None)
        expect = req.header(b"expect")
        req.expect_continue = (expect is not None and expect.lower() == b"100-continue" and req.http11
                               and not self.busy)
        self._wait(_BODY, self.loop.time())
        if length is None and req.header(b"transfer-encoding") is None:
            return  # no body
        need = int(length) if length is not None else plane.max_body
        if need and not plane.body_budget.take(need):
            # Bodies in memory are at the budget: this one waits (reading paused) for room, then 503.
            self.budget_need = need
            self.transport.pause_reading()
            plane.body_budget.wait(self)
            return
        self._reserved(need)

    def _reserved(self, need: int) -> None:
        req = self.request
        req.reserved = need
        self.reserved += need
        if req.expect_continue:
            self.transport.write(http.CONTINUE)

    def budget_granted(self) -> None:
        """The body budget has room for the request waiting on it (BodyBudget took it for us)."""
        need, self.budget_need = self.budget_need, 0
        if self.closed or self.request is None:  # gone, or its body had come with its head after all
            self.plane.body_budget.give_back(need)
        else:
            self._reserved(need)
        if not self.closed and not self.reading_paused and not self.broken:
            self.transport.resume_reading()

    def budget_timed_out(self) -> None:
        self.budget_need = 0
        if self.closed:
            return
        if self.request is None:
            if not self.reading_paused and not self.broken:
                self.transport.resume_reading()
            return
        self._refuse(ProxyError(503, "The proxy holds as many request bodies as it may right now; retry shortly.",
                                "service_unavailable", code="body_memory_full", headers={"Retry-After": "1"}), True)

    def on_body(self, body: bytes) -> None:
        req = self.request
        parts = req.parts
        if not parts:
            parts.append(body)
        elif len(parts) == 1 and not isinstance(parts[0], bytearray):
            # A body in pieces grows in one buffer: glibc serves it from mmap once large (security/limits.py
            # fixes the threshold) and gives it back whole, where thousands of 64 KiB pieces would fragment
            # the heap and keep a burst of large bodies resident.
            parts[0] = bytearray(parts[0])
            parts[0] += body
        else:
            parts[0] += body
        req.size += len(body)
        if req.size > self.plane.max_body:
            raise _Refused(_too_large(self.plane.max_body), req.kind is None)

    def on_message_complete(self) -> None:
        req = self.request
        self.request = None
        self.wait_kind = _NOTHING
        self.pending.append(req)
        if self.busy:
            if not self.reading_paused:  # one parsed request ahead is enough: the rest waits in the socket
                self.reading_paused = True
                self.transport.pause_reading()
        else:
            self._next()

    # --- answering ------------------------------------------------------------------------------
    def _refuse(self, error: ProxyError, direct: bool) -> None:
        """The byte stream cannot go on: answer `error` in turn (after what is queued), then close."""
        req = self.request or IncomingRequest()
        self.request = None
        req.refusal = error
        req.refusal_direct = direct or req.kind is None
        req.keep_alive = False
        self.broken = True
        self.wait_kind = _NOTHING
        self.pending.append(req)
        if not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        self._next()

    def _next(self) -> None:
        if self.busy or self.closed:
            return
        if not self.pending:
            if self.reading_paused and not self.broken:
                self.reading_paused = False
                self.transport.resume_reading()
            return
        req = self.pending.popleft()
        self.current = req
        self.busy = True
        self.http11 = req.http11
        self.keep_alive = req.keep_alive
        if req.kind is not None and self.plane.shutting_down:
            self.keep_alive = False
            self.write(self.plane.shutting_down_response)
            self.plane.journey.observer.refused(req, 503, "shutting_down")
            self.response_done()
            return
        if req.refusal is not None and req.refusal_direct:
            self.keep_alive = False
            self.write(http.error_response(req.refusal, {}, False))
            if req.kind is not None:  # a completion refused on its head (401, 413, 431, 408...): logged too
                self.plane.journey.observer.refused(req, req.refusal.status, req.refusal.code)
            self.response_done()
            return
        plane = self.plane
        if req.kind is None and (worker_id := report_worker_id(req.method, req.url)) is not None:
            answer = answer_report(plane.registry, worker_id, req.header(b"authorization"), req.body(),
                                   self.keep_alive)
            if answer is not None:  # a worker's own report, recorded: no hop to the control plane
                self.write(answer)
                self.response_done()
                return
        coro = plane.journey.serve(self, req) if req.kind is not None else plane.passthrough(self, req)
        self.task = self.loop.create_task(coro)

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    def abort(self) -> None:
        self.closed = True
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()

    def response_done(self) -> None:
        """The answer to the current request is written: close, or go on with the next one."""
        self.task = None
        self.busy = False
        current, self.current = self.current, None
        if current is not None and current.reserved:
            self.reserved -= current.reserved
            self.plane.body_budget.give_back(current.reserved)
            current.reserved = 0
        if self.closed:
            return
        if not self.keep_alive or self.plane.shutting_down:
            if self.write_blocked_since is not None:
                self.abort()
            elif self.broken:
                self._linger()
            else:
                self._close()
            return
        now = self.loop.time()
        if self.request is not None:
            self._wait(self.wait_kind, now)  # a pipelined request's deadline runs from now
        elif not self.pending:
            self._wait(_IDLE, now)
        self._next()

    # --- deadlines: one timer per connection, re-armed only when it fires early -------------------
    def _deadline(self) -> float:
        kind = self.wait_kind
        limits = self.plane.limits
        if kind == _IDLE:
            return self.wait_since + KEEPALIVE_S
        if kind == _BODY:
            return self.wait_since + limits.body_read_timeout_s
        return self.wait_since + limits.header_read_timeout_s

    def _wait(self, kind: int, since: float) -> None:
        self.wait_kind = kind
        self.wait_since = since
        deadline = self._deadline()
        if self.timer is not None:
            if self.timer_at <= deadline:
                return
            self.timer.cancel()
        self.timer_at = deadline
        self.timer = self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        kind = self.wait_kind
        if self.closed or kind == _NOTHING:
            return
        now = self.loop.time()
        deadline = self._deadline()
        if now < deadline or self.busy:  # busy: a pipelined request waits for its turn, not for the client
            self.timer_at = max(deadline, now + 1.0)
            self.timer = self.loop.call_at(self.timer_at, self._on_timer)
            return
        if kind == _IDLE:
            self.abort() if self.write_blocked_since is not None else self._close()
            return
        self.broken = True
        self.transport.write(self.plane.body_timeout if kind == _BODY else self.plane.header_timeout)
        self._linger()

    def _close(self) -> None:
        self.closed = True
        self.transport.close()

    def _linger(self) -> None:
        """Close after an answer to a request whose bytes were not all read: closing with unread input
        makes the kernel send a reset, which can destroy the answer before the client reads it. So:
        end our side, read and drop what still comes for a moment, then close."""
        self.closed = True
        transport = self.transport
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        self.loop.call_later(LINGER_S, transport.abort)


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"The request body is larger than the proxy's limit of {limit} bytes.",
                      "invalid_request_error", code="request_too_large")
