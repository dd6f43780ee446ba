"""One request sent over one upstream connection, and its response relayed to one client.

Owns the response's life on the worker's side: its head, retryable failures before the first byte, unbuffered
relay with back-pressure (pause_reading while the client's buffer is full), a break after the first byte, and
connect / first-byte / idle / stalled-reader deadlines on one lazily re-armed timer. What the client gets and
how it is framed is relay.py's. A migratable stream's events pass through a StreamTracker (migration.py): a
break then hands the open client stream back to the journey, and a continuation's exchange relays into it
without a head.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from httptools import HttpParserError, HttpResponseParser

from proxy.config import Timeouts
from proxy.dataplane import http
from proxy.dataplane.heads import MAX_RESPONSE_HEAD_BYTES, HeadBound, feed_bounded
from proxy.dataplane.migration import StreamTracker
from proxy.dataplane.outcome import PASS, STREAM, WHOLE, Relayed, Retryable, bad_response
from proxy.dataplane.pool import Endpoint, UpstreamConnection, UpstreamPool
from proxy.dataplane.relay import Client, Relay
from proxy.dataplane.stall import Pulse

log = logging.getLogger("kvroute.dataplane")

# Responses up to this size are read whole before the client sees a byte (a worker that breaks
# off is then retried elsewhere); larger ones are relayed as they come.
BUFFER_LIMIT = 1024 * 1024

# Where the exchange stands.
_HEAD, _ERROR_BODY, _BUFFER, _FIRST, _RELAY, _DONE = range(6)

_STALE = Retryable("stale", "a pooled connection was closed by the worker")


class Exchange:
    """Send one request and relay its response; `await send(...)` returns how it ended."""

    __slots__ = ("client", "mode", "extra", "timeouts", "loop", "future", "conn", "parser", "state", "status",
                 "headers", "parts", "size", "out", "complete", "interim", "sse", "relay", "first_byte_at",
                 "last_activity", "first_byte_deadline", "timer", "got_head", "paused",
                 "head_request", "close_delimited", "total_deadline", "keep_alive", "index",
                 "tracker", "resumed", "pulse", "stall_detail", "streaming", "timer_at", "on_output",
                 "events_seen", "on_head", "bound")

    def __init__(self, client: Client, mode: int, extra_headers: bytes, timeouts: Timeouts,
                 head_request: bool = False, tracker: StreamTracker | None = None, resumed: bool = False,
                 pulse: Pulse | None = None) -> None:
        self.client = client
        self.tracker = tracker    # a migratable stream: its events are read (and rewritten when `resumed`)
        self.resumed = resumed    # continues a stream whose head (and first events) the client already has
        self.pulse = pulse        # the worker's liveness (stall.py), when it is watched
        self.stall_detail: str | None = None
        self.streaming = False    # counted in the pulse's streams under way
        self.mode = mode
        self.extra = extra_headers
        self.timeouts = timeouts
        self.loop = client.loop  # not asyncio.get_running_loop(): that costs a getpid() system call
        self.head_request = head_request
        self.conn: UpstreamConnection | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.total_deadline: float | None = None
        # called once when a stream's first generated output arrives (the routing's prefill backlog): its second
        # event, as vLLM sends the role chunk with the first token and the sim sends it at once
        self.on_output: Callable[[], None] | None = None
        self.on_head: Callable[[], None] | None = None  # called once at the upstream's final (non-1xx) head
        self.events_seen = 0
        self._reset()

    def _reset(self) -> None:
        self.future: asyncio.Future[Retryable | Relayed] = self.loop.create_future()
        self.parser = None
        self.bound = HeadBound(MAX_RESPONSE_HEAD_BYTES)
        self.state = _HEAD
        self.status = 0
        self.headers: http.Headers = []
        self.index: dict[bytes, bytes] = {}
        self.parts: list[bytes] = []
        self.size = 0
        self.out: list[bytes] = []  # body bytes for the client, not yet written
        self.relay = Relay(self.client, self.mode, self.extra, self.head_request, self.tracker, self.resumed)
        self.complete = False
        self.keep_alive = False
        self.interim = False
        self.sse = False
        self.first_byte_at: float | None = None
        self.last_activity = 0.0
        self.got_head = False
        self.paused = False
        self.close_delimited = False

    # --- the awaitable side ------------------------------------------------------------------
    async def send(self, pool: UpstreamPool, endpoint: Endpoint, request: bytes) -> Retryable | Relayed:
        loop = self.loop
        now = loop.time()
        if self.mode == WHOLE:
            # vLLM sends a non-streamed answer's head only once the answer is complete: its one deadline is
            # timeouts.total_s (None: none), never first_byte_s, which is for streams.
            total_s = self.timeouts.total_s
            self.total_deadline = now + total_s if total_s is not None else None
            self.first_byte_deadline = self.total_deadline if self.total_deadline is not None else math.inf
        else:
            self.total_deadline = None
            self.first_byte_deadline = now + self.timeouts.first_byte_s
        for _ in range(2):  # a second time only when a pooled connection turned out to be closed
            try:
                conn = pool.take(endpoint, loop.time())  # a kept-alive one, without a coroutine
                if conn is None:
                    conn = await pool.connect(endpoint, min(self.timeouts.connect_s,
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
            if self.first_byte_deadline != math.inf:
                # no later than the idle deadline after a first byte could be: that one then needs no timer of its own
                self._arm(min(self.first_byte_deadline, loop.time() + self.timeouts.idle_s))
            pulse = self.pulse
            if pulse is not None:
                pulse.join(self)
            try:
                outcome = await self.future
            finally:
                if self.state != _DONE:  # cancelled: the worker must see the request end
                    self._stop()
                self.client.exchange = None
                if pulse is not None:
                    if self.streaming:
                        self.streaming = False
                        pulse.streams -= 1
                    pulse.leave(self)
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
        if (bad := http.invalid_field(self.headers)) is not None:  # never relayed: the answer is a bad one
            raise HttpParserError(f"an invalid response header {bad[:64]!r}")
        self.status = status
        self.got_head = True
        if self.on_head is not None:
            callback, self.on_head = self.on_head, None
            callback()
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
        is_sse = self.mode == STREAM and index.get(b"content-type", b"").startswith(b"text/event-stream")
        if status >= 500 or status == 429 or (self.resumed and not (is_sse and status == 200)):
            self.state = _ERROR_BODY  # a continuation can only join the client's stream with a stream
        elif is_sse:
            self.sse = True
            self.state = _FIRST
        else:
            self.state = _BUFFER
            self._rearm_idle()

    def on_chunk_header(self) -> None:
        self.bound.start()  # the last chunk's trailers may follow: bounded as a head is

    def on_body(self, body: bytes) -> None:
        self.bound.reading = False
        state = self.state
        if state == _RELAY:
            self.out.append(body)
            if self.on_output is not None:
                self._count_events(body)
        elif state == _FIRST:
            self._commit_relay()
            self.out.append(body)
            if self.on_output is not None:
                self._count_events(body)
        else:
            self.parts.append(body)
            self.size += len(body)
            if state == _BUFFER and self.size > BUFFER_LIMIT:
                self._commit_relay()
                self.out.extend(self.parts)
                self.parts = []
            elif self.size > BUFFER_LIMIT:  # an error answer is read whole: not an endless one
                raise HttpParserError(f"an error body over {BUFFER_LIMIT} bytes")

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            self.bound.start()
            return
        self.complete = True
        # llhttp forgets the connection's flags once this callback returns: ask now
        self.keep_alive = self.parser.should_keep_alive()

    # --- the upstream connection's events -------------------------------------------------------
    def upstream_data(self, data: bytes) -> None:
        state = self.state
        if state == _DONE:
            return
        now = self.loop.time()
        pulse = self.pulse
        if pulse is not None:
            pulse.last_byte = now
            if state == _RELAY and self.sse:
                pulse.observe_gap(now - self.last_activity)
        self.last_activity = now
        try:
            if not feed_bounded(self.parser, self.bound, data):
                self._fail(False, f"a response head over {MAX_RESPONSE_HEAD_BYTES} bytes", bad=True)
                return
        except HttpParserError as exc:
            self._fail(False, f"an unreadable response ({exc.__context__ or exc})", bad=True)
            return
        if self.complete:
            self._finish()
        elif self.out or self.relay.held_head:  # a head alone goes out too: an event stream may be quiet a while
            self.relay.flush(self.out)
            self.out = []
            tracker = self.tracker
            if tracker is not None and tracker.broken is not None and self.state == _RELAY:
                self._fail(False, tracker.broken)

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
            if self.pulse is not None:
                self.pulse.last_byte = self.last_activity
            conn.transport.resume_reading()

    def client_lost(self) -> None:
        if self.state == _DONE:
            return
        self._stop()
        self.future.set_result(Relayed(self.status, self.first_byte_at, client_gone=True))

    def worker_stalled(self, detail: str) -> None:
        """stall.py: the worker sent nothing for its stall threshold; let go of it (it sees the cancel)."""
        if self.state == _DONE:
            return
        self.stall_detail = detail
        self._fail(True, detail)

    # --- deadlines: one timer, re-armed only when it fires early ----------------------------------
    def _arm(self, when: float) -> None:
        self.timer_at = when
        self.timer = self.loop.call_at(when, self._on_timer)

    def _rearm_idle(self) -> None:
        """Leaving the first-byte phase: the idle deadline may come sooner than the armed timer."""
        now = self.last_activity = self.loop.time()
        deadline = now + self.timeouts.idle_s
        if self.timer is not None:
            if self.timer_at <= deadline:  # it fires first and re-arms for what is then due
                return
            self.timer.cancel()
        self._arm(deadline)

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
            if state in (_HEAD, _FIRST) and self.total_deadline is None:
                self._fail(True, f"no answer within {self.timeouts.first_byte_s}s")
            elif self._past_total():
                self._fail(True, f"no whole answer within {self.timeouts.total_s}s")
            else:
                self._fail(True, f"nothing for {idle_s}s")

    def _past_total(self) -> bool:
        return self.total_deadline is not None and self.loop.time() >= self.total_deadline

    def _count_events(self, body: bytes) -> None:
        self.events_seen += body.count(b"\n\n")
        if self.events_seen >= 2:
            callback, self.on_output = self.on_output, None
            callback()  # type: ignore[misc]

    # --- committing to the client and relaying -------------------------------------------------
    def _commit_relay(self) -> None:
        """Send the head now; the body follows as it arrives."""
        self.state = _RELAY
        self.first_byte_at = time.monotonic()
        pulse = self.pulse
        if pulse is not None and self.sse and not self.streaming:
            self.streaming = True
            pulse.streams += 1
        self.relay.commit(self.status, self.headers, self.index, self.close_delimited, self.sse)
        self._rearm_idle()

    def _flush(self, last: bool = False) -> bool:
        """relay.py's flush of what arrived; False when `last` but a tracked stream is not whole."""
        out = self.out
        if out:
            self.out = []
        return self.relay.flush(out, last)

    def _finish(self) -> None:
        """The worker's response is complete: answer the client if not yet done, free the connection."""
        state = self.state
        keep = self.keep_alive and not self.close_delimited and not self.head_request
        conn = self._detach()
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
            if not self._flush(last=True):  # a tracked stream that ended early, or with an error event
                tracker = self.tracker
                self.future.set_result(self.relay.broke(
                    "broken_stream", tracker.broken or "the worker ended the stream before [DONE]", self.status,
                    self.first_byte_at))
                return
            outcome = Relayed(self.status, self.first_byte_at, client_gone=client.closed)
        else:  # _BUFFER or _FIRST: the whole answer at once
            body = b"".join(self.parts)
            self.first_byte_at = time.monotonic()
            self.relay.whole(self.status, self.headers, self.index, body)
            outcome = Relayed(self.status, self.first_byte_at, client_gone=client.closed)
        self.future.set_result(outcome)

    def _fail(self, timed_out: bool, detail: str, bad: bool = False) -> None:
        """The worker failed (closed, sent broken or invalid HTTP, went silent): retry, or end the client's answer."""
        state = self.state
        reused = self.conn is not None and self.conn.reused
        if self.out or self.relay.held_head:
            self._flush()
        self._stop()
        status = self.status
        if self.stall_detail is not None and state != _RELAY:
            outcome: Retryable | Relayed = Retryable("stalled", detail)  # nothing reached the client yet
        elif state == _HEAD:
            if bad:  # nothing of it reached the client: another worker may answer, else the client gets a 502
                outcome = bad_response(detail)
            elif not timed_out and reused and not self.got_head and self.last_activity == 0.0:
                outcome = _STALE
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
            if self.stall_detail is not None:
                reason = "stalled"
            elif timed_out:
                reason = "idle_timeout"
            elif self.tracker is not None and self.tracker.broken is not None:
                reason = "broken_stream"  # an error event or an unreadable one, in a well-framed body
            else:
                reason = "connection_lost"
            outcome = self.relay.broke(reason, detail, status, self.first_byte_at)
        self.future.set_result(outcome)

    def _stop(self) -> None:
        """No more of this exchange: the timer goes, the upstream connection closes (the worker sees it)."""
        conn = self._detach()
        if conn is not None:
            conn.close()

    def _detach(self) -> UpstreamConnection | None:
        """Done: stop the timer and let go of the upstream connection, returned for the caller to keep or close."""
        self.state = _DONE
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        conn, self.conn = self.conn, None
        return conn
