"""One request sent over one upstream connection, and its response relayed to one client.

Owns the response's life: head, retryable failures before the first byte, unbuffered relay with
back-pressure (pause_reading while the client's buffer is full), the SSE error event after the
first byte, and connect / first-byte / idle / stalled-reader deadlines on one lazily re-armed timer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import orjson
from httptools import HttpParserError, HttpResponseParser

from proxy.config import Timeouts
from proxy.dataplane import http
from proxy.dataplane.pool import Endpoint, UpstreamConnection, UpstreamPool
from proxy.errors import error_body

log = logging.getLogger("kvroute.dataplane")

# Responses up to this size are read whole before the client sees a byte (a worker that breaks
# off is then retried elsewhere); larger ones are relayed as they come.
BUFFER_LIMIT = 1024 * 1024

# How the response is handled: a worker's stream, a worker's whole answer, the internal app's answer.
STREAM, WHOLE, PASS = 0, 1, 2
# Where the exchange stands.
_HEAD, _ERROR_BODY, _BUFFER, _FIRST, _RELAY, _DONE = range(6)
# How the client's body is framed once the head is sent.
_NO_BODY, _LENGTH, _CHUNKED, _CLOSE = range(4)


class Client(Protocol):
    """What an exchange needs of the client connection (server.py's ClientConnection)."""

    transport: asyncio.Transport
    http11: bool
    keep_alive: bool
    closed: bool
    write_blocked_since: float | None
    exchange: Exchange | None


@dataclass(slots=True)
class Retryable:
    """Nothing reached the client yet, so another worker may serve the request."""

    reason: str                 # connect_error | first_byte_timeout | status_5xx | status_429 | broken_body | ...
    detail: str
    status: int | None = None   # the worker's HTTP status, when it answered
    body: bytes | None = None
    content_type: str | None = None
    retry_after: str | None = None


@dataclass(slots=True)
class Relayed:
    """The client got an answer (or left): how it ended, for metrics and the circuit breaker."""

    status: int
    first_byte_at: float | None   # time.monotonic() of the first byte sent to the client
    worker_failed: bool = False   # the worker broke the response after the first byte
    client_gone: bool = False


_STALE = Retryable("stale", "a pooled connection was closed by the worker")


class Exchange:
    """Send one request and relay its response; `await send(...)` returns how it ended."""

    __slots__ = ("client", "mode", "extra", "timeouts", "loop", "future", "conn", "parser", "state", "status",
                 "headers", "parts", "size", "out", "complete", "interim", "sse", "framing", "first_byte_at",
                 "last_activity", "first_byte_deadline", "timer", "got_head", "paused", "ends_clean",
                 "head_request", "close_delimited", "total_deadline", "keep_alive", "index", "held_head")

    def __init__(self, client: Client, mode: int, extra_headers: bytes, timeouts: Timeouts,
                 head_request: bool = False) -> None:
        self.client = client
        self.mode = mode
        self.extra = extra_headers
        self.timeouts = timeouts
        self.loop = asyncio.get_running_loop()
        self.head_request = head_request
        self.conn: UpstreamConnection | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.total_deadline: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.future: asyncio.Future[Retryable | Relayed] = self.loop.create_future()
        self.parser = None
        self.state = _HEAD
        self.status = 0
        self.headers: http.Headers = []
        self.index: dict[bytes, bytes] = {}
        self.parts: list[bytes] = []
        self.size = 0
        self.out: list[bytes] = []
        self.held_head = b""
        self.complete = False
        self.keep_alive = False
        self.interim = False
        self.sse = False
        self.framing = _NO_BODY
        self.first_byte_at: float | None = None
        self.last_activity = 0.0
        self.got_head = False
        self.paused = False
        self.ends_clean = True
        self.close_delimited = False

    # --- the awaitable side ------------------------------------------------------------------
    async def send(self, pool: UpstreamPool, endpoint: Endpoint, request: bytes) -> Retryable | Relayed:
        loop = self.loop
        self.first_byte_deadline = loop.time() + self.timeouts.first_byte_s
        total_s = self.timeouts.total_s
        self.total_deadline = loop.time() + total_s if total_s is not None and self.mode == WHOLE else None
        for _ in range(2):  # a second time only when a pooled connection turned out to be closed
            try:
                conn = await pool.acquire(endpoint, min(self.timeouts.connect_s,
                                                        max(0.001, self.first_byte_deadline - loop.time())))
            except TimeoutError:
                return Retryable("connect_error", f"no connection within {self.timeouts.connect_s}s")
            except OSError as exc:
                return Retryable("connect_error", f"{type(exc).__name__}: {exc}")
            self.conn = conn
            conn.exchange = self
            self.client.exchange = self
            self.parser = HttpResponseParser(self)
            conn.transport.write(request)
            self._arm(self.first_byte_deadline)
            try:
                outcome = await self.future
            finally:
                if self.state != _DONE:  # cancelled: the worker must see the request end
                    self._stop()
                self.client.exchange = None
            if outcome is _STALE:
                self._reset()
                continue
            return outcome
        return Retryable("connect_error", "pooled connections to the worker keep closing")

    # --- httptools callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: interim, the real answer follows on the same connection
            self.interim = True
            self.headers = []
            return
        self.status = status
        self.got_head = True
        index = self.index = {name.lower(): value for name, value in self.headers}
        has_length = b"content-length" in index
        te = index.get(b"transfer-encoding")
        self.close_delimited = (not has_length and (te is None or b"chunked" not in te.lower())
                                and status not in (204, 304) and not self.head_request)
        if self.mode == PASS:
            self._commit_relay()
            if self.head_request:  # no body follows, whatever the head says
                self.complete = True
            return
        if status >= 500 or status == 429:
            self.state = _ERROR_BODY
        elif self.mode == STREAM and index.get(b"content-type", b"").startswith(b"text/event-stream"):
            self.sse = True
            self.state = _FIRST
        else:
            self.state = _BUFFER
            self._rearm_idle()

    def on_body(self, body: bytes) -> None:
        state = self.state
        if state == _RELAY:
            self.out.append(body)
        elif state == _FIRST:
            self._commit_relay()
            self.out.append(body)
        else:
            self.parts.append(body)
            self.size += len(body)
            if state == _BUFFER and self.size > BUFFER_LIMIT:
                self._commit_relay()
                self.out.extend(self.parts)
                self.parts = []

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        # llhttp forgets the connection's flags once this callback returns: ask now
        self.keep_alive = self.parser.should_keep_alive()

    # --- the upstream connection's events -------------------------------------------------------
    def upstream_data(self, data: bytes) -> None:
        if self.state == _DONE:
            return
        self.last_activity = self.loop.time()
        try:
            self.parser.feed_data(data)
        except HttpParserError as exc:
            self._fail(False, f"an unreadable response ({exc})")
            return
        if self.complete:
            self._finish()
        elif self.out or self.held_head:  # a head alone goes out too: an event stream may be quiet a while
            self._flush()

    def upstream_eof(self) -> None:
        self.upstream_lost(None)

    def upstream_lost(self, exc: Exception | None) -> None:
        if self.state == _DONE:
            return
        if self.close_delimited and self.got_head and not self.complete:
            self.complete = True  # the body was framed by the connection's end
            self._finish()
            return
        self._fail(False, f"{type(exc).__name__}: {exc}" if exc else "the worker closed the connection")

    # --- the client connection's events ---------------------------------------------------------
    def client_paused(self) -> None:
        conn = self.conn
        if self.state == _RELAY and conn is not None and not conn.closed and not self.paused:
            self.paused = True
            conn.transport.pause_reading()

    def client_resumed(self) -> None:
        conn = self.conn
        if self.paused and conn is not None and not conn.closed:
            self.paused = False
            self.last_activity = self.loop.time()  # the worker was waiting on us, not idle
            conn.transport.resume_reading()

    def client_lost(self) -> None:
        if self.state == _DONE:
            return
        self._stop()
        self.future.set_result(Relayed(self.status, self.first_byte_at, client_gone=True))

    # --- deadlines: one timer, re-armed only when it fires early ----------------------------------
    def _arm(self, when: float) -> None:
        self.timer = self.loop.call_at(when, self._on_timer)

    def _rearm_idle(self) -> None:
        """Leaving the first-byte phase: the idle deadline may come sooner than the armed timer."""
        if self.timer is not None:
            self.timer.cancel()
        self.last_activity = self.loop.time()
        self._arm(self.last_activity + self.timeouts.idle_s)

    def _on_timer(self) -> None:
        self.timer = None
        state = self.state
        if state == _DONE:
            return
        idle_s = self.timeouts.idle_s
        blocked_since = self.client.write_blocked_since
        if state in (_HEAD, _FIRST):
            deadline = self.first_byte_deadline
            if self.total_deadline is not None and self.total_deadline < deadline:
                deadline = self.total_deadline
        elif state == _RELAY and blocked_since is not None:
            deadline = blocked_since + idle_s
        else:
            deadline = self.last_activity + idle_s
            if self.total_deadline is not None and self.total_deadline < deadline and state != _RELAY:
                deadline = self.total_deadline
        if self.loop.time() < deadline:
            self._arm(deadline)
        elif state == _RELAY and blocked_since is not None:
            log.warning("client stopped reading for %.0fs; dropping its stream", idle_s)
            self._stop()
            self.client.closed = True
            self.client.transport.abort()
            self.future.set_result(Relayed(self.status, self.first_byte_at, client_gone=True))
        else:
            if state in (_HEAD, _FIRST):
                self._fail(True, f"no answer within {self.timeouts.first_byte_s}s")
            elif self._past_total():
                self._fail(True, f"no whole answer within {self.timeouts.total_s}s")
            else:
                self._fail(True, f"nothing for {idle_s}s")

    def _past_total(self) -> bool:
        return self.total_deadline is not None and self.loop.time() >= self.total_deadline

    # --- committing to the client and relaying -------------------------------------------------
    def _head(self, framing: int, length: int = 0) -> bytes:
        drop = http.connection_named(self.headers)
        lines = http.filtered(self.headers, http.HOP_BY_HOP,
                              drop | http.FROM_WORKER_REPLACED if self.mode != PASS else drop)
        client = self.client
        if framing == _LENGTH:
            end = b"Content-Length: %d\r\n" % length
        elif framing == _CHUNKED:
            end = b"Transfer-Encoding: chunked\r\n"
        else:
            end = b""
        if self.head_request:
            value = self.index.get(b"content-length")
            end = b"Content-Length: " + value + b"\r\n" if value is not None else b""
        if not client.keep_alive:
            end += b"Connection: close\r\n"
        return b"".join((http.status_line(self.status), lines, self.extra, end, b"\r\n"))

    def _commit_relay(self) -> None:
        """Send the head now; the body follows as it arrives."""
        client = self.client
        self.state = _RELAY
        self.first_byte_at = time.monotonic()
        length_value = self.index.get(b"content-length")
        if self.head_request or self.status in (204, 304):
            framing = _NO_BODY
        elif self.mode == PASS and length_value is not None and not self.close_delimited:
            framing = _LENGTH
        elif client.http11:
            framing = _CHUNKED
        else:
            framing = _CLOSE
            client.keep_alive = False
        self.framing = framing
        # written with the first piece of body (one send instead of two; see _flush)
        self.held_head = self._head(framing, int(length_value) if framing == _LENGTH else 0)
        self._rearm_idle()

    def _flush(self, last: bool = False) -> None:
        """Write what arrived (and a held head, and with `last` the end of the body) in one send."""
        parts = []
        if self.held_head:
            parts.append(self.held_head)
            self.held_head = b""
        out = self.out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            self.out = []
            if self.sse:
                self.ends_clean = data.endswith(b"\n\n")
            parts.append(http.chunk(data) if self.framing == _CHUNKED else data)
        if last and self.framing == _CHUNKED:
            parts.append(http.LAST_CHUNK)
        if parts and not self.client.closed:
            self.client.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def _finish(self) -> None:
        """The worker's response is complete: answer the client if not yet done, free the connection."""
        state = self.state
        keep = self.keep_alive and not self.close_delimited and not self.head_request
        self.state = _DONE
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        conn = self.conn
        self.conn = None
        if conn is not None:
            if keep:
                conn.pool.release(conn)
            else:
                conn.close()
        client = self.client
        if state == _ERROR_BODY:
            status = self.status
            retry_after = self.index.get(b"retry-after")
            outcome: Retryable | Relayed = Retryable(
                f"status_{status}", f"worker answered HTTP {status}", status, b"".join(self.parts),
                (self.index.get(b"content-type") or b"").decode("latin-1") or None,
                retry_after.decode("latin-1") if retry_after is not None else None)
        elif state == _RELAY:
            self._flush(last=True)
            outcome = Relayed(self.status, self.first_byte_at, client_gone=client.closed)
        else:  # _BUFFER or _FIRST: the whole answer at once
            body = b"".join(self.parts)
            self.first_byte_at = time.monotonic()
            if not client.closed:
                client.transport.write(self._head(_LENGTH, len(body)) + body)
            outcome = Relayed(self.status, self.first_byte_at, client_gone=client.closed)
        self.future.set_result(outcome)

    def _fail(self, timed_out: bool, detail: str) -> None:
        """The worker failed (closed, broke the framing, or went silent): retry, or end the client's answer."""
        state = self.state
        reused = self.conn is not None and self.conn.reused
        if self.out or self.held_head:
            self._flush()
        self._stop()
        status = self.status
        if state == _HEAD:
            if not timed_out and reused and not self.got_head and not self.parser_seen_bytes():
                outcome: Retryable | Relayed = _STALE
            elif timed_out:
                outcome = Retryable("first_byte_timeout", detail)
            else:
                outcome = Retryable("connect_error", detail)
        elif state in (_ERROR_BODY, _BUFFER):
            reason = ("total_timeout" if self._past_total() else "idle_timeout") if timed_out else "broken_body"
            outcome = Retryable(reason, f"worker answered HTTP {status}, then {detail}")
        elif state == _FIRST:
            outcome = Retryable("first_byte_timeout" if timed_out else "broken_before_first_chunk",
                                f"{detail} before the first chunk")
        else:
            reason = "idle_timeout" if timed_out else "connection_lost"
            log.warning("worker stream broke after the first byte (%s); ending the client's stream", reason)
            self._end_client_after_failure(reason)
            outcome = Relayed(status, self.first_byte_at, worker_failed=True, client_gone=self.client.closed)
        self.future.set_result(outcome)

    def parser_seen_bytes(self) -> bool:
        return self.last_activity != 0.0

    def _end_client_after_failure(self, reason: str) -> None:
        """An SSE stream gets an error event and [DONE]; any other body can only be cut off."""
        client = self.client
        if client.closed:
            return
        if self.sse and self.framing in (_CHUNKED, _CLOSE):
            event = orjson.dumps(error_body(f"The worker serving this request failed mid-stream ({reason}).",
                                            "server_error", code="worker_failed"))
            data = (b"" if self.ends_clean else b"\n\n") + b"data: " + event + b"\n\ndata: [DONE]\n\n"
            if self.framing == _CHUNKED:
                client.transport.write(http.chunk(data) + http.LAST_CHUNK)
                return
            client.transport.write(data)
        client.keep_alive = False
        client.closed = True
        if self.framing == _CLOSE and self.sse:
            client.transport.close()
        else:
            client.transport.abort()

    def _stop(self) -> None:
        """No more of this exchange: the timer goes, the upstream connection closes (the worker sees it)."""
        self.state = _DONE
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        conn = self.conn
        self.conn = None
        if conn is not None:
            conn.close()
