"""One client connection of the public port: requests parsed with httptools as bytes arrive, answered in order.

Owns HTTP/1.1 on the client side of one connection: keep-alive and pipelining (one parsed request ahead at
most), read deadlines (408), 100-continue, waiting for room in the body budget, back-pressure signals to the
exchange relaying into it, and closing without losing an answer. What a request is and whether it may go on
is incoming.py's; who answers it is the server's, asked through the Server protocol.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Coroutine
from typing import Any, Protocol

from httptools import HttpParserCallbackError, HttpParserError, HttpParserUpgrade, HttpRequestParser

from proxy.config import ProxyLimits
from proxy.dataplane import http
from proxy.dataplane.budget import BodyBudget
from proxy.dataplane.gate import KEEPALIVE_S, ConnectionGate, client_key
from proxy.dataplane.heads import REQUEST_LINE_SLACK, HeadBound, feed_bounded
from proxy.dataplane.incoming import MAX_URL_BYTES, IncomingRequest, Refused
from proxy.dataplane.relay import ClientListener
from proxy.errors import ProxyError
from proxy.security.clientauth import ClientAuth

log = logging.getLogger("kvroute.dataplane")

# After refusing a request whose body was not read, its bytes are read and dropped this long.
LINGER_S = 2.0

# What a connection waits for, and so which deadline applies.
_NOTHING, _OPENED, _IDLE, _HEAD, _BODY = range(5)


class Server(Protocol):
    """What a client connection needs of the server that accepted it (server.py's DataPlane)."""

    loop: asyncio.AbstractEventLoop
    limits: ProxyLimits
    max_body: int
    client_auth: ClientAuth
    body_budget: BodyBudget
    gate: ConnectionGate    # who is let in, and how long an idle connection stays
    shutting_down: bool
    refused: bytes          # the answers to a connection over the total cap, and over its client's cap
    refused_client: bytes
    header_timeout: bytes   # the answers to a head or a body that did not arrive in time
    body_timeout: bytes

    def answer(self, conn: ClientConnection, req: IncomingRequest) -> Coroutine[Any, Any, None] | None:
        """Answer `req` on `conn` now (None), or the coroutine that answers it."""
        ...


class ClientConnection(asyncio.Protocol):
    """One client connection: parses requests as bytes arrive and answers them in order."""

    __slots__ = ("plane", "loop", "transport", "parser", "request", "pending", "busy", "task", "exchange",
                 "http11", "keep_alive", "closed", "write_blocked_since", "reading_paused", "broken", "peer",
                 "timer", "timer_at", "wait_kind", "wait_since", "counted", "current", "reserved", "budget_need",
                 "head", "client")

    def __init__(self, plane: Server) -> None:
        self.plane = plane
        self.loop = plane.loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = HttpRequestParser(self)
        self.head = HeadBound(plane.limits.max_header_bytes + MAX_URL_BYTES + REQUEST_LINE_SLACK)
        self.request: IncomingRequest | None = None   # being parsed
        self.pending: deque[IncomingRequest] = deque()  # parsed, waiting for their turn
        self.busy = False
        self.task: asyncio.Task[None] | None = None
        self.exchange: ClientListener | None = None  # the exchange relaying into this connection
        self.http11 = True
        self.keep_alive = True
        self.closed = False
        self.write_blocked_since: float | None = None
        self.reading_paused = False
        self.broken = False  # the byte stream cannot be parsed further: answer what is queued, then close
        self.peer = b""
        self.client = b""  # whose connection it is, for the per-client cap (gate.py)
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
        peername = transport.get_extra_info("peername")
        if isinstance(peername, tuple) and peername:
            self.peer = str(peername[0]).encode()
        self.client = client_key(self.peer)
        sock = transport.get_extra_info("socket")
        refused = plane.gate.admit(self, self.client, sock.fileno() if sock is not None else -1)
        if refused is not None:
            self.closed = self.broken = True
            answer = plane.refused if refused == "total_cap" else plane.refused_client
            transport.write(answer)  # type: ignore[attr-defined]
            transport.close()
            return
        self.counted = True
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._wait(_OPENED, self.loop.time())

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            if not feed_bounded(self.parser, self.head, data):
                self._refuse(ProxyError(431, "The request head (or its trailers) is larger than the proxy accepts.",
                                        code="request_header_fields_too_large"), True)
                return
        except HttpParserCallbackError as exc:  # httptools wraps what a callback raised
            refused = exc.__context__
            if isinstance(refused, Refused):
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
            self.plane.gate.release(self, self.client)
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
        self.request.add_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.request.add_header(name, value, self.plane.limits)

    def on_headers_complete(self) -> None:
        self.head.reading = False
        req = self.request
        plane = self.plane
        need = req.head_complete(self.parser, plane.client_auth, plane.max_body)
        if req.expect_continue and self.busy:  # its turn comes later: no interim answer ahead of the current one
            req.expect_continue = False
        self._wait(_BODY, self.loop.time())
        if need is None:
            return  # no body
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

    def on_chunk_header(self) -> None:
        self.head.start()  # the last chunk's trailers may follow: bounded as a head is

    def on_body(self, body: bytes) -> None:
        self.head.reading = False
        self.request.add_body(body, self.plane.max_body)

    def on_message_complete(self) -> None:
        self.head.start()  # the next request's head
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
        answering = self.plane.answer(self, req)
        if answering is not None:
            self.task = self.loop.create_task(answering)

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
            return self.wait_since + self.plane.gate.keepalive_s
        if kind == _BODY:
            return self.wait_since + limits.body_read_timeout_s
        if kind == _OPENED:  # nothing sent yet: as idle as an idle keep-alive connection
            return self.wait_since + min(limits.header_read_timeout_s, self.plane.gate.keepalive_s)
        return self.wait_since + limits.header_read_timeout_s

    def keepalive_changed(self) -> None:
        """The gate's keep-alive changed (the proxy became busy): an idle connection's deadline moves."""
        if not self.closed and self.wait_kind in (_IDLE, _OPENED):
            self._wait(self.wait_kind, self.wait_since)

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
        if kind == _IDLE or (kind == _OPENED and now < self.wait_since + self.plane.limits.header_read_timeout_s):
            if now < self.wait_since + KEEPALIVE_S:  # closed early: the proxy is busy
                self.plane.gate.shed_idle()
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
